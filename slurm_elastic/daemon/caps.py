"""Per-job and per-user GPU caps, applied around any policy (the policies themselves know no users).

- A **per-job cap** lowers every job's ``max_gpus`` before the policy runs. A job whose ``min_gpus`` is
  above the cap cannot run under it; it is left out of the problem and reported.
- A **per-user cap** limits the GPUs all elastic jobs of one user hold together. It is enforced on the
  policy's answer, in the policy's priority order: a job that would push its user past the cap gets
  the largest allowed GPU count that still fits (with the feasible batch nearest to the one chosen),
  or nothing if even its minimum does not fit. A running job is never cut below its minimum; if its
  user is over the cap through running jobs alone, new starts and grows of that user wait.
- A **weight grant** bounds what a spec's ``weight`` is worth. The weight is the user's word, so as with
  Slurm's ``--nice`` a user may only lower a job's standing: a weight counts for at most the site's
  grant (``weight_grants``: to the user, else to the job's Slurm account as ``account:NAME``, else
  ``*``; default 1). To put one job first, a user lowers the others.

This keeps the caps exact whatever a job asks for; the price is that GPUs a cap takes from one job
are not re-optimised among the others until the next cycle.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from slurm_elastic.policies.base import Allocation, AllocationProblem, JobAllocation, Policy


@dataclass
class CappedPolicy(Policy):
    inner: Policy
    max_gpus_per_job: int = 0
    max_gpus_per_user: int = 0
    user_of: dict | None = None  # job id -> user name, refreshed every cycle
    weight_grants: dict | None = None  # user, "account:NAME" or "*" -> the most weight a job counts with
    account_of: dict | None = None  # job id -> Slurm account, refreshed every cycle

    def __post_init__(self):
        self.name = getattr(self.inner, "name", "")
        self.excluded: dict = {}
        # job id -> most GPUs it may get, refreshed every cycle: a job found running at a size the daemon
        # did not decide is limited to the decided size (daemon/oversight.py), so it is never grown past
        # it and is shrunk like a job over its cap.
        self.limit: dict = {}
        self.weight_notes: dict = {}  # job id -> why its weight counted for less than its spec asks

    def learned(self) -> dict:
        return self.inner.learned()

    def restore(self, learned: dict) -> None:
        self.inner.restore(learned)

    def grant(self, user: str, account: str = "") -> tuple[float, str]:
        """The most weight a job of ``user`` under ``account`` counts with (1 unless granted), and to whom
        the grant is: the user's own, else the account's, else every user's."""
        g = self.weight_grants or {}
        if user in g:
            return float(g[user]), user or "?"
        if account and f"account:{account}" in g:
            return float(g[f"account:{account}"]), f"account {account}"
        return float(g.get("*", 1.0)), user or "?"

    def noted(self, job_id, reason: str) -> str:
        """``reason`` with why the job's weight counted for less than its spec asks, if it did."""
        return "; ".join(x for x in (reason, self.weight_notes.get(job_id)) if x)

    def _granted(self, jobs) -> list:
        """Each job's weight capped at its grant (the note says so in status)."""
        users, accounts = self.user_of or {}, self.account_of or {}
        out = []
        for j in jobs:
            g, whom = self.grant(users.get(j.job_id, j.user), accounts.get(j.job_id, ""))
            if j.spec.weight > g:
                self.weight_notes[j.job_id] = f"weight {j.spec.weight:g} counts as {g:g} (the site's grant to {whom})"
                j = replace(j, spec=replace(j.spec, weight=g))
            out.append(j)
        return out

    def allocate(self, problem: AllocationProblem) -> Allocation:
        self.excluded = {}
        self.weight_notes = {}
        jobs = []
        for j in self._granted(problem.jobs):
            lim = self.limit.get(j.job_id)
            if lim is not None and j.spec.max_gpus > lim:
                j = replace(j, spec=replace(j.spec, max_gpus=max(lim, j.spec.min_gpus)))
            cap = self.max_gpus_per_job
            if cap and j.spec.max_gpus > cap:
                if j.spec.min_gpus > cap and not j.is_running:
                    self.excluded[j.job_id] = f"min_gpus {j.spec.min_gpus} is above the per-job cap {cap}"
                    continue
                j = replace(j, spec=replace(j.spec, max_gpus=max(cap, j.spec.min_gpus)))
            jobs.append(j)
        if self.max_gpus_per_user:
            jobs = self._user_prefilter(jobs)
        alloc = self.inner.allocate(replace(problem, jobs=tuple(jobs)))
        out = dict(alloc.jobs)
        if self.max_gpus_per_user:
            out = self._user_caps(problem, jobs, out, problem.node_size)
            # When the cap cuts the answer, re-solve with each capped user's jobs held at what the cap
            # left them (that user's other pending jobs out), so the GPUs the cap took go to other users'
            # jobs in this cycle. Every round caps at least one more user, so this ends; a policy that
            # picks among identical jobs of one user would otherwise be cut one job per round (seen:
            # 8 GPUs, cap 4, bob's 2 jobs first and ann's 6: bob 0, ann 4, 4 GPUs idle).
            users = self.user_of or {}
            capped: set[str] = set()
            for _ in range(len(set(users.values())) + 1):
                cut = {j.job_id for j in jobs if j.job_id in out and j.job_id in alloc.jobs
                       and out[j.job_id].gpus < alloc.jobs[j.job_id].gpus}
                if not cut:
                    break
                capped |= {users.get(jid, "") for jid in cut}
                again = []
                for j in jobs:
                    if users.get(j.job_id, "") not in capped:
                        again.append(j)
                        continue
                    k = out[j.job_id].gpus if j.job_id in out else 0
                    if k > 0:
                        again.append(replace(j, spec=replace(j.spec, max_gpus=k)))
                    elif j.is_running:
                        again.append(j)
                    else:
                        self.excluded[j.job_id] = (out[j.job_id].reason if j.job_id in out and out[j.job_id].reason
                                                   else f"per-user cap {self.max_gpus_per_user} reached by user "
                                                        f"{users.get(j.job_id) or '?'}")
                jobs = again
                alloc = self.inner.allocate(replace(problem, jobs=tuple(jobs)))
                out = self._user_caps(problem, jobs, dict(alloc.jobs), problem.node_size)
        for jid, reason in self.excluded.items():
            out[jid] = JobAllocation(jid, 0, reason=reason)
        return replace(alloc, jobs=out)

    def _user_prefilter(self, jobs: list) -> list:
        """Before the policy: in priority order, a pending job whose minimum no longer fits under its
        user's cap (after that user's running jobs and earlier pending minimums) is left out, and no job
        may ask for more than the cap. Otherwise a policy that chooses which pending jobs start (joint
        admission) can give the GPUs to one user's many jobs, have the cap cut them afterwards, and
        leave another user's jobs waiting cycle after cycle (seen in tests/faults/test_user_files.py)."""
        users = self.user_of or {}
        cap = self.max_gpus_per_user
        held: dict[str, int] = {}
        for j in jobs:
            if j.is_running:
                user = users.get(j.job_id, "")
                held[user] = held.get(user, 0) + j.running_gpus
        kept = []
        for j in jobs:
            user = users.get(j.job_id, "")
            if not j.is_running:
                if held.get(user, 0) + j.spec.min_gpus > cap:
                    self.excluded[j.job_id] = (f"per-user cap {cap}: the user's other jobs hold or are first "
                                               f"in line for {held.get(user, 0)} GPUs")
                    continue
                held[user] = held.get(user, 0) + j.spec.min_gpus
            if j.spec.max_gpus > cap >= j.spec.min_gpus:
                j = replace(j, spec=replace(j.spec, max_gpus=cap))
            kept.append(j)
        return kept

    def _user_caps(self, problem, jobs, out: dict, node_size: int) -> dict:
        users = self.user_of or {}
        used: dict[str, int] = {}
        cap = self.max_gpus_per_user
        for j in jobs:
            a = out.get(j.job_id)
            if a is None or a.gpus == 0:
                continue
            user = users.get(j.job_id, "")
            have = used.get(user, 0)
            if have + a.gpus <= cap:
                used[user] = have + a.gpus
                continue
            room = cap - have
            floor = j.spec.min_gpus if j.is_running else 1
            # Counts up to the room left (at most the cap), and the batch nearest the chosen one from the
            # spec's bounds: never a listing of the spec's ranges (a 2**40 batch range once hung a cycle here).
            counts = [k for k in j.spec.allowed_gpu_counts(node_size, most=room) if floor <= k]
            new = None
            for k in sorted(counts, reverse=True):
                b = j.spec.nearest_batch(k, a.batch or None)
                if b is not None:
                    local, accum = j.spec.split_batch(k, b)
                    nodes, _ = j.spec.placement(k, node_size)
                    new = replace(a, gpus=k, nodes=nodes, batch=b, local_batch=local, accum=accum,
                                  samples_per_s=j.model.samples_per_s(k, nodes, local, accum),
                                  reason=f"per-user cap {cap}: {a.gpus} -> {k} GPUs")
                    break
            if new is None:
                if j.is_running:
                    # Never below the minimum: keep it where it is and let the cap bite on others.
                    k = j.running_gpus
                    new = replace(a, gpus=k, reason=f"per-user cap {cap}: kept at {k} GPUs")
                    if j.running_batch:
                        split = j.spec.split_batch(k, j.running_batch)
                        if split:
                            nodes, _ = j.spec.placement(k, node_size)
                            new = replace(new, nodes=nodes, batch=j.running_batch, local_batch=split[0],
                                          accum=split[1])
                else:
                    new = JobAllocation(j.job_id, 0, reason=f"per-user cap {cap} reached by user {user or '?'}")
            out[j.job_id] = new
            used[user] = have + new.gpus
        return out
