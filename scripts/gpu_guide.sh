#!/usr/bin/env bash
# docs/serving_ling_flash.md followed end to end on one H200, with a checkpoint folder made on
# the spot instead of a download: scripts/make_random_checkpoint.py writes LAYERS layers of the
# real width in block fp8 with the MTP layer and the bundled tokenizer (default 6: five KDA
# layers and one MLA layer), then the guide's §4 command serves it (without and with NEXTN),
# a text request goes through /v1/completions, and §5's bench_serving measures the seed's
# workload. Logs and JSON lines under $OUT (or pack them with scripts/gpu_call.sh):
#
#   bash scripts/gpu_call.sh "540 gpu_guide.sh LAYERS=6"
#
# The folder goes to CKPT (default /tmp/ling-flash-guide; 17 GB for 6 layers, as the tool
# computes it). PROMPTS (default 4) prompts of 8192 in / 1024 out at concurrency 1;
# GUIDE_NEXTN=0 serves without NEXTN only, GUIDE_NEXTN=only with NEXTN only. GUIDE_DUMMY=1
# makes no folder and serves §4's commands on the whole 42-layer model with dummy weights
# instead (`--model-path ling-3.0-flash --load-format dummy`; a 42-layer folder, about 117 GB,
# does not fit the host's disk).
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names, serve / stop_server
CKPT=${CKPT:-/tmp/ling-flash-guide}
PORT=${PORT:-30730}
SERVE_WAIT=${SERVE_WAIT:-300}
date -u; git log --oneline -1

if [ "${GUIDE_DUMMY:-0}" = 1 ]; then
  MODEL="ling-3.0-flash --load-format dummy"
else
  echo "== make the checkpoint folder (${LAYERS:-6} layers, fp8, MTP layer)"
  start=$(date +%s)
  python3 scripts/make_random_checkpoint.py "$CKPT" --overwrite --device cuda --quantization fp8 \
    --json-model-override-args "{\"num_hidden_layers\": ${LAYERS:-6}}" > "$OUT/guide_make.log" 2>&1 \
    || { tail -5 "$OUT/guide_make.log"; exit 1; }
  tail -4 "$OUT/guide_make.log"; echo "made in $(( $(date +%s) - start )) s"; du -sh "$CKPT"
  MODEL=$CKPT
fi

# The guide's §4 commands, with the folder (or the dummy model) as --model-path.
GUIDE="--model-path $MODEL --quantization fp8 --mem-fraction-static 0.93 --context-length 9216 \
--max-running-requests 2 --cuda-graph-max-bs 1"
specs=("" "--speculative-algorithm NEXTN --speculative-num-steps 3")
# GUIDE_NEXTN=0: the plain server only; GUIDE_NEXTN=only: the NEXTN server only (two calls)
case "${GUIDE_NEXTN:-1}" in 0) specs=("") ;; only) specs=("${specs[1]}") ;; esac
for spec in "${specs[@]}"; do
  label=${spec:+nextn3}; label=${label:-plain}
  echo "== serve ($label): python -m sglang.launch_server $GUIDE $spec"
  # shellcheck disable=SC2086  # GUIDE and spec are lists of flags
  if serve $PORT "$OUT/guide_server_$label.log" $GUIDE $spec; then
    curl -s localhost:$PORT/v1/completions -H 'Content-Type: application/json' \
      -d '{"model": "default", "prompt": "def add(a, b):", "max_tokens": 16, "temperature": 0}' \
      | tee "$OUT/guide_completion_$label.json" | head -c 400; echo
    timeout ${BENCH_TIMEOUT:-150} python3 -m sglang.bench_serving --backend sglang --port $PORT \
      --dataset-name random-ids --random-input-len 8192 --random-output-len 1024 \
      --random-range-ratio 1.0 --num-prompts ${PROMPTS:-4} --max-concurrency 1 --disable-tqdm \
      --output-file "$OUT/guide_served.jsonl" 2>&1 | tee "$OUT/guide_bench_$label.log" \
      | grep -E "Output token throughput|Mean TTFT|Mean TPOT|Accept length"
    grep -E "request slots|pools:|Prefill warm-up|scaled_mm" "$OUT/guide_server_$label.log" | head -6
  fi
  stop_server
done
date -u
