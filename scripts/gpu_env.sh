# Sourced by the scripts/gpu_*.sh entry points on the GPU host (no network): install the staged
# wheels (.whl, from scripts/gpu_wheels.sh), put the repository's packages on the path, and print
# the GPUs. Sets OUT (default out) and creates it; defines serve / stop_server (a server in its own
# process group, waited on for SERVE_WAIT seconds, default 400).
# The entry points read their settings from the environment (STAGE=served bash
# scripts/gpu_graphs.sh); a VAR=value given as an argument would be ignored and the default stage
# would run in its place, on device time. Refuse arguments before anything is installed (an
# entry point that takes some sets TAKES_ARGS=1 before sourcing this file).
if [ $# -gt 0 ] && [ "${TAKES_ARGS:-0}" != 1 ]; then
  echo "$(basename "$0"): settings are environment variables, not arguments (got: $*);" \
    "e.g. STAGE=served bash $0" >&2
  exit 2
fi
OUT=${OUT:-out}; mkdir -p "$OUT"
# Once per machine: later entry points of the same call find the wheels installed.
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
[ -d /tmp/site/fastapi ] || { echo "gpu_env.sh: installing .whl/*.whl failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"

# serve PORT LOG ARGS...: start a server in its own process group (SERVER = its pid), wait until
# ready. Call it directly, never inside $(...): a subshell would lose SERVER, and its EXIT trap
# would kill the server as soon as the subshell returns.
serve() {
  local port=$1 log=$2; shift 2
  # SERVE_MAIN: what python3 runs instead of "-m sglang.launch_server" (a script taking the same
  # arguments, e.g. benchmark/batch1/served_variant.py).
  # shellcheck disable=SC2086  # SERVE_MAIN may be two words
  setsid python3 ${SERVE_MAIN:--m sglang.launch_server} "$@" --port $port > "$log" 2>&1 &
  SERVER=$!
  trap 'kill -9 -- -$SERVER 2>/dev/null' EXIT
  for i in $(seq 1 ${SERVE_WAIT:-400}); do
    curl -sf localhost:$port/health > /dev/null && { echo "ready after ${i}s"; return 0; }
    kill -0 $SERVER 2>/dev/null || { echo "server exited:"; tail -5 "$log"; return 1; }
    sleep 1
  done
  # Not ready in time: stop it, or it would hold the port (and the GPU) for the next stage.
  echo "not ready after ${SERVE_WAIT:-400}s:"; tail -3 "$log"
  kill -9 -- -"$SERVER" 2>/dev/null; sleep 3
  return 1
}

# serve_with ENV_WORDS -- PORT LOG ARGS...: serve with the VAR=value words before "--" exported
# for this server only (local -x: the caller's values come back on return; SERVER stays set).
serve_with() {
  while [ $# -gt 0 ] && [ "$1" != -- ]; do local -x "$1"; shift; done
  shift
  serve "$@"
}

stop_server() { [ -n "${SERVER:-}" ] && kill -9 -- -"$SERVER" 2>/dev/null; sleep 3; }
