"""`python -m job bench` off the GPU: the write-path groups (rows from memory through the job's
own write path, no engine) run where vLLM is absent, as the GPU machine's S3 set-up runs them
(.ci/gpu-s3.sh, a bare Python with the job's wheels), to a local directory and to a real S3
server, with the rows they report and nothing left in the bucket; the job group runs on a CPU
build of vLLM as .ci/gpu-bench.sh runs it on the GPU (null pass, disk ceiling, job run with its
spot check, step budgets, a backend job setting); a --write-to that leaves the job group nowhere
to write is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import VLLM_CPU_ENV, hide_vllm, needs_vllm

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import REPO, TEST_MAX_STAGED_BYTES, job_env  # noqa: E402

pytest_plugins = ["s3_fixtures"]


def _bench(tmp_path: Path, env: dict[str, str], *args: str) -> tuple[list[dict[str, Any]], str]:
    """``python -m job bench`` on the tiny Llama with a few short prompts and no long ones:
    the rows it wrote to results.jsonl and its stdout."""
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            *(sys.executable, "-m", "job", "bench", "--model=tiny-llama", "--median-tokens=64"),
            "--long-prompts=0",
            f"--work-dir={tmp_path / 'work'}",
            f"--out={out}",
            *args,
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()], proc.stdout


def test_the_write_groups_run_without_vllm_to_disk_and_s3(
    tmp_path: Path, s3_endpoint: str, s3: Any, bucket: str, job_cache: str
) -> None:
    env = {**job_env(s3_endpoint, job_cache), "PYTHONPATH": hide_vllm(tmp_path)}
    rows_written, stdout = _bench(
        tmp_path,
        env,
        "--groups=write",
        "--write-to=disk,s3",
        "--num-prompts=6",
        "--max-tokens=128",
        f"--s3-uri=s3://{bucket}/bench",
        f"--s3-setting=output.max_staged_bytes={TEST_MAX_STAGED_BYTES}",
        "--s3-setting=output.shard_bytes=8MiB",
        "--timeout=240",
    )
    assert "bench_group_failed" not in stdout, stdout[-3000:]
    rows = {r["config"]: r for r in rows_written}
    assert set(rows) == {"write", "write_s3"}
    for row in rows.values():
        assert row["prompts"] == 6 and row["tokens"] > 0
        assert row["bytes_written"] >= row["tokens"] * 4 * 64 * 2  # 4 layers x hidden 64, bf16
    assert rows["write_s3"]["upload_threads"] > 0
    assert rows["write_s3"]["client_cpus"] == len(os.sched_getaffinity(0))  # no --s3-server-pids:
    assert rows["write_s3"]["server_cpus"] is None  # the server's cores are not known
    assert s3.list_objects_v2(Bucket=bucket, Prefix="bench/").get("KeyCount") == 0  # deleted after


def test_the_job_group_needs_a_local_target() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "job", "bench", "--groups=plain,job", "--write-to=s3"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "--write-to: the job group writes to disk or shm" in proc.stderr


@pytest.mark.vllm
@needs_vllm
def test_the_job_group_runs_on_a_cpu_vllm(tmp_path: Path, job_cache: str) -> None:
    env = {**os.environ, "JOB_CACHE_DIR": job_cache, **VLLM_CPU_ENV}
    rows, _ = _bench(
        tmp_path,
        env,
        "--groups=job",
        "--write-to=disk",
        "--num-prompts=12",
        "--max-tokens=256",
        "--max-num-batched-tokens=128",
        "--max-num-seqs=4",
        "--step-budgets=64",
        "--step-budget-prompts=6",
        "--job-setting=backend.vllm.final_step_tokens=32",
        "--timeout=600",
    )
    assert [r["config"] for r in rows] == ["null", "disk_ceiling", "job", "null_budget", "null_budget"]
    null, _, job, *budgets = rows
    assert all(r["tokens"] == job["tokens"] > 0 for r in (null, rows[1]))
    assert job["bytes_written"] >= job["tokens"] * 4 * 64 * 2  # 4 layers x hidden 64, bf16
    assert max(job["spot_check_worst_rel_error_per_layer"]) <= 2e-2  # against HF, in the same run
    # The backend setting reached the group's one engine: its null pass and its job run say so.
    assert "backend.vllm.final_step_tokens=32" in null["notes"]
    assert "backend.vllm.final_step_tokens=32" in job["notes"]
    assert [r["step_tokens"] for r in budgets] == [128, 64]
    assert all(0 < r["tokens_per_step"] <= r["step_tokens"] for r in budgets)
