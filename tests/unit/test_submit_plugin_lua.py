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
    # pace= (emulated GPUs): a profile name, refused with the same rule as profile=
    BASE + ",pace=cifar10",
    BASE + ",pace=$(id)",
    BASE + ",pace=",
    # Found by tests/faults: the plugin accepted points the daemon rejects (then the job waits held forever).
    BASE + ",points=1x64@1e400",
    BASE + ",points=1x1000000000000000000@5",
    # ckpt_dir in a system directory (issue 11): refused by both, naming ckpt_dir.
    *(BASE + f",ckpt_dir={d}" for d in ("/", "/etc", "/etc/x", "/usr/lib", "/lib64/x", "/var/lib/slurm-elastic/%j",
                                         "/var/lib/slurmd", "/proc/1", "/dev", "//etc", "/./etc/x", "/run/user/1")),
    *(BASE + f",ckpt_dir={d}" for d in ("/etcx", "/home/u/ck", "/var/lib/other/%j", "/scratch/lib")),
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
    # issue 23: per-type per-GPU batch limits
    BASE + ",local_batch_by_type=t4:128|rtx:256",
    BASE + ",local_batch_by_type=t4:1024",
    BASE + ",min_local_batch=64,local_batch_by_type=t4:32",
    BASE + ",local_batch_by_type=t4:128|t4:64",
    BASE + ",local_batch_by_type=t4:0",
    BASE + ",local_batch_by_type=t4",
    BASE + ",local_batch_by_type=t4:12|",
    BASE + ",local_batch_by_type=" + "|".join(f"g{i}:8" for i in range(17)),
    # issue 21: resume=must (stop's resubmit line) and its refusals
    BASE + ",resume=must",
    BASE + ",resume=auto",
    BASE + ",resume=MUST",
    BASE + ",resume=",
]


def test_known_examples_agree():
    assert lua_verdicts(EXAMPLES) == [py_verdict(c) for c in EXAMPLES]
    assert lua_verdicts(EXAMPLES)[:3] == ["OK", "OK", "OK"]


KEYS = ["min_gpus", "max_gpus", "min_batch", "max_batch", "max_local_batch", "batch", "gpus", "weight",
        "max_accum", "gpus_per_node", "min_local_batch", "profile", "pace", "ckpt_dir", "max_failures", "local_batch_by_type",
        "resume"]
value = st.one_of(st.integers(0, 5000).map(str), st.sampled_from(["x", "1.5", "", "/t/%j", "cifar10", "2e3",
                                                                    "t4:16", "t4:16|a100:600", "t4:0", "must", "auto"]))
spec_text = st.dictionaries(st.sampled_from(KEYS), value, min_size=3, max_size=9).map(
    lambda d: "elastic:" + ",".join(f"{k}={v}" for k, v in d.items()))


@settings(max_examples=60, deadline=None)
@given(st.lists(spec_text, min_size=20, max_size=20))
def test_lua_and_python_accept_and_reject_the_same_specs(comments):
    lua = lua_verdicts(comments)
    py = [py_verdict(c) for c in comments]
    for c, a, b in zip(comments, lua, py, strict=True):
        assert (a == "OK") == (b == "OK"), (c, a, b)


# ----- the prefix rule: one definition of "elastic" (spec.comment_kind and the plugin's comment_kind) -----
KIND_HARNESS = r"""
slurm = {SUCCESS = 0, ERROR = -1, NO_VAL = 4294967294,
         log_user = function(...) end, log_info = function(...) end, log_error = function(...) end}
dofile(PLUGIN_PATH)
for line in io.lines() do
  local s = string.gsub(line, "%x%x", function(h) return string.char(tonumber(h, 16)) end)
  local err = nil
  if is_elastic_comment(s) then err = elastic_spec_error(s) end
  print(comment_kind_of(s) .. " " .. (err == nil and "OK" or "ERR"))
end
"""


def lua_kinds(comments):
    lines = [c.encode("utf-8", "surrogatepass").hex() for c in comments]
    proc = subprocess.run([LUA, "-e", KIND_HARNESS.replace("PLUGIN_PATH", repr(str(PLUGIN)))],
                          input="\n".join(lines) + "\n", capture_output=True, text=True, timeout=60, check=True)
    return proc.stdout.splitlines()


def py_kind(comment):
    from slurm_elastic.spec import comment_kind, is_elastic_comment

    ok = "OK"
    if is_elastic_comment(comment):
        ok = py_verdict(comment).split()[0]
    return f"{comment_kind(comment)} {ok}"


SPEC_BODY = "min_gpus=1,max_gpus=8,min_batch=128,max_batch=4096,max_local_batch=512"
HIDDEN = ["", " ", "\t", "\n", "\r", "\v", "\f", "\x00", "\x01", "\x1f", "\x7f", "\x85", "\xa0", "\u200b",
          "\ufeff", "\u2028", "\u3000", "x", "E", "\ud800"]


def test_prefix_examples_agree_and_hidden_prefixes_are_refused():
    cases = [h + p + SPEC_BODY for h in HIDDEN for p in ("elastic:", "Elastic:", "ELASTIC:", "elastic :")]
    cases += ["elastic:" + SPEC_BODY.replace("max_gpus=8", f"max_gpus={h}8") for h in HIDDEN]
    cases += ["", "my run", "not elastic: really", "elastic" , "elastic:"]
    assert lua_kinds(cases) == [py_kind(c) for c in cases]
    # The rule itself: only "elastic:" at the first character is elastic; hidden or case-changed
    # prefixes are refused (malformed), never treated as plain or as valid.
    from slurm_elastic.spec import comment_kind

    assert comment_kind("elastic:" + SPEC_BODY) == "elastic"
    for h in ("\x1f", "\xa0", " ", "\ufeff", "\u200b"):
        assert comment_kind(h + "elastic:" + SPEC_BODY) == "malformed"
        assert py_kind(h + "elastic:" + SPEC_BODY) == "malformed ERR"
    assert comment_kind("Elastic:" + SPEC_BODY) == "malformed"
    assert comment_kind("x elastic:" + SPEC_BODY) == "plain"


hidden = st.sampled_from(HIDDEN)
prefix = st.sampled_from(["elastic:", "Elastic:", "eLaStIc:", "elastic", "elastic :", "elastic;", ""])
any_text = st.text(alphabet=st.sampled_from(list("ab=,:19 ") + HIDDEN[1:]), max_size=6)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.lists(hidden, max_size=3), prefix, any_text, st.booleans()), min_size=20, max_size=20))
def test_lua_and_python_classify_every_comment_the_same(parts):
    comments = []
    for lead, pre, junk, with_body in parts:
        body = SPEC_BODY.replace(",", "," + junk, 1) if with_body else junk
        comments.append("".join(lead) + pre + body)
    lua = lua_kinds(comments)
    py = [py_kind(c) for c in comments]
    for c, a, b in zip(comments, lua, py, strict=True):
        assert a == b, (c, a, b)
