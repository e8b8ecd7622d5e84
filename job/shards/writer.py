"""Fill planned shards as hidden states arrive.

A shard's members, and therefore its whole safetensors header, are fixed by its
plan (``job.shards.planner``) before the backend sees them. Hidden-state rows are
then written straight to their final offsets in whatever order (and from whichever
thread) they arrive: no per-shard buffering in memory, no second copy.

How rows reach the file:

* direct I/O (``O_DIRECT``) when the shard is the output itself (a local
  directory), the filesystem takes it and the rows are block-aligned in
  memory and in the file (the capture ring's rows are; the shard layout aligns
  hidden_states): the page cache is skipped, so nothing is left for the
  commit's fsync to write out, and the disk sees large sequential writes;
* otherwise a copy into a shared memory map of the file (S3 staging, tmpfs,
  odd row sizes). Not ``pwrite``: a buffered write holds the file's inode lock, so
  writer threads filling one shard would take turns; page faults on a
  mapping run in parallel.

The shard's CRC64NVME is combined from per-write checksums of the source
bytes, so committing never reads the shard back; combining also proves that
every byte of the file was written exactly once.
"""

from __future__ import annotations

import errno
import functools
import json
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
from awscrt.checksums import crc64nvme

from job.checksum import combine_pieces
from job.errors import OutOfSpace
from job.hidden_dtype import SCALE_BYTES, HiddenDtype
from job.shards.format import DATA_ALIGNMENT, FORMAT_VERSION, ShardLayout
from job.shards.planner import ShardPlan
from job.storage.staging import StagedShard, StagingArea

# Reserving a shard's blocks before anything is copied into its mapping turns "disk full"
# into an error instead of SIGBUS on a page fault. It runs off the driver's thread (on tmpfs
# it allocates every page: ~0.5 s per 2 GiB); row writes into the mapping wait for it.
_ALLOCATOR = ThreadPoolExecutor(1, thread_name_prefix="shard-allocate")


@dataclass
class ShardContext:
    """Per-run values recorded in every shard's metadata."""

    num_layers: int  # stored layers (L)
    hidden_size: int
    dtype: HiddenDtype
    metadata: dict[str, str]


@dataclass
class FinishedShard:
    plan: ShardPlan
    staged: StagedShard
    failed: dict[str, str]  # sample id -> reason (e.g. non-finite values)
    checksum: str  # CRC64NVME of the whole file (base64, as S3 reports it)
    direct_bytes: int  # bytes written with direct I/O
    # hidden-state rows that took the mapping although the file had a direct I/O descriptor
    # (rows not block-aligned in memory): a slower path that should not happen
    buffered_row_bytes: int


@dataclass
class _OpenShard:
    plan: ShardPlan
    staged: StagedShard
    fd: int
    direct_fd: int | None  # O_DIRECT descriptor, where the filesystem and row size allow
    mapping: mmap.mmap
    data: np.ndarray  # uint8 view of ``mapping``
    layout: ShardLayout
    row_offsets: np.ndarray
    row_bytes: int
    remaining: int  # samples not yet finished
    failed: dict[str, str] = field(default_factory=dict)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, length, crc) per write
    direct_bytes: int = 0
    buffered_row_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    ready: Future = field(default_factory=Future)  # done once prepare() ran (its error, if it failed)

    def put(self, offset: int, values: np.ndarray | memoryview | bytes, rows: bool = False) -> None:
        """Write raw bytes at ``offset`` and record their checksum (``rows``: hidden-state rows). A
        write into the mapping first waits until the file is ready (its blocks reserved): a page
        fault on a full disk is a SIGBUS, which no handler survives, whereas the reservation fails
        with an error."""
        self._put(offset, values, wait=True, rows=rows)

    def _put(
        self, offset: int, values: np.ndarray | memoryview | bytes, wait: bool, rows: bool = False
    ) -> None:
        source = np.frombuffer(memoryview(values).cast("B"), np.uint8)
        # O_DIRECT needs the memory address, the file offset and the length block-aligned. Only
        # hidden-state rows take it: the header, ids, masks and scales are small, and whether their
        # memory happened to be aligned would decide their path by chance.
        direct = (
            rows
            and self.direct_fd is not None
            and (source.ctypes.data | offset | source.size) % DATA_ALIGNMENT == 0
        )
        if direct:  # a full disk fails the write itself with ENOSPC
            pwrite_all(self.direct_fd, source, offset)
        else:
            if wait:
                self.ready.result()
            self.data[offset : offset + source.size] = source  # numpy drops the GIL while copying
        crc = crc64nvme(source)
        with self.lock:
            self.pieces.append((offset, source.size, crc))
            self.direct_bytes += source.size if direct else 0
            if rows and not direct and self.direct_fd is not None:
                self.buffered_row_bytes += source.size

    def prepare(self, first: list[tuple[int, np.ndarray]]) -> None:
        """On the allocator's thread: reserve the file's blocks, then write ``first`` (offset,
        bytes) pieces: header, ids and masks."""
        _allocate(self.fd, self.layout.total_bytes, self.staged.path)
        for offset, values in first:
            self._put(offset, values, wait=False)

    def close(self) -> None:
        del self.data
        self.mapping.close()
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


class ShardWriter:
    """Receives hidden-state rows by sample id and writes them in place."""

    def __init__(
        self, context: ShardContext, on_finished: Callable[[FinishedShard], None], *, direct_io: bool
    ) -> None:
        self.context = context
        self.direct_io = direct_io  # False: staging is transient, keep it in the page cache
        self._on_finished = on_finished
        self._by_sample: dict[str, tuple[_OpenShard, int]] = {}
        self._open: dict[int, _OpenShard] = {}
        self._lock = threading.Lock()

    @property
    def row_bytes(self) -> int:
        ctx = self.context
        return ctx.num_layers * ctx.hidden_size * ctx.dtype.itemsize

    def layout(self, plan: ShardPlan) -> ShardLayout:
        """The byte layout of ``plan``'s shard file (``total_bytes`` is its exact size)."""
        ctx = self.context
        metadata = dict(ctx.metadata)
        metadata.update(
            format_version=FORMAT_VERSION,
            sample_ids=json.dumps([s.sample_id for s in plan.samples], ensure_ascii=False),
            num_truncated=str(sum(s.truncated for s in plan.samples)),
        )
        return ShardLayout.build(
            len(plan.samples), plan.num_tokens, ctx.num_layers, ctx.hidden_size, ctx.dtype, metadata
        )

    def open(
        self,
        plan: ShardPlan,
        staging: StagingArea,
        timeout_s: float | None = None,
        *,
        name: str | None = None,
    ) -> bool:
        """Reserve ``plan``'s shard file in ``staging`` (as ``name``, by default the plan's), waiting
        at most ``timeout_s`` for the space (False if it is not free by then), and create it: its
        header, ids and masks now, rows as they come. The reservation then belongs to the shard,
        released when it is committed or discarded (``StagedShard.discard``)."""
        layout = self.layout(plan)
        staged = staging.reserve(name or plan.name, layout.total_bytes, timeout_s)
        if staged is None:
            return False
        offsets = np.zeros(len(plan.samples) + 1, np.int64)
        np.cumsum([s.num_tokens for s in plan.samples], out=offsets[1:])
        path = staged.path
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, layout.total_bytes)
            mapping = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        data = np.frombuffer(mapping, np.uint8)
        direct_fd = _open_direct(path) if self.direct_io and self.row_bytes % DATA_ALIGNMENT == 0 else None
        shard = _OpenShard(
            plan,
            staged,
            fd,
            direct_fd,
            mapping,
            data,
            layout,
            offsets,
            self.row_bytes,
            len(plan.samples),
        )
        ids = np.concatenate([s.input_ids for s in plan.samples]).astype(np.int32, copy=False)
        mask = np.concatenate([s.loss_mask for s in plan.samples]).astype(np.uint8, copy=False)
        # The header, ids and masks go in once the blocks are reserved, on the allocator's thread:
        # opening a shard never waits for its reservation (~0.5 s per 2 GiB on tmpfs).
        first = [(layout.offsets[n], v) for n, v in (("sample_offsets", offsets), ("input_ids", ids))]
        first += [(layout.offsets["loss_mask"], mask), (0, np.frombuffer(layout.header, np.uint8))]
        shard.ready = _ALLOCATOR.submit(shard.prepare, first)
        with self._lock:
            self._open[plan.number] = shard
            for pos, sample in enumerate(plan.samples):
                self._by_sample[sample.sample_id] = (shard, pos)
        return True

    def write_rows(
        self, sample_id: str, start: int, rows: memoryview | bytes, scales: bytes | None = None
    ) -> None:
        """Write hidden-state rows ``start..`` of a sample (raw stored-dtype bytes)."""
        shard, pos = self._by_sample[sample_id]
        first_row = int(shard.row_offsets[pos]) + start
        count = memoryview(rows).nbytes // shard.row_bytes
        if start + count > shard.plan.samples[pos].num_tokens:
            raise ValueError(f"rows {start}..{start + count} exceed sample {sample_id}")
        shard.put(shard.layout.offsets["hidden_states"] + first_row * shard.row_bytes, rows, rows=True)
        if scales is not None:
            scale_row = self.context.num_layers * SCALE_BYTES
            shard.put(shard.layout.offsets["hidden_states_scale"] + first_row * scale_row, scales)

    def finish_sample(self, sample_id: str, failure: str | None = None) -> None:
        """All rows of a sample are written (or it failed with ``failure``)."""
        with self._lock:
            shard, _pos = self._by_sample.pop(sample_id)
        with shard.lock:
            if failure is not None:
                shard.failed[sample_id] = failure
            shard.remaining -= 1
            done = shard.remaining == 0
        if done:
            with self._lock:
                del self._open[shard.plan.number]
            try:
                shard.ready.result()
            finally:
                shard.close()
            checksum = combine_pieces(shard.pieces, shard.layout.total_bytes, shard.staged.path.name)
            self._on_finished(
                FinishedShard(
                    shard.plan,
                    shard.staged,
                    shard.failed,
                    checksum,
                    shard.direct_bytes,
                    shard.buffered_row_bytes,
                )
            )

    def abandon_open(self) -> list[ShardPlan]:
        """Drop every unfinished shard and its staging space (its samples will be redone by a
        later run)."""
        with self._lock:
            shards = list(self._open.values())
            self._open.clear()
            self._by_sample.clear()
        for shard in shards:
            shard.ready.exception()  # wait; its error no longer matters
            shard.close()
            shard.staged.discard()
        return [s.plan for s in shards]


def _open_direct(path: Path) -> int | None:
    if _filesystem_type(str(path.parent)) in _MEMORY_FILESYSTEMS:
        return None
    try:
        return os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:  # e.g. EINVAL: the filesystem has no direct I/O
        return None


# tmpfs accepts O_DIRECT (Linux 6.6+) but serves it as a buffered write, which
# holds the inode lock: the mapping is faster there.
_MEMORY_FILESYSTEMS = ("tmpfs", "ramfs")


@functools.lru_cache(maxsize=16)
def _filesystem_type(directory: str) -> str:
    """The type of the filesystem holding ``directory`` (its deepest mount point)."""
    resolved = os.path.realpath(directory)
    mounts = [
        m
        for m in psutil.disk_partitions(all=True)
        if resolved == m.mountpoint or resolved.startswith(m.mountpoint.rstrip("/") + "/")
    ]
    return max(mounts, key=lambda m: len(m.mountpoint)).fstype if mounts else ""


def pwrite_all(fd: int, data: np.ndarray, offset: int) -> None:
    """Write all of ``data`` at ``offset`` (pwrite may write less than asked)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _allocate(fd: int, size: int, path: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OutOfSpace(
                f"no space left for shard {path.name} ({size:,} bytes) in {path.parent}: committed shards "
                "are kept; free space there (or lower output.shard_bytes / output.max_staged_bytes) and rerun"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
            raise
