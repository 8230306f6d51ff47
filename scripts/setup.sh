#!/usr/bin/env bash
# Installs what the build and the scripts need, and nothing twice:
# Debian packages (compilers' libraries, SentencePiece, JSON, cxxopts, Gloo headers, ccache,
# Slurm and munge for scripts/cluster.py's emulated hosts)
# and a git-ignored virtual environment .venv holding the pinned PyPI torch wheel,
# whose bundled LibTorch is what CMake links, plus the Python packages of scripts/.
#
# Safe to run again: a second run checks, prints "up to date" and changes nothing.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"

# One place for every pinned version.
TORCH_VERSION="2.11.0"
PY_PACKAGES=(
  "torch==${TORCH_VERSION}"
  "numpy"
  "matplotlib"
  "safetensors"
  "transformers==4.57.6"
  "sacrebleu==2.6.0"
  "tensorboard==2.21.0"
)
APT_PACKAGES=(
  build-essential cmake ninja-build ccache pkg-config git
  python3 python3-venv
  libsentencepiece-dev nlohmann-json3-dev libcxxopts-dev libgloo-dev
  libgtest-dev libgmock-dev libbenchmark-dev
  # Slurm on scripts/cluster.py's hosts (`up N --slurm`), which starts its own munged, slurmctld
  # and slurmd with its own config: the packages' system services are not used.
  slurm-wlm munge
)

log() { printf '[setup] %s\n' "$*"; }
die() { printf '[setup] error: %s\n' "$*" >&2; exit 1; }

# ---- Debian packages -------------------------------------------------------
missing=()
for p in "${APT_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  log "installing Debian packages: ${missing[*]}"
  SUDO=""
  if [[ $(id -u) -ne 0 ]]; then
    command -v sudo >/dev/null || die "need root (or sudo) to install: ${missing[*]}"
    SUDO="sudo"
  fi
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -qq ||
    die "apt-get update failed: Debian's package registry cannot be reached (needed for: ${missing[*]})"
  $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null ||
    die "apt-get install failed for: ${missing[*]}"
else
  log "Debian packages: up to date"
fi

# ---- Python virtual environment with the torch wheel -------------------------
VENV="$ROOT/.venv"
STAMP="$VENV/.setup-stamp"
WANT="$(printf '%s\n' "${PY_PACKAGES[@]}")"
if [[ -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]] && "$VENV/bin/python" -c "import torch" 2>/dev/null; then
  log "Python environment .venv: up to date (torch $("$VENV/bin/python" -c 'import torch;print(torch.__version__)'))"
else
  PYTHON="${PYTHON:-python3}"
  command -v "$PYTHON" >/dev/null || die "python3 not found"
  if [[ ! -x "$VENV/bin/python" ]]; then
    log "creating virtual environment .venv"
    "$PYTHON" -m venv "$VENV" || die "python3 -m venv failed (is python3-venv installed?)"
  fi
  log "installing Python packages into .venv: ${PY_PACKAGES[*]} (torch is about 4.7 GB; a few minutes)"
  "$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null ||
    die "pip could not reach PyPI to upgrade itself"
  # A download cut short (a wheel of several hundred MB over a flaky link) is tried again from the
  # start, up to three times, before giving up.
  installed=0
  for attempt in 1 2 3; do
    if "$VENV/bin/python" -m pip install -q "${PY_PACKAGES[@]}"; then
      installed=1
      break
    fi
    log "pip install failed (attempt $attempt of 3)"
  done
  ((installed)) ||
    die "pip install failed: PyPI cannot be reached or a pinned version is not served (${PY_PACKAGES[*]})"
  printf '%s' "$WANT" >"$STAMP"
  log "Python environment .venv: ready"
fi
