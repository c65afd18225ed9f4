#!/usr/bin/env bash
# Prefill and batched serving on one H200; one stage per run (each within 10 minutes), logs and
# JSONL under $OUT.
#   STAGE=kernels   the CUDA tests of the prefill kernels (MoE grouped GEMM, dense block-fp8 GEMM,
#                   MLA prefill attention), the MoE grouped GEMM tile sweep (SWEEP_DTYPES, default
#                   bf16 + fp8; w8a8: fp8 activations too), written to
#                   $OUT/moe_grouped_gemm.json for sgl-kernel/python/sgl_kernel/configs/;
#                   SWEEP_TOKENS, and SWEEP_ARGS: more flags of the sweep, which replace the
#                   grid's, e.g. "--block-m 64 128 --block-n 128 256"), the
#                   KDA prefill conv's tile sweep (CONVSWEEP=0 skips it; SWEEP=0 the MoE's) and
#                   the dense fp8 GEMM benchmark (FP8BENCH=0 skips it; FP8BENCH_ARGS: its flags,
#                   e.g. "--no-sweep")
#   STAGE=cold      benchmark/kernels/bench_cold_l2_kernels.py on COLD_KERNELS (default the
#                   RMSNorm and the KDA prefill conv) at 1024 / 8192 rows, then the conv's sweep
#   STAGE=prefill12 bench_one_batch prefill of 1024 and 8192 tokens on the 12-layer dummy
#                   Ling-3.0-flash in bf16, defaults vs the torch MoE (the per-expert loop), and
#                   the prefill census of both at 1024 / 8192 tokens ($OUT/prefill_census.jsonl)
#   STAGE=peer      transformers' bailing_hybrid (wheel in .whl_peer) on the 12-layer shape:
#                   prefill of 1024 / 8192 tokens and decode steps, $OUT/hf_peer.jsonl
#   STAGE=prefill42 the same on the whole 42-layer Ling-3.0-flash in block fp8 (LAYERS=N: its first N)
#   STAGE=served    the seed's workload (random-ids 8192 in / 1024 out, concurrency 1, PROMPTS
#                   prompts, default 4) against the fp8 42-layer server without speculation and
#                   with NEXTN (SPECS, default "0 3"); one JSON line per run in $OUT/served.jsonl;
#                   SERVED_ARGS adds server flags (SERVED_ARGS="--prefill-cuda-graph-tokens 8192");
#                   SERVED_LENS="1024:128:6 8192:1024:2" (input:output:prompts, one benchmark
#                   each per server) replaces the seed's workload;
#                   SERVED_VARIANTS, comma-separated flag lists, runs one server per list in turn
#                   (SERVED_VARIANTS=",--mem-fraction-static 0.85": defaults, then that flag);
#                   a list's leading VAR=value words are that server's environment, e.g.
#                   SERVE_MAIN=benchmark/batch1/served_variant.py PREFILL_CAPTURE_VARIANT=warmup
#   STAGE=conc      12-layer bf16 server (default flags; CONC_ARGS adds server flags), random-ids
#                   1024 / 128 at concurrency CONCS (default "1 4 16 64"); $OUT/conc.jsonl
#   STAGE=served_trace two fp8 servers (LAYERS applies), without and with TRACE_ARGS (default
#                   --prefill-cuda-graph-tokens 1024): the unprofiled TPOT of 8192-token prompts,
#                   then one request torch-profiled, both traces summarised per decode step by
#                   benchmark/batch1/server_trace.py (graph launch cadence, blocking calls)
#   STAGE=gap_probe benchmark/batch1/graph_gap_probe.py: a chain graph's µs per node before and
#                   after each start-up event (second graph, copies, cuBLAS, empty_cache, fla),
#                   no model; $OUT/gap_probe.jsonl (about a minute; give the stage 90 s)
#   STAGE=gap_events the probe's single events (GAP_EVENTS, default all), one fresh process each,
#                   with their graphs' DOT files and node kinds (under 10 s each)
#   STAGE=graph_nodes benchmark/batch1/graph_node_kinds.py: the node kinds of every graph an fp8
#                   server captures (LAYERS applies; NODES_ARGS, default --prefill-cuda-graph-tokens
#                   1024), DOT files in $OUT/dots_engine, $OUT/graph_nodes.jsonl
#   STAGE=prefill_gates  the gpu-marked tests of the prefill path's kernels and glue (KDA fla
#                   prefill, MLA RoPE assembly, norms, grouped MoE GEMM, dense fp8 GEMM and its
#                   scaled_mm form, activation quantisation, prefill CUDA graphs, the gated
#                   activations), with skip reasons (-rs). CENSUS_ARGS=--prefill-graphs on
#                   prefill12 / prefill42 times captured prefills beside the eager census in
#                   the same process
#   STAGE=gates     the gpu-marked graph gates (test/srt/test_cuda_graph_runner.py; GATES: other
#                   files and pytest options, GATES_LOG: the log's name, GATES_TIMEOUT: seconds)
#   STAGE=interference a decoding request's ITL while an 8192-token prompt is prefilled
#                   (benchmark/batch1/prefill_interference.py), 12-layer bf16 server per
#                   --chunked-prefill-size in CHUNKS (default "8192 2048"); $OUT/interference.jsonl
#   STAGE=probe     benchmark/batch1/invariance_probe.py (bundled model, bf16, deterministic
#                   flag) for NEXTN-3 and DSPARK (PROBE_ALGS, default "nextn3 dspark") on
#                   PROBE_PROMPTS (default "7 0 1 2"): the first module whose verify row
#                   differs from the decode of the same token
#   STAGE=determinism  the bit-exact bf16 speculation gate (test/srt/test_deterministic_spec.py:
#                   NEXTN-3 and DSPARK == plain with --enable-deterministic-inference), then the
#                   flag's cost: bench_one_batch decode (64 steps after 1024 tokens) of the
#                   12-layer bf16 model without and with it, in one call (DET_GATE=0: cost only)
# Wheels: `bash scripts/gpu_wheels.sh` stages what the host lacks (opentelemetry-api included,
# which fastapi imports at start-up: a server from wheels without it exits at once).
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
FLASH12="--model-path ling-3.0-flash --load-format dummy --json-model-override-args {\"num_hidden_layers\":12}"
FLASH42="--model-path ling-3.0-flash --load-format dummy --quantization fp8 --mem-fraction-static 0.93 --context-length 9216"
# LAYERS=N: the fp8 stages on the first N layers (an H100's 80 GB holds about 20 of the 42)
[ -n "${LAYERS:-}" ] && FLASH42="$FLASH42 --json-model-override-args {\"num_hidden_layers\":$LAYERS}"
date -u; git log --oneline -1

# bench_one_batch prefill lines of one process: "<label> <input_len> <prefill ms>".
one_batch() {
  local label=$1; shift
  timeout ${OB_TIMEOUT:-200} python3 -m sglang.bench_one_batch "$@" --batch-size 1 \
    --input-len ${LENS:-1024 8192} --output-len ${OUTLEN:-4} --result-filename "$OUT/one_batch.jsonl" \
    --run-name "$label" > "$OUT/one_batch_$label.log" 2>&1
  grep -E "input_len|Prefill|Decode" "$OUT/one_batch_$label.log" | sed "s/^/$label: /"
}

# census LABEL ARGS...: one process (one model load) censuses every length in CENSUS_LENS;
# CENSUS_ARGS adds flags (an A/B: CENSUS_ARGS=--kernel-choices=moe_align_kernel=1), and then
# goes into the label. CENSUS_ARGS=--sync-sites: one more prefill per length under torch's sync
# debug mode, its table "| syncs | site | via |" (every host<->device sync of the prefill at
# its call site; each one drains the GPU queue) in the log and the output, "sync_sites" and
# "syncs" in the JSON line. CENSUS_ARGS=--host-profile=30: one more prefill timed without
# synchronising and one under cProfile, the host's 30 costliest functions ("host:" line and
# tables; "host_*" in the JSON line).
census() {
  local label=$1${CENSUS_ARGS:+ ${CENSUS_ARGS##*--kernel-choices[= ]}}; shift
  [ -n "${CENSUS_LENS-1024 8192}" ] || return 0
  # shellcheck disable=SC2086  # CENSUS_ARGS is a list of words
  timeout ${CENSUS_TIMEOUT:-200} python3 benchmark/batch1/prefill_census.py "$@" ${CENSUS_ARGS:-} \
    --prompt-len ${CENSUS_LENS:-1024 8192} --label "$label" \
    --result-filename "$OUT/prefill_census.jsonl" > "$OUT/census_${label// /_}.log" 2>&1
  grep -E "^\||^prefill of|^host" "$OUT/census_${label// /_}.log" | sed "s/^/$label: /"
}

# The KDA prefill conv's tile sweep (CONV_ARGS: its flags, e.g. a narrower grid).
conv_sweep() {
  # shellcheck disable=SC2086  # CONV_ARGS is a list of words
  timeout ${CONV_TIMEOUT:-150} python3 benchmark/kernels/tune_kda_prefill_conv.py ${CONV_ARGS:-} \
    > "$OUT/kda_prefill_conv_sweep.log" 2>&1; grep "^|" "$OUT/kda_prefill_conv_sweep.log" | tail -8
}

case "${STAGE:-kernels}" in
kernels)
  # KTESTS: the CUDA tests to run first (KTESTS=0: none, straight to the sweeps).
  [ "${KTESTS:-}" != 0 ] && timeout 240 python3 -m pytest -q -m gpu \
    ${KTESTS:-test/kernels/test_moe_grouped_gemm.py test/kernels/test_fp8_gemm.py \
    test/srt/test_mla_prefill.py} 2>&1 | tee "$OUT/kernel_tests.log" | tail -4
  # SWEEP=0 skips the MoE tile sweep only (CONVSWEEP=0 / FP8BENCH=0 skip the others).
  # The packaged table is the output: $OUT gets a copy. A reduced grid (the compiles dominate).
  [ "${SWEEP:-1}" = 1 ] && for dt in ${SWEEP_DTYPES:-bf16 fp8}; do
    bk="64 128"; [ $dt != bf16 ] && bk=128  # fp8 weights: a K step inside a scale block
    timeout ${SWEEP_TIMEOUT:-200} python3 benchmark/kernels/tune_moe_grouped_gemm.py --dtype $dt \
      --proj up down --tokens ${SWEEP_TOKENS:-128 1024 4096 8192} --block-m 32 64 128 \
      --block-n 128 --block-k $bk --group-m 8 --num-warps 4 8 --num-stages 3 4 ${SWEEP_ARGS:-} \
      > "$OUT/moe_sweep_$dt.log" 2>&1; grep "^|" "$OUT/moe_sweep_$dt.log" | tail -20
  done
  [ "${SWEEP:-1}" = 1 ] && cp sgl-kernel/python/sgl_kernel/configs/moe_grouped_gemm.json "$OUT/"
  [ "${CONVSWEEP:-1}" = 1 ] && conv_sweep
  [ "${FP8BENCH:-1}" = 1 ] && { timeout 120 python3 benchmark/kernels/bench_fp8_gemm.py ${FP8BENCH_ARGS:-} \
    > "$OUT/fp8_gemm.log" 2>&1; grep -E "^\||^library" "$OUT/fp8_gemm.log" | tail -25; }
  ;;
cold)  # cold-L2 rows of the prefill's small kernels against their references, then the conv sweep
  # shellcheck disable=SC2086  # COLD_KERNELS / COLD_ARGS are lists of words
  timeout ${COLD_TIMEOUT:-90} python3 benchmark/kernels/bench_cold_l2_kernels.py \
    --kernels ${COLD_KERNELS:-rmsnorm kda_prefill_conv} --prefill-rows 1024 8192 \
    --out "$OUT/cold_l2.jsonl" ${COLD_ARGS:-} > "$OUT/cold_l2.log" 2>&1
  grep "^|" "$OUT/cold_l2.log"
  [ "${CONVSWEEP:-1}" = 1 ] && conv_sweep
  ;;
prefill12)  # ONE_BATCH=0: the census alone (its unprofiled wall time is the prefill time)
  [ "${ONE_BATCH:-1}" = 1 ] && one_batch flash12-new $FLASH12
  [ -n "${OLD_LENS-1024}" ] && LENS=${OLD_LENS:-1024} one_batch flash12-torchmoe $FLASH12 \
    --moe-runner-backend torch_native
  census flash12-new $FLASH12 --disable-cuda-graph
  ;;
peer)  # transformers' bailing_hybrid on the 12-layer shape (its wheel staged in .whl_peer)
  python3 -m pip install -q --no-index --no-deps --target /tmp/peer .whl_peer/*.whl 2>&1 | tail -1
  PYTHONPATH=/tmp/peer:$PYTHONPATH timeout ${PEER_TIMEOUT:-200} python3 benchmark/batch1/hf_peer.py \
    --json-model-override-args '{"num_hidden_layers": 12}' --prompt-len ${LENS:-1024 8192} \
    --decode-steps 32 --result-filename "$OUT/hf_peer.jsonl" > "$OUT/hf_peer.log" 2>&1
  grep -E "^\||transformers|kda|fla" "$OUT/hf_peer.log" | head -20
  ;;
prefill42)
  [ "${ONE_BATCH:-1}" = 1 ] && one_batch flash42fp8-new $FLASH42 --max-running-requests 2
  census flash42fp8-new $FLASH42 --max-running-requests 2 --disable-cuda-graph
  ;;
served)
  IFS=, read -ra variants <<< "${SERVED_VARIANTS:-${SERVED_ARGS:-}}"
  [ ${#variants[@]} = 0 ] && variants=("")
  v=0
  for variant in "${variants[@]}"; do
  v=$((v + 1)); tag=$([ ${#variants[@]} -gt 1 ] && echo "_v$v")  # one log per server
  envs=(); flags=()  # leading VAR=value words: the server's environment
  for word in $variant; do
    if [ ${#flags[@]} = 0 ] && [[ $word =~ ^[A-Z_][A-Z0-9_]*= ]]; then envs+=("$word")
    else flags+=("$word"); fi
  done
  for steps in ${SPECS:-0 3}; do
    spec=""; [ "$steps" != 0 ] && spec="--speculative-algorithm NEXTN --speculative-num-steps $steps"
    echo "== fp8 42 layers, spec=$steps${variant:+, $variant}"
    # shellcheck disable=SC2086  # flag lists
    serve_with "${envs[@]}" -- 30710 "$OUT/server_fp8_$steps$tag.log" $FLASH42 \
      --cuda-graph-max-bs 4 $spec "${flags[@]}" || continue
    for lens in ${SERVED_LENS:-8192:1024:${PROMPTS:-4}}; do
      IFS=: read -r in_len out_len prompts <<< "$lens"
      timeout ${BENCH_TIMEOUT:-200} python3 -m sglang.bench_serving --backend sglang \
        --port 30710 --dataset-name random-ids --random-input-len "$in_len" \
        --random-output-len "$out_len" --random-range-ratio 1.0 --num-prompts "$prompts" \
        --max-concurrency 1 --disable-tqdm --output-details --output-file "$OUT/served.jsonl" \
        2>&1 | tee "$OUT/bench_fp8_$steps${tag}_$in_len.log" \
        | grep -E "Output token throughput|Mean TTFT|Mean TPOT|Accept"
    done
    grep -E "request slots|pools:|Prefill warm-up|Prefill CUDA graphs|CUDA graphs captured" \
      "$OUT/server_fp8_$steps$tag.log" | head -6
    stop_server
  done
  done
  ;;
gap_probe)
  timeout 80 python3 benchmark/batch1/graph_gap_probe.py --result-filename "$OUT/gap_probe.jsonl"
  ;;
gap_events)  # one event per process, its graphs dumped
  for ev in ${GAP_EVENTS:-zero_eager zero_captured zero_graph small_zero_graph \
      zero_graph_side_stream fill1_graph triton_zero_graph copy_graph}; do
    timeout 40 python3 benchmark/batch1/graph_gap_probe.py --event "$ev" --dump-dir "$OUT/dots_$ev" \
      --result-filename "$OUT/gap_probe.jsonl"
  done
  ;;
graph_nodes)  # node kinds of an fp8 server's graphs (LAYERS applies), NODES_ARGS: more flags
  # shellcheck disable=SC2086  # flag lists
  timeout ${NODES_TIMEOUT:-150} python3 benchmark/batch1/graph_node_kinds.py $FLASH42 \
    --cuda-graph-max-bs 4 ${NODES_ARGS:---prefill-cuda-graph-tokens 1024} \
    --dump-dir "$OUT/dots_engine" --result-filename "$OUT/graph_nodes.jsonl" \
    > "$OUT/graph_nodes.log" 2>&1
  grep -E "^graph|^    " "$OUT/graph_nodes.log" | head -60; tail -3 "$OUT/graph_nodes.log"
  ;;
served_trace)  # the decode loop of two servers, without and with TRACE_ARGS, torch-profiled
  n=0
  for args in "" "${TRACE_ARGS:---prefill-cuda-graph-tokens 1024}"; do
    n=$((n + 1)); export SGLANG_TORCH_PROFILER_DIR="$OUT/trace$n"; mkdir -p "$SGLANG_TORCH_PROFILER_DIR"
    echo "== server $n: ${args:-defaults}"
    # shellcheck disable=SC2086  # args is a list of words
    serve 30713 "$OUT/server_trace$n.log" $FLASH42 --cuda-graph-max-bs 4 $args || continue
    for prof in "" --profile; do  # unprofiled first (also the warm-up), then one profiled request
      timeout 150 python3 -m sglang.bench_serving --backend sglang --port 30713 \
        --dataset-name random-ids --random-input-len 8192 --random-output-len ${TRACE_LEN:-64} \
        --random-range-ratio 1.0 --num-prompts $([ -z "$prof" ] && echo 2 || echo 1) \
        --max-concurrency 1 --disable-tqdm $prof 2>&1 | grep -E "Mean TPOT|Median TPOT|Mean TTFT"
    done
    stop_server
  done
  python3 benchmark/batch1/server_trace.py "$OUT"/trace1/*.json.gz "$OUT"/trace2/*.json.gz \
    --labels defaults "${TRACE_ARGS:---prefill-cuda-graph-tokens 1024}" \
    --result-filename "$OUT/server_trace.jsonl"
  ;;
conc)
  echo "== 12-layer bf16"
  # shellcheck disable=SC2086  # CONC_ARGS is a list of words
  serve 30711 "$OUT/server_conc.log" $FLASH12 ${CONC_ARGS:-} || exit 1
  grep -E "request slots|pools:" "$OUT/server_conc.log" | head -2
  for c in ${CONCS:-1 4 16 64}; do
    n=$(( c * 4 < 16 ? 16 : c * 4 ))
    echo "-- concurrency $c ($n prompts)"
    timeout 150 python3 -m sglang.bench_serving --backend sglang --port 30711 \
      --dataset-name random-ids --random-input-len 1024 --random-output-len 128 \
      --random-range-ratio 1.0 --num-prompts $n --max-concurrency $c --disable-tqdm \
      --output-file "$OUT/conc.jsonl" 2>&1 | tee "$OUT/bench_conc_$c.log" \
      | grep -E "Output token throughput|Mean TTFT|Mean TPOT"
  done
  stop_server
  ;;
prefill_gates)
  timeout ${GATES_TIMEOUT:-300} python3 -m pytest -q -m gpu -rfEs test/srt/test_attention_kda.py \
    test/kernels/test_mla_rope.py test/kernels/test_rmsnorm.py test/kernels/test_fp8_scaled_mm.py \
    test/kernels/test_moe_grouped_gemm.py test/kernels/test_fp8_gemm.py \
    test/kernels/test_fp8_act_quant.py test/srt/test_prefill_graphs.py \
    test/kernels/test_kernels_cuda.py::test_gated_act 2>&1 \
    | tee "$OUT/prefill_gates.log" \
    | grep -E "^(FAILED|ERROR|SKIPPED)|passed|failed"
  ;;
gates)
  timeout ${GATES_TIMEOUT:-540} python3 -m pytest -q -m gpu -rfE \
    ${GATES:-test/srt/test_cuda_graph_runner.py} 2>&1 | tee "$OUT/${GATES_LOG:-gates}.log" \
    | grep -E "^(FAILED|ERROR)|passed|failed|[0-9.]+s (call|setup)"
  ;;
interference)
  for c in ${CHUNKS:-8192 2048}; do
    echo "== 12-layer bf16, --chunked-prefill-size $c"
    serve 30712 "$OUT/server_interference_$c.log" $FLASH12 --chunked-prefill-size $c || continue
    timeout 200 python3 benchmark/batch1/prefill_interference.py --port 30712 \
      --prefill-len 8192 --decode-output-len 512 --label "chunk$c" \
      --output-file "$OUT/interference.jsonl" 2>&1 | tee "$OUT/interference_$c.log" | grep -E ":"
    stop_server
  done
  ;;
determinism)  # DET_GATE=0: the cost only (the gate ran with the other gpu tests)
  [ "${DET_GATE:-1}" = 1 ] && timeout ${GATE_TIMEOUT:-300} python3 -m pytest -q -s -m gpu test/srt/test_deterministic_spec.py \
    2>&1 | tee "$OUT/determinism.log" | grep -E "first differing|passed|failed"
  # Batch 1 is what is measured: one graph, not the default capture ladder.
  LENS=1024 OUTLEN=64 one_batch flash12-plain $FLASH12 --cuda-graph-max-bs 1
  LENS=1024 OUTLEN=64 one_batch flash12-deterministic $FLASH12 --cuda-graph-max-bs 1 \
    --enable-deterministic-inference
  ;;
probe)  # which target module rounds a verify row apart from the decode of the same token
  for i in ${PROBE_PROMPTS:-7 0 1 2}; do
    for alg in ${PROBE_ALGS:-nextn3 dspark}; do
      spec="--speculative-algorithm DSPARK"
      [ $alg = nextn3 ] && spec="--speculative-algorithm NEXTN --speculative-num-steps 3"
      # shellcheck disable=SC2086  # spec is a list of flags
      timeout ${PROBE_TIMEOUT:-120} python3 benchmark/batch1/invariance_probe.py --device cuda \
        --dtype bfloat16 --enable-deterministic-inference $spec --max-total-tokens 32768 \
        --max-running-requests 4 --prompt-index $i --gen ${PROBE_GEN:-256} \
        --result-filename "$OUT/invariance_probe.jsonl" > "$OUT/probe_${alg}_$i.log" 2>&1
      echo "prompt $i $alg: $(grep -E "^(first difference|batch-invariant)" \
        "$OUT/probe_${alg}_$i.log" | head -1)"
    done
  done
  ;;
*) echo "unknown STAGE=${STAGE}"; exit 2 ;;
esac
date -u
