"""Regenerate docs/EVALUATION.md: the paper's claim measured with the simulator.

    python -m slurm_elastic.sim.evaluate            # writes docs/EVALUATION.md and docs/figures/sim_*.png
    python -m slurm_elastic.sim.evaluate --quick    # a smaller run (fewer workloads and rates) to try it

Every run goes through ``Simulation`` -> ``enact.run_cycle`` -> ``policies.get_policy(name)`` ->
``planner.plan`` -> ``SimulatedSlurm``: the daemon's code path. The Pollux workloads are read from
``../shared/data/pollux`` beside the repository (``--pollux DIR`` to point elsewhere).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from dataclasses import replace
from pathlib import Path

from slurm_elastic.policies import get_policy
from slurm_elastic.sim import report
from slurm_elastic.sim.engine import SimConfig, SimResult, Simulation
from slurm_elastic.sim.metrics import summarize
from slurm_elastic.sim.workloads import read_pollux, synthetic

POLICIES = ("dp", "fixed-batch", "static")
REPO = Path(__file__).resolve().parents[2]
HORIZON_S = 8 * 3600.0  # the Pollux traces and the synthetic sweep submit jobs over 8 hours


def completed_by(res: SimResult, t: float) -> int:
    return sum(1 for j in res.jobs if j.end_s is not None and j.end_s <= t)


def run(jobs, policy: str, cfg: SimConfig, **options) -> tuple[SimResult, dict]:
    res = Simulation(jobs, get_policy(policy, **options), cfg).run()
    m = summarize(res)
    m["completed_by_8h"] = completed_by(res, HORIZON_S)
    return res, m


def h(x):
    return "-" if x is None else f"{x / 3600:.2f}"


def ratio(a, b):
    if a is None or b is None or b == 0:
        return "-"
    return f"{a / b:.2f}x"


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def pollux_section(pollux: Path, figs: Path, quick: bool, cfg: SimConfig) -> tuple[str, dict]:
    sets = [("workloads", "160 jobs")] + ([] if quick else [("workloads-2.0", "320 jobs")])
    numbers = range(1, 3) if quick else range(1, 6)
    lines = []
    agg: dict = {}
    first_results = None
    for folder, label in sets:
        rows = []
        sums = {p: {"jct": 0.0, "done": 0, "n": 0} for p in POLICIES}
        for n in numbers:
            path = pollux / folder / f"workload-{n}.csv"
            jobs = read_pollux(path, node_size=cfg.gpus_per_node)
            results = {}
            for p in POLICIES:
                res, m = run(jobs, p, cfg)
                results[p] = res
                log(f"pollux {folder}/workload-{n} {p}: avg JCT {h(m['avg_jct_s'])} h, {m['completed_by_8h']} by 8 h, "
                    f"{m['sim_wall_s']:.1f} s")
                rows.append([f"{folder}/workload-{n}", p, m["completed_by_8h"], f"{m['jobs_completed']}/{m['jobs_total']}",
                             h(m["avg_jct_s"]), h(m["median_jct_s"]), h(m["p95_jct_s"]), h(m["avg_queue_s"]),
                             f"{m['gpu_utilization']:.2f}", m["rescales"], h(m["makespan_s"])])
                agg.setdefault("_per_workload", []).append((folder, n, p, m["avg_jct_s"], m["completed_by_8h"]))
                sums[p]["jct"] += m["avg_jct_s"]
                sums[p]["done"] += m["completed_by_8h"]
                sums[p]["n"] += 1
            if first_results is None:
                first_results = results
        lines.append(f"### `{folder}/` ({label} each, 8 h of arrivals)\n")
        lines.append(report.markdown_table(
            ["workload", "policy", "done by 8 h", "done (end)", "avg JCT h", "median JCT h", "p95 JCT h",
             "avg queue h", "GPU util", "rescales", "makespan h"], rows))
        mean = {p: (sums[p]["jct"] / sums[p]["n"], sums[p]["done"] / sums[p]["n"]) for p in POLICIES}
        agg[folder] = mean
        lines.append("")
        lines.append(report.markdown_table(
            ["mean over workloads", "avg JCT h", "done by 8 h", "JCT ratio to dp", "done-by-8h ratio dp / this"],
            [[p, h(mean[p][0]), f"{mean[p][1]:.1f}", ratio(mean[p][0], mean["dp"][0]),
              ratio(mean["dp"][1], mean[p][1])] for p in POLICIES]))
        lines.append("")
    if report.have_matplotlib() and first_results is not None:
        report.plot_jct_cdf(first_results, figs / "sim_pollux_jct_cdf.png", "Pollux workload-1: JCT CDF (64 GPUs)")
        report.plot_utilization(first_results, figs / "sim_pollux_utilization.png", "Pollux workload-1: GPUs allocated")
        lines.append("![JCT CDF, Pollux workload-1](figures/sim_pollux_jct_cdf.png)\n")
        lines.append("![GPU utilization over time, Pollux workload-1](figures/sim_pollux_utilization.png)\n")
    return "\n".join(lines), agg


def sweep_section(figs: Path, quick: bool, cfg: SimConfig, seed: int) -> tuple[str, dict]:
    rates = [5.0, 25.0, 100.0] if quick else [5.0, 10.0, 25.0, 50.0, 100.0, 200.0]
    out = {p: [] for p in POLICIES}
    rows = []
    for rate in rates:
        jobs = synthetic(rate_per_h=rate, hours=HORIZON_S / 3600, seed=seed, node_size=cfg.gpus_per_node,
                         max_gpus=cfg.total_gpus)
        ms = {}
        for p in POLICIES:
            _, m = run(jobs, p, cfg)
            ms[p] = m
            out[p].append(m)
            log(f"sweep {rate:g}/h ({len(jobs)} jobs) {p}: {m['completed_by_8h']} by 8 h, avg JCT {h(m['avg_jct_s'])} h, "
                f"{m['sim_wall_s']:.1f} s")
        d, f, s = ms["dp"], ms["fixed-batch"], ms["static"]
        rows.append([f"{rate:g}", len(jobs), d["completed_by_8h"], f["completed_by_8h"], s["completed_by_8h"],
                     ratio(d["completed_by_8h"], f["completed_by_8h"]), ratio(d["completed_by_8h"], s["completed_by_8h"]),
                     h(d["avg_jct_s"]), h(f["avg_jct_s"]), h(s["avg_jct_s"]),
                     ratio(f["avg_jct_s"], d["avg_jct_s"]), ratio(s["avg_jct_s"], d["avg_jct_s"]),
                     f"{d['gpu_utilization']:.2f} / {f['gpu_utilization']:.2f} / {s['gpu_utilization']:.2f}"])
    text = report.markdown_table(
        ["rate /h", "jobs", "done 8h dp", "fixed-batch", "static", "dp/fixed", "dp/static",
         "avg JCT h dp", "fixed-batch", "static", "fixed/dp", "static/dp", "GPU util dp / fb / st"], rows)
    if report.have_matplotlib():
        for p in POLICIES:
            for m in out[p]:
                m["jobs_completed_all"] = m["jobs_completed"]
        plot_in = {p: [dict(m, jobs_completed=m["completed_by_8h"]) for m in out[p]] for p in POLICIES}
        report.plot_sweep(rates, plot_in, figs / "sim_sweep.png",
                          f"Synthetic sweep, {cfg.total_gpus} GPUs: jobs done within 8 h and average JCT")
        text += "\n\n![Arrival-rate sweep](figures/sim_sweep.png)\n"
    return text, {"rates": rates, **out}


def sensitivity_section(pollux: Path, quick: bool, cfg: SimConfig) -> str:
    jobs = read_pollux(pollux / "workloads" / "workload-1.csv", node_size=cfg.gpus_per_node)
    costs = [(1.5, 10.5), (10.0, 5.0), (10.0, 35.0), (10.0, 110.0), (30.0, 270.0)] + ([] if quick else [(60.0, 540.0)])
    rows = []
    for ck, rs in costs:
        c = replace(cfg, checkpoint_s=ck, restart_s=rs)
        ms = {p: run(jobs, p, c)[1] for p in POLICIES}
        log(f"sensitivity restart {ck + rs:g} s done")
        rows.append([f"{ck + rs:g} s ({ck:g} + {rs:g})", h(ms["dp"]["avg_jct_s"]), h(ms["fixed-batch"]["avg_jct_s"]),
                     h(ms["static"]["avg_jct_s"]), ratio(ms["fixed-batch"]["avg_jct_s"], ms["dp"]["avg_jct_s"]),
                     ratio(ms["static"]["avg_jct_s"], ms["dp"]["avg_jct_s"]), ms["dp"]["rescales"],
                     ms["fixed-batch"]["rescales"], f"{ms['dp']['gpu_s_lost_to_rescales'] / 3600:.1f}"])
    t1 = report.markdown_table(["rescale cost (checkpoint + restart)", "avg JCT h dp", "fixed-batch", "static",
                                "fixed/dp", "static/dp", "rescales dp", "rescales fb", "GPU-h lost dp"], rows)
    intervals = [30.0, 60.0, 300.0] + ([] if quick else [900.0])
    rows = []
    for iv in intervals:
        c = replace(cfg, interval_s=iv)
        ms = {p: run(jobs, p, c)[1] for p in POLICIES}
        log(f"sensitivity interval {iv:g} s done")
        rows.append([f"{iv:g} s", h(ms["dp"]["avg_jct_s"]), h(ms["fixed-batch"]["avg_jct_s"]), h(ms["static"]["avg_jct_s"]),
                     ratio(ms["fixed-batch"]["avg_jct_s"], ms["dp"]["avg_jct_s"]),
                     ratio(ms["static"]["avg_jct_s"], ms["dp"]["avg_jct_s"]), ms["dp"]["rescales"], ms["dp"]["cycles"]])
    t2 = report.markdown_table(["scheduling interval", "avg JCT h dp", "fixed-batch", "static", "fixed/dp", "static/dp",
                                "rescales dp", "cycles dp"], rows)
    return ("Pollux `workloads/workload-1.csv`, 64 GPUs, other settings at their defaults.\n\n**Rescale cost.**\n\n" + t1
            + f"\n\n**Scheduling interval** (rescale cost {cfg.checkpoint_s + cfg.restart_s:g} s).\n\n" + t2 + "\n")


def goodput_section(pollux: Path, quick: bool, cfg: SimConfig) -> str:
    """The optional work model: progress = samples x statistical efficiency at the batch."""
    c = replace(cfg, work_model="goodput")
    runs = [("dp (objective goodput)", "dp", {"objective": "goodput"}), ("dp (objective throughput)", "dp", {}),
            ("fixed-batch", "fixed-batch", {}), ("static", "static", {})]
    numbers = range(1, 3) if quick else range(1, 6)
    sums = {label: [0.0, 0.0, 0] for label, _, _ in runs}
    for n in numbers:
        jobs = read_pollux(pollux / "workloads" / f"workload-{n}.csv", node_size=cfg.gpus_per_node)
        for label, pol, opts in runs:
            _, m = run(jobs, pol, c, **opts)
            sums[label][0] += m["avg_jct_s"]
            sums[label][1] += m["completed_by_8h"]
            sums[label][2] += 1
        log(f"goodput workload-{n} done")
    ref = sums["dp (objective goodput)"][0] / sums["dp (objective goodput)"][2]
    rows = [[label, h(v[0] / v[2]), f"{v[1] / v[2]:.1f}", ratio(v[0] / v[2], ref)] for label, v in sums.items()]
    return (f"Pollux `workloads/workload-{numbers[0]}..{numbers[-1]}`, work model `goodput`: a job's total is "
            "N x epochs samples at its app's initial batch, and progress accrues at samples/s x the app's "
            "statistical efficiency at the batch it runs (Pollux validation data), so large batches need more "
            "samples. Means over the workloads.\n\n"
            + report.markdown_table(["policy", "avg JCT h", "done by 8 h", "JCT ratio to dp (goodput)"], rows) + "\n")


def speed_section(pollux: Path, cfg: SimConfig, quick: bool) -> str:
    jobs = read_pollux(pollux / "workloads" / "workload-1.csv", node_size=cfg.gpus_per_node)
    rows = []
    for label in ("first run in the process (loads numba's cache or compiles)", "second run (warm)"):
        t0 = time.perf_counter()
        res, m = run(jobs, "dp", cfg)
        rows.append([f"Pollux workload-1, 160 jobs, 64 GPUs, dp: {label}", f"{time.perf_counter() - t0:.2f}",
                     f"{res.solve_s:.2f}", res.cycles])
    n_jobs = 2000 if quick else 10_000
    big = replace(cfg, nodes=256)
    t0 = time.perf_counter()
    syn = synthetic(rate_per_h=200.0, jobs=n_jobs, seed=1, node_size=big.gpus_per_node, max_gpus=big.total_gpus)
    gen_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    res, m = run(syn, "dp", big)
    rows.append([f"synthetic {n_jobs:,} jobs at 200/h, 1,024 GPUs (256 x 4), dp (generation {gen_s:.1f} s not included)",
                 f"{time.perf_counter() - t0:.1f}", f"{res.solve_s:.1f}", res.cycles])
    log("speed done")
    text = report.markdown_table(["run", "wall s", "of which policy.allocate s", "cycles"], rows)
    text += (f"\n\nMeasured on this machine: {os.cpu_count()} CPUs, Python {platform.python_version()}, "
             f"{platform.machine()}; single-threaded. The {n_jobs:,}-job run completed {m['jobs_completed']:,} jobs "
             f"with {m['rescales']:,} rescales over {h(m['makespan_s'])} h of simulated time.\n")
    return text


HEADER = """# Evaluation: does elastic (GPUs, batch) scheduling beat the baselines?

Generated by `python -m slurm_elastic.sim.evaluate` (about {minutes:.0f} minutes on this machine); do not edit by
hand. Every number below comes from the simulator driving the daemon's own code path:
`Simulation` -> `enact.run_cycle` -> `problem.build_problem` -> `policies.get_policy(name).allocate` ->
`planner.plan` -> `Enactor` -> `backends.simulated.SimulatedSlurm` (see `tests/unit/test_sim_real_path.py`,
which spies on the planner and the policy during a simulation).

Settings unless a table says otherwise: {nodes} nodes x {gpn} GPUs = {gpus} GPUs; scheduling interval {interval:g} s;
a rescale costs {ck:g} s of checkpoint (USR2 to ack, GPUs held) + {rs:g} s of restart (release to training,
GPUs held) = {total:g} s (the real path as measured on the local cluster, docs/MEASUREMENTS.md); first starts cost
nothing under every policy; rescale cooldown {cool:g} s; at most {mif} rescales in flight. Work model: a job
completes when it has processed its total samples (the paper's model): Pollux jobs N x epochs of their app;
synthetic jobs what their Philly duration would process at their requested size. Throughput from the
measured Pollux profiles (`slurm_elastic.profiles`), the same model the policy plans with. Policies:
`dp` (GPU count and batch, exact DP), `fixed-batch` (elastic GPU count at the requested batch, the paper's
baseline), `static` (FIFO at the requested GPUs and batch, never resized). "done by 8 h" counts jobs
finished within the 8 hours of arrivals; JCT figures come from running every job to completion.
"""


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default=str(REPO / "docs" / "EVALUATION.md"))
    ap.add_argument("--figures", default=None, help="figure folder (default: figures/ beside --out)")
    ap.add_argument("--pollux", default=str(REPO.parent / "shared" / "data" / "pollux"))
    ap.add_argument("--quick", action="store_true", help="fewer workloads, rates and a 2,000-job speed run")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args(argv)
    pollux = Path(args.pollux)
    if not (pollux / "workloads" / "workload-1.csv").exists():
        print(f"Pollux workloads not found under {pollux} (use --pollux DIR)", file=sys.stderr)
        return 2
    out = Path(args.out)
    figs = Path(args.figures) if args.figures else out.parent / "figures"
    figs.mkdir(parents=True, exist_ok=True)
    cfg = SimConfig()
    t0 = time.perf_counter()
    speed = speed_section(pollux, cfg, args.quick)  # first, so that "first run" is the process's first dp run
    pol_text, agg = pollux_section(pollux, figs, args.quick, cfg)
    sweep_text, sweep = sweep_section(figs, args.quick, cfg, args.seed)
    sens = sensitivity_section(pollux, args.quick, cfg)
    good = goodput_section(pollux, args.quick, cfg)
    minutes = (time.perf_counter() - t0) / 60
    doc = [HEADER.format(minutes=minutes, nodes=cfg.nodes, gpn=cfg.gpus_per_node, gpus=cfg.total_gpus,
                         interval=cfg.interval_s, ck=cfg.checkpoint_s, rs=cfg.restart_s, total=cfg.rescale_cost_s,
                         cool=cfg.planner.cooldown_s, mif=cfg.planner.max_in_flight)]
    doc.append(findings(agg, sweep))
    doc.append("## 1. Pollux workloads (64 GPUs, 16 nodes x 4)\n")
    doc.append(pol_text)
    doc.append(f"## 2. Arrival-rate sweep (synthetic, seed {args.seed}, 8 h of Poisson arrivals, Pollux app mix, "
               "Philly sizes)\n")
    doc.append("Done-by-8h ratios are dp's count over the baseline's; JCT ratios are the baseline's average over dp's.\n")
    doc.append(sweep_text)
    doc.append("## 3. Sensitivity to the rescale cost and the scheduling interval\n")
    doc.append(sens)
    doc.append("## 4. Optional work model: statistical efficiency (goodput)\n")
    doc.append(good)
    doc.append("## 5. Simulator speed\n")
    doc.append(speed)
    doc.append(REGEN)
    out.write_text("\n".join(doc))
    log(f"wrote {out} and figures in {figs}/ in {minutes:.1f} min")
    return 0


def findings(agg: dict, sweep: dict) -> str:
    per = agg.pop("_per_workload", [])
    lines = ["## Findings\n"]
    for folder, mean in agg.items():
        d, f, s = mean["dp"], mean["fixed-batch"], mean["static"]
        lines.append(f"- Pollux `{folder}/` (mean over the workloads): dp's average JCT is {h(d[0])} h against "
                     f"{h(f[0])} h for fixed-batch ({ratio(f[0], d[0])}) and {h(s[0])} h for static ({ratio(s[0], d[0])}); "
                     f"jobs done within 8 h: {d[1]:.1f} vs {f[1]:.1f} ({ratio(d[1], f[1])}) and {s[1]:.1f} ({ratio(d[1], s[1])}).")
    jct = {(fo, n, p): j for fo, n, p, j, _ in per}
    pairs = sorted({(fo, n) for fo, n, _, _, _ in per})
    fb_wins = [f"{fo}/workload-{n}" for fo, n in pairs if jct[(fo, n, "fixed-batch")] < jct[(fo, n, "dp")]]
    best_static = max(pairs, key=lambda k: jct[(*k, "static")] / jct[(*k, "dp")]) if pairs else None
    if best_static:
        lines.append(f"- Per Pollux workload, the largest average-JCT ratio static/dp is "
                     f"{jct[(*best_static, 'static')] / jct[(*best_static, 'dp')]:.2f}x ({best_static[0]}/workload-"
                     f"{best_static[1]}); fixed-batch has a lower average JCT than dp on {len(fb_wins)} of "
                     f"{len(pairs)} workloads{' (' + ', '.join(fb_wins) + ')' if fb_wins else ''}.")

    def best(other, key):
        rows = list(zip(sweep["rates"], sweep["dp"], sweep[other], strict=True))
        return max(rows, key=key)

    bd = best("fixed-batch", lambda x: x[1]["completed_by_8h"] / max(1, x[2]["completed_by_8h"]))
    bj = best("fixed-batch", lambda x: (x[2]["avg_jct_s"] or 0) / (x[1]["avg_jct_s"] or 1))
    bs = best("static", lambda x: (x[2]["avg_jct_s"] or 0) / (x[1]["avg_jct_s"] or 1))
    bds = best("static", lambda x: x[1]["completed_by_8h"] / max(1, x[2]["completed_by_8h"]))
    rd = bd[1]["completed_by_8h"] / max(1, bd[2]["completed_by_8h"])
    rj = (bj[2]["avg_jct_s"] or 0) / (bj[1]["avg_jct_s"] or 1)
    rjs = (bs[2]["avg_jct_s"] or 0) / (bs[1]["avg_jct_s"] or 1)
    rds = bds[1]["completed_by_8h"] / max(1, bds[2]["completed_by_8h"])
    lines.append(f"- Sweep: dp over fixed-batch at most {rd:.2f}x jobs done within 8 h (at {bd[0]:g} jobs/h) and "
                 f"{rj:.2f}x lower average JCT (at {bj[0]:g} jobs/h); over static at most {rds:.2f}x jobs done "
                 f"(at {bds[0]:g} jobs/h) and {rjs:.2f}x lower average JCT (at {bs[0]:g} jobs/h).")
    pol_done = max((m["dp"][1] / max(1e-9, m["fixed-batch"][1]) for m in agg.values()), default=0)
    pol_jct = max((m["fixed-batch"][0] / max(1e-9, m["dp"][0]) for m in agg.values()), default=0)
    pol_done_s = max((m["dp"][1] / max(1e-9, m["static"][1]) for m in agg.values()), default=0)
    pol_jct_s = max((m["static"][0] / max(1e-9, m["dp"][0]) for m in agg.values()), default=0)
    top_f = (max(rd, pol_done), max(rj, pol_jct))
    top_s = (max(rds, pol_done_s), max(rjs, pol_jct_s))

    def verdict(x, goal):
        return f"reaches {goal}x ({x:.2f}x)" if x >= goal else f"does not reach {goal}x (at most {x:.2f}x)"

    lines.append(f"- **The paper's headline** (up to 2x more jobs completed and up to 10x lower average JCT than "
                 f"fixed-batch): against fixed-batch this measurement {verdict(top_f[0], 2)} on jobs completed and "
                 f"{verdict(top_f[1], 10)} on average JCT. Against static (Slurm-like FIFO at the requested size) it "
                 f"{verdict(top_s[0], 2)} on jobs completed and {verdict(top_s[1], 10)} on average JCT "
                 f"(means over a workload set or sweep points).")
    lines.append(WHY)
    return "\n".join(lines) + "\n"


WHY = """
Why, as far as these runs show:

- **Fixed-batch is a strong baseline here.** It is elastic in GPU count and shares everything else with
  dp: the planner, admission in priority order, the placement gate, the restart costs and the cooldown.
  Most of the gain over static is elasticity itself (idle GPUs go to running jobs, queues drain faster),
  which fixed-batch has too. The Pollux traces ask for batches that split over many GPUs (cifar10 at
  2048 runs on up to 64 GPUs at 32 per GPU), so fixed-batch scales nearly as far as dp there.
- **dp's extra freedom is the batch**, and it pays where the requested batch caps the GPU count: in the
  light-load end of the sweep, where one-GPU Philly-sized jobs keep a small batch under fixed-batch
  (cifar10 at 256 can grow to 8 GPUs at most); that is where dp's JCT gain over fixed-batch is largest.
- **Under overload both elastic policies keep nearly every GPU busy** (utilization column), and the measured T4 profiles
  scale sub-linearly, so the best use of a full cluster is many jobs at small sizes under both elastic
  policies: the ratios tend to 1 as the load grows, while static, which cannot shrink jobs to admit
  more, falls behind (the 320-job Pollux traces show the largest gaps to static).
- **dp maximizes the total weighted speedup, not JCT**, and does not look at remaining work. How it then
  spreads GPUs differs from fixed-batch's greedy marginal gain (in a diagnostic run of workload-2, not
  tabulated, cifar10 jobs peaked at 2.2 GPUs on average under dp against 4.4 under fixed-batch); on the
  workloads listed above that costs dp some average JCT.
- **Restart cost**: dp's gain over fixed-batch shrinks as rescales get dearer (section 3) and vanishes
  around 10 minutes per rescale; the scheduling interval matters little up to 5 minutes.
- The paper's 10x over fixed-batch is not reproduced; its profiles, its baseline's implementation and its
  cluster are not ours, and these runs cannot tell which of them made the difference.
"""

REGEN = """## How to regenerate

    pip install -e '.[dev]'                  # matplotlib for the figures
    python -m slurm_elastic.sim.evaluate     # writes docs/EVALUATION.md and docs/figures/sim_*.png

The same experiments one at a time, e.g.:

    slurm-elastic simulate --workload ../shared/data/pollux/workloads/workload-1.csv --compare dp,fixed-batch,static --json out.json --plot figs/
    slurm-elastic simulate --sweep 5,10,25,50,100,200 --hours 8 --seed 1 --compare dp,fixed-batch,static --plot figs/
"""


if __name__ == "__main__":
    sys.exit(main())
