"""The object-store output and input through the S3 transport, against a real S3 server
(SeaweedFS), in process: no model runs."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import TEST_MAX_STAGED_BYTES, FaultProxy, job_env, multipart_uploads  # noqa: E402

from job.checksum import crc64nvme_file  # noqa: E402
from job.data.source import data_fingerprint, list_input_files, read_records  # noqa: E402
from job.errors import EXIT_SUPERSEDED, ConfigError, Superseded  # noqa: E402
from job.settings import OutputSettings  # noqa: E402
from job.storage import s3 as s3_transport  # noqa: E402
from job.storage.objects import ObjectIndexStore  # noqa: E402
from job.storage.staging import StagedShard  # noqa: E402

pytest_plugins = ["s3_fixtures"]
pytestmark = pytest.mark.s3

MiB = 1024**2


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str) -> None:
    """This process's boto3 default chain: the admin identity, the test server."""
    for name in [n for n in os.environ if n.startswith("AWS_")]:
        monkeypatch.delenv(name)
    for name, value in job_env(s3_endpoint, "").items():
        if name.startswith("AWS_"):
            monkeypatch.setenv(name, value)


def output(bucket: str, prefix: str, **overrides: Any) -> OutputSettings:
    settings = {
        "uri": f"s3://{bucket}/{prefix}",
        "shard_bytes": "1MiB",
        "part_size": "5MiB",
        "max_staged_bytes": TEST_MAX_STAGED_BYTES,
    }
    return OutputSettings.model_validate(settings | overrides)


def open_store(settings: OutputSettings, index: int, **kwargs: Any) -> ObjectIndexStore:
    transport, root = s3_transport.connect(
        settings.uri,
        "output.uri",
        upload_threads=int(settings.upload_threads),
        part_size=int(settings.part_size),
        sign_payload=settings.sign_payload,
    )
    return ObjectIndexStore.open(transport, root, settings, index, **kwargs)


def random_file(path: Path, size: int) -> Path:
    path.write_bytes(os.urandom(size))
    return path


def stage_random(store: ObjectIndexStore, name: str, size: int) -> StagedShard:
    staged = store.staging.reserve(name, size)
    assert staged is not None
    random_file(staged.path, size)
    return staged


def test_manifest_compare_and_swap(s3_env: None, s3: Any, bucket: str) -> None:
    first = open_store(output(bucket, "store-cas"), 1)
    second = open_store(output(bucket, "store-cas"), 1)
    try:
        assert first.read_manifest() == (None, None)
        version = first.write_manifest(b'{"run": "first", "n": 1}', None)
        # Both read "absent"; creating it again (If-None-Match: *) finds the first run's manifest.
        with pytest.raises(Superseded) as lost:
            second.write_manifest(b'{"run": "second"}', None)
        assert lost.value.exit_code == EXIT_SUPERSEDED == 3
        newer = first.write_manifest(b'{"run": "first", "n": 2}', version)
        # A stale ETag loses (If-Match) ...
        with pytest.raises(Superseded):
            first.write_manifest(b'{"run": "first", "n": 3}', version)
        # ... unless S3 already holds exactly these bytes: a write whose response was lost and
        # that botocore retried; the run carries on with the manifest's real ETag.
        assert first.write_manifest(b'{"run": "first", "n": 2}', version) == newer
        stored = s3.get_object(Bucket=bucket, Key="store-cas/index-00001/manifest.json")
        assert stored["Body"].read() == b'{"run": "first", "n": 2}'
        assert stored["ETag"] == newer
    finally:
        first.close()
        second.close()


def test_shards_are_checksummed_multipart_and_never_overwritten(
    s3_env: None, s3: Any, bucket: str, tmp_path: Path
) -> None:
    store = open_store(output(bucket, "store-keys", max_staged_bytes="64MiB"), 0)
    try:
        assert store.list_names() == []
        # Another writer takes shard-00000 after this run listed the prefix.
        s3.put_object(Bucket=bucket, Key="store-keys/index-00000/shard-00000.safetensors", Body=b"theirs")
        staged = store.staging.reserve("shard-00000.safetensors", 12 * MiB)
        assert staged is not None
        big = random_file(staged.path, 12 * MiB)
        checksum = crc64nvme_file(big)
        committed = store.commit_shard(staged, checksum)
        assert committed.name == "shard-00001.safetensors"  # re-keyed, not overwritten
        assert (committed.bytes, committed.checksum) == (12 * MiB, checksum)
        theirs = s3.get_object(Bucket=bucket, Key="store-keys/index-00000/shard-00000.safetensors")
        assert theirs["Body"].read() == b"theirs"
        head = s3.head_object(
            Bucket=bucket, Key="store-keys/index-00000/shard-00001.safetensors", ChecksumMode="ENABLED"
        )
        assert head["ChecksumCRC64NVME"] == checksum
        assert head["ChecksumType"] == "FULL_OBJECT"
        assert head["ETag"].strip('"').endswith("-3")  # 5 + 5 + 2 MiB parts
        assert not big.exists()  # deleted once S3's checksum matched
        assert store.staging.used_bytes == 0

        small = stage_random(store, "shard-00002.safetensors", 1000)
        committed = store.commit_shard(small, crc64nvme_file(small.path))
        assert committed.name == "shard-00002.safetensors"
        # The planner's next number is one this run already used: it moves on, too.
        again = stage_random(store, "shard-00001.safetensors", 1000)
        assert store.commit_shard(again, crc64nvme_file(again.path)).name == "shard-00003.safetensors"
        assert store.stats["key_conflicts"] == 1
        assert multipart_uploads(s3, bucket, "store-keys") == []
    finally:
        store.close()


@pytest.mark.parametrize("sign_payload", [True, False])
def test_part_bodies_are_signed_unless_turned_off(
    monkeypatch: pytest.MonkeyPatch,
    s3_env: None,
    s3: Any,
    bucket: str,
    fault_proxy: FaultProxy,
    sign_payload: bool,
) -> None:
    """output.sign_payload=false: shard parts go as UNSIGNED-PAYLOAD over http://, each still
    with its CRC64NVME (which the server checks), and the shard is verified as before."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    prefix = f"store-signing-{sign_payload}"
    store = open_store(output(bucket, prefix, max_staged_bytes="64MiB", sign_payload=sign_payload), 0)
    try:
        staged = stage_random(store, "shard-00000.safetensors", 12 * MiB)
        checksum = crc64nvme_file(staged.path)
        assert store.commit_shard(staged, checksum).checksum == checksum
    finally:
        store.close()
    parts = [r for r in fault_proxy.requests if r.operation == "UploadPart"]
    assert len(parts) == 3  # 5 + 5 + 2 MiB
    for part in parts:
        assert part.headers["x-amz-checksum-crc64nvme"]
        content_sha256 = part.headers["x-amz-content-sha256"]
        if sign_payload:
            assert len(content_sha256) == 64 and int(content_sha256, 16) >= 0  # the body's SHA-256
        else:
            assert content_sha256 == "UNSIGNED-PAYLOAD"
    head = s3.head_object(
        Bucket=bucket, Key=f"{prefix}/index-00000/shard-00000.safetensors", ChecksumMode="ENABLED"
    )
    assert head["ChecksumCRC64NVME"] == checksum


def test_staging_space_is_bounded(s3_env: None, bucket: str) -> None:
    store = open_store(output(bucket, "store-staging", shard_bytes="8KiB", max_staged_bytes="10KiB"), 0)
    try:
        a = store.staging.reserve("a", 6000)
        assert a is not None
        got_b = threading.Event()
        waiter = threading.Thread(target=lambda: (store.staging.reserve("b", 6000), got_b.set()))
        waiter.start()
        assert not got_b.wait(0.3)  # 12000 bytes would exceed the bound: extraction waits
        assert store.staging.reserve("c", 6000, timeout_s=0.05) is None  # a bounded wait gives up
        a.discard()
        a.discard()  # idempotent: the space is given back once
        assert got_b.wait(5)
        waiter.join()
        assert store.staging.used_bytes == 6000
        assert store.staging.high_water_bytes == 6000
        assert store.staging.waits == 1
        with pytest.raises(ConfigError, match=r"output\.max_staged_bytes.*output\.shard_bytes"):
            store.staging.reserve("huge", 20000)
    finally:
        store.close()


def test_a_killed_runs_staging_is_removed_by_the_next_run(s3_env: None, bucket: str, tmp_path: Path) -> None:
    """A run killed with SIGKILL leaves its staging directory (partial shards) behind; the next run
    to stage in output.staging_dir removes it, but never a live run's, nor a directory it did not
    make. Without this, killed runs on a host-mounted /staging fill it until runs fail with exit 2."""
    staging = tmp_path / "staging"
    settings = output(bucket, "store-stale-staging", staging_dir=str(staging))
    killed = subprocess.run(
        [
            sys.executable,
            "-c",
            "import os, signal\n"
            "from job.settings import OutputSettings\n"
            "from job.storage import open_index_store\n"
            f"settings = OutputSettings.model_validate_json({settings.model_dump_json()!r})\n"
            "store = open_index_store(settings, 0)\n"
            "staged = store.staging.reserve('shard-00000.safetensors', 4096)\n"
            "staged.path.write_bytes(bytes(4096))\n"
            "print(staged.path, flush=True)\n"
            "os.kill(os.getpid(), signal.SIGKILL)\n",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    partial = Path(killed.stdout.strip())
    left_behind = partial.parent.parent
    assert partial.is_file() and left_behind.parent == staging
    foreign = staging / "eagle3-index-00009-not-ours"  # no lock file: not made by this code
    foreign.mkdir()

    live = open_store(settings, 1)
    try:
        assert not left_behind.exists()
        other = open_store(settings, 2)
        other.close()
        assert sorted(p.name for p in staging.iterdir()) == sorted([foreign.name, live._staging_root.name]), (
            "the live run's directory stays"
        )
    finally:
        live.close()
    assert [p.name for p in staging.iterdir()] == [foreign.name]


def test_logs_are_shipped_periodically_and_at_the_end(s3_env: None, s3: Any, bucket: str) -> None:
    store = open_store(output(bucket, "store-logs"), 0, log_interval_s=0.2)
    key = "store-logs/index-00000/logs/run-1.jsonl"

    def shipped() -> bytes | None:
        try:
            return s3.get_object(Bucket=bucket, Key=key)["Body"].read()
        except s3.exceptions.NoSuchKey:
            return None

    def wait_for(expected: bytes) -> None:
        deadline = time.monotonic() + 10
        while shipped() != expected:
            assert time.monotonic() < deadline, shipped()
            time.sleep(0.1)

    try:
        path = store.local_path("logs/run-1.jsonl")
        with path.open("w", buffering=1) as f:
            f.write('{"event": "a"}\n{"event": "b"}\n{"event": "c", "half')
            wait_for(b'{"event": "a"}\n{"event": "b"}\n')  # whole lines only
            f.write('": 1}\n')
            wait_for(b'{"event": "a"}\n{"event": "b"}\n{"event": "c", "half": 1}\n')
            f.write('{"event": "last"}\n')
        store.put_file(path, "logs/run-1.jsonl")
        assert shipped().splitlines()[-1] == b'{"event": "last"}'  # type: ignore[union-attr]
        assert all(json.loads(line) for line in shipped().splitlines())  # type: ignore[union-attr]
    finally:
        store.close()


def test_new_owner_aborts_stale_multipart_uploads(s3_env: None, s3: Any, bucket: str) -> None:
    key = "store-stale/index-00000/shard-00007.safetensors"
    upload = s3.create_multipart_upload(Bucket=bucket, Key=key)["UploadId"]
    s3.upload_part(Bucket=bucket, Key=key, UploadId=upload, PartNumber=1, Body=b"x" * 1000)
    store = open_store(output(bucket, "store-stale"), 0)
    try:
        # Opening is not owning: a run still finishing this index may be uploading.
        assert [u["UploadId"] for u in multipart_uploads(s3, bucket, "store-stale")] == [upload]
        store.write_manifest(b"{}", None)
        assert multipart_uploads(s3, bucket, "store-stale") == []
        assert store.stats["stale_uploads_aborted"] == 1
    finally:
        store.close()


def test_store_survives_injected_faults(
    monkeypatch: pytest.MonkeyPatch, s3_env: None, s3: Any, bucket: str, fault_proxy: FaultProxy
) -> None:
    """Shards and manifests through ~20% of requests failing: 500, SlowDown, connection resets
    before and after S3 ran the request, mid-response, and error answers cut off mid-body."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    fault_proxy.fault_rate = 0.2
    store = open_store(output(bucket, "store-faults", max_staged_bytes="64MiB", upload_threads=2), 0)
    sizes = [11 * MiB, 100_000, 6 * MiB, 200_000, 11 * MiB, 1000, 300_000, 7 * MiB]
    expected = {}
    try:
        _, version = store.read_manifest()
        version = store.write_manifest(b"[]", version)
        for number, size in enumerate(sizes):
            staged = stage_random(store, f"shard-{number:05d}.safetensors", size)
            committed = store.commit_shard(staged, crc64nvme_file(staged.path))
            expected[committed.name] = committed.checksum
            version = store.write_manifest(json.dumps(sorted(expected)).encode(), version)
        data, _ = store.read_manifest()
        retries = store.transport.retries
    finally:
        store.close()
    assert json.loads(data or b"") == sorted(expected) == [f"shard-{n:05d}.safetensors" for n in range(8)]
    for name, checksum in expected.items():
        head = s3.head_object(Bucket=bucket, Key=f"store-faults/index-00000/{name}", ChecksumMode="ENABLED")
        assert head["ChecksumCRC64NVME"] == checksum
    assert multipart_uploads(s3, bucket, "store-faults") == []
    injected = sum(fault_proxy.faults.values())
    print(
        f"\nstore under faults: {len(fault_proxy.requests)} requests, {dict(fault_proxy.faults)}, "
        f"{retries} botocore retries"
    )
    assert injected >= 10 and len(fault_proxy.faults) >= 5
    assert fault_proxy.faults["truncated error body"] > 0
    assert retries > 0


def test_a_truncated_error_body_is_retried(
    monkeypatch: pytest.MonkeyPatch, s3_env: None, s3: Any, bucket: str, fault_proxy: FaultProxy
) -> None:
    """The first manifest read of a new index (a 404) answered with an error body cut off by a
    reset: botocore raises urllib3's ProtocolError outside its own retries; the store asks again."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    cut: list[str] = []

    def cut_first_manifest_read(request: Any) -> str | None:
        if request.operation == "GetObject" and request.path.endswith("manifest.json") and not cut:
            cut.append(request.path)
            return "truncated error body"
        return None

    fault_proxy.fault_for = cut_first_manifest_read
    store = open_store(output(bucket, "store-truncated"), 0)
    try:
        assert store.read_manifest() == (None, None)
    finally:
        store.close()
    assert fault_proxy.faults["truncated error body"] == 1
    gets = [r for r in fault_proxy.requests if r.operation == "GetObject"]
    assert len(gets) == 2


def test_s3_input_files_list_and_read(
    monkeypatch: pytest.MonkeyPatch, s3_env: None, s3: Any, bucket: str, fault_proxy: FaultProxy
) -> None:
    rows = [{"id": f"p{i}", "messages": [{"role": "user", "content": "x" * i}]} for i in range(300)]
    table = pa.Table.from_pylist(rows)
    parquet = io.BytesIO()
    pq.write_table(table, parquet, row_group_size=50)
    jsonl = b"".join(json.dumps(r).encode() + b"\n" for r in rows[:40]) + b"not json\n"
    s3.put_object(Bucket=bucket, Key="inputs/b/part.parquet", Body=parquet.getvalue())
    s3.put_object(Bucket=bucket, Key="inputs/a.jsonl", Body=jsonl)
    s3.put_object(Bucket=bucket, Key="inputs/notes.txt", Body=b"ignored")
    s3.put_object(Bucket=bucket, Key="inputs-other/c.jsonl", Body=b"{}\n")  # shares the prefix string

    files = list_input_files(f"s3://{bucket}/inputs")
    assert [(f.name, f.size) for f in files] == [
        ("a.jsonl", len(jsonl)),
        ("b/part.parquet", len(parquet.getvalue())),
    ]
    assert [f.name for f in list_input_files(f"s3://{bucket}/inputs/a.jsonl")] == ["a.jsonl"]
    # A same-size edit changes the data fingerprint (the ETag is in it): no resume over it.
    s3.put_object(Bucket=bucket, Key="inputs/a.jsonl", Body=jsonl.replace(b"x", b"y"))
    edited = list_input_files(f"s3://{bucket}/inputs")
    assert [f.size for f in edited] == [f.size for f in files]
    assert data_fingerprint(edited) != data_fingerprint(files)
    s3.put_object(Bucket=bucket, Key="inputs/a.jsonl", Body=jsonl)

    # Every body read through the proxy is cut off halfway once: the reader resumes where it was.
    monkeypatch.setenv("AWS_ENDPOINT_URL", fault_proxy.endpoint)
    cut: set[str] = set()

    def cut_first_get(request: Any) -> str | None:
        if request.operation == "GetObject" and request.path not in cut:
            cut.add(request.path)
            return "reset mid-response"
        return None

    fault_proxy.fault_for = cut_first_get
    records = list(read_records(list_input_files(f"s3://{bucket}/inputs/")))
    assert [r.sample_id for r in records] == [
        *(f"p{i}" for i in range(40)),
        "a.jsonl:41",
        *(f"p{i}" for i in range(300)),
    ]
    assert records[40].error is not None and records[40].error.startswith("malformed JSON")
    assert [r.value for r in records[41:]] == rows
    assert fault_proxy.faults["reset mid-response"] == 2

    with pytest.raises(ConfigError, match=r"no \.jsonl/.*\.parquet objects"):
        list_input_files(f"s3://{bucket}/no-such-prefix")
    with pytest.raises(ConfigError, match="does not exist"):
        list_input_files("s3://no-such-bucket-eagle3/x")
