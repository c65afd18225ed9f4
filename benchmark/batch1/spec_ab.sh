#!/usr/bin/env bash
# A/B ladder at concurrency 1: no speculation vs NEXTN with 3/4/5 steps (chain, topk 1), each
# through a real server and bench_serving (random-ids, IN in / OUT out). Results are appended to
# $OUT/spec_ab.jsonl (one line per run, tagged) and summarised by benchmark/batch1/summarize.py.
# Usage: OUT=out [STEPS="0 3 4 5"] bash benchmark/batch1/spec_ab.sh NAME "SERVER ARGS..." [PROMPTS] [IN] [OUT_LEN]
# (STEPS: 0 = no speculation.) Logs: $OUT/server-TAG.log, $OUT/bench-TAG.{log,jsonl}.
set -uo pipefail
OUT=${OUT:-out}; mkdir -p "$OUT"
name=$1; server_args=$2; prompts=${3:-5}; in_len=${4:-1024}; out_len=${5:-256}
port=${PORT_BASE:-30100}
for steps in ${STEPS:-0 3 4 5}; do
  tag="$name-$([ "$steps" = 0 ] && echo nospec || echo nextn$steps)"
  spec=()
  [ "$steps" != 0 ] && spec=(--speculative-algorithm NEXTN --speculative-num-steps "$steps"
                             --speculative-eagle-topk 1 --speculative-num-draft-tokens $((steps + 1)))
  # exec: the background job IS the server, so the SIGTERM below reaches it (not a subshell).
  eval "exec python3 -m sglang.launch_server $server_args ${spec[*]} --port $port" > "$OUT/server-$tag.log" 2>&1 &
  pid=$!
  for i in $(seq 1 300); do curl -sf "localhost:$port/health" > /dev/null && break; kill -0 "$pid" 2> /dev/null || break; sleep 1; done
  python3 -m sglang.bench_serving --backend sglang --port "$port" --dataset-name random-ids \
    --random-input-len "$in_len" --random-output-len "$out_len" --random-range-ratio 1.0 \
    --num-prompts "$prompts" --max-concurrency 1 --disable-tqdm \
    --output-file "$OUT/bench-$tag.jsonl" > "$OUT/bench-$tag.log" 2>&1 || tail -5 "$OUT/bench-$tag.log"
  python3 - "$tag" "$OUT/bench-$tag.jsonl" >> "$OUT/spec_ab.jsonl" <<'PY'
import json, sys
tag, path = sys.argv[1], sys.argv[2]
try:
    row = json.loads(open(path).read().splitlines()[-1])
except (OSError, IndexError):
    row = {}
row.pop("server_info", None)
print(json.dumps({"tag": tag, **row}))
PY
  kill -TERM "$pid"; wait "$pid"
  port=$((port + 1))
done
