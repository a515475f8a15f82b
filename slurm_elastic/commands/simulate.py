"""``slurm-elastic simulate``: replay a workload through the scheduler in simulated time.

Examples::

    slurm-elastic simulate --workload ../shared/data/pollux/workloads/workload-1.csv --compare dp,fixed-batch,static
    slurm-elastic simulate --rate 20 --hours 8 --seed 1 --policy dp --json out.json --plot figs/
    slurm-elastic simulate --workload sacct.txt --write-trace trace.csv   # import sacct history

The ``--json`` file is one object keyed by policy name; each value has at least ``jobs_total``,
``jobs_completed``, ``avg_jct_s``, ``median_jct_s``, ``p95_jct_s``, ``avg_queue_s``,
``gpu_utilization`` (0-1) and ``rescales`` (see :mod:`slurm_elastic.sim.metrics` for all keys).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import click


def _policies(policy: str | None, compare: str | None) -> list[str]:
    if compare:
        names = [p.strip() for p in compare.split(",") if p.strip()]
        if not names:
            raise click.BadParameter("give at least one policy", param_hint="--compare")
        return names
    return [policy or "dp"]


def _get_policy(name: str, dp_objective: str = "completion"):
    try:
        from slurm_elastic.policies import get_policy
    except ImportError as e:  # pragma: no cover - the registry ships with the optimizer
        raise click.ClickException(f"the policy registry is not available: {e}") from None
    try:
        if name.strip().lower() == "dp":
            return get_policy(name, objective=dp_objective)
        return get_policy(name)
    except (KeyError, ValueError) as e:
        raise click.ClickException(str(e.args[0] if e.args else e)) from None


@click.command(name="simulate")
@click.option("--workload", "workload_path", type=click.Path(exists=True, dir_okay=False),
              help="Workload file: Pollux CSV, our trace CSV, or sacct -P output (told apart by the header).")
@click.option("--format", "fmt", type=click.Choice(["auto", "pollux", "trace", "sacct"]), default="auto",
              show_default=True, help="Workload file format.")
@click.option("--rate", type=float, help="Synthetic workload: Poisson arrivals, jobs per hour.")
@click.option("--jobs", "n_jobs", type=click.IntRange(min=1), help="Synthetic: number of jobs.")
@click.option("--hours", type=click.FloatRange(min=0, min_open=True), help="Synthetic: arrival window in hours.")
@click.option("--mix", help="Synthetic / sacct: app mix, e.g. 'cifar10=2,bert=1' (default: the Pollux workloads' mix).")
@click.option("--seed", type=int, default=0, show_default=True, help="Seed of the synthetic generator / sacct app draw.")
@click.option("--sacct-static", is_flag=True, help="sacct import: keep jobs non-elastic (static, their own run time).")
@click.option("--policy", help="One policy (default dp).")
@click.option("--compare", help="Several policies, comma-separated, e.g. dp,fixed-batch,static.")
@click.option("--nodes", type=click.IntRange(min=1), default=16, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(min=1), default=4, show_default=True)
@click.option("--interval", type=click.FloatRange(min=0, min_open=True), default=60.0, show_default=True,
              help="Scheduling interval (s), the daemon's polling period.")
@click.option("--checkpoint-s", type=click.FloatRange(min=0), default=1.5, show_default=True,
              help="Time from USR2 to the checkpoint ack (s).")
@click.option("--restart-s", type=click.FloatRange(min=0), default=10.5, show_default=True,
              help="Time from release to training at the new size (s).")
@click.option("--startup-s", type=click.FloatRange(min=0), default=0.0, show_default=True,
              help="Start-up time of a job's first start (s), the same under every policy.")
@click.option("--cooldown", type=click.FloatRange(min=0), default=300.0, show_default=True,
              help="Minimum time between two rescales of one job (s).")
@click.option("--max-in-flight", type=click.IntRange(min=1), default=8, show_default=True)
@click.option("--horizon", type=click.FloatRange(min=0, min_open=True),
              help="Stop at this time (s) and count the jobs completed by then (default: run to completion).")
@click.option("--json", "json_out", type=click.Path(dir_okay=False, allow_dash=True),
              help="Write the metrics, keyed by policy name, to this file ('-' for stdout).")
@click.option("--plot", "plot_dir", type=click.Path(file_okay=False), help="Write PNG figures into this folder.")
@click.option("--write-trace", type=click.Path(dir_okay=False),
              help="Write the workload in our trace CSV format to this file and exit.")
@click.option("--work-model", type=click.Choice(["samples", "goodput"]), default="samples", show_default=True,
              help="samples: a job needs its total samples at any batch (the paper's model); goodput: progress "
                   "is samples x the app's statistical efficiency at its batch (Pollux validation data).")
@click.option("--dp-objective", type=click.Choice(["completion", "goodput", "pnorm", "throughput"]), default="completion",
              show_default=True, help="What the dp policy maximises.")
@click.option("--sweep", help="Synthetic arrival-rate sweep: comma-separated rates (jobs/h), instead of --rate.")
@click.option("--progress/--no-progress", default=None, help="Progress bar on stderr (default: when stderr is a terminal).")
def simulate(workload_path, fmt, rate, n_jobs, hours, mix, seed, sacct_static, policy, compare, nodes, gpus_per_node,
             interval, checkpoint_s, restart_s, startup_s, cooldown, max_in_flight, horizon, json_out, plot_dir,
             write_trace, work_model, dp_objective, sweep, progress):
    """Replay a workload through the scheduler (the daemon's planner and policies) in simulated time."""
    from slurm_elastic.planner import PlannerConfig
    from slurm_elastic.sim import workloads as wl
    from slurm_elastic.sim.engine import SimConfig, Simulation
    from slurm_elastic.sim.metrics import summarize
    from slurm_elastic.sim.report import table

    if policy and compare:
        raise click.UsageError("give --policy or --compare, not both")
    if sweep:
        return _sweep(sweep, n_jobs, hours, mix, seed, policy, compare, nodes, gpus_per_node, interval, checkpoint_s,
                      restart_s, startup_s, cooldown, max_in_flight, horizon, json_out, plot_dir, progress,
                      work_model, dp_objective)
    try:
        mix_d = wl.parse_mix(mix)
        if workload_path:
            if rate is not None:
                raise click.UsageError("give --workload or --rate (synthetic), not both")
            kw = {}
            if fmt == "sacct" or (fmt == "auto" and _looks_like_sacct(workload_path)):
                kw = dict(elastic=not sacct_static, mix=mix_d, seed=seed)
            jobs = wl.load(workload_path, node_size=gpus_per_node, fmt=fmt, **kw)
        elif rate is not None:
            if n_jobs is None and hours is None:
                raise click.UsageError("a synthetic workload needs --jobs or --hours")
            jobs = wl.synthetic(rate_per_h=rate, seed=seed, jobs=n_jobs, hours=hours, mix=mix_d,
                                node_size=gpus_per_node, max_gpus=nodes * gpus_per_node)
        else:
            raise click.UsageError("give --workload PATH or a synthetic workload (--rate with --jobs or --hours)")
    except (wl.WorkloadError, ValueError, KeyError) as e:
        raise click.ClickException(str(e)) from None
    if write_trace:
        wl.write_trace(jobs, write_trace)
        click.echo(f"wrote {len(jobs)} jobs to {write_trace}", err=True)
        return
    if not jobs:
        raise click.ClickException("the workload has no jobs")
    cfg = SimConfig(
        nodes=nodes, gpus_per_node=gpus_per_node, interval_s=interval, checkpoint_s=checkpoint_s,
        restart_s=restart_s, startup_s=startup_s, horizon_s=horizon,
        planner=PlannerConfig(cooldown_s=cooldown, max_in_flight=max_in_flight), work_model=work_model,
    )
    names = _policies(policy, compare)
    pols = {n: _get_policy(n, dp_objective) for n in names}
    show = sys.stderr.isatty() if progress is None else progress
    results, metrics = {}, {}
    for name, pol in pols.items():
        sim = Simulation(jobs, pol, cfg)
        res = _run(sim, len(jobs), f"{name:>12}", show)
        results[name] = res
        metrics[name] = summarize(res)
    click.echo(table(metrics))
    if json_out:
        _write_json(metrics, json_out)
    if plot_dir:
        from slurm_elastic.sim import report

        try:
            d = Path(plot_dir)
            d.mkdir(parents=True, exist_ok=True)
            report.plot_jct_cdf(results, d / "jct_cdf.png")
            report.plot_utilization(results, d / "utilization.png")
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"figures in {d}/ (jct_cdf.png, utilization.png)", err=True)


def _sweep(sweep, n_jobs, hours, mix, seed, policy, compare, nodes, gpus_per_node, interval, checkpoint_s,
           restart_s, startup_s, cooldown, max_in_flight, horizon, json_out, plot_dir, progress, work_model="samples",
           dp_objective="completion"):
    """Run each policy at each arrival rate; JSON: {policy: {"rate_per_h": [...], "runs": [metrics...]}}."""
    from slurm_elastic.planner import PlannerConfig
    from slurm_elastic.sim import workloads as wl
    from slurm_elastic.sim.engine import SimConfig, Simulation
    from slurm_elastic.sim.metrics import summarize
    from slurm_elastic.sim.report import table

    try:
        rates = [float(x) for x in sweep.split(",") if x.strip()]
    except ValueError:
        raise click.BadParameter(f"expected comma-separated numbers, got {sweep!r}", param_hint="--sweep") from None
    if not rates or any(r <= 0 for r in rates):
        raise click.BadParameter("rates must be positive", param_hint="--sweep")
    if n_jobs is None and hours is None:
        raise click.UsageError("a sweep needs --hours (or --jobs)")
    names = _policies(policy, compare)
    pols = {n: _get_policy(n, dp_objective) for n in names}
    cfg = SimConfig(
        nodes=nodes, gpus_per_node=gpus_per_node, interval_s=interval, checkpoint_s=checkpoint_s,
        restart_s=restart_s, startup_s=startup_s, horizon_s=horizon if horizon else (hours * 3600 if hours else None),
        planner=PlannerConfig(cooldown_s=cooldown, max_in_flight=max_in_flight), work_model=work_model,
    )
    out = {n: {"rate_per_h": rates, "runs": []} for n in names}
    show = sys.stderr.isatty() if progress is None else progress
    try:
        mix_d = wl.parse_mix(mix)
    except ValueError as e:
        raise click.ClickException(str(e)) from None
    for rate in rates:
        jobs = wl.synthetic(rate_per_h=rate, seed=seed, jobs=n_jobs, hours=hours, mix=mix_d,
                            node_size=gpus_per_node, max_gpus=nodes * gpus_per_node)
        ms = {}
        for name, pol in pols.items():
            sim = Simulation(jobs, pol, cfg)
            res = _run(sim, len(jobs), f"{rate:g}/h {name:>12}", show)
            ms[name] = summarize(res)
            out[name]["runs"].append(ms[name])
        click.echo(f"rate {rate:g} jobs/h ({len(jobs)} jobs)")
        click.echo(table(ms))
    if json_out:
        _write_json(out, json_out)
    if plot_dir:
        from slurm_elastic.sim import report

        try:
            d = Path(plot_dir)
            d.mkdir(parents=True, exist_ok=True)
            report.plot_sweep(rates, {n: out[n]["runs"] for n in names}, d / "sweep.png")
        except RuntimeError as e:
            raise click.ClickException(str(e)) from None
        click.echo(f"figure in {d}/sweep.png", err=True)


def _looks_like_sacct(path: str) -> bool:
    with open(path) as f:
        for line in f:
            if line.strip() and not line.lstrip().startswith("#"):
                return "|" in line and "JobID" in line
    return False


def _run(sim, n_jobs: int, label: str, show: bool):
    """Run one simulation, with a progress bar on stderr when asked."""
    if not show:
        return sim.run()
    with click.progressbar(length=n_jobs, label=label, file=sys.stderr) as bar:
        return sim.run(progress=bar.update)


def _write_json(obj, json_out: str) -> None:
    """``--json OUT``: the results as one JSON object, to a file or (``-``) to stdout."""
    text = json.dumps(obj, indent=2, sort_keys=True)
    if json_out == "-":
        click.echo(text)
    else:
        Path(json_out).write_text(text + "\n")
