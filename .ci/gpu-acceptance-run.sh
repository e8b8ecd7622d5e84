#!/usr/bin/env bash
# On the lent GPU, after the copy-only calls of docs/acceptance.md: issue 45's acceptance benchmark
# as one pipeline that outlives the calls watching it. A call lasts 10 minutes at most and the
# machine stays lent while calls follow each other within 30 s, so the first call starts the
# pipeline in the background and every call then waits on it and brings back what it has:
#   bash .ci/gpu-acceptance-run.sh start BUDGET [-- ACCEPTANCE ARGS...]
#       the pipeline, every phase time-boxed within BUDGET seconds; then as `wait 540`
#   bash .ci/gpu-acceptance-run.sh wait SECONDS
#       until the pipeline ends or SECONDS pass; its logs, state and rows go to $OUT
# Phases: the training data beside the held-out answers (and their neighbouring layers' states);
# then a chain per variant at once (FP8 storage, export, train job_fp8 | export, train job_bf16 |
# vLLM's extractor, train vllm_extractor); then serving, the offline check, the report.
# ACC_VARIANTS (unset: job_fp8 vllm_extractor) adds variants to job_bf16, whose draft is also
# served with shifted layers.
# Engines take a fixed KV cache (kv_cache_memory_bytes): one started beside others counts their
# memory against its gpu_memory_utilization while it profiles.
# Measured (H100, 2026-12-07, docs/acceptance.md): the whole pipeline 11 min 47 s; data of 4,066
# prompts 170 s, FP8 61 s, extractor 93 s, three 10-epoch trainings at once 5.0-5.4 min each,
# nine serving engines at once 73 s. Again with 10,462 ShareGPT and eval prompts, job_bf16 only
# (ACC_VARIANTS=""): 12 min 55 s; data 262 s, one 6-epoch training 326 s, serving 101 s. Their
# first two user turns (2026-12-08, `start 1080 -- --epochs 4`): 13 min 24 s; data 363 s, one
# 4-epoch training 285 s, serving 78 s, offline 57 s.
set -o pipefail
run=/opt/acc-run  # the pipeline's logs and results, copied to each call's $OUT
# the work (about 25 GB of hidden states): in memory where /dev/shm has the room
if [ "$(df -P -BG /dev/shm | awk 'NR == 2 { sub("G", "", $4); print $4 }')" -ge 60 ]; then
  export ACC_WORK=/dev/shm/acc
else
  export ACC_WORK=/opt/acc
fi
mode=${1:?usage: start BUDGET | wait SECONDS}
shift

pipeline() {
  local budget=$1
  shift
  [ "${1:-}" = -- ] && shift
  local end=$(($(date +%s) + budget))
  local variants=" job_bf16 ${ACC_VARIANTS-job_fp8 vllm_extractor} "
  has() { [[ $variants == *" $1 "* ]]; }
  # the budget of every variant's draft; speculators' own lr (its default, 1e-3)
  # $variants unquoted: a word each
  set -- --train-max-new-tokens 256 --epochs 10 --lr 1e-3 --train-arg=--draft-attn-impl=sdpa \
    --train-arg=--loss-implementation=eager --train-arg=--num-workers=4 --variants $variants "$@"
  echo "work in $ACC_WORK; acceptance args: $*"
  # box MAX [RESERVE]: a phase's limit, at most MAX s, leaving RESERVE s for what comes after it
  box() { local l=$((end - $(date +%s) - ${2:-0})); ((l < 5)) && l=5; ((l < $1)) && echo $l || echo "$1"; }
  # step NAME LIMIT STEP... [-- ARGS]: one `python -m job.benchmarks.acceptance` run, its output in NAME.out
  step() {
    local name=$1 limit=$2
    shift 2
    echo "$(date +%T) $name: start (limit $limit s)"
    LIMIT=$limit OUT=$run bash .ci/gpu-acceptance.sh "$@" >"$run/$name.out" 2>&1
    echo "$(date +%T) $name: $(tail -1 "$run/$name.out")"
  }
  while [ ! -f /opt/vb/unpacked ] && (($(date +%s) < end)); do sleep 1; done
  echo "$(date +%T) bundle unpacked"
  bash .ci/gpu-wheels.sh .whl /tmp/site || return 1 # once, before the steps share /tmp/site
  # kv BYTES / job_kv BYTES: a KV cache of BYTES for serving and the extractor / the job's engine
  kv() { echo "--engine-args={\"kv_cache_memory_bytes\": $1}"; }
  job_kv() { echo "--job-arg=--backend.vllm.engine_args={\"kv_cache_memory_bytes\": $1}"; }
  local job=(--job-arg=--backend.name=vllm --job-arg=--backend.vllm.enforce_eager=true
    --job-arg=--backend.vllm.max_num_seqs=512 --job-arg=--backend.vllm.gpu_memory_utilization=0.1)
  local serving=(--gpu-memory-utilization 0.1 --engine-args
    '{"enforce_eager": true, "kv_cache_memory_bytes": 2000000000}')
  local trained=$((end - 300)) # training stops here: serving and the report need the rest
  {
    step heldout "$(box 300 600)" heldout -- "${job[@]}" "$@" "$(job_kv 2000000000)"
    step neighbours "$(box 120 600)" neighbours -- "${job[@]}" "$@" "$(job_kv 2000000000)"
  } &
  # 16 GB: 694k tokens of SmolLM2's KV (23,040 B a token), room for 512 multi-turn conversations
  step data "$(box 900 600)" data -- "${job[@]}" "$@" "$(job_kv 16000000000)"
  wait
  until_trained() { local l=$((trained - $(date +%s))); ((l < 5)) && l=5; echo $l; }
  has job_fp8 && {
    step fp8 "$(until_trained)" fp8 -- "${job[@]}" "$@" "$(job_kv 4000000000)"
    step export-fp8 "$(until_trained)" export -- "$@" --variants job_fp8
    step train-fp8 "$(until_trained)" train -- "$@" --variants job_fp8
  } &
  {
    step export-bf16 "$(until_trained)" export -- "$@" --variants job_bf16
    has vllm_extractor && {
      step extractor "$(until_trained)" extractor -- "$@" --gpu-memory-utilization 0.1 "$(kv 4000000000)"
      step train-extractor "$(until_trained)" train -- "$@" --variants vllm_extractor
    } &
    step train-bf16 "$(until_trained)" train -- "$@" --variants job_bf16
    wait
  } &
  wait
  pkill -f 'job.speculators train' && sleep 3 # a time-boxed trainer outlives its parent
  step serve "$(box 240 135)" serve -- "$@" "${serving[@]}" --serve-parallel 9
  pkill -f 'acceptance serve-one'
  # 120 s: with a cold inductor cache the step passed 60 s (2026-12-07; 35 s warm)
  step offline "$(box 120 15)" offline -- "$@"
  step report "$(box 15)" report -- "$@"
}

# what the pipeline has so far, in few files: a call brings back 8 at most
collect() {
  [ -d "$run" ] || return 0
  cp "$run/results.jsonl" "$run/pipeline.log" "$ACC_WORK/state.json" "$OUT"/ 2>/dev/null
  tar czf "$OUT/acceptance.tgz" -C "$run" . -C "$ACC_WORK" logs serve state.json 2>/dev/null
  nvidia-smi --query-gpu=memory.used --format=csv,noheader
  df -h "$ACC_WORK" | tail -1
  tail -n 40 "$run/pipeline.log"
}

case $mode in
  start)
    budget=${1:?BUDGET}
    shift
    rm -rf "$run" /opt/acc-tree && mkdir -p "$run"
    # from a copy of this tree: the next calls' copies of the working tree must not touch it
    cp -a . /opt/acc-tree
    (cd /opt/acc-tree && setsid nohup bash .ci/gpu-acceptance-run.sh pipeline "$budget" "$@" \
      >"$run/pipeline.log" 2>&1 </dev/null &)
    sleep 2
    exec bash "$0" wait 540
    ;;
  pipeline) pipeline "$@" && echo "$(date +%T) pipeline done" || echo "$(date +%T) pipeline rc=$?"; touch "$run/done" ;;
  wait)
    until=$(($(date +%s) + ${1:?SECONDS}))
    while [ ! -f "$run/done" ] && (($(date +%s) < until)); do sleep 2; done
    collect
    ;;
  *) echo "usage: $0 start BUDGET [-- ARGS] | wait SECONDS" >&2 && exit 2 ;;
esac
