"""The CLI backend's plumbing with a fake runner (unit level): argv lists, retries, typed errors."""

import json
import subprocess
from pathlib import Path

import pytest

from slurm_elastic.backends.base import JobNotRequeueable, SlurmError, SlurmParseError, SlurmTimeout
from slurm_elastic.backends.cli import CliBackend

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


class FakeRunner:
    """Answers Slurm commands from a script of (predicate, result) and records every argv."""

    def __init__(self, version="22.05.8"):
        self.calls: list[list[str]] = []
        self.version = version
        self.answers: dict[str, list] = {}

    def add(self, tool_and_first_arg: str, *results):
        self.answers.setdefault(tool_and_first_arg, []).extend(results)

    def __call__(self, argv, **kw):
        assert isinstance(argv, list) and "shell" not in kw, "Slurm tools must be called with argv lists"
        self.calls.append(argv)
        tool = argv[0].rsplit("/", 1)[-1]
        if argv[1:] == ["--version"]:
            return subprocess.CompletedProcess(argv, 0, f"slurm {self.version}\n", "")
        key = f"{tool} {argv[1]}" if len(argv) > 1 else tool
        queue = self.answers.get(key) or self.answers.get(tool)
        if not queue:
            return subprocess.CompletedProcess(argv, 0, "", "")
        result = queue.pop(0)
        if isinstance(result, Exception):
            raise result
        rc, out, err = result
        return subprocess.CompletedProcess(argv, rc, out, err)


def backend(runner, **kw):
    return CliBackend(runner=runner, retry_delay=0, **kw)


def squeue_doc(name="squeue_mixed.json"):
    return (FIXTURES / "slurm-22.05" / name).read_text()


def test_reads_jobs_and_filters_finished_ones_on_2205():
    r = FakeRunner()
    doc = json.loads(squeue_doc())
    doc["jobs"][0] = dict(doc["jobs"][0], job_state="COMPLETED")
    r.add("squeue --json", (0, json.dumps(doc), ""))
    jobs = backend(r).list_jobs()
    assert doc["jobs"][0]["job_id"] not in [j.job_id for j in jobs]
    assert len(jobs) == len(doc["jobs"]) - 1


def test_nodes_come_from_sinfo_on_2205_and_scontrol_from_2302():
    r = FakeRunner("22.05.8")
    r.add("sinfo", (0, (FIXTURES / "slurm-22.05" / "nodes_idle.json").read_text(), ""))
    assert len(backend(r).list_nodes()) == 4
    assert r.calls[-2][1:] == ["--json"] and r.calls[-2][0].endswith("sinfo")
    assert r.calls[-1][1:] == ["-o", "show", "reservation"]  # reservations: the same text on every version
    r = FakeRunner("24.11.5")
    r.add("scontrol show", (0, (FIXTURES / "slurm-24.11-reference" / "scontrol_node_2411.json").read_text(), ""))
    assert len(backend(r).list_nodes()) == 2
    assert r.calls[-2][1:] == ["show", "nodes", "--json"]


def test_transient_errors_are_retried_a_bounded_number_of_times():
    r = FakeRunner()
    r.add("squeue --json", (1, "", "squeue: error: Socket timed out on send/recv operation"),
          subprocess.TimeoutExpired(["squeue"], 30), (0, squeue_doc(), ""))
    assert backend(r, retries=3).list_jobs()
    r = FakeRunner()
    r.add("squeue --json", *[(1, "", "slurm_load_jobs error: Socket timed out on send/recv operation")] * 10)
    with pytest.raises(SlurmTimeout) as e:
        backend(r, retries=2).list_jobs()
    assert sum(1 for c in r.calls if c[1:] == ["--json"]) == 3
    assert "Socket timed out" in e.value.stderr and e.value.argv[1:] == ["--json"]


def test_a_failing_scontrol_raises_with_command_and_stderr_without_retry():
    r = FakeRunner()
    r.add("scontrol release", (1, "", "slurm_release_job error: Invalid job id specified\n"))
    with pytest.raises(SlurmError) as e:
        backend(r).release(99)
    assert e.value.returncode == 1 and "Invalid job id" in e.value.stderr
    assert e.value.argv[1:] == ["release", "99"] and "Invalid job id" in str(e.value)
    assert len([c for c in r.calls if "release" in c]) == 1


def test_garbled_or_truncated_json_is_a_parse_error():
    r = FakeRunner()
    r.add("squeue --json", (0, squeue_doc()[:500], ""))
    with pytest.raises(SlurmParseError, match="invalid JSON"):
        backend(r).list_jobs()
    r.add("squeue --json", (0, "[1, 2]", ""))
    with pytest.raises(SlurmParseError):
        backend(r).list_jobs()


def one_job_doc(job_id=5, tres_per_node="gres:gpu:2", partition="gpu"):
    doc = json.loads(squeue_doc())
    doc["jobs"] = [dict(doc["jobs"][0], job_id=job_id, tres_per_node=tres_per_node, partition=partition)]
    return json.dumps(doc)


def test_update_uses_the_version_spelling_and_exact_node_counts():
    r = FakeRunner("22.05.8")
    r.add("squeue --json", (0, one_job_doc(), ""))
    backend(r).update_job(5, gpus_per_node=4, num_nodes=2, num_tasks=8, start_now=True, admin_comment="x=1")
    updates = [c[1:] for c in r.calls if len(c) > 1 and c[1] == "update"]
    assert updates == [["update", "JobId=5", "TresPerNode=gres:gpu:4", "NumNodes=2-2", "NumTasks=8",
                        "MinCPUsNode=4", "NumCPUs=8"],
                       ["update", "JobId=5", "AdminComment=x=1"], ["update", "JobId=5", "StartTime=now"]]
    r = FakeRunner("24.11.5")
    r.add("squeue --json", (0, one_job_doc(), ""))
    backend(r).update_job(5, gpus_per_node=3)
    assert r.calls[-1][-1] == "TresPerNode=gres/gpu:3"


def test_update_pins_partition_and_gpu_type_in_one_update_and_keeps_a_type_it_does_not_change():
    r = FakeRunner("22.05.8")
    r.add("squeue --json", (0, one_job_doc(tres_per_node="gres:gpu:a100:2", partition="a100,v100"), ""))
    b = backend(r)
    b.list_jobs()  # the daemon's cycle read: the job asks for a100
    b.update_job(5, gpus_per_node=4, num_nodes=1)  # a resize without a type keeps the job's a100
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres:gpu:a100:4", "NumNodes=1-1"]
    b.update_job(5, gpus_per_node=8, partition="a100", gpu_type="a100")  # Partition after TresPerNode
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres:gpu:a100:8", "Partition=a100"]
    n = len(r.calls)
    for other in ("", "v100"):  # 22.05 would leave it with no GPU, or pending forever (BadConstraints)
        with pytest.raises(SlurmError, match="cannot move a typed job"):
            b.update_job(5, gpus_per_node=2, gpu_type=other)
    assert len(r.calls) == n
    r = FakeRunner("24.11.5")
    r.add("squeue --json", (0, one_job_doc(tres_per_node="gres/gpu:v100:2"), ""))
    b = backend(r)
    b.update_job(5, partition="a100", gpu_type="a100")  # count unchanged: read from the job
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres/gpu:a100:2", "Partition=a100"]
    b.update_job(5, gpus_per_node=2)  # our own write is remembered: still a100
    assert r.calls[-1][-1] == "TresPerNode=gres/gpu:a100:2"
    b.update_job(5, gpus_per_node=2, gpu_type="")  # 24.11 takes typed -> untyped in one update
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres/gpu:2"]


def test_2205_untyped_to_typed_clears_first_and_restores_untyped_when_slurm_refuses():
    r = FakeRunner("22.05.8")
    r.add("squeue --json", (0, one_job_doc(tres_per_node="gres:gpu:2"), ""))
    b = backend(r)
    b.list_jobs()
    b.update_job(5, gpus_per_node=4, gpu_type="v100", partition="v100")
    assert [c[1:] for c in r.calls[-2:]] == [["update", "JobId=5", "TresPerNode="],
                                           ["update", "JobId=5", "TresPerNode=gres:gpu:v100:4", "Partition=v100"]]
    r = FakeRunner("22.05.8")
    r.add("squeue --json", (0, one_job_doc(tres_per_node="gres:gpu:2"), ""))
    r.add("scontrol update", (0, "", ""), (1, "", "Invalid partition name specified"), (0, "", ""))
    b = backend(r)
    with pytest.raises(SlurmError, match="Invalid partition"):
        b.update_job(5, gpus_per_node=4, gpu_type="v100", partition="nope")
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres:gpu:4"]  # never left without GPUs


def test_hostile_partition_or_gpu_type_is_refused_before_any_call():
    r = FakeRunner()
    b = backend(r)
    for kw in ({"partition": "a100 Nice=-100"}, {"partition": ""}, {"partition": "a;b"},
               {"gpu_type": "a100:8"}, {"gpu_type": "x Partition=root"}, {"gpu_type": 7}, {"partition": ["a"]},
               {"partition": "a100\n"}, {"gpu_type": "a100\n"}):  # "$" alone matches before a final newline
        with pytest.raises(ValueError, match="job 5"):
            b.update_job(5, gpus_per_node=1, **kw)
    assert not [c for c in r.calls if "update" in c]


def test_update_excludes_nodes_in_the_same_update_clears_them_and_refuses_odd_names():
    r = FakeRunner("22.05.8")
    r.add("squeue --json", (0, one_job_doc(), ""))
    b = backend(r)
    b.update_job(5, gpus_per_node=3, num_nodes=1, exclude_nodes=("node3", "node4"))
    assert r.calls[-1][1:] == ["update", "JobId=5", "TresPerNode=gres:gpu:3", "NumNodes=1-1",
                               "ExcNodeList=node3,node4"]
    b.update_job(5, gpus_per_node=3, exclude_nodes=())  # the reservation is over: cleared (seen live)
    assert r.calls[-1][-1] == "ExcNodeList="
    n = len(r.calls)
    for bad in (("node3 Partition=root",), ("",), ("-x",), (7,), ("node3\n",)):
        with pytest.raises(ValueError, match="job 5: exclude_nodes"):
            b.update_job(5, gpus_per_node=1, exclude_nodes=bad)
    assert len(r.calls) == n


def test_a_job_asking_for_two_gpu_types_is_not_resized_into_one():
    r = FakeRunner()
    r.add("squeue --json", (0, one_job_doc(tres_per_node="gres:gpu:a100:1,gres:gpu:v100:1"), ""))
    with pytest.raises(ValueError, match="several GPU types"):
        backend(r).update_job(5, gpus_per_node=2)


def test_hostile_values_never_reach_a_shell_and_bad_ids_are_refused():
    r = FakeRunner()
    b = backend(r)
    b.update_job(5, admin_comment="$(reboot); `id` | x")
    assert r.calls[-1][-1] == "AdminComment=$(reboot); `id` | x"  # one argv element, no shell
    for bad in ("5; rm -rf /", -1, 0, True, 2.5):
        with pytest.raises(ValueError):
            b.release(bad)
    for sig in ("USR2; reboot", "USR2\n"):
        with pytest.raises(ValueError):
            b.signal(5, sig)
    with pytest.raises(ValueError):
        b.update_job(5, admin_comment="two\nlines")


def test_requeue_hold_refuses_a_non_requeueable_job_before_calling_slurm():
    r = FakeRunner()
    doc = json.loads(squeue_doc())
    norq = [j for j in doc["jobs"] if not j["requeue"]][0]
    r.add("squeue --json", (0, json.dumps(doc), ""))
    with pytest.raises(JobNotRequeueable):
        backend(r).requeue_hold(norq["job_id"])
    assert not [c for c in r.calls if "requeuehold" in c]


def test_signal_argv():
    r = FakeRunner()
    backend(r).signal(12, "usr2")
    backend(r).signal(12, "USR2", batch_only=True)
    assert [c[1:] for c in r.calls if c[0].endswith("scancel")] == [["--signal=USR2", "12"],
                                                                     ["--signal=USR2", "--batch", "12"]]


def test_tres_per_job_of_one_job_on_2411_and_not_on_2205():
    doc = json.loads((FIXTURES / "pools-24.11" / "squeue_pools.json").read_text())
    doc["jobs"] = [dict(doc["jobs"][0], tres_per_job="gres/gpu:v100:3")]
    r = FakeRunner("24.11.5")
    r.add("scontrol show", (0, json.dumps(doc), ""), (1, "", "slurm_load_jobs error: Invalid job id specified"))
    b = backend(r)
    assert b.tres_per_job(5) == "gres/gpu:v100:3"
    assert r.calls[-1][1:] == ["show", "job", "5", "--json"]
    assert b.tres_per_job(6) == ""  # ended meanwhile
    with pytest.raises(SlurmError, match="no --json"):
        backend(FakeRunner("22.05.8")).tres_per_job(5)
