"""Expand Slurm hostlist expressions (``node[1-3,07-08],gpu-a``) without calling ``scontrol``.

The syntax (``slurm_hostlist_create``): items separated by commas outside brackets; each item may hold
one or more bracket groups of comma-separated numbers and ``lo-hi`` ranges, zero padding kept from the
low bound (``n[08-10]`` -> ``n08 n09 n10``). Several groups multiply (``r[1-2]n[1-2]`` -> 4 names).
``scontrol show hostnames`` does the same; this module exists so the job needs no Slurm call for it.
Torch-free.
"""

from __future__ import annotations

import itertools
import re

_RANGE_RE = re.compile(r"^([0-9]+)(?:-([0-9]+))?$")
MAX_HOSTS = 1 << 20


class HostlistError(ValueError):
    """A hostlist expression that Slurm would not accept."""


def _split_top(expr: str) -> list[str]:
    items, depth, cur = [], 0, []
    for ch in expr:
        if ch == "[":
            depth += 1
            if depth > 1:
                raise HostlistError(f"nested '[' in hostlist {expr!r}")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise HostlistError(f"unbalanced ']' in hostlist {expr!r}")
        if ch == "," and depth == 0:
            items.append("".join(cur))
            cur = []
        else:
            cur.append(ch)
    if depth:
        raise HostlistError(f"unclosed '[' in hostlist {expr!r}")
    items.append("".join(cur))
    return [i.strip() for i in items if i.strip()]


def _expand_group(body: str, expr: str) -> list[str]:
    out: list[str] = []
    for part in body.split(","):
        m = _RANGE_RE.match(part.strip())
        if not m:
            raise HostlistError(f"bad range {part!r} in hostlist {expr!r}")
        lo_s, hi_s = m.group(1), m.group(2)
        if hi_s is None:
            out.append(lo_s)
            continue
        lo, hi = int(lo_s), int(hi_s)
        if hi < lo:
            raise HostlistError(f"range {part!r} runs backwards in hostlist {expr!r}")
        if hi - lo + 1 > MAX_HOSTS:
            raise HostlistError(f"range {part!r} is too large in hostlist {expr!r}")
        width = len(lo_s) if lo_s.startswith("0") else 0
        out.extend(str(n).zfill(width) for n in range(lo, hi + 1))
    return out


def _expand_item(item: str, expr: str) -> list[str]:
    pieces = re.split(r"(\[[^\]]*\])", item)
    choices: list[list[str]] = []
    for p in pieces:
        if p.startswith("[") and p.endswith("]"):
            choices.append(_expand_group(p[1:-1], expr))
        elif p:
            if "[" in p or "]" in p:
                raise HostlistError(f"bad brackets in hostlist {expr!r}")
            choices.append([p])
    return ["".join(c) for c in itertools.product(*choices)]


def expand_hostlist(expr: str) -> list[str]:
    """All host names of a Slurm hostlist expression, in Slurm's order (duplicates kept)."""
    if not isinstance(expr, str) or not expr.strip():
        raise HostlistError("empty hostlist")
    out: list[str] = []
    for item in _split_top(expr.strip()):
        out.extend(_expand_item(item, expr))
        if len(out) > MAX_HOSTS:
            raise HostlistError(f"hostlist {expr!r} names more than {MAX_HOSTS} hosts")
    return out


def first_host(expr: str) -> str:
    """The first host of a hostlist expression (where rank 0 runs under srun's block distribution)."""
    return expand_hostlist(expr)[0]
