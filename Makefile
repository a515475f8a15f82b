# The two commands a newcomer types (see README.md): `make demo` and `make test`.
VENV := .venv
SE := $(VENV)/bin/slurm-elastic
STATE_DIR ?= $(CURDIR)/.cluster
export SLURM_ELASTIC_CLUSTER_DIR := $(STATE_DIR)

.PHONY: setup setup-demo setup-all demo test test-unit down lint capture-fixtures chroot

# setup-demo: only what the demo needs (host Slurm, munge, the package with torch and matplotlib).
# setup-all: everything the tests need (plus the lua plugin, the other Slurm's chroot, pyslurm, extras).
setup-demo:
	bash scripts/setup.sh demo

setup-all:
	bash scripts/setup.sh all

setup: setup-all

# A local 4-node x 4-GPU Slurm; elastic jobs on emulated T4 GPUs under the daemon; a timeline picture.
demo: setup-demo
	bash scripts/demo.sh

# Two test processes (pytest-xdist; the live tests mostly wait on Slurm), each chroot/plugin/pools cluster's
# tests in one of them (tests/conftest.py), and the 10 slowest tests listed at the end.
test: setup-all
	$(VENV)/bin/python -m pytest -q -n 2 --dist loadgroup --durations=10

test-unit: setup-all
	$(VENV)/bin/python -m pytest -q tests/unit

down:
	$(SE) cluster down

lint:
	$(VENV)/bin/ruff check slurm_elastic tests scripts

# The other Debian release's Slurm in a cached chroot (setup runs this too; SLURM_ELASTIC_CHROOT=0 skips it).
chroot: setup-all
	$(SE) cluster prepare

# Record squeue/nodes JSON from every Slurm version of this machine (host + chroot) into tests/fixtures/.
capture-fixtures: setup-all
	$(VENV)/bin/python scripts/capture_fixtures.py --slurm all

# Site install (docs/INSTALL.md): venv at /opt/slurm-elastic, CLI in /usr/local/bin, unit, plugin,
# templates, dashboard, /etc/slurm/elastic.toml. Run as root; SITE_ARGS passes options (--help).
.PHONY: install-site doctor
install-site:
	BUILD_PYTHON=$(if $(wildcard $(VENV)/bin/python),$(VENV)/bin/python,python3) bash scripts/install-site.sh $(SITE_ARGS)

doctor:
	$(SE) doctor
