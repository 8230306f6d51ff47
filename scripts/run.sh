#!/usr/bin/env bash
# The main job: installs what is missing, builds, then trains gpt2-mini on the embedded
# German->English corpus with data parallelism over two CPU ranks (Gloo) and prints the results.
# Extra arguments are passed to run_data_parallel (e.g. --n_epochs 2).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
# The demo runs run_data_parallel; run_pipeline is built too, so that every command of README's
# Quick start runs after this one. The tools and test suites are left to scripts/build.sh.
"$ROOT/scripts/build.sh" run_data_parallel run_pipeline
BUILD_DIR="${BUILD_DIR:-$ROOT/build}"
WORKDIR="${WORKDIR:-$ROOT/workdir/main}"
cd "$ROOT"
echo "[run] run_data_parallel --world_size 2 on the embedded corpus (gpt2-mini); a \"device\" here is a CPU process with half the cores"
# Settings for a few CPU-minutes: sequences of the embedded corpus fit in 40 tokens; a larger
# learning rate than the original's 1e-4 and a smaller batch give enough optimizer steps.
"$BUILD_DIR/run_data_parallel" --world_size 2 --model gpt2-mini --workdir "$WORKDIR" \
  --n_epochs 3 --batch_size 32 --learning_rate 1e-3 --model_max_length 40 --fit_vocab "$@"
echo "[run] results, tokenizer.model, model.safetensors and config.json are in $WORKDIR"
