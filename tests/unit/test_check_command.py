"""``slurm-elastic check`` passes the plain example and names each of five mistakes in deliberately broken
copies of the examples: a Lightning Trainer without ``**elastic.trainer_kwargs()``, a plain HF ``Trainer``
after ``elastic_setup()``, a plain DataLoader instead of the elastic one, a OneCycleLR (a step schedule
that cannot be counted in samples), and a dataset order drawn from an unseeded RNG (a non-deterministic
sampler: the resume is not exact).

Real processes (one, and two under torchrun), CPU, gloo; the Lightning example passing is shown in
docs/INTEGRATIONS.md ("Pre-flight"). Cost: the two whole checks run side by side, as do the two broken
copies that check runs for real; the Lightning loader and scheduler mistakes fail in check's first run,
before anything that differs between them, so their copies run here in this process (the same script,
the same error) and only check's explanation of that error is checked, not another process start."""

from __future__ import annotations

import os
import runpy
import traceback
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = [pytest.mark.torch, pytest.mark.slow]
pytest.importorskip("torch")

from slurm_elastic.commands.check import Run, _explain, check_script  # noqa: E402

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
    bad = _copy(tmp_path, "ddp_elastic.py", "loader = job.loader(ds, num_workers=2)",
                "import random\nloader = job.loader(torch.utils.data.Subset(ds, random.Random().sample("
                "range(len(ds)), len(ds))), num_workers=0)")
    with ThreadPoolExecutor(2) as ex:
        good = ex.submit(check_script, str(EX / "ddp_elastic.py"), (), say=lines.append)
        problems = ex.submit(check_script, bad, (), say=lambda _line: None).result()
        assert good.result() == [], lines
    assert any("max difference" in line for line in lines)
    assert len(problems) == 1 and "the resume is not exact" in problems[0], problems


BROKEN = {  # what: (example, old, new, what check must say)
    "missing trainer kwargs": ("lightning_elastic.py", "**elastic.trainer_kwargs())", 'accelerator="cpu", devices=1)',
                               "**elastic.trainer_kwargs() to L.Trainer"),
    "plain HF Trainer": ("hf_elastic.py", "trainer = ElasticTrainer(job=job, ",
                         "from transformers import Trainer\ntrainer = Trainer(", "ElasticTrainer(job=job, ...), not Trainer"),
}


def test_a_missing_lightning_or_hf_integration_call_is_named(tmp_path, monkeypatch):
    pytest.importorskip("lightning")
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    with ThreadPoolExecutor(2) as ex:
        runs = {what: ex.submit(check_script, _copy(tmp_path, name, old, new), ())
                for what, (name, old, new, _) in BROKEN.items()}
        for what, (*_, expect) in BROKEN.items():
            problems = runs[what].result()
            assert len(problems) == 1 and "no checkpoint after the stop" in problems[0], (what, problems)
            assert expect in problems[0], (what, problems)
    assert "without slurm-elastic's hooks" in runs["plain HF Trainer"].result()[0]


@pytest.mark.parametrize("what, old, new, expect", [
    ("missing elastic loader", "elastic.dataloader(ds, num_workers=2)",
     "torch.utils.data.DataLoader(ds, batch_size=8)", "DataLoader is not the elastic one"),
    ("step scheduler that cannot be converted",
     "torch.optim.lr_scheduler.LambdaLR(opt, lambda step: max(0.0, 1 - step / 40))",
     "torch.optim.lr_scheduler.OneCycleLR(opt, 1e-3, total_steps=40)", "cannot follow a batch change"),
])
def test_a_broken_lightning_script_fails_in_checks_first_run_and_is_named(tmp_path, monkeypatch, what, old, new,
                                                                           expect):
    """The copy runs as check's first run would (one process, its environment); check's words for its error."""
    pytest.importorskip("lightning")
    import torch.distributed as dist

    from slurm_elastic.train.signals import global_stop_flag

    monkeypatch.chdir(tmp_path)
    for k in [k for k in os.environ if k.startswith(("SLURM_", "RANK", "WORLD_SIZE", "LOCAL_", "MASTER_",
                                                     "TORCHELASTIC_", "ELASTIC_"))]:
        monkeypatch.delenv(k)
    for k, v in {"ELASTIC_CKPT_DIR": str(tmp_path / "ck"), "ELASTIC_BATCH": "8", "ELASTIC_STOP_AT_STEP": "3",
                 "SLURM_ELASTIC_BACKEND": "gloo", "CUDA_VISIBLE_DEVICES": ""}.items():
        monkeypatch.setenv(k, v)
    script = _copy(tmp_path, "lightning_elastic.py", old, new)
    try:
        with pytest.raises(Exception) as e:  # noqa: PT011 - whatever the script raises, check reads its text
            runpy.run_path(script, run_name="__main__")
    finally:
        global_stop_flag().uninstall()
        global_stop_flag().clear()
        if dist.is_initialized():
            dist.destroy_process_group()
    assert not (tmp_path / "ck" / "checkpoint.pt").exists(), what  # check's first run finds no checkpoint
    out = "".join(traceback.format_exception(e.value))
    assert expect in _explain(Run(1, out, None)), (what, out[-2000:])
