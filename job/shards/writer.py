"""Backend chunks -> rows in reserved shard files -> finished shards.

A shard's members, and therefore its whole safetensors header, are fixed by its plan, and its
file reserved in staging, before the backend sees its samples (``job.pipeline.feed``). Each
backend input carries its sample's place in that shard (``ShardSlot``), and every chunk of its
rows brings it back: the writer needs no other record of where rows go. A shard's file is
opened when its first rows arrive; rows are then written straight to their final offsets in
whatever order they arrive: no per-shard buffering in memory, no second copy.

Rows are written by a small thread pool, so the backend's loop never waits on the disk. A
chunk larger than ``PIECE_BYTES`` is written as several pieces by as many threads: one step's
rows for one long request would otherwise go through one thread, and the run's last step is
then what the run waits for. A sample is finished once all its rows are written, and rejected
if any row was non-finite; a shard is finished once all its samples are.

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

The shard's CRC64NVME is combined from per-write checksums of the source bytes, so committing
never reads the shard back; combining also proves that every byte of the file was written
exactly once (``combined_checksum``). The same per-write checksums give the manifest's
per-range ones (``range_checksums``: the header with the sample offsets, and each sample's
bytes), with which a reader checks one sample without reading its whole shard.
"""

from __future__ import annotations

import bisect
import functools
import math
import mmap
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import psutil
import torch
from awscrt.checksums import combine_crc64nvme, crc64nvme

from job.backend_io import HiddenChunk
from job.checksum import ALGORITHM, encode
from job.hidden_dtype import SCALE_BYTES
from job.manifest import RangeChecksums
from job.shards.format import DATA_ALIGNMENT, ShardContext, ShardLayout, ShardPlan
from job.storage.staging import StagedShard

NONFINITE = "non-finite hidden states (NaN or Inf); not written"


@dataclass(eq=False)
class ReservedShard:
    """A planned shard whose file is reserved in staging, ready for its rows."""

    plan: ShardPlan
    layout: ShardLayout
    staged: StagedShard


@dataclass(frozen=True, slots=True)
class ShardSlot:
    """Where one sample's rows go: its shard and its position among the shard's samples. The
    backend hands it back with every chunk of the sample (``HiddenChunk.destination``)."""

    shard: ReservedShard
    position: int


@dataclass
class FinishedShard:
    plan: ShardPlan
    staged: StagedShard
    failed: dict[str, str]  # sample id -> reason (e.g. non-finite values)
    checksum: str  # CRC64NVME of the whole file (base64, as S3 reports it)
    ranges: RangeChecksums  # per-range CRC64NVME (the manifest's ShardEntry.ranges)
    direct_bytes: int  # bytes written with direct I/O
    # hidden-state rows that took the mapping although the file had a direct I/O descriptor
    # (rows not block-aligned in memory): a slower path that should not happen
    buffered_row_bytes: int


@dataclass
class _OpenShard:
    reserved: ReservedShard
    fd: int
    direct_fd: int | None  # O_DIRECT descriptor, where the filesystem and row size allow
    mapping: mmap.mmap
    data: np.ndarray  # uint8 view of ``mapping``
    row_offsets: np.ndarray
    row_bytes: int
    remaining: int  # samples not yet finished
    failed: dict[str, str] = field(default_factory=dict)
    pieces: list[tuple[int, int, int]] = field(default_factory=list)  # (offset, length, crc) per write
    direct_bytes: int = 0
    buffered_row_bytes: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    prepared: Future = field(default_factory=Future)  # done once prepare() ran (its error, if it failed)

    @classmethod
    def open(cls, reserved: ReservedShard, row_bytes: int, direct_io: bool) -> _OpenShard:
        path, size = reserved.staged.path, reserved.layout.total_bytes
        fd = os.open(path, os.O_RDWR)
        try:
            mapping = mmap.mmap(fd, size, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
        samples = reserved.plan.samples
        offsets = np.zeros(len(samples) + 1, np.int64)
        np.cumsum([s.num_tokens for s in samples], out=offsets[1:])
        direct_fd = _open_direct(path) if direct_io and row_bytes % DATA_ALIGNMENT == 0 else None
        data = np.frombuffer(mapping, np.uint8)
        return cls(reserved, fd, direct_fd, mapping, data, offsets, row_bytes, len(samples))

    @property
    def layout(self) -> ShardLayout:
        return self.reserved.layout

    def prepare(self) -> None:
        """Write what the plan fixes (header, sample offsets, ids, masks), once the file's
        blocks are claimed; ``prepared`` then holds the outcome."""
        try:
            samples, offsets = self.reserved.plan.samples, self.layout.offsets
            ids = np.concatenate([s.input_ids for s in samples]).astype(np.int32, copy=False)
            mask = np.concatenate([s.loss_mask for s in samples]).astype(np.uint8, copy=False)
            self.put(0, np.frombuffer(self.layout.header, np.uint8))
            self.put(offsets["sample_offsets"], self.row_offsets)
            self.put(offsets["input_ids"], ids)
            self.put(offsets["loss_mask"], mask)
        except BaseException as exc:
            self.prepared.set_exception(exc)
            raise
        self.prepared.set_result(None)

    def put(self, offset: int, values: np.ndarray | memoryview | bytes, rows: bool = False) -> None:
        """Write raw bytes at ``offset`` and record their checksum (``rows``: hidden-state rows). A
        write into the mapping first waits until the file's blocks are claimed: a page fault on a
        full disk is a SIGBUS, which no handler survives, whereas the claim fails with an error."""
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
            self.reserved.staged.allocated.result()
            self.data[offset : offset + source.size] = source  # numpy drops the GIL while copying
        crc = crc64nvme(source)
        with self.lock:
            self.pieces.append((offset, source.size, crc))
            self.direct_bytes += source.size if direct else 0
            if rows and not direct and self.direct_fd is not None:
                self.buffered_row_bytes += source.size

    def close(self) -> None:
        del self.data
        self.mapping.close()
        os.close(self.fd)
        if self.direct_fd is not None:
            os.close(self.direct_fd)


class _Pieces:
    """The pieces of one chunk still to write; its buffer is released after the last."""

    def __init__(self, chunk: HiddenChunk, count: int) -> None:
        self.chunk = chunk
        self.left = count
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.chunk.release is not None:
            self.chunk.release()


class ShardWriter:
    """Takes the backend's chunks (``writer(chunk)``, from one thread) and writes their rows in
    place on ``threads`` threads; each finished shard goes to ``on_finished``."""

    MAX_IN_FLIGHT = 256  # pieces handed to writer threads but not yet written
    PIECE_BYTES = 16 * 2**20  # large sequential writes, yet a 16k-token step of an 8B is 32 pieces

    def __init__(
        self,
        context: ShardContext,
        on_finished: Callable[[FinishedShard], None],
        *,
        direct_io: bool,
        threads: int,
    ) -> None:
        self.context = context
        self.direct_io = direct_io  # False: staging is transient, keep it in the page cache
        self._on_finished = on_finished
        self._open: dict[int, _OpenShard] = {}  # by shard number
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self._slots = threading.BoundedSemaphore(self.MAX_IN_FLIGHT)
        self._outstanding: dict[str, int] = {}  # sample id -> pieces not yet written
        self._complete: set[str] = set()  # samples whose last chunk has arrived
        self._bad: set[str] = set()
        self.error: BaseException | None = None
        self.tokens = 0  # rows taken
        self.samples = 0  # samples whose last chunk was taken

    def __call__(self, chunk: HiddenChunk) -> None:
        """Queue one chunk for writing (blocks while MAX_IN_FLIGHT pieces wait)."""
        sample_id, count = chunk.sample_id, int(chunk.rows.shape[0])
        row_bytes = math.prod(chunk.rows.shape[1:]) * chunk.rows.element_size()
        step = max(1, self.PIECE_BYTES // row_bytes)
        starts = range(0, count, step) if count else range(1)
        pieces = _Pieces(chunk, len(starts))
        with self._lock:
            self._outstanding[sample_id] = self._outstanding.get(sample_id, 0) + len(starts)
            if chunk.nonfinite:
                self._bad.add(sample_id)
            if chunk.last:
                self._complete.add(sample_id)
        self.tokens += count
        self.samples += chunk.last
        for first in starts:
            self._slots.acquire()
            self._pool.submit(self._write, pieces, first, min(first + step, count))

    def samples_left(self) -> dict[int, int]:
        """Samples not yet written of each shard being filled, by shard number (any thread)."""
        with self._lock:
            return {number: shard.remaining for number, shard in self._open.items()}

    def close(self, raise_error: bool = True) -> None:
        """Wait for every queued piece; raise the first write error."""
        self._pool.shutdown(wait=True)
        if raise_error and self.error is not None:
            raise self.error

    def close_open(self) -> None:
        """Close the files of shards still being filled (after ``close``). Their samples are redone
        by a later run; their staging space goes back with the feed's (``BackendFeed.abandon``)."""
        with self._lock:
            shards = list(self._open.values())
            self._open.clear()
        for shard in shards:
            shard.prepared.exception()  # wait; its error no longer matters
            shard.close()

    def _write(self, pieces: _Pieces, first: int, stop: int) -> None:
        chunk = pieces.chunk
        sample_id = chunk.sample_id
        try:
            if self.error is None:
                self._write_rows(
                    chunk.destination,
                    chunk.start + first,
                    chunk.rows[first:stop].view(torch.uint8).numpy().data,
                    None if chunk.scales is None else chunk.scales[first:stop].numpy().tobytes(),
                )
        except BaseException as exc:
            self.error = exc
        finally:
            pieces.done()
            self._slots.release()
        with self._lock:
            self._outstanding[sample_id] -= 1
            finished = self._outstanding[sample_id] == 0 and sample_id in self._complete
            if finished:
                del self._outstanding[sample_id]
                self._complete.discard(sample_id)
                failed = sample_id in self._bad
                self._bad.discard(sample_id)
        if finished and self.error is None:
            try:
                self._finish_sample(chunk.destination, NONFINITE if failed else None)
            except BaseException as exc:
                self.error = exc

    def _shard(self, reserved: ReservedShard) -> _OpenShard:
        """``reserved``'s open file: opened by the first rows that reach it, which also write what
        its plan fixes (the other writers' rows do not wait for that)."""
        with self._lock:
            shard = self._open.get(reserved.plan.number)
            opening = shard is None
            if opening:
                shard = self._open[reserved.plan.number] = _OpenShard.open(
                    reserved, self.context.row_bytes, self.direct_io
                )
        if opening:
            shard.prepare()
        return shard

    def _write_rows(
        self, slot: ShardSlot, start: int, rows: memoryview | bytes, scales: bytes | None = None
    ) -> None:
        """Write hidden-state rows ``start..`` of a sample (raw stored-dtype bytes)."""
        shard = self._shard(slot.shard)
        sample = slot.shard.plan.samples[slot.position]
        first_row = int(shard.row_offsets[slot.position]) + start
        count = memoryview(rows).nbytes // shard.row_bytes
        if start + count > sample.num_tokens:
            raise ValueError(f"rows {start}..{start + count} exceed sample {sample.sample_id}")
        shard.put(shard.layout.offsets["hidden_states"] + first_row * shard.row_bytes, rows, rows=True)
        if scales is not None:
            scale_row = self.context.num_layers * SCALE_BYTES
            shard.put(shard.layout.offsets["hidden_states_scale"] + first_row * scale_row, scales)

    def _finish_sample(self, slot: ShardSlot, failure: str | None) -> None:
        """All rows of a sample are written (or it failed with ``failure``)."""
        with self._lock:
            shard = self._open[slot.shard.plan.number]  # opened by the sample's rows
        with shard.lock:
            if failure is not None:
                shard.failed[slot.shard.plan.samples[slot.position].sample_id] = failure
            shard.remaining -= 1
            done = shard.remaining == 0
        if not done:
            return
        with self._lock:
            del self._open[slot.shard.plan.number]
        try:
            shard.prepared.result()
        finally:
            shard.close()
        staged = slot.shard.staged
        self._on_finished(
            FinishedShard(
                slot.shard.plan,
                staged,
                shard.failed,
                combined_checksum(shard.pieces, shard.layout.total_bytes, staged.path.name),
                range_checksums(shard.pieces, shard.layout, slot.shard.plan, shard.row_offsets),
                shard.direct_bytes,
                shard.buffered_row_bytes,
            )
        )


def combined_checksum(pieces: list[tuple[int, int, int]], total: int, name: str) -> str:
    """The checksum of a ``total``-byte file from the checksums of the pieces it was written in,
    ``(offset, length, crc)``; the pieces must tile it exactly."""
    crc = end = 0
    for offset, length, piece in sorted(pieces):
        if offset != end:
            raise ValueError(f"{name}: bytes {min(offset, end)}..{max(offset, end)} written twice or never")
        crc = combine_crc64nvme(crc, piece, length)
        end += length
    if end != total:
        raise ValueError(f"{name}: bytes {end}..{total} never written")
    return encode(crc)


def range_checksums(
    pieces: list[tuple[int, int, int]], layout: ShardLayout, plan: ShardPlan, row_offsets: np.ndarray
) -> RangeChecksums:
    """The shard's per-range checksums (``RangeChecksums``) from the pieces it was written in
    (``combined_checksum`` has proven that they tile the file). Rows and scales come from the
    backend's writes, which never span two samples; the header, sample offsets, ids and masks are
    the plan's own arrays, checksummed here as written."""
    written = sorted(p for p in pieces if p[1])
    starts = [offset for offset, _, _ in written]

    def span(begin: int, end: int) -> int:
        crc, at, i = 0, begin, bisect.bisect_left(starts, begin)
        while at < end:
            offset, length, piece = written[i]
            if offset != at or offset + length > end:
                raise ValueError(f"{plan.name}: a write crosses the sample boundary at byte {at}")
            crc, at, i = combine_crc64nvme(crc, piece, length), at + length, i + 1
        return crc

    offsets = layout.offsets
    row_bytes = layout.specs["hidden_states"].nbytes // max(1, int(row_offsets[-1]))
    scaled = "hidden_states_scale" in offsets
    scale_bytes = layout.specs["hidden_states_scale"].shape[1] * SCALE_BYTES if scaled else 0
    samples = []
    for i, sample in enumerate(plan.samples):
        a, b = int(row_offsets[i]), int(row_offsets[i + 1])
        crc = span(offsets["hidden_states"] + a * row_bytes, offsets["hidden_states"] + b * row_bytes)
        if scaled:
            base = offsets["hidden_states_scale"]
            crc = combine_crc64nvme(
                crc, span(base + a * scale_bytes, base + b * scale_bytes), (b - a) * scale_bytes
            )
        ids = np.ascontiguousarray(sample.input_ids, np.int32)
        mask = np.ascontiguousarray(sample.loss_mask, np.uint8)
        crc = combine_crc64nvme(crc, crc64nvme(ids), ids.nbytes)
        samples.append(encode(combine_crc64nvme(crc, crc64nvme(mask), mask.nbytes)))
    head = crc64nvme(row_offsets.astype(np.int64, copy=False), crc64nvme(layout.header))
    return RangeChecksums(algorithm=ALGORITHM, layout=encode(head), samples=samples)


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
