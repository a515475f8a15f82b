"""``status --history``: jobs that only the daemon's decision log still has (ended, gone from Slurm)."""

from slurm_elastic.commands.status import format_table, history_rows
from slurm_elastic.daemon.state import StateDB


def test_history_rows_from_the_decision_log(tmp_path):
    db = StateDB(tmp_path)
    db.log_decision(1, 11, "start", "done", gpus_from=0, gpus_to=2, batch=64)
    db.log_decision(3, 11, "resize", "done", gpus_from=2, gpus_to=4, batch=128)
    db.log_decision(4, 12, "requeue-failed", "gave-up", message="max_failures=2 reached")
    db.log_decision(5, 13, "start", "done", gpus_from=0, gpus_to=1, batch=32)
    db.close()
    rows = {r["jobid"]: r for r in history_rows(str(tmp_path), active={13})}
    assert set(rows) == {11, 12}  # 13 is still listed by Slurm
    assert (rows[11]["gpus"], rows[11]["batch"], rows[11]["rescales"], rows[11]["st"]) == (4, 128, 1, "E")
    assert "gave-up" in rows[12]["reason"] and "max_failures=2" in rows[12]["reason"]
    assert "11" in format_table(list(rows.values()))
    assert history_rows(str(tmp_path / "none"), set()) == []
