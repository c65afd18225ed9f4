#!/usr/bin/env bash
# One device call, several stages, one archive back. The device returns at most 8 files from
# $OUT, and a stage writes many logs, so every stage writes into a scratch folder and the call
# ends by packing it into $OUT/logs.tgz (also when a stage ran out of time).
#
#   bash scripts/gpu_call.sh "SECONDS SCRIPT VAR=value ..." ...
#
# Each argument is one stage: its time limit in seconds, the stage script under scripts/
# (gpu_prefill.sh or gpu_graphs.sh) and the environment it takes (STAGE=... and the stage's own
# variables). A value with spaces cannot go there (the words are split): export it before the
# call instead, e.g. SERVED_ARGS="--prefill-cuda-graph-tokens 1024 8192" or CONCS="16 64",
# and every stage sees it. Stages run in order; one that exceeds its limit is stopped with what it
# started, and the next one runs. Example, the gpu-marked gates, then the
# deterministic gate's cost:
#
#   bash scripts/gpu_call.sh "300 gpu_prefill.sh STAGE=gates GATES=-v" \
#       "150 gpu_prefill.sh STAGE=determinism DET_GATE=0"
#
# Plan a call's limits to end well inside the device's limit for one command: a machine starts
# with an empty Triton cache, so the first run of every kernel compiles (minutes on the 42-layer
# model; docs/performance.md).
set -uo pipefail
cd "$(dirname "$0")/.."
RESULTS=${OUT:-out}
SCRATCH=${SCRATCH:-/tmp/gpu_call_logs}
# Triton's compiled kernels between calls: a machine starts with an empty cache and the first
# run of every kernel compiles (minutes). A carried .triton_cache.txz (or the older gzip form
# .triton_cache.tgz; git-ignored; name it in the device call's carry) is unpacked first;
# TRITON_CACHE_OUT=1 packs the cache into $OUT/triton_cache.txz at the end when it fits the
# device's 16 MiB per file. xz at -9 in one thread: its 64 MiB dictionary spans the cache's many
# similar cubins (109 MB of cache entries: 3.9 MB, where gzip gave 16.3 MB and multi-threaded xz,
# whose blocks each start a fresh dictionary, 6.7 MB), which also keeps the carry (at most 64
# MiB with the tracked tree of about 45 MB) in bounds; it costs about 35 s of CPU per pack.
TRITON_DIR=${TRITON_CACHE_DIR:-${HOME:-/tmp}/.triton/cache}
mkdir -p "$RESULTS" "$SCRATCH"
for stage in "$@"; do  # check every stage before the first one spends device time
  read -r limit script vars <<< "$stage"
  case "$limit" in ''|*[!0-9]*) echo "gpu_call.sh: '$stage' must start with seconds"; exit 2 ;; esac
  [ -f "scripts/$script" ] || { echo "gpu_call.sh: no scripts/$script"; exit 2; }
done
# TRITON_CACHE_IN names another archive to unpack (a path that does not exist: none).
for cache in ${TRITON_CACHE_IN:-.triton_cache.txz .triton_cache.tgz}; do
  if [ -f "$cache" ]; then  # tar reads either compression
    mkdir -p "$TRITON_DIR" && tar xf "$cache" -C "$TRITON_DIR" \
      && echo "unpacked $(ls "$TRITON_DIR" | wc -l) Triton cache entries from $cache"
    break
  fi
done
# The GPU's clocks, power and throttle reasons once a second for the whole call (a near-empty
# kernel's launch-to-launch time follows the SM clock; read it beside any gap or TPOT change).
SMI_FIELDS=timestamp,clocks.sm,clocks.mem,pstate,power.draw,temperature.gpu,utilization.gpu
SMI_FIELDS=$SMI_FIELDS,clocks_throttle_reasons.active
nvidia-smi --query-gpu=$SMI_FIELDS --format=csv -l 1 > "$SCRATCH/nvidia_smi.csv" 2>&1 &
smi_pid=$!
for stage in "$@"; do
  read -r limit script vars <<< "$stage"
  echo "== $script $vars (limit ${limit}s) at $(date -u +%H:%M:%S)"
  # GNU timeout signals its whole process group, so pytest and benchmarks stop with the stage;
  # servers started with setsid (the stage scripts' serve) escape it: pkill below.
  # shellcheck disable=SC2086  # vars is a list of VAR=value words
  timeout -s KILL "$limit" env OUT="$SCRATCH" $vars bash "scripts/$script"
  rc=$?
  [ $rc = 137 ] && echo "== stopped at ${limit}s"
  # Anchored at the interpreter: a stage's own words may name served_variant.py
  # (SERVE_MAIN=...), and an unanchored pattern would match this script and its caller.
  servers="^python[0-9.]* (-m sglang[.]launch_server|benchmark/batch1/served_variant[.]py)"
  pkill -9 -f "$servers" 2>/dev/null
done
kill "$smi_pid" 2>/dev/null
tar czf "$RESULTS/logs.tgz" -C "$SCRATCH" . && echo "packed $(ls "$SCRATCH" | wc -l) files into logs.tgz"
if [ "${TRITON_CACHE_OUT:-0}" = 1 ] && [ -d "$TRITON_DIR" ]; then
  tar cf - -C "$TRITON_DIR" . | xz -9 -T1 > /tmp/triton_cache.txz
  size=$(stat -c %s /tmp/triton_cache.txz)
  if [ "$size" -le $((16 << 20)) ]; then
    cp /tmp/triton_cache.txz "$RESULTS/triton_cache.txz" && echo "Triton cache: $size bytes"
  else
    echo "Triton cache: $size bytes, over the 16 MiB a returned file may have: not returned"
  fi
fi
