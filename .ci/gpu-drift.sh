#!/usr/bin/env bash
# On the lent H200, after the vLLM 0.26 bundle is in place (see .ci/gpu-check.sh): where a model's
# captured hidden states drift from an fp32 HF reference, one vLLM setting at a time. The builtin
# MODEL (random weights) through `python -m job run` on the bundled examples:
#   hf32                 HF at float32, the reference
#   hf-bf16              HF at bf16: how far a correct bf16 forward drifts from it
#   compiled             vLLM's default: compilation, CUDA graphs, aux-output capture
#   eager                enforce_eager (forward hooks)
#   compiled-mla-off     VLLM_MLA_DISABLE=1 (DeepseekV2's non-MLA attention; MLA models only)
#   fp32-compiled        vLLM at float32, compiled (TRITON_ATTN, MLA off: vLLM's MLA kernels are
#                        fp16/bf16 only): capture, layer choice and order against the reference
#                        with bf16 rounding out of the way
# each compared with hf32 (python -m job compare) as soon as it is written. Log: $OUT/gpu_drift.log;
# the table: $OUT/drift.md, printed last. About 7 min for tiny-deepseek-v3 on the H200 (timeout_s=600).
# usage: bash .ci/gpu-drift.sh [MODEL]   (default tiny-deepseek-v3)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc
M=${1:-tiny-deepseek-v3}
L=$OUT/gpu_drift.log
C="--model.path=builtin:$M --data.max_length=1024 --output.shard_bytes=4MiB --log.format=json"
V="--backend.name=vllm --backend.vllm.max_num_batched_tokens=256 --backend.vllm.max_num_seqs=8 --backend.vllm.gpu_memory_utilization=0.3"
# run NAME [ENV=VALUE...] -- ARGS...: one `python -m job run` into /tmp/d/NAME, then (but for
# the reference itself) its comparison with hf32, at once: a call cut short keeps what it had.
run() {
  local name=$1 env=() start=$SECONDS
  shift
  while [ "$1" != -- ]; do env+=("$1"); shift; done
  shift
  echo "=== $name: ${env[*]} $*" | tee -a "$L"
  env "${env[@]}" timeout 200 python3 -m job run $C --output.uri=/tmp/d/$name "$@" >>"$L" 2>&1
  echo "rc=$? in $((SECONDS - start)) s" | tee -a "$L"
  [ "$name" = hf32 ] ||
    echo "| $name | $(python3 -m job compare /tmp/d/$name --reference /tmp/d/hf32 2>&1 | tail -1) |" >>"$OUT/drift.md"
}
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$L"
printf '| candidate | vs hf32 |\n|---|---|\n' >"$OUT/drift.md"
run hf32 -- --backend.name=hf --model.dtype=float32
run hf-bf16 -- --backend.name=hf
run compiled -- $V
run eager -- $V --backend.vllm.enforce_eager=true
run compiled-mla-off VLLM_MLA_DISABLE=1 -- $V
run fp32-compiled VLLM_MLA_DISABLE=1 -- $V --model.dtype=float32 --backend.vllm.attention_backend=TRITON_ATTN
grep -h '"event": "\(adapter_selected\|capture_installed\|run_failed\|job_crashed\)"' "$L" | cut -c1-500
cat "$OUT/drift.md"
