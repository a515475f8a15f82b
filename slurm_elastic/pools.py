"""Pools and rigid jobs (issue 13): where a job may run, and GPUs kept free for Slurm's own jobs. Pure.

**Pools.** The managed, usable nodes fall into disjoint pools: maximal groups with the same
(partitions, GPU type, features, reservations). Every job sees all nodes of a pool alike, so the
allocator only has to choose a pool and a count. Nodes of different GPU counts may share a pool.

**A job's pools** (:func:`allowed_pools`): those that share one of its partitions, whose GPU type
matches its gres type ("" = any type), whose features satisfy its ``--constraint`` (simple feature
names joined by ``&``; anything else -- ``|``, ``[..]``, ``*N``, ``!`` -- is refused with
:class:`PoolError` naming the job and field, never guessed), and that carry no reservation unless
the job names it (a job with a reservation runs only on that reservation's nodes).

**Rigid jobs** (:func:`reserve_rigid`): pending jobs of the managed partitions that are not elastic.
In Slurm priority order, each one that would fit on whole nodes of one of its pools if the elastic
jobs there shrank toward their minimums gets GPUs *reserved* on specific nodes: they are taken out
of the capacity the policy may hand out (nobody grows into them), and the elastic jobs that sit on
them and can shrink are capped below their current count (the policy shrinks them). Slurm's own
scheduler then starts the rigid job; the daemon never holds or modifies it. A rigid job that does
not fit even then blocks the lower-priority rigid jobs that share one of its pools (Slurm's strict
priority within a partition); rigid jobs on disjoint pools go on.
Bound: a rigid job that is next in its pools and fits at the elastic minimums has its GPUs reserved
in the first cycle that sees it, and they are free once the shrinks end: it waits at most one
daemon cycle plus one rescale (checkpoint + requeue) longer than with those GPUs already free; elastic
jobs never hold more than their minimums against it.
"""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from slurm_elastic.backends.base import JobRecord, NodeRecord
from slurm_elastic.spec import SpecError

_FEATURE_RE = re.compile(r"^[A-Za-z0-9_.:+-]{1,64}$")


class PoolError(SpecError):
    """A job's placement request that the daemon will not interpret (names the job and field); a
    :class:`SpecError`, so it is reported like a bad spec and the job is never acted on."""


@dataclass(frozen=True)
class PoolKey:
    partitions: tuple[str, ...]
    gpu_type: str
    features: tuple[str, ...]
    reservations: tuple[str, ...]


@dataclass(frozen=True)
class NodePool:
    """One pool of nodes (the policy sees it as :class:`~slurm_elastic.policies.base.Pool`)."""

    name: str
    key: PoolKey
    nodes: tuple[str, ...]

    @property
    def gpu_type(self) -> str:
        return self.key.gpu_type


def pool_key(n: NodeRecord) -> PoolKey:
    return PoolKey(tuple(sorted(n.partitions)), n.gpu_type, tuple(sorted(set(n.features))),
                   tuple(sorted(set(n.reservations))))


def group_pools(nodes: Iterable[NodeRecord]) -> list[NodePool]:
    """Disjoint pools of ``nodes`` in first-seen order; names ``<partitions>:<type>`` (+ features,
    reservations), unique."""
    groups: dict[PoolKey, list[str]] = defaultdict(list)
    for n in nodes:
        groups[pool_key(n)].append(n.name)
    out, seen = [], set()
    for key, names in groups.items():
        name = "+".join(key.partitions) + ":" + (key.gpu_type or "gpu")
        if key.features:
            name += "[" + "&".join(key.features) + "]"
        if key.reservations:
            name += "@" + "+".join(key.reservations)
        base, i = name, 2
        while name in seen:
            name, i = f"{base}#{i}", i + 1
        seen.add(name)
        out.append(NodePool(name, key, tuple(names)))
    return out


def parse_constraint(text: str, job_id=None) -> frozenset[str]:
    """The features a ``--constraint`` requires: simple names joined by ``&`` (or ``,``, Slurm's old
    AND). Anything else is refused: OR, counts, brackets and negation change where a job may run in
    ways the daemon does not model."""
    text = (text or "").strip()
    if not text:
        return frozenset()
    parts = re.split(r"[&,]", text)
    bad = [p for p in parts if not _FEATURE_RE.fullmatch(p.strip())]
    if bad or any(c in text for c in "|[]*!()"):
        raise PoolError(f"--constraint {text[:80]!r} is not supported (only feature names joined by '&'); "
                        "the daemon does not place this job", job_id=job_id, field="constraint")
    return frozenset(p.strip() for p in parts)


def allowed_pools(r: JobRecord, pools: Sequence[NodePool]) -> tuple[str, ...]:
    """Names of the pools job ``r`` may use (see the module docstring); raises :class:`PoolError`."""
    need = parse_constraint(r.constraint, r.job_id)
    parts = set(r.partitions)
    out = []
    for p in pools:
        k = p.key
        if parts and not parts & set(k.partitions):
            continue
        if r.gpu_type and r.gpu_type != k.gpu_type:
            continue
        if not need <= set(k.features):
            continue
        if k.reservations and r.reservation not in k.reservations:
            continue
        if r.reservation and r.reservation not in k.reservations:
            continue
        out.append(p.name)
    return tuple(out)


@dataclass(frozen=True)
class RigidDemand:
    """One pending rigid job: its shape and the pools it may use."""

    job_id: int
    nodes: int
    gpus_per_node: int
    exclusive: bool
    pools: tuple[str, ...]

    @property
    def gpus(self) -> int:
        return self.nodes * self.gpus_per_node


def rigid_demand(r: JobRecord, pools: Sequence[NodePool]) -> RigidDemand | None:
    """The demand of a pending non-elastic job, None if it asks for no GPUs."""
    if r.gpus_total <= 0 and r.gpus_per_node <= 0:
        return None
    n = max(1, r.node_count)
    g = r.gpus_per_node or -(-r.gpus_total // n)
    return RigidDemand(r.job_id, n, g, r.exclusive, allowed_pools(r, pools))


@dataclass(frozen=True)
class ElasticOnNode:
    """A running elastic job, as the reservation needs it: where it is and how far it may shrink."""

    job_id: int | str
    pool: str
    gpus: int
    min_gpus: int
    nodes: tuple[str, ...]
    gpus_per_node: int
    priority_rank: int  # 0 = highest


@dataclass
class KeptForRigid:
    """What :func:`reserve_rigid` decided."""

    by_node: dict[str, int] = field(default_factory=dict)  # node -> GPUs kept free for rigid jobs
    jobs: dict[int, tuple[str, tuple[str, ...]]] = field(default_factory=dict)  # rigid job -> (pool, nodes)
    blocked: dict[int, str] = field(default_factory=dict)  # rigid job -> why nothing is reserved
    caps: dict[int | str, int] = field(default_factory=dict)  # elastic job -> largest count it may keep
    # elastic job -> reserved nodes it must leave (it restarts elsewhere: the enactor excludes them)
    avoid: dict[int | str, set[str]] = field(default_factory=dict)

    def per_pool(self, pools: Sequence[NodePool]) -> dict[str, int]:
        return {p.name: sum(self.by_node.get(n, 0) for n in p.nodes) for p in pools}


def reserve_rigid(
    rigid: Sequence[RigidDemand],
    pools: Sequence[NodePool],
    capacity: Mapping[str, int],
    free_now: Mapping[str, int],
    totals: Mapping[str, int],
    elastic: Sequence[ElasticOnNode],
    committed_min: Mapping[str, int],
    limit: int = 256,
) -> KeptForRigid:
    """Reserve GPUs for ``rigid`` jobs (already in Slurm priority order).

    ``capacity``: node -> GPUs not held by running non-elastic jobs; ``free_now``: node -> GPUs Slurm
    shows free; ``totals``: node -> GPUs; ``elastic``: running elastic jobs on the nodes;
    ``committed_min``: pool -> GPUs the elastic jobs of that pool keep at their minimums (running and
    starting). A node is reclaimable up to its free GPUs plus the per-node GPUs of elastic jobs on it
    (each down to its minimum, at most its GPUs on that node); reservations go on the nodes that displace
    the fewest elastic GPUs.
    """
    res = KeptForRigid()
    by_name = {p.name: p for p in pools}
    on_node: dict[str, list[ElasticOnNode]] = defaultdict(list)
    for e in elastic:
        for n in e.nodes:
            on_node[n].append(e)
    free = dict(free_now)
    left = {n: capacity.get(n, 0) for p in pools for n in p.nodes}  # what elastic jobs may still get
    shrink_left = {e.job_id: e.gpus - e.min_gpus for e in elastic}  # GPUs each may still give up
    pool_room = {p.name: sum(left[n] for n in p.nodes) - committed_min.get(p.name, 0) for p in pools}
    closed: set[str] = set()  # pools behind a blocked rigid job (strict priority there)

    def movable(e: ElasticOnNode, n: str, p: NodePool) -> bool:
        """Can ``e`` restart off node ``n`` at its minimum, on the pool's other nodes as they are free now?"""
        if len(e.nodes) != 1 or e.nodes[0] != n:
            return False  # multi-node jobs shrink in place only (kept simple)
        return any(free.get(m, 0) >= e.min_gpus for m in p.nodes if m != n and m not in res.by_node)

    for d in rigid[:limit]:
        if not d.pools:
            res.blocked[d.job_id] = "no managed pool matches its partition, gres type, constraint and reservation"
            continue
        if set(d.pools) & closed:
            res.blocked[d.job_id] = "a higher-priority rigid job in its pools is waiting"
            continue
        best = None
        for name in d.pools:
            p = by_name[name]
            if d.gpus > pool_room[name]:
                continue  # elastic minimums there leave too little
            cands = []
            for n in p.nodes:
                size = totals.get(n, 0)
                want = size if d.exclusive else d.gpus_per_node
                if size < d.gpus_per_node or left[n] < want:
                    continue
                # What the elastic jobs here can give up. A resize restarts the whole job (requeue), so a
                # job may leave this node entirely and restart on the pool's other nodes (the enactor
                # then excludes the reserved nodes: ``KeptForRigid.avoid``), when its minimum fits there;
                # else it can shrink here down to its minimum.
                gain = sum(e.gpus_per_node if movable(e, n, p) else min(e.gpus_per_node, shrink_left[e.job_id])
                           for e in on_node.get(n, ()))
                if free.get(n, 0) + gain < want:
                    continue
                cands.append((max(0, want - free.get(n, 0)), left[n], n, want))
            if len(cands) < d.nodes:
                continue
            cands.sort()
            pick = cands[:d.nodes]
            cost = sum(c[0] for c in pick)
            if best is None or cost < best[0]:
                best = (cost, name, pick)
        if best is None:
            res.blocked[d.job_id] = (f"needs {d.nodes} node(s) x {d.gpus_per_node} GPUs"
                                     + (" (exclusive)" if d.exclusive else "")
                                     + " that elastic jobs at their minimums do not leave in its pools")
            closed.update(d.pools)
            continue
        _, name, pick = best
        for displaced, _, n, want in pick:
            need = displaced
            for e in sorted(on_node.get(n, ()), key=lambda e: -e.priority_rank):  # lowest priority first
                if need <= 0:
                    break
                take = min(e.gpus_per_node, shrink_left[e.job_id], need)
                can_move = movable(e, n, by_name[name])
                if take >= need or (take > 0 and not can_move):
                    shrink_left[e.job_id] -= take
                    res.caps[e.job_id] = max(e.min_gpus, res.caps.get(e.job_id, e.gpus) - take)
                    need -= take
                    continue
                if not can_move:
                    continue
                # Shrinking here is not enough: the job leaves the node and restarts elsewhere in the
                # pool, at most at what the other nodes leave free (and below its size, so it is resized).
                room = sum(free.get(m, 0) for m in by_name[name].nodes if m != n and m not in res.by_node)
                res.caps[e.job_id] = max(e.min_gpus, min(e.gpus - 1, room, res.caps.get(e.job_id, e.gpus)))
                res.avoid.setdefault(e.job_id, set()).add(n)
                shrink_left[e.job_id] = 0
                need -= e.gpus_per_node
            free[n] = max(0, free.get(n, 0) - want)
            left[n] -= want
            res.by_node[n] = res.by_node.get(n, 0) + want
        pool_room[name] -= sum(c[3] for c in pick)
        res.jobs[d.job_id] = (name, tuple(c[2] for c in pick))
    return res
