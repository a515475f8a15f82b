"""``slurm-elastic check`` passes the plain example and names each of four mistakes in deliberately broken
copies of the examples: a Lightning Trainer without ``**elastic.trainer_kwargs()``, a plain DataLoader
instead of the elastic one, a OneCycleLR (a step schedule that cannot be counted in samples), and a
dataset order drawn from an unseeded RNG (a non-deterministic sampler: the resume is not exact).
Real processes (one, and two under torchrun), CPU, gloo; the Lightning example passing is shown in
docs/INTEGRATIONS.md ("Pre-flight")."""

from __future__ import annotations

from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("torch")

from slurm_elastic.commands.check import check_script  # noqa: E402

EX = Path(__file__).resolve().parents[2] / "examples"


def _copy(tmp_path: Path, name: str, old: str, new: str) -> str:
    src = (EX / name).read_text()
    assert old in src
    p = tmp_path / name
    p.write_text(src.replace(old, new))
    return str(p)


def test_the_plain_example_passes_and_an_unseeded_order_is_caught(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    lines: list[str] = []
    assert check_script(str(EX / "ddp_elastic.py"), (), say=lines.append) == [], lines
    assert any("max difference" in line for line in lines)
    bad = _copy(tmp_path, "ddp_elastic.py", "loader = job.loader(ds, num_workers=2)",
                "import random\nloader = job.loader(torch.utils.data.Subset(ds, random.Random().sample("
                "range(len(ds)), len(ds))), num_workers=0)")
    problems = check_script(bad, ())
    assert len(problems) == 1 and "the resume is not exact" in problems[0], problems


@pytest.mark.parametrize("what, old, new, expect", [
    ("missing trainer kwargs", "**elastic.trainer_kwargs())", 'accelerator="cpu", devices=1)',
     "**elastic.trainer_kwargs() to L.Trainer"),
    ("missing elastic loader", "elastic.dataloader(ds, num_workers=2)",
     "torch.utils.data.DataLoader(ds, batch_size=8)", "DataLoader is not the elastic one"),
    ("step scheduler that cannot be converted",
     "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 40))",
     "torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=40)", "cannot follow a batch change"),
])
def test_a_broken_lightning_script_is_named(tmp_path, monkeypatch, what, old, new, expect):
    pytest.importorskip("lightning")
    monkeypatch.chdir(tmp_path)
    problems = check_script(_copy(tmp_path, "lightning_elastic.py", old, new), ())
    assert problems and expect in problems[0], (what, problems)
