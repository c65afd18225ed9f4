#!/usr/bin/env bash
# Stage into ./.whl (git-ignored) every wheel that an offline GPU host without the serving stack
# lacks: the HTTP server (fastapi, starlette, uvicorn, pydantic), the ZMQ transport (pyzmq), the
# optional fla-core KDA prefill kernel, opentelemetry-api, which fastapi imports at start-up,
# prometheus_client (--enable-metrics) and pyyaml (--config).
# Run it on a machine with network access, from anywhere inside the checkout; scripts/gpu_env.sh
# installs the result on the GPU host. --no-deps: the list below is the complete closure that
# the host lacks, pinned to versions tested together (Python 3.12, x86_64).
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
WHEELS=(
  annotated_types==0.8.0
  fastapi==0.165.0
  fla-core==0.6.0
  opentelemetry-api==1.45.2
  prometheus_client==0.26.0
  pydantic==2.14.4
  pydantic_core==2.50.5
  pyyaml==6.0.3
  pyzmq==27.3.0
  sniffio==1.3.1
  starlette==1.10.0
  typing_inspection==0.4.5
  uvicorn==0.54.0
)
mkdir -p .whl
# Keep the staged wheels out of `git status` even in a checkout whose .gitignore lacks the entry.
exclude="$(git rev-parse --git-path info/exclude)"
mkdir -p "$(dirname "$exclude")"
grep -qx '/.whl/' "$exclude" 2>/dev/null || echo '/.whl/' >> "$exclude"
# Binary wheels for the host's interpreter only: pure-Python wheels match `any`, pyzmq,
# pydantic_core and pyyaml ship manylinux wheels.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d .whl "${WHEELS[@]}"
echo "staged $(ls .whl/*.whl | wc -l) wheels in .whl ($(du -sh .whl | cut -f1))"
