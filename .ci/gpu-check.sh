#!/usr/bin/env bash
# On the lent H200 (device tool), after the vLLM 0.26 bundle is in place
# (../shared/device/README.md; built with WITH_MOE=1 for DeepSeek-V3) and the
# job's missing wheels are carried in .whl/ (pydantic-settings, python-dotenv,
# structlog, awscrt): the tiny Llama (Model Runner V2 and V1, FlashAttention 3)
# and the tiny DeepSeek-V3 (MLA, MoE) through `python -m job run` with the vLLM
# backend, each compared with the HF reference backend. Results: docs/gpu.md.
# Run from the checkout's root: bash .ci/gpu-check.sh  (log in $OUT/gpu_check.log)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc
L=$OUT/gpu_check.log
C="--data.max_length=1024 --output.shard_bytes=4MiB --log.format=json"
V="--backend.name=vllm --backend.vllm.max_num_batched_tokens=256 --backend.vllm.max_num_seqs=8 --backend.vllm.gpu_memory_utilization=0.3"
run() { echo "=== $*" | tee -a $L; timeout 300 python3 -m job run $C "$@" >>$L 2>&1; echo "rc=$?" | tee -a $L; }
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L
run --backend.name=hf --output.uri=/tmp/g/llama-hf
run $V --backend.vllm.attention_backend=FLASH_ATTN --output.uri=/tmp/g/llama-v2
VLLM_USE_V2_MODEL_RUNNER=0 run $V --backend.vllm.attention_backend=FLASH_ATTN --output.uri=/tmp/g/llama-v1
run --model.path=builtin:tiny-deepseek-v3 --backend.name=hf --output.uri=/tmp/g/dsv3-hf
run --model.path=builtin:tiny-deepseek-v3 $V --output.uri=/tmp/g/dsv3-vllm
for c in llama-v2:llama-hf llama-v1:llama-hf dsv3-vllm:dsv3-hf; do
  echo "=== compare ${c%%:*} vs ${c##*:}" | tee -a $L
  python3 -m job compare /tmp/g/${c%%:*} --reference /tmp/g/${c##*:} 2>&1 | tail -1 | tee -a $L
done
grep -h '"event": "\(adapter_selected\|capture_installed\|vllm_ready\|vllm_extract_finished\|run_finished\|run_failed\|job_crashed\)"' $L | cut -c1-600
