#!/usr/bin/env bash
# GPU host, one call: (with ONE_BATCH=1) eager bench_one_batch on the 12-layer dummy Ling-3.0-flash, the gpu-marked
# tests (bf16 parity, fla, NEXTN losslessness), then the NEXTN A/B ladders (no spec vs 3/4/5 steps)
# on the bundled model and on the 12-layer dummy preset. Logs and JSONL under $OUT.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python PYTHONUNBUFFERED=1
FLASH12="--model-path ling-3.0-flash --load-format dummy --json-model-override-args '{\"num_hidden_layers\": 12}'"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader; date -u

if [ "${ONE_BATCH:-0}" = 1 ]; then
echo "== bench_one_batch (eager, batch 1, 8192-token prefill, decode at 8k)"
eval "timeout 200 python3 -m sglang.bench_one_batch $FLASH12 --batch-size 1 --input-len 8192 --output-len 32 --result-filename $OUT/one_batch.jsonl" 2>&1 | grep -v Warn | tail -5
fi

echo "== gpu-marked tests (not slow)"
timeout 200 python3 -m pytest -q -rfE -m "gpu and not slow" test -p no:cacheprovider --durations=8 2>&1 | tee "$OUT/gpu_tests.log" | tail -6

echo "== NEXTN ladder, bundled model"
timeout 130 bash benchmark/batch1/spec_ab.sh bundled "" 3 1024 256
pkill -f sglang.launch_server; sleep 2  # nothing may outlive a timed-out ladder
echo "== NEXTN ladder, dummy 12-layer Ling-3.0-flash"
PORT_BASE=30200 timeout 190 bash benchmark/batch1/spec_ab.sh flash12 "$FLASH12" 3 1024 256
python3 benchmark/batch1/summarize.py "$OUT/spec_ab.jsonl"
