"""The storage seam: one work index's slice of the output.

Layout under ``output.uri`` (pinned): ``index-{i:05d}/shard-{k:05d}.safetensors``,
``index-{i:05d}/manifest.json``, ``index-{i:05d}/rejected.jsonl``,
``index-{i:05d}/logs/{run_id}.jsonl``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path

MANIFEST = "manifest.json"
REJECTED = "rejected.jsonl"
LOGS = "logs"


def index_dir_name(index: int) -> str:
    return f"index-{index:05d}"


@dataclass(frozen=True)
class CommittedShard:
    name: str
    bytes: int
    checksum: str  # base64 CRC64NVME, verified against what storage holds


class IndexStore(ABC):
    """One index's output. Implementations must make ``commit_shard`` and
    ``write_manifest`` atomic: an object is either complete or absent."""

    index: int
    location: str  # human-readable, for messages (never holds credentials)
    # True where the staged shard file becomes the output itself (a local directory):
    # rows may go to it with direct I/O, and commit_shard makes it durable. False where
    # staging is transient (uploaded, then deleted): the page cache serves it best.
    staging_is_output: bool = True

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
    def shard_staging_path(self, name: str) -> Path:
        """Local path where the writer builds shard ``name`` before commit."""

    @abstractmethod
    def commit_shard(self, path: Path, name: str, checksum: str) -> CommittedShard:
        """Publish a finished shard under ``name`` (never overwriting one), durably."""

    @abstractmethod
    def discard(self, name: str) -> None:
        """Remove an object that no manifest lists, where the store allows it."""

    @abstractmethod
    def put_file(self, path: Path, name: str) -> None:
        """Publish a small local file (rejected.jsonl, logs) under ``name``, replacing it."""

    @abstractmethod
    def local_path(self, name: str) -> Path:
        """A local, writable path for a small file that will be published with put_file."""

    def reserve_staging(self, name: str, nbytes: int, timeout_s: float | None = None) -> bool:
        """Reserve ``nbytes`` of local staging space for shard ``name``, waiting at most
        ``timeout_s`` (None: as long as it takes); False if it is not free by then. Only
        bounded stores ever wait. ``commit_shard(..., name, ...)`` gives the space back; so
        does ``release_staging``."""
        return True

    def release_staging(self, name: str) -> None:  # noqa: B027 - optional hook
        """Give back the staging space of shard ``name``, which will not be committed."""

    def drain(self) -> None:  # noqa: B027 - optional hook
        """Wait for background work (uploads) to finish."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release locks and background resources."""
