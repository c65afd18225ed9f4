#!/usr/bin/env bash
# The acceptance-aware loss against plain CE over several seeds: the bundled draft's
# architecture and block, trained on the bundled model's data with DSpark's loss and the
# acceptance-aware term (0.1 CE + 0.9 L1 + confidence BCE + 0.5 acceptance-aware; run name
# "default", the training default when the script was written) and with plain CE (+ the
# confidence head's BCE, the default since), the same number of optimizer steps, once per
# training seed (--train-seed). One data cache serves every run, so a seed changes only the
# initialisation and the batches; runs already done are kept, so a second invocation
# completes an interrupted set.
#   bash benchmark/dspark/loss_seeds.sh OUT_DIR [STEPS] [SEEDS] [JOBS]
# STEPS default 800 (the bundled draft's budget until 2026-12-05), SEEDS default "0 1 2", JOBS
# runs at a time (default 2, one thread each, after one short run that builds the shared data
# cache). The summary (benchmark/dspark/summarize_ablation.py --by-loss: mean and spread per
# loss) prints last. Environment:
#   EXTRA   flags for every run and the cache build (data size and draft architecture; the
#           cache records its data flags, so a run with other ones refuses it). The bundled
#           draft's budget since 2026-12-05: EXTRA="--prompts-per-setting 512
#           --num-draft-layers 3 --intermediate-size 1024 --markov-rank 64", STEPS=3200.
#   BLOCK15 also train plain CE at block 15 (run name "plain-ce-b15") for every seed.
#   BUDGET  --time-budget-s of each run (default 86400: the steps decide). A run cut by it
#           finishes its schedule on the time clock; its train_log.json records its steps.
#   SUMMARY_JSON  also write the summary's rows there (JSON lines).
# Runs pick the device as sglang.train.dspark does (CUDA when there is one).
set -euo pipefail
OUT=${1:?usage: loss_seeds.sh OUT_DIR [STEPS] [SEEDS] [JOBS]}
STEPS=${2:-800}
SEEDS=${3:-0 1 2}
JOBS=${4:-2}
TARGET=python/sglang/assets/tiny-bailing-v3
mkdir -p "$OUT"
run() {  # name seed extra flags...; a run whose folder holds its log already is kept
  local name=$1 seed=$2; shift 2
  [ -f "$OUT/$name-s$seed/train_log.json" ] && { echo "$name seed $seed: done before"; return; }
  python3 -m sglang.train.dspark --target-path $TARGET --output-dir "$OUT/$name-s$seed" \
    --target-layer-ids 1 3 4 --num-threads 1 --steps "$STEPS" --time-budget-s "$BUDGET" \
    --train-seed "$seed" --data-cache "$OUT/data_cache.pt" $EXTRA "$@" \
    > "$OUT/$name-s$seed.log" 2>&1
  echo "$name seed $seed: $(tail -1 "$OUT/$name-s$seed.log")"
}
export -f run
EXTRA=${EXTRA:-}
BUDGET=${BUDGET:-86400}
export OUT STEPS TARGET EXTRA BUDGET
read -ra seeds <<< "$SEEDS"
# One short run builds the data cache (the target's generations and features) that every
# training run below reads; its one-step draft is not part of the comparison.
[ -f "$OUT/data_cache.pt" ] || python3 -m sglang.train.dspark --target-path $TARGET \
  --output-dir "$OUT/cache-build" --target-layer-ids 1 3 4 --num-threads "$JOBS" --steps 1 \
  --data-cache "$OUT/data_cache.pt" $EXTRA > "$OUT/cache-build.log" 2>&1
{
  recipe="--alpha-ce 0.1 --alpha-tv 0.9 --alpha-accept 0.5"
  for s in "${seeds[@]}"; do echo "default $s $recipe"; done
  for s in "${seeds[@]}"; do echo "plain-ce $s --alpha-ce 1 --alpha-tv 0 --alpha-accept 0"; done
  if [ "${BLOCK15:-0}" = 1 ]; then
    for s in "${seeds[@]}"; do
      echo "plain-ce-b15 $s --alpha-ce 1 --alpha-tv 0 --alpha-accept 0 --block-size 15"
    done
  fi
} | xargs -P "$JOBS" -L 1 bash -c 'run "$@"' _
shopt -s nullglob
python3 benchmark/dspark/summarize_ablation.py --by-loss "$OUT"/default-s*/ "$OUT"/plain-ce-s*/ \
  "$OUT"/plain-ce-b15-s*/ ${SUMMARY_JSON:+--json "$SUMMARY_JSON"}
