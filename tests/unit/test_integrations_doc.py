"""docs/INTEGRATIONS.md shows the real diffs between examples/{lightning,hf}_plain.py and their elastic
versions, each adds at most 10 lines, and the elastic examples run as documented against the installed
Lightning and transformers: one process outside Slurm (the documented ./elastic-ckpt default and
default_batch=), to the end. Every Python
block of docs/ELASTIC-SCRIPT.md and INTEGRATIONS.md at least compiles."""

from __future__ import annotations

import ast
import difflib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CASES = {"lightning": "## PyTorch Lightning", "hf": "## Hugging Face Trainer"}


def _section(doc: str, title: str) -> str:
    i = doc.index(title)
    j = doc.find("\n## ", i + len(title))
    return doc[i: j if j > 0 else len(doc)]


@pytest.mark.parametrize("name", list(CASES))
def test_the_docs_diff_is_the_examples_diff_and_adds_at_most_10_lines(name):
    plain = (REPO / "examples" / f"{name}_plain.py").read_text().splitlines()
    elastic = (REPO / "examples" / f"{name}_elastic.py").read_text().splitlines()
    real = list(difflib.unified_diff(plain, elastic, lineterm="", n=3))[2:]
    section = _section((REPO / "docs" / "INTEGRATIONS.md").read_text(), CASES[name])
    block = re.search(r"```diff\n(.*?)\n```", section, re.S).group(1).splitlines()
    assert block == real
    added = [line for line in real if line.startswith("+")]
    assert f"**{len(added)} `+` lines**" in section
    assert len(added) <= 10, added


def test_every_python_block_of_the_script_docs_compiles():
    for doc in ("ELASTIC-SCRIPT.md", "INTEGRATIONS.md"):
        for block in re.findall(r"```python\n(.*?)\n```", (REPO / "docs" / doc).read_text(), re.S):
            ast.parse(block)


@pytest.mark.parametrize("name", list(CASES))
def test_the_elastic_example_runs_as_documented(name, tmp_path):
    pytest.importorskip({"lightning": "lightning", "hf": "transformers"}[name])
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "ELASTIC_", "RANK", "WORLD_SIZE",
                                                                    "LOCAL_RANK", "MASTER_"))}
    env.update(PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    script = REPO / "examples" / f"{name}_elastic.py"
    p = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "finished:" in p.stdout + p.stderr, (p.stdout + p.stderr)[-3000:]
    assert (tmp_path / "elastic-ckpt" / "checkpoint.pt").exists()


def test_the_local_daemon_page_config_loads_and_its_commands_exist():
    import tomllib

    from click.testing import CliRunner

    from slurm_elastic.cli import main
    from slurm_elastic.daemon.config import config_from_dict

    doc = (REPO / "docs" / "LOCAL-DAEMON.md").read_text()
    blocks = re.findall(r"```toml\n(.*?)\n```", doc, re.S)
    assert blocks
    for block in blocks:
        cfg = config_from_dict(tomllib.loads(block), "LOCAL-DAEMON.md")
        assert cfg.metrics_port != 9788  # the page's point: not the default a second daemon collides on
    for sh in re.findall(r"```sh\n(.*?)\n```", doc, re.S):
        for line in sh.splitlines():
            words = line.split("#")[0].split()
            if words[:1] == ["slurm-elastic"]:
                sub = [w for w in words[1:3] if not w.startswith("-") and w.isalpha()][:2]
                r = CliRunner().invoke(main, [*sub, "--help"])
                assert r.exit_code == 0, (line, r.output)
                for w in words[1 + len(sub):]:
                    if not w.startswith("--"):
                        break  # a positional: what follows is the script's own arguments
                    assert w.split("=")[0] in r.output, (line, w)
