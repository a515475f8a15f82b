"""``status --history``: jobs that only the daemon's state DB still has (ended, gone from Slurm), with
their name, final state and last user-visible event."""

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.backends.simulated import SimulatedSlurm
from slurm_elastic.commands.status import format_table, history_rows, last_events
from slurm_elastic.daemon.config import config_from_dict
from slurm_elastic.daemon.loop import Daemon
from slurm_elastic.daemon.state import StateDB
from slurm_elastic.profiles import load_profile

SPEC = "elastic:min_gpus=1,max_gpus=4,min_batch=128,max_batch=1024,max_local_batch=512,batch=256,profile=cifar10"


def test_history_rows_from_the_decision_log(tmp_path):
    db = StateDB(tmp_path)
    db.log_decision(1, 11, "start", "done", gpus_from=0, gpus_to=2, batch=64)
    db.log_decision(3, 11, "resize", "done", gpus_from=2, gpus_to=4, batch=128)
    db.log_decision(4, 11, "measure", "restart-cost", reason="restart 1", message="restart 1: 3.0 s")
    db.log_decision(4, 12, "requeue-failed", "gave-up", message="max_failures=2 reached")
    db.log_decision(5, 13, "start", "done", gpus_from=0, gpus_to=1, batch=32)
    db.save_job_views([{"job_id": 11, "name": "bert", "user": "ann", "partition": "gpu"},
                       {"job_id": 12, "name": "gpt", "user": "bob", "partition": "gpu"},
                       {"job_id": 13, "name": "vit", "user": "ann", "partition": "gpu"}])
    db.forget_jobs({13}, {11: "COMPLETED"})  # 12 vanished without the daemon seeing its end
    db.close()
    rows = {r["jobid"]: r for r in history_rows(str(tmp_path), active={13})}
    assert set(rows) == {11, 12}  # 13 is still listed by Slurm
    r = rows[11]
    assert (r["gpus"], r["batch"], r["rescales"], r["name"], r["user"], r["state"], r["st"]) == \
        (4, 128, 1, "bert", "ann", "COMPLETED", "CD")
    # The daemon's own measurement is not what a user sees as the last event.
    assert r["reason"] == "last: resize 2->4 GPUs, batch 128: done", r["reason"]
    assert (rows[12]["name"], rows[12]["state"], rows[12]["st"]) == ("gpt", "ENDED", "E")
    assert "gave-up" in rows[12]["reason"] and "max_failures=2" in rows[12]["reason"]
    table = format_table(list(rows.values()), "jobid,name,user,st,gpus,reason")
    assert "bert" in table and " CD " in table and "measure" not in table
    assert history_rows(str(tmp_path / "none"), set()) == []


def test_a_job_requeued_after_it_was_seen_ending_is_no_longer_ended(tmp_path):
    db = StateDB(tmp_path)
    db.save_job_views([{"job_id": 7, "name": "a", "user": "ann", "partition": "gpu"}])
    db.forget_jobs(set(), {7: "FAILED"})
    assert db.ended_jobs()[7]["state"] == "FAILED"
    db.save_job_views([{"job_id": 7, "name": "a", "user": "ann", "partition": "gpu"}])  # pending again
    assert 7 not in db.ended_jobs()
    db.close()


def test_an_old_database_without_the_ended_table_still_shows_history(tmp_path):
    db = StateDB(tmp_path)
    db.log_decision(1, 5, "start", "done", gpus_from=0, gpus_to=2, batch=64)
    db.conn.execute("DROP TABLE ended")
    db.close()
    (row,) = history_rows(str(tmp_path), set())
    assert (row["jobid"], row["name"], row["state"], row["gpus"]) == (5, "-", "ENDED", 2)
    assert last_events([{"job_id": 5, "action": "measure", "status": "x"}]) == {}


class ListsFinished(SimulatedSlurm):
    """The simulator with Slurm's ``include_finished`` listing (squeue shows ended jobs for MinJobAge)."""

    def list_jobs(self, include_finished: bool = False):
        jobs = super().list_jobs()
        if include_finished:
            jobs += [JobRecord(job_id=j.job_id, name=j.name, user=j.user, partition=j.partition, state=j.state,
                               comment=j.comment) for j in self.finished]
        return jobs


def test_the_daemon_records_name_user_and_final_state(tmp_path):
    sim = ListsFinished(nodes=1, gpus_per_node=4)
    model = load_profile("cifar10")
    short = sim.submit(name="short-one", user="ann", gpus_per_node=1, comment=SPEC, total_samples=2e4, model=model)
    sim.submit(name="long-one", user="bob", gpus_per_node=1, comment=SPEC, total_samples=1e9, model=model)
    cfg = config_from_dict({"state_dir": str(tmp_path), "metrics_address": "", "cooldown_s": 0})
    d = Daemon(cfg, backend=sim, ack=sim, clock=lambda: sim.now)
    d.open()
    try:
        for _ in range(200):
            d.cycle()
            sim.advance_to(sim.now + 20)
            if short not in sim.active and short in d.db.ended_jobs():
                break
        ended = d.db.ended_jobs()
    finally:
        d.close()
    assert short not in sim.active
    assert (ended[short]["name"], ended[short]["user"], ended[short]["state"]) == ("short-one", "ann", "COMPLETED")
    (row,) = history_rows(str(tmp_path), set(sim.active))
    assert (row["jobid"], row["name"], row["st"]) == (short, "short-one", "CD")
    assert row["reason"].startswith("last: "), row


def test_an_ended_job_slurm_still_lists_shows_its_last_event_not_the_stale_view(tmp_path, monkeypatch):
    import json

    from click.testing import CliRunner

    import slurm_elastic.backends.cli as cli_backend
    from slurm_elastic.commands.status import status

    db = StateDB(tmp_path)
    db.log_decision(1, 21, "start", "done", gpus_from=0, gpus_to=2, batch=64)
    db.log_decision(2, 21, "measure", "restart-cost", message="restart 1: 3.0 s")
    db.save_job_views([{"job_id": 21, "reason": "kept: gain below restart cost", "name": "a"},
                       {"job_id": 22, "reason": "kept: gain below restart cost", "name": "b"}])
    db.close()
    jobs = [JobRecord(job_id=21, name="a", user="ann", partition="gpu", state="COMPLETED", comment=SPEC),
            JobRecord(job_id=22, name="b", user="ann", partition="gpu", state="RUNNING", comment=SPEC)]

    class Slurm:
        def list_jobs(self, include_finished=False):
            return [j for j in jobs if include_finished or j.state == "RUNNING"]

    monkeypatch.setattr(cli_backend, "CliBackend", Slurm)
    out = CliRunner().invoke(status, ["--history", "--json", "--state-dir", str(tmp_path)])
    assert out.exit_code == 0, out.output
    rows = {r["jobid"]: r for r in json.loads(out.output)["jobs"]}
    assert (rows[21]["st"], rows[21]["reason"]) == ("CD", "last: start 0->2 GPUs, batch 64: done"), rows[21]
    assert rows[22]["reason"] == "kept: gain below restart cost"  # a running job keeps the daemon's view
