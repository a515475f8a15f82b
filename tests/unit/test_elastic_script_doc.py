"""docs/ELASTIC-SCRIPT.md shows the real diff between examples/ddp_plain.py and examples/ddp_elastic.py
(the elastic one is run under torchrun by tests/integration/test_train_dataloader.py), and the number
of lines a user adds stays at the issue's goal (10 or fewer)."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def test_the_docs_diff_is_the_examples_diff_and_adds_at_most_10_lines():
    plain = (REPO / "examples" / "ddp_plain.py").read_text().splitlines()
    elastic = (REPO / "examples" / "ddp_elastic.py").read_text().splitlines()
    real = list(difflib.unified_diff(plain, elastic, lineterm="", n=3))[2:]  # without the ---/+++ header
    doc = (REPO / "docs" / "ELASTIC-SCRIPT.md").read_text()
    section = doc[doc.index("## Plain PyTorch"):doc.index("## Lightning")]
    block = re.search(r"```diff\n(.*?)\n```", section, re.S).group(1).splitlines()
    assert block == real
    added = [line for line in real if line.startswith("+")]
    assert f"**{len(added)} `+` lines**" in section
    assert len(added) <= 10, added
