"""``slurm-elastic cluster up|down|status``: the local multi-node Slurm used by the demo and the tests."""

from __future__ import annotations

import json
import sys

import click

from slurm_elastic.cluster import DEFAULT_STATE_DIR, ClusterConfig, ClusterError, LocalCluster

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=str(DEFAULT_STATE_DIR),
    show_default=True,
    envvar="SLURM_ELASTIC_CLUSTER_DIR",
    help="Directory holding this cluster's config, logs, spool and pids.",
)


@click.group()
def cluster():
    """Run a local multi-node Slurm cluster with fake GPUs (for the demo and the tests)."""


@cluster.command()
@state_dir_option
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option("--cpus-per-node", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--port", type=click.IntRange(1024, 65000), default=16817, show_default=True,
              help="slurmctld port; slurmd ports are the next --nodes ports.")
@click.option("--cred-expire", type=click.IntRange(5, 3600), default=10, show_default=True,
              help="Seconds a requeued job waits before it may start (Slurm's default is 120).")
@click.option("--job-submit-lua", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Load this job_submit.lua into slurmctld (JobSubmitPlugins=lua).")
def up(state_dir, nodes, gpus_per_node, cpus_per_node, port, cred_expire, job_submit_lua):
    """Start slurmctld and one slurmd per node, and wait until every node is idle (a no-op if up)."""
    config = ClusterConfig(nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
                           ctld_port=port, cred_expire=cred_expire, job_submit_lua=job_submit_lua)
    c = LocalCluster(state_dir)
    if c.is_up() and _shape(c.config) != _shape(config):
        raise click.ClickException(
            f"a cluster with another shape is already up in {state_dir}; run 'slurm-elastic cluster down' first"
        )
    c = LocalCluster(state_dir, config)
    try:
        started = c.up()
    except ClusterError as e:
        raise click.ClickException(str(e)) from e
    click.echo(("started" if started else "already up") + f": {nodes} nodes x {gpus_per_node} GPUs")
    click.echo(f"export SLURM_CONF={c.conf_path}")


def _shape(cfg: ClusterConfig):
    return (cfg.nodes, cfg.gpus_per_node, cfg.cpus_per_node, cfg.ctld_port, cfg.cred_expire, cfg.job_submit_lua)


@cluster.command()
@state_dir_option
def down(state_dir):
    """Stop the daemons this cluster started (by pid); files stay in the state dir."""
    stopped = LocalCluster(state_dir).down()
    click.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@cluster.command()
@state_dir_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(state_dir, as_json):
    """Show the cluster's daemons (pids) and its nodes with their GPUs."""
    c = LocalCluster(state_dir)
    try:
        info = c.status()
    except Exception as e:  # a half-up cluster must still be inspectable
        raise click.ClickException(f"cannot read the cluster state: {e}") from e
    if as_json:
        json.dump(info, sys.stdout, indent=2)
        click.echo()
        return
    click.echo(f"state dir : {info['state_dir']}")
    click.echo(f"SLURM_CONF: {info['slurm_conf']}")
    click.echo(f"up        : {'yes' if info['up'] else 'no'}")
    for d in info["daemons"]:
        click.echo(f"  {d['name']:<14} pid {d['pid']:<8} {'running' if d['alive'] else 'not running'}")
    if info["nodes"]:
        click.echo(f"{'NODE':<8} {'STATE':<10} {'GPUS':>5} {'USED':>5}  PARTITIONS")
        for n in info["nodes"]:
            click.echo(f"{n['name']:<8} {n['state']:<10} {n['gpus_total']:>5} {n['gpus_used']:>5}  "
                       f"{','.join(n['partitions'])}")
        total = sum(n["gpus_total"] for n in info["nodes"])
        used = sum(n["gpus_used"] for n in info["nodes"])
        click.echo(f"GPUs: {total} total, {used} in use, {total - used} free")
