#!/usr/bin/env bash
# On the lent GPU, after the vLLM 0.26 bundle (WITH_MOE=1) is in place (docs/gpu.md): issue 35's
# figures on the Kimi-class proxy (DeepSeek-V3 architecture at Kimi-K2's width, INT4
# compressed-tensors experts, dummy weights), one step after another:
#   preflight      `python -m job preflight` alone (CUDA graphs up to batch 8, its default)
#   preflight-all  the same, capturing the run's CUDA graph sizes (max_cudagraph_capture_size=null)
#   run            the preflight, then the run without it: its engine's start-up
#   memory         the preflight at gpu_memory_utilization 0.85, where the proxy's 8 layers leave
#                  no KV cache: exit 2 naming the memory expected
#   v2-regen       gpu-check.sh's generating run (tiny-chatml, all_turns) on Model Runner V2
#   profile        `preflight` under py-spy: every process's sampled stacks, idle ones too, in time
#                  order ($OUT/preflight.speedscope.json.gz; where a preflight's seconds go)
# usage: bash .ci/gpu-preflight.sh STEP...   (GPU_MEMORY=0.95; logs $OUT/*.log, rows $OUT/preflight.jsonl)
set -o pipefail
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc-preflight PYTHONFAULTHANDLER=1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
bench() {  # preflight_time on the proxy, its output appended to $OUT/gpu_preflight.log
  timeout -k 10 "${LIMIT:-400}" python3 -m job.benchmarks.preflight_time --gpu --no-write --log-dir "$OUT" \
    --cases bench:kimi-k2-proxy "$@" >>"$OUT/gpu_preflight.log" 2>&1
  echo "rc=$?"
}
for step in "$@"; do
  echo "=== $step $(date +%T)"
  case $step in
    preflight) bench --gpu-memory-utilization "${GPU_MEMORY:-0.95}" --no-run ;;
    preflight-all)
      bench --gpu-memory-utilization "${GPU_MEMORY:-0.95}" --no-run \
        --preflight-arg=--preflight.max_cudagraph_capture_size=null ;;
    run) bench --gpu-memory-utilization "${GPU_MEMORY:-0.95}" ;;
    profile)
      timeout -k 10 "${LIMIT:-400}" /tmp/site/bin/py-spy record --subprocesses --idle --nonblocking --rate 25 \
        --format speedscope -o "$OUT/preflight.speedscope.json" -- python3 -m job.benchmarks.preflight_time \
        --gpu --no-write --log-dir "$OUT" --cases bench:kimi-k2-proxy --no-run \
        --gpu-memory-utilization "${GPU_MEMORY:-0.95}" >>"$OUT/gpu_preflight.log" 2>&1
      echo "rc=$?"
      gzip -f "$OUT/preflight.speedscope.json" ;;
    memory)
      bench --gpu-memory-utilization 0.85 --no-run
      grep -ho 'preflight: memory[^"]*' "$OUT"/*.preflight.log | tail -1 ;;
    v2-regen)
      VLLM_USE_V2_MODEL_RUNNER=1 timeout -k 10 300 python3 -m job run --model.path=builtin:tiny-chatml \
        --data.max_length=1024 --output.shard_bytes=4MiB --log.format=json --backend.name=vllm \
        --backend.vllm.max_num_batched_tokens=256 --backend.vllm.max_num_seqs=8 \
        --backend.vllm.gpu_memory_utilization=0.3 --generate.mode=all_turns --generate.max_new_tokens=48 \
        --generate.temperature=0.8 --output.uri=/tmp/g/regenerated-v2 >"$OUT/v2_regen.log" 2>&1
      echo "rc=$?"
      grep -h '"event": "\(capture_installed\|run_finished\|run_failed\)"' "$OUT/v2_regen.log" | cut -c1-400 ;;
    *) echo "unknown step $step" ;;
  esac
done
grep '^{' "$OUT/gpu_preflight.log" >"$OUT/preflight.jsonl"
grep '^bench:' "$OUT/gpu_preflight.log"
