#!/usr/bin/env bash
# Download WHEEL specs (no dependencies) as cp312 x86_64 wheels, for the GPU machine's Python 3.12.
# usage: bash .ci/cp312-wheels.sh OUT_DIR WHEEL...   (PY: the Python whose pip downloads)
set -euo pipefail
out=$1; shift
plat=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3 --abi none)
for p in manylinux2014_x86_64 manylinux_2_17_x86_64 manylinux_2_28_x86_64 any; do plat+=(--platform "$p"); done
"${PY:-python3}" -m pip download -q --no-deps "${plat[@]}" -d "$out" "$@"
