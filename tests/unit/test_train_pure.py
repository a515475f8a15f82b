"""The torch-free parts of slurm_elastic.train: hostlists, the job record, the assignment, lr scaling,
the protocol files, and that the package does not pull torch into the daemon."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap

import pytest

from slurm_elastic.spec import Decision, SpecError
from slurm_elastic.train.assignment import AssignmentError, resolve_assignment
from slurm_elastic.train.hostlist import HostlistError, expand_hostlist, first_host
from slurm_elastic.train.lr import LRScaler
from slurm_elastic.train.protocol import (
    ack_path,
    atomic_write_json,
    merge_throughput,
    read_ack,
    read_throughput,
)
from slurm_elastic.train.slurm_env import JobRecordError, SlurmEnv, parse_scontrol_show_job, read_job_record

# `scontrol show job 1` from Slurm 22.05.8 on the local cluster (Comment on its own line, trailing
# space), with an AdminComment line as root's `scontrol update AdminComment=` adds it.
SCONTROL_2205 = """JobId=1 JobName=env.sh
   UserId=root(0) GroupId=root(0) MCS_label=N/A
   Priority=4294901759 Nice=0 Account=(null) QOS=(null)
   JobState=RUNNING Reason=None Dependency=(null)
   Requeue=1 Restarts=0 BatchFlag=1 Reboot=0 ExitCode=0:0
   Partition=gpu AllocNode:Sid=localhost:3411
   NodeList=node1
   NumNodes=1 NumCPUs=1 NumTasks=1 CPUs/Task=1 ReqB:S:C:T=0:0:*:*
   Command=/tmp/dev/jobs/env.sh
   WorkDir=/tmp/dev
   AdminComment=elastic-decision:gpus=2,nodes=1,batch=64,local_batch=32,accum=1,seq=4{sp}
   Comment=elastic:min_gpus=1,max_gpus=8,min_batch=8,max_batch=96,max_local_batch=24{sp}
   StdErr=/tmp/dev/jobs/env.1.out
   TresPerNode=gres:gpu:2

""".format(sp=" ")
SPEC = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=512,max_local_batch=64,batch=128,max_accum=4"


@pytest.mark.parametrize(
    "expr, hosts",
    [
        ("node1", ["node1"]),
        ("node[1-3]", ["node1", "node2", "node3"]),
        ("node[1-2,5],gpu07", ["node1", "node2", "node5", "gpu07"]),
        ("n[08-11]", ["n08", "n09", "n10", "n11"]),
        ("r[1-2]n[1-2]", ["r1n1", "r1n2", "r2n1", "r2n2"]),
        ("a-[01-02]-b,c", ["a-01-b", "a-02-b", "c"]),
    ],
)
def test_expand_hostlist(expr, hosts):
    assert expand_hostlist(expr) == hosts
    assert first_host(expr) == hosts[0]


@pytest.mark.parametrize("expr", ["", "node[1-", "node]1[", "node[3-1]", "node[a-b]", "n[[1]]"])
def test_bad_hostlists_are_rejected(expr):
    with pytest.raises(HostlistError):
        expand_hostlist(expr)


def test_slurm_env_from_srun_variables():
    env = {"SLURM_JOB_ID": "42", "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NTASKS": "6",
           "SLURM_STEP_NODELIST": "node[2-3]", "SLURM_STEP_NUM_NODES": "2", "SLURM_RESTART_COUNT": "3",
           "SLURM_STEP_ID": "0"}
    s = SlurmEnv.from_environ(env)
    assert (s.job_id, s.rank, s.local_rank, s.world_size, s.num_nodes, s.restart_count) == ("42", 5, 1, 6, 2, 3)
    assert s.nodes == ("node2", "node3") and s.first_node == "node2"
    local = SlurmEnv.from_environ({})
    assert (local.job_id, local.rank, local.world_size, local.in_slurm) == (None, 0, 1, False)
    with pytest.raises(ValueError, match="SLURM_PROCID=6"):
        SlurmEnv.from_environ({"SLURM_PROCID": "6", "SLURM_NTASKS": "6"})


def test_parse_scontrol_multiline_and_one_liner():
    rec = parse_scontrol_show_job(SCONTROL_2205)
    assert rec["JobId"] == "1" and rec["JobState"] == "RUNNING" and rec["NumNodes"] == "1"
    assert rec["Comment"] == "elastic:min_gpus=1,max_gpus=8,min_batch=8,max_batch=96,max_local_batch=24"
    assert rec["AdminComment"].startswith("elastic-decision:gpus=2,") and rec["AdminComment"].endswith("seq=4")
    one = " ".join(line.strip() for line in SCONTROL_2205.splitlines() if line.strip())
    rec1 = parse_scontrol_show_job(one)
    assert rec1["Comment"] == rec["Comment"] and rec1["AdminComment"] == rec["AdminComment"]
    # A comment with spaces survives in the multi-line form.
    spaced = SCONTROL_2205.replace("max_local_batch=24 \n", "max_local_batch=24, batch=16 \n")
    assert parse_scontrol_show_job(spaced)["Comment"].endswith("max_local_batch=24, batch=16")


def _fake_tool(tmp_path, name: str, body: str) -> None:
    p = tmp_path / name
    p.write_text(f"#!{sys.executable}\n" + textwrap.dedent(body))
    p.chmod(0o755)


def test_read_job_record_through_scontrol_and_squeue_fallback(tmp_path):
    (tmp_path / "rec.txt").write_text(SCONTROL_2205)
    _fake_tool(tmp_path, "scontrol", f"""
        import sys
        assert sys.argv[1:] == ["show", "job", "1"], sys.argv
        print(open({str(tmp_path / 'rec.txt')!r}).read())
    """)
    env = {"PATH": f"{tmp_path}"}
    rec = read_job_record(1, env=env)
    assert rec.source == "scontrol" and rec.admin_comment.endswith("seq=4")
    # scontrol fails -> squeue --json (22.05 lists every job; filter here).
    _fake_tool(tmp_path, "scontrol", "import sys; sys.exit(1)\n")
    _fake_tool(tmp_path, "squeue", """
        import json
        print(json.dumps({"jobs": [{"job_id": 9, "comment": "x", "admin_comment": ""},
                                   {"job_id": 1, "comment": "elastic:c", "admin_comment": "elastic-decision:d"}]}))
    """)
    rec = read_job_record("1", env=env)
    assert (rec.source, rec.comment, rec.admin_comment) == ("squeue-json", "elastic:c", "elastic-decision:d")
    with pytest.raises(JobRecordError, match="job 2"):
        read_job_record(2, env=env)
    with pytest.raises(JobRecordError, match="not a Slurm job id"):
        read_job_record("1; rm -rf /", env=env)


def test_assignment_without_decision_uses_the_spec_batch():
    a = resolve_assignment(job_id=5, world_size=4, num_nodes=1, comment=SPEC, admin_comment="")
    assert (a.global_batch, a.local_batch, a.accum, a.source) == (128, 32, 1, "spec")
    a = resolve_assignment(job_id=5, world_size=1, comment=SPEC, admin_comment=None)
    assert (a.local_batch, a.accum) == (64, 2)  # 128 > max_local_batch 64: accumulate


def test_assignment_from_a_consistent_decision():
    d = Decision(gpus=8, nodes=2, batch=256, local_batch=16, accum=2, seq=9)
    a = resolve_assignment(job_id=5, world_size=8, num_nodes=2, comment=SPEC, admin_comment=d.to_admin_comment())
    assert (a.global_batch, a.local_batch, a.accum, a.source, a.seq) == (256, 16, 2, "decision", 9)


@pytest.mark.parametrize(
    "decision, world, nodes, field",
    [
        (Decision(gpus=4, nodes=1, batch=128, local_batch=32), 2, 1, "admin_comment.gpus"),
        (Decision(gpus=4, nodes=2, batch=128, local_batch=32), 4, 1, "admin_comment.nodes"),
        (Decision(gpus=4, nodes=1, batch=1024, local_batch=64, accum=4), 4, 1, "admin_comment.batch"),
        (Decision(gpus=1, nodes=1, batch=128, local_batch=128), 1, 1, "admin_comment.local_batch"),
        (Decision(gpus=1, nodes=1, batch=256, local_batch=32, accum=8), 1, 1, "admin_comment.accum"),
        (Decision(gpus=16, nodes=2, batch=256, local_batch=16), 16, 2, "admin_comment.gpus"),
    ],
)
def test_inconsistent_decision_fails_naming_job_and_field(decision, world, nodes, field):
    with pytest.raises(AssignmentError) as e:
        resolve_assignment(job_id=77, world_size=world, num_nodes=nodes, comment=SPEC,
                           admin_comment=decision.to_admin_comment())
    assert e.value.job_id == 77 and e.value.field == field
    assert "job 77" in str(e.value) and field in str(e.value)


def test_assignment_errors_without_spec_or_batch():
    with pytest.raises(SpecError, match="admin_comment"):
        resolve_assignment(job_id=3, world_size=1, comment="", admin_comment="elastic-decision:gpus=x")
    with pytest.raises(AssignmentError, match="no elastic spec"):
        resolve_assignment(job_id=3, world_size=1, comment="", admin_comment="")
    with pytest.raises(AssignmentError, match="cannot run on 3 tasks"):
        resolve_assignment(job_id=3, world_size=3, comment=SPEC, admin_comment="")
    a = resolve_assignment(job_id=None, world_size=2, default_batch=100, max_local_batch=20)
    assert (a.global_batch, a.local_batch, a.accum, a.source) == (100, 10, 5, "default")


def test_lr_linear_ramps_up_after_an_increase_and_drops_at_once():
    s = LRScaler("linear", base_batch=128, warmup_samples=1000)
    s.set_batch(128, 0)
    assert s.factor(0) == 1.0
    s.set_batch(512, 5000)  # 4x batch: ramp 1 -> 4 over 1000 samples
    assert s.factor(5000) == 1.0 and s.factor(5500) == pytest.approx(2.5) and s.factor(6000) == 4.0
    state = json.loads(json.dumps(s.state_dict()))  # mid-ramp state survives a checkpoint
    t = LRScaler("linear", base_batch=128, warmup_samples=1000)
    t.load_state_dict(state)
    assert t.factor(5750) == pytest.approx(3.25)
    t.set_batch(256, 5750)  # decrease below the current factor: immediate
    assert t.factor(5750) == 2.0 and t.factor(99999) == 2.0
    sq = LRScaler("sqrt", base_batch=100)
    sq.set_batch(400, 0)
    assert sq.factor(0) == 2.0
    none = LRScaler("none", base_batch=100)
    none.set_batch(400, 0)
    assert none.factor(123) == 1.0
    with pytest.raises(ValueError):
        LRScaler("cubic", base_batch=1)
    assert math.isclose(LRScaler("sqrt", base_batch=2).target(8), 2.0)


def test_protocol_files(tmp_path):
    assert read_ack(tmp_path, 5, 0) is None
    atomic_write_json(ack_path(tmp_path, 5, 0), {"job_id": "5", "restart_count": 0, "samples_seen": 10})
    assert read_ack(tmp_path, 5, 0)["samples_seen"] == 10
    assert read_ack(tmp_path, 5, 1) is None  # another start's ack is not this one's
    assert oct(os.stat(ack_path(tmp_path, 5, 0)).st_mode & 0o777) in ("0o644", "0o664", "0o666")
    merge_throughput(tmp_path, 5, 2, 64, samples=640, seconds=2.0, steps=10)
    merge_throughput(tmp_path, 5, 2, 64, samples=640, seconds=6.0, steps=10)
    merge_throughput(tmp_path, 5, 4, 128, samples=1280, seconds=2.0, steps=10)
    pts = {(p["gpus"], p["batch"]): p for p in read_throughput(tmp_path)}
    assert pts[(2, 64)]["samples_per_s"] == pytest.approx(1280 / 8.0) and pts[(2, 64)]["steps"] == 20
    assert pts[(4, 128)]["samples_per_s"] == pytest.approx(640.0)
    assert merge_throughput(tmp_path, 5, 1, 8, samples=0, seconds=1.0, steps=0) is None
    assert not list(tmp_path.glob(".*.tmp"))


def test_daemon_side_imports_do_not_import_torch():
    code = ("import sys, slurm_elastic, slurm_elastic.spec, slurm_elastic.train, slurm_elastic.train.protocol, "
            "slurm_elastic.train.assignment, slurm_elastic.train.slurm_env, slurm_elastic.train.lr; "
            "from slurm_elastic.train import read_ack, read_throughput, EXIT_CHECKPOINTED; "
            "print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "False"


EXITING_TASK = """
import os, sys, time
from slurm_elastic.train.signals import install_stop_handler
flag = install_stop_handler()
if sys.argv[1] == "quiesce":
    flag.quiesce()
sys.stdout.write("ready\\n"); sys.stdout.flush()
time.sleep(0.3)
"""


def test_a_repeated_stop_signal_cannot_kill_an_exiting_task():
    # At interpreter shutdown CPython resets Python-handled signals to SIG_DFL, so a USR2 sent while
    # the task exits would end it with signal 12 (the job then fails instead of exiting 75).
    import signal as _signal

    codes = []
    for _ in range(3):
        p = subprocess.Popen([sys.executable, "-c", EXITING_TASK, "quiesce"], stdout=subprocess.PIPE, text=True)
        assert p.stdout.readline() == "ready\n"
        while p.poll() is None:
            try:
                os.kill(p.pid, _signal.SIGUSR2)
            except ProcessLookupError:
                break
        codes.append(p.wait(timeout=30))
    assert codes == [0, 0, 0]


def test_checkpoint_dir_is_where_the_daemon_reads():
    from slurm_elastic.train.ckptdir import checkpoint_dir

    spec = "elastic:min_gpus=1,max_gpus=8,min_batch=32,max_batch=256,max_local_batch=32"
    assert checkpoint_dir("12", "/work/u", spec) == "/work/u/elastic-ckpt/12"
    assert checkpoint_dir("12", "/work/u", spec + ",ckpt_dir=/scratch/%j/ck") == "/scratch/12/ck"
    assert checkpoint_dir("12", "/work/u/", "not elastic") == "/work/u/elastic-ckpt/12"
