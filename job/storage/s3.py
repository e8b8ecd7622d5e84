"""S3 output (``output.uri: s3://bucket/prefix``) and S3 input (``data.path: s3://...``).

The layout under ``prefix/`` is the local sink's. What makes it safe to retry and to resume:

- Credentials come only from boto3's default chain (environment, web identity, instance
  profile); ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` point it at S3-compatible stores.
  Error messages carry the operation and S3's error code, never a response body.
- A shard is built in a bounded local staging area, then uploaded by s3transfer (multipart
  above ``output.part_size``) with its full-object CRC64NVME, which S3 verifies on completion.
  PutObject and CompleteMultipartUpload carry ``If-None-Match: *``, so a shard key is never
  overwritten. The checksum S3 then reports must equal the local one before the local file goes.
- The manifest is replaced by compare-and-swap: ``If-Match`` on the ETag this run last saw,
  ``If-None-Match: *`` when creating it. A 412 means another run (a Kubernetes retry overlap)
  has taken the index over: this run stops with exit 3 and lists nothing more.
- Objects no manifest lists (left by a killed run, or by a run that lost the index) are never
  read, overwritten or deleted; new shards take numbers above every existing key.
- ``logs/*.jsonl`` files handed out by ``local_path`` are uploaded every ``log_interval_s``
  while the run goes on, and once more by ``put_file`` at its end.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import secrets
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any

import boto3
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError, PartialCredentialsError
from s3transfer.manager import TransferConfig, TransferManager

from job.data.source import DATA_SUFFIXES, InputFile
from job.errors import ConfigError, JobError, StorageError, Superseded
from job.logs import get_logger
from job.settings import OutputSettings
from job.shards.format import shard_name, shard_number
from job.storage.base import LOGS, MANIFEST, CommittedShard, IndexStore, index_dir_name

LOG_SHIP_INTERVAL_S = 30.0
PARTIAL = ".partial"
# Defaults for botocore's retry policy, used unless AWS_RETRY_MODE / AWS_MAX_ATTEMPTS (or the
# shared config file) say otherwise. "standard" retries 5xx, SlowDown/throttling and connection
# errors with exponential backoff and full jitter.
RETRY_MODE = "standard"
MAX_ATTEMPTS = 10
# A shard whose planned key another writer took meanwhile is re-keyed; more conflicts than this
# in a row mean something keeps writing into this index.
_MAX_KEY_CONFLICTS = 5
_READ_ATTEMPTS = 5  # GETs whose body broke off (after botocore's retries, which end at the headers)
_CREDENTIAL_ERRORS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}


class _RetryCounter:
    """Retries botocore made, across every client this module created (a figure for the logs)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.retries = 0

    def after_call(self, parsed: dict[str, Any], **_: Any) -> None:
        self._add(parsed.get("ResponseMetadata", {}).get("RetryAttempts", 0))

    def after_call_error(self, context: dict[str, Any], **_: Any) -> None:
        self._add(context.get("retries", {}).get("attempt", 1) - 1)

    def _add(self, n: int) -> None:
        if n:
            with self._lock:
                self.retries += n


retry_counter = _RetryCounter()


def make_client(max_connections: int = 10) -> BaseClient:
    """An S3 client from boto3's default credential chain and endpoint settings."""
    retries: dict[str, Any] = {}
    if not os.environ.get("AWS_RETRY_MODE"):
        retries["mode"] = RETRY_MODE
    if not os.environ.get("AWS_MAX_ATTEMPTS"):
        retries["max_attempts"] = MAX_ATTEMPTS
    config = Config(retries=retries, max_pool_connections=max_connections)  # type: ignore[arg-type]
    client = boto3.session.Session().client("s3", config=config)
    client.meta.events.register("after-call.s3", retry_counter.after_call)
    client.meta.events.register("after-call-error.s3", retry_counter.after_call_error)
    return client


def parse_s3_uri(uri: str, setting: str) -> tuple[str, str]:
    """``s3://bucket/some/prefix`` -> (bucket, "some/prefix")."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ConfigError(f"{setting}: {uri!r} names no bucket; use s3://bucket/prefix")
    return bucket, prefix.strip("/")


def _code(exc: ClientError) -> tuple[str, int]:
    return (
        str(exc.response.get("Error", {}).get("Code", "")),
        int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)),
    )


def _translate(exc: Exception, setting: str, bucket: str, action: str) -> JobError:
    """One readable error for a boto failure; built from codes only, so no echoed secret leaks."""
    if isinstance(exc, NoCredentialsError | PartialCredentialsError):
        return ConfigError(
            f"{setting}: no usable AWS credentials while {action}; provide them through the standard "
            "chain (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, AWS_PROFILE, web identity/IRSA, "
            "instance profile)"
        )
    if isinstance(exc, ClientError):
        code, status = _code(exc)
        if code in _CREDENTIAL_ERRORS:
            return ConfigError(
                f"{setting}: S3 rejected the credentials ({code}) while {action}; check the access key, "
                "secret and session token the credential chain provides"
            )
        if code == "NoSuchBucket":
            return ConfigError(f"{setting}: bucket {bucket!r} does not exist; create it or fix {setting}")
        if code == "AccessDenied" or status == 403:
            return ConfigError(
                f"{setting}: access denied while {action} ({code or status}); the identity needs "
                "s3:ListBucket, s3:ListBucketMultipartUploads, s3:GetObject, s3:PutObject and "
                "s3:AbortMultipartUpload on the prefix"
            )
        return StorageError(f"{setting}: {action} failed: {code or 'error'} (HTTP {status})")
    return StorageError(f"{setting}: {action} failed: {type(exc).__name__}: {exc}")


@contextlib.contextmanager
def _s3_errors(setting: str, bucket: str, action: str) -> Iterator[None]:
    try:
        yield
    except (ClientError, BotoCoreError) as exc:
        raise _translate(exc, setting, bucket, action) from None


def _is_status(exc: ClientError, *statuses: int) -> bool:
    return _code(exc)[1] in statuses


class S3IndexStore(IndexStore):
    staging_is_output = False  # shards are uploaded from staging, then deleted

    def __init__(
        self,
        output: OutputSettings,
        index: int,
        client: BaseClient,
        bucket: str,
        prefix: str,
        log_interval_s: float,
    ) -> None:
        self.index = index
        self.bucket = bucket
        self.prefix = prefix  # ends with "/"
        self.location = f"s3://{bucket}/{prefix.rstrip('/')}"
        self._log = get_logger(work_index=index, output=self.location)
        threads = int(output.upload_threads)
        self._client = client
        # Every object the shard client creates is create-only: s3transfer has no If-None-Match
        # argument, so it is added to the two requests that create objects.
        self._shard_client = make_client(threads + 4)
        for operation in ("PutObject", "CompleteMultipartUpload"):
            self._shard_client.meta.events.register(f"before-parameter-build.s3.{operation}", _create_only)
        part = int(output.part_size)
        transfer_config = TransferConfig(
            multipart_threshold=part, multipart_chunksize=part, max_request_concurrency=threads
        )
        self._transfer = TransferManager(self._shard_client, transfer_config)
        self._max_staged = int(output.max_staged_bytes)
        self._staging_root = _make_staging_dir(output, index)
        self._shards_dir = self._staging_root / "shards"
        self._files_dir = self._staging_root / "files"
        self._shards_dir.mkdir()
        self._files_dir.mkdir()
        self._staged: dict[str, int] = {}
        self._staged_bytes = 0
        self._space = threading.Condition()
        self._taken: set[int] = set()  # shard numbers seen under the prefix or claimed by this run
        self._taken_lock = threading.Lock()
        self._owner = False  # this run has written the manifest at least once
        self._own_keys: set[str] = set()  # keys this run created objects (or the write probe) at
        self.stats = {
            "shards_uploaded": 0,
            "bytes_uploaded": 0,
            "key_conflicts": 0,
            "stale_uploads_aborted": 0,
            "staging_high_water_bytes": 0,
            "staging_waits": 0,
            "staging_wait_s": 0.0,
        }
        self._live_logs: dict[str, Path] = {}
        self._shipped: dict[str, int] = {}
        self._ship_lock = threading.Lock()
        self._stop = threading.Event()
        self._shipper = threading.Thread(
            target=self._ship_periodically, args=(log_interval_s,), name="s3-log-shipper", daemon=True
        )
        self._shipper.start()

    @classmethod
    def open(
        cls, output: OutputSettings, index: int, log_interval_s: float = LOG_SHIP_INTERVAL_S
    ) -> S3IndexStore:
        bucket, root = parse_s3_uri(output.uri, "output.uri")
        prefix = f"{root}/{index_dir_name(index)}/" if root else f"{index_dir_name(index)}/"
        store = cls(output, index, make_client(), bucket, prefix, log_interval_s)
        try:
            store._check_access()
        except BaseException:
            store.close()
            raise
        return store

    def _check_access(self) -> None:
        """Fail before any model loads when the bucket, credentials or permissions are wrong."""
        with self._errors(f"listing {self.location}"):
            self._client.list_objects_v2(Bucket=self.bucket, Prefix=self.prefix, MaxKeys=1)
            # The new owner's clean-up needs it (s3:ListBucketMultipartUploads).
            self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=self.prefix, MaxUploads=1)
        # Creating and aborting a multipart upload proves s3:PutObject and s3:AbortMultipartUpload
        # without creating an object.
        probe = f"{self.prefix}.write-probe-{secrets.token_hex(4)}"
        with self._errors(f"writing under {self.location}"):
            upload_id = self._client.create_multipart_upload(Bucket=self.bucket, Key=probe)["UploadId"]
        self._own_keys.add(probe)
        with self._errors(f"aborting a multipart upload under {self.location}"):
            self._client.abort_multipart_upload(Bucket=self.bucket, Key=probe, UploadId=upload_id)

    # -- listing and the manifest --------------------------------------------------------------

    def list_names(self) -> list[str]:
        names = self._list()
        with self._taken_lock:
            self._taken.update(n for name in names if (n := shard_number(name)) is not None)
        return names

    def _errors(self, action: str) -> contextlib.AbstractContextManager[None]:
        return _s3_errors("output.uri", self.bucket, action)

    def _list(self) -> list[str]:
        names = []
        with self._errors(f"listing {self.location}"):
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                names.extend(obj["Key"][len(self.prefix) :] for obj in page.get("Contents", []))
        return sorted(names)

    def read_manifest(self) -> tuple[bytes | None, str | None]:
        with self._errors(f"reading {self.location}/{MANIFEST}"):
            try:
                return _get_whole(self._client, Bucket=self.bucket, Key=self.prefix + MANIFEST)
            except ClientError as exc:
                if _is_status(exc, 404) and _code(exc)[0] != "NoSuchBucket":
                    return None, None
                raise

    def write_manifest(self, data: bytes, version: str | None) -> str | None:
        condition = {"IfMatch": version} if version else {"IfNoneMatch": "*"}
        with self._errors(f"writing {self.location}/{MANIFEST}"):
            try:
                etag = self._client.put_object(
                    Bucket=self.bucket,
                    Key=self.prefix + MANIFEST,
                    Body=data,
                    ContentType="application/json",
                    ChecksumAlgorithm="CRC64NVME",
                    **condition,
                )["ETag"]
            except ClientError as exc:
                if not _is_status(exc, 409, 412):
                    raise
                # A retried request whose first attempt did succeed also ends in 412: the manifest
                # then holds exactly these bytes (they name this run), so the write is ours.
                current, etag = self.read_manifest()
                if current != data:
                    raise Superseded(
                        f"{self.location}: another run changed {MANIFEST} since this run last wrote it "
                        "(two pods on one index, e.g. a Kubernetes retry overlap); this run stops, the "
                        "other one owns the index"
                    ) from None
        if not self._owner:
            self._owner = True
            # Only now is this run the index's owner, so multipart uploads left under the prefix
            # belong to dead or superseded runs. (The runner writes the manifest before any shard,
            # so none of them is this run's.) Hygiene only: a failure is reported, not fatal.
            try:
                self._abort_uploads()
            except JobError as exc:
                self._log.warning("multipart_cleanup_failed", error=str(exc))
        return etag

    def _abort_uploads(self, only_keys: set[str] | None = None) -> None:
        """Abort the unfinished multipart uploads under the prefix (or only those to ``only_keys``)."""
        aborted = 0
        with self._errors(f"cleaning up multipart uploads under {self.location}"):
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=self.prefix
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if only_keys is not None and upload["Key"] not in only_keys:
                        continue
                    with contextlib.suppress(self._client.exceptions.NoSuchUpload):
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                        aborted += 1
        if aborted:
            self.stats["stale_uploads_aborted"] += aborted
            self._log.info("stale_multipart_uploads_aborted", count=aborted)

    # -- shards ----------------------------------------------------------------------------------

    def shard_staging_path(self, name: str) -> Path:
        return self._shards_dir / (name + PARTIAL)

    def reserve_staging(self, name: str, nbytes: int, timeout_s: float | None = None) -> bool:
        if nbytes > self._max_staged:
            raise ConfigError(
                f"shard {name} needs {nbytes} bytes of staging but output.max_staged_bytes is "
                f"{self._max_staged}; raise output.max_staged_bytes or lower output.shard_bytes "
                "(a single sample longer than shard_bytes makes a shard of its own)"
            )
        with self._space:
            started = time.monotonic()
            deadline = None if timeout_s is None else started + timeout_s
            waited = False
            while self._staged_bytes + nbytes > self._max_staged:
                waited = True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.stats["staging_wait_s"] += time.monotonic() - started
                    return False
                self._space.wait(left)
            if waited:
                self.stats["staging_waits"] += 1
                self.stats["staging_wait_s"] += time.monotonic() - started
            self._staged[name] = nbytes
            self._staged_bytes += nbytes
            self.stats["staging_high_water_bytes"] = max(
                self.stats["staging_high_water_bytes"], self._staged_bytes
            )
            return True

    def release_staging(self, name: str) -> None:
        with self._space:
            self._staged_bytes -= self._staged.pop(name, 0)
            self._space.notify_all()

    def commit_shard(self, path: Path, name: str, checksum: str) -> CommittedShard:
        try:
            size = path.stat().st_size
            key_name = self._claim(name)
            for _ in range(_MAX_KEY_CONFLICTS):
                if self._upload(path, key_name, checksum, size):
                    break
                self.stats["key_conflicts"] += 1
                taken_by_other = key_name
                with self._taken_lock:
                    self._taken.update(n for n in map(shard_number, self._list()) if n is not None)
                key_name = self._claim(name, fresh=True)
                self._log.warning("shard_key_taken", key=taken_by_other, uploading_as=key_name)
            else:
                raise StorageError(
                    f"{self.location}: {_MAX_KEY_CONFLICTS} shard keys in a row were taken by another "
                    "writer; is another job writing to this output.uri and index?"
                )
            remote = self._remote_checksum(key_name)
            if remote != (checksum, size):
                raise StorageError(
                    f"{self.location}/{key_name}: S3 holds {remote[1]} bytes with CRC64NVME {remote[0]}, "
                    f"but the local shard has {size} bytes with {checksum}; it is not listed"
                )
            self._own_keys.add(self.prefix + key_name)
            self.stats["shards_uploaded"] += 1
            self.stats["bytes_uploaded"] += size
            return CommittedShard(key_name, size, checksum)
        finally:
            path.unlink(missing_ok=True)
            self.release_staging(name)

    def _claim(self, name: str, fresh: bool = False) -> str:
        """The key name to upload ``name`` under: its own number unless that is already taken."""
        number = shard_number(name)
        assert number is not None, name
        with self._taken_lock:
            if fresh or number in self._taken:
                number = max(self._taken) + 1
            self._taken.add(number)
        return shard_name(number)

    def _upload(self, path: Path, key_name: str, checksum: str, size: int) -> bool:
        """Upload ``path`` as a new object; False when another writer holds the key."""
        with self._errors(f"uploading {self.location}/{key_name}"):
            try:
                # Giving the full-object checksum makes s3transfer create the multipart upload with
                # ChecksumType FULL_OBJECT and pass it to CompleteMultipartUpload, where S3 checks it.
                self._transfer.upload(
                    str(path), self.bucket, self.prefix + key_name, extra_args={"ChecksumCRC64NVME": checksum}
                ).result()
                return True
            except ClientError as exc:
                # 412: the key exists. NoSuchUpload: the upload was completed already. Either can be
                # this very upload whose successful completion was retried after a lost response.
                if not (_is_status(exc, 412) or _code(exc)[0] == "NoSuchUpload"):
                    raise
        return self._remote_checksum(key_name) == (checksum, size)

    def _remote_checksum(self, key_name: str) -> tuple[str | None, int]:
        with self._errors(f"verifying {self.location}/{key_name}"):
            head = self._client.head_object(
                Bucket=self.bucket, Key=self.prefix + key_name, ChecksumMode="ENABLED"
            )
        return head.get("ChecksumCRC64NVME"), int(head["ContentLength"])

    def discard(self, name: str) -> None:
        """Unlisted objects stay: a run that lost the index may still be finishing them, and
        keys are never reused, so they are harmless (an AbortIncompleteMultipartUpload and
        expiry lifecycle rule can reclaim the space)."""

    # -- small files and logs ---------------------------------------------------------------------

    def local_path(self, name: str) -> Path:
        path = self._files_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if name.startswith(LOGS + "/"):
            with self._ship_lock:
                self._live_logs[name] = path
        return path

    def put_file(self, path: Path, name: str) -> None:
        if not name.startswith(LOGS + "/"):
            with self._errors(f"uploading {self.location}/{name}"), path.open("rb") as f:
                self._client.put_object(
                    Bucket=self.bucket, Key=self.prefix + name, Body=f, ChecksumAlgorithm="CRC64NVME"
                )
            return
        # The final upload of a log: its last lines are this store's figures. A failure to ship
        # logs is reported, not raised: it must not hide the error that may be ending the run.
        self._log.info("s3_output_summary", retries=retry_counter.retries, **self.stats)
        with self._ship_lock:
            self._live_logs.pop(name, None)
            try:
                self._ship_log(path, name)
            except JobError as exc:
                self._log.warning("log_not_shipped", log=name, error=str(exc))

    def _ship_periodically(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            with self._ship_lock:
                for name, path in list(self._live_logs.items()):
                    try:
                        if path.stat().st_size != self._shipped.get(name):
                            self._ship_log(path, name)
                    except (JobError, OSError) as exc:
                        self._log.warning("log_not_shipped", log=name, error=str(exc))

    def _ship_log(self, path: Path, name: str) -> None:
        data = path.read_bytes()
        self._shipped[name] = len(data)
        data = data[: data.rfind(b"\n") + 1]  # whole JSON lines only
        with self._errors(f"uploading {self.location}/{name}"):
            self._client.put_object(
                Bucket=self.bucket,
                Key=self.prefix + name,
                Body=data,
                ContentType="application/x-ndjson",
                ChecksumAlgorithm="CRC64NVME",
            )

    def close(self) -> None:
        self._stop.set()
        self._shipper.join()
        self._transfer.shutdown()
        if self._own_keys:
            # A CreateMultipartUpload whose response was lost (and retried) leaves an upload nobody
            # knows the id of. Uploads to keys this run created objects at can never complete
            # (If-None-Match), so they are garbage whoever started them: abort them now rather
            # than leave them to the index's next owner.
            try:
                self._abort_uploads(self._own_keys)
            except JobError as exc:
                self._log.warning("multipart_cleanup_failed", error=str(exc))
        shutil.rmtree(self._staging_root, ignore_errors=True)


def _get_whole(client: BaseClient, **kwargs: Any) -> tuple[bytes, str]:
    """GetObject's body and ETag. botocore's retries end when the response headers arrive, so a
    body that breaks off is fetched again here."""
    for attempt in range(_READ_ATTEMPTS):
        response = client.get_object(**kwargs)
        try:
            return response["Body"].read(), response["ETag"]
        except BotoCoreError:
            if attempt + 1 == _READ_ATTEMPTS:
                raise
            time.sleep(random.uniform(0, 2**attempt))  # full jitter, like botocore's own backoff
    raise AssertionError("unreachable")


def _create_only(params: dict[str, Any], **_: Any) -> None:
    params.setdefault("IfNoneMatch", "*")


def _make_staging_dir(output: OutputSettings, index: int) -> Path:
    parent = output.staging_dir
    try:
        if parent is not None:
            Path(parent).mkdir(parents=True, exist_ok=True)
        root = Path(tempfile.mkdtemp(prefix=f"eagle3-{index_dir_name(index)}-", dir=parent))
    except OSError as exc:
        raise ConfigError(
            f"output.staging_dir: cannot create a staging directory in {parent or tempfile.gettempdir()}: "
            f"{exc.strerror}"
        ) from None
    free = shutil.disk_usage(root).free
    if free < int(output.max_staged_bytes):
        shutil.rmtree(root, ignore_errors=True)
        raise ConfigError(
            f"output.staging_dir {root.parent} has {free} bytes free, less than output.max_staged_bytes "
            f"({int(output.max_staged_bytes)}); lower max_staged_bytes or stage on a larger disk"
        )
    return root


# -- input ------------------------------------------------------------------------------------------


def list_s3_input_files(uri: str) -> list[InputFile]:
    """The .jsonl/.parquet objects at ``uri`` (one object, or every one under the prefix), sorted."""
    bucket, prefix = parse_s3_uri(uri, "data.path")
    client = make_client()
    found: list[tuple[str, str, int, str]] = []  # name, key, size, etag
    with _s3_errors("data.path", bucket, f"listing {uri}"):
        if prefix.endswith(DATA_SUFFIXES):
            try:
                head = client.head_object(Bucket=bucket, Key=prefix)
                found.append((prefix.rsplit("/", 1)[-1], prefix, int(head["ContentLength"]), head["ETag"]))
            except ClientError as exc:
                if not _is_status(exc, 404):
                    raise
        if not found:
            base = f"{prefix}/" if prefix else ""
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base):
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith(DATA_SUFFIXES):
                        found.append((obj["Key"][len(base) :], obj["Key"], int(obj["Size"]), obj["ETag"]))
    if not found:
        raise ConfigError(f"data.path: no .jsonl or .parquet objects at {uri}")
    return [
        InputFile(name, size, _opener(client, bucket, key, etag, size), f"s3://{bucket}/{key}")
        for name, key, size, etag in sorted(found)
    ]


def _opener(
    client: BaseClient, bucket: str, key: str, etag: str, size: int, setting: str = "data.path"
) -> Callable[[], IO[bytes]]:
    return lambda: io.BufferedReader(
        _ObjectReader(client, bucket, key, etag, size, setting), buffer_size=1 << 20
    )


class _ObjectReader(io.RawIOBase):
    """A seekable read-only view of one object version: ranged GETs pinned to its ETag.

    A connection that breaks mid-body is reopened at the current offset, so a long JSONL read
    survives what botocore's retries (which end when the response headers arrive) do not cover;
    seeking (Parquet reads its footer first) just starts the next GET elsewhere.
    """

    def __init__(
        self, client: BaseClient, bucket: str, key: str, etag: str, size: int, setting: str = "data.path"
    ) -> None:
        self._setting = setting  # named in errors
        self._client = client
        self._bucket = bucket
        self._key = key
        self._etag = etag
        self._size = size
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        target = max(0, base + offset)
        if target != self._pos:
            self._drop_body()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        if self._pos >= self._size or len(buffer) == 0:
            return 0
        where = f"s3://{self._bucket}/{self._key}"
        for attempt in range(_READ_ATTEMPTS):
            try:
                if self._body is None:
                    self._body = self._client.get_object(
                        Bucket=self._bucket, Key=self._key, Range=f"bytes={self._pos}-", IfMatch=self._etag
                    )["Body"]
                n = self._body.readinto(buffer)
                if n == 0:
                    raise StorageError(f"{self._setting}: {where} ended at byte {self._pos} of {self._size}")
                self._pos += n
                return n
            except ClientError as exc:
                if _is_status(exc, 412):
                    raise StorageError(
                        f"{self._setting}: {where} changed while the job was reading it"
                    ) from None
                raise _translate(exc, self._setting, self._bucket, f"reading {where}") from None
            except (BotoCoreError, StorageError) as exc:
                self._drop_body()
                if attempt + 1 == _READ_ATTEMPTS:
                    raise StorageError(f"{self._setting}: reading {where} failed: {exc}") from None
                time.sleep(random.uniform(0, 2**attempt))  # full jitter, like botocore's own backoff
        raise AssertionError("unreachable")

    def _drop_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop_body()
        super().close()
