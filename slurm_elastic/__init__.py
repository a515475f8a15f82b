"""slurm-elastic: elastic GPU scheduling for Slurm (GPU count and batch size chosen together)."""

__version__ = "0.1.0"
