"""Launch environments: torchrun's variables, inconsistent launches, the rank-0 lock, the launch entry
point's task layout, and the resubmission hint of ``slurm-elastic stop``. Torch-free."""

from __future__ import annotations

import subprocess
import sys

import pytest

from slurm_elastic.commands.launch import task_layout
from slurm_elastic.commands.stop import resubmit_hint
from slurm_elastic.spec import parse_spec
from slurm_elastic.train.lock import CheckpointDirBusy, acquire_rank0_lock, release_rank0_lock
from slurm_elastic.train.slurm_env import LaunchError, SlurmEnv

TR = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2", "MASTER_ADDR": "h",
      "MASTER_PORT": "29500"}


def test_torchrun_variables_are_honoured_alone_and_under_srun():
    e = SlurmEnv.from_environ(TR)
    assert (e.rank, e.world_size, e.local_rank, e.launcher, e.job_id) == (3, 4, 1, "torchrun", None)
    srun = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", **TR}
    e = SlurmEnv.from_environ(srun)
    assert (e.rank, e.world_size, e.launcher, e.job_id) == (3, 4, "torchrun", "9")
    assert SlurmEnv.from_environ({"SLURM_JOB_ID": "9", "SLURM_PROCID": "1", "SLURM_NTASKS": "2",
                                  "SLURM_STEP_ID": "0"}).launcher == "srun"
    assert SlurmEnv.from_environ({}).launcher == "local"


def test_inconsistent_launches_fail_loudly():
    # srun started 2 tasks, each a standalone torchrun of 2: two worlds of 2 instead of one of 4.
    bad = {"SLURM_JOB_ID": "9", "SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0",
           "RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "2"}
    with pytest.raises(LaunchError, match="srun started 2 task"):
        SlurmEnv.from_environ(bad)
    with pytest.raises(LaunchError, match="RANK=4 is not a rank of WORLD_SIZE=4"):
        SlurmEnv.from_environ({**TR, "RANK": "4"})
    with pytest.raises(LaunchError, match="LOCAL_RANK=2"):
        SlurmEnv.from_environ({**TR, "LOCAL_RANK": "2"})


def test_rank0_lock_refuses_a_second_holder_and_is_released(tmp_path):
    fd = acquire_rank0_lock(tmp_path, what="7 via srun")
    code = ("import sys; from slurm_elastic.train.lock import acquire_rank0_lock as a\n"
            f"a({str(tmp_path)!r}, wait_s=0.3)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode != 0 and "another process is already rank 0" in r.stderr and "7 via srun" in r.stderr
    release_rank0_lock(fd)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert issubclass(CheckpointDirBusy, RuntimeError)


def test_launch_layout_follows_this_start():
    assert task_layout({"SLURM_GPUS_ON_NODE": "3", "SLURM_JOB_NUM_NODES": "2", "SLURM_CPUS_ON_NODE": "8"}) == (
        2, 6, ["--ntasks=6", "--ntasks-per-node=3"])
    assert task_layout({"SLURM_JOB_GPUS": "0,1", "SLURM_CPUS_ON_NODE": "1"})[2][-1] == "--overcommit"


def test_resubmit_hint_pins_the_checkpoint_dir_and_stays_a_valid_spec():
    spec = "elastic:min_gpus=1,max_gpus=4,min_batch=8,max_batch=64,max_local_batch=32,ckpt_dir=/s/%j,max_failures=1"
    hint = resubmit_hint(spec, "/s/42")
    assert hint.endswith(",ckpt_dir=/s/42,resume=must") and hint.count("ckpt_dir") == 1
    assert parse_spec(hint).checkpoint_dir(43) == "/s/42" and parse_spec(hint).resume == "must"
    assert resubmit_hint(hint, "/s/42") == hint  # resubmitting twice keeps one of each


def test_runner_installs_the_stop_handler_before_the_script_runs(tmp_path):
    """What `launch` starts under srun: the script sees its own argv and directory, and a USR2 that
    arrives before it imports anything is kept as a stop request instead of killing the task."""
    import subprocess
    import sys

    (tmp_path / "helper.py").write_text("VALUE = 7\n")
    script = tmp_path / "train.py"
    script.write_text(
        "import os, signal, sys\n"
        "import helper\n"
        "os.kill(os.getpid(), signal.SIGUSR2)\n"
        "from slurm_elastic.train.signals import install_stop_handler\n"
        "print(helper.VALUE, sys.argv[1:], install_stop_handler().is_set(), __name__)\n")
    r = subprocess.run([sys.executable, "-m", "slurm_elastic.train.run", str(script), "--n", "3"],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["7", "['--n',", "'3']", "True", "__main__"]
