"""Every job's throughput model and progress claim, from what it reports in its ckpt_dir.

The one place where a job's own reports (``throughput.json``) enter the daemon: read through
:mod:`userfiles`, checked by :mod:`reports`, verified against what Slurm showed (:class:`RunEvidence`).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from slurm_elastic.backends.base import JobRecord
from slurm_elastic.claims import ClaimBook, Evidence
from slurm_elastic.daemon.logfmt import note_problem
from slurm_elastic.daemon.oom import OomBook
from slurm_elastic.daemon.reports import ReportError, RunEvidence, validate_report, verify_points
from slurm_elastic.daemon.userfiles import UserFileError
from slurm_elastic.daemon.userfiles import read_json as read_user_json
from slurm_elastic.problem import JobInfo
from slurm_elastic.profiles import Observation, ParametricModel, model_for_spec
from slurm_elastic.profiles.base import ThroughputModel
from slurm_elastic.profiles.learned import JobFacts, LearnedModel, learn
from slurm_elastic.profiles.types import OnType, TypeRatios, measured_pairs, model_on_type
from slurm_elastic.spec import ElasticSpec

MAX_RATIO_JOBS = 2000  # finished jobs whose type ratios the cluster keeps learning from

# The conservative default prior, until a job reports or names a profile: ~0.1 s compute per 100 samples
# per GPU, all-reduce 10 ms + 2 ms per extra GPU, 20 ms more across nodes (about 85% efficiency at 8
# GPUs). Its scale is matched to the job's first report (profiles/learned.py).
DEFAULT_MODEL = ParametricModel([0.01, 0.001, 0.01, 0.002, 0.02, 0.005], name="default")


@dataclass
class ModelRegistry:
    """The model of every job: its prior (profile, declared points, default) and what it reported.

    The report (``throughput.json`` in the job's ckpt_dir: points, noise scale, base batch, first-step
    times per restart) is read through :mod:`userfiles` (no symlinks, FIFOs, foreign files or unbounded
    reads) and checked by :mod:`reports` (finite, in range; points kept only when consistent with how
    long Slurm ran the job on that GPU count). A bad report is that job's problem (``problems``, logged
    once per change); the job keeps its prior. Returns a :class:`LearnedModel` carrying provenance,
    uncertainty and the reported facts. The restart cost is measured from the daemon's signal times
    (:meth:`note_signal`) and the job's first step after the restart; new figures wait in
    :attr:`measured` for the daemon's decision log.
    """

    node_size: int = 4
    evidence: RunEvidence = field(default_factory=RunEvidence)
    _models: dict = field(default_factory=dict)  # job id -> (key, model): same inputs, same object
    sources: dict = field(default_factory=dict)  # job id -> provenance of its model, shown by status
    problems: dict = field(default_factory=dict)  # job id -> what was wrong with its report
    signals: dict = field(default_factory=dict)  # (job id, restart count) -> wall time of the resize signal
    restarts: dict = field(default_factory=dict)  # (job id, restart) -> {"daemon_s", "job_s"}
    measured: list = field(default_factory=list)  # new restart measurements: (job id, restart, figures)
    claims: ClaimBook = field(default_factory=ClaimBook)  # the trust rule over progress and noise scale
    progress: dict = field(default_factory=dict)  # job id -> JobInfo for the policy (problem.JobInfo)
    notes: dict = field(default_factory=dict)  # job id -> what status shows of its claims
    trusted_noise: dict = field(default_factory=dict)  # job id -> its noise scale as far as it is trusted
    owners: dict = field(default_factory=dict)  # job id -> (user, checkpoint dir read): lineage (reports.py)
    # Issue 23: node -> GPU type (the daemon's last node read); job -> type -> (gpus, local, accum) ->
    # Observation (what it reported while running on that type: a point the job later overwrites on
    # another type is kept); job -> the type it last ran on; the type ratios learned across jobs.
    node_types: dict = field(default_factory=dict)
    typed_obs: dict = field(default_factory=dict)
    last_type: dict = field(default_factory=dict)
    ratios: TypeRatios = field(default_factory=TypeRatios)
    oom: OomBook = field(default_factory=OomBook)  # per-type batch limits learned from out-of-memory failures

    def note_nodes(self, nodes) -> None:
        self.node_types = {n.name: n.gpu_type for n in nodes}

    def _type_now(self, job: JobRecord) -> str:
        """The GPU type the job runs on now (its nodes' most common), else the one it last ran on."""
        if job.is_running and job.nodes:
            types = [self.node_types.get(n, "") for n in job.nodes]
            t = max(set(types), key=types.count) if types else ""
            if t:
                self.last_type[job.job_id] = t
                return t
        return self.last_type.get(job.job_id, "")

    def _by_type(self, job: JobRecord, obs: list[Observation], here: str,
                 family: str = "") -> dict[str, list[Observation]]:
        """The job's observations per GPU type: a point new or changed while it runs on ``here`` is
        ``here``'s; one already seen keeps its type (a job's report does not say which type)."""
        book = self.typed_obs.setdefault(job.job_id, {})
        if here and job.is_running:
            known = {(t, k): o.samples_per_s for t, d in book.items() for k, o in d.items()}
            for o in obs:
                key = (o.gpus, o.local_batch, o.accum)
                if not any(known.get((t, key)) == o.samples_per_s for t in book):
                    book.setdefault(here, {})[key] = o
        out = {t: list(d.values()) for t, d in book.items() if d}
        if len(out) > 1:
            for (a, b), r in measured_pairs(out).items():
                self.ratios.observe(job.job_id, a, b, r, family=family, user=job.user or "")
        return out

    def model_for_type(self, job: JobRecord, spec: ElasticSpec, model: ThroughputModel, gpu_type: str,
                       home: str = "") -> ThroughputModel | None:
        """The job's model on ``gpu_type`` (profiles.types.model_on_type) with this cluster's type ratios."""
        return model_on_type(model, gpu_type, home, self.ratios, family=spec.profile or "", user=job.user or "")

    def _trusted(self, job: JobRecord, spec: ElasticSpec, report: dict | None, obs: list[Observation]) -> JobInfo:
        """What the policy ranks the job by: the GPU-seconds Slurm has shown it running (attained service,
        never the job's word) and, from its report, the work it has left and its noise scale, as far as
        the trust rule (:mod:`slurm_elastic.claims`) lets what Slurm saw back them."""
        rates = [o.samples_per_s for o in obs if o.samples_per_s > 0]
        here = [o.samples_per_s for o in obs if job.is_running and o.gpus == job.gpus_total]
        ev = Evidence(running_s=self.evidence.running_seconds(job.job_id),
                      gpus=job.gpus_total if job.is_running else 0,
                      rate=max(here) if here else None, best_rate=max(rates) if rates else None)
        r = report or {}
        t = self.claims.update(job.job_id, job.user, ev, seen=r.get("samples_seen"), total=r.get("total_samples"),
                               noise_scale=r.get("noise_scale"), max_batch=spec.max_batch)
        self.notes[job.job_id] = t.note
        self.trusted_noise[job.job_id] = t.noise_scale  # goes to the model's facts (with its base batch)
        return JobInfo(attained_gpu_s=self.evidence.gpu_seconds(job.job_id), remaining_samples=t.remaining_samples)

    def _problem(self, job_id: int, text: str | None) -> None:
        note_problem(self.problems, job_id, text, "throughput report not used")

    def note_signal(self, job_id: int, restart_count: int | None, when: float) -> None:
        if restart_count is not None:
            self.signals.setdefault((int(job_id), int(restart_count)), when)

    def _report(self, job: JobRecord, spec: ElasticSpec) -> tuple[list[Observation], dict | None, int]:
        """(observations from verified points, the rest of the report, unverified points ignored).

        The report is ``None`` when the job has no directory, ``{}`` when its file was rejected."""
        from slurm_elastic.train.protocol import THROUGHPUT_NAME, parse_report

        d = spec.checkpoint_dir(job.job_id, job.work_dir)
        if not d:
            return [], None, 0
        self.owners[job.job_id] = (job.user, d)
        try:
            data = read_user_json(d, THROUGHPUT_NAME, job.user_id)
            old = None
            if isinstance(data, dict) and data.get("job_id") is not None:
                old = self.evidence.lineage_of(job.job_id, job.user, d, data["job_id"])
            points = validate_report(data, job.job_id, also=old) if data is not None else []
        except UserFileError as e:
            self._problem(job.job_id, f"{e.path}: {e.reason}")
            return [], {}, 0
        except ReportError as e:
            self._problem(job.job_id, f"{d.rstrip('/')}/{THROUGHPUT_NAME}: {e}")
            return [], {}, 0
        except OSError as e:
            self._problem(job.job_id, f"{d}: {e.strerror or e}")
            return [], {}, 0
        report = parse_report(data if isinstance(data, dict) else {})
        report.pop("points", None)
        verified, why = verify_points(points, job.job_id, self.evidence)
        obs = []
        for p in verified:
            k, b, sps = p["gpus"], p["batch"], float(p["samples_per_s"])
            split = spec.split_batch(k, b)
            if split is None:  # the spec cannot run it: no per-GPU batch to model it at (said, not silent)
                why.append(f"{k} GPUs x batch {b}: not a batch the spec runs on {k} GPUs")
                continue
            nodes = 1 if k <= self.node_size else -(-k // self.node_size)
            obs.append(Observation(k, nodes, split[0], split[1], sps))
        self._problem(job.job_id, f"unverified points ignored: {'; '.join(why)[:300]}" if why else None)
        return obs, report, len(why)

    def reported(self, job: JobRecord, spec: ElasticSpec) -> list[Observation]:
        return self._report(job, spec)[0]

    def _restart_s(self, job: JobRecord, starts: list[dict]) -> float | None:
        """Mean measured restart cost: the daemon's signal -> first step when known, else the job's own
        stop -> first step. New measurements are queued in :attr:`measured`."""
        for st in starts:
            r = st["restart_count"]
            key = (job.job_id, r)
            if r < 1 or key in self.restarts:
                continue
            sig = self.signals.get((job.job_id, r - 1))
            daemon_s = st["first_step"] - sig if sig is not None and st["first_step"] > sig else None
            job_s = st["first_step"] - st["stop"] if st.get("stop") and st["first_step"] > st["stop"] else None
            if daemon_s is None and job_s is None:
                continue
            fig = {"daemon_s": daemon_s, "job_s": job_s}
            self.restarts[key] = fig
            self.measured.append((job.job_id, r, fig))
        return self.restart_cost(job.job_id)

    def restart_cost(self, job_id: int) -> float | None:
        """Mean of the job's measured restart costs (daemon's view first), None before any."""
        vals = [f["daemon_s"] if f["daemon_s"] is not None else f["job_s"]
                for (j, _), f in self.restarts.items() if j == job_id]
        return sum(vals) / len(vals) if vals else None

    def __call__(self, job: JobRecord, spec: ElasticSpec) -> ThroughputModel:
        obs, report, unverified = self._report(job, spec)
        self.progress[job.job_id] = self._trusted(job, spec, report, obs)
        starts = (report or {}).get("starts", [])
        facts = JobFacts(noise_scale=self.trusted_noise.get(job.job_id), base_batch=(report or {}).get("base_batch"),
                         restart_s=self._restart_s(job, starts),
                         stepped_restarts=None if report is None else frozenset(st["restart_count"] for st in starts))
        if spec.profile or spec.points:
            prior = model_for_spec(spec, self.node_size, job.job_id)  # SpecError names the job and field
            kind = "profile" if spec.profile else "declared"
        else:
            prior, kind = DEFAULT_MODEL, "prior"
        running = job.gpus_total if job.is_running else 0
        here = self._type_now(job)
        self.oom.observe(job, spec, spec.checkpoint_dir(job.job_id, job.work_dir), here, self.node_size)
        if self.oom.limits.get(job.job_id) or job.job_id in self.oom.restart:
            why, below = self.oom.restart_reason(job)
            self.progress[job.job_id] = replace(self.progress[job.job_id], local_batch_limits=self.oom.of(job.job_id),
                                                restart_now=why, restart_below=below)
        typed = self._by_type(job, obs, here, spec.profile or "") if here else {}
        if here and typed:  # its reports on the type it runs on (else the prior); the others per type
            obs = typed.get(here, [])
        key = (tuple(obs), id(prior), kind, running, spec.min_gpus, facts, here,
               tuple((t, tuple(v)) for t, v in sorted(typed.items())))
        hit = self._models.get(job.job_id)
        if hit is not None and hit[0] == key:
            model = hit[1]
        else:
            src = max(typed, key=lambda t: len(typed[t])) if here and not obs and typed else ""
            if src:  # nothing reported here yet: its reports on ``src``, scaled by the type ratio
                base = learn(prior, kind, typed[src], min_gpus=spec.min_gpus, facts=facts, name=f"job{job.job_id}")
                r = self.ratios.ratio(src, here, spec.profile or "", job.user or "") or (1.0, "unscaled")
                model = LearnedModel(OnType(base, r[0], here, r[1]), provenance=f"{r[1]} from its {src} reports",
                                     uncertainty=base.uncertainty + 0.2, facts=facts, name=f"job{job.job_id}",
                                     max_gpus=max(running, spec.min_gpus) if running else None)
            else:
                model = learn(prior, kind, obs, running_gpus=running, min_gpus=spec.min_gpus, facts=facts,
                              name=f"job{job.job_id}")
            model.gpu_type = here
            for t, o in typed.items():
                if t != here:
                    other = learn(prior, kind, o, min_gpus=spec.min_gpus, facts=facts, name=f"job{job.job_id}")
                    other.gpu_type = t
                    other.provenance = f"measured on {t}: {other.provenance}"
                    model.by_type[t] = other
            self._models[job.job_id] = (key, model)
        note = ""
        if unverified:
            note = f", {unverified} unverified ignored"
        elif job.job_id in self.problems:
            note = " (report rejected)"
        types = f" on {here}" if here and obs else ""
        if model.by_type:
            types += "; also measured on " + ", ".join(sorted(model.by_type))
        self.sources[job.job_id] = model.provenance + types + note + self._progress_note(job.job_id)
        return model

    def _progress_note(self, job_id: int) -> str:
        """What ``status`` shows of the job's progress claim: how far it is, or why it is not used."""
        note = self.notes.get(job_id)
        return f", {note}" if note else ""

    def forget(self, live: set) -> None:
        """Drop what is kept for jobs no longer in Slurm."""
        self._models = {j: v for j, v in self._models.items() if j in live}
        self.claims.forget(live)
        self.notes = {j: v for j, v in self.notes.items() if j in live}
        self.trusted_noise = {j: v for j, v in self.trusted_noise.items() if j in live}
        self.progress = {j: v for j, v in self.progress.items() if j in live}
        self.sources = {j: v for j, v in self.sources.items() if j in live}
        self.problems = {j: v for j, v in self.problems.items() if j in live}
        self.signals = {k: v for k, v in self.signals.items() if k[0] in live}
        self.restarts = {k: v for k, v in self.restarts.items() if k[0] in live}
        self.typed_obs = {j: v for j, v in self.typed_obs.items() if j in live}
        self.last_type = {j: v for j, v in self.last_type.items() if j in live}
        self.oom.forget(live)
        self.ratios.keep_last(MAX_RATIO_JOBS)  # finished jobs' ratios go on teaching the cluster
