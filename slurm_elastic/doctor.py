"""``slurm-elastic doctor``'s rules: is this site's Slurm set up the way the daemon needs it?

Pure: every check reads :class:`SiteFacts` (gathered by ``commands/doctor.py`` from ``scontrol show
config``, ``scontrol -o show partition``, the node list, the job_submit.lua next to slurm.conf, the
state directory, munge and the backend probe) and returns one :class:`Check` with a level and, unless
it is OK, the change to make. Why each matters is in docs/SYSADMIN.md; a FAIL is something the daemon
cannot work without (it would refuse to start, or could never resize a job), a WARN something that
works but costs the site (elastic jobs unheld at submit, slow resizes).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from slurm_elastic.backends.base import NO_PREEMPTION, NodeRecord

OK, WARN, FAIL = "OK", "WARN", "FAIL"
PLUGIN_MARK = "slurm-elastic job_submit plugin"
REQUEUE_RULE = "elastic jobs must be submitted with --requeue"
# A requeued job may start again only when its launch credential expired (AuthInfo cred_expire, Slurm's
# default 120 s): every resize waits that long. Above this many seconds the doctor says so.
SLOW_CRED_EXPIRE_S = 60
DEFAULT_CRED_EXPIRE_S = 120
SLURM_TOOLS = ("squeue", "sinfo", "scontrol", "scancel", "sbatch")


@dataclass(frozen=True)
class Check:
    name: str
    level: str  # OK | WARN | FAIL
    what: str  # what was found
    fix: str = ""  # what to change (empty when OK)

    def line(self) -> str:
        return f"{self.level:<4}  {self.name:<12} {self.what}" + (f"\n      {'':<12} fix: {self.fix}" if self.fix else "")


@dataclass
class SiteFacts:
    """What the doctor found; None where it could not be read (the check then says why)."""

    slurm_config: dict[str, str] | None = None  # scontrol show config
    slurm_error: str = ""
    partitions_text: str | None = None  # scontrol -o show partition
    nodes: list[NodeRecord] | None = None
    plugin_path: str = ""  # job_submit.lua next to slurm.conf
    plugin_text: str | None = None  # its text (None: no such file)
    shipped_plugin_text: str | None = None  # the plugin this install ships
    shipped_plugin_path: str = ""  # where it is
    daemon_config: object | None = None  # DaemonConfig
    daemon_config_error: str = ""
    config_path: str = ""
    state_dir: dict | None = None  # {"exists", "is_dir", "is_symlink", "uid", "mode", "parent_writable_by_other"}
    euid: int = 0
    munge: tuple[bool, str] | None = None  # (works, detail)
    backend: tuple[str, str] | None = None  # (name chosen, why) or ("", error)
    missing_tools: list[str] = field(default_factory=list)


def submit_plugins(config: dict[str, str]) -> list[str]:
    """JobSubmitPlugins as plain names: 'lua,job_submit/pbs' -> ['lua', 'pbs']; '(null)' -> []."""
    value = (config.get("JobSubmitPlugins") or "").strip()
    if value.lower() in ("", "(null)", "none"):
        return []
    return [p.strip().removeprefix("job_submit/") for p in value.split(",") if p.strip()]


def is_yes(value: str | None) -> bool:
    return (value or "").strip().lower() in ("yes", "1", "true")


def partition_fields(text: str) -> dict[str, dict[str, str]]:
    """``scontrol -o show partition`` -> {partition: {Key: value}} (one line per partition)."""
    out: dict[str, dict[str, str]] = {}
    for line in (text or "").splitlines():
        kv = dict(tok.partition("=")[::2] for tok in line.split() if "=" in tok)
        if kv.get("PartitionName"):
            out[kv["PartitionName"]] = kv
    return out


def cred_expire_s(config: dict[str, str]) -> int:
    m = re.search(r"(?:^|,)cred_expire=(\d+)", config.get("AuthInfo") or "")
    return int(m.group(1)) if m else DEFAULT_CRED_EXPIRE_S


def _plugin_body(text: str) -> str:
    """The plugin without the line a site may edit (DAEMON_UIDS, docs/SYSADMIN.md)."""
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("local DAEMON_UIDS"))


def check_slurm(f: SiteFacts) -> Check:
    if f.slurm_config is None:
        return Check("slurm", FAIL, f"cannot read Slurm's configuration: {f.slurm_error}",
                     "run the doctor where scontrol reaches slurmctld (SLURM_CONF, munge), as the daemon will")
    c = f.slurm_config
    return Check("slurm", OK, f"Slurm {c.get('SLURM_VERSION', '?')}, cluster {c.get('ClusterName', '?')}, "
                              f"{c.get('SLURM_CONF', 'slurm.conf')}")


def check_plugin(f: SiteFacts) -> Check:
    c = f.slurm_config or {}
    names = submit_plugins(c)
    conf = "JobSubmitPlugins=" + ",".join(["lua", *[n for n in names if n != "lua"]])
    install = f"cp {_shipped(f)} {f.plugin_path or 'job_submit.lua next to slurm.conf'}"
    if "lua" not in names:
        return Check("job_submit", WARN, f"JobSubmitPlugins={c.get('JobSubmitPlugins', '(null)')}: elastic jobs "
                     "are not held at submit (they start at their submitted size until the daemon's next cycle) "
                     "and bad specs are not refused at sbatch",
                     f"{install}, set {conf} in slurm.conf, scontrol reconfigure")
    if f.plugin_text is None:
        return Check("job_submit", FAIL, f"JobSubmitPlugins has lua but {f.plugin_path or 'job_submit.lua'} is "
                     "missing", install)
    if PLUGIN_MARK not in f.plugin_text:
        return Check("job_submit", WARN, f"{f.plugin_path} is not slurm-elastic's plugin (a site plugin?)",
                     f"merge slurm_job_submit/slurm_job_modify of {_shipped(f)} into it")
    if f.shipped_plugin_text is not None and _plugin_body(f.plugin_text) != _plugin_body(f.shipped_plugin_text):
        return Check("job_submit", WARN, f"{f.plugin_path} differs from the plugin of this install",
                     f"{install} (keep your DAEMON_UIDS line), scontrol reconfigure")
    return Check("job_submit", OK, f"lua loaded, {f.plugin_path} is this install's plugin")


def _shipped(f: SiteFacts) -> str:
    return f.shipped_plugin_path or "/usr/share/slurm-elastic/job_submit_elastic.lua"


def plugin_requires_requeue(f: SiteFacts) -> bool:
    return ("lua" in submit_plugins(f.slurm_config or {}) and f.plugin_text is not None
            and REQUEUE_RULE in f.plugin_text)


def check_requeue(f: SiteFacts) -> Check:
    c = f.slurm_config or {}
    if (c.get("JobRequeue") or "").strip() == "1":
        return Check("requeue", OK, "JobRequeue=1: batch jobs are requeueable unless submitted --no-requeue"
                     + ("; the plugin refuses elastic --no-requeue" if plugin_requires_requeue(f) else ""))
    if plugin_requires_requeue(f):
        return Check("requeue", OK, f"JobRequeue={c.get('JobRequeue', '?')}, but the job_submit plugin refuses an "
                     "elastic job without --requeue")
    return Check("requeue", FAIL, f"JobRequeue={c.get('JobRequeue', '?')} and no plugin requiring --requeue: elastic "
                 "jobs submitted without --requeue can never be resized (the daemon leaves them alone)",
                 "install the job_submit plugin (it requires --requeue), or set JobRequeue=1 in slurm.conf; "
                 "scontrol reconfigure")


def check_gres(f: SiteFacts) -> Check:
    c = f.slurm_config or {}
    types = [t.strip() for t in (c.get("GresTypes") or "").split(",")]
    if "gpu" not in types:
        return Check("gres", FAIL, f"GresTypes={c.get('GresTypes', '(null)')}: Slurm counts no GPUs",
                     "GresTypes=gpu in slurm.conf, Gres=gpu[:TYPE]:N on the GPU nodes, gres.conf on them; restart")
    if f.nodes is None:
        return Check("gres", WARN, "the node list could not be read", "check that sinfo/scontrol work for this user")
    managed = set(getattr(f.daemon_config, "partitions", ()) or ())
    nodes = [n for n in f.nodes if not managed or set(n.partitions) & managed]
    with_gpus = [n for n in nodes if n.gpus_total > 0]
    where = f"partitions {', '.join(sorted(managed))}" if managed else "the cluster"
    if not with_gpus:
        return Check("gres", FAIL, f"no node of {where} has GPUs in its Gres", "Gres=gpu[:TYPE]:N on the GPU nodes")
    per_type: dict[str, int] = {}
    for n in with_gpus:
        per_type[n.gpu_type or "untyped"] = per_type.get(n.gpu_type or "untyped", 0) + n.gpus_total
    summary = ", ".join(f"{k} {v}" for k, v in sorted(per_type.items()))
    mixed = [n.name for n in with_gpus if "," in n.gpu_type]
    if mixed:
        return Check("gres", WARN, f"{len(with_gpus)} GPU nodes ({summary}); {', '.join(mixed[:5])} mix GPU types, "
                     "which no pool matches (nothing is placed there)",
                     "one GPU type per node (split them into nodes/partitions per type)")
    return Check("gres", OK, f"{sum(per_type.values())} GPUs on {len(with_gpus)} nodes of {where} ({summary})")


def check_preemption(f: SiteFacts) -> Check:
    c = f.slurm_config or {}
    kind = (c.get("PreemptType") or "").strip()
    if kind.lower() in NO_PREEMPTION:
        return Check("preemption", OK, f"Slurm's own preemption is off (PreemptType={kind or '(null)'})")
    return Check("preemption", FAIL, f"PreemptType={kind}, PreemptMode={c.get('PreemptMode', '?')}: the daemon refuses "
                 "to run next to Slurm's preemption (it would stop elastic jobs behind the plan, without a checkpoint)",
                 "PreemptType=preempt/none (or remove it) in slurm.conf, scontrol reconfigure; the daemon's own "
                 "preemption is allow_preemption in elastic.toml")


def check_root_jobs(f: SiteFacts) -> Check:
    """The lease (daemon/lease.py) is a held job of the daemon's user, root by default."""
    c = f.slurm_config or {}
    cfg = f.daemon_config
    ttl = getattr(cfg, "lease_ttl_s", 90.0)
    lease_part = (getattr(cfg, "partitions", ()) or (None,))[0]
    parts = partition_fields(f.partitions_text or "")
    if lease_part is None:
        lease_part = next((p for p, kv in parts.items() if is_yes(kv.get("Default"))), None)
    blocked = ""
    if is_yes(c.get("DisableRootJobs")):
        blocked = "DisableRootJobs=YES in slurm.conf"
    elif lease_part and is_yes(parts.get(lease_part, {}).get("DisableRootJobs")):
        blocked = f"DisableRootJobs=YES on partition {lease_part}"
    if not blocked:
        return Check("root_jobs", OK, f"root may submit the daemon's lease job (partition {lease_part or 'default'})")
    if not ttl:
        return Check("root_jobs", WARN, f"{blocked}; lease_ttl_s = 0, so no lease is kept and a second daemon "
                     "(another host or state dir) would not be detected",
                     "allow root jobs there to use the lease (docs/SYSADMIN.md, 'One daemon per cluster')")
    return Check("root_jobs", FAIL, f"{blocked}: the daemon cannot submit its lease job (one daemon per cluster) "
                 "and refuses to act", f"DisableRootJobs=NO where it is set ({blocked}), or a first managed partition "
                 "that allows root jobs; or lease_ttl_s = 0 in elastic.toml (then no second-daemon detection)")


def check_state_dir(f: SiteFacts) -> Check:
    path = getattr(f.daemon_config, "state_dir", "/var/lib/slurm-elastic")
    s = f.state_dir
    if s is None:
        return Check("state_dir", WARN, f"{path}: not checked")
    if not s.get("exists"):
        return Check("state_dir", OK, f"{path} does not exist yet: the daemon creates it (the systemd unit's "
                     "StateDirectory= too)")
    if s.get("is_symlink"):
        return Check("state_dir", FAIL, f"{path} is a symlink: the daemon (root) must not follow it",
                     f"make {path} a real directory owned by the daemon's user, mode 0755")
    if not s.get("is_dir"):
        return Check("state_dir", FAIL, f"{path} is not a directory", f"remove it or set state_dir in {f.config_path}")
    mode = s.get("mode", 0)
    if mode & 0o022:
        return Check("state_dir", FAIL, f"{path} is writable by group or others (mode {mode:04o}): a user could "
                     "replace the state database or its lock", f"chmod go-w {path}")
    if s.get("uid") not in (0, f.euid):
        return Check("state_dir", WARN, f"{path} belongs to uid {s.get('uid')}, not root or this user ({f.euid})",
                     "chown it to the daemon's user (root, or SlurmUser with User= in the unit)")
    return Check("state_dir", OK, f"{path} (uid {s.get('uid')}, mode {mode:04o})")


def check_munge(f: SiteFacts) -> Check:
    if f.munge is None:
        return Check("munge", WARN, "munge not checked")
    ok, detail = f.munge
    if ok:
        return Check("munge", OK, detail)
    return Check("munge", FAIL, detail, "start munged (systemctl enable --now munge) with the cluster's "
                 "/etc/munge/munge.key; `munge -n | unmunge` must work")


def check_backend(f: SiteFacts) -> list[Check]:
    out = []
    if f.missing_tools:
        bin_dir = getattr(f.daemon_config, "slurm_bin", "/usr/bin")
        out.append(Check("tools", FAIL, f"missing in {bin_dir}: {', '.join(f.missing_tools)}",
                         f"install slurm-client, or set slurm_bin in {f.config_path or 'elastic.toml'}"))
    else:
        out.append(Check("tools", OK, f"{', '.join(SLURM_TOOLS)} in {getattr(f.daemon_config, 'slurm_bin', '/usr/bin')}"))
    if f.backend is None:
        return out
    name, why = f.backend
    if not name:
        out.append(Check("backend", FAIL, why, "backend = \"auto\" in elastic.toml, or build pyslurm for this Slurm "
                         "(docs/SYSADMIN.md, 'pyslurm')"))
    elif name == "cli" and getattr(f.daemon_config, "backend", "auto") == "auto":
        out.append(Check("backend", OK, f"cli ({why}); pyslurm reads big queues 5x faster: docs/SYSADMIN.md, "
                                        "'pyslurm'"))
    else:
        out.append(Check("backend", OK, f"{name} ({why})"))
    return out


def check_config(f: SiteFacts) -> Check:
    if f.daemon_config_error:
        return Check("config", FAIL, f.daemon_config_error, "fix the key it names (docs/elastic.toml.example)")
    if f.daemon_config is None:
        return Check("config", WARN, "no configuration read")
    return Check("config", OK, f"{f.config_path} read" if f.config_path else "no elastic.toml: every default")


def check_partitions(f: SiteFacts) -> Check | None:
    from slurm_elastic.daemon.config import ConfigError, check_managed_partitions

    if f.daemon_config is None or f.nodes is None:
        return None
    try:
        check_managed_partitions(f.daemon_config, f.nodes)
    except ConfigError as e:
        return Check("partitions", FAIL, str(e), f"set partitions in {f.config_path or 'elastic.toml'} to GPU "
                     "partitions Slurm has")
    parts = getattr(f.daemon_config, "partitions", ())
    return Check("partitions", OK, f"managed: {', '.join(parts) if parts else 'every partition'}")


def check_cred_expire(f: SiteFacts) -> Check:
    s = cred_expire_s(f.slurm_config or {})
    if s <= SLOW_CRED_EXPIRE_S:
        return Check("restart", OK, f"a requeued job may start again after cred_expire={s} s")
    return Check("restart", WARN, f"a requeued job waits cred_expire={s} s before it may start again: every resize "
                 "costs at least that", "AuthInfo=...,cred_expire=30 in slurm.conf (restart slurmctld and slurmd)")


def diagnose(f: SiteFacts) -> list[Check]:
    """Every check, in the order a sysadmin fixes them."""
    checks = [check_config(f), check_slurm(f)]
    if f.slurm_config is not None:
        checks += [check_requeue(f), check_plugin(f), check_gres(f)]
        p = check_partitions(f)
        if p is not None:
            checks.append(p)
        checks += [check_preemption(f), check_root_jobs(f), check_cred_expire(f)]
    checks += [check_state_dir(f), check_munge(f), *check_backend(f)]
    return checks


def exit_code(checks: list[Check]) -> int:
    return 1 if any(c.level == FAIL for c in checks) else 0
