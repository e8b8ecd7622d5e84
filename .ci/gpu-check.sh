#!/usr/bin/env bash
# On the lent H200 (device tool), after the vLLM 0.26 bundle is in place
# (../shared/device/README.md; built with WITH_MOE=1 for DeepSeek-V3) and the
# job's missing wheels are installed in /tmp/site (or carried in .whl/): the tiny
# Llama and the tiny DeepSeek-V3 (MLA, MoE), random weights, through
# `python -m job run` with the vLLM backend, compiled (CUDA graphs, aux-output
# capture: the default) and eager (forward hooks), each compared with an fp32 HF
# reference next to HF bf16's own drift from it; then a compiled regeneration
# (generate.mode all_turns) of the bundled examples. Results: docs/gpu.md.
# Run from the checkout's root: bash .ci/gpu-check.sh  (log in $OUT/gpu_check.log)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc
L=$OUT/gpu_check.log
C="--data.max_length=1024 --output.shard_bytes=4MiB --log.format=json"
V="--backend.name=vllm --backend.vllm.max_num_batched_tokens=256 --backend.vllm.max_num_seqs=8 --backend.vllm.gpu_memory_utilization=0.3"
run() { echo "=== $*" | tee -a $L; timeout 200 python3 -m job run $C "$@" >>$L 2>&1; echo "rc=$?" | tee -a $L; }
compare() {
  echo "=== compare $1 vs $2" | tee -a $L
  python3 -m job compare /tmp/g/$1 --reference /tmp/g/$2 2>&1 | tail -1 | tee -a $L
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L
for m in tiny-llama tiny-deepseek-v3; do
  run --model.path=builtin:$m --backend.name=hf --model.dtype=float32 --output.uri=/tmp/g/$m-hf32
  run --model.path=builtin:$m --backend.name=hf --output.uri=/tmp/g/$m-hf
  run --model.path=builtin:$m $V --output.uri=/tmp/g/$m-compiled
done
run --model.path=builtin:tiny-llama $V --backend.vllm.enforce_eager=true --output.uri=/tmp/g/tiny-llama-eager
for m in tiny-llama tiny-deepseek-v3; do
  compare $m-compiled $m-hf32
  compare $m-hf $m-hf32
done
compare tiny-llama-eager tiny-llama-hf32
run --model.path=builtin:tiny-chatml $V --generate.mode=all_turns --generate.max_new_tokens=48 \
  --generate.temperature=0.8 --output.uri=/tmp/g/regenerated
python3 -m job inspect /tmp/g/regenerated --verify 2>&1 | tail -12 | tee -a $L
grep -h '"event": "\(adapter_selected\|capture_installed\|generation_configured\|run_finished\|run_failed\|job_crashed\)"' $L | cut -c1-700
