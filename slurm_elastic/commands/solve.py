"""``slurm-elastic solve PROBLEM.json``: one allocation problem in, one answer per job out."""

from __future__ import annotations

import json

import click


@click.command("solve")
@click.argument("problem_file", type=click.Path(exists=True, dir_okay=False, allow_dash=True))
@click.option("--policy", "policy_name", type=click.Choice(["dp", "fixed-batch", "static", "pollux-dp", "tiresias"]), default="dp",
              show_default=True, help="Which allocator to run.")
@click.option("--admission", type=click.Choice(["priority", "joint"]), default="joint", show_default=True,
              help="dp only: let the optimiser choose which pending jobs start (the daemon's default), or "
                   "admit them by priority first.")
@click.option("--starvation-s", type=float, default=3600.0, show_default=True,
              help="A pending job blocked this long stops later jobs from passing it.")
@click.option("--objective", type=click.Choice(["completion", "goodput", "pnorm", "throughput"]), default="completion",
              show_default=True, help="dp only: completion (remaining work done per second, goodput), goodput, pnorm (Pollux), throughput (the paper).")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def solve(problem_file, policy_name, admission, starvation_s, objective, as_json):
    """Solve one allocation problem from a JSON file (format: slurm_elastic/policies/problem_json.py;
    examples/problem.json, and examples/problem-pools.json for several pools).

    Prints each job's GPUs, nodes, global batch, per-GPU batch, accumulation steps, expected
    samples/s, pool (several pools) and the reason, then the objective, its proven bound when the
    solver is not exact (several pools), and the solve time.
    """
    from slurm_elastic.policies import get_policy
    from slurm_elastic.policies.problem_json import allocation_to_dict, problem_from_dict
    from slurm_elastic.spec import SpecError

    try:
        with click.open_file(problem_file) as fh:
            data = json.load(fh)
    except (OSError, UnicodeDecodeError) as e:
        raise click.ClickException(f"{problem_file}: cannot read: {e}") from None
    except json.JSONDecodeError as e:
        raise click.ClickException(f"{problem_file}: not valid JSON: {e}") from None
    try:
        problem = problem_from_dict(data)
    except SpecError as e:
        raise click.ClickException(f"{problem_file}: {e}") from None
    options = {"starvation_s": starvation_s}
    if policy_name == "dp":
        options.update(admission=admission, objective=objective)
    elif policy_name in ("static", "tiresias"):
        options = {}
    compile_s = None
    if policy_name == "dp":  # load (or compile) the numba kernel first: not part of the solve time
        from slurm_elastic.policies._mckp import warm_up

        compile_s = warm_up()
    try:
        policy = get_policy(policy_name, **options)
        alloc = policy.allocate(problem)
    except (ValueError, KeyError) as e:
        raise click.ClickException(f"{problem_file}: {e}") from None
    doc = allocation_to_dict(problem, alloc)
    doc["compile_s"] = compile_s
    if as_json:
        click.echo(json.dumps(doc, indent=2))
        return
    rows = [("JOB", "GPUS", "NODES", "BATCH", "LOCAL", "ACCUM", "SAMPLES/S", "REASON")]
    for j in doc["jobs"]:
        rows.append((str(j["id"]), str(j["gpus"]), str(j["nodes"]), str(j["batch"]), str(j["local_batch"]),
                     str(j["accum"]), f"{j['samples_per_s']:.1f}", j["reason"]))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    for r in rows:
        click.echo("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1])
    what = f"objective {objective}" if policy_name == "dp" else "its objective"
    gap = ""
    if doc.get("bound") is not None:
        g = doc["bound"] - doc["objective"]
        gap = f", bound {doc['bound']:.4f} (gap {100 * g / max(abs(doc['bound']), 1e-12):.2g}%)"
    click.echo(
        f"\npolicy {doc['policy']}: {doc['objective']:.4f} ({what}){gap}, "
        f"{doc['gpus_used']}/{doc['total_gpus']} GPUs, solved in {1e3 * doc['solve_s']:.2f} ms"
        + (f" (kernel load/compile {1e3 * compile_s:.0f} ms, not included)" if compile_s is not None else "")
    )
