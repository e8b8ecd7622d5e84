"""Input files are read as they were fingerprinted at start, never further.

* a local JSONL file appended to while a real run reads it: the run writes the records it held at
  start, warns (``input_file_grew``), and its manifest's data fingerprint is that of those bytes;
* a local file changed in place, or cut short, after the fingerprint: an error naming it (exit 2);
* an S3 object replaced after it was listed: an error naming it (exit 2), not "a rerun resumes".
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import structlog

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import job_env as s3_job_env  # noqa: E402
from test_resume import conversation  # noqa: E402

from job.data.source import data_fingerprint, read_records, scan_input  # noqa: E402
from job.errors import ConfigError  # noqa: E402
from job.shards import read_manifest  # noqa: E402

pytest_plugins = ["s3_fixtures"]


def jsonl(records: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in records)


def test_a_file_appended_to_after_the_fingerprint_is_read_up_to_it(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(jsonl([conversation(i) for i in range(5)]))
    files = scan_input(str(path)).files
    with path.open("ab") as f:
        f.write(jsonl([conversation(i) for i in range(5, 8)]))
    with structlog.testing.capture_logs() as logs:
        records = list(read_records(files))
    assert [r.sample_id for r in records] == [f"c-{i:03d}" for i in range(5)]
    (grew,) = [e for e in logs if e["event"] == "input_file_grew"]
    assert grew["read_bytes"] == files[0].size and grew["size_now"] == path.stat().st_size
    assert grew["file"] == str(path)


@pytest.mark.parametrize("change", ["edited in place", "cut short"])
def test_a_file_changed_after_the_fingerprint_is_an_error_naming_it(change: str, tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    data = jsonl([conversation(i) for i in range(5)])
    path.write_bytes(data)
    files = scan_input(str(path)).files
    if change == "edited in place":
        path.write_bytes(data.replace(b"Question 3", b"Question 9"))  # same size
        expected = f"data.path: {path} changed while this run read it: its first {len(data)} bytes have"
    else:
        path.write_bytes(data[: len(data) // 2])
        expected = f"data.path: {path} shrank while this run read it: it ended at byte {len(data) // 2}"
    with pytest.raises(ConfigError) as caught:
        list(read_records(files))
    assert str(caught.value).startswith(expected), caught.value
    assert "run again on a new output.uri" in str(caught.value)


def test_a_run_reads_a_growing_file_only_as_fingerprinted(
    tmp_path: Path, job_env: dict[str, str], fast_args: tuple[str, ...], read_jsonl: Callable
) -> None:
    """A real run; 50 records are appended once it has committed its first shard, while its reader
    (4 samples ahead of the backend) is still inside the file: after every 20 records a blank line of
    1 MiB of spaces, so that the reader's 1 MiB reads do not take the whole file at once."""
    count = 300
    data = tmp_path / "growing.jsonl"
    with data.open("wb") as f:
        for start in range(0, count, 20):
            f.write(jsonl([conversation(i) for i in range(start, start + 20)]) + b" " * 2**20 + b"\n")
    fingerprint = data_fingerprint(scan_input(str(data)).files)
    out = tmp_path / "out"
    args = [
        "run",
        f"--data.path={data}",
        f"--output.uri={out}",
        "--output.shard_bytes=64KiB",
        "--data.prefetch_samples=4",
        "--log.format=json",
        *fast_args,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", *args],
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines = []
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        if json.loads(line)["event"] == "shard_committed":
            with data.open("ab") as f:
                f.write(jsonl([conversation(i) for i in range(count, count + 50)]))
            break
    lines += proc.stdout.read().splitlines(keepends=True)
    assert proc.wait(timeout=600) == 0, "".join(lines[-20:]) + proc.stderr.read()
    events = [json.loads(line) for line in lines]
    (grew,) = [e for e in events if e["event"] == "input_file_grew"]
    assert grew["size_now"] > grew["read_bytes"]
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.complete
    assert sorted(sid for s in manifest.shards for sid in s.sample_ids) == [
        f"c-{i:03d}" for i in range(count)
    ]
    assert manifest.identity.data_fingerprint == fingerprint


@pytest.mark.s3
def test_an_object_replaced_after_the_listing_is_an_error_naming_it(
    s3_endpoint: str, s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in s3_job_env(s3_endpoint, "").items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)
    data = jsonl([conversation(i) for i in range(5)])
    s3.put_object(Bucket=bucket, Key="replaced/data.jsonl", Body=data)
    files = scan_input(f"s3://{bucket}/replaced/").files
    s3.put_object(Bucket=bucket, Key="replaced/data.jsonl", Body=data.replace(b"Question", b"Answer!!"))
    with pytest.raises(ConfigError) as caught:
        list(read_records(files))
    assert str(caught.value).startswith(
        f"data.path: s3://{bucket}/replaced/data.jsonl was replaced while this run read it"
    ), caught.value
