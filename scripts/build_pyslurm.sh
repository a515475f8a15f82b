#!/usr/bin/env bash
# Build and install pyslurm for every Slurm of this machine (scripts/setup.sh runs it; idempotent):
#   * the host's Slurm -> into ./.venv (apt libslurm-dev; Cython<3 for pyslurm 22.x from PyPI);
#   * each prepared chroot's Slurm -> into the chroot's system Python (Debian's cython3,
#     python3-setuptools, python3-wheel, libslurm-dev; pip --no-index --break-system-packages).
# Sources: the pyslurm release tarballs in ../shared/vendor/pyslurm (SLURM_ELASTIC_PYSLURM_SRC
# overrides), one per Slurm major version (pyslurm refuses any other). Without them this prints why
# and exits 0: the pyslurm tests are then skipped (failed in CI, SLURM_ELASTIC_REQUIRE_SLURM=1).
# Built wheels are cached in /var/cache/slurm-elastic/pyslurm-wheels/ (SLURM_ELASTIC_WHEEL_CACHE),
# keyed by pyslurm version, Slurm version and Python tag: a build is ~4 CPU-minutes, a reuse seconds.
set -euo pipefail
cd "$(dirname "$0")/.."

SRC=${SLURM_ELASTIC_PYSLURM_SRC:-../shared/vendor/pyslurm}
CACHE=${SLURM_ELASTIC_WHEEL_CACHE:-/var/cache/slurm-elastic/pyslurm-wheels}
CHROOTS=${SLURM_ELASTIC_CHROOT_CACHE:-/var/cache/slurm-elastic/chroots}
PKGS_CHROOT=(python3 python3-dev python3-pip cython3 python3-setuptools python3-wheel libslurm-dev gcc libc6-dev)

if ! ls "$SRC"/pyslurm-*.tar.gz >/dev/null 2>&1; then
  echo "pyslurm: no pyslurm sources in $SRC; the pyslurm backend tests will be skipped"
  exit 0
fi
if [ "$(id -u)" != 0 ]; then
  echo "pyslurm: building needs root (apt-get, chroot); skipped" >&2
  exit 0
fi
mkdir -p "$CACHE"
exec 9>"$CACHE/.lock"
flock 9  # one builder at a time per machine

# The tarball for a Slurm version "22.05.8": pyslurm-22.5.*.tar.gz (pyslurm numbers 22.05 as 22.5).
tarball_for() {
  local maj=${1%%.*} rest=${1#*.}; local min=$((10#${rest%%.*}))
  ls "$SRC"/pyslurm-"$maj"."$min".*.tar.gz 2>/dev/null | sort -V | tail -n 1
}

# build KEYDIR BUILD-COMMAND...: run the build into KEYDIR.partial unless KEYDIR holds a wheel.
cached_wheel() { ls "$1"/pyslurm-*.whl 2>/dev/null | head -n 1; }

# ----- the host's Slurm -> .venv ---------------------------------------------------------------
host_slurm=$(/usr/sbin/slurmctld -V | awk '{print $2}')
tar=$(tarball_for "$host_slurm")
if [ -z "$tar" ]; then
  echo "pyslurm: no pyslurm release for Slurm $host_slurm in $SRC; host pyslurm skipped"
else
  ver=$(basename "$tar" .tar.gz); ver=${ver#pyslurm-}
  pytag=$(.venv/bin/python -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  key="$CACHE/pyslurm-${ver}_slurm-${host_slurm}_${pytag}"
  if [ -z "$(cached_wheel "$key")" ]; then
    [ -e /usr/include/slurm/slurm.h ] || { export DEBIAN_FRONTEND=noninteractive; apt-get install -y -qq libslurm-dev >/dev/null; }
    cython='Cython>=0.29.30,<3.0'; [ "${ver%%.*}" -ge 23 ] && cython='Cython>=0.29.37'
    .venv/bin/python -m pip install -q "$cython" setuptools wheel
    echo "pyslurm: building $ver for Slurm $host_slurm ($pytag), about 4 CPU-minutes"
    rm -rf "$key.partial"; mkdir -p "$key.partial"
    SLURM_LIB_DIR=/usr/lib/x86_64-linux-gnu SLURM_INCLUDE_DIR=/usr/include \
      .venv/bin/python -m pip wheel -q --no-build-isolation --no-deps -w "$key.partial" "$tar"
    rm -rf "$key"; mv "$key.partial" "$key"
  fi
  whl=$(cached_wheel "$key")
  have=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("pyslurm"))' 2>/dev/null || true)
  if [ "$have" != "$ver" ]; then
    .venv/bin/python -m pip install -q --no-deps --force-reinstall "$whl"
  fi
  echo "pyslurm: $ver for Slurm $host_slurm in .venv (wheel $whl)"
fi

# ----- each prepared chroot's Slurm -> the chroot's python3 ---------------------------------
for stamp in "$CHROOTS"/*.stamp; do
  [ -e "$stamp" ] || continue
  rel=$(basename "$stamp" .stamp); root="$CHROOTS/$rel"
  [ -x "$root/usr/sbin/slurmctld" ] || continue
  slurm=$(chroot "$root" /usr/sbin/slurmctld -V | awk '{print $2}')
  tar=$(tarball_for "$slurm")
  if [ -z "$tar" ]; then
    echo "pyslurm: no pyslurm release for Slurm $slurm ($rel chroot) in $SRC; skipped"
    continue
  fi
  ver=$(basename "$tar" .tar.gz); ver=${ver#pyslurm-}
  missing=()
  for p in "${PKGS_CHROOT[@]}"; do
    chroot "$root" dpkg-query -W -f '${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    echo "pyslurm: apt-get install ${missing[*]} in the $rel chroot"
    cp /etc/resolv.conf "$root/etc/resolv.conf"
    chroot "$root" apt-get update -qq
    DEBIAN_FRONTEND=noninteractive chroot "$root" apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  fi
  pytag=$(chroot "$root" python3 -c 'import sys; print(f"cp{sys.version_info[0]}{sys.version_info[1]}")')
  key="$CACHE/pyslurm-${ver}_slurm-${slurm}_${pytag}"
  work="$root/tmp/slurm-elastic-pyslurm"
  if [ -z "$(cached_wheel "$key")" ]; then
    echo "pyslurm: building $ver for Slurm $slurm in the $rel chroot ($pytag), about 4 CPU-minutes"
    rm -rf "$work"; mkdir -p "$work/out"; cp "$tar" "$work/"
    chroot "$root" env SLURM_LIB_DIR=/usr/lib/x86_64-linux-gnu SLURM_INCLUDE_DIR=/usr/include \
      python3 -m pip wheel -q --no-build-isolation --no-index --no-deps -w /tmp/slurm-elastic-pyslurm/out \
      "/tmp/slurm-elastic-pyslurm/$(basename "$tar")"
    rm -rf "$key.partial"; mkdir -p "$key.partial"; cp "$work"/out/pyslurm-*.whl "$key.partial/"
    rm -rf "$key"; mv "$key.partial" "$key"
  fi
  have=$(chroot "$root" python3 -c 'import importlib.metadata as m; print(m.version("pyslurm"))' 2>/dev/null || true)
  if [ "$have" != "$ver" ]; then
    whl=$(cached_wheel "$key")
    rm -rf "$work"; mkdir -p "$work"; cp "$whl" "$work/"
    chroot "$root" python3 -m pip install -q --no-index --no-deps --force-reinstall --break-system-packages --root-user-action=ignore \
      "/tmp/slurm-elastic-pyslurm/$(basename "$whl")"
  fi
  rm -rf "$work"
  echo "pyslurm: $ver for Slurm $slurm in the $rel chroot's python3 (wheel $(cached_wheel "$key"))"
done
