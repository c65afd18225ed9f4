# Sourced by the scripts/gpu_*.sh entry points on the GPU host (no network): install the staged
# wheels (.whl, from scripts/gpu_wheels.sh), put the repository's packages on the path, and print
# the GPUs. Sets OUT (default out) and creates it.
OUT=${OUT:-out}; mkdir -p "$OUT"
# Once per machine: later entry points of the same call find the wheels installed.
[ -d /tmp/site/fastapi ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --target /tmp/site .whl/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
[ -d /tmp/site/fastapi ] || { echo "gpu_env.sh: installing .whl/*.whl failed"; exit 1; }
export PYTHONPATH=/tmp/site:$PWD/python:$PWD/sgl-kernel/python PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
