#!/usr/bin/env bash
# DSpark training ablation on the bundled model (held-out Python prompts, offline greedy accept
# length of each saved draft): block 8 with and without the acceptance-aware loss, and block 16
# with it. One data cache serves every run, so the runs differ only in the loss and the block.
#   bash benchmark/dspark/train_ablation.sh OUT_DIR [TIME_BUDGET_S] [THREADS]
# Writes OUT_DIR/<variant>/ (draft folders) and prints the summary table
# (benchmark/dspark/summarize_ablation.py) at the end.
set -euo pipefail
OUT=${1:?usage: train_ablation.sh OUT_DIR [TIME_BUDGET_S] [THREADS]}
BUDGET=${2:-300}
THREADS=${3:-1}
TARGET=python/sglang/assets/tiny-bailing-v3
mkdir -p "$OUT"
run() {  # name, extra flags
  local name=$1; shift
  echo "== $name ($*)"
  python3 -m sglang.train.dspark --target-path $TARGET --output-dir "$OUT/$name" \
    --target-layer-ids 1 3 4 --num-threads "$THREADS" --time-budget-s "$BUDGET" \
    --data-cache "$OUT/data_cache.pt" "$@" > "$OUT/$name.log" 2>&1
  tail -1 "$OUT/$name.log"
}
run block8-accept --block-size 8
run block8-ce --block-size 8 --alpha-accept 0
run block16-accept --block-size 16
python3 benchmark/dspark/summarize_ablation.py "$OUT"/block8-accept "$OUT"/block8-ce "$OUT"/block16-accept
