"""The pyslurm backend's mapping, retry rules, backend choice and worker protocol, with a fake pyslurm.

The live behaviour (22.05 on the host, 24.11 in the chroot) is in tests/integration/test_cluster_backend.py.
"""

import io
import json
import subprocess
from types import SimpleNamespace

import pytest

from slurm_elastic.backends.base import JobRecord, SlurmError, SlurmParseError, SlurmTimeout
from slurm_elastic.backends.choose import choose_backend, major
from slurm_elastic.backends.cli import CliBackend
from slurm_elastic.backends.pyslurm_backend import PyslurmBackend, gpus_in_gres_dict, job_record, node_record
from slurm_elastic.backends.pyslurm_worker import _decode, _encode, serve


class FakeError(Exception):
    def __init__(self, errno=-1, msg=None):
        super().__init__(msg)
        self.errno, self.msg = errno, msg


def fake_job(**over):
    base = dict(id=7, state="PENDING", allocated_nodes=None, num_nodes=1, gres_per_node={"gpu": 2}, priority=0,
                state_reason="JobHeldAdmin", is_requeueable=True, user_id=0, name="j", partition="gpu",
                comment="elastic:min_gpus=1", admin_comment=None, requeue_count=1, submit_time=100,
                start_time=0, working_directory="/w", resource_sharing="OK", constraints=[], time_limit=None,
                reservation=None, account=None)
    base.update(over)
    return SimpleNamespace(**base)


def test_job_record_matches_the_cli_meaning():
    r = job_record(fake_job())
    assert (r.job_id, r.state, r.held, r.gpus_per_node, r.gpus_total, r.restart_count) == (7, "PENDING", True, 2, 2, 1)
    assert r.user == "root" and r.admin_comment == "" and r.start_time is None and r.work_dir == "/w"
    assert r.account == "" and job_record(fake_job(account="ml-lab")).account == "ml-lab"
    run = job_record(fake_job(state="RUNNING", allocated_nodes="node[1-2]", num_nodes=2, priority=5,
                              state_reason="None", gres_per_node={"gres/gpu": 4}))
    assert run.nodes == ("node1", "node2") and run.gpus_total == 8 and not run.held
    # 22.05 prints only the flag while a requeued job is held: it is pending.
    assert job_record(fake_job(state="REQUEUE_HOLD")).state == "PENDING"
    assert job_record(fake_job(state="COMPLETING")).is_completing


def test_job_and_node_pool_fields_from_pyslurm():
    # Shapes as pyslurm 22.5.3 / 24.11.0 give them (cstr.to_gres_dict keys, job_share_string words).
    r = job_record(fake_job(gres_per_node={"gres/gpu:a100": 2}, resource_sharing="NO", constraints=["a100"],
                            time_limit=30, reservation="maint"))
    assert (r.gpu_type, r.exclusive, r.constraint, r.time_limit_s, r.reservation) == ("a100", True, "a100", 1800, "maint")
    r = job_record(fake_job())
    assert (r.gpu_type, r.exclusive, r.constraint, r.time_limit_s, r.reservation) == ("", False, "", None, "")
    assert job_record(fake_job(time_limit=-5)).time_limit_s is None  # never a negative limit
    assert job_record(fake_job(gres_per_node={"gpu:v100": 1, "gpu:a100": 1})).gpu_type == "a100,v100"
    n = node_record(SimpleNamespace(name="node3", state="MIXED", configured_gres={"gpu:v100": 8},
                                    allocated_gres={"gpu:v100": 3}, total_cpus=8, partitions=["v100"],
                                    active_features=["v100", "ib"]))
    assert (n.gpu_type, n.features, n.gpus_total, n.gpus_used) == ("v100", ("v100", "ib"), 8, 3)


def test_bad_values_from_pyslurm_name_the_job_and_field():
    with pytest.raises(SlurmParseError, match="job 7: priority"):
        job_record(fake_job(priority="high"))
    with pytest.raises(SlurmParseError, match="job 7: tres_per_node"):
        job_record(fake_job(gres_per_node={"gpu": -1}))
    with pytest.raises(SlurmParseError, match="valid id"):
        job_record(fake_job(id=0))
    with pytest.raises(SlurmParseError, match="job 7: account"):
        job_record(fake_job(account=5))


def test_gres_dicts_of_both_versions():
    assert gpus_in_gres_dict({"gpu": {"count": 3, "indexes": "0-2"}}, what="x") == 3
    assert gpus_in_gres_dict({"gpu:a100": 2, "gpu:v100": 1, "shard": 8}, what="x") == 3
    assert gpus_in_gres_dict({}, what="x") == 0
    n = node_record(SimpleNamespace(name="node1", state="IDLE+DRAIN", configured_gres={"gpu": 4},
                                    allocated_gres={"gpu": 1}, total_cpus=8, partitions=["gpu"], active_features=[]))
    assert (n.state, n.state_flags, n.gpus_total, n.gpus_used, n.usable) == ("IDLE", ("DRAIN",), 4, 1, False)


class NoCli:
    """The CLI half a list_jobs needs: it only remembers the GPU types read."""

    def remember_gpu_types(self, jobs):
        self.types = {j.job_id: j.gpu_type for j in jobs}


class FakePyslurm:
    PyslurmError = FakeError
    RPCError = FakeError

    def __init__(self, failures):
        self.failures = list(failures)
        self.calls = 0
        outer = self

        class Jobs:
            @staticmethod
            def load():
                outer.calls += 1
                if outer.failures:
                    raise outer.failures.pop(0)
                return {7: fake_job()}

        self.Jobs = Jobs


def test_transient_rpc_errors_are_retried_then_typed():
    fake = FakePyslurm([FakeError(1, "Zero Bytes were transmitted or received")])
    b = PyslurmBackend(module=fake, cli=NoCli(), retries=3, retry_delay=0)
    assert [j.job_id for j in b.list_jobs()] == [7] and fake.calls == 2
    # libslurm already retried the connection for MessageTimeout seconds: no second round.
    fake = FakePyslurm([FakeError(1, "Unable to contact slurm controller (connect failure)")])
    with pytest.raises(SlurmTimeout, match="unreachable"):
        PyslurmBackend(module=fake, cli=NoCli(), retries=3, retry_delay=0).list_jobs()
    assert fake.calls == 1
    fake = FakePyslurm([FakeError(1, "Socket timed out on send/recv operation")] * 4)
    with pytest.raises(SlurmTimeout, match="transiently"):
        PyslurmBackend(module=fake, cli=NoCli(), retries=3, retry_delay=0).list_jobs()
    assert fake.calls == 4
    fake = FakePyslurm([FakeError(2017, "Invalid job id specified")])
    with pytest.raises(SlurmError) as e:
        PyslurmBackend(module=fake, cli=NoCli(), retries=3, retry_delay=0).list_jobs()
    assert fake.calls == 1 and e.value.returncode == 2017 and "Invalid job id" in e.value.stderr


class FakeCli:
    retries, retry_delay = 3, 1.0

    def __init__(self, version="22.05.8"):
        self._v = version

    def version(self):
        return self._v


def test_choice_auto_cli_pyslurm():
    made = []
    factory = made.append
    cli = FakeCli()
    b, why = choose_backend("auto", cli, probe=lambda: ("22.5.3", ""), factory=lambda c: "PY")
    assert b == "PY" and "matches Slurm 22.05.8" in why
    b, why = choose_backend("auto", cli, probe=lambda: ("24.11.0", ""), factory=factory)
    assert b is cli and "built for another Slurm" in why and not made
    b, why = choose_backend("auto", cli, probe=lambda: (None, "'import pyslurm' fails: No module"), factory=factory)
    assert b is cli and "No module" in why
    assert choose_backend("cli", cli, probe=lambda: 1 / 0)[0] is cli  # never probed
    with pytest.raises(SlurmError, match="cannot be used.*another Slurm"):
        choose_backend("pyslurm", cli, probe=lambda: ("24.11.0", ""), factory=factory)
    with pytest.raises(ValueError):
        choose_backend("grpc", cli)
    assert major("22.5.3") == major("22.05.8") == (22, 5) and major("24.11.0") != major("25.11.1")


def test_worker_protocol_round_trips_records_and_typed_errors():
    rec = job_record(fake_job())
    assert _decode(json.loads(json.dumps(_encode([rec])))) == [rec]

    class B:
        def list_jobs(self, include_finished=False):
            return [rec]

        def release(self, job_id):
            raise SlurmTimeout("slow", argv=["pyslurm", "release"], stderr="Socket timed out")

    out = io.StringIO()
    serve(B(), io.StringIO('{"call": "list_jobs"}\n{"call": "release", "args": [3]}\n{"call": "rm"}\n'), out)
    answers = [json.loads(x) for x in out.getvalue().splitlines()]
    assert isinstance(_decode(answers[0]["ok"])[0], JobRecord)
    assert answers[1]["error"]["type"] == "SlurmTimeout" and answers[1]["error"]["stderr"] == "Socket timed out"
    assert answers[2]["error"]["type"] == "ValueError"


def test_config_backend_key():
    from slurm_elastic.daemon.config import ConfigError, config_from_dict

    assert config_from_dict({}).backend == "auto"  # issue 22: the fast backend wherever it works
    assert config_from_dict({"backend": "cli"}).backend == "cli"
    assert config_from_dict({"backend": "auto"}).backend == "auto"
    with pytest.raises(ConfigError, match="backend must be one of auto, cli, pyslurm"):
        config_from_dict({"backend": "grpc"})


def test_gpus_per_job_come_from_the_old_api_once_per_job():
    """``--gpus=N`` (tres_per_job) is not in pyslurm's typed API: read once per job, as the CLI reads it."""
    class Old:
        loads = []

        def find_id(self, jid):
            Old.loads.append(jid)
            if jid == "9":
                raise ValueError("Invalid job id specified", 2017)
            return [{"tres_per_job": {"7": "gres/gpu:v100:6", "8": ""}[jid]}]

    jobs = {7: fake_job(gres_per_node={}, num_nodes=2, priority=5, state_reason="Resources"),
            8: fake_job(id=8, gres_per_node={}, priority=5),
            9: fake_job(id=9, gres_per_node={}, priority=5),
            10: fake_job(id=10, gres_per_node={"gpu": 1})}
    fake = SimpleNamespace(PyslurmError=FakeError, RPCError=FakeError, job=Old, __version__="22.5.3",
                           Jobs=SimpleNamespace(load=lambda: jobs))
    b = PyslurmBackend(module=fake, cli=NoCli(), retries=0, retry_delay=0)
    for _ in range(2):
        recs = {j.job_id: j for j in b.list_jobs()}
        assert (recs[7].gpus_per_node, recs[7].gpus_total, recs[7].gpu_type) == (3, 6, "v100")
        assert recs[8].gpus_total == 0 and recs[9].gpus_total == 0 and recs[10].gpus_per_node == 1
    assert sorted(Old.loads) == ["7", "8", "9"]  # once per job; never for a job with GPUs per node


def test_a_failing_old_api_read_is_a_typed_error_not_zero_gpus():
    class Old:
        def find_id(self, jid):
            raise ValueError("Socket timed out on send/recv operation", 5004)

    fake = SimpleNamespace(PyslurmError=FakeError, RPCError=FakeError, job=Old, __version__="22.5.3",
                           Jobs=SimpleNamespace(load=lambda: {7: fake_job(gres_per_node={})}))
    with pytest.raises(SlurmTimeout):
        PyslurmBackend(module=fake, cli=NoCli(), retries=1, retry_delay=0).list_jobs()


def test_gpus_per_job_through_the_cli_on_pyslurm_24():
    class Cli(NoCli):
        asked = []

        def tres_per_job(self, jid):
            Cli.asked.append(jid)
            return "gres/gpu:4"

    fake = SimpleNamespace(PyslurmError=FakeError, RPCError=FakeError, __version__="24.11.0",
                           Jobs=SimpleNamespace(load=lambda: {7: fake_job(gres_per_node={}, num_nodes=2)}))
    b = PyslurmBackend(module=fake, cli=Cli(), retries=0, retry_delay=0)
    for _ in range(2):
        (rec,) = b.list_jobs()
        assert (rec.gpus_per_node, rec.gpus_total, rec.gpu_type) == (2, 4, "")
    assert Cli.asked == [7]


def test_default_backend_survives_a_bad_slurm_conf(tmp_path, monkeypatch, caplog):
    """The default ("auto") probes ``import pyslurm`` in a child: with a SLURM_CONF that libslurm cannot
    read (which exits the importing process), this process lives on, takes the CLI and logs why."""
    import logging

    from slurm_elastic.backends.choose import make_backend
    from slurm_elastic.daemon.config import config_from_dict

    bad = tmp_path / "slurm.conf"
    bad.write_text("Bogus=\n")  # a missing file would make libslurm try DNS (configless) for a minute first
    monkeypatch.setenv("SLURM_CONF", str(bad))
    cfg = config_from_dict({"slurm_bin": str(tmp_path)})  # no scontrol there either
    with caplog.at_level(logging.INFO, logger="slurm_elastic.daemon"):
        backend = make_backend(cfg)
    assert isinstance(backend, CliBackend)
    assert cfg.backend == "auto"
    line = [r.getMessage() for r in caplog.records if r.getMessage().startswith("backend: cli")]
    assert line and "auto" in line[0] and "using the CLI because" in line[0], caplog.text


def test_probe_fails_fast_naming_a_missing_slurm_conf(tmp_path, monkeypatch):
    """A SLURM_CONF naming no file is refused before the child starts (libslurm would retry it for 60 s):
    the reason names the variable and the path; ``auto`` and ``pyslurm`` fail with it at once."""
    from slurm_elastic.backends import choose

    def no_child(*a, **k):
        raise AssertionError("the probe started a child for a SLURM_CONF that names no file")

    monkeypatch.setattr(choose.subprocess, "run", no_child)
    gone = tmp_path / "etc" / "slurm.conf"
    version, why = choose.probe_pyslurm(env={"SLURM_CONF": str(gone)})
    assert version is None and f"SLURM_CONF={gone} does not exist" in why and "60 s" in why
    version, why = choose.probe_pyslurm(env={"SLURM_CONF": str(tmp_path)})
    assert version is None and "is not a file" in why
    assert "empty" in choose.probe_pyslurm(env={"SLURM_CONF": ""})[1]
    cli = CliBackend(bin_dir=str(tmp_path), env={"SLURM_CONF": str(gone)})
    for kind in ("auto", "pyslurm"):  # the CLI's scontrol would wait as long on every call: no fallback
        with pytest.raises(SlurmError, match=f'backend = "{kind}" cannot be used: SLURM_CONF=.* does not exist'):
            choose.choose_backend(kind, cli)
    assert choose.choose_backend("cli", cli)[0] is cli  # asked for by name: its own errors say it
    # an existing file (or none set) still goes to the child, which is what decides
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=x\n")
    calls = []
    monkeypatch.setattr(choose.subprocess, "run", lambda argv, **k: calls.append(k["env"]) or
                        subprocess.CompletedProcess(argv, 1, "", "boom"))
    assert choose.probe_pyslurm(env={"SLURM_CONF": str(conf)}) == (None, "'import pyslurm' fails: boom")
    assert choose.probe_pyslurm(env={}) == (None, "'import pyslurm' fails: boom")
    assert calls[0]["SLURM_CONF"] == str(conf) and "SLURM_CONF" not in calls[1]
