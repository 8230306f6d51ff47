#!/usr/bin/env bash
# Prepares, on this machine, what a GPU machine without network needs besides the source tree to
# run scripts/gpu_check.py, in one git-ignored folder (default .gpu_bundle/) that travels with the
# tree (64 MiB in all, tree included):
#   debs/      the Debian development packages the build needs (SentencePiece and its runtime
#              library, nlohmann-json, cxxopts, Gloo's headers, GoogleTest/GoogleMock) and pkgconf,
#              at the versions installed here; gpu_check.py unpacks them with dpkg -x into a prefix
#   include/   nccl.h from the torch wheel's NCCL, in case the GPU machine's CUDA toolkit has none
#   bin/       stripped cuda_tests, run_pipeline, run_data_parallel and gpu_throughput built here,
#              which gpu_check.py runs when they match the tree and load there (it builds otherwise,
#              and builds anyway to check that the build works there)
#   manifest.json  versions, the hash of the sources the binaries were built from, sizes
#
# Usage: scripts/gpu_bundle.sh [--out DIR] [--build-dir DIR] [--no-build] [--no-binaries]
#   --build-dir DIR  where to take (and first bring up to date) the binaries; default build/
#   --no-build       take the binaries as they are in --build-dir (none if missing)
#   --no-binaries    debs and headers only
# Prints the bundle's size and the size of everything that travels; fails above 64 MiB.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT_DIR="$ROOT/.gpu_bundle"
BUILD_DIR="$ROOT/build"
BUILD=1
BINARIES=1
LIMIT=$((64 * 1024 * 1024))

# The Debian packages whose headers, CMake files, pkg-config files and libraries the build uses
# (scripts/setup.sh installs the same ones here), plus pkgconf for a machine without pkg-config.
# libgmock-dev: Debian's GTest CMake package declares the gmock targets and checks their files.
PACKAGES=(libsentencepiece-dev libsentencepiece0 nlohmann-json3-dev libcxxopts-dev libgloo-dev
          libgtest-dev libgmock-dev pkgconf-bin libpkgconf3)
PROGRAMS=(tests/cuda_tests run_pipeline run_data_parallel gpu_throughput)

log() { printf '[gpu_bundle] %s\n' "$*"; }
die() { printf '[gpu_bundle] error: %s\n' "$*" >&2; exit 1; }

while (($#)); do
  case "$1" in
    --out) OUT_DIR="$(realpath -m "$2")"; shift 2 ;;
    --build-dir) BUILD_DIR="$(realpath -m "$2")"; shift 2 ;;
    --no-build) BUILD=0; shift ;;
    --no-binaries) BINARIES=0; shift ;;
    -h|--help) sed -n '2,20p' "$0"; exit 0 ;;
    *) die "unknown argument '$1' (see --help)" ;;
  esac
done

# The hash of what the binaries are compiled from, by the same function that gpu_check.py applies
# to the tree it gets, where git may be absent (only these files travel as they are here).
source_hash() { python3 "$ROOT/scripts/gpu_check.py" --source-hash; }

mkdir -p "$OUT_DIR/debs" "$OUT_DIR/include"

# ---- Debian packages --------------------------------------------------------------------------
command -v apt-get >/dev/null || die "apt-get not found: this script runs on Debian/Ubuntu"
# debs/<package>.deb (plain names: they travel to a machine that may be picky about file names),
# their versions in debs/VERSIONS; a package already there at the wanted version is kept.
versions=()
touch "$OUT_DIR/debs/VERSIONS"
for p in "${PACKAGES[@]}"; do
  v="$(dpkg-query -W -f='${Version}' "$p" 2>/dev/null || true)"
  [[ -n "$v" ]] || v="$(apt-cache policy "$p" 2>/dev/null | awk '/Candidate:/ {print $2}')"
  [[ -n "$v" && "$v" != "(none)" ]] || die "package $p: neither installed nor known to apt (run apt-get update)"
  versions+=("$p=$v")
  if [[ -f "$OUT_DIR/debs/$p.deb" ]] && grep -qxF "$p=$v" "$OUT_DIR/debs/VERSIONS"; then
    continue
  fi
  scratch="$(mktemp -d)"
  cached="$(compgen -G "/var/cache/apt/archives/${p}_${v//:/%3a}_*.deb" | head -1 || true)"
  if [[ -n "$cached" ]]; then
    cp "$cached" "$scratch/"
  else
    (cd "$scratch" && apt-get download -q "$p=$v" >/dev/null 2>"$scratch/error") ||
      die "apt-get download $p=$v failed: $(tail -2 "$scratch/error" 2>/dev/null)"
  fi
  mv "$scratch"/*.deb "$OUT_DIR/debs/$p.deb"
  rm -rf "$scratch"
done
printf '%s\n' "${versions[@]}" >"$OUT_DIR/debs/VERSIONS"
# Anything else in debs/ (a package no longer listed) would be unpacked too.
for f in "$OUT_DIR"/debs/*.deb; do
  [[ " ${PACKAGES[*]} " == *" $(basename "$f" .deb) "* ]] || rm -f "$f"
done
log "Debian packages: ${versions[*]}"

# ---- nccl.h -----------------------------------------------------------------------------------
NCCL_H=""
for candidate in "$ROOT"/.venv/lib/python3*/site-packages/nvidia/nccl/include/nccl.h /usr/local/cuda/include/nccl.h; do
  [[ -f "$candidate" ]] && { NCCL_H="$candidate"; break; }
done
if [[ -n "$NCCL_H" ]]; then
  cp "$NCCL_H" "$OUT_DIR/include/nccl.h"
else
  log "note: no nccl.h here (.venv's nvidia-nccl or /usr/local/cuda); the GPU machine's own must do"
fi

# ---- binaries ---------------------------------------------------------------------------------
rm -rf "$OUT_DIR/bin"
binaries_hash=""
if ((BINARIES)); then
  if ((BUILD)); then
    [[ -f "$BUILD_DIR/build.ninja" || -f "$BUILD_DIR/Makefile" ]] ||
      die "no configured build in $BUILD_DIR (scripts/build.sh makes one; or --no-binaries)"
    log "bringing ${PROGRAMS[*]} up to date in $BUILD_DIR"
    cmake --build "$BUILD_DIR" -j "$(nproc)" --target cuda_tests run_pipeline run_data_parallel gpu_throughput >/dev/null ||
      die "building the programs in $BUILD_DIR failed (run: cmake --build $BUILD_DIR --target cuda_tests)"
  fi
  missing=()
  for prog in "${PROGRAMS[@]}"; do [[ -x "$BUILD_DIR/$prog" ]] || missing+=("$prog"); done
  if ((${#missing[@]})); then
    log "note: no binaries carried (missing in $BUILD_DIR: ${missing[*]}); gpu_check.py will build"
  else
    mkdir -p "$OUT_DIR/bin"
    for prog in "${PROGRAMS[@]}"; do
      strip --strip-debug -o "$OUT_DIR/bin/$(basename "$prog")" "$BUILD_DIR/$prog"
    done
    # Taken as they are (--no-build): a source of a program newer than the program means it may be
    # stale, and then the bundle carries no source hash, so gpu_check.py builds instead.
    newer=""
    for prog in "${PROGRAMS[@]}"; do
      own=(apps/"$(basename "$prog")".cpp apps/*.h)
      [[ "$prog" == tests/* ]] && own=(tests/CMakeLists.txt tests/cuda)
      found="$(cd "$ROOT" && find CMakeLists.txt cmake include src "${own[@]}" -type f \
                 \( -name '*.cpp' -o -name '*.h' -o -name '*.hpp' -o -name 'CMakeLists.txt' \) \
                 -newer "$BUILD_DIR/$prog" 2>/dev/null | head -1)"
      [[ -n "$found" ]] && newer="$found is newer than $BUILD_DIR/$prog"
    done
    if [[ -n "$newer" ]]; then
      log "note: $newer: the programs may be stale, carried without a source hash"
    else
      binaries_hash="$(source_hash)"
    fi
  fi
fi

# ---- manifest ---------------------------------------------------------------------------------
PY="$ROOT/.venv/bin/python"
[[ -x "$PY" ]] || PY=python3
torch_version="$("$PY" -c 'import torch; print(torch.__version__)' 2>/dev/null || echo unknown)"
git_head="$(git -C "$ROOT" rev-parse HEAD 2>/dev/null || echo unknown)"
git_dirty="$(git -C "$ROOT" status --porcelain 2>/dev/null | wc -l)"
python3 - "$OUT_DIR/manifest.json" "$torch_version" "$binaries_hash" "$git_head" "$git_dirty" \
  "$(ldd --version 2>/dev/null | head -1)" "${versions[@]}" <<'PY'
import datetime, json, os, sys
path, torch_version, binaries_hash, head, dirty, libc, *versions = sys.argv[1:]
root = os.path.dirname(path)
files = {}
for folder, _, names in os.walk(root):
    for n in names:
        full = os.path.join(folder, n)
        if full != path:
            files[os.path.relpath(full, root)] = os.path.getsize(full)
json.dump({"made": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch_built_against": torch_version,
           "binaries_source_hash": binaries_hash or None,
           "git_head": head, "git_changed_files": int(dirty), "libc": libc,
           "packages": dict(v.split("=", 1) for v in versions),
           "files": files}, open(path, "w"), indent=2)
PY

# ---- sizes ------------------------------------------------------------------------------------
bundle_bytes="$(du -sb "$OUT_DIR" | cut -f1)"
tree_bytes="$(cd "$ROOT" && git ls-files -z --cached --others --exclude-standard 2>/dev/null |
              xargs -0 -r stat -c %s 2>/dev/null | awk '{s += $1} END {print s + 0}')"
total=$((bundle_bytes + tree_bytes))
mib() { awk -v b="$1" 'BEGIN {printf "%.1f MiB", b / 1048576}'; }
log "bundle $OUT_DIR: $(mib "$bundle_bytes") ($bundle_bytes bytes; binaries: $([[ -d $OUT_DIR/bin ]] && echo yes || echo no))"
log "travels with the tree: $(mib "$total") of 64 MiB (tree $(mib "$tree_bytes"))"
((bundle_bytes < LIMIT)) || die "the bundle is $(mib "$bundle_bytes"), over 64 MiB"
((total < LIMIT)) || die "tree and bundle together are $(mib "$total"), over the 64 MiB that travel"
echo "$bundle_bytes"
