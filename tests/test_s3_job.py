"""``python -m job run`` with ``output.uri: s3://...`` and ``data.path: s3://...`` against a real
S3 server (SeaweedFS on 127.0.0.1): the happy path, kill -9 at three points and SIGTERM then a
rerun, injected faults, credential and permission errors, and the staging bound."""

from __future__ import annotations

import json
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import (  # noqa: E402
    ADMIN_KEY,
    ADMIN_SECRET,
    READONLY_KEY,
    READONLY_SECRET,
    FaultProxy,
    IndexContents,
    JobProcess,
    all_record_ids,
    job_args,
    job_env,
    log_objects,
    multipart_uploads,
    read_index,
    run_job,
)

from job.errors import EXIT_CONFIG, EXIT_SUPERSEDED, EXIT_TERMINATED  # noqa: E402
from job.layout import shard_number  # noqa: E402

pytest_plugins = ["s3_fixtures"]
pytestmark = pytest.mark.s3

SECRETS = (ADMIN_SECRET, READONLY_SECRET, ADMIN_KEY, READONLY_KEY)


@dataclass
class Reference:
    """An uninterrupted run: what every other run of the same data must end up with."""

    job: JobProcess
    contents: IndexContents
    rejected: list[str]


def rejected_ids(s3: Any, bucket: str, prefix: str) -> list[str]:
    body = s3.get_object(Bucket=bucket, Key=f"{prefix}/index-00000/rejected.jsonl")["Body"].read()
    return [json.loads(line)["sample_id"] for line in body.splitlines()]


def assert_no_secrets(*texts: str | bytes, also: str = "") -> None:
    for text in texts:
        data = text.encode() if isinstance(text, str) else text
        for secret in (*SECRETS, also) if also else SECRETS:
            assert secret.encode() not in data, "a credential leaked"


def s3_uris(bucket: str, prefix: str) -> dict[str, str]:
    return {"output__uri": f"s3://{bucket}/{prefix}", "data__path": f"s3://{bucket}/data/"}


@pytest.fixture(scope="session")
def reference(
    s3_endpoint: str, s3: Any, bucket: str, job_cache: str, tmp_path_factory: pytest.TempPathFactory
) -> Reference:
    job = run_job(job_args(**s3_uris(bucket, "reference")), job_env(s3_endpoint, job_cache))
    assert job.proc.returncode == 0, job.tail()
    contents = read_index(s3, bucket, "reference", tmp_path_factory.mktemp("reference"))
    return Reference(job, contents, rejected_ids(s3, bucket, "reference"))


def test_happy_path(reference: Reference, s3: Any, bucket: str) -> None:
    contents, manifest = reference.contents, reference.contents.manifest
    assert manifest is not None and manifest.complete
    written = contents.sample_ids
    assert len(written) == len(set(written)) == manifest.counts.written
    assert set(written) | set(reference.rejected) == all_record_ids()  # every record accounted for
    assert not set(written) & set(reference.rejected)
    assert manifest.counts.rejected == len(reference.rejected) > 0

    run_id = manifest.run_ids[-1]
    shards = [entry.name for entry in manifest.shards]
    assert sorted(contents.keys) == sorted(
        ["manifest.json", "rejected.jsonl", f"logs/{run_id}.jsonl", *shards]
    ), "nothing but the pinned layout"
    multipart = 0
    for name in shards:
        head = s3.head_object(Bucket=bucket, Key=f"reference/index-00000/{name}", ChecksumMode="ENABLED")
        if "-" in head["ETag"]:  # a multipart object's ETag ends in -<parts>
            multipart += 1
            assert head["ChecksumType"] == "FULL_OBJECT"
    assert multipart >= 2
    assert multipart_uploads(s3, bucket, "reference") == []

    log = log_objects(s3, bucket, "reference")[f"reference/index-00000/logs/{run_id}.jsonl"]
    events = [json.loads(line) for line in log.splitlines()]
    names = [e["event"] for e in events]
    assert names[0] == "run_started" and "run_finished" in names
    assert names.count("shard_committed") == len(shards)
    summary = next(e for e in events if e["event"] == "s3_output_summary")
    assert summary["shards_uploaded"] == len(shards)
    assert summary["bytes_uploaded"] == sum(entry.bytes for entry in manifest.shards)
    manifest_bytes = s3.get_object(Bucket=bucket, Key="reference/index-00000/manifest.json")["Body"].read()
    assert_no_secrets(log, manifest_bytes, "".join(reference.job.stdout), "".join(reference.job.stderr))
    print(
        f"\nhappy path: {len(shards)} shards ({multipart} multipart), {summary['bytes_uploaded']} bytes, "
        f"{manifest.counts.written} samples, {manifest.counts.rejected} rejected"
    )


def test_an_index_with_another_work_count_is_refused(
    reference: Reference, s3_endpoint: str, s3: Any, bucket: str, job_cache: str
) -> None:
    """The output's extraction.json (written create-only by the reference run) refuses index 1
    of 2 beside index 0 of 1: the samples would be split differently and some written twice."""
    recorded = json.loads(s3.get_object(Bucket=bucket, Key="reference/extraction.json")["Body"].read())
    assert recorded["work_count"] == 1 and "work_index" not in recorded
    args = job_args(**s3_uris(bucket, "reference"), work__index="1", work__count="2")
    job = run_job(args, job_env(s3_endpoint, job_cache))
    assert job.proc.returncode == EXIT_CONFIG, job.tail()
    errors = [line for line in job.stderr if line.startswith("error: ")]
    assert len(errors) == 1 and "work.count (work_count: 1 -> 2)" in errors[0], job.tail()
    listing = s3.list_objects_v2(Bucket=bucket, Prefix="reference/index-00001/")
    assert listing.get("KeyCount", 0) == 0


def test_a_first_run_that_commits_nothing_pins_nothing(
    reference: Reference, s3_endpoint: str, s3: Any, bucket: str, job_cache: str, tmp_path: Path
) -> None:
    """A first run on data without records ends with exit 2 before any shard is listed: it leaves
    no extraction.json, and its manifest (no shard, incomplete) pins nothing, so the corrected run on
    the same output.uri completes."""
    s3.put_object(Bucket=bucket, Key="empty/empty.jsonl", Body=b"")
    env = job_env(s3_endpoint, job_cache)
    job = run_job(job_args(output__uri=f"s3://{bucket}/unpinned", data__path=f"s3://{bucket}/empty/"), env)
    assert job.proc.returncode == EXIT_CONFIG, job.tail()
    assert any("the input holds no records at all" in line for line in job.stderr), job.tail()
    assert s3.list_objects_v2(Bucket=bucket, Prefix="unpinned/extraction.json").get("KeyCount", 0) == 0

    job = run_job(job_args(**s3_uris(bucket, "unpinned")), env)
    assert job.proc.returncode == 0, job.tail()
    assert [e for e in job.events if e.get("event") == "index_started_over"]
    contents = read_index(s3, bucket, "unpinned", tmp_path)
    assert contents.manifest is not None and contents.manifest.complete
    assert sorted(contents.sample_ids) == sorted(reference.contents.sample_ids)
    recorded = s3.get_object(Bucket=bucket, Key="unpinned/extraction.json")["Body"].read()
    assert json.loads(recorded) == json.loads(
        s3.get_object(Bucket=bucket, Key="reference/extraction.json")["Body"].read()
    )


def test_a_probe_upload_left_by_a_kill_is_aborted_on_a_complete_index(
    reference: Reference, s3_endpoint: str, s3: Any, bucket: str, job_cache: str
) -> None:
    """The start-up write check's multipart upload, left unfinished by a kill in its window, is
    aborted by the next run although the index is complete (no manifest write follows there)."""
    s3.create_multipart_upload(Bucket=bucket, Key="reference/index-00000/.write-probe-0badc0de")
    assert [u["Key"] for u in multipart_uploads(s3, bucket, "reference")] == [
        "reference/index-00000/.write-probe-0badc0de"
    ]
    job = run_job(job_args(**s3_uris(bucket, "reference")), job_env(s3_endpoint, job_cache))
    assert job.proc.returncode == 0, job.tail()
    assert [e["event"] for e in job.events if e.get("event") == "index_already_complete"]
    assert multipart_uploads(s3, bucket, "reference") == []


def _uploaded(requests: list[Any]) -> set[str]:
    return {r.path for r in requests if r.operation in ("PutObject", "CompleteMultipartUpload")}


def _shard_reads(requests: list[Any]) -> set[str]:
    return {
        r.path
        for r in requests
        if r.operation in ("GetObject", "HeadObject") and r.path.endswith(".safetensors")
    }


def test_kill_points_and_resume(
    reference: Reference,
    s3: Any,
    bucket: str,
    job_cache: str,
    fault_proxy: FaultProxy,
    tmp_path: Path,
) -> None:
    """kill -9 during a multipart upload, during extraction, between the last shard's upload and
    the manifest write, and a SIGTERM; then a rerun completes with every sample exactly once."""
    prefix = "killed"
    args = job_args(**s3_uris(bucket, prefix))
    env = job_env(fault_proxy.endpoint, job_cache)
    total = len(reference.contents.sample_ids)
    runs: list[tuple[str, list[Any], set[str]]] = []  # what each run asked S3 for, what was listed
    listed_at_start: set[str] = set()

    def index() -> IndexContents:
        return read_index(s3, bucket, prefix, tmp_path)

    def start() -> JobProcess:
        nonlocal listed_at_start
        contents = index()
        shards = contents.manifest.shards if contents.manifest is not None else []
        listed_at_start = {f"/{bucket}/{prefix}/index-00000/{entry.name}" for entry in shards}
        fault_proxy.requests.clear()
        return JobProcess(args, env)

    # 1. kill -9 in the middle of a multipart upload: its second part is held back at the proxy.
    fault_proxy.delay = lambda r: 60.0 if r.operation == "UploadPart" and "partNumber=2" in r.query else 0.0
    job = start()

    def part_uploaded() -> bool:
        for upload in multipart_uploads(s3, bucket, prefix):
            if upload["Key"].endswith(".safetensors"):  # not the job's short-lived write probe
                parts = s3.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
                if parts.get("Parts"):
                    return True
        return False

    job.wait_for(part_uploaded, what="a multipart upload with a part")
    job.kill9()
    fault_proxy.delay = None
    runs.append(("multipart upload", list(fault_proxy.requests), listed_at_start))
    orphans = multipart_uploads(s3, bucket, prefix)
    orphan_uploads = [u["UploadId"] for u in orphans]
    assert orphan_uploads
    after_1 = index()
    assert after_1.manifest is not None and not after_1.manifest.complete
    for upload in orphans:  # the interrupted shard is neither an object nor listed
        assert upload["Key"].rsplit("/", 1)[-1] not in after_1.keys

    # 2. kill -9 during extraction, once this run listed a shard.
    job = start()
    job.wait_event("shard_committed")
    job.kill9()
    runs.append(("extraction", list(fault_proxy.requests), listed_at_start))
    after_2 = index()
    assert len(after_1.sample_ids) < len(after_2.sample_ids) < total
    # The new owner aborted the killed run's upload after winning the manifest.
    assert not {u["UploadId"] for u in multipart_uploads(s3, bucket, prefix)} & set(orphan_uploads)

    # 3. SIGTERM after a commit: a clean stop, committed shards listed, logs shipped.
    job = start()
    job.wait_event("shard_committed")
    job.proc.send_signal(signal.SIGTERM)
    assert job.finish() == EXIT_TERMINATED, job.tail()
    runs.append(("SIGTERM", list(fault_proxy.requests), listed_at_start))
    run_3 = next(e["run_id"] for e in job.events if e.get("event") == "run_started")
    log_3 = log_objects(s3, bucket, prefix)[f"{prefix}/index-00000/logs/{run_3}.jsonl"]
    assert b'"event": "run_stopped"' in log_3
    after_3 = index()
    assert len(after_2.sample_ids) < len(after_3.sample_ids) < total

    # 4. kill -9 after the last shard is uploaded and verified, before the manifest lists it.
    written = f'"written": {total},'.encode()
    fault_proxy.hold = lambda r: (
        r.operation == "PutObject" and r.path.endswith("/manifest.json") and written in r.body
    )
    job = start()
    job.wait_for(fault_proxy.held.is_set, what="the manifest write listing every sample")
    job.kill9()
    fault_proxy.hold = None
    runs.append(("before manifest", list(fault_proxy.requests), listed_at_start))
    after_4 = index()
    assert after_4.manifest is not None and len(after_4.sample_ids) < total
    listed_4 = {entry.name for entry in after_4.manifest.shards}
    unlisted = {name for name in after_4.keys if name.endswith(".safetensors")} - listed_4
    assert unlisted, "the last shard was uploaded"

    # 5. The rerun finishes: every sample exactly once, only listed shards kept.
    existing = {n for name in after_4.keys if (n := shard_number(name)) is not None}
    job = start()
    assert job.finish() == 0, job.tail()
    runs.append(("rerun", list(fault_proxy.requests), listed_at_start))
    final = index()
    assert final.manifest is not None and final.manifest.complete
    assert len(final.sample_ids) == len(set(final.sample_ids)) == total
    assert sorted(final.sample_ids) == sorted(reference.contents.sample_ids)
    assert sorted(rejected_ids(s3, bucket, prefix)) == sorted(reference.rejected)
    assert multipart_uploads(s3, bucket, prefix) == []
    new_shards = {
        n for e in final.manifest.shards if e.name not in listed_4 and (n := shard_number(e.name)) is not None
    }
    assert new_shards and min(new_shards) > max(existing)
    assert unlisted <= set(final.keys), "orphans are ignored, not overwritten or deleted"
    assert not unlisted & {e.name for e in final.manifest.shards}

    # No run read a shard it did not upload itself (to verify it) or find listed (to check it on
    # resume); every resumed run checked every listed shard ...
    for point, requests, listed in runs:
        assert _shard_reads(requests) <= _uploaded(requests) | listed, point
        assert listed <= _shard_reads(requests), point
    # ... and no shard key was ever written twice.
    every_upload = [p for _, requests, _ in runs for p in _uploaded(requests) if p.endswith(".safetensors")]
    assert len(every_upload) == len(set(every_upload))
    assert_no_secrets(*log_objects(s3, bucket, prefix).values())
    print(
        f"\nkill points: {[point for point, _, _ in runs[:-1]]}; {len(unlisted)} orphan shard(s) ignored; "
        f"{len(orphan_uploads)} orphan multipart upload(s) aborted; final {len(final.manifest.shards)} shards"
    )


def test_takeover_by_another_run_stops_this_one(
    reference: Reference, s3: Any, s3_endpoint: str, bucket: str, job_cache: str, tmp_path: Path
) -> None:
    """Another pod rewrites the manifest (a retry overlap): this run's next compare-and-swap fails,
    it exits 3 without touching the manifest, and its logs are shipped all the same."""
    key = "takeover/index-00000/manifest.json"
    job = JobProcess(job_args(**s3_uris(bucket, "takeover")), job_env(s3_endpoint, job_cache))

    def manifest_written() -> bool:
        return s3.list_objects_v2(Bucket=bucket, Prefix=key).get("KeyCount", 0) > 0

    job.wait_for(manifest_written, what="the run's first manifest write")
    theirs = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
    theirs["run_ids"].append("the-other-pod")
    theirs = json.dumps(theirs).encode()
    s3.put_object(Bucket=bucket, Key=key, Body=theirs)
    assert job.finish() == EXIT_SUPERSEDED, job.tail()
    assert s3.get_object(Bucket=bucket, Key=key)["Body"].read() == theirs
    run_id = next(e["run_id"] for e in job.events if e.get("event") == "run_started")
    log = log_objects(s3, bucket, "takeover")[f"takeover/index-00000/logs/{run_id}.jsonl"]
    failed = [json.loads(line) for line in log.splitlines() if b'"run_failed"' in line]
    assert failed and "Superseded: " in failed[0]["error"] and "another run changed" in failed[0]["error"]
    assert_no_secrets(log, "".join(job.stdout), "".join(job.stderr))


def test_injected_faults(
    reference: Reference, s3: Any, bucket: str, job_cache: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """~10% of requests (data reads included) fail with 500, 503 SlowDown or a connection reset."""
    fault_proxy.fault_rate = 0.1
    job = run_job(job_args(**s3_uris(bucket, "faults")), job_env(fault_proxy.endpoint, job_cache))
    assert job.proc.returncode == 0, job.tail()
    contents = read_index(s3, bucket, "faults", tmp_path)
    assert contents.manifest is not None and contents.manifest.complete
    assert sorted(contents.sample_ids) == sorted(reference.contents.sample_ids)
    assert sorted(rejected_ids(s3, bucket, "faults")) == sorted(reference.rejected)
    assert multipart_uploads(s3, bucket, "faults") == []
    summary = next(e for e in job.events if e.get("event") == "s3_output_summary")
    faults = sum(fault_proxy.faults.values())
    assert faults >= 3
    assert summary["retries"] >= 1
    logs = log_objects(s3, bucket, "faults")
    assert all(json.loads(line) for body in logs.values() for line in body.splitlines())
    assert_no_secrets(*logs.values(), "".join(job.stdout), "".join(job.stderr))
    print(
        f"\nfaults: {len(fault_proxy.requests)} requests, {dict(fault_proxy.faults)}; job retries "
        f"{summary['retries']}; {len(contents.manifest.shards)} shards complete"
    )


@pytest.mark.parametrize(
    ("case", "message"),
    [
        ("wrong credentials", r"S3 rejected the credentials \((SignatureDoesNotMatch|InvalidAccessKeyId)\)"),
        ("missing bucket", r"bucket 'eagle3-no-such-bucket' does not exist"),
        ("no permission", r"access denied while writing under"),
    ],
)
def test_unusable_output_fails_with_one_clear_line(
    case: str, message: str, s3_endpoint: str, s3: Any, bucket: str, job_cache: str, tmp_path: Path
) -> None:
    data = tmp_path / "chat.jsonl"
    data.write_text('{"id": "a", "messages": [{"role": "user", "content": "hi"}]}\n')
    key, secret, uri = ADMIN_KEY, ADMIN_SECRET, f"s3://{bucket}/{case.replace(' ', '-')}"
    if case == "wrong credentials":
        secret = "wrong-" + ADMIN_SECRET
    elif case == "missing bucket":
        uri = "s3://eagle3-no-such-bucket/out"
    else:
        key, secret = READONLY_KEY, READONLY_SECRET
    job = run_job(
        job_args(output__uri=uri, data__path=str(data)), job_env(s3_endpoint, job_cache, key, secret)
    )
    assert job.proc.returncode == EXIT_CONFIG
    # stderr: the one error line (and, on a first run, the tiny model's build progress bars).
    errors = [line for line in job.stderr if line.strip() and "%|" not in line]
    assert len(errors) == 1 and errors[0].startswith("error: output.uri: "), job.tail()
    assert re.search(message, errors[0]), errors[0]
    assert [e["event"] for e in job.events if e.get("level") == "error"] == ["job_error"]
    if case != "missing bucket":
        listing = s3.list_objects_v2(Bucket=bucket, Prefix=case.replace(" ", "-") + "/")
        assert listing.get("KeyCount", 0) == 0, "nothing written, no manifest claimed"
    # This run's output, and every log object any run of the session shipped.
    assert_no_secrets(
        "".join(job.stdout), "".join(job.stderr), *log_objects(s3, bucket, "").values(), also=secret
    )


def test_staging_stays_within_its_bound(
    reference: Reference, s3: Any, bucket: str, job_cache: str, fault_proxy: FaultProxy, tmp_path: Path
) -> None:
    """With uploads slower than extraction, extraction waits and staged shards never exceed
    output.max_staged_bytes."""
    bound = 512 * 1024
    staging = tmp_path / "staging"
    # One float32 layer: 517 bytes a token, a 512-token sample's shard is ~265 KB; 64 KiB shards.
    args = job_args(
        **s3_uris(bucket, "staging"),
        layers__ids="[8]",
        output__shard_bytes="64KiB",
        output__max_staged_bytes=str(bound),
        output__staging_dir=str(staging),
    )
    fault_proxy.delay = lambda r: (
        1.0 if r.operation == "PutObject" and r.path.endswith(".safetensors") else 0.0
    )
    peak = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal peak
        while not done.is_set():
            total = 0
            for path in staging.glob("*/shards/*"):
                try:
                    total += path.stat().st_size
                except FileNotFoundError:
                    continue  # uploaded and deleted meanwhile
            peak = max(peak, total)
            time.sleep(0.002)

    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    try:
        job = run_job(args, job_env(fault_proxy.endpoint, job_cache))
    finally:
        done.set()
        watcher.join()
    assert job.proc.returncode == 0, job.tail()
    summary = next(e for e in job.events if e.get("event") == "s3_output_summary")
    contents = read_index(s3, bucket, "staging", tmp_path)
    assert contents.manifest is not None and contents.manifest.complete
    assert sorted(contents.sample_ids) == sorted(reference.contents.sample_ids)
    assert summary["staging_waits"] > 0, "the bound was never reached"
    assert 0 < peak <= summary["staging_high_water_bytes"] <= bound
    assert list(staging.iterdir()) == []  # the run's staging directory is gone
    print(
        f"\nstaging: bound {bound} bytes, high-water {summary['staging_high_water_bytes']} (sampled {peak}), "
        f"{summary['staging_waits']} waits, {summary['staging_wait_s']:.1f} s waited, "
        f"{len(contents.manifest.shards)} shards"
    )


def test_regenerated_conversations_are_committed_with_their_shards(
    s3_endpoint: str, s3: Any, bucket: str, job_cache: str, tmp_path: Path
) -> None:
    """generate.mode: each shard's sidecar is uploaded (its CRC64NVME proven by the store) before
    the manifest lists the shard, and holds one line per sample of it, in its order."""
    args = job_args(
        **s3_uris(bucket, "regenerated"),
        generate__mode="last_turn",
        generate__max_new_tokens="8",
        generate__seed="3",
    )
    job = run_job(args, job_env(s3_endpoint, job_cache))
    assert job.proc.returncode == 0, job.tail()
    contents = read_index(s3, bucket, "regenerated", tmp_path)
    manifest = contents.manifest
    assert manifest is not None and manifest.complete and manifest.generation is not None
    base = "regenerated/index-00000/"
    for entry in manifest.shards:
        sidecar = entry.regenerated
        assert sidecar is not None and contents.keys[sidecar.name] == sidecar.bytes
        head = s3.head_object(Bucket=bucket, Key=base + sidecar.name, ChecksumMode="ENABLED")
        assert head["ChecksumCRC64NVME"] == sidecar.checksum.value
        body = s3.get_object(Bucket=bucket, Key=base + sidecar.name)["Body"].read()
        lines = [json.loads(line) for line in body.splitlines()]
        assert [line["sample_id"] for line in lines] == entry.sample_ids
        assert all(len(line["turns"]) == 1 for line in lines)
    assert manifest.generation.conversations == manifest.counts.written
    listed = {e.name for e in manifest.shards} | {
        e.regenerated.name for e in manifest.shards if e.regenerated
    }
    assert {k for k in contents.keys if not k.startswith("logs/")} == listed | {
        "manifest.json",
        "rejected.jsonl",
    }
