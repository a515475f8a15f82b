"""``slurm-elastic cluster up|down|status|prepare``: the local multi-node Slurm used by the demo and the tests.

``--slurm host`` (the default) runs the machine's own Slurm; ``--slurm trixie`` or ``--slurm bookworm``
runs that Debian release's Slurm in a debootstrap chroot that ``prepare`` (or the first ``up``)
builds under /var/cache/slurm-elastic/chroots (see slurm_elastic/chroot.py). Each version gets its
own default state dir and port, so a host cluster and a chroot cluster can run side by side.
"""

from __future__ import annotations

import json
import sys

import click

from slurm_elastic.chroot import KNOWN_RELEASES, ChrootError, ChrootRoot, host_release, other_release
from slurm_elastic.cluster import (
    DEFAULT_STATE_DIR,
    ClusterConfig,
    ClusterError,
    LocalCluster,
    parse_pools,
    resolve_release,
)

# Default slurmctld port per Slurm source, so that clusters of different versions do not collide.
DEFAULT_PORTS = {None: 16817, "bookworm": 16917, "trixie": 17017, "sid": 17117}

state_dir_option = click.option(
    "--state-dir",
    type=click.Path(file_okay=False),
    default=None,
    envvar="SLURM_ELASTIC_CLUSTER_DIR",
    help=f"Directory holding this cluster's state and pids [default: {DEFAULT_STATE_DIR} for the host's "
         f"Slurm, {DEFAULT_STATE_DIR}-RELEASE for a chroot].",
)
slurm_option = click.option(
    "--slurm", "--release", "slurm",
    type=click.Choice(["host", *KNOWN_RELEASES]),
    default="host",
    show_default=True,
    help="Whose Slurm to run: the host's packages, or a Debian release's packages in a chroot "
         "(trixie: 24.11, bookworm: 22.05, sid: 26.05 as of 2026-12). The host's own codename means the host.",
)


def _state_dir(state_dir: str | None, release: str | None) -> str:
    """--state-dir as given; else the default, with '-RELEASE' appended for a chroot. A dir taken from
    SLURM_ELASTIC_CLUSTER_DIR (the Makefile sets it) also gets the suffix, so `make` keeps the host
    cluster and the chroot cluster apart."""
    ctx = click.get_current_context(silent=True)
    from_env = ctx is not None and ctx.get_parameter_source("state_dir") == click.core.ParameterSource.ENVIRONMENT
    if state_dir and (release is None or not from_env):
        return state_dir
    base = state_dir or str(DEFAULT_STATE_DIR)
    return base if release is None else f"{base}-{release}"


def _release(slurm: str) -> str | None:
    try:
        return resolve_release(slurm)
    except ChrootError as e:
        raise click.ClickException(str(e)) from e


@click.group()
def cluster():
    """Run a local multi-node Slurm cluster with fake GPUs (for the demo and the tests)."""


@cluster.command()
@state_dir_option
@slurm_option
@click.option("--nodes", type=click.IntRange(1, 64), default=4, show_default=True)
@click.option("--gpus-per-node", type=click.IntRange(1, 16), default=4, show_default=True)
@click.option("--cpus-per-node", type=click.IntRange(1, 256), default=8, show_default=True)
@click.option("--port", type=click.IntRange(1024, 65000), default=None,
              help="slurmctld port; slurmd ports are the next --nodes ports [default: 16817 for the host's "
                   "Slurm, 16917 bookworm, 17017 trixie, 17117 sid].")
@click.option("--cred-expire", type=click.IntRange(5, 3600), default=10, show_default=True,
              help="Seconds a requeued job waits before it may start (Slurm's default is 120).")
@click.option("--job-submit-lua", type=click.Path(exists=True, dir_okay=False), default=None,
              help="Load this job_submit.lua into slurmctld (JobSubmitPlugins=lua).")
@click.option("--pools", default=None, metavar="SPEC",
              help="Partitions with typed fake GPUs instead of one 'gpu' partition: NAME:NODESxGPUS,... (partition "
                   "and GPU type named NAME, e.g. a100:2x4,v100:2x8), or 'two' for that pair with v100 limited to "
                   "MaxTime 2 h and MaxNodes 2. Overrides --nodes and --gpus-per-node.")
def up(state_dir, slurm, nodes, gpus_per_node, cpus_per_node, port, cred_expire, job_submit_lua, pools):
    """Start slurmctld and one slurmd per node, and wait until every node is idle (a no-op if up)."""
    release = _release(slurm)
    state_dir = _state_dir(state_dir, release)
    try:
        pool_list = parse_pools(pools) if pools else []
    except ClusterError as e:
        raise click.BadParameter(str(e), param_hint="--pools") from e
    config = ClusterConfig(nodes=nodes, gpus_per_node=gpus_per_node, cpus_per_node=cpus_per_node,
                           ctld_port=port if port is not None else DEFAULT_PORTS.get(release, 16817),
                           cred_expire=cred_expire, job_submit_lua=job_submit_lua, release=release, pools=pool_list)
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
    shape = (", ".join(f"{p['partition']}: {p['nodes']} x {p['gpu_type']}:{p['gpus_per_node']}" for p in pool_list)
             if pool_list else f"{nodes} nodes x {gpus_per_node} GPUs")
    click.echo(("started" if started else "already up") + f": {shape}, Slurm {c.backend.version()} ({c.label})")
    if c.chroot is None:
        click.echo(f"export SLURM_CONF={c.conf_path}")
    else:
        click.echo(f"tools: SLURM_CONF={c.inside(c.conf_path)} chroot {c.chroot.path} /usr/bin/sinfo")


def _shape(cfg: ClusterConfig):
    return (cfg.nodes, cfg.gpus_per_node, cfg.cpus_per_node, cfg.ctld_port, cfg.cred_expire, cfg.job_submit_lua,
            cfg.release, cfg.pools)


@cluster.command()
@state_dir_option
@slurm_option
def down(state_dir, slurm):
    """Stop the daemons this cluster started (by pid) and, for a chroot, its bind mounts; files stay."""
    try:
        stopped = LocalCluster(_state_dir(state_dir, _release(slurm))).down()
    except ClusterError as e:
        raise click.ClickException(str(e)) from e
    click.echo("stopped: " + (", ".join(stopped) if stopped else "nothing was running"))


@cluster.command()
@click.option("--slurm", "--release", "slurm", type=click.Choice(["other", *KNOWN_RELEASES]), default="other",
              show_default=True, help="The Debian release to build ('other': trixie on bookworm, bookworm on trixie).")
@click.option("--json", "as_json", is_flag=True, help="Print the build record as JSON.")
def prepare(slurm, as_json):
    """Build (once; cached) the chroot with another Debian release's Slurm, from Debian's packages only."""
    try:
        release = other_release() if slurm == "other" else slurm
        if release is None:
            raise click.ClickException(f"no other release is known for this host ({host_release()})")
        if release == host_release():
            # Built anyway when named: the tests can run it (SLURM_ELASTIC_CHROOT_RELEASES), as a host of
            # another release would. `cluster up --slurm RELEASE` with the host's own release uses the host.
            click.echo(f"note: {release} is this host's release; 'cluster up --slurm {release}' runs the host's "
                       f"Slurm, the chroot serves the tests (SLURM_ELASTIC_CHROOT_RELEASES)", err=True)
        root = ChrootRoot(release)
        cached = root.is_complete()
        info = root.ensure(log=lambda msg: click.echo(msg, err=True))
    except ChrootError as e:
        raise click.ClickException(str(e)) from e
    if as_json:
        json.dump({**info, "path": str(root.path), "cached": cached}, sys.stdout, indent=2)
        click.echo()
    else:
        click.echo(f"{'cached' if cached else 'built'}: {root.path} ({info['slurm']}, {info['size_mb']} MB, "
                   f"built in {info['build_seconds']} s on {info['built']})")


@cluster.command()
@state_dir_option
@slurm_option
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def status(state_dir, slurm, as_json):
    """Show the cluster's daemons (pids) and its nodes with their GPUs."""
    c = LocalCluster(_state_dir(state_dir, _release(slurm)))
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
    click.echo(f"slurm     : {info['slurm']}" + (f" {info['version']}" if info.get("version") else ""))
    if "chroot" in info:
        click.echo(f"chroot    : {info['chroot']} (mounted: {', '.join(info['mounts']) or 'nothing'})")
    click.echo(f"up        : {'yes' if info['up'] else 'no'}")
    for d in info["daemons"]:
        click.echo(f"  {d['name']:<14} pid {d['pid']:<8} {'running' if d['alive'] else 'not running'}")
    if info["nodes"]:
        click.echo(f"{'NODE':<8} {'STATE':<10} {'GPUS':>5} {'USED':>5}  {'TYPE':<6} PARTITIONS")
        for n in info["nodes"]:
            click.echo(f"{n['name']:<8} {n['state']:<10} {n['gpus_total']:>5} {n['gpus_used']:>5}  "
                       f"{n.get('gpu_type') or '-':<6} {','.join(n['partitions'])}")
        total = sum(n["gpus_total"] for n in info["nodes"])
        used = sum(n["gpus_used"] for n in info["nodes"])
        click.echo(f"GPUs: {total} total, {used} in use, {total - used} free")
