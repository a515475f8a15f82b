"""Where the files a site installs beside the package are: the job_submit plugin, the systemd unit, the
example configuration, the sbatch templates, the Grafana dashboard and the sysadmin docs.

They live once in the repository (``plugins/``, ``packaging/``, ...); the wheel carries copies under
``slurm_elastic/_site/`` (setup.py's build step), so an installed package finds them without the
checkout, and a checkout (editable install) finds them in place.
"""

from __future__ import annotations

from pathlib import Path

# name -> path in the repository (and under _site/ in the wheel)
SITE_FILES: dict[str, str] = {
    "plugin": "plugins/job_submit_elastic.lua",
    "unit": "packaging/systemd/slurm-elastic.service",
    "grafana": "packaging/grafana/slurm-elastic.json",
    "config": "docs/elastic.toml.example",
    "sbatch": "sbatch_templates/elastic.sbatch",
    "sbatch_ddp": "sbatch_templates/elastic_ddp.sbatch",
    "sbatch_readme": "sbatch_templates/README.md",
    "install_doc": "docs/INSTALL.md",
    "sysadmin_doc": "docs/SYSADMIN.md",
}
_PACKAGE = Path(__file__).resolve().parent


def site_file(name: str) -> Path:
    """The installed copy of a site file (``name`` from SITE_FILES), else the checkout's; FileNotFoundError
    names both places when neither exists."""
    rel = SITE_FILES[name]
    for place in (_PACKAGE / "_site" / rel, _PACKAGE.parent / rel):
        if place.is_file():
            return place
    raise FileNotFoundError(f"{rel}: neither in {_PACKAGE / '_site'} (the wheel's copy) nor in the checkout "
                            f"{_PACKAGE.parent}")


if __name__ == "__main__":  # scripts/install-site.sh: `python -m slurm_elastic.sitefiles` lists name<TAB>path
    for key in SITE_FILES:
        print(f"{key}\t{site_file(key)}")
