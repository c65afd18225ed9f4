#!/usr/bin/env bash
# GPU host, one stage per run (each finishes within 10 minutes on one H200); logs and JSONL
# under $OUT.
#   STAGE=tests   the gpu-marked tests (NEXTN bf16/fp32 losslessness first, then bf16 parity,
#                 fla, CUDA sizing), then the NEXTN ladder (no spec vs 3/4/5 steps) on the
#                 bundled model
#   STAGE=flash12 the NEXTN ladder on the 12-layer dummy Ling-3.0-flash
#   STAGE=bundled the NEXTN ladder on the bundled model alone (STEPS="4 5" picks rows)
#   STAGE=kernels the Triton kernels (--moe-runner-backend triton, --linear-attn-decode-backend
#                 triton): kernel tests and NEXTN bf16 losslessness with them, the cold-L2 MoE
#                 microbenchmark, then no spec / NEXTN 3 on the 12-layer dummy preset, torch_native
#                 vs triton (MICRO=0 skips the microbenchmark; KSTEPS="3" picks ladder rows)
#   STAGE=census  per-phase census (ops, launches, kernel time; profiled vs unprofiled) of a plain
#                 decode step and a NEXTN-3 round on the 12-layer dummy preset, torch_native and
#                 Triton kernels (benchmark/batch1/round_census.py)
#   STAGE=tune    cold-L2 sweep of the grouped GEMV's launch configs on Flash's MoE shapes
#                 (benchmark/kernels/tune_grouped_gemv.py), then the MoE microbenchmark
#   STAGE=prefill torch-native MoE prefill: the loop over experts vs torch._grouped_mm
#                 (--kernel-choices moe_grouped_mm=1) — its gpu test, then eager bench_one_batch
#                 (8192-token prefill, 12-layer dummy preset, --moe-runner-backend torch_native)
#                 with each
#   STAGE=fusions the norm and router kernels (kernel choices rmsnorm, router): their kernel
#                 tests on CUDA, then eager bench_one_batch (1024-token prompt, 32 decode steps,
#                 12-layer dummy preset) with neither, each, and both
#   STAGE=trace   a served decode on the 12-layer dummy preset (no spec, or ARGS="..." added
#                 to the server): bench_serving without, then with --profile (profiled vs
#                 unprofiled TPOT), the torch trace of the profiled run in $OUT/trace
#   ONE_BATCH=1   also eager bench_one_batch on the 12-layer dummy preset first
# The ladder's summary table: python3 benchmark/batch1/summarize.py $OUT/spec_ab.jsonl
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
FLASH12="--model-path ling-3.0-flash --load-format dummy --json-model-override-args '{\"num_hidden_layers\": 12}'"
date -u; git log --oneline -1

if [ "${ONE_BATCH:-0}" = 1 ]; then
  echo "== bench_one_batch (eager, batch 1, 8192-token prefill, decode at 8k)"
  eval "timeout 200 python3 -m sglang.bench_one_batch $FLASH12 --batch-size 1 --input-len 8192 --output-len 32 --result-filename $OUT/one_batch.jsonl" 2>&1 | grep -v Warn | tail -5
fi

case "${STAGE:-tests}" in
tests)
  echo "== NEXTN on CUDA (gpu-marked)"
  timeout 240 python3 -m pytest -v -s -m gpu test/srt/test_nextn.py -k "not triton" -p no:cacheprovider --durations=4 2>&1 \
    | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|first differing|Error|passed|failed"
  echo "== other gpu-marked tests (not slow)"
  timeout 150 python3 -m pytest -v -s -m "gpu and not slow" test --ignore=test/srt/test_nextn.py -p no:cacheprovider --durations=6 2>&1 \
    | tee -a "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|rel. error|fla vs|Error|passed|failed"
  echo "== NEXTN ladder, bundled model"
  timeout 190 bash benchmark/batch1/spec_ab.sh bundled "" 3 1024 256
  ;;
bundled)
  echo "== NEXTN ladder, bundled model (steps: ${STEPS:-0 3 4 5})"
  timeout ${LADDER_TIMEOUT:-300} bash benchmark/batch1/spec_ab.sh bundled "" 3 1024 256
  ;;
census)
  for args in "" "--speculative-algorithm NEXTN --speculative-num-steps 3" \
              "--speculative-algorithm NEXTN --speculative-num-steps 3 --moe-runner-backend triton --linear-attn-decode-backend triton"; do
    echo "== census: $args"
    eval "timeout 150 python3 benchmark/batch1/round_census.py $FLASH12 $args --prompt-len 1024 --steps 20" 2>&1 \
      | grep -v Warn | tee -a "$OUT/census.log" | tail -12
  done
  ;;
tune)
  timeout 300 python3 benchmark/kernels/tune_grouped_gemv.py 2>&1 | tee "$OUT/tune_grouped_gemv.log"
  timeout 120 python3 benchmark/kernels/bench_moe_small_m.py 2>&1 | tee "$OUT/bench_moe_small_m.log"
  ;;
prefill)
  timeout 120 python3 -m pytest -v -s -m gpu test/srt/test_moe.py -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|Error|passed|failed"
  for flag in 0 1; do
    echo "== bench_one_batch, torch-native MoE, moe_grouped_mm=$flag"
    eval "timeout 200 python3 -m sglang.bench_one_batch $FLASH12 --moe-runner-backend torch_native --kernel-choices moe_grouped_mm=$flag --batch-size 1 --input-len 8192 --output-len 16 --result-filename $OUT/one_batch.jsonl" 2>&1 | grep -v Warn | tail -4
  done
  ;;
fusions)
  timeout 150 python3 -m pytest -v -s test/kernels/test_rmsnorm.py test/kernels/test_moe_router.py \
    -p no:cacheprovider 2>&1 | grep -E "PASS|FAIL|Error|passed|failed"
  for flags in "0 0" "1 0" "0 1" "1 1"; do
    set -- $flags
    echo "== bench_one_batch, rmsnorm=$1 router=$2"
    eval "timeout 120 python3 -m sglang.bench_one_batch $FLASH12 --kernel-choices rmsnorm=$1,router=$2 --batch-size 1 --input-len 1024 --output-len 32" 2>&1 | grep -v Warn | tail -3
  done
  ;;
trace)
  eval "exec python3 -m sglang.launch_server $FLASH12 ${ARGS:-} --port 30500" > "$OUT/server-trace.log" 2>&1 &
  for i in $(seq 1 300); do curl -sf localhost:30500/health > /dev/null && break; sleep 1; done
  for prof in "" --profile; do
    echo "== bench_serving ${prof:-(unprofiled)}"
    SGLANG_TORCH_PROFILER_DIR=$OUT/trace timeout 200 python3 -m sglang.bench_serving --backend sglang \
      --port 30500 --dataset-name random-ids --random-input-len 1024 --random-output-len 64 \
      --random-range-ratio 1.0 --num-prompts 2 --max-concurrency 1 --disable-tqdm $prof 2>&1 \
      | grep -E "Mean TPOT|Median TPOT|Mean TTFT|Trace|rofil"
  done
  ls -la "$OUT/trace"
  ;;
flash12)
  echo "== NEXTN ladder, dummy 12-layer Ling-3.0-flash"
  PORT_BASE=30200 timeout ${LADDER_TIMEOUT:-480} bash benchmark/batch1/spec_ab.sh flash12 "$FLASH12" 3 1024 256
  ;;
kernels)
  echo "== Triton kernels: tests on CUDA, NEXTN bf16 losslessness with them, MoE microbenchmark"
  timeout 150 python3 -m pytest -v -s test/kernels "test/srt/test_nextn.py::test_greedy_lossless_on_cuda[bfloat16-triton]" \
    -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | grep -E "PASS|FAIL|first differing|Error|passed|failed"
  [ "${MICRO:-1}" = 1 ] && timeout 120 python3 benchmark/kernels/bench_moe_small_m.py 2>&1 | tee "$OUT/bench_moe_small_m.log"
  echo "== 12-layer dummy Ling-3.0-flash: torch_native vs triton kernels (steps: ${KSTEPS:-0 3})"
  for kern in torch_native triton; do
    STEPS="${KSTEPS:-0 3}" PORT_BASE=$([ $kern = triton ] && echo 30400 || echo 30300) timeout 200 \
      bash benchmark/batch1/spec_ab.sh "flash12-$kern" \
      "$FLASH12 --moe-runner-backend $kern --linear-attn-decode-backend $kern" 3 1024 256
  done
  ;;
esac
pkill -f sglang.launch_server
python3 benchmark/batch1/summarize.py "$OUT/spec_ab.jsonl"
# Pack the per-run logs into one archive.
cd "$OUT" && tar czf logs.tgz server-*.log bench-* 2>/dev/null && rm -f server-*.log bench-*
