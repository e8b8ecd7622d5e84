"""`python -m job bench`'s write-path groups (rows from memory through the job's own write path,
no engine) run where vLLM is absent, as the GPU machine's S3 set-up runs them (.ci/gpu-s3.sh,
a bare Python with the job's wheels): to a local directory and to a real S3 server, with the
rows they report and nothing left in the bucket; and a --write-to that leaves the job group
nowhere to write is refused."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import hide_vllm

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import REPO, TEST_MAX_STAGED_BYTES, job_env  # noqa: E402

pytest_plugins = ["s3_fixtures"]


def test_the_write_groups_run_without_vllm_to_disk_and_s3(
    tmp_path: Path, s3_endpoint: str, s3: Any, bucket: str, job_cache: str
) -> None:
    env = {**job_env(s3_endpoint, job_cache), "PYTHONPATH": hide_vllm(tmp_path)}
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "job",
            "bench",
            "--model=tiny-llama",
            "--groups=write",
            "--write-to=disk,s3",
            "--num-prompts=6",
            "--median-tokens=64",
            "--max-tokens=128",
            "--long-prompts=0",
            f"--work-dir={tmp_path / 'work'}",
            f"--out={out}",
            f"--s3-uri=s3://{bucket}/bench",
            f"--s3-setting=output.max_staged_bytes={TEST_MAX_STAGED_BYTES}",
            "--s3-setting=output.shard_bytes=8MiB",
            "--timeout=240",
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    assert "bench_group_failed" not in proc.stdout, proc.stdout[-3000:]
    rows = {r["config"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
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
