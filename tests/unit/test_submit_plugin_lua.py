"""The submit plugin's Lua validator agrees with the Python spec parser (differential, with hypothesis).

The daemon re-validates every cycle with the Python parser; the plugin rejects at submit time. If the
two disagreed, a job could be accepted and held but never placed (or rejected needlessly).
"""

import shutil
import subprocess
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from slurm_elastic.spec import SpecError, parse_spec

PLUGIN = Path(__file__).resolve().parents[2] / "plugins" / "job_submit_elastic.lua"
LUA = shutil.which("lua5.1")
pytestmark = pytest.mark.skipif(LUA is None, reason="lua5.1 is not installed (apt-get install lua5.1)")

HARNESS = r"""
slurm = {SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294,
         log_user = function(...) end, log_info = function(...) end, log_error = function(...) end}
dofile(PLUGIN_PATH)
for line in io.lines() do
  local err = elastic_spec_error(line)
  if err == nil then print("OK") else print("ERR " .. (string.match(err, "field '([^']*)'") or "?")) end
end
"""


def lua_verdicts(comments):
    proc = subprocess.run([LUA, "-e", HARNESS.replace("PLUGIN_PATH", repr(str(PLUGIN)))], input="\n".join(comments) + "\n",
                          capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.splitlines()


def py_verdict(comment):
    try:
        parse_spec(comment)
        return "OK"
    except SpecError as e:
        return f"ERR {e.field}"


BASE = "elastic:min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512"
EXAMPLES = [
    BASE,
    BASE + ",batch=256,gpus=2,profile=cifar10,weight=2.5,max_accum=4,points=1x256@100|2x256@190.5",
    BASE + ",ckpt_dir=/scratch/%j/ckpt",
    BASE + ",colour=blue",
    BASE.replace("min_gpus=1", "min_gpus=9"),
    BASE + ",weight=0",
    "elastic:min_gpus=3,max_gpus=3,min_batch=100,max_batch=101,max_local_batch=512",
    "elastic:min_gpus=1,max_gpus=1,min_batch=1024,max_batch=1024,max_local_batch=256,max_accum=4",
    BASE + ",ckpt_dir=/a/../b",
    BASE + ",profile=$(id)",
    # Found by tests/faults: the plugin accepted points the daemon rejects (then the job waits held forever).
    BASE + ",points=1x64@1e400",
    BASE + ",points=1x1000000000000000000@5",
    BASE + ",points=1x256@0|2x256@5",
    BASE + ",points=2000000x256@5",
    BASE + ",weight=1e0001",
    BASE + ",max_failures=0",
    BASE + ",max_failures=2",
    BASE + ",max_failures=100",
    BASE + ",max_failures=101",
    BASE + ",max_failures=-1",
    BASE + ",max_failures=0002",
    BASE + ",max_failures=1.0",
]


def test_known_examples_agree():
    assert lua_verdicts(EXAMPLES) == [py_verdict(c) for c in EXAMPLES]
    assert lua_verdicts(EXAMPLES)[:3] == ["OK", "OK", "OK"]


KEYS = ["min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch", "batch", "gpus", "weight",
        "max_accum", "gpus_per_node", "min_local_batch", "profile", "ckpt_dir", "max_failures"]
value = st.one_of(st.integers(0, 5000).map(str), st.sampled_from(["x", "1.5", "", "/t/%j", "cifar10", "2e3"]))
spec_text = st.dictionaries(st.sampled_from(KEYS), value, min_size=3, max_size=9).map(
    lambda d: "elastic:" + ",".join(f"{k}={v}" for k, v in d.items()))


@settings(max_examples=60, deadline=None)
@given(st.lists(spec_text, min_size=20, max_size=20))
def test_lua_and_python_accept_and_reject_the_same_specs(comments):
    lua = lua_verdicts(comments)
    py = [py_verdict(c) for c in comments]
    for c, a, b in zip(comments, lua, py, strict=True):
        assert (a == "OK") == (b == "OK"), (c, a, b)
