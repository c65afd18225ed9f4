#!/usr/bin/env bash
# GPU host: the eager baselines (weight-bandwidth floor, bench_one_batch, served bench_serving)
# on the dummy Ling-3.0-flash preset with 12 layers (real width, bf16), then the gpu-marked test
# suite. Writes logs under $OUT.
# Usage (from the project root, wheels staged in .whl by scripts/gpu_wheels.sh):
#   OUT=out bash scripts/gpu_suite.sh
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
FLASH12=(--model-path ling-3.0-flash --load-format dummy --json-model-override-args '{"num_hidden_layers": 12}')
date -u | tee -a "$OUT/gpu.txt"

echo "== weight-bandwidth floor (12 layers, 8k context)"
python3 benchmark/batch1/weight_floor.py "${FLASH12[@]:0:2}" --json-model-override-args '{"num_hidden_layers": 12}' \
  --context 8192 --measure 2>&1 | tee "$OUT/floor.log" | tail -2

echo "== bench_one_batch (eager, batch 1, 8192-token prefill, decode at 8k)"
python3 -m sglang.bench_one_batch "${FLASH12[@]}" --batch-size 1 --input-len 8192 --output-len 32 \
  --result-filename "$OUT/one_batch.jsonl" 2>&1 | tee "$OUT/one_batch.log" | grep -v Warning | tail -6

echo "== server + bench_serving (eager, random-ids 1024/256, concurrency 1)"
python3 -m sglang.launch_server "${FLASH12[@]}" --port 30000 > "$OUT/server.log" 2>&1 &
SERVER=$!
for i in $(seq 1 240); do curl -sf localhost:30000/health > /dev/null && break; kill -0 $SERVER 2> /dev/null || break; sleep 1; done
python3 -m sglang.bench_serving --backend sglang --port 30000 --dataset-name random-ids \
  --random-input-len 1024 --random-output-len 256 --random-range-ratio 1.0 --num-prompts 5 \
  --max-concurrency 1 --disable-tqdm --output-file "$OUT/serving.jsonl" 2>&1 | tee "$OUT/serving.log" | tail -40
kill -TERM $SERVER; wait $SERVER; echo "server exit $?"

echo "== gpu-marked tests"
python3 -m pytest -q -m gpu test -p no:cacheprovider -x 2>&1 | tee "$OUT/gpu_tests.log" | tail -15
