#!/usr/bin/env bash
# DSpark training ablation on the bundled model (held-out Python prompts, offline greedy accept
# length of each saved draft): block 8 with DSpark's loss (0.1 CE + 0.9 L1 + confidence BCE +
# 0.5 acceptance-aware, the training default until benchmark/dspark/loss_seeds.sh decided for
# plain CE), the same without the acceptance-aware term, and plain CE (+ the confidence head's
# BCE, which trains that head only through the shared backbone); block 16 with DSpark's loss.
# One data cache serves every run, so the runs differ only in the loss and the block.
#   bash benchmark/dspark/train_ablation.sh OUT_DIR [STEPS] [THREADS]
# Every run trains the same number of optimizer steps (not the same time: a shared machine
# would give the runs different step counts); OUT_DIR/<variant>/ holds the draft folders, and
# the summary table (benchmark/dspark/summarize_ablation.py) is printed at the end.
set -euo pipefail
OUT=${1:?usage: train_ablation.sh OUT_DIR [STEPS] [THREADS]}
STEPS=${2:-300}
THREADS=${3:-1}
TARGET=python/sglang/assets/tiny-bailing-v3
mkdir -p "$OUT"
run() {  # name, extra flags
  local name=$1; shift
  echo "== $name ($*)"
  python3 -m sglang.train.dspark --target-path $TARGET --output-dir "$OUT/$name" \
    --target-layer-ids 1 3 4 --num-threads "$THREADS" --steps "$STEPS" --time-budget-s 86400 \
    --data-cache "$OUT/data_cache.pt" "$@" > "$OUT/$name.log" 2>&1
  tail -1 "$OUT/$name.log"
}
RECIPE="--alpha-ce 0.1 --alpha-tv 0.9"  # DSpark's CE / L1 mix (the default is plain CE)
run block8-accept --block-size 8 $RECIPE --alpha-accept 0.5
run block8-l1 --block-size 8 $RECIPE --alpha-accept 0
run block8-plain-ce --block-size 8 --alpha-ce 1 --alpha-tv 0 --alpha-accept 0
run block16-accept --block-size 16 $RECIPE --alpha-accept 0.5
python3 benchmark/dspark/summarize_ablation.py "$OUT"/block8-accept "$OUT"/block8-l1 \
  "$OUT"/block8-plain-ce "$OUT"/block16-accept
