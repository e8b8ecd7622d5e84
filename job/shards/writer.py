"""Plan shards ahead of extraction and fill them as hidden states arrive.

Token counts are known once a sample is tokenized, so a shard's members, and
therefore its whole safetensors header, are fixed before the backend sees
them. Hidden-state rows are then written straight to their final offsets in
whatever order (and from whichever thread) they arrive: no per-shard
buffering in memory, no second copy.

Rows are copied into a shared memory map of the file, not written with
``pwrite``: a buffered write holds the file's inode lock, so writer threads
filling one shard take turns, and a single thread allocating fresh page-cache
pages tops out near 1-2 GB/s. Page faults on a mapping run in parallel.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from job.data.encode import EncodedSample
from job.shards.format import FORMAT_VERSION, SAFETENSORS_DTYPES, ShardLayout, shard_name

# Reserving a shard's blocks up front turns "disk full" into an error instead of
# SIGBUS on a page fault of the mapping. It runs beside the first row writes (on
# tmpfs it allocates every page: ~0.5 s per 2 GiB).
_ALLOCATOR = ThreadPoolExecutor(1, thread_name_prefix="shard-allocate")


@dataclass
class ShardPlan:
    number: int
    samples: list[EncodedSample]

    @property
    def name(self) -> str:
        return shard_name(self.number)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


class ShardPlanner:
    """Groups samples, in input order, into shards of about ``shard_bytes``."""

    def __init__(self, shard_bytes: int, bytes_per_token: int, first_number: int) -> None:
        self.shard_bytes = shard_bytes
        self.bytes_per_token = bytes_per_token
        self.next_number = first_number
        self._pending: list[EncodedSample] = []
        self._pending_bytes = 0

    def add(self, sample: EncodedSample) -> Iterator[ShardPlan]:
        size = sample.num_tokens * self.bytes_per_token
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            yield self._emit()
        self._pending.append(sample)
        self._pending_bytes += size
        if self._pending_bytes >= self.shard_bytes:
            yield self._emit()

    def flush(self) -> Iterator[ShardPlan]:
        if self._pending:
            yield self._emit()

    def _emit(self) -> ShardPlan:
        plan = ShardPlan(self.next_number, self._pending)
        self.next_number += 1
        self._pending, self._pending_bytes = [], 0
        return plan


@dataclass
class ShardContext:
    """Per-run values recorded in every shard's metadata."""

    num_layers: int  # stored layers (L)
    hidden_size: int
    storage_dtype: str  # bfloat16 | float16 | float32 | fp8_e4m3
    metadata: dict[str, str]


@dataclass
class FinishedShard:
    plan: ShardPlan
    path: Path
    failed: dict[int, str]  # sample position -> reason (e.g. non-finite values)


@dataclass
class _OpenShard:
    plan: ShardPlan
    path: Path
    fd: int
    mapping: mmap.mmap
    data: np.ndarray  # uint8 view of ``mapping``
    allocated: Future  # the file's blocks, reserved in the background
    layout: ShardLayout
    row_offsets: np.ndarray
    row_bytes: int
    remaining: int  # samples not yet finished
    failed: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        del self.data
        self.mapping.close()
        os.close(self.fd)


class ShardWriter:
    """Receives hidden-state rows by sample key and writes them in place."""

    def __init__(
        self,
        context: ShardContext,
        staging_path: Callable[[str], Path],
        on_finished: Callable[[FinishedShard], None],
    ) -> None:
        self.context = context
        self._staging_path = staging_path
        self._on_finished = on_finished
        self._by_key: dict[int, tuple[_OpenShard, int]] = {}
        self._open: dict[int, _OpenShard] = {}
        self._lock = threading.Lock()

    @property
    def row_bytes(self) -> int:
        itemsize = SAFETENSORS_DTYPES[self.context.storage_dtype][1]
        return self.context.num_layers * self.context.hidden_size * itemsize

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
            len(plan.samples), plan.num_tokens, ctx.num_layers, ctx.hidden_size, ctx.storage_dtype, metadata
        )

    def open(self, plan: ShardPlan, first_key: int) -> list[int]:
        """Create the shard file for ``plan``; returns the keys of its samples."""
        offsets = np.zeros(len(plan.samples) + 1, np.int64)
        np.cumsum([s.num_tokens for s in plan.samples], out=offsets[1:])
        layout = self.layout(plan)
        path = self._staging_path(plan.name)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.ftruncate(fd, layout.total_bytes)
            mapping = mmap.mmap(fd, layout.total_bytes, mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        data = np.frombuffer(mapping, np.uint8)
        allocated = _ALLOCATOR.submit(_allocate, fd, layout.total_bytes, path)
        shard = _OpenShard(
            plan, path, fd, mapping, data, allocated, layout, offsets, self.row_bytes, len(plan.samples)
        )
        try:
            ids = np.concatenate([s.input_ids for s in plan.samples]).astype(np.int32, copy=False)
            mask = np.concatenate([s.loss_mask for s in plan.samples]).astype(np.uint8, copy=False)
            for name, values in (("sample_offsets", offsets), ("input_ids", ids), ("loss_mask", mask)):
                _put(data, layout.offsets[name], values)
            _put(data, 0, np.frombuffer(layout.header, np.uint8))
        except BaseException:
            allocated.exception()  # wait: the file descriptor is about to close
            shard.close()
            path.unlink(missing_ok=True)
            raise
        keys = list(range(first_key, first_key + len(plan.samples)))
        with self._lock:
            self._open[plan.number] = shard
            for pos, key in enumerate(keys):
                self._by_key[key] = (shard, pos)
        return keys

    def write_rows(self, key: int, start: int, rows: memoryview | bytes, scales: bytes | None = None) -> None:
        """Write hidden-state rows ``start..`` of sample ``key`` (raw storage-dtype bytes)."""
        shard, pos = self._by_key[key]
        first_row = int(shard.row_offsets[pos]) + start
        count = len(rows) // shard.row_bytes
        if start + count > shard.plan.samples[pos].num_tokens:
            raise ValueError(
                f"rows {start}..{start + count} exceed sample {shard.plan.samples[pos].sample_id}"
            )
        _put(shard.data, shard.layout.offsets["hidden_states"] + first_row * shard.row_bytes, rows)
        if scales is not None:
            scale_row = self.context.num_layers * 4
            _put(shard.data, shard.layout.offsets["hidden_states_scale"] + first_row * scale_row, scales)

    def finish_sample(self, key: int, failure: str | None = None) -> None:
        """All rows of sample ``key`` are written (or it failed with ``failure``)."""
        with self._lock:
            shard, pos = self._by_key.pop(key)
        with shard.lock:
            if failure is not None:
                shard.failed[pos] = failure
            shard.remaining -= 1
            done = shard.remaining == 0
        if done:
            with self._lock:
                del self._open[shard.plan.number]
            try:
                shard.allocated.result()
            finally:
                shard.close()
            self._on_finished(FinishedShard(shard.plan, shard.path, shard.failed))

    def abandon_open(self) -> list[ShardPlan]:
        """Drop every unfinished shard (its samples will be redone by a later run)."""
        with self._lock:
            shards = list(self._open.values())
            self._open.clear()
            self._by_key.clear()
        for shard in shards:
            shard.allocated.exception()  # wait; its error no longer matters
            shard.close()
            shard.path.unlink(missing_ok=True)
        return [s.plan for s in shards]


def _put(data: np.ndarray, offset: int, values: np.ndarray | memoryview | bytes) -> None:
    """Copy raw bytes into the mapped file at ``offset`` (numpy drops the GIL while copying)."""
    source = np.frombuffer(memoryview(values).cast("B"), np.uint8)
    data[offset : offset + source.size] = source


def _allocate(fd: int, size: int, path: Path) -> None:
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise OSError(
                exc.errno,
                f"no space left for shard {path.name} ({size:,} bytes) in {path.parent}: free space there "
                "or lower output.shard_bytes / output.max_staged_bytes",
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
            raise
