"""A local directory (a path or file:// URI): output store and shard source."""

from __future__ import annotations

import contextlib
import fcntl
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from job.checksum import crc64nvme_file
from job.errors import ConfigError, DamagedShard
from job.layout import EXTRACTION, MANIFEST, PARTIAL, index_dir_name
from job.manifest import StoredFile
from job.storage.base import CommittedShard, IndexStore, ShardSource, SourceIndex
from job.storage.staging import StagedShard, StagingArea


def local_root(uri: str) -> Path:
    return Path(uri.removeprefix("file://")).expanduser()


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class LocalIndexStore(IndexStore):
    """Shards are built in the index directory under a temporary name and renamed on commit."""

    def __init__(self, directory: Path, index: int, lock: IO[str]) -> None:
        self.index = index
        self.directory = directory
        self.location = str(directory)
        self.staging = StagingArea(directory, limit=None)
        self._lock = lock

    @classmethod
    def open(cls, uri: str, index: int) -> LocalIndexStore:
        directory = local_root(uri) / index_dir_name(index)
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

    def read_output_claim(self) -> bytes | None:
        try:
            return (self.directory.parent / EXTRACTION).read_bytes()
        except FileNotFoundError:
            return None

    def claim_output(self, data: bytes) -> bytes:
        target = self.directory.parent / EXTRACTION
        with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f".{EXTRACTION}.", delete=False) as tmp:
            tmp.write(data)
            tmp.flush()
            os.fsync(tmp.fileno())
        try:
            os.link(tmp.name, target)  # create-only, and never seen half written
            _fsync_dir(target.parent)
            return data
        except FileExistsError:
            return target.read_bytes()
        finally:
            os.unlink(tmp.name)

    def commit_shard(self, staged: StagedShard, checksum: str) -> CommittedShard:
        try:
            final = self.directory / staged.name
            if final.exists():
                raise FileExistsError(f"{final} exists; shards are never overwritten")
            with staged.path.open("rb+") as f:
                os.fsync(f.fileno())
            os.replace(staged.path, final)
            _fsync_dir(self.directory)
            return CommittedShard(staged.name, final.stat().st_size, checksum)
        finally:
            staged.discard()

    def commit_file(self, path: Path, name: str, checksum: str) -> None:
        final = self.directory / name
        if final.exists():
            raise FileExistsError(f"{final} exists; committed files are never overwritten")
        with path.open("rb+") as f:
            os.fsync(f.fileno())
        os.replace(path, final)
        _fsync_dir(self.directory)

    def check_committed(self, entry: StoredFile, checksum: bool) -> None:
        check_local_file(self.directory / entry.name, entry, checksum)

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
        # A run that wrote nothing (refused at resume) leaves no index directory: readers would
        # take it for an index of the output that has committed nothing yet.
        if [p.name for p in self.directory.iterdir()] == [".lock"]:
            (self.directory / ".lock").unlink()
            with contextlib.suppress(OSError):  # another run has just created its own lock there
                self.directory.rmdir()
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


class LocalShardSource(ShardSource):
    def __init__(self, root: Path, verify: bool, setting: str) -> None:
        if not root.exists():
            raise ConfigError(f"{setting} {root}: does not exist")
        if not root.is_dir():
            raise ConfigError(f"{setting} {root}: not a directory (give an output directory or one index-*)")
        self.location = str(root)
        self.verify = verify
        dirs = sorted(d for d in root.glob("index-*") if d.is_dir())
        self.single_index = not dirs and (root / MANIFEST).is_file()
        if not dirs and not self.single_index:
            raise ConfigError(f"{setting} {root}: holds no index-* directories and no {MANIFEST}")
        self._dirs = {root.name: root} if self.single_index else {d.name: d for d in dirs}

    def indexes(self) -> list[SourceIndex]:
        found = []
        for name, directory in self._dirs.items():
            path = directory / MANIFEST
            found.append(SourceIndex.parse(name, path.read_bytes() if path.is_file() else None, str(path)))
        return found

    def _listed(self, index: str, entry: StoredFile) -> Path:
        path = self._dirs[index] / entry.name
        if not path.is_file():
            raise DamagedShard(f"{path}: listed in {index}/{MANIFEST} but missing")
        return path

    def open_stream(self, index: str, entry: StoredFile) -> IO[bytes]:
        return self._listed(index, entry).open("rb")

    def check(self, index: str, entry: StoredFile, checksum: bool = True) -> None:
        check_local_file(self._listed(index, entry), entry, checksum)

    @contextmanager
    def fetch(self, index: str, entry: StoredFile) -> Iterator[Path]:
        path = self._listed(index, entry)
        if self.verify:
            check_local_file(path, entry, checksum=True)
        yield path


def check_local_file(path: Path, entry: StoredFile, checksum: bool) -> None:
    """DamagedShard unless ``path`` has the manifest entry's size (and CRC64NVME)."""
    size = path.stat().st_size if path.is_file() else None
    if size is None:
        raise DamagedShard(f"{path}: listed in the manifest but missing")
    if size != entry.bytes:
        raise DamagedShard(
            f"{path}: {size} bytes, but the manifest lists {entry.bytes}; the {entry.described_as} is damaged"
        )
    if checksum and (actual := crc64nvme_file(path)) != entry.checksum.value:
        raise DamagedShard(
            f"{path}: checksum {actual} differs from the manifest's {entry.checksum.value}; "
            f"the {entry.described_as} is damaged"
        )
