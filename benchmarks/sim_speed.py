"""Simulator speed: one 160-job Pollux workload under dp, and a 10,000-job synthetic trace.

    python benchmarks/sim_speed.py [--jobs 10000] [--pollux ../shared/data/pollux]

Prints the figures that docs/EVALUATION.md (section 5) records; not a test, no timed asserts.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from slurm_elastic.sim.engine import SimConfig
from slurm_elastic.sim.evaluate import speed_section

if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pollux", default=str(Path(__file__).resolve().parents[2] / "shared" / "data" / "pollux"))
    ap.add_argument("--quick", action="store_true", help="2,000 synthetic jobs instead of 10,000")
    args = ap.parse_args()
    print(speed_section(Path(args.pollux), SimConfig(), args.quick))
    sys.exit(0)
