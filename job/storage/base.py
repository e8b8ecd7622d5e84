"""The storage seam, both ways.

Write side: ``IndexStore``, one work index's slice of the output (layout names in
``job.layout``). Read side: ``ShardSource``, the committed shards of an output for
``export`` and readers. Stores deal in bytes and files; what a shard holds is the
``job.shards`` package's business.
"""

from __future__ import annotations

import hashlib
from abc import ABC, abstractmethod
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from job.manifest import Manifest, StoredFile
from job.storage.staging import StagedShard, StagingArea


@dataclass(frozen=True)
class CommittedShard:
    name: str
    bytes: int
    checksum: str  # base64 CRC64NVME, verified against what storage holds


class IndexStore(ABC):
    """One index's output. ``commit_shard`` and ``write_manifest`` are atomic: an object is
    either complete or absent."""

    index: int
    location: str  # human-readable, for messages (never holds credentials)
    staging: StagingArea  # where shards are built before commit_shard; reserve() waits for space
    # True where the staged shard file becomes the output itself (a local directory):
    # rows may go to it with direct I/O, and commit_shard makes it durable. False where
    # staging is transient (uploaded, then deleted): the page cache serves it best.
    staging_is_output: bool = True

    def __enter__(self) -> IndexStore:
        return self

    def __exit__(self, *_exc: object) -> None:
        self.close()

    @abstractmethod
    def list_names(self) -> list[str]:
        """Names (relative to the index directory) of every object present."""

    @abstractmethod
    def read_manifest(self) -> tuple[bytes | None, str | None]:
        """The manifest's bytes and a version token for write_manifest (None if absent)."""

    @abstractmethod
    def write_manifest(self, data: bytes, version: str | None) -> str | None:
        """Replace the manifest if it is still at ``version``; return the new version."""

    @abstractmethod
    def read_output_claim(self) -> bytes | None:
        """What the output's ``EXTRACTION`` file holds; None while no index has committed anything."""

    @abstractmethod
    def claim_output(self, data: bytes) -> bytes:
        """Write ``data`` as the output's ``EXTRACTION`` file (beside the index directories) unless
        one exists, atomically and create-only; return what the file holds."""

    @abstractmethod
    def commit_shard(self, staged: StagedShard, checksum: str) -> CommittedShard:
        """Publish a finished shard (never overwriting one), durably; the staged shard is
        discarded (its space given back) whether or not this succeeds."""

    @abstractmethod
    def commit_file(self, path: Path, name: str, checksum: str) -> None:
        """Publish finished local file ``path`` (a shard's sidecar) as new object ``name``, durably,
        with the store proving its checksum where it can; ``path`` is gone afterwards."""

    @abstractmethod
    def check_committed(self, entry: StoredFile, checksum: bool) -> None:
        """Raise DamagedShard unless committed file ``entry`` is present with the manifest's size
        and, with ``checksum``, its CRC64NVME (local: the file is read; object stores: the
        checksum the store recorded is asked for)."""

    @abstractmethod
    def discard(self, name: str) -> None:
        """Remove an object that no manifest lists, where the store allows it."""

    @abstractmethod
    def put_file(self, path: Path, name: str) -> None:
        """Publish a small local file (rejected.jsonl, logs) under ``name``, replacing it."""

    @abstractmethod
    def local_path(self, name: str) -> Path:
        """A local, writable path for a small file that will be published with put_file."""

    def drain(self) -> None:  # noqa: B027 - optional hook
        """Wait for background work (uploads) to finish."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release locks and background resources."""


@dataclass(frozen=True)
class SourceIndex:
    name: str  # index-00000, or the directory's name when the source is one index directory
    manifest: Manifest | None  # None: the index has committed nothing
    manifest_sha256: str | None

    @classmethod
    def parse(cls, name: str, data: bytes | None, where: str) -> SourceIndex:
        if data is None:
            return cls(name, None, None)
        return cls(name, Manifest.from_bytes(data, where), hashlib.sha256(data).hexdigest())


class ShardSource(ABC):
    """Where readers (``export``) find committed shards: a local output or an object-store prefix."""

    location: str
    single_index: bool  # the source is one index directory rather than an output directory

    @abstractmethod
    def indexes(self) -> list[SourceIndex]:
        """Every index present, in index order."""

    @abstractmethod
    def open_stream(self, index: str, entry: StoredFile) -> IO[bytes]:
        """A seekable reader of shard ``entry`` as stored (enough to read its header)."""

    @abstractmethod
    def fetch(self, index: str, entry: StoredFile) -> AbstractContextManager[Path]:
        """A local file holding shard ``entry``, checked against the manifest's checksum where the
        source verifies, for as long as the context lasts."""

    @abstractmethod
    def check(self, index: str, entry: StoredFile, checksum: bool = True) -> None:
        """Raise DamagedShard (naming the shard and what is wrong) unless shard ``entry`` is present
        with the manifest's size and, with ``checksum``, its CRC64NVME."""
