#!/usr/bin/env bash
# Installs ddrl_jax on one freshly booted Cloud TPU VM host (run there by launch/tpu/gcloud_v5p.sh, from
# the repository copy in ~/ddrl_jax): a current Python 3.11 from the deadsnakes PPA (Ubuntu 22.04's own
# python3.11 is an early 3.11.0), a virtualenv ~/ddrl_venv, `pip install -e '.[EXTRAS]'`.
# Fresh hosts often still run unattended-upgrades, which holds the dpkg lock for minutes: apt waits for
# the lock (DPkg::Lock::Timeout) and every network step is retried, so one slow host does not fail a
# 256-host launch. Exits non-zero, with the failing step on stderr, when it still fails.
set -euo pipefail

usage() {
  cat <<'USAGE'
Usage: bash launch/tpu/host_setup.sh [--python=python3.11] [--min-version=3.11.1] [--extras=tpu,video]
                                    [--venv=~/ddrl_venv] [--no-ppa]
  --python=PY        the interpreter to install (an apt package, from deadsnakes unless --no-ppa)
  --min-version=V    refuse an interpreter older than this (default: 3.11.1)
  --extras=LIST      pip extras of ddrl_jax (default: tpu,video)
  --venv=DIR         the virtualenv (default: ~/ddrl_venv)
  --no-ppa           use the distribution's package as it is (no deadsnakes)
Environment: DDRL_SETUP_RETRIES (default 4), DDRL_SETUP_RETRY_SLEEP (seconds, default 20),
DDRL_APT_LOCK_TIMEOUT (seconds apt waits for the dpkg lock, default 900).
USAGE
}

die() { echo "host_setup.sh ($(hostname)): error: $*" >&2; exit 1; }
PY=python3.11 MIN=3.11.1 EXTRAS=tpu,video VENV=$HOME/ddrl_venv PPA=1
for arg in "$@"; do
  case $arg in
    -h|--help) usage; exit 0 ;;
    --python=*) PY=${arg#*=} ;;
    --min-version=*) MIN=${arg#*=} ;;
    --extras=*) EXTRAS=${arg#*=} ;;
    --venv=*) VENV=${arg#*=} ;;
    --no-ppa) PPA=0 ;;
    *) die "unknown option: $arg" ;;
  esac
done
[[ $PY =~ ^python3\.[0-9]+$ ]] || die "--python must be an apt package name like python3.11 (got '$PY')"
[[ $MIN =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || die "--min-version must be X.Y.Z (got '$MIN')"
RETRIES=${DDRL_SETUP_RETRIES:-4} SLEEP=${DDRL_SETUP_RETRY_SLEEP:-20}
LOCK_TIMEOUT=${DDRL_APT_LOCK_TIMEOUT:-900}

retry() {   # retry COMMAND...: up to RETRIES tries, SLEEP x try seconds apart
  local try
  for ((try = 1; try <= RETRIES; try++)); do
    if "$@"; then return 0; fi
    echo "host_setup.sh: try $try of $RETRIES failed: $*" >&2
    ((try < RETRIES)) && sleep $((SLEEP * try))
  done
  die "gave up after $RETRIES tries: $*"
}
apt_get() { sudo env DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$LOCK_TIMEOUT" -y -q "$@"; }

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
[[ -f setup.py ]] || die "no setup.py in $PWD (the repository copy is incomplete)"
if ((PPA)); then
  retry apt_get update
  retry apt_get install software-properties-common
  # --no-update: the update below waits for the dpkg lock; add-apt-repository's own would not.
  retry sudo add-apt-repository -y --no-update ppa:deadsnakes/ppa
fi
retry apt_get update
retry apt_get install "$PY" "$PY-venv"
"$PY" - "$MIN" <<'PYCHECK' || die "$PY is too old (see above); use a newer --python or the Docker image"
import sys
want = tuple(int(x) for x in sys.argv[1].split('.'))
have = sys.version_info[:3]
print(f'{sys.executable}: Python {sys.version.split()[0]}')
sys.exit(0 if have >= want else f'Python {".".join(map(str, have))} < {sys.argv[1]}')
PYCHECK
# A virtualenv left by an earlier run is kept only when it is of this very interpreter.
version() { "$1" -c 'import sys; print(sys.version)' 2>/dev/null; }
if [[ ! -x $VENV/bin/python || $(version "$VENV/bin/python") != "$(version "$PY")" ]]; then
  rm -rf "$VENV"
  "$PY" -m venv "$VENV"
fi
retry "$VENV/bin/python" -m pip install -q -U pip
retry "$VENV/bin/python" -m pip install -q -e ".[$EXTRAS]"
echo "host_setup.sh ($(hostname)): ddrl_jax installed in $VENV"
