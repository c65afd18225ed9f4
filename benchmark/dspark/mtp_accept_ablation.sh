#!/usr/bin/env bash
# Does the acceptance-aware loss raise NEXTN's accept length? Three versions of the bundled
# model's MTP layer (python -m sglang.train.mtp; the target is the same in all three):
#   bundled  as shipped (--steps 0: the folder copied and evaluated like the others);
#   accept   retrained for TIME_BUDGET_S seconds with the MTP phase's loss plus ALPHA x the
#            acceptance-aware loss over a 3-step chain;
#   control  retrained with --alpha-accept 0 (the MTP phase's loss alone) for as many optimizer
#            steps as "accept" made, on the same batches (same seed): only the loss differs.
# Each is scored on the same held-out prompts: NEXTN-3 greedy accept length through
# sglang.Engine (committed tokens per verify round), and the teacher-forced chain on held-out
# windows (greedy accepted prefix, expected accept length, per-step agreement).
#   bash benchmark/dspark/mtp_accept_ablation.sh OUT_DIR [TIME_BUDGET_S] [THREADS]
# Environment: ALPHA (default 3.0), EXTRA (more flags for both retrained runs).
set -euo pipefail
OUT=${1:?usage: mtp_accept_ablation.sh OUT_DIR [TIME_BUDGET_S] [THREADS]}
BUDGET=${2:-240}
THREADS=${3:-1}
ALPHA=${ALPHA:-3.0}
EXTRA=${EXTRA:-}
MODEL=python/sglang/assets/tiny-bailing-v3
# Idle OpenMP threads sleep instead of spinning: the engine's scheduler process shares the cores.
export OMP_WAIT_POLICY=PASSIVE
mkdir -p "$OUT"
echo "$(date -u '+%Y-%m-%d %H:%M UTC'), $(uname -m), $(nproc) cores; budget ${BUDGET} s," \
  "threads ${THREADS}, alpha ${ALPHA}"
run() {  # name, flags
  local name=$1; shift
  echo "== $name ($*)"
  # shellcheck disable=SC2086  # EXTRA is a list of flags
  python3 -m sglang.train.mtp --model-path "$MODEL" --output-dir "$OUT/$name" \
    --num-threads "$THREADS" $EXTRA "$@" > "$OUT/$name.log" 2>&1
  tail -n 1 "$OUT/$name.log"
}
run bundled --steps 0
run accept --alpha-accept "$ALPHA" --time-budget-s "$BUDGET" --steps 1000000
STEPS=$(python3 -c 'import json, sys; print(json.load(open(sys.argv[1]))["train"]["num_steps"])' \
  "$OUT/accept/mtp_train_log.json")
run control --alpha-accept 0 --steps "$STEPS" --time-budget-s 1000000
python3 - "$OUT" bundled control accept <<'EOF'
import json, sys
out = sys.argv[1]
print(f"{'variant':<9}{'alpha':>6}{'steps':>7}{'train s':>9}{'NEXTN-3 accept':>16}"
      f"{'TF greedy':>11}{'TF E[A]':>9}  agreement (steps 1..3)")
for name in sys.argv[2:]:
    log = json.load(open(f"{out}/{name}/mtp_train_log.json"))
    ev = log.get("heldout_chain_after", log["heldout_chain_before"])
    alpha = log["args"]["alpha_accept"] if log["train"]["num_steps"] else "-"
    print(f"{name:<9}{alpha!s:>6}{log['train']['num_steps']:>7}{log['train']['seconds']:>9.0f}"
          f"{log['nextn']['accept_length']:>16.3f}{ev['greedy_accept_length']:>11.3f}"
          f"{ev['expected_accept_length']:>9.3f}  "
          + ", ".join(f"{a:.3f}" for a in ev["agreement"]))
EOF
