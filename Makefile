# The two commands a newcomer types (see README.md): `make demo` and `make test`.
VENV := .venv
SE := $(VENV)/bin/slurm-elastic
STATE_DIR ?= $(CURDIR)/.cluster
export SLURM_ELASTIC_CLUSTER_DIR := $(STATE_DIR)

.PHONY: setup demo test test-unit down lint capture-fixtures chroot

setup:
	bash scripts/setup.sh

# Bring up a local 4-node x 4-GPU Slurm and show it (later: the full elastic demo).
demo: setup
	bash scripts/demo.sh

# Two test processes (pytest-xdist; the live tests mostly wait on Slurm), each chroot/plugin/pools cluster's
# tests in one of them (tests/conftest.py), and the 10 slowest tests listed at the end.
test: setup
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10

test-unit: setup
	$(VENV)/bin/python -m pytest -q tests/unit

down:
	$(SE) cluster down

lint:
	$(VENV)/bin/ruff check slurm_elastic tests scripts

# The other Debian release's Slurm in a cached chroot (setup runs this too; SLURM_ELASTIC_CHROOT=0 skips it).
chroot: setup
	$(SE) cluster prepare

# Record squeue/nodes JSON from every Slurm version of this machine (host + chroot) into tests/fixtures/.
capture-fixtures: setup
	$(VENV)/bin/python scripts/capture_fixtures.py --slurm all
