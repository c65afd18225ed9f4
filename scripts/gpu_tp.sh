#!/usr/bin/env bash
# Multi-GPU host (4 H200s run TP=4; 2 GPUs run the same at TP=2). Each stage finishes within
# 10 minutes; logs under $OUT. NVLink multicast stays off.
#   STAGE=tests  TP (4 ranks where 4 GPUs exist, else 2) == TP=1 on the GPUs, random checkpoint
#                and bundled model (test_tp_matches_tp1_on_gpus), then the batch-1 all-reduce
#                latency table (benchmark/kernels/bench_allreduce.py: engine path vs plain NCCL,
#                eager and CUDA graph)
#   STAGE=serve  Ling-3.0-flash with dummy weights at --tp-size TP (all 42 layers unless LAYERS
#                is set; about 63 GB per rank at TP=4): no spec and NEXTN 5 steps / topk 1 / 6
#                draft tokens (STEPS="0 5"), bench_serving random-ids IN_LEN / OUT_LEN (default
#                8192 / 1024) at concurrency 1 with PROMPTS prompts (default 1);
#                KERNELS=triton adds the Triton MoE and KDA decode kernels
# Usage: OUT=out STAGE=tests bash scripts/gpu_tp.sh; the serve table: benchmark/batch1/summarize.py
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
GPUS=$(nvidia-smi -L | wc -l); TP=${TP:-$GPUS}
date -u; git log --oneline -1; echo "GPUs: $GPUS, TP: $TP"

case "${STAGE:-tests}" in
tests)
  timeout 300 python3 -m pytest -v -s -m gpu test/srt/test_tp.py -p no:cacheprovider 2>&1 \
    | tee "$OUT/gpu_tp_tests.log" | grep -E "PASS|FAIL|SKIP|Error|passed|failed"
  timeout 200 python3 benchmark/kernels/bench_allreduce.py --tp "$TP" 2>&1 | tee "$OUT/allreduce.log"
  ;;
serve)
  layers=""
  [ -n "${LAYERS:-}" ] && layers="--json-model-override-args '{\"num_hidden_layers\": $LAYERS}'"
  kernels=""
  [ "${KERNELS:-}" = triton ] && kernels="--moe-runner-backend triton --linear-attn-decode-backend triton"
  STEPS="${STEPS:-0 5}" timeout ${SERVE_TIMEOUT:-560} bash benchmark/batch1/spec_ab.sh "flash-tp$TP" \
    "--model-path ling-3.0-flash --load-format dummy --tp-size $TP $layers $kernels" \
    "${PROMPTS:-1}" "${IN_LEN:-8192}" "${OUT_LEN:-1024}"
  pkill -f sglang.launch_server  # a server the stage's timeout left behind (ranks included)
  python3 benchmark/batch1/summarize.py "$OUT/spec_ab.jsonl"
  ;;
esac
# Pack the per-run logs into one archive.
cd "$OUT" && tar czf logs.tgz server-*.log bench-* 2>/dev/null && rm -f server-*.log bench-*
