"""Framework integrations: PyTorch Lightning (:mod:`.lightning`) and the Hugging Face Trainer (:mod:`.hf`).

Each module imports its framework on import, so ``import slurm_elastic`` / ``slurm_elastic.train`` never
loads ``lightning`` or ``transformers``; install them with the ``lightning`` / ``hf`` extras. Both are thin
layers over :class:`~slurm_elastic.train.integrations.loop.ExternalLoop`, which drives the library's
:class:`~slurm_elastic.train.job.ElasticJob` (checkpoint, stop protocol, global-offset sampler, lr rule)
from a training loop that the framework owns. See docs/INTEGRATIONS.md.
"""
