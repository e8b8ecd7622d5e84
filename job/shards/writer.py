"""Plan shards ahead of extraction and fill them as hidden states arrive.

Token counts are known once a sample is tokenized, so a shard's members, and
therefore its whole safetensors header, are fixed before the backend sees
them. Hidden-state rows are then written straight to their final offsets in
whatever order (and from whichever thread) they arrive: no per-shard
buffering in memory, no second copy.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from job.data.encode import EncodedSample
from job.shards.format import FORMAT_VERSION, SAFETENSORS_DTYPES, ShardLayout, shard_name


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
    layout: ShardLayout
    row_offsets: np.ndarray
    row_bytes: int
    remaining: int  # samples not yet finished
    failed: dict[int, str] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)


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
            os.pwrite(fd, layout.header, 0)
            os.pwrite(fd, offsets.tobytes(), layout.offsets["sample_offsets"])
            ids = np.concatenate([s.input_ids for s in plan.samples]).astype(np.int32, copy=False)
            mask = np.concatenate([s.loss_mask for s in plan.samples]).astype(np.uint8, copy=False)
            os.pwrite(fd, ids.tobytes(), layout.offsets["input_ids"])
            os.pwrite(fd, mask.tobytes(), layout.offsets["loss_mask"])
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        shard = _OpenShard(plan, path, fd, layout, offsets, self.row_bytes, len(plan.samples))
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
        _pwrite_all(shard.fd, rows, shard.layout.offsets["hidden_states"] + first_row * shard.row_bytes)
        if scales is not None:
            scale_row = self.context.num_layers * 4
            _pwrite_all(shard.fd, scales, shard.layout.offsets["hidden_states_scale"] + first_row * scale_row)

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
            os.close(shard.fd)
            self._on_finished(FinishedShard(shard.plan, shard.path, shard.failed))

    def abandon_open(self) -> list[ShardPlan]:
        """Drop every unfinished shard (its samples will be redone by a later run)."""
        with self._lock:
            shards = list(self._open.values())
            self._open.clear()
            self._by_key.clear()
        for shard in shards:
            os.close(shard.fd)
            shard.path.unlink(missing_ok=True)
        return [s.plan for s in shards]


def _pwrite_all(fd: int, data: memoryview | bytes, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n
