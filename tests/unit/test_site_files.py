"""The site files (slurm_elastic/sitefiles.py) and the install script's promises that need no Slurm: every
file exists, the unit starts the CLI where install-site.sh links it, and a Python only its owner can reach
is refused before anything is installed. The install itself is tested live (test_submit_plugin.py)."""

import os
import re
import shutil
import subprocess
from pathlib import Path

from slurm_elastic.sitefiles import SITE_FILES, site_file

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "install-site.sh"


def test_every_site_file_is_found():
    for name, rel in SITE_FILES.items():
        assert site_file(name) == REPO / rel or site_file(name).as_posix().endswith("_site/" + rel)
    out = subprocess.run(["python3", "-c", "import sys; sys.path.insert(0, sys.argv[1]); "
                          "import runpy; runpy.run_module('slurm_elastic.sitefiles', run_name='__main__')", str(REPO)],
                         capture_output=True, text=True, timeout=60, check=True).stdout
    assert [line.split("\t")[0] for line in out.splitlines()] == list(SITE_FILES)


def test_the_unit_runs_what_the_script_installs():
    unit = site_file("unit").read_text()
    script = SCRIPT.read_text()
    exe = re.search(r"^ExecStart=(\S+) daemon --config (\S+)", unit, re.M)
    assert exe and exe.group(1) == "/usr/local/bin/slurm-elastic" and exe.group(2) == "/etc/slurm/elastic.toml"
    assert 'ln -sfn "$VENV/bin/slurm-elastic" "$ROOT/usr/local/bin/slurm-elastic"' in script
    doc = re.search(r"^Documentation=file://(\S+)", unit, re.M).group(1)
    assert doc == "/usr/share/doc/slurm-elastic/SYSADMIN.md" and '"$ROOT/usr/share/doc/slurm-elastic/"' in script
    assert "StateDirectory=slurm-elastic" in unit  # /var/lib/slurm-elastic, the default state_dir


def test_a_python_closed_to_other_users_is_refused(tmp_path):
    private = tmp_path / "home"
    private.mkdir(mode=0o700)
    os.chmod(private, 0o700)
    fake = private / "python3"
    shutil.copyfile("/bin/true", fake)
    os.chmod(fake, 0o755)
    r = subprocess.run(["bash", str(SCRIPT), "--root", str(tmp_path / "root"), "--python", str(fake)],
                       capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 1 and "is not open to other users (mode drwx------)" in r.stderr, r.stderr
    assert not (tmp_path / "root").exists()  # refused before anything was made
