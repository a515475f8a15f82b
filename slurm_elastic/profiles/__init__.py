"""Throughput models: how many samples/s a job processes on k GPUs at global batch b."""

from slurm_elastic.profiles.base import ThroughputModel

__all__ = ["ThroughputModel"]
