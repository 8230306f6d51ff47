#!/usr/bin/env bash
# Installs what is missing (scripts/setup.sh), then configures and builds into build/.
# Usage: scripts/build.sh [TARGET ...]: everything (the programs, tools and test suites), or only
# the targets named and what they need (e.g. scripts/build.sh run_data_parallel).
# Torch_DIR=/path/to/libtorch/share/cmake/Torch builds against another LibTorch.
# BUILD_DIR overrides the build folder (default: build).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
"$ROOT/scripts/setup.sh"

BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
args=(-S "$ROOT" -B "$BUILD_DIR" -G Ninja)
[[ -n "${Torch_DIR:-}" ]] && args+=("-DTorch_DIR=$Torch_DIR")
if [[ ! -f "$BUILD_DIR/build.ninja" || -n "${Torch_DIR:-}" ]]; then
  echo "[build] configuring $BUILD_DIR"
  mkdir -p "$BUILD_DIR"
  cmake "${args[@]}" -Wno-dev >"$BUILD_DIR/configure.log" 2>&1 || {
    cat "$BUILD_DIR/configure.log" >&2
    echo "[build] error: cmake configure failed (log above)" >&2
    exit 1
  }
fi
targets=()
for target in "$@"; do targets+=(--target "$target"); done
echo "[build] building ${*:-everything} (ninja, $(nproc) jobs)"
cmake --build "$BUILD_DIR" -j "$(nproc)" "${targets[@]}"
