#!/usr/bin/env bash
# On the GPU machine: install the carried wheels of WHEEL_DIR into TARGET (a --target site),
# again whenever the set of wheels differs from the last install there (a warm machine keeps
# TARGET between calls; a wheel added since must not be missed).
# usage: bash .ci/gpu-wheels.sh WHEEL_DIR TARGET
set -euo pipefail
wheels=$1 target=$2
stamp=$(ls "$wheels"/*.whl | xargs -n1 basename | sort | sha256sum | cut -d' ' -f1)
[ "$(cat "$target/.wheels" 2>/dev/null)" = "$stamp" ] && exit 0
rm -rf "$target"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$target" "$wheels"/*.whl
echo "$stamp" >"$target/.wheels"
