"""The seam between the object-store policy and one object store's API.

``ObjectIndexStore`` (staging, shard numbers, manifest compare-and-swap, log shipping)
and ``ObjectShardSource`` (the read side) speak only this interface; a store is one
module ``job/storage/<scheme>.py`` whose ``connect(uri, setting, ...)`` returns an
``ObjectTransport`` (``s3.py`` is the one that exists). What a transport owns: its
client, credentials, retries, error translation, conditional writes, multipart
uploads, and proving that what it stored is what was sent (with whatever full-object
checksum the store offers; shards arrive with their CRC64NVME).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from awscrt.checksums import crc64nvme

from job.checksum import ALGORITHM, encode
from job.errors import JobError, StorageError
from job.manifest import Checksum

_CHUNK = 8 * 2**20


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    version: str  # an ETag or generation: reads pinned to it fail if the object changes


class ObjectExists(JobError):
    """A create-only write found an object at the key (written by someone else)."""


class ObjectChanged(StorageError):
    """A read pinned to an object's version found another version there (it was replaced)."""


class PreconditionFailed(JobError):
    """A conditional write found the object changed (or present) since the version given."""


class ObjectTransport(ABC):
    scheme: str  # "s3"
    bucket: str
    setting: str  # the setting the location came from, named in every error ("output.uri")

    def url(self, key: str) -> str:
        """The object's address for messages (never credentials)."""
        return f"{self.scheme}://{self.bucket}/{key}"

    @abstractmethod
    def check_access(self, prefix: str, write: bool) -> None:
        """Fail now, with a ConfigError naming the setting, if the location cannot be listed
        (or written, with ``write``): before any model loads."""

    @abstractmethod
    def list(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix``, sorted by key."""

    @abstractmethod
    def head(self, key: str) -> ObjectInfo | None:
        """One object's size and version, None if absent."""

    @abstractmethod
    def get(self, key: str) -> tuple[bytes, str] | None:
        """A small object's bytes and version (None if absent), retried until whole."""

    @abstractmethod
    def put(
        self,
        key: str,
        data: bytes | IO[bytes],
        content_type: str,
        *,
        if_version: str | None = None,
        create_only: bool = False,
    ) -> str:
        """Write a small object, returning its new version. ``if_version``: only if the object is
        still at that version; ``create_only``: only if absent. Either raises PreconditionFailed."""

    @abstractmethod
    def upload_new(self, path: Path, key: str, checksum: Checksum) -> None:
        """Upload a shard file to a key that must not exist yet (ObjectExists if it does) and prove
        the stored object has the file's size and ``checksum`` (StorageError otherwise): by the
        checksum the store records where it keeps one of that algorithm, else by reading it back
        (``checksum_by_reading``). A retried upload that finds its own earlier, complete attempt
        succeeds."""

    @abstractmethod
    def stored_checksum(self, key: str, algorithm: str) -> tuple[str | None, int] | None:
        """The full-object checksum of ``algorithm`` (``job.checksum.ALGORITHM``) the store
        recorded for ``key`` (None if it keeps none of that algorithm) and the object's size; None
        if the object is absent. One metadata request, no data read."""

    def checksum_by_reading(self, info: ObjectInfo, algorithm: str) -> str:
        """The checksum of ``algorithm`` of that version of the object, computed by reading it
        (for a store that records none)."""
        if algorithm != ALGORITHM:
            raise StorageError(f"{self.url(info.key)}: no reader for checksum algorithm {algorithm!r}")
        crc, buffer = 0, bytearray(_CHUNK)
        with self.open_reader(info) as reader:
            while n := reader.readinto(buffer):
                crc = crc64nvme(memoryview(buffer)[:n], crc)
        return encode(crc)

    @abstractmethod
    def open_reader(self, info: ObjectInfo) -> IO[bytes]:
        """A seekable, buffered reader of exactly that version of the object."""

    @abstractmethod
    def read_range(self, info: ObjectInfo, start: int, into: memoryview) -> None:
        """Fill ``into`` with exactly that version's bytes from offset ``start`` (StorageError if the
        object changed or is gone), retried as every read is, from where a broken body stopped."""

    @abstractmethod
    def delete(self, key: str) -> None:
        """Remove an object (absent already: nothing to do)."""

    @abstractmethod
    def abort_uploads(self, prefix: str, only_keys: set[str] | None = None) -> int:
        """Abort unfinished multipart uploads under ``prefix`` (or to ``only_keys``); how many."""

    @property
    @abstractmethod
    def retries(self) -> int:
        """Requests retried so far (a figure for the logs)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections and threads."""
