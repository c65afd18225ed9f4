#!/usr/bin/env bash
# CUDA graphs and host run-ahead on one H200; one stage per run (each within 10 minutes), logs and
# JSONL under $OUT.
#   STAGE=gates   the gpu-marked gates: graph == eager greedy (plain, NEXTN 1/3/5; batch 1 and 4;
#                 state pollution; seeded sampling) with both kernel sets, every graph refill
#                 mode, the Triton MLA and round-prep kernels (GATES: other test files)
#   STAGE=ab      benchmark/batch1/graph_ab.py: eager vs graphs x overlap on/off in one process,
#                 back-to-back replay time and the GPU idle share of the graphed loop, on the
#                 12-layer dummy Ling-3.0-flash (no spec, NEXTN 3/4/5) and the bundled model;
#                 then the weight floor and the Triton MLA microbenchmark
#   STAGE=served  bench_serving random-ids 1024/256 at concurrency 1 against a server with graphs
#                 (default) and with --disable-cuda-graph, 12-layer dummy Flash and bundled model
#                 (CONFIGS: "model:graphs:steps[:overlap]"; servers capture batch sizes 1, 2, 4:
#                 --cuda-graph-max-bs 4, the batch-1 setting, keeps each start short); one JSON
#                 line per run in $OUT/served.jsonl
#   STAGE=dspark  the fused norm / router kernel tests on CUDA, then the gpu-marked DSpark gate
#                 (graphs == plain greedy, seeded, pollution, no host sync in replayed rounds)
#   STAGE=dspark-train  train a DSpark draft for the bundled model on the GPU
#                 (python -m sglang.train.dspark, TRAIN_BUDGET seconds of training, default 200;
#                 PROMPTS per sampling setting, default 512) into $OUT/dspark, then NEXTN-3 vs
#                 DSPARK served with that draft, in the same call
#   STAGE=kernels the kernel tests on CUDA, the cold-L2 sweeps of the grouped GEMV and the small-M
#                 GEMM (bf16, then block-fp8 unless FP8=0), the KDA recurrence's value tile, and
#                 the bf16 NEXTN batch-1 parity print (test_nextn's gpu test; it needs more than
#                 120 s)
#   STAGE=fusion  the decode fusions (kernel choices moe_combine and small_m_gemm, and
#                 SGLANG_ENABLE_PDL) off vs on, same call: the graph gates with PDL on, then per
#                 setting the category census (decode and NEXTN-3; $OUT/census.jsonl and
#                 census.png) and graph_ab (no spec, NEXTN 3) on the 12-layer dummy Flash;
#                 about 5 minutes per setting: FUSION_SETTINGS / FUSION_GATES split it over calls
#   STAGE=fp8full the whole 42-layer Ling-3.0-flash (plus MTP) in block fp8 on this one GPU, graphs
#                 on, batch 1, context CONTEXT (default 8192): graph_ab per SPECS (default "0 5 3":
#                 decode step, NEXTN-5 / NEXTN-3 rounds, memory) into $OUT/fp8full.jsonl, the fp8
#                 weight floors (1, 4 and 6 tokens), then one NEXTN-5 server at concurrency 1
#                 (SERVED=0 skips it, FLOORS=0 the floors); first the fp8 tile sweeps (SWEEP=0
#                 skips them), after graph_ab the top kernels of an eager decode step
#                 (benchmark/batch1/top_kernels.py; TOP=0 skips them).
#                 About 9 minutes in all: SPECS / SERVED split it over calls.
#   STAGE=fp8ab   the fp8 42-layer model's graph_ab per setting, one process each, same call:
#                 FP8AB_SETTINGS "PDL CHOICES label,..." (PDL: SGLANG_ENABLE_PDL 0/1; CHOICES:
#                 graph_ab's --kernel-choices with its fields joined by +, e.g.
#                 mla_absorb_gemv=1+gated_act=0, - for none; more graph_ab flags of
#                 that process after the label; default: the defaults, PDL on with /
#                 without the weight prefetch, the torch MLA RoPE, KDA's output norm inside
#                 o_proj), FP8AB_SPECS (default "0"), FP8AB_STEPS (iterations per row, 16),
#                 FP8AB_ARGS (more graph_ab flags, e.g. "--prefill-graph-ab 1024": decode before
#                 and after a prefill graph capture), LAYERS (the first N layers only: an
#                 H100 holds about 20); lines with the setting's label in $OUT/fp8ab.jsonl
#                 (about a minute per process)
#   STAGE=dspark_flash  DSpark at Flash width: the whole 42-layer Ling-3.0-flash in block fp8 with
#                 the dummy draft preset ling-3.0-flash-dspark (5 layers of hidden 2560, the
#                 published draft's shape), batch 1, context CONTEXT (default 8192), same call:
#                 graph_ab (graphs on) of the DSPARK round at each block of BLOCKS (default
#                 "7 15": verify windows 8 and 16) and of the NEXTN round with NEXTN steps
#                 (default 5; 0 skips it) into $OUT/dspark_flash.jsonl; then (CENSUS=0 skips)
#                 the eager per-phase round census of the same rounds into
#                 $OUT/dspark_flash_phases.jsonl (DSPARK: draft layers, draft LM head, Markov
#                 slot loop, confidence head, planner, verify forward, KDA verify, acceptance,
#                 KDA commit, context write; a one-probe SPS table, flat: every draft verified,
#                 so that the confidence head and the planner run). BLOCKS / NEXTN / CENSUS split
#                 it over calls when one call does not hold it.
#   STAGE=small_m the small-M GEMM's block-fp8 tiles on the decode step's dense shapes (cold L2,
#                 rows 1 / 4 / 16): BLOCK_N 32 / 64, steps of 1 / 2 / 4 scale blocks, K splits
#                 1 / 4 / 8 (SMALLM_ARGS replaces these sweep flags), into $OUT/small_m.log
#   STAGE=mla_splits MLA decode attention at 8192 keys, 1 and 4 query tokens (cold L2, graph
#                 replay of split + merge) per "rows per program:key splits" of MLA_VARIANTS
#                 (default 16:64,32:64,16:128,32:128,32:96; the kernel's rule is 16:64 at one
#                 token) into $OUT/mla_splits.log
# KERNELS (default "triton"): the MoE / KDA-decode / attention kernel set of the A/B stages;
# FUSED=0 runs the in-process benchmarks (graph_ab, round_census, top_kernels) with the torch
# norms and routers (--kernel-choices rmsnorm=0,router=0; the gates and servers keep the
# defaults); CHOICES: any other --kernel-choices for them (one graph per round phase is
# graph_ab.py's --seam-ab variant "graph/phase"); SPECS (default "0 3 4 5")
# the NEXTN steps of the 12-layer A/B rows (0: no speculation); BUNDLED=0 skips the bundled rows;
# AB_ARGS: more graph_ab.py options (e.g. --seam-ab 2: the seam variants), AB_TIMEOUT seconds each.
set -uo pipefail
source scripts/gpu_env.sh  # OUT, wheels, PYTHONPATH, GPU names
FLASH12="--model-path ling-3.0-flash --load-format dummy --json-model-override-args '{\"num_hidden_layers\": 12}'"
K=${KERNELS:-triton}
# The norm / router kernels are on by default on CUDA; FUSED=0 turns them off for an A/B.
CHOICES=${CHOICES:-$([ "${FUSED:-1}" = 1 ] || echo rmsnorm=0,router=0)}
KC=${CHOICES:+--kernel-choices $CHOICES}
TAG="$K$([ "${FUSED:-1}" = 1 ] && echo +fused)"
KARGS="--moe-runner-backend $K --linear-attn-decode-backend $K --attention-backend $([ $K = triton ] && echo triton || echo torch_native)"
date -u; git log --oneline -1

case "${STAGE:-gates}" in
gates)
  timeout ${GATES_TIMEOUT:-420} python3 -m pytest -v -s -m gpu ${GATES:-test/srt/test_cuda_graph_runner.py test/srt/test_graph_refill.py test/kernels/test_mla_decode.py test/kernels/test_round_prep.py} \
    -p no:cacheprovider --durations=5 2>&1 | tee "$OUT/gates.log" \
    | grep -E "PASS|FAIL|first differing|refill|Error|error|passed|failed" | cut -c1-400
  ;;
kernels)
  timeout ${KTEST_TIMEOUT:-150} python3 -m pytest -q test/kernels test/srt/test_moe.py -p no:cacheprovider \
    2>&1 | tee "$OUT/kernel_tests.log" | grep -E "FAIL|Error|passed|failed" | cut -c1-300
  ( cd benchmark/kernels && timeout 150 python3 tune_grouped_gemv.py --tokens 1 --check-tokens 4 \
    --iters 20 --num-stages 1 3 > "$OUT/tune_grouped_gemv.log" 2>&1; tail -40 "$OUT/tune_grouped_gemv.log" | grep -E "^\||tokens|###" | head -30 )
  ( cd benchmark/kernels && timeout 120 python3 tune_small_m_gemm.py --rows 1 4 16 --iters 20 \
    > "$OUT/tune_small_m_gemm.log" 2>&1; tail -9 "$OUT/tune_small_m_gemm.log" )
  [ "${FP8:-1}" = 1 ] && ( cd benchmark/kernels && timeout 100 python3 tune_grouped_gemv.py --fp8 \
    --tokens 1 --check-tokens 4 --iters 20 --block-n 4 8 --block-k 512 1024 --num-stages 3 \
    > "$OUT/tune_grouped_gemv_fp8.log" 2>&1; grep -E "^\| default|^###" "$OUT/tune_grouped_gemv_fp8.log";
    timeout 80 python3 tune_small_m_gemm.py --fp8 --rows 1 4 --iters 20 --block-n 16 32 \
    --block-k 256 --num-stages 4 > "$OUT/tune_small_m_gemm_fp8.log" 2>&1; tail -8 "$OUT/tune_small_m_gemm_fp8.log" )
  ( cd benchmark/kernels && timeout 60 python3 tune_kda_recurrent.py --iters 30 \
    > "$OUT/tune_kda_recurrent.log" 2>&1; tail -6 "$OUT/tune_kda_recurrent.log" )
  timeout ${NEXTN_TIMEOUT:-150} python3 -m pytest -q -s -m gpu test/srt/test_nextn.py -p no:cacheprovider \
    2>&1 | tee "$OUT/nextn_gpu.log" | grep -E "differing|passed|failed|Error" | cut -c1-300
  ;;
small_m)
  ( cd benchmark/kernels && timeout ${SMALLM_TIMEOUT:-240} python3 tune_small_m_gemm.py --fp8 \
    --rows 1 4 16 --iters 10 --shapes "kda qkvbfg" "attn out" "mla q" "dense gate_up" \
    "dense down" ${SMALLM_ARGS:---block-n 32 64 --block-k 128 256 512 --num-stages 4 --split-k 1 4 8} \
    > "$OUT/small_m.log" 2>&1; grep -E "ranking|^\| [a-z]" "$OUT/small_m.log" | cut -c1-400 )
  ;;
mla_splits)
  IFS=, read -ra variants <<< "${MLA_VARIANTS:-16:64,32:64,16:128,32:128,32:96}"
  for v in "${variants[@]}"; do
    echo "== rows per program ${v%%:*}, splits ${v##*:}"
    ( cd benchmark/kernels && timeout 60 python3 bench_mla_decode.py --contexts 8192 --tokens 1 4 \
      --iters 30 --block-h "${v%%:*}" --splits "${v##*:}" 2>&1 | tee -a "$OUT/mla_splits.log" \
      | grep -E "^\| 1 " )
  done
  ;;
fusion)
  # One device call does not hold it all: FUSION_GATES=0 skips the gates, FUSION_SETTINGS picks
  # rows ("moe gemm pdl label" separated by commas). The gates run the tests' own kernel choices
  # (the combine with the Triton MoE, the small-M GEMM for fp8), here with PDL on.
  export SGLANG_ENABLE_PDL=1
  [ "${FUSION_GATES:-1}" = 1 ] && timeout ${GATES_TIMEOUT:-200} python3 -m pytest -q -m gpu test/srt/test_cuda_graph_runner.py \
    test/kernels/test_pdl.py -p no:cacheprovider 2>&1 | tee "$OUT/fusion_gates.log" \
    | grep -E "FAIL|Error|passed|failed" | cut -c1-300
  IFS=, read -ra settings <<< "${FUSION_SETTINGS:-0 0 0 before,1 1 0 fused,1 1 1 fused+pdl}"
  for setting in "${settings[@]}"; do
    read -r moe gemm pdl label <<< "$setting"
    export SGLANG_ENABLE_PDL=$pdl
    fkc="--kernel-choices moe_combine=$moe,small_m_gemm=$gemm"
    for spec in "" "--speculative-algorithm NEXTN --speculative-num-steps 3"; do
      echo "== fusion $label ${spec:+nextn3}"
      eval "timeout ${CENSUS_TIMEOUT:-120} python3 benchmark/batch1/round_census.py $FLASH12 $KARGS $fkc $spec \
        --cuda-graph-max-bs 4 --prompt-len 1024 --steps 16 --label '$label' \
        --result-filename $OUT/census.jsonl" 2>&1 | grep -v Warn | tail -14
      eval "timeout ${AB_TIMEOUT:-120} python3 benchmark/batch1/graph_ab.py $FLASH12 $KARGS $fkc $spec \
        --cuda-graph-max-bs 4 --prompt-len 1024 --steps 48 --label 'flash12 $label ${spec:+nextn3}' \
        --result-filename $OUT/graph_ab.jsonl" 2>&1 | grep -v Warn | tail -6
    done
  done
  python3 benchmark/batch1/plot_census.py "$OUT/census.jsonl" -o "$OUT/census.png" | tail -12
  ;;
fp8full)
  ctx=${CONTEXT:-8192}
  # The context holds the prompt plus every measured round (NEXTN-5: 6 tokens a round).
  FULL="--model-path ling-3.0-flash --load-format dummy --quantization fp8 --mem-fraction-static 0.93 --max-running-requests 2 --context-length $((ctx + 1024)) --cuda-graph-max-bs 1"
  if [ "${SWEEP:-1}" = 1 ]; then  # the fp8 tiles first: they own the step (docs/performance.md)
    ( cd benchmark/kernels && timeout 200 python3 tune_small_m_gemm.py --fp8 --rows 1 4 \
      --shapes "kda qkvbfg" "attn out + norm" "mla q" "router gate" --block-n 32 64 \
      --num-stages 4 --split-k 1 4 8 --swap-ab 0 1 --iters 10 > "$OUT/fp8full_small_m.log" 2>&1
      grep -E "ranking|^\| [a-z]" "$OUT/fp8full_small_m.log" | cut -c1-400
      timeout 150 python3 tune_grouped_gemv.py --fp8 --tokens 1 --check-tokens 4 --iters 10 \
        --block-n 2 4 8 --block-k 256 512 1024 --num-warps 4 8 --num-stages 3 \
        > "$OUT/fp8full_grouped.log" 2>&1
      grep -E "^\| |^###|tokens" "$OUT/fp8full_grouped.log" | head -40 )
  fi
  for steps in ${SPECS:-0 5 3}; do
    spec=$([ "$steps" = 0 ] && echo "" || echo "--speculative-algorithm NEXTN --speculative-num-steps $steps")
    echo "== fp8full graph_ab nextn $steps"
    timeout ${AB_TIMEOUT:-150} python3 benchmark/batch1/graph_ab.py $FULL $KARGS $KC $spec --prompt-len $ctx \
      --steps 16 --replays 30 --label "flash42 fp8 nextn$steps" --result-filename $OUT/fp8full.jsonl 2>&1 \
      | grep -v Warn | tail -7
  done
  [ "${TOP:-1}" = 1 ] && { timeout ${TOP_TIMEOUT:-200} python3 benchmark/batch1/top_kernels.py $FULL $KARGS $KC \
    --prompt-len 64 --steps 2 --top 16 --by-shape > "$OUT/fp8full_top_kernels.log" 2>&1
    grep "^|" "$OUT/fp8full_top_kernels.log"; }
  [ "${FLOORS:-1}" = 1 ] && for tokens in 1 4 6; do
    timeout 60 python3 benchmark/batch1/weight_floor.py --quantization fp8 --context $ctx --tokens $tokens \
      --measure 2>&1 | tail -1 >> "$OUT/fp8full_floor.jsonl"
    echo "floor, $tokens token(s): $(grep -o '"floor_ms": [0-9.]*' "$OUT/fp8full_floor.jsonl" | tail -1)"
  done
  [ "${SERVED:-1}" = 1 ] || exit 0
  eval "exec setsid python3 -m sglang.launch_server $FULL $KARGS --speculative-algorithm NEXTN --speculative-num-steps 5 --port 30700" > "$OUT/server-fp8full.log" 2>&1 &
  pid=$!
  # The server outlives this script if a limit ends it first: end its process group on exit.
  trap 'kill -9 -- -$pid 2>/dev/null' EXIT
  for i in $(seq 1 300); do
    curl -sf localhost:30700/health > /dev/null && break
    kill -0 $pid 2>/dev/null || { echo "fp8full server exited:"; tail -5 "$OUT/server-fp8full.log"; break; }
    sleep 1
  done
  echo "== served flash42 fp8 nextn5 (ready after ${i}s)"
  timeout 120 python3 -m sglang.bench_serving --backend sglang --port 30700 --dataset-name random-ids \
    --random-input-len 1024 --random-output-len 128 --random-range-ratio 1.0 --num-prompts 2 \
    --max-concurrency 1 --disable-tqdm --output-file "$OUT/served.jsonl" 2>&1 | grep -E "Mean TPOT|Accept|Output token"
  ;;
fp8ab)
  FULL="--model-path ling-3.0-flash --load-format dummy --quantization fp8 --mem-fraction-static 0.93 --max-running-requests 2 --context-length 9216 --cuda-graph-max-bs 1"
  # LAYERS=N: the first N layers (an H100's 80 GB holds about 20 of the 42)
  [ -n "${LAYERS:-}" ] && FULL="$FULL --json-model-override-args {\"num_hidden_layers\":$LAYERS}"
  IFS=, read -ra settings <<< "${FP8AB_SETTINGS:-0 - defaults,1 - pdl+prefetch,1 pdl_weight_prefetch=0 pdl,0 mla_rope=0 torch-rope,0 kda_norm_in_o_proj=1 norm-in-o_proj}"
  for setting in "${settings[@]}"; do
    read -r pdl choices label extra <<< "$setting"
    choices=${choices//+/,}  # several fields joined by + (the settings list splits on commas)
    ckc=$([ "$choices" = - ] && echo "" || echo "--kernel-choices $choices")
    for steps in ${FP8AB_SPECS:-0}; do
      spec=$([ "$steps" = 0 ] && echo "" || echo "--speculative-algorithm NEXTN --speculative-num-steps $steps")
      echo "== fp8ab $label nextn $steps"
      SGLANG_ENABLE_PDL=$pdl timeout ${AB_TIMEOUT:-150} python3 benchmark/batch1/graph_ab.py $FULL $KARGS $ckc $spec \
        --prompt-len 8192 --steps ${FP8AB_STEPS:-16} --replays 30 --label "flash42 fp8 $label nextn$steps" \
        ${FP8AB_ARGS:-} $extra --result-filename $OUT/fp8ab.jsonl 2>&1 | grep -v Warn | grep -E "graph|replay"
    done
  done
  ;;
dspark)
  timeout 150 python3 -m pytest -q test/kernels/test_rmsnorm.py test/kernels/test_moe_router.py \
    -p no:cacheprovider 2>&1 | tee "$OUT/fusion_kernels.log" | grep -E "FAIL|Error|passed|failed"
  timeout ${GATES_TIMEOUT:-300} python3 -m pytest -v -s -m gpu test/srt/test_dspark_gpu.py \
    -p no:cacheprovider --durations=3 2>&1 | tee "$OUT/dspark_gates.log" \
    | grep -E "DSPARK|PASS|FAIL|Error|passed|failed" | cut -c1-400
  ;;
dspark_flash)
  ctx=${CONTEXT:-8192}
  # Context: the prompt plus graph_ab's measured rounds (six rows of STEPS + 3 rounds, up to 16
  # tokens each at block 15).
  FULL="--model-path ling-3.0-flash --load-format dummy --quantization fp8 --mem-fraction-static 0.93 --max-running-requests 2 --context-length $((ctx + 2560)) --cuda-graph-max-bs 1"
  DRAFT="--speculative-algorithm DSPARK --speculative-draft-model-path ling-3.0-flash-dspark"
  FLAT="$OUT/sps_flat.json"
  echo '{"sample_batch_tokens": [1], "sample_steps_per_sec": [1.0], "max_batch_tokens": 4096}' > "$FLAT"
  runs=()
  for block in ${BLOCKS:-7 15}; do runs+=("dspark$block:$DRAFT --speculative-dspark-block-size $block"); done
  nextn=${NEXTN:-5}
  [ "$nextn" = 0 ] || runs+=("nextn$nextn:--speculative-algorithm NEXTN --speculative-num-steps $nextn")
  for run in "${runs[@]}"; do
    name=${run%%:*}; spec=${run#*:}
    echo "== dspark_flash graph_ab flash42 fp8 $name"
    timeout ${AB_TIMEOUT:-150} python3 benchmark/batch1/graph_ab.py $FULL $KARGS $KC $spec --prompt-len $ctx \
      --steps 16 --replays 30 --label "flash42 fp8 $name" --result-filename $OUT/dspark_flash.jsonl 2>&1 \
      | grep -v Warn | tail -7
  done
  [ "${CENSUS:-1}" = 1 ] || exit 0
  for run in "${runs[@]}"; do
    name=${run%%:*}; spec=${run#*:}
    # Replayed graphs call no Python: the phases are split on the eager round.
    planner=$([ "${name#dspark}" != "$name" ] && echo "--speculative-dspark-sps-table-path $FLAT")
    echo "== dspark_flash phase census flash42 fp8 $name (eager)"
    timeout ${CENSUS_TIMEOUT:-150} python3 benchmark/batch1/round_census.py $FULL $KARGS $KC $spec $planner \
      --disable-cuda-graph --by phase --prompt-len $ctx --steps 8 --warmup 2 --label "flash42 fp8 $name" \
      --result-filename $OUT/dspark_flash_phases.jsonl 2>&1 | grep -v Warn | tail -16
  done
  ;;
dspark-train)
  timeout $(( ${TRAIN_BUDGET:-200} + 300 )) python3 -m sglang.train.dspark \
    --target-path python/sglang/assets/tiny-bailing-v3 --output-dir "$OUT/dspark" \
    --target-layer-ids 1 3 4 --device cuda --prompts-per-setting ${PROMPTS:-512} --batch-seqs 32 \
    --steps 20000 --time-budget-s ${TRAIN_BUDGET:-200} --eval-served --compare-nextn \
    > "$OUT/train_dspark.log" 2>&1
  echo "train rc=$?"; tail -3 "$OUT/train_dspark.log"
  [ -f "$OUT/dspark/model.safetensors" ] || exit 1
  cp "$OUT/dspark/config.json" "$OUT/dspark/model.safetensors" python/sglang/assets/tiny-bailing-v3/dspark/
  STAGE=served CONFIGS="bundled:1:3 bundled:1:dspark" bash "$0"
  ;;
ab)
  for steps in ${SPECS:-0 3 4 5}; do
    spec=$([ "$steps" = 0 ] && echo "" || echo "--speculative-algorithm NEXTN --speculative-num-steps $steps")
    trace=$([ "$steps" = 0 ] && echo "--trace-dir $OUT" || echo "")
    echo "== graph_ab flash12 $TAG: nextn $steps"
    eval "timeout ${AB_TIMEOUT:-150} python3 benchmark/batch1/graph_ab.py $FLASH12 $KARGS $KC --cuda-graph-max-bs 4 $spec --prompt-len 1024 --steps 48 --label 'flash12 $TAG nextn$steps' --result-filename $OUT/graph_ab.jsonl $trace ${AB_ARGS:-}" 2>&1 \
      | grep -v Warn | tail -16
  done
  [ "${BUNDLED:-1}" = 1 ] && for steps in 0 3; do
    spec=$([ "$steps" = 0 ] && echo "" || echo "--speculative-algorithm NEXTN --speculative-num-steps $steps")
    echo "== graph_ab bundled $TAG: nextn $steps"
    eval "timeout 90 python3 benchmark/batch1/graph_ab.py $KARGS $KC --cuda-graph-max-bs 4 $spec --prompt-len 1024 --steps 48 --label 'bundled $TAG nextn$steps' --result-filename $OUT/graph_ab.jsonl" 2>&1 | grep -v Warn | tail -8
  done
  [ "${FLOOR:-1}" = 1 ] || exit 0
  for ctx in 1024 1280; do
    timeout 60 python3 benchmark/batch1/weight_floor.py --model-path ling-3.0-flash \
      --json-model-override-args '{"num_hidden_layers": 12}' --context $ctx --measure 2>&1 | tail -4
  done
  timeout 60 python3 benchmark/kernels/bench_mla_decode.py 2>&1 | tail -12
  ;;
served)
  # CONFIGS: "model:graphs:steps[:overlap]" (model flash12|bundled, graphs 1|0, NEXTN steps with
  # 0 = none or "dspark" (DSPARK with the model's dspark/ draft; "dspark-cap" / "dspark-compact":
  # with the confidence scheduler on an SPS table profiled here first,
  # --speculative-dspark-verify-mode cap-accept / compact), overlap 1|0, 1 the default).
  port=30600
  for cfg in ${CONFIGS:-flash12:1:0 flash12:1:3 flash12:0:0 bundled:1:0 bundled:1:3}; do
    IFS=: read -r model graphs steps overlap <<< "$cfg"
    oargs=$([ "${overlap:-1}" = 1 ] && echo "" || echo "--disable-overlap-schedule")
    margs=$([ $model = flash12 ] && echo "$FLASH12" || echo "")
    gargs=$([ $graphs = 1 ] && echo "" || echo "--disable-cuda-graph")
    case $steps in
      0) spec="" ;;
      dspark) spec="--speculative-algorithm DSPARK" ;;  # the model's dspark/ draft
      dspark-cap|dspark-compact)  # the confidence scheduler, on an SPS table of this GPU
        [ -f "$OUT/sps_$model.json" ] || timeout 150 python3 -m sglang.benchmark.dspark_sps_profiler \
          $margs $KARGS --device cuda --dtype bfloat16 --cuda-graph --max-running-requests 1 \
          --output "$OUT/sps_$model.json" > "$OUT/sps_profiler_$model.log" 2>&1
        mode=$([ $steps = dspark-compact ] && echo compact || echo cap-accept)
        spec="--speculative-algorithm DSPARK --speculative-dspark-sps-table-path $OUT/sps_$model.json --speculative-dspark-verify-mode $mode" ;;
      *) spec="--speculative-algorithm NEXTN --speculative-num-steps $steps" ;;
    esac
    port=$((port + 1))
    # Own process group: killing it ends the scheduler children too, so the next server finds the
    # GPU memory free.
    # exec: the background job's pid is the server's, and setsid makes it its group's leader
    # (without exec the subshell stays in between and `kill -- -$pid` finds no such group).
    eval "exec setsid python3 -m sglang.launch_server $margs $KARGS $gargs $oargs $spec --cuda-graph-max-bs 4 --port $port" > "$OUT/server-$port.log" 2>&1 &
    pid=$!
    trap 'kill -9 -- -$pid 2>/dev/null' EXIT  # a limit that ends this script ends the server too
    for i in $(seq 1 240); do
      curl -sf localhost:$port/health > /dev/null && break
      kill -0 $pid 2>/dev/null || { echo "server $cfg exited:"; tail -3 "$OUT/server-$port.log"; break; }
      sleep 1
    done
    echo "== served $model $TAG graphs=$graphs nextn=$steps overlap=${overlap:-1}"
    timeout 120 python3 -m sglang.bench_serving --backend sglang --port $port --dataset-name random-ids \
      --random-input-len 1024 --random-output-len 256 --random-range-ratio 1.0 --num-prompts 3 \
      --max-concurrency 1 --disable-tqdm --output-file "$OUT/served.jsonl" 2>&1 | grep -E "Mean TPOT|Median TPOT|Accept|Output token throughput"
    kill -- -$pid 2>/dev/null || echo "could not signal the server's process group $pid"
    ( sleep 60; kill -9 -- -$pid 2>/dev/null ) & killer=$!  # the drain is bounded anyway
    wait $pid 2>/dev/null; kill $killer 2>/dev/null
    for i in $(seq 1 60); do  # until the GPU memory is back
      used=$(nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1)
      [ "${used:-0}" -lt 2000 ] && break; sleep 1
    done
  done
  ;;
esac
cd "$OUT" && ls
