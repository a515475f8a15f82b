#!/usr/bin/env bash
# Site install of slurm-elastic (docs/INSTALL.md): a venv at PREFIX (default /opt/slurm-elastic) made from a
# Python every user can run, the package installed from a wheel, the CLI on every user's PATH
# (/usr/local/bin/slurm-elastic), and the daemon's unit, the job_submit plugin, the sbatch templates, the
# Grafana dashboard and an example /etc/slurm/elastic.toml in the places INSTALL.md lists.
# Nothing it installs is fetched at run time; pip fetches the dependencies at install time unless
# --pip-args '--no-index --find-links DIR' (an offline wheelhouse) or --no-deps says otherwise.
# It never overwrites /etc/slurm/elastic.toml or an existing /etc/slurm/job_submit.lua.
set -euo pipefail
umask 022

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PREFIX=/opt/slurm-elastic
ROOT=
PYTHON=/usr/bin/python3
BUILD_PYTHON=${BUILD_PYTHON:-python3}
WHEEL=
EXTRAS=train
NO_DEPS=0
SYSTEM_SITE=0
PIP_ARGS=
WITH_PLUGIN=0

usage() {
  cat <<EOF
usage: $0 [options]
  --prefix DIR            the venv (default $PREFIX)
  --root DIR              install everything below DIR instead of / (tests, chroots); paths are DIR-prefixed
  --python PY             the Python of the venv (default $PYTHON); every user must be able to run it
  --wheel FILE            install this wheel (default: build one from this checkout with --build-python)
  --build-python PY       the Python that builds the wheel (default \$BUILD_PYTHON or python3; needs setuptools>=77)
  --extras LIST           pip extras (default "$EXTRAS": torch, for launch and check; "" for the daemon alone)
  --no-deps               install the wheel alone (its dependencies must already be visible to the venv)
  --system-site-packages  let the venv see the system Python's packages (e.g. Debian's python3-numpy)
  --pip-args ARGS         more pip arguments, e.g. '--no-index --find-links /srv/wheels'
  --with-plugin           also copy the job_submit plugin to /etc/slurm/job_submit.lua (only if there is none)
EOF
}

while [ $# -gt 0 ]; do
  case "$1" in
    --prefix) PREFIX=$2; shift 2 ;;
    --root) ROOT=${2%/}; shift 2 ;;
    --python) PYTHON=$2; shift 2 ;;
    --wheel) WHEEL=$2; shift 2 ;;
    --build-python) BUILD_PYTHON=$2; shift 2 ;;
    --extras) EXTRAS=$2; shift 2 ;;
    --no-deps) NO_DEPS=1; shift ;;
    --system-site-packages) SYSTEM_SITE=1; shift ;;
    --pip-args) PIP_ARGS=$2; shift 2 ;;
    --with-plugin) WITH_PLUGIN=1; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "install-site: unknown option $1" >&2; usage >&2; exit 2 ;;
  esac
done

say() { echo "install-site: $*"; }
die() { echo "install-site: $*" >&2; exit 1; }
case "$PREFIX" in /*) ;; *) die "--prefix must be an absolute path, got $PREFIX" ;; esac

# The venv's python links to PYTHON: if any directory above it is closed to others (a pyenv under
# /root, mode 700), nobody but its owner can run the CLI. Refuse that before installing anything.
real=$(readlink -f "$PYTHON") || die "no Python at $PYTHON"
[ -x "$real" ] || die "$PYTHON is not executable"
d=$real
while [ "$d" != "/" ]; do
  perm=$(stat -c %A "$d")
  [ "${perm:9:1}" = "x" ] || [ "${perm:9:1}" = "t" ] || \
    die "$d (on the way to $real) is not open to other users (mode $perm): use a system Python, e.g. --python /usr/bin/python3"
  d=$(dirname "$d")
done

if [ -z "$WHEEL" ]; then
  dist=$(mktemp -d)
  trap 'rm -rf "$dist"' EXIT
  say "building the wheel from $REPO with $BUILD_PYTHON"
  # from a clean copy: an in-tree build reuses build/lib, where a module deleted since would linger
  mkdir "$dist/src"
  tar -C "$REPO" --exclude=./.git --exclude=./.venv --exclude=./build --exclude='*.egg-info' --exclude=./.cluster \
    --exclude=__pycache__ --exclude=./.pytest_cache -cf - . | tar -C "$dist/src" -xf -
  "$BUILD_PYTHON" -m pip wheel --quiet --no-deps --no-build-isolation --no-index -w "$dist" "$dist/src" >&2
  WHEEL=$(ls "$dist"/slurm_elastic-*.whl)
fi
[ -f "$WHEEL" ] || die "no wheel at $WHEEL"

VENV=$ROOT$PREFIX
say "venv $VENV from $real"
venv_args=()
[ "$SYSTEM_SITE" = 1 ] && venv_args+=(--system-site-packages)
"$PYTHON" -m venv "${venv_args[@]}" "$VENV"
spec=$WHEEL
[ -n "$EXTRAS" ] && spec="$WHEEL[$EXTRAS]"
pip_args=(--quiet --no-cache-dir --disable-pip-version-check)
[ "$NO_DEPS" = 1 ] && pip_args+=(--no-deps)
# shellcheck disable=SC2206  # --pip-args is a list of words on purpose
[ -n "$PIP_ARGS" ] && pip_args+=($PIP_ARGS)
say "pip install ${pip_args[*]} $(basename "$spec")"
"$VENV/bin/python" -m pip install "${pip_args[@]}" --force-reinstall "$spec"

site=$(ls -d "$VENV"/lib/python3*/site-packages/slurm_elastic/_site 2>/dev/null | head -1)
[ -n "$site" ] || die "the wheel carries no site files (slurm_elastic/_site): build it with setup.py's build step"

install -d -m 0755 "$ROOT/usr/local/bin" "$ROOT/etc/slurm" "$ROOT/etc/systemd/system" \
  "$ROOT/usr/share/slurm-elastic/sbatch_templates" "$ROOT/usr/share/slurm-elastic/grafana" \
  "$ROOT/usr/share/doc/slurm-elastic"
ln -sfn "$VENV/bin/slurm-elastic" "$ROOT/usr/local/bin/slurm-elastic"
install -m 0644 "$site/packaging/systemd/slurm-elastic.service" "$ROOT/etc/systemd/system/slurm-elastic.service"
install -m 0644 "$site/plugins/job_submit_elastic.lua" "$ROOT/usr/share/slurm-elastic/job_submit_elastic.lua"
install -m 0644 "$site"/sbatch_templates/* "$ROOT/usr/share/slurm-elastic/sbatch_templates/"
install -m 0644 "$site/packaging/grafana/slurm-elastic.json" "$ROOT/usr/share/slurm-elastic/grafana/"
install -m 0644 "$site/docs/INSTALL.md" "$site/docs/SYSADMIN.md" "$site/docs/elastic.toml.example" \
  "$ROOT/usr/share/doc/slurm-elastic/"
if [ -e "$ROOT/etc/slurm/elastic.toml" ]; then
  say "kept $ROOT/etc/slurm/elastic.toml (the new defaults: /usr/share/doc/slurm-elastic/elastic.toml.example)"
else
  install -m 0644 "$site/docs/elastic.toml.example" "$ROOT/etc/slurm/elastic.toml"
fi
if [ "$WITH_PLUGIN" = 1 ]; then
  if [ -e "$ROOT/etc/slurm/job_submit.lua" ]; then
    cmp -s "$ROOT/etc/slurm/job_submit.lua" "$site/plugins/job_submit_elastic.lua" || \
      say "kept the existing $ROOT/etc/slurm/job_submit.lua (merge /usr/share/slurm-elastic/job_submit_elastic.lua into it)"
  else
    install -m 0644 "$site/plugins/job_submit_elastic.lua" "$ROOT/etc/slurm/job_submit.lua"
  fi
fi

if [ "$NO_DEPS" = 0 ]; then
  "$ROOT/usr/local/bin/slurm-elastic" --version
fi
cat <<EOF
install-site: installed into $VENV; CLI: $ROOT/usr/local/bin/slurm-elastic
Next (docs/INSTALL.md):
  1. JobSubmitPlugins=lua in slurm.conf and /etc/slurm/job_submit.lua (--with-plugin, or copy
     /usr/share/slurm-elastic/job_submit_elastic.lua), then: scontrol reconfigure
  2. slurm-elastic doctor            # what the daemon needs from slurm.conf; fix every FAIL
  3. systemctl daemon-reload && systemctl enable --now slurm-elastic
EOF
