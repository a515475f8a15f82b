"""Translate Slurm's JSON dialects into :class:`JobRecord` and :class:`NodeRecord`.

Two families are handled (see docs/SLURM-VERSIONS.md):

* 22.05, openapi v0.0.38: plain numbers (``null`` for unset), ``job_state`` a string, node ``state``
  a lower-case string, ``tres_per_node`` like ``gres:gpu:2``;
* 23.02+ data_parser v0.0.39..v0.0.42: numbers as ``{"set","infinite","number"}``, timestamps wrapped
  from 23.11, ``job_state`` and node ``state`` as lists of upper-case flags, ``tres_per_node`` like
  ``gres/gpu:2``, ``job_resources`` null for pending jobs, a ``hold`` boolean.

Every function here is pure; anything that does not have the expected shape raises
:class:`SlurmParseError` naming the job (or node) and the field.
"""

from __future__ import annotations

import math
import re
from typing import Any

from slurm_elastic.backends.base import JobRecord, NodeRecord, PartitionRecord, SlurmParseError

# Job state flags that Slurm (22.05's job_state_string) may print in place of the base state.
JOB_STATE_FLAGS = frozenset(
    {
        "COMPLETING", "CONFIGURING", "RESIZING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "SPECIAL_EXIT",
        "STAGE_OUT", "STOPPED", "REVOKED", "RESV_DEL_HOLD", "SIGNALING", "POWER_UP_NODE", "UPDATE_DB",
        "LAUNCH_FAILED", "RECONFIG_FAIL",
    }
)
JOB_BASE_STATES = frozenset(
    {"PENDING", "RUNNING", "SUSPENDED", "COMPLETE", "COMPLETED", "CANCELLED", "FAILED", "TIMEOUT",
     "NODE_FAIL", "PREEMPTED", "BOOT_FAIL", "DEADLINE", "OUT_OF_MEMORY"}
)
# Flags whose presence in 22.05's single string means the job is (back) in the queue.
_PENDING_FLAGS = frozenset({"REQUEUED", "REQUEUE_HOLD", "REQUEUE_FED", "SPECIAL_EXIT", "RESV_DEL_HOLD"})

NODE_BASE_STATES = frozenset({"IDLE", "MIXED", "ALLOCATED", "DOWN", "ERROR", "FUTURE", "UNKNOWN", "PLANNED"})

_GPU_RE = re.compile(r"^(?:gres[:/])?gpu(?::([A-Za-z0-9_.\-]+))?[:=](\d+)")
# Slurm's time strings (MaxTime, DefaultTime): [days-]hours:minutes:seconds, minutes:seconds, minutes.
_TIME_RE = re.compile(r"^(?:(\d+)-)?(\d+)(?::(\d+))?(?::(\d+))?$")
# A job time limit above this (minutes; ten years) is Slurm's INFINITE/NO_VAL leaking through: unlimited.
MAX_TIME_LIMIT_MIN = 10 * 366 * 24 * 60


def slurm_version(doc: dict) -> tuple[int, int, int]:
    """(major, minor, micro) from a ``--json`` document's meta, for both meta shapes."""
    try:
        meta = doc["meta"]
        v = (meta.get("Slurm") or meta.get("slurm"))["version"]
        return int(v["major"]), int(v["minor"]), int(v.get("micro", 0))
    except (KeyError, TypeError, ValueError) as e:
        raise SlurmParseError(f"no Slurm version in the JSON meta: {e}") from e


def number(value: Any, *, what: str = "value") -> float | int | None:
    """A Slurm number in any dialect: int, null, {"set","infinite","number"}, or "Infinity"."""
    if value is None:
        return None
    if isinstance(value, bool):
        raise SlurmParseError(f"{what}: expected a number, got a boolean")
    if isinstance(value, (int, float)):
        return value
    if isinstance(value, dict):
        if value.get("infinite"):
            return math.inf
        if not value.get("set", True):
            return None
        return number(value.get("number"), what=what)
    if value == "Infinity":
        return math.inf
    raise SlurmParseError(f"{what}: expected a number, got {value!r}")


def int_or_none(value: Any, *, what: str = "value") -> int | None:
    n = number(value, what=what)
    if n is None or (isinstance(n, float) and math.isinf(n)):
        return None
    return int(n)


def state_list(value: Any, *, what: str = "state") -> list[str]:
    """A state as a list of upper-case words: 'RUNNING' | ['RUNNING'] | 'mixed' | 'idle+drain'."""
    if value is None:
        return []
    if isinstance(value, str):
        return [part.upper() for part in re.split(r"[+,\s]+", value) if part]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return [v.upper() for v in value]
    raise SlurmParseError(f"{what}: expected a string or a list of strings, got {value!r}")


# Base states of a job that has ended (or is ending, with the COMPLETING flag).
JOB_FINAL_STATES = frozenset(JOB_BASE_STATES - {"PENDING", "RUNNING", "SUSPENDED"})


def split_job_state(words: list[str]) -> tuple[str, tuple[str, ...]]:
    """(base state, flags). 22.05 may print only a flag (e.g. 'REQUEUE_HOLD'): infer the base state.

    A job that has ended but whose processes are still ending reads ``COMPLETING`` in every dialect:
    22.05 prints just ``"COMPLETING"``, while 23.02+ prints the final state plus the flag, e.g.
    ``["CANCELLED", "COMPLETING"]`` (seen live on 24.11 after scancel). The final state is kept as a
    flag. A requeued job that is still ending (``["PENDING", "COMPLETING"]``) stays PENDING.
    """
    base = [w for w in words if w in JOB_BASE_STATES]
    flags = tuple(w for w in words if w not in JOB_BASE_STATES)
    if base:
        b = "COMPLETED" if base[0] == "COMPLETE" else base[0]
        if b in JOB_FINAL_STATES and "COMPLETING" in flags:
            return "COMPLETING", (*flags, b)
        return b, flags
    if set(flags) & _PENDING_FLAGS:
        return "PENDING", flags
    if set(flags) & {"CONFIGURING", "RESIZING", "SIGNALING", "POWER_UP_NODE", "STAGE_OUT"}:
        return "RUNNING", flags
    if "COMPLETING" in flags:
        return "COMPLETING", flags
    return (words[0] if words else "UNKNOWN"), flags


def gpus_in_tres(value: Any) -> int | None:
    """GPU count in a TRES/GRES string: 'gres:gpu:2', 'gres/gpu:a100:2', 'gres/gpu=2', 'gpu:4(S:0-1)'.

    Several comma-separated entries may appear; their GPU counts add up. None if no GPU is named.
    """
    if value in (None, ""):
        return None
    if not isinstance(value, str):
        raise SlurmParseError(f"expected a TRES string, got {value!r}")
    total, seen = 0, False
    for part in value.split(","):
        m = _GPU_RE.match(part.strip())
        if m:
            total += int(m.group(2))
            seen = True
    return total if seen else None


def gpu_type_in_tres(value: Any) -> str:
    """The GPU type named in a TRES/GRES string: 'gres/gpu:a100:2' -> 'a100', 'gpu:a100:4(S:0)' -> 'a100';
    '' when untyped, when no GPU is named, or when the string does not parse (its GPU count is then
    None too, so nothing is placed on a guess). Several types ('gpu:a100:2,gpu:v100:2') come back
    sorted and comma-joined: no single pool holds such a request or node."""
    if value in (None, ""):
        return ""
    if not isinstance(value, str):
        raise SlurmParseError(f"expected a TRES string, got {value!r}")
    types = set()
    for part in value.split(","):
        m = _GPU_RE.match(part.strip())
        if m and m.group(1):
            types.add(m.group(1))
    return ",".join(sorted(types))


def time_limit_seconds(value: Any, *, what: str) -> int | None:
    """A job's time limit (Slurm gives minutes) in seconds; None for unlimited or unset.

    Zero (``--time=0`` means no limit), negative values and values past ten years (INFINITE/NO_VAL
    printed as a number) read as None: a limit the allocator plans against must be a real one.
    """
    n = number(value, what=what)
    if n is None or (isinstance(n, float) and not math.isfinite(n)) or n <= 0 or n > MAX_TIME_LIMIT_MIN:
        return None
    return int(n) * 60


def slurm_duration_seconds(text: str) -> int | None:
    """'2:00:00' / '1-00:00:00' / '30:00' / '45' (Slurm time strings) -> seconds; None for UNLIMITED/NONE/
    INFINITE. Raises SlurmParseError for anything else."""
    t = (text or "").strip()
    if t.upper() in ("UNLIMITED", "INFINITE", "NONE", "(NULL)", "N/A", ""):
        return None
    m = _TIME_RE.match(t)
    if not m:
        raise SlurmParseError(f"not a Slurm time: {text!r}")
    days, a, b, c = (int(x) if x else None for x in m.groups())
    if b is None:  # minutes, or days-hours
        secs = a * 3600 if days is not None else a * 60
    elif c is None:  # minutes:seconds (days-hours:minutes when days are given)
        secs = a * 3600 + b * 60 if days is not None else a * 60 + b
    else:
        secs = a * 3600 + b * 60 + c
    return secs + (days or 0) * 86400


def _exclusive(shared: Any, what: str) -> bool:
    """``--exclusive`` from the job's ``shared`` field: 'none' (22.05) / ['none'] (23.02+) is exclusive; so
    are 'user' and 'mcs' (no other user's job on its nodes); 'oversubscribe', null or [] are not."""
    if shared in (None, "", []):
        return False
    words = state_list(shared, what=what)
    return bool({"NONE", "USER", "MCS"} & set(words))


def expand_hostlist(expr: str) -> list[str]:
    """Expand a Slurm hostlist such as 'node[1-3,7],gpu05' into node names, in order."""
    if not expr:
        return []
    if not isinstance(expr, str):
        raise SlurmParseError(f"expected a hostlist string, got {expr!r}")
    out: list[str] = []
    for item in re.findall(r"[^,\[]+(?:\[[^\]]*\][^,\[]*)*", expr):
        out.extend(_expand_one(item))
    return out


def _expand_one(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    names = []
    for r in ranges.split(","):
        lo, sep, hi = r.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise SlurmParseError(f"bad hostlist range {r!r} in {item!r}")
        width = len(lo)
        for i in range(int(lo), int(hi if sep else lo) + 1):
            names.append(f"{prefix}{i:0{width}d}")
    return [n + tail for n in names for tail in _expand_one(rest)] if "[" in rest else [n + rest for n in names]


def _str(job: dict, key: str, job_id: Any) -> str:
    v = job.get(key)
    if v is None:
        return ""
    if not isinstance(v, str):
        raise SlurmParseError(f"job {job_id}: field '{key}' should be text, got {type(v).__name__}")
    return v


def _job_nodes(job: dict, job_id: Any) -> list[str]:
    nodes = job.get("nodes")
    if isinstance(nodes, str) and nodes and nodes != "(null)":
        return expand_hostlist(nodes)
    res = job.get("job_resources")
    if isinstance(res, dict):
        n = res.get("nodes")
        if isinstance(n, str):
            return expand_hostlist(n)
        if isinstance(n, dict) and isinstance(n.get("list"), str):
            return expand_hostlist(n["list"])
    return []


def parse_job(job: dict) -> JobRecord:
    """One job object of ``squeue --json`` (any supported dialect) -> JobRecord."""
    if not isinstance(job, dict):
        raise SlurmParseError(f"expected a job object, got {type(job).__name__}")
    job_id = job.get("job_id")
    try:
        jid = int_or_none(job_id, what="job_id")
        if jid is None:
            raise SlurmParseError("job without a job_id")
        base, flags = split_job_state(state_list(job.get("job_state"), what=f"job {jid}: job_state"))
        nodes = _job_nodes(job, jid)
        node_count = int_or_none(job.get("node_count"), what=f"job {jid}: node_count") or len(nodes) or 0
        per_node = gpus_in_tres(job.get("tres_per_node"))
        total = None
        if per_node is None:
            per_job = gpus_in_tres(job.get("tres_per_job"))
            if per_job is not None:
                total = per_job
                per_node = per_job // node_count if node_count else per_job
        detail = job.get("gres_detail") or []
        if base == "RUNNING" and isinstance(detail, list) and detail:
            alloc = [gpus_in_tres(d) or 0 for d in detail if isinstance(d, str)]
            if alloc:
                total = sum(alloc)
                per_node = max(alloc)
        per_node = per_node or 0
        if total is None:
            total = per_node * node_count
        priority = int_or_none(job.get("priority"), what=f"job {jid}: priority")
        reason = _str(job, "state_reason", jid)
        hold = job.get("hold")
        held = bool(hold) if isinstance(hold, bool) else (priority == 0 and base == "PENDING")
        held = held or reason in ("JobHeldUser", "JobHeldAdmin")
        requeue = job.get("requeue", True)
        if not isinstance(requeue, bool):
            raise SlurmParseError(f"job {jid}: field 'requeue' should be a boolean, got {requeue!r}")
        gpu_type = gpu_type_in_tres(job.get("tres_per_node")) or gpu_type_in_tres(job.get("tres_per_job"))
        return JobRecord(
            job_id=jid,
            name=_str(job, "name", jid),
            user=_str(job, "user_name", jid),
            user_id=int_or_none(job.get("user_id"), what=f"job {jid}: user_id"),
            account=_str(job, "account", jid),
            partition=_str(job, "partition", jid),
            state=base,
            state_flags=flags,
            state_reason=reason,
            gpus_per_node=per_node,
            gpus_total=total,
            node_count=node_count,
            nodes=tuple(nodes),
            comment=_str(job, "comment", jid),
            admin_comment=_str(job, "admin_comment", jid),
            restart_count=int_or_none(job.get("restart_cnt"), what=f"job {jid}: restart_cnt") or 0,
            priority=priority,
            held=held,
            requeueable=requeue,
            submit_time=int_or_none(job.get("submit_time"), what=f"job {jid}: submit_time"),
            start_time=int_or_none(job.get("start_time"), what=f"job {jid}: start_time"),
            work_dir=_str(job, "current_working_directory", jid),
            gpu_type=gpu_type,
            constraint=_str(job, "features", jid),
            exclusive=_exclusive(job.get("shared"), f"job {jid}: shared"),
            time_limit_s=time_limit_seconds(job.get("time_limit"), what=f"job {jid}: time_limit"),
            reservation=_str(job, "resv_name", jid),
        )
    except SlurmParseError:
        raise
    except (TypeError, ValueError, AttributeError, KeyError) as e:
        raise SlurmParseError(f"job {job_id}: unexpected shape: {e}") from e


def parse_jobs(doc: Any) -> list[JobRecord]:
    """All jobs of a ``squeue --json`` / ``scontrol show job --json`` document."""
    if not isinstance(doc, dict) or not isinstance(doc.get("jobs"), list):
        raise SlurmParseError("expected a JSON object with a 'jobs' list")
    _check_errors(doc)
    return [parse_job(j) for j in doc["jobs"]]


def parse_node(node: dict) -> NodeRecord:
    """One node of ``sinfo --json`` (22.05) or ``scontrol show nodes --json`` (23.02+)."""
    if not isinstance(node, dict):
        raise SlurmParseError(f"expected a node object, got {type(node).__name__}")
    name = node.get("name")
    if not isinstance(name, str) or not name:
        raise SlurmParseError("node without a name")
    try:
        words = state_list(node.get("state"), what=f"node {name}: state")
        flags = [w for w in state_list(node.get("state_flags"), what=f"node {name}: state_flags")]
        base = [w for w in words if w in NODE_BASE_STATES]
        flags += [w for w in words if w not in NODE_BASE_STATES]
        partitions = node.get("partitions") or []
        if isinstance(partitions, str):
            partitions = [p for p in partitions.split(",") if p]
        if not isinstance(partitions, list):
            raise SlurmParseError(f"node {name}: field 'partitions' should be a list")
        return NodeRecord(
            name=name,
            state=base[0] if base else (words[0] if words else "UNKNOWN"),
            state_flags=tuple(flags),
            gpus_total=gpus_in_tres(node.get("gres")) or 0,
            gpus_used=gpus_in_tres(node.get("gres_used")) or 0,
            cpus_total=int_or_none(node.get("cpus"), what=f"node {name}: cpus") or 0,
            partitions=tuple(str(p) for p in partitions),
            gpu_type=gpu_type_in_tres(node.get("gres")),
            features=_features(node.get("active_features"), f"node {name}: active_features"),
            reservations=_features(node.get("reservation"), f"node {name}: reservation"),
        )
    except SlurmParseError:
        raise
    except (TypeError, ValueError, AttributeError) as e:
        raise SlurmParseError(f"node {name}: unexpected shape: {e}") from e


def _features(value: Any, what: str) -> tuple[str, ...]:
    """A comma list as text (22.05) or a list of strings (23.02+) -> names; null/''/'(null)' -> ()."""
    if value in (None, "", "(null)"):
        return ()
    if isinstance(value, str):
        return tuple(v for v in value.split(",") if v and v != "(null)")
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        return tuple(v for v in value if v)
    raise SlurmParseError(f"{what}: expected text or a list of strings, got {value!r}")


# ----- scontrol one-line text (``scontrol -o show partition|reservation|config``) ------------------
# 22.05's scontrol has no --json; the ``-o`` text is the same on every version and costs about 5 ms.
_KV_RE = re.compile(r"(?:^|\s)([A-Za-z][A-Za-z0-9_/]*)=(.*?)(?=\s+[A-Za-z][A-Za-z0-9_/]*=|\s*$)")


def parse_oneliners(text: str) -> list[dict[str, str]]:
    """Records of ``scontrol -o show ...``: one line per record, ``Key=value`` pairs (a value may hold
    spaces: it runs to the next ``Key=``). Blank lines and 'No reservations in the system' are skipped."""
    if not isinstance(text, str):
        raise SlurmParseError(f"expected scontrol text, got {type(text).__name__}")
    out = []
    for line in text.splitlines():
        if "=" not in line:
            continue
        out.append({m.group(1): m.group(2) for m in _KV_RE.finditer(line.strip())})
    return out


def parse_partitions(text: str) -> list[PartitionRecord]:
    """``scontrol -o show partition`` -> PartitionRecord (MaxNodes, MaxTime, DefaultTime, nodes, state)."""
    out = []
    for rec in parse_oneliners(text):
        name = rec.get("PartitionName", "")
        if not name:
            raise SlurmParseError(f"a partition record without a PartitionName: {sorted(rec)[:8]}")
        try:
            max_nodes = rec.get("MaxNodes", "UNLIMITED")
            nodes = rec.get("Nodes", "")
            out.append(PartitionRecord(
                name=name,
                nodes=tuple(expand_hostlist(nodes)) if nodes and nodes != "(null)" else (),
                max_nodes=None if max_nodes.upper() in ("UNLIMITED", "INFINITE") else int(max_nodes),
                max_time_s=slurm_duration_seconds(rec.get("MaxTime", "UNLIMITED")),
                default_time_s=slurm_duration_seconds(rec.get("DefaultTime", "NONE")),
                state=rec.get("State", "UNKNOWN").upper(),
                is_default=rec.get("Default", "NO").upper() == "YES",
            ))
        except (SlurmParseError, ValueError) as e:
            raise SlurmParseError(f"partition {name}: {e}") from e
    return out


def parse_reservations(text: str) -> dict[str, tuple[str, ...]]:
    """``scontrol -o show reservation`` -> {node: names of the ACTIVE reservations covering it}."""
    out: dict[str, list[str]] = {}
    for rec in parse_oneliners(text):
        name = rec.get("ReservationName", "")
        if not name:
            raise SlurmParseError(f"a reservation record without a ReservationName: {sorted(rec)[:8]}")
        if rec.get("State", "").upper() != "ACTIVE":
            continue
        nodes = rec.get("Nodes", "")
        if not nodes or nodes == "(null)":
            continue
        try:
            for node in expand_hostlist(nodes):
                out.setdefault(node, []).append(name)
        except SlurmParseError as e:
            raise SlurmParseError(f"reservation {name}: {e}") from e
    return {k: tuple(v) for k, v in out.items()}


def parse_config(text: str) -> dict[str, str]:
    """``scontrol show config`` (``Key = value`` lines) -> {Key: value}."""
    out = {}
    for line in (text or "").splitlines():
        key, sep, value = line.partition(" = ")
        if sep and key.strip() and " " not in key.strip():
            out[key.strip()] = value.strip()
    return out


def parse_nodes(doc: Any) -> list[NodeRecord]:
    """Nodes of a per-node document: 22.05 ``sinfo --json`` or 23.02+ ``scontrol show nodes --json``."""
    if not isinstance(doc, dict) or not isinstance(doc.get("nodes"), list):
        raise SlurmParseError("expected a JSON object with a 'nodes' list (per-node output)")
    _check_errors(doc)
    return [parse_node(n) for n in doc["nodes"]]


def _check_errors(doc: dict) -> None:
    errors = doc.get("errors") or []
    if errors:
        msgs = []
        for e in errors:
            if isinstance(e, dict):
                msgs.append(str(e.get("description") or e.get("error") or e))
            else:
                msgs.append(str(e))
        raise SlurmParseError("Slurm reported errors: " + "; ".join(msgs))
