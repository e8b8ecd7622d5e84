"""The S3 transport (``s3://bucket/prefix``), for the output, the input and export sources.

- Credentials come only from boto3's default chain (environment, web identity, instance
  profile); ``AWS_ENDPOINT_URL`` / ``AWS_ENDPOINT_URL_S3`` point it at S3-compatible stores.
  Error messages carry the operation and S3's error code, never a response body.
- Shards go up through s3transfer (multipart above ``part_size``) with their full-object
  CRC64NVME, which S3 verifies on completion; PutObject and CompleteMultipartUpload carry
  ``If-None-Match: *``, so a shard key is never overwritten, and the checksum S3 then
  reports must equal the local one.
- Small objects (manifest, logs, rejected.jsonl) are single PUTs, conditional where asked
  (``If-Match`` on an ETag, ``If-None-Match: *`` to create).
- Reads are pinned to the listed ETag; a body that breaks off is fetched again from where
  it stopped (botocore's retries end when the response headers arrive). Ranged reads go from
  the socket straight into the caller's buffer (``read_range``).
"""

from __future__ import annotations

import contextlib
import functools
import http.client
import io
import os
import random
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO, Any, TypeVar

import boto3
import botocore.loaders
import urllib3.exceptions
from botocore.client import BaseClient
from botocore.config import Config
from botocore.exceptions import (
    BotoCoreError,
    ClientError,
    IncompleteReadError,
    NoCredentialsError,
    PartialCredentialsError,
    ResponseStreamingError,
)
from s3transfer.manager import TransferConfig, TransferManager

from job.errors import ConfigError, JobError, StorageError
from job.manifest import Checksum
from job.storage.transport import ObjectChanged, ObjectExists, ObjectInfo, ObjectTransport, PreconditionFailed

# Defaults for botocore's retry policy, used unless AWS_RETRY_MODE / AWS_MAX_ATTEMPTS (or the
# shared config file) say otherwise. "standard" retries 5xx, SlowDown/throttling and connection
# errors with exponential backoff and full jitter.
RETRY_MODE = "standard"
MAX_ATTEMPTS = 10
# botocore retries what fails before a response arrives, and 5xx/throttling answers; a connection
# that breaks while it reads a response body (a truncated error body, a GET cut short) escapes it,
# as urllib3/http.client errors or these: such calls are made again here, this many times.
_ATTEMPTS = 5
_BROKEN_RESPONSE = (
    urllib3.exceptions.HTTPError,
    http.client.HTTPException,
    ConnectionError,
    ResponseStreamingError,
    IncompleteReadError,
)
_T = TypeVar("_T")
# The full-object checksums S3 records, by the algorithm's name in our manifests (job.checksum).
_CHECKSUM_HEADERS = {"crc64nvme": "ChecksumCRC64NVME"}
DEFAULT_PART_SIZE = 64 * 1024**2
WRITE_PROBE = ".write-probe-"  # the start-up check's multipart uploads: their keys' start under the index
_CREDENTIAL_ERRORS = {
    "InvalidAccessKeyId",
    "SignatureDoesNotMatch",
    "ExpiredToken",
    "InvalidToken",
    "TokenRefreshRequired",
    "AuthorizationHeaderMalformed",
}


def connect(
    uri: str,
    setting: str,
    *,
    upload_threads: int = 8,
    part_size: int = DEFAULT_PART_SIZE,
    sign_payload: bool = True,
    read_threads: int = 8,
) -> tuple[S3Transport, str]:
    """The transport for ``s3://bucket/prefix`` and the prefix (no leading or trailing ``/``);
    ``read_threads``: ranged reads made at once (job.shards.access), each needs a connection."""
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    if not bucket:
        raise ConfigError(f"{setting}: {uri!r} names no bucket; use s3://bucket/prefix")
    transport = S3Transport(
        bucket,
        setting,
        upload_threads=upload_threads,
        part_size=part_size,
        sign_payload=sign_payload,
        read_threads=read_threads,
    )
    return transport, prefix.strip("/")


class _RetryCounter:
    """Retries botocore made across a transport's clients."""

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


@functools.cache
def _model_loader() -> Any:
    """One botocore data loader per process: a new session parses botocore's S3 model again (0.7 s
    a transport here, paid by every reader and every DataLoader worker), the loader keeps it.
    Sessions stay per client, so each resolves credentials and endpoint as it is created."""
    return botocore.loaders.create_loader()


def _make_client(counter: _RetryCounter, max_connections: int, sign_payload: bool = True) -> BaseClient:
    retries: dict[str, Any] = {}
    if not os.environ.get("AWS_RETRY_MODE"):
        retries["mode"] = RETRY_MODE
    if not os.environ.get("AWS_MAX_ATTEMPTS"):
        retries["max_attempts"] = MAX_ATTEMPTS
    # payload_signing_enabled=False: UNSIGNED-PAYLOAD over http:// too (botocore signs bodies
    # there by default); what botocore sends over https is the same either way.
    s3 = None if sign_payload else {"payload_signing_enabled": False}
    config = Config(retries=retries, max_pool_connections=max_connections, s3=s3)  # type: ignore[arg-type]
    session = boto3.session.Session()
    session._session.register_component("data_loader", _model_loader())
    client = session.client("s3", config=config)
    client.meta.events.register("after-call.s3", counter.after_call)
    client.meta.events.register("after-call-error.s3", counter.after_call_error)
    return client


def _code(exc: ClientError) -> tuple[str, int]:
    return (
        str(exc.response.get("Error", {}).get("Code", "")),
        int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)),
    )


def _is_status(exc: ClientError, *statuses: int) -> bool:
    return _code(exc)[1] in statuses


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
                "s3:ListBucket, s3:ListBucketMultipartUploads, s3:GetObject, s3:PutObject, "
                "s3:AbortMultipartUpload and (for the preflight's probe) s3:DeleteObject on the prefix"
            )
        return StorageError(f"{setting}: {action} failed: {code or 'error'} (HTTP {status})")
    return StorageError(f"{setting}: {action} failed: {type(exc).__name__}: {exc}")


def _create_only(params: dict[str, Any], **_: Any) -> None:
    params.setdefault("IfNoneMatch", "*")


def _backoff(attempt: int) -> None:
    time.sleep(random.uniform(0, 2**attempt))  # full jitter, like botocore's own backoff


class S3Transport(ObjectTransport):
    scheme = "s3"

    def __init__(
        self,
        bucket: str,
        setting: str,
        *,
        upload_threads: int,
        part_size: int,
        sign_payload: bool = True,
        read_threads: int = 8,
    ) -> None:
        self.bucket = bucket
        self.setting = setting
        self._counter = _RetryCounter()
        self._client = _make_client(self._counter, max(10, read_threads + 2))
        # Every object the shard client creates is create-only: s3transfer has no If-None-Match
        # argument, so it is added to the two requests that create objects.
        self._shard_client = _make_client(self._counter, upload_threads + 4, sign_payload)
        for operation in ("PutObject", "CompleteMultipartUpload"):
            self._shard_client.meta.events.register(f"before-parameter-build.s3.{operation}", _create_only)
        transfer = TransferConfig(
            multipart_threshold=part_size,
            multipart_chunksize=part_size,
            max_request_concurrency=upload_threads,
        )
        self._transfer = TransferManager(self._shard_client, transfer)

    @contextlib.contextmanager
    def _errors(self, action: str) -> Iterator[None]:
        try:
            yield
        except (ClientError, BotoCoreError) as exc:
            raise _translate(exc, self.setting, self.bucket, action) from None

    def _retrying(self, action: str, call: Callable[[], _T]) -> _T:
        """``call()`` with S3's errors translated, made again when its response broke off."""
        broken: Exception | None = None
        for attempt in range(_ATTEMPTS):
            with self._errors(action):
                try:
                    return call()
                except _BROKEN_RESPONSE as exc:
                    broken = exc
            _backoff(attempt)
        raise StorageError(
            f"{self.setting}: {action} failed: the response broke off {_ATTEMPTS} times "
            f"({type(broken).__name__}: {broken})"
        )

    @property
    def retries(self) -> int:
        return self._counter.retries

    def check_access(self, prefix: str, write: bool) -> None:
        where = self.url(prefix)
        self._retrying(
            f"listing {where}",
            lambda: self._client.list_objects_v2(Bucket=self.bucket, Prefix=prefix, MaxKeys=1),
        )
        if not write:
            return
        # The new owner's clean-up needs it (s3:ListBucketMultipartUploads).
        self._retrying(
            f"listing uploads under {where}",
            lambda: self._client.list_multipart_uploads(Bucket=self.bucket, Prefix=prefix, MaxUploads=1),
        )
        # Creating and aborting a multipart upload proves s3:PutObject and s3:AbortMultipartUpload
        # without creating an object. Every probe upload under the prefix is aborted: this one (a
        # create whose response was lost and retried leaves a second upload to its key) and any a
        # run killed between its create and its abort left, whatever the index's state (the first
        # manifest write's clean-up never comes for a complete index). Another run's probe aborted
        # under its feet is harmless: it has proven its access by creating it.
        probes = f"{prefix}{WRITE_PROBE}"
        probe = f"{probes}{secrets.token_hex(4)}"
        self._retrying(
            f"writing under {where}",
            lambda: self._client.create_multipart_upload(Bucket=self.bucket, Key=probe),
        )
        self.abort_uploads(probes)

    def list(self, prefix: str) -> list[ObjectInfo]:
        def pages() -> list[ObjectInfo]:
            found = []
            for page in self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=prefix
            ):
                found.extend(
                    ObjectInfo(obj["Key"], int(obj["Size"]), obj["ETag"]) for obj in page.get("Contents", [])
                )
            return found

        return sorted(self._retrying(f"listing {self.url(prefix)}", pages), key=lambda info: info.key)

    def head(self, key: str) -> ObjectInfo | None:
        def call() -> ObjectInfo | None:
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _is_status(exc, 404) and _code(exc)[0] != "NoSuchBucket":
                    return None
                raise
            return ObjectInfo(key, int(head["ContentLength"]), head["ETag"])

        return self._retrying(f"reading {self.url(key)}", call)

    def get(self, key: str) -> tuple[bytes, str] | None:
        def call() -> tuple[bytes, str] | None:
            try:
                response = self._client.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _is_status(exc, 404) and _code(exc)[0] != "NoSuchBucket":
                    return None
                raise
            return response["Body"].read(), response["ETag"]

        return self._retrying(f"reading {self.url(key)}", call)

    def put(
        self,
        key: str,
        data: bytes | IO[bytes],
        content_type: str,
        *,
        if_version: str | None = None,
        create_only: bool = False,
    ) -> str:
        condition = {"IfMatch": if_version} if if_version else {"IfNoneMatch": "*"} if create_only else {}

        def call() -> str:
            if not isinstance(data, bytes):
                data.seek(0)  # a retry sends the whole file again
            try:
                return self._client.put_object(
                    Bucket=self.bucket,
                    Key=key,
                    Body=data,
                    ContentType=content_type,
                    ChecksumAlgorithm="CRC64NVME",
                    **condition,
                )["ETag"]
            except ClientError as exc:
                if condition and _is_status(exc, 409, 412):
                    raise PreconditionFailed(f"{self.url(key)} changed since version {if_version}") from None
                raise

        return self._retrying(f"writing {self.url(key)}", call)

    def upload_new(self, path: Path, key: str, checksum: Checksum) -> None:
        size = path.stat().st_size
        header = _CHECKSUM_HEADERS.get(checksum.algorithm)
        # Giving the full-object checksum makes s3transfer create the multipart upload with
        # ChecksumType FULL_OBJECT and pass it to CompleteMultipartUpload, where S3 checks it.
        extra = {} if header is None else {header: checksum.value}

        def call() -> None:
            try:
                self._transfer.upload(str(path), self.bucket, key, extra_args=extra).result()
            except ClientError as exc:
                # 412: the key exists. NoSuchUpload: the upload was completed already. Either can be
                # this very upload whose successful completion was retried after a lost response.
                if not (_is_status(exc, 412) or _code(exc)[0] == "NoSuchUpload"):
                    raise
                if self._proven(key, checksum) != (checksum.value, size):
                    raise ObjectExists(f"{self.url(key)} exists (written by another writer)") from None

        self._retrying(f"uploading {self.url(key)}", call)
        stored = self._proven(key, checksum)
        if stored != (checksum.value, size):
            raise StorageError(
                f"{self.url(key)}: S3 holds {stored[1]} bytes with {checksum.algorithm} {stored[0]}, "
                f"but the local shard has {size} bytes with {checksum.value}; it is not listed"
            )

    def _proven(self, key: str, checksum: Checksum) -> tuple[str | None, int]:
        """What the store holds at ``key``: its checksum (read back where it records none) and size."""
        stored = self.stored_checksum(key, checksum.algorithm)
        if stored is None:
            return None, 0
        if stored[0] is None and (info := self.head(key)) is not None:
            return self.checksum_by_reading(info, checksum.algorithm), info.size
        return stored

    def stored_checksum(self, key: str, algorithm: str) -> tuple[str | None, int] | None:
        header = _CHECKSUM_HEADERS.get(algorithm)

        def call() -> tuple[str | None, int] | None:
            try:
                head = self._client.head_object(Bucket=self.bucket, Key=key, ChecksumMode="ENABLED")
            except ClientError as exc:
                if _is_status(exc, 404) and _code(exc)[0] != "NoSuchBucket":
                    return None
                raise
            return (None if header is None else head.get(header)), int(head["ContentLength"])

        return self._retrying(f"verifying {self.url(key)}", call)

    def open_reader(self, info: ObjectInfo) -> IO[bytes]:
        return io.BufferedReader(_ObjectReader(self, info), buffer_size=1 << 20)

    def read_range(self, info: ObjectInfo, start: int, into: memoryview) -> None:
        where, done = self.url(info.key), 0
        for attempt in range(_ATTEMPTS):
            try:
                body = self._client.get_object(
                    Bucket=self.bucket,
                    Key=info.key,
                    Range=f"bytes={start + done}-{start + len(into) - 1}",
                    IfMatch=info.version,
                )["Body"]
                read, finish = _direct_reader(body)
                try:
                    while done < len(into):
                        n = read(into[done:])
                        if n == 0:
                            raise StorageError(f"{where} ended at byte {start + done} of {info.size}")
                        done += n
                except BaseException:
                    body.close()  # a broken body's connection is not reused
                    raise
                finish()
                return
            except ClientError as exc:
                if _is_status(exc, 412, 404):
                    raise StorageError(
                        f"{self.setting}: {where} changed or was removed since it was listed"
                    ) from None
                raise _translate(exc, self.setting, self.bucket, f"reading {where}") from None
            # OSError: a socket's timeout or reset, read past urllib3 (which would wrap it)
            except (*_BROKEN_RESPONSE, BotoCoreError, StorageError, OSError) as exc:
                if attempt + 1 == _ATTEMPTS:
                    raise StorageError(f"{self.setting}: reading {where} failed: {exc}") from None
                _backoff(attempt)
        raise AssertionError("unreachable")

    def delete(self, key: str) -> None:
        self._retrying(
            f"deleting {self.url(key)}", lambda: self._client.delete_object(Bucket=self.bucket, Key=key)
        )

    def abort_uploads(self, prefix: str, only_keys: set[str] | None = None) -> int:
        def call() -> int:
            aborted = 0
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=prefix
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
            return aborted

        return self._retrying(f"cleaning up multipart uploads under {self.url(prefix)}", call)

    def close(self) -> None:
        self._transfer.shutdown()


class _ObjectReader(io.RawIOBase):
    """A seekable read-only view of one object version: ranged GETs pinned to its ETag.

    A connection that breaks mid-body is reopened at the current offset, so a long JSONL read
    survives what botocore's retries (which end when the response headers arrive) do not cover;
    seeking (Parquet reads its footer first) just starts the next GET elsewhere.
    """

    def __init__(self, transport: S3Transport, info: ObjectInfo) -> None:
        self._transport = transport
        self._info = info
        self._pos = 0
        self._body: Any = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._info.size}[whence]
        target = max(0, base + offset)
        if target != self._pos:
            self._drop_body()
            self._pos = target
        return self._pos

    def readinto(self, buffer: Any) -> int:
        info, transport = self._info, self._transport
        if self._pos >= info.size or len(buffer) == 0:
            return 0
        where, setting = transport.url(info.key), transport.setting
        for attempt in range(_ATTEMPTS):
            try:
                if self._body is None:
                    self._body = transport._client.get_object(
                        Bucket=transport.bucket,
                        Key=info.key,
                        Range=f"bytes={self._pos}-",
                        IfMatch=info.version,
                    )["Body"]
                n = self._body.readinto(buffer)
                if n == 0:
                    raise StorageError(f"{setting}: {where} ended at byte {self._pos} of {info.size}")
                self._pos += n
                return n
            except ClientError as exc:
                if _is_status(exc, 412):
                    raise ObjectChanged(f"{setting}: {where} changed while the job was reading it") from None
                raise _translate(exc, setting, transport.bucket, f"reading {where}") from None
            except (*_BROKEN_RESPONSE, BotoCoreError, StorageError) as exc:
                self._drop_body()
                if attempt + 1 == _ATTEMPTS:
                    raise StorageError(f"{setting}: reading {where} failed: {exc}") from None
                _backoff(attempt)
        raise AssertionError("unreachable")

    def _drop_body(self) -> None:
        if self._body is not None:
            self._body.close()
            self._body = None

    def close(self) -> None:
        self._drop_body()
        super().close()


def _direct_reader(body: Any) -> tuple[Callable[[memoryview], int], Callable[[], None]]:
    """A ranged GET's body read straight into the caller's buffer, and what to call once every
    byte asked for was read. urllib3's ``readinto`` reads into a new buffer, makes ``bytes`` of
    it and copies those over: three passes over memory where one does (2 GiB read by
    OutputDataset: 1.0 s of user time, 0.7 s without them). http.client's response under it
    (urllib3's ``_fp``) reads into the given buffer, and counts the length and chunks as it
    does for urllib3; without one, botocore's body is read as before."""

    raw = getattr(body, "_raw_stream", None)
    response = getattr(raw, "_fp", None)
    if not isinstance(response, http.client.HTTPResponse):
        # read to its end, botocore's body returns its connection to the pool by itself
        return body.readinto, lambda: None

    def finish() -> None:
        if response.isclosed():  # the whole response was read: its connection serves the next
            raw.release_conn()
        else:  # more bytes than asked for (a store ignoring the range): the connection is dropped
            body.close()

    return response.readinto, finish
