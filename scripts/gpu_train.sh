#!/usr/bin/env bash
# GPU host: train the bundled tiny model (docs/bundled_model.md) and, beside it, run the
# gpu-marked test suite.
# Usage (from the project root, wheels staged in .whl by scripts/gpu_wheels.sh):
#   bash scripts/gpu_train.sh [TIME_BUDGET_S]
set -uo pipefail
TAKES_ARGS=1  # TIME_BUDGET_S
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
python3 -c "import torch, fla; print('torch', torch.__version__, 'fla', fla.__version__)"
# Correctness tests only (no timing), so they may share the GPU with training.
(python3 -m pytest -q -m gpu test -p no:cacheprovider > "$OUT/gpu_tests.log" 2>&1; echo "pytest rc=$?" >> "$OUT/gpu_tests.log") &
TESTS=$!
python3 -m sglang.train.target --out python/sglang/assets/tiny-bailing-v3 --time-budget-s "${1:-420}" > "$OUT/train.log" 2>&1
echo "train rc=$?"; tail -c 3000 "$OUT/train.log" | tr '\r' '\n' | tail -25
python3 -m sglang.train.eval --model python/sglang/assets/tiny-bailing-v3 --output "$OUT/eval.json" > "$OUT/eval.log" 2>&1
echo "eval rc=$?"; tail -40 "$OUT/eval.log"
tar cf - -C python/sglang/assets tiny-bailing-v3 | split -b 15m - "$OUT/ckpt.tar.part-"
wait $TESTS; tail -30 "$OUT/gpu_tests.log"
