"""slurm_elastic.chroot: host release, apt mirror, paths, and the shared bind mounts of a chroot root.

The mount tests bind-mount the real /proc, /dev and /sys into a fake root under tmp_path (no
debootstrap needed) and always unmount them again; they need root.
"""

import json
import os
import subprocess

import pytest

from slurm_elastic.chroot import (
    ChrootError,
    ChrootRoot,
    _safe_rmtree,
    apt_mirror,
    host_release,
    mounts_under,
    other_release,
)
from slurm_elastic.cluster import ClusterConfig, LocalCluster


def test_host_release_and_the_other_one(tmp_path):
    f = tmp_path / "os-release"
    f.write_text('PRETTY_NAME="Debian GNU/Linux 13 (trixie)"\nVERSION_CODENAME=trixie\nID=debian\n')
    assert host_release(str(f)) == "trixie"
    assert other_release("trixie") == "bookworm" and other_release("bookworm") == "trixie"
    assert other_release("jammy") is None
    f.write_text("ID=debian\n")
    with pytest.raises(ChrootError, match="VERSION_CODENAME"):
        host_release(str(f))


def test_apt_mirror_from_deb822_and_one_line_sources(tmp_path, monkeypatch):
    monkeypatch.delenv("SLURM_ELASTIC_DEBIAN_MIRROR", raising=False)
    d = tmp_path / "apt"
    (d / "sources.list.d").mkdir(parents=True)
    (d / "sources.list.d" / "debian.sources").write_text(
        "Types: deb\nURIs: http://mirror.example/debian-security\nSuites: bookworm-security\nComponents: main\n\n"
        "Types: deb\n# a comment\nURIs: http://mirror.example/debian/\nSuites: bookworm bookworm-updates\n"
        "Components: main\nSigned-By:\n -----BEGIN PGP PUBLIC KEY BLOCK-----\n URIs: http://not.this/\n")
    assert apt_mirror("bookworm", str(d)) == "http://mirror.example/debian"
    with pytest.raises(ChrootError, match="SLURM_ELASTIC_DEBIAN_MIRROR") as e:
        apt_mirror("trixie", str(d))  # nothing for trixie: no guess, a message naming the variable
    assert "trixie" in str(e.value)
    # a third-party repository naming the codename with another component is not a Debian archive
    (d / "sources.list").write_text("deb [arch=amd64] http://thirdparty.example/linux/debian trixie stable\n")
    with pytest.raises(ChrootError):
        apt_mirror("trixie", str(d))
    (d / "sources.list").write_text("# old style\ndeb [arch=amd64 signed-by=/k.gpg] http://other.example/debian "
                                    "trixie main contrib\n")
    assert apt_mirror("trixie", str(d)) == "http://other.example/debian"
    (d / "sources.list.d" / "debian.sources").write_text(
        "Enabled: no\nTypes: deb\nURIs: http://off.example/debian\nSuites: sid\nComponents: main\n")
    with pytest.raises(ChrootError):
        apt_mirror("sid", str(d))
    monkeypatch.setenv("SLURM_ELASTIC_DEBIAN_MIRROR", "http://override.example/debian/")
    assert apt_mirror("trixie", str(d)) == "http://override.example/debian"


def test_paths_inside_and_outside_the_root(tmp_path):
    root = ChrootRoot("trixie", tmp_path)
    assert root.path == tmp_path / "trixie"
    assert root.inside(root.path / "srv" / "x" / "etc" / "slurm.conf") == "/srv/x/etc/slurm.conf"
    assert root.outside("/srv/x") == root.path / "srv" / "x"
    assert root.prefix() == ["chroot", str(root.path)]
    with pytest.raises(ChrootError):
        root.inside(tmp_path / "elsewhere")
    with pytest.raises(ChrootError):
        ChrootRoot("jammy", tmp_path)
    assert not root.is_complete()  # no stamp, no slurmctld


def test_a_chroot_cluster_translates_paths_and_prefixes_every_command(tmp_path):
    root = ChrootRoot("trixie", tmp_path)
    state = root.path / "srv" / "slurm-elastic" / "c1"
    c = LocalCluster(state, ClusterConfig(release="trixie", chroot_cache=str(tmp_path)))
    assert c.data_dir == state  # a state dir inside the root is used as is
    assert c.env["SLURM_CONF"] == "/srv/slurm-elastic/c1/etc/slurm.conf"
    assert c.tool("squeue", "--json") == ["chroot", str(root.path), "/usr/bin/squeue", "--json"]
    assert c.backend.prefix == ["chroot", str(root.path)]
    assert c._translate(str(state / "jobs" / "a.sh")) == "/srv/slurm-elastic/c1/jobs/a.sh"
    assert c._translate(f"--output={state}/o.txt") == "--output=/srv/slurm-elastic/c1/o.txt"
    assert c._translate("--gres=gpu:2") == "--gres=gpu:2"
    outside = LocalCluster(tmp_path / "elsewhere", ClusterConfig(release="trixie", chroot_cache=str(tmp_path)))
    assert root.path in outside.data_dir.parents  # runtime files go inside the root
    host = LocalCluster(tmp_path / "h")
    assert host.data_dir == tmp_path / "h" and host.tool("squeue") == ["/usr/bin/squeue"] and host.prefix == []


def test_cli_backend_puts_the_prefix_before_every_command():
    from slurm_elastic.backends.cli import CliBackend

    seen = []

    def runner(argv, **kw):
        seen.append(argv)
        return subprocess.CompletedProcess(argv, 0, stdout="slurm 24.11.5\n", stderr="")

    b = CliBackend(env={"SLURM_CONF": "/srv/x/slurm.conf"}, prefix=["chroot", "/r"], runner=runner)
    assert b.version() == "24.11.5"
    b.release(7)
    assert seen == [["chroot", "/r", "/usr/bin/squeue", "--version"], ["chroot", "/r", "/usr/bin/scontrol", "release", "7"]]
    assert CliBackend(runner=runner).prefix == []


def _host_mounts() -> list[str]:
    with open("/proc/self/mountinfo") as f:
        return sorted(line.split()[4] for line in f)


needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="bind mounts need root")


@pytest.fixture
def fake_root(tmp_path):
    root = ChrootRoot("trixie", tmp_path / "cache")
    (root.path / "etc").mkdir(parents=True)
    yield root
    for mp in mounts_under(root.path):  # never leave a mount behind, whatever the test did
        subprocess.run(["umount", "-l", mp], check=False)


@needs_root
def test_mounts_are_shared_by_holders_and_removed_with_the_last(fake_root):
    root = fake_root
    host_mounts = _host_mounts()
    root.acquire("/state/a")
    wanted = root.wanted_mounts()
    assert wanted == ["proc", "dev", "sys"] and root.mounted() == wanted
    count = len(mounts_under(root.path))  # /sys with the mounts below it (cgroups): at least 3
    assert (root.path / "etc" / "hosts").read_text() == open("/etc/hosts").read()
    assert os.path.exists(root.path / "proc" / "self" / "stat")
    # /sys is bound with the mounts below it: 22.05's slurmd needs /sys/fs/cgroup (and its v1 controllers)
    below_sys = [m[len("/sys"):] for m in host_mounts if m.startswith("/sys/")]
    assert sorted(m[len(str(root.path / "sys")):] for m in mounts_under(root.path / "sys")
                  if m != str(root.path / "sys")) == sorted(below_sys)
    root.acquire("/state/b")  # a second cluster: no second mount
    assert count >= 3 and len(mounts_under(root.path)) == count
    assert root.release_holder("/state/a", still_in_use=lambda h: h == "/state/b") == []
    assert root.mounted() == wanted  # b still needs them
    assert json.loads(root.holders_path.read_text()) == ["/state/b"]
    done = root.release_holder("/state/b", still_in_use=lambda h: True)
    assert sorted(done) == sorted(str(root.path / n) for n in wanted)
    assert root.mounted() == [] and mounts_under(root.path) == []
    assert _host_mounts() == host_mounts  # unmounting the binds took none of the host's mounts along


@needs_root
def test_a_holder_whose_cluster_is_gone_does_not_keep_the_mounts(fake_root):
    root = fake_root
    root.acquire("/state/crashed")  # e.g. a cluster killed without `down`
    root.acquire("/state/me")
    root.release_holder("/state/me", still_in_use=lambda h: False)
    assert root.mounted() == [] and json.loads(root.holders_path.read_text()) == []


@needs_root
def test_nothing_is_deleted_below_a_mount(fake_root):
    root = fake_root
    root.acquire("/state/a")
    with pytest.raises(ChrootError, match="refusing to delete"):
        _safe_rmtree(root.path)
    assert os.path.exists("/dev/null") and os.path.exists(root.path / "dev" / "null")
    root.release_holder("/state/a")
    _safe_rmtree(root.path)
    assert not root.path.exists()
