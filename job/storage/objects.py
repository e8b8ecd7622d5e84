"""Output and shard source on an object store, over any ``ObjectTransport``.

The layout under ``prefix/`` is the local store's. What makes it safe to retry and to resume:

- A shard is built in a bounded local staging area (``output.max_staged_bytes``), then
  uploaded create-only and proven equal to the local file before it goes.
- The manifest is replaced by compare-and-swap on the version this run last saw (created
  only-if-absent). A conflict means another run (a Kubernetes retry overlap) has taken the
  index over: this run stops with exit 3 and lists nothing more.
- Objects no manifest lists (left by a killed run, or by a run that lost the index) are never
  read, overwritten or deleted; new shards take numbers above every existing key.
- ``logs/*.jsonl`` files handed out by ``local_path`` are uploaded every ``log_interval_s``
  while the run goes on, and once more by ``put_file`` at its end.
"""

from __future__ import annotations

import fcntl
import shutil
import tempfile
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from awscrt.checksums import crc64nvme

from job.checksum import ALGORITHM, encode
from job.errors import (
    ConfigError,
    DamagedShard,
    JobError,
    OutOfSpace,
    StorageError,
    Superseded,
    is_out_of_space,
)
from job.layout import EXTRACTION, MANIFEST, index_dir_name, is_log, shard_name, shard_number
from job.logs import get_logger
from job.manifest import Checksum, StoredFile
from job.storage.base import CommittedShard, IndexStore, ShardSource, SourceIndex
from job.storage.staging import StagedShard, StagingArea
from job.storage.transport import ObjectExists, ObjectInfo, ObjectTransport, PreconditionFailed

if TYPE_CHECKING:
    from job.settings import OutputSettings

LOG_SHIP_INTERVAL_S = 30.0
# A shard whose planned key another writer took meanwhile is re-keyed; more conflicts than this
# in a row mean something keeps writing into this index.
_MAX_KEY_CONFLICTS = 5
_CHUNK = 8 * 1024 * 1024


class ObjectIndexStore(IndexStore):
    staging_is_output = False  # shards are uploaded from staging, then deleted

    def __init__(
        self, transport: ObjectTransport, root: str, output: OutputSettings, index: int, log_interval_s: float
    ) -> None:
        self.index = index
        self.transport = transport
        self._root_prefix = f"{root}/" if root else ""
        self.prefix = f"{self._root_prefix}{index_dir_name(index)}/"
        self.location = transport.url(self.prefix.rstrip("/"))
        self._log = get_logger(work_index=index, output=self.location)
        self._staging_root, self._staging_lock = _make_staging_dir(output, index, self._log)
        self._files_dir = self._staging_root / "files"
        (self._staging_root / "shards").mkdir()
        self._files_dir.mkdir()
        self.staging = StagingArea(
            self._staging_root / "shards", int(output.max_staged_bytes), "output.max_staged_bytes"
        )
        self._taken: set[int] = set()  # shard numbers seen under the prefix or claimed by this run
        self._taken_lock = threading.Lock()
        self._owner = False  # this run has written the manifest at least once
        self._own_keys: set[str] = set()  # keys this run created objects at
        self.stats = {
            "shards_uploaded": 0,
            "bytes_uploaded": 0,
            "key_conflicts": 0,
            "stale_uploads_aborted": 0,
        }
        self._live_logs: dict[str, Path] = {}
        self._shipped: dict[str, int] = {}
        self._ship_lock = threading.Lock()
        self._stop = threading.Event()
        self._shipper = threading.Thread(
            target=self._ship_periodically, args=(log_interval_s,), name="log-shipper", daemon=True
        )
        self._shipper.start()

    @classmethod
    def open(
        cls,
        transport: ObjectTransport,
        root: str,
        output: OutputSettings,
        index: int,
        log_interval_s: float = LOG_SHIP_INTERVAL_S,
    ) -> ObjectIndexStore:
        """Fail before any model loads when the bucket, credentials or permissions are wrong."""
        store = cls(transport, root, output, index, log_interval_s)
        try:
            transport.check_access(store.prefix, write=True)
        except BaseException:
            store.close()
            raise
        return store

    # -- listing and the manifest --------------------------------------------------------------

    def list_names(self) -> list[str]:
        names = [info.key[len(self.prefix) :] for info in self.transport.list(self.prefix)]
        with self._taken_lock:
            self._taken.update(n for name in names if (n := shard_number(name)) is not None)
        return names

    def read_manifest(self) -> tuple[bytes | None, str | None]:
        found = self.transport.get(self.prefix + MANIFEST)
        return (None, None) if found is None else found

    def write_manifest(self, data: bytes, version: str | None) -> str | None:
        key = self.prefix + MANIFEST
        try:
            new_version = self.transport.put(
                key, data, "application/json", if_version=version, create_only=version is None
            )
        except PreconditionFailed:
            # A retried request whose first attempt did succeed also ends in a conflict: the manifest
            # then holds exactly these bytes (they name this run), so the write is ours.
            current = self.transport.get(key)
            if current is None or current[0] != data:
                raise Superseded(
                    f"{self.location}: another run changed {MANIFEST} since this run last wrote it "
                    "(two pods on one index, e.g. a Kubernetes retry overlap); this run stops, the "
                    "other one owns the index"
                ) from None
            new_version = current[1]
        if not self._owner:
            self._owner = True
            # Only now is this run the index's owner, so multipart uploads left under the prefix
            # belong to dead or superseded runs. (The runner writes the manifest before any shard,
            # so none of them is this run's.) Hygiene only: a failure is reported, not fatal.
            self._abort_uploads()
        return new_version

    def read_output_claim(self) -> bytes | None:
        found = self.transport.get(self._root_prefix + EXTRACTION)
        return None if found is None else found[0]

    def claim_output(self, data: bytes) -> bytes:
        key = self._root_prefix + EXTRACTION
        try:
            self.transport.put(key, data, "application/json", create_only=True)
            return data
        except PreconditionFailed:  # present (or this very write, retried after it succeeded)
            found = self.transport.get(key)
            if found is None:
                raise StorageError(
                    f"{self.transport.url(key)}: present when written create-only, gone when read back; "
                    "is something deleting it?"
                ) from None
            return found[0]

    def _abort_uploads(self, only_keys: set[str] | None = None) -> None:
        try:
            aborted = self.transport.abort_uploads(self.prefix, only_keys)
        except JobError as exc:
            self._log.warning("multipart_cleanup_failed", error=str(exc))
            return
        if aborted:
            self.stats["stale_uploads_aborted"] += aborted
            self._log.info("stale_multipart_uploads_aborted", count=aborted)

    # -- shards ----------------------------------------------------------------------------------

    def commit_shard(self, staged: StagedShard, checksum: str) -> CommittedShard:
        try:
            size = staged.path.stat().st_size
            key_name = self._claim(staged.name)
            for _ in range(_MAX_KEY_CONFLICTS):
                try:
                    self.transport.upload_new(
                        staged.path, self.prefix + key_name, Checksum(algorithm=ALGORITHM, value=checksum)
                    )
                    break
                except ObjectExists:
                    self.stats["key_conflicts"] += 1
                    taken_by_other = key_name
                    self.list_names()
                    key_name = self._claim(staged.name, fresh=True)
                    self._log.warning("shard_key_taken", key=taken_by_other, uploading_as=key_name)
            else:
                raise StorageError(
                    f"{self.location}: {_MAX_KEY_CONFLICTS} shard keys in a row were taken by another "
                    "writer; is another job writing to this output.uri and index?"
                )
            self._own_keys.add(self.prefix + key_name)
            self.stats["shards_uploaded"] += 1
            self.stats["bytes_uploaded"] += size
            return CommittedShard(key_name, size, checksum)
        finally:
            staged.discard()

    def _claim(self, name: str, fresh: bool = False) -> str:
        """The key name to upload ``name`` under: its own number unless that is already taken."""
        number = shard_number(name)
        assert number is not None, name
        with self._taken_lock:
            if fresh or number in self._taken:
                number = max(self._taken) + 1
            self._taken.add(number)
        return shard_name(number)

    def commit_file(self, path: Path, name: str, checksum: str) -> None:
        try:
            self.transport.upload_new(path, self.prefix + name, Checksum(algorithm=ALGORITHM, value=checksum))
        finally:
            path.unlink(missing_ok=True)
        self._own_keys.add(self.prefix + name)

    def check_committed(self, entry: StoredFile, checksum: bool) -> None:
        key = self.prefix + entry.name
        stored = self.transport.stored_checksum(key, entry.checksum.algorithm)
        if stored is None:
            raise DamagedShard(f"{self.transport.url(key)}: listed in the manifest but missing")
        crc, size = stored
        if (
            checksum
            and crc is None
            and size == entry.bytes
            and (info := self.transport.head(key)) is not None
        ):
            crc = self.transport.checksum_by_reading(info, entry.checksum.algorithm)  # the store keeps none
        if size != entry.bytes:
            raise DamagedShard(
                f"{self.transport.url(key)}: {size} bytes, but the manifest lists {entry.bytes}; "
                f"the {entry.described_as} is damaged"
            )
        if checksum and crc != entry.checksum.value:
            raise DamagedShard(
                f"{self.transport.url(key)}: the store records checksum {crc}, the manifest "
                f"{entry.checksum.value}; the {entry.described_as} is damaged"
            )

    def discard(self, name: str) -> None:
        """Unlisted objects stay: a run that lost the index may still be finishing them, and
        keys are never reused, so they are harmless (an AbortIncompleteMultipartUpload and
        expiry lifecycle rule can reclaim the space)."""

    # -- small files and logs ---------------------------------------------------------------------

    def local_path(self, name: str) -> Path:
        path = self._files_dir / name
        path.parent.mkdir(parents=True, exist_ok=True)
        if is_log(name):
            with self._ship_lock:
                self._live_logs[name] = path
        return path

    def put_file(self, path: Path, name: str) -> None:
        if not is_log(name):
            with path.open("rb") as f:
                self.transport.put(self.prefix + name, f, "application/x-ndjson")
            return
        # The final upload of a log: its last lines are this store's figures. A failure to ship
        # logs is reported, not raised: it must not hide the error that may be ending the run.
        staging = self.staging
        self._log.info(
            f"{self.transport.scheme}_output_summary",
            retries=self.transport.retries,
            staging_high_water_bytes=staging.high_water_bytes,
            staging_waits=staging.waits,
            staging_wait_s=round(staging.wait_s, 3),
            **self.stats,
        )
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
        self.transport.put(self.prefix + name, data, "application/x-ndjson")

    def close(self) -> None:
        self._stop.set()
        self._shipper.join()
        if self._own_keys:
            # A CreateMultipartUpload whose response was lost (and retried) leaves an upload nobody
            # knows the id of. Uploads to keys this run created objects at can never complete
            # (create-only), so they are garbage whoever started them: abort them now rather
            # than leave them to the index's next owner.
            self._abort_uploads(self._own_keys)
        self.transport.close()
        shutil.rmtree(self._staging_root, ignore_errors=True)
        self._staging_lock.close()


_STAGING_PREFIX = "eagle3-"
_STAGING_LOCK = ".lock"


def _make_staging_dir(output: OutputSettings, index: int, log: Any) -> tuple[Path, IO[str]]:
    """A new staging directory, locked for the run's life, after removing those that no live run
    holds (a killed run's partial shards would otherwise fill output.staging_dir, run by run)."""
    parent = Path(output.staging_dir or tempfile.gettempdir())
    try:
        parent.mkdir(parents=True, exist_ok=True)
        _remove_stale_staging(parent, log)
        # Built under a hidden name and locked before it is renamed into view: a directory the
        # sweep can see always has its lock file, held while its run lives.
        building = Path(tempfile.mkdtemp(prefix=f".{_STAGING_PREFIX}new-", dir=parent))
        lock = (building / _STAGING_LOCK).open("w")
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        root = parent / f"{_STAGING_PREFIX}{index_dir_name(index)}-{building.name.rsplit('-', 1)[-1]}"
        building.rename(root)
    except OSError as exc:
        raise ConfigError(
            f"output.staging_dir: cannot create a staging directory in {parent}: {exc.strerror}"
        ) from None
    free = shutil.disk_usage(root).free
    if free < int(output.max_staged_bytes):
        shutil.rmtree(root, ignore_errors=True)
        lock.close()
        raise ConfigError(
            f"output.staging_dir {root.parent} has {free} bytes free, less than output.max_staged_bytes "
            f"({int(output.max_staged_bytes)}); lower max_staged_bytes or stage on a larger disk"
        )
    return root, lock


def _remove_stale_staging(parent: Path, log: Any) -> None:
    for directory in parent.glob(f"{_STAGING_PREFIX}index-*"):
        try:
            with (directory / _STAGING_LOCK).open() as lock:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held: a live run's
                size = sum(f.stat().st_size for f in directory.rglob("*") if f.is_file())
                shutil.rmtree(directory)
        except (BlockingIOError, FileNotFoundError, NotADirectoryError):
            continue  # in use, gone meanwhile, or without a lock file (not made by this code)
        log.info("stale_staging_removed", directory=str(directory), bytes=size)


class ObjectShardSource(ShardSource):
    """An output (or one index) under an object-store prefix. Manifests are read whole; a
    shard's header through a ranged reader; a shard itself is streamed to a temporary file,
    checked against the manifest's CRC64NVME on the way, and removed after use, so local
    disk holds one shard at a time. Shards are read pinned to the listed version."""

    def __init__(self, transport: ObjectTransport, prefix: str, setting: str) -> None:
        self.transport = transport
        self.location = transport.url(prefix).rstrip("/")
        base = f"{prefix.rstrip('/')}/" if prefix else ""
        self._objects = {info.key: info for info in transport.list(base)}
        keys = [key[len(base) :] for key in self._objects]
        if not keys:
            raise ConfigError(
                f"{setting} {self.location}: no objects there (give an output prefix or one index-* prefix)"
            )
        names = sorted({key.split("/", 1)[0] for key in keys if key.startswith("index-") and "/" in key})
        self.single_index = not names and MANIFEST in keys
        if not names and not self.single_index:
            raise ConfigError(f"{setting} {self.location}: neither index-*/ prefixes nor a {MANIFEST} there")
        single = base.rstrip("/").rsplit("/", 1)[-1] or transport.bucket
        self._bases = {single: base} if self.single_index else {name: f"{base}{name}/" for name in names}

    def indexes(self) -> list[SourceIndex]:
        found = []
        for name, base in self._bases.items():
            key = base + MANIFEST
            stored = self.transport.get(key) if key in self._objects else None
            found.append(
                SourceIndex.parse(name, None if stored is None else stored[0], self.transport.url(key))
            )
        return found

    def _listed(self, index: str, entry: StoredFile) -> ObjectInfo:
        key = self._bases[index] + entry.name
        info = self._objects.get(key)
        if info is None:
            raise DamagedShard(f"{self.transport.url(key)}: listed in {index}/{MANIFEST} but missing")
        if info.size != entry.bytes:
            raise DamagedShard(
                f"{self.transport.url(key)}: {info.size} bytes, but the manifest lists {entry.bytes}; "
                f"the {entry.described_as} is damaged"
            )
        return info

    def open_stream(self, index: str, entry: StoredFile) -> IO[bytes]:
        return self.transport.open_reader(self._listed(index, entry))

    def check(self, index: str, entry: StoredFile, checksum: bool = True) -> None:
        info = self._listed(index, entry)
        if checksum:
            self._copy_checked(info, entry, None)

    def _copy_checked(self, info: ObjectInfo, entry: StoredFile, out: IO[bytes] | None) -> None:
        """Stream the object (into ``out``), computing its CRC64NVME on the way."""
        crc = 0
        with self.transport.open_reader(info) as reader:
            buffer = bytearray(_CHUNK)
            view = memoryview(buffer)
            while n := reader.readinto(buffer):
                if out is not None:
                    out.write(view[:n])
                crc = crc64nvme(view[:n], crc)
        if encode(crc) != entry.checksum.value:
            raise DamagedShard(
                f"{self.transport.url(info.key)}: checksum {encode(crc)} differs from the manifest's "
                f"{entry.checksum.value}; the {entry.described_as} is damaged"
            )

    @contextmanager
    def fetch(self, index: str, entry: StoredFile) -> Iterator[Path]:
        info = self._listed(index, entry)
        directory = Path(tempfile.mkdtemp(prefix="eagle3-fetch-"))
        try:
            path = directory / entry.name
            try:
                with path.open("wb") as out:
                    self._copy_checked(info, entry, out)
            except OSError as exc:
                if not is_out_of_space(exc):
                    raise
                raise OutOfSpace(
                    f"no space left in {directory.parent} for {self.transport.url(info.key)} "
                    f"({entry.bytes:,} bytes), which is fetched there to be read: free space there, or point "
                    "TMPDIR at a disk with room, and run the same command again"
                ) from None
            yield path
        finally:
            shutil.rmtree(directory, ignore_errors=True)
