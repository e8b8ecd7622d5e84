#!/usr/bin/env bash
# On the lent H200, after the vLLM 0.26 bundle is in place (see .ci/gpu-check.sh):
# the throughput benchmark of docs/benchmarks.md for one model.
# usage: bash .ci/gpu-bench.sh llama-3.1-8b|qwen3-8b [extra `python -m job bench` args]
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc
M=$1; shift
python3 -m job bench --model $M --groups job,plain,native,hf --work-dir /tmp/eb --out $OUT --timeout 280 "$@" 2>&1 | grep -v '^{"event": "bench_inputs"' | tail -30
rm -f $OUT/bench-*.jsonl
