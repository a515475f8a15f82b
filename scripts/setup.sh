#!/usr/bin/env bash
# Install what slurm-elastic needs on a fresh Debian 12/13 machine (as root). Idempotent.
#
#   scripts/setup.sh demo   what `make demo` needs, nothing more: the host's Slurm and munge from apt
#                           when missing, and the package with torch and matplotlib (extra `demo`) in
#                           ./.venv. About a minute on a fresh machine (torch==2.13.0 is the CPU build
#                           on local disk).
#   scripts/setup.sh all    what `make test` needs (the default): the above, plus the job_submit/lua
#                           plugin, lua5.1 and debootstrap, the dev/train/lightning/hf extras, the other
#                           Debian release's Slurm in a cached chroot and pyslurm for every Slurm.
set -euo pipefail
cd "$(dirname "$0")/.."
level=${1:-all}
case "$level" in
  demo|all) ;;
  *) echo "setup: unknown level '$level' (demo or all)" >&2; exit 2 ;;
esac

tools=(/usr/sbin/slurmctld:slurm-wlm /usr/sbin/slurmd:slurm-wlm /usr/bin/sbatch:slurm-client /usr/sbin/munged:munge)
if [ "$level" = all ]; then
  # Slurm's job_submit/lua plugin is in slurm-wlm-basic-plugins; the lua runtime comes with it.
  tools+=(/usr/sbin/debootstrap:debootstrap /usr/bin/lua5.1:lua5.1
          /usr/lib/x86_64-linux-gnu/slurm-wlm/job_submit_lua.so:slurm-wlm-basic-plugins)
fi
need_apt=()
for tool in "${tools[@]}"; do
  [ -e "${tool%%:*}" ] || need_apt+=("${tool##*:}")
done
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "setup: missing ${need_apt[*]}; run as root so apt-get can install them" >&2
    exit 1
  fi
  echo "setup: apt-get install ${need_apt[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need_apt[@]}" >/dev/null
fi

PY=${PYTHON:-python3}
if [ ! -x .venv/bin/pip ]; then
  # A half-made venv (ensurepip failed once here, transiently) is removed and made again.
  rm -rf .venv
  "$PY" -m venv .venv || { echo "setup: venv creation failed; retrying once" >&2; rm -rf .venv; sleep 3; "$PY" -m venv .venv; }
fi
# torch==2.13.0 (extras demo and train) is the CPU build on local disk; any other pin downloads GBs.
# lightning and hf: the framework integrations' extras (their tests need them; both keep torch 2.13.0).
if [ "$level" = demo ]; then extras='.[demo]'; else extras='.[dev,train,demo,lightning,hf]'; fi
stamp=.venv/.slurm-elastic-installed-$level
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install -q --upgrade pip >/dev/null 2>&1 || true
  .venv/bin/python -m pip install -q -e "$extras"
  touch "$stamp"
fi
if [ "$level" = demo ]; then
  echo "setup: ok for the demo ($(.venv/bin/python --version), $(/usr/sbin/slurmctld -V)); 'make test' sets up the rest"
  exit 0
fi
# A second Slurm version for the tests: the other Debian release's Slurm in a debootstrap chroot
# (trixie -> 24.11 on Debian 12, bookworm -> 22.05 on Debian 13), built once per machine into
# /var/cache/slurm-elastic/chroots and reused when its stamp says it is complete (about 90 s and
# 240 MB the first time). SLURM_ELASTIC_CHROOT=0 skips it (the chroot test cases are then skipped).
# SLURM_ELASTIC_CHROOT_RELEASES=trixie,sid (comma-separated) builds those instead; the tests then
# run against each of them (tests/conftest.py reads the same variable).
other=""
if [ "${SLURM_ELASTIC_CHROOT:-1}" != 0 ] && [ "$(id -u)" = 0 ]; then
  IFS=, read -r -a releases <<< "${SLURM_ELASTIC_CHROOT_RELEASES:-other}"
  for rel in "${releases[@]}"; do
    [ -n "$rel" ] || continue
    .venv/bin/slurm-elastic cluster prepare --slurm "$rel"
    other+=", $(.venv/bin/slurm-elastic cluster prepare --slurm "$rel" --json | .venv/bin/python -c 'import json,sys; d=json.load(sys.stdin); print(d["slurm"] + " in " + d["path"])')"
  done
fi
# pyslurm for the host's Slurm (into .venv) and each chroot's (into its python3), from the release
# tarballs in ../shared/vendor/pyslurm; wheels cached in /var/cache/slurm-elastic/pyslurm-wheels.
bash scripts/build_pyslurm.sh
echo "setup: ok ($(.venv/bin/python --version), $(/usr/sbin/slurmctld -V)${other})"
