"""The wheel's build step: copy the site files (slurm_elastic/sitefiles.py: plugin, unit, example config,
templates, dashboard, docs) into the package as ``slurm_elastic/_site/``, so an install has them without
the checkout. Metadata is in pyproject.toml."""

import shutil
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE / "slurm_elastic"))
from sitefiles import SITE_FILES  # noqa: E402  (the module alone: the package's deps are not needed here)


class BuildPyWithSiteFiles(build_py):
    def run(self):
        super().run()
        dest = Path(self.build_lib) / "slurm_elastic" / "_site"
        for rel in SITE_FILES.values():
            src = HERE / rel
            if not src.is_file():
                raise SystemExit(f"setup.py: site file {rel} is missing")
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(src, dest / rel)


setup(cmdclass={"build_py": BuildPyWithSiteFiles})
