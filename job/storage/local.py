"""Local directory output (a path or file:// URI)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path
from typing import IO

from job.errors import ConfigError
from job.storage.base import MANIFEST, CommittedShard, IndexStore, index_dir_name

PARTIAL = ".partial"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalIndexStore(IndexStore):
    def __init__(self, directory: Path, index: int, lock: IO[str]) -> None:
        self.index = index
        self.directory = directory
        self.location = str(directory)
        self._lock = lock

    @classmethod
    def open(cls, uri: str, index: int) -> LocalIndexStore:
        root = Path(uri.removeprefix("file://")).expanduser()
        directory = root / index_dir_name(index)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            probe = directory / ".write-test"
            probe.write_bytes(b"")
            probe.unlink()
            lock = (directory / ".lock").open("w")
        except OSError as exc:
            raise ConfigError(f"output.uri: cannot write to {directory}: {exc.strerror}") from None
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            lock.close()
            raise ConfigError(
                f"output.uri: another run holds {directory}/.lock; two runs must not share an index"
            ) from None
        return cls(directory, index, lock)

    def list_names(self) -> list[str]:
        return sorted(
            p.relative_to(self.directory).as_posix()
            for p in self.directory.rglob("*")
            if p.is_file() and p.name != ".lock"
        )

    def read_manifest(self) -> tuple[bytes | None, str | None]:
        try:
            return (self.directory / MANIFEST).read_bytes(), None
        except FileNotFoundError:
            return None, None

    def write_manifest(self, data: bytes, version: str | None) -> str | None:
        self._write_atomic(self.directory / MANIFEST, data)
        return None

    def shard_staging_path(self, name: str) -> Path:
        return self.directory / (name + PARTIAL)

    def commit_shard(self, path: Path, name: str, checksum: str) -> CommittedShard:
        final = self.directory / name
        if final.exists():
            raise FileExistsError(f"{final} exists; shards are never overwritten")
        with path.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(path, final)
        _fsync_dir(self.directory)
        return CommittedShard(name, final.stat().st_size, checksum)

    def discard(self, name: str) -> None:
        (self.directory / name).unlink(missing_ok=True)

    def put_file(self, path: Path, name: str) -> None:
        target = self.directory / name
        if path != target:
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(path, target)
        _fsync_dir(target.parent)

    def local_path(self, name: str) -> Path:
        path = self.directory / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def close(self) -> None:
        self._lock.close()

    @staticmethod
    def _write_atomic(target: Path, data: bytes) -> None:
        tmp = target.with_name(target.name + PARTIAL)
        with tmp.open("wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)
        _fsync_dir(target.parent)
