#!/usr/bin/env bash
# On the lent GPU, after the vLLM 0.26 bundle is in place (docs/gpu.md): issue 36's regeneration
# figures on the Llama-3.1-8B shape (dummy weights, 200 one-turn conversations, 512 new tokens,
# temperature 0.7). Per model runner named: the job's regenerating run against its parts on one
# engine (python -m job.benchmarks.regeneration), then, with "plain", LLM.generate on the same
# requests and seeds (the bench's regenerate_plain group).
# usage: bash .ci/gpu-regen.sh v2 v2-plain v1 v1-plain   (log $OUT/gpu_regen.log, rows $OUT/results.jsonl)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc PYTHONFAULTHANDLER=1
L=$OUT/gpu_regen.log
LIMIT=${LIMIT:-240}

# Runs "$@" in a session of its own; past $LIMIT seconds every process of it prints its threads'
# stacks (SIGABRT under PYTHONFAULTHANDLER) and is killed: a hang shows where it waits.
limited() {
  setsid "$@" >>"$L" 2>&1 &
  local pid=$! waited=0 sid
  sid=$(ps -o sid= -p $pid | tr -d ' ')
  while kill -0 $pid 2>/dev/null && [ $waited -lt "$LIMIT" ]; do sleep 1; waited=$((waited + 1)); done
  if kill -0 $pid 2>/dev/null; then
    echo "TIMEOUT after ${LIMIT}s; stacks of session $sid follow" | tee -a "$L"
    pkill -ABRT -s "$sid"; sleep 5; pkill -KILL -s "$sid"
  fi
  wait $pid
  echo "rc=$? (${waited}s)" | tee -a "$L"
}

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a "$L"
ENGINE=(--max-num-seqs 128 --max-num-batched-tokens 16384 --gpu-memory-utilization 0.7)
for step in "$@"; do
  runner=${step%-plain}
  v2=$([ "$runner" = v2 ] && echo 1 || echo 0)
  echo "=== $step (VLLM_USE_V2_MODEL_RUNNER=$v2)" | tee -a "$L"
  if [ "$step" = "$runner" ]; then
    VLLM_USE_V2_MODEL_RUNNER=$v2 limited python3 -m job.benchmarks.regeneration --bench-model llama-3.1-8b \
      --user-tokens 600 --conversations 200 --user-turns 1 --mode last_turn --max-new-tokens 512 \
      --temperature 0.7 --dtype bfloat16 --compiled --max-length 8192 --shard-bytes 2GiB \
      --engine-args '{}' --rounds 1 --trace --label "$runner" --work-dir /tmp/regen-$runner --out "$OUT" \
      "${ENGINE[@]}"
  else
    VLLM_USE_V2_MODEL_RUNNER=$v2 limited python3 -m job bench --model llama-3.1-8b --worker regenerate_plain \
      --work-dir /tmp/regen-$runner --temperature 0.7 "${ENGINE[@]}"
    grep -h '^BENCH_RESULT ' "$L" | tail -1 | cut -c14- >"$OUT/plain-$runner.json"
  fi
  grep '^| 0 \|model_runner\|Traceback\|Error' "$L" | tail -6
done
