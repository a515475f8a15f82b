"""Issue 23: heterogeneous GPU clusters in the simulator -- Sia's cluster, tables, restarts and traces.

One run: a Sia Philly workload (``../shared/data/sia/workloads/workload-<n>.csv``, 160 jobs) on Sia's
64-GPU cluster (6 x 4 T4 ``aws``, 3 x 8 RTX 2080Ti ``rtx``, 2 x 8 A100 ``dgx-ext``; one partition, so
every job may run on any type and the policy chooses), through the daemon's own cycle
(``Simulation`` -> ``enact.run_cycle`` -> ``problem.build_problem`` with one pool per type ->
policy -> planner -> ``SimulatedSlurm``). Every job *runs* at its app's measured table on the type it
is on (``profiles.pertype``), its step times scaled by Sia's per-model slowdown (:data:`SIA_SLOWDOWN`,
as Sia's simulator does); what the policy *knows* per type is the run's ``knowledge``:

* ``job`` -- what the daemon learns (:class:`Learner`): the job's own model (its ``profile=``, Pollux's
  T4 table), its family's measured tables on the types a job of it trained on, else the model scaled
  by the cluster's learned type ratios (``profiles.types.TypeRatios``, per family first), shrunk
  toward the data-sheet prior (``TYPE_SPEED``, built from no table this simulator runs at);
* ``bootstrap`` -- ``job`` plus a Sia-style profile of each family's first job on one GPU of every type,
  charged (``dp:bootstrap``);
* ``profiled`` -- every job's true table on every type, the one it runs on included, as if Sia's
  bootstrap measured every configuration (its cost not charged). The peers ``sia`` and ``gavel`` run
  ``profiled`` by default (both designs assume per-type throughputs); ``dp`` runs ``job``.

Restarts (``restart="sia"``): each job's spec carries its model's restart cost from Sia's simulator
(cifar10 50 s, deepspeech2 25, bert 120, yolov3 80, imagenet 250, ncf 15), and its first start pays it
too (``first_start_charge``), as Pollux's simulator charges it (Sia's builds on Pollux's);
``restart="flat"``: 30 s for every job; ``restart="600"``: that many seconds for every job. Work: the
goodput model following Pollux's gradient traces (as Sia's simulator).

Figures per run (:func:`hetero_metrics`): average, p99 and longest JCT, restarts (requeues) per job,
moves between types (jobs moved, moves), GPU-hours per job and their share by type, the jobs held
short of the size their true gain says pays for longer than ``held_bound_s`` (``held_short_jobs``,
engine.held_short) and those held at a size their own measured model says is wrong for longer than
that (``held_wrong_jobs``, sim/checks.py, as in the one-type evaluation), and
finish-time fairness: JCT over the job's run time alone at its requested size on its best type, by
the set of types the job ran on.
"""

from __future__ import annotations

from dataclasses import replace
from functools import cache
from pathlib import Path

import numpy as np

from slurm_elastic.profiles.pertype import SIA_CLUSTER, SIA_RESTART_S, SIA_TYPES, app_of, sia_model
from slurm_elastic.profiles.types import OnType, TypeRatios, model_on_type
from slurm_elastic.sim.engine import SimConfig, SimResult, Simulation
from slurm_elastic.sim.workloads import WorkloadJob, read_pollux

REPO = Path(__file__).resolve().parents[2]
SIA_DATA = REPO.parent / "shared" / "data" / "sia"
WORKLOADS = tuple(range(1, 9))
PEER_KNOWLEDGE = {"sia": "profiled", "gavel": "profiled"}  # the rest: "job"
FLAT_RESTART_S = 30.0


def flat_restart_s(restart: str) -> float | None:
    """``"sia"`` -> None (per model); ``"flat"`` -> 30 s; a number of seconds (``"600"``) -> that, for
    every job."""
    if restart == "sia":
        return None
    if restart == "flat":
        return FLAT_RESTART_S
    try:
        v = float(restart)
    except ValueError:
        v = -1.0
    if not (v > 0 and np.isfinite(v)):
        raise ValueError(f"restart must be 'sia', 'flat' or seconds > 0, not {restart!r}")
    return v


def sia_config(*, restart: str = "sia", held_bound_s: float = 1800.0, **kw) -> SimConfig:
    """Sia's cluster, one partition ``gpu``; goodput work model; the first start pays the restart."""
    flat = flat_restart_s(restart)
    groups = tuple((n, g, "gpu", t) for n, g, t in SIA_CLUSTER)
    base = dict(nodes=sum(n for n, _, _ in SIA_CLUSTER), gpus_per_node=4, groups=groups, work_model="goodput",
                checkpoint_s=0.0, restart_s=flat or FLAT_RESTART_S, first_start_charge=True,
                held_bound_s=held_bound_s)
    base.update(kw)
    return SimConfig(**base)


def read_sia_workload(n: int, *, restart: str = "sia", data: Path | str = SIA_DATA) -> list[WorkloadJob]:
    """Sia's Philly workload ``n`` (Pollux's CSV format); with ``restart="sia"`` each job's spec
    carries its model's restart cost."""
    jobs = read_pollux(Path(data) / "workloads" / f"workload-{n}.csv")
    flat = flat_restart_s(restart)
    return [replace(w, spec=replace(w.spec, restart_s=SIA_RESTART_S[w.spec.profile] if flat is None else flat))
            for w in jobs]


# Sia's simulator scales every step time by a per-model slowdown (its applications' measured tables ran
# faster than the jobs of its traces); applied here to what every job runs at, under every policy alike.
SIA_SLOWDOWN = {"cifar10": 1.8, "ncf": 1.5}
DEFAULT_SLOWDOWN = 1.2


def true_model(app: str, gpu_type: str):
    """What a job of ``app`` runs at on ``gpu_type``: Sia's table there, its step times scaled by the
    model's slowdown. What a profile of the job on that type would measure."""
    return _true_model(app, gpu_type)


@cache
def _true_model(app, gpu_type):
    slow = SIA_SLOWDOWN.get(app, DEFAULT_SLOWDOWN)
    return OnType(sia_model(app, gpu_type), 1.0 / slow, gpu_type, "measured")


def type_models(w: WorkloadJob, model) -> dict:
    """A job's true table on each type of the cluster."""
    return {t: true_model(w.spec.profile, t) for _, _, t in SIA_CLUSTER}


PROFILE_S = 60.0  # a bootstrap profile's steps per type, after its restart
PROFILE_WEIGHT = 4.0  # a profile's ratio counts as this many jobs' reports (several batches measured)


def _one_gpu_batches(app: str) -> list[int]:
    """The per-GPU batches ``app``'s table measured on one GPU (what a bootstrap profile measures)."""
    c = sia_model(app, "aws").curves.get((1, 1))
    return sorted({int(x) for x in c.lb}) if c is not None else [32]


class Known(OnType):
    """A job's model as its own reports make it (``Learner``): ``inner`` scaled by ``ratio`` to
    ``gpu_type`` (1 where it measured), with its tables on the other types it measured (``on_type``)."""

    def __init__(self, inner, ratio, gpu_type, provenance, by_type):
        super().__init__(inner, ratio, gpu_type, provenance)
        self.by_type = by_type

    def on_type(self, gpu_type: str):
        return self.by_type.get(gpu_type)


class Profiled:
    """What a ``profiled`` run tells the policy (Sia's bootstrap, its cost not charged): every job's
    true table on every type, the one it runs on included."""

    def model_now(self, record, model, backend):
        j = backend.jobs[record.job_id]
        app = app_of(model)
        if not j.nodes or app is None:
            return model
        return true_model(app, backend.node_type[j.nodes[0]])

    def model_for_type(self, record, spec, model, gpu_type, home=""):
        app = app_of(model)
        return true_model(app, gpu_type) if app is not None and gpu_type in SIA_TYPES else None


class Learner:
    """What the daemon knows of a job's speed per type, learned as it learns it (``job`` knowledge).

    A job knows its own model (its ``profile=``: Pollux's T4 table, without Sia's slowdown) until it
    trains on a type; from then on it knows its true table there (what its reports give the daemon,
    daemon/models.py). With ``share`` (the default), what one job measured on a type serves the other
    jobs of its family (same ``profile=``) as well, as the profile itself serves them on its own type;
    in this simulator jobs of one family run at the same table, so sharing is exact here, optimistic
    where jobs of one profile differ. Per-type models go through the daemon's rule, ``profiles.types.model_on_type``
    with one ``TypeRatios`` for the cluster: a type it measured, else its measured (or prior) model
    scaled by the ratio the cluster's jobs measured between the two types (same app first: ``family``),
    shrunk toward the prior. A job that trained on two types gives the cluster its ratio, the geometric
    mean over the configurations it ran at of its tables there (what ``measured_pairs`` gives where the
    daemon has points at the same configuration on both)."""

    def __init__(self, bootstrap: bool = False, share: bool = True):
        self.ratios = TypeRatios()
        self.runs: dict = {}  # job id -> {type: configurations (gpus, nodes, local, accum) it trained at}
        self.family: dict = {}  # app -> types a job of it trained on (share=True)
        self.share = share
        self.last: dict = {}  # job id -> the type it trained on last
        self._cache: dict = {}
        self.bootstrap = bootstrap
        self.profiled: set = set()  # families profiled (bootstrap)
        self.profile_gpu_s = 0.0  # GPU-seconds the profiles cost

    def _profile(self, j, app: str) -> None:
        """Sia-style bootstrap, once per model family: the first job of ``app`` is profiled on one GPU of
        every type (its restart, then :data:`PROFILE_S` of steps at the 1-GPU batches of its table) before
        it starts; the ratios it measures enter the cluster's ``TypeRatios`` for that family, weighing
        :data:`PROFILE_WEIGHT` jobs. Charged: its first start waits the longest type's profile (types in
        parallel) holding the GPUs it starts on, and the profile's GPU-seconds are counted."""
        self.profiled.add(app)
        types = [t for _, _, t in SIA_CLUSTER]
        batches = _one_gpu_batches(app)
        rates = {t: [true_model(app, t).samples_per_s(1, 1, lb, 1) for lb in batches] for t in types}
        for i, a in enumerate(types):
            for b in types[i + 1:]:
                r = float(np.exp(np.mean(np.log(np.array(rates[b]) / np.array(rates[a])))))
                self.ratios.observe(("profile", app, a, b), a, b, r, family=app, weight=PROFILE_WEIGHT)
        each = (j.startup_s or 0.0) + PROFILE_S
        self.profile_gpu_s += each * len(types)
        j.startup_s = (j.startup_s or 0.0) + each

    def _observe(self, j, backend) -> str:
        """The type the job is on now ("" none); records a configuration it trains at."""
        if not j.nodes:
            return ""
        t = backend.node_type[j.nodes[0]]
        if j.phase == "training" and j.rate > 0:
            runs = self.runs.setdefault(j.job_id, {})
            cfg = (j.gpus, j.num_nodes, j.local_batch, j.accum)
            new_type = t not in runs
            runs.setdefault(t, set()).add(cfg)
            self.last[j.job_id] = t
            self.family.setdefault(app_of(j.model), set()).add(t)
            if new_type and len(runs) > 1:
                app = app_of(j.model)
                for a in runs:
                    if a != t and app is not None:
                        cfgs = runs[a] | runs[t]
                        logs = [np.log(true_model(app, t).samples_per_s(*c) / true_model(app, a).samples_per_s(*c))
                                for c in cfgs]
                        self.ratios.observe(j.job_id, a, t, float(np.exp(np.mean(logs))), family=app)
        return t

    def model_now(self, record, model, backend):
        j = backend.jobs[record.job_id]
        app = app_of(model)
        if self.bootstrap and app is not None and app not in self.profiled and j.first_start is None:
            self._profile(j, app)
        here = self._observe(j, backend) or self.last.get(j.job_id, "")
        measured = self.runs.get(j.job_id, {})
        if app is None:
            return model
        types = set(measured) | (self.family.get(app, set()) if self.share else set())
        by_type = {t: true_model(app, t) for t in types}
        if not here:  # never ran: its family's measurements, else its own model
            if not by_type:
                return model
            here = sorted(by_type)[0]
        if here in by_type:
            base, src, r = by_type[here], here, (1.0, "measured")
        elif by_type:
            src = self.last.get(j.job_id) if self.last.get(j.job_id) in by_type else sorted(by_type)[0]
            base, r = by_type[src], self.ratios.ratio(src, here, app) or (1.0, "unscaled")
        else:
            base, src, r = model, "", self.ratios.ratio("", here, app) or (1.0, "unscaled")
        key = (here, src, tuple(sorted(by_type)), round(r[0], 4))
        hit = self._cache.get(j.job_id)
        if hit is not None and hit[0] == key:
            return hit[1]
        m = Known(base, r[0], here, r[1], by_type)
        self._cache[j.job_id] = (key, m)
        return m

    def model_for_type(self, record, spec, model, gpu_type, home=""):
        return model_on_type(model, gpu_type, home, self.ratios, family=spec.profile or "")


def parse_policy(spec: str):
    """``name[:opt,key=value,...]`` -> (policy, knowledge). ``profiled``/``blind`` set the knowledge."""
    from slurm_elastic.policies import get_policy

    name, _, opts = spec.partition(":")
    knowledge = PEER_KNOWLEDGE.get(name, "job")
    kw = {}
    for o in filter(None, opts.split(",")):
        if o in ("profiled", "bootstrap"):
            knowledge = o
        elif o == "blind":
            knowledge = "job"
        else:
            k, _, v = o.partition("=")
            kw[k] = v
    return get_policy(name, **kw), knowledge


def run(policy_spec: str, n: int, *, restart: str = "sia", data: Path | str = SIA_DATA,
        config: SimConfig | None = None, jobs: list[WorkloadJob] | None = None) -> tuple[SimResult, dict]:
    """One workload under one policy spec: the result and its figures (:func:`hetero_metrics`)."""
    policy, knowledge = parse_policy(policy_spec)
    cfg = config or sia_config(restart=restart)
    wl = jobs if jobs is not None else read_sia_workload(n, restart=restart, data=data)
    know = Profiled() if knowledge == "profiled" else Learner(bootstrap=knowledge == "bootstrap")
    sim = Simulation(wl, policy, cfg, type_models_for_job=type_models, model_for_type=know.model_for_type,
                     model_now=know.model_now)
    res = sim.run()
    m = hetero_metrics(res, wl, cfg)
    prof = getattr(know, "profile_gpu_s", 0.0) / 3600.0 / max(1, len(wl))
    m.update(policy_spec=policy_spec, workload=n, restart=restart, knowledge=knowledge,
             profile_gpu_h_per_job=prof, gpu_h_per_job=m["gpu_h_per_job"] + prof)
    return res, m


def alone_s(w: WorkloadJob, cfg: SimConfig) -> float:
    """The job's run time alone at its requested GPUs and batch on its best type (first start included)."""
    from slurm_elastic.profiles.goodput import pollux_grad_trace

    spec = w.spec
    k, b = spec.requested_gpus, spec.requested_batch
    local, accum = spec.split_batch(k, b)
    eff = 1.0
    if cfg.work_model == "goodput":
        tr = pollux_grad_trace(spec.profile)
        xs = np.linspace(0, w.total_samples, 41)[:-1] + w.total_samples / 80
        eff = float(np.mean([tr.efficiency(b, x) for x in xs]))
    best = np.inf
    for count, size, t in ((c, g, t) for c, g, _, t in cfg.groups):
        if k > count * size:
            continue
        try:
            nodes = spec.placement(k, size)[0]
        except ValueError:  # a count that fills no whole nodes of this size: spread as evenly as it goes
            nodes = -(-k // size)
        rate = true_model(spec.profile, t).samples_per_s(k, nodes, local, accum) * eff
        best = min(best, w.total_samples / rate)
    first = (spec.restart_s if spec.restart_s is not None else cfg.rescale_cost_s) if cfg.first_start_charge else 0.0
    return float(best + first)


def _pct(xs, q):
    return float(np.percentile(xs, q)) if len(xs) else None


def hetero_metrics(res: SimResult, workload: list[WorkloadJob], cfg: SimConfig) -> dict:
    """The run's figures (module docstring); times in seconds, GPU time in GPU-hours."""
    from slurm_elastic.sim.metrics import summarize

    base = summarize(res)
    done = [o for o in res.jobs if o.jct_s is not None]
    jct = np.array([o.jct_s for o in done])
    n = len(res.jobs)
    by_type: dict[str, float] = {}
    for o in res.jobs:
        for t, g in o.gpu_s_by_type.items():
            by_type[t] = by_type.get(t, 0.0) + g
    total_gpu_s = sum(by_type.values())
    alone = {w.name: alone_s(w, cfg) for w in workload if w.spec is not None}
    rho = {o.name: o.jct_s / alone[o.name] for o in done if alone.get(o.name)}
    mixes: dict[str, list[float]] = {}
    for o in done:
        if o.name in rho:
            key = "+".join(sorted(t for t, g in o.gpu_s_by_type.items() if g > 0)) or "-"
            mixes.setdefault(key, []).append(rho[o.name])
    bound = cfg.held_bound_s
    worst = max(done, key=lambda o: o.jct_s, default=None)
    return {
        "jobs": n, "finished": len(done), "stopped": res.stopped,
        "avg_jct_s": float(jct.mean()) if len(jct) else None,
        "p99_jct_s": _pct(jct, 99), "p95_jct_s": _pct(jct, 95),
        "longest_jct_s": float(jct.max()) if len(jct) else None,
        "longest_job": worst.name if worst else None,
        "makespan_s": base["makespan_s"],
        "restarts_per_job": base["rescales_per_job"],
        "moves": int(sum(o.moves for o in res.jobs)),
        "jobs_moved": int(sum(1 for o in res.jobs if o.moves > 0)),
        "gpu_h_per_job": total_gpu_s / 3600.0 / n if n else 0.0,
        "gpu_share_by_type": {t: g / total_gpu_s for t, g in sorted(by_type.items())} if total_gpu_s else {},
        "held_bound_s": bound,
        "held_short_jobs": int(sum(1 for o in res.jobs if bound is not None and o.held_short_s > bound)),
        "held_short_longest_s": float(max((o.held_short_s for o in res.jobs), default=0.0)),
        # by the job's own measured model (sim/checks.py), as in the one-type evaluation
        "held_wrong_jobs": int(base["held_wrong_jobs"]), "held_wrong_max_s": float(base["held_wrong_max_s"]),
        # cycles with GPUs idle while a pending job that fits them waited (sim/checks.py)
        "idle_wait_cycles": int(res.checks.get("idle_wait_cycles", 0)),
        "ftf_median": _pct(list(rho.values()), 50), "ftf_p99": _pct(list(rho.values()), 99),
        "ftf_max": float(max(rho.values())) if rho else None,
        "ftf_by_mix": {k: {"jobs": len(v), "median": float(np.median(v)), "max": float(max(v))}
                       for k, v in sorted(mixes.items())},
        "gpu_utilization": base["gpu_utilization"],
        "sim_wall_s": res.wall_s, "cycles": res.cycles, "policy_solve_s": res.solve_s,
    }


def summary_line(m: dict) -> str:
    """One line per run, for the harness's log and quick comparisons."""
    def h(x):
        return "-" if x is None else f"{x / 3600:.2f}"
    share = " ".join(f"{t}={v:.0%}" for t, v in m["gpu_share_by_type"].items())
    return (f"{m['policy_spec']:<14} w{m['workload']} restart={m['restart']:<4} know={m['knowledge']:<8} "
            f"avg {h(m['avg_jct_s'])} h  p99 {h(m['p99_jct_s'])} h  longest {h(m['longest_jct_s'])} h  "
            f"restarts/job {m['restarts_per_job']:.2f}  moved {m['jobs_moved']}/{m['jobs']} ({m['moves']})  "
            f"GPU-h/job {m['gpu_h_per_job']:.2f} [{share}]  held-short {m['held_short_jobs']}  held-wrong {m['held_wrong_jobs']}  "
            f"idle-while-waiting {m.get('idle_wait_cycles', '-')}  "
            f"ftf max {m['ftf_max'] or 0:.1f}  {m['finished']}/{m['jobs']} done ({m['sim_wall_s']:.0f} s)")
