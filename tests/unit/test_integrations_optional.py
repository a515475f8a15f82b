"""The framework integrations are optional: the core package, the daemon and the in-job library load
without lightning/transformers (they are the `lightning` / `hf` extras), and the integration modules
import their framework only when they are imported themselves."""

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def _loaded(code: str) -> list[str]:
    code += f"; print(','.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180, check=True)
    return [m for m in out.stdout.strip().split(",") if m]


def test_core_daemon_and_train_do_not_import_the_frameworks():
    code = ("import sys, slurm_elastic, slurm_elastic.cli, slurm_elastic.daemon.loop, slurm_elastic.train, "
            "slurm_elastic.train.protocol, slurm_elastic.train.integrations")
    assert _loaded(code) == []


def test_torch_side_of_train_does_not_import_the_frameworks():
    code = ("import sys, importlib.util\n"
            "if importlib.util.find_spec('torch'):\n"
            "    import slurm_elastic.train.job, slurm_elastic.train.integrations.loop")
    assert _loaded(code) == []
