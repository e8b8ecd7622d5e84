#!/usr/bin/env bash
# On a lent multi-GPU kind (nvidia-h200-x2 or larger), after the vLLM 0.26 bundle is in place
# (see .ci/gpu-check.sh): the tiny Llama at TP=N against the HF reference (and against TP=1),
# then the Llama-3.1-8B benchmark at TP=N. NVLink multicast stays off (device rules).
# usage: bash .ci/gpu-tp.sh N   (log in $OUT/gpu_tp.log, benchmark rows in $OUT)
set -o pipefail
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 VLLM_ALLREDUCE_USE_SYMM_MEM=0
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc
N=${1:-2}
L=$OUT/gpu_tp.log
C="--data.max_length=1024 --output.shard_bytes=4MiB --log.format=json"
V="--backend.name=vllm --backend.vllm.max_num_batched_tokens=256 --backend.vllm.max_num_seqs=8 --backend.vllm.gpu_memory_utilization=0.3"
run() { echo "=== $*" | tee -a $L; timeout 240 python3 -m job run $C "$@" >>$L 2>&1; echo "rc=$?" | tee -a $L; }
compare() {
  echo "=== compare $1 vs $2" | tee -a $L
  python3 -m job compare /tmp/g/$1 --reference /tmp/g/$2 2>&1 | tail -1 | tee -a $L
}
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee -a $L
run --backend.name=hf --output.uri=/tmp/g/hf
run $V --backend.tensor_parallel_size=$N --output.uri=/tmp/g/tp$N
compare tp$N hf
grep -h '"event": "\(capture_installed\|run_finished\|run_failed\)"' $L | cut -c1-400
timeout 300 python3 -m job bench --model llama-3.1-8b --groups job,plain --tensor-parallel-size $N --long-prompts 0 \
  --work-dir /tmp/eb --out $OUT --timeout 200 2>&1 | grep -v '^{"event": "bench_inputs"' | tail -12
rm -f $OUT/bench-*.jsonl
run $V --backend.tensor_parallel_size=1 --output.uri=/tmp/g/tp1
compare tp$N tp1
