#!/usr/bin/env bash
# On the GPU machine: install the carried wheels of WHEEL_DIR into TARGET (a --target site),
# again whenever the set of wheels differs from the last install there (a warm machine keeps
# TARGET between calls; a wheel added since must not be missed), and byte-compile them and the
# checkout's job/ and adapters/ as the image's pip install does: that machine sets
# PYTHONDONTWRITEBYTECODE=1, so every process would otherwise compile each module it imports
# (seconds of every start-up, which the preflight's timings must not count).
# usage: bash .ci/gpu-wheels.sh WHEEL_DIR TARGET
set -euo pipefail
wheels=$1 target=$2
stamp=$(ls "$wheels"/*.whl | xargs -n1 basename | sort | sha256sum | cut -d' ' -f1)
python3 -m compileall -q -j 0 job adapters >/dev/null
[ "$(cat "$target/.wheels" 2>/dev/null)" = "$stamp" ] && exit 0
rm -rf "$target"
python3 -m pip install -q --no-index --no-deps --no-cache-dir --target "$target" "$wheels"/*.whl
echo "$stamp" >"$target/.wheels"
