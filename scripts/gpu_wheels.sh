#!/usr/bin/env bash
# Stage every wheel the offline GPU host lacks into ./.whl: the shared set (../shared/gpu/prepare.sh)
# plus opentelemetry-api, which fastapi 0.165 imports at start-up and the host does not have.
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
bash ../shared/gpu/prepare.sh
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 -d .whl "opentelemetry-api==1.45.2"
ls .whl
