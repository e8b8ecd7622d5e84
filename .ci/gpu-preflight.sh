#!/usr/bin/env bash
# On the lent GPU, after the vLLM 0.26 bundle (WITH_MOE=1) is in place (docs/gpu.md): issue 35's
# figure, `python -m job preflight` on the Kimi-class proxy (DeepSeek-V3 architecture at Kimi-K2's
# width, INT4 compressed-tensors experts, dummy weights) against the same run's engine start-up.
# usage: bash .ci/gpu-preflight.sh [cases]   (logs $OUT/*.log, rows $OUT/preflight.jsonl; GPU_MEMORY=0.95)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc-preflight PYTHONFAULTHANDLER=1
timeout -k 10 "${LIMIT:-450}" python3 -m job.benchmarks.preflight_time --gpu --no-write --log-dir "$OUT" \
  --gpu-memory-utilization "${GPU_MEMORY:-0.85}" \
  --cases "${1:-bench:kimi-k2-proxy}" >"$OUT/gpu_preflight.log" 2>&1
echo "rc=$?"
grep '^{' "$OUT/gpu_preflight.log" >"$OUT/preflight.jsonl"
tail -4 "$OUT/gpu_preflight.log"
