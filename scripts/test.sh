#!/usr/bin/env bash
# Installs what is missing, builds, and runs the whole test suite (GoogleTest via CTest, and
# the Python checks registered with it). Extra arguments go to ctest (e.g. -R pipeline).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
"$ROOT/scripts/build.sh"
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
cd "$BUILD_DIR"
echo "[test] running the test suite"
ctest --output-on-failure --timeout 900 "$@"
