#!/usr/bin/env bash
# On the lent H200 (device tool), after the vLLM 0.26 bundle is in place and .whl/ is carried
# (as for .ci/gpu-check.sh): what the kernel's OOM killer or a GPU fault does to a CUDA worker.
# The tiny Llama, compiled capture (the default), 6,000 records; vLLM's worker is SIGKILLed once
# the first shard is committed. The run must exit 1 at once (no hang) with the error line naming
# the dead worker, and the rerun must complete with every record written once, checksums verified.
# Run from the checkout's root: bash .ci/gpu-worker-kill.sh  (log in $OUT/gpu_worker_kill.log)
set -o pipefail
rm -rf /tmp/kill
source .devbundle/bin/vllm_env.sh || exit 1
bash .ci/gpu-wheels.sh .whl /tmp/site || exit 1
export PYTHONPATH=/tmp/site:$PYTHONPATH JOB_CACHE_DIR=/tmp/jc PYTHONUNBUFFERED=1
L=$OUT/gpu_worker_kill.log
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee -a "$L"
timeout 500 python3 - "$L" <<'EOF'
import json, subprocess, sys, time
from pathlib import Path

import psutil

log = open(sys.argv[1], "a")
words = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()
data = Path("/tmp/kill/data.jsonl")
data.parent.mkdir(parents=True, exist_ok=True)
with data.open("w") as f:
    for n in range(6000):
        user = " ".join(words[(n + i) % 10] for i in range(60))
        answer = " ".join(words[(n * 7 + i) % 10] for i in range(120))
        f.write(json.dumps({"id": f"r{n:05d}", "messages": [
            {"role": "user", "content": user}, {"role": "assistant", "content": answer}]}) + "\n")
args = [sys.executable, "-m", "job", "run", "--log.format=json", f"--data.path={data}",
        "--output.uri=/tmp/kill/out", "--output.shard_bytes=64MiB", "--backend.name=vllm",
        "--backend.vllm.gpu_memory_utilization=0.3", "--data.tokenizer_workers=4"]
job = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
for line in job.stdout:
    log.write(line)
    if line.startswith("{") and json.loads(line)["event"] == "shard_committed":
        break
# The worker is the job's child holding the GPU (without setproctitle it is not named VLLM::Worker).
on_gpu = subprocess.run(["nvidia-smi", "--query-compute-apps=pid", "--format=csv,noheader"],
                        capture_output=True, text=True).stdout.split()
workers = [p for p in psutil.Process(job.pid).children(recursive=True) if str(p.pid) in on_gpu]
print("processes on the GPU:", on_gpu, "the job's:", [p.pid for p in workers])
workers[0].kill()
killed = time.monotonic()
try:
    rest, stderr = job.communicate(timeout=180)
except subprocess.TimeoutExpired:
    job.kill()
    rest, stderr = job.communicate()
    print("HANG: the job did not exit within 180 s of the worker's death")
exit_s = time.monotonic() - killed
log.write(rest + stderr)
errors = [l for l in stderr.splitlines() if l.startswith("error: ")]
print(f"killed pid {workers[0].pid} ({len(workers)} of the job's processes on the GPU); job exit {job.returncode} {exit_s:.1f} s later")
print("error line:", errors)
rerun = subprocess.run(args, capture_output=True, text=True)
log.write(rerun.stdout + rerun.stderr)
finished = [json.loads(l) for l in rerun.stdout.splitlines() if '"run_finished"' in l]
print("rerun exit", rerun.returncode, {k: finished[0][k] for k in ("status", "written", "written_this_run")}
      if finished else rerun.stderr[-2000:])
EOF
python3 -m job inspect /tmp/kill/out --verify 2>&1 | grep -c "checksum ok" | sed 's/^/shards with checksum ok: /'
python3 -m job inspect /tmp/kill/out 2>&1 | head -1
