"""Commit finished shards in the background, then record them in the manifest.

Order per shard: (repack without failed samples) -> ``store.commit_shard`` (fsync + rename
/ verified upload) -> (its sidecar of regenerated conversations, the same way) -> manifest
rewrite. The checksum comes with the finished shard (combined from its writes). A crash
anywhere before the manifest rewrite leaves unlisted files that the next run discards, so no
sample is ever listed twice or lost.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from job.backend_io import HiddenChunk
from job.checksum import ALGORITHM, crc64nvme_file
from job.data import exact_json
from job.data.encode import EncodedSample
from job.generate.stage import generation_counts
from job.layout import PARTIAL, regenerated_name
from job.manifest import Checksum, Manifest, RangeChecksums, Regenerated, ShardEntry
from job.shards.format import ShardContext, ShardPlan
from job.shards.writer import FinishedShard, ReservedShard, ShardSlot, ShardWriter
from job.storage.base import IndexStore
from job.storage.staging import StagedShard, StagingArea


class Committer:
    """``workers`` shards are committed at once (uploads overlap on object stores); the manifest
    is rewritten after each, one rewrite at a time."""

    def __init__(
        self,
        store: IndexStore,
        manifest: Manifest,
        manifest_version: str | None,
        context: ShardContext,
        on_rejected: Callable[[str, str], None],
        log: Any,
        workers: int = 1,
        regenerated: Callable[[list[str]], list[dict[str, Any]]] | None = None,
        pin: Callable[[], None] = lambda: None,
    ) -> None:
        """``regenerated``: with generate.mode, the sidecar lines of a shard's samples, by id.
        ``pin``: called once, before the first manifest that lists a shard or is complete (it
        writes the output's extraction.json)."""
        self.store = store
        self._regenerated = regenerated
        self.manifest = manifest
        self._version = manifest_version
        self._context = context
        self._on_rejected = on_rejected
        self._log = log
        self._pool = ThreadPoolExecutor(workers, thread_name_prefix="shard-committer")
        self._lock = threading.Lock()
        self.error: BaseException | None = None
        self.committed_samples = 0
        self.direct_io_bytes = 0  # of the shards committed by this run
        self._fallback_reported = False
        self._pin = pin
        self._pinned = False
        self._pending: set[str] = set()  # shards submitted and not yet committed (or dropped)

    def submit(self, finished: FinishedShard) -> None:
        """Commit a finished shard in the background (any thread)."""
        with self._lock:
            self._pending.add(finished.plan.name)
        self._pool.submit(self._run, finished)

    def pending(self) -> set[str]:
        """The shards submitted and not yet committed (any thread)."""
        with self._lock:
            return set(self._pending)

    def close(self) -> None:
        """Finish every submitted shard, then stop; raises the first commit error."""
        self._pool.shutdown(wait=True)
        self.store.drain()
        if self.error is not None:
            raise self.error

    def write_manifest(self, complete: bool = False, rejected: int | None = None) -> None:
        with self._lock:
            if rejected is not None:
                self.manifest.counts.rejected = rejected
            self.manifest.complete = complete
            if not self._pinned and (complete or self.manifest.shards):
                self._pin()
                self._pinned = True
            self._version = self.store.write_manifest(self.manifest.to_bytes(), self._version)

    def _run(self, finished: FinishedShard) -> None:
        try:
            if self.error is None:
                self._commit(finished)
                return
        except BaseException as exc:
            self.error = self.error or exc
        finally:
            with self._lock:
                self._pending.discard(finished.plan.name)
        # The run is failing: drop the shard and free its staging space, so that extraction
        # waiting for that space wakes up and sees the error.
        finished.staged.discard()

    def _commit(self, finished: FinishedShard) -> None:
        plan, checksum = finished.plan, finished.checksum
        if finished.failed:
            for sample in plan.samples:
                if sample.sample_id in finished.failed:
                    self._on_rejected(sample.sample_id, finished.failed[sample.sample_id])
            kept = [s for s in plan.samples if s.sample_id not in finished.failed]
            if not kept:
                finished.staged.discard()
                return
            checksum, ranges = _repack(
                finished.staged, plan, kept, self._context, self.store.staging_is_output
            )
            plan = ShardPlan(plan.number, kept)
        else:
            ranges = finished.ranges
        records = None
        if self._regenerated is not None:
            records = self._regenerated([s.sample_id for s in finished.plan.samples])
            records = [r for r in records if r["sample_id"] not in finished.failed]
        committed = self.store.commit_shard(finished.staged, checksum)
        entry = ShardEntry(
            name=committed.name,
            num_samples=len(plan.samples),
            num_tokens=plan.num_tokens,
            bytes=committed.bytes,
            checksum=Checksum(algorithm=ALGORITHM, value=committed.checksum),
            sample_ids=[s.sample_id for s in plan.samples],
            num_truncated=sum(s.truncated for s in plan.samples),
            regenerated=None if records is None else self._commit_sidecar(committed.name, records),
            ranges=ranges,
        )
        with self._lock:
            self.manifest.add_shard(entry)
            self.committed_samples = self.manifest.counts.written
            self.direct_io_bytes += finished.direct_bytes
        self.write_manifest()
        self._log.info(
            "shard_committed",
            shard=entry.name,
            samples=entry.num_samples,
            tokens=entry.num_tokens,
            bytes=entry.bytes,
            checksum=entry.checksum.value,
            direct_io_bytes=finished.direct_bytes,
        )
        if finished.buffered_row_bytes and not self._fallback_reported:
            self._fallback_reported = True  # once a run: the cause is the same for every shard
            self._log.warning(
                "direct_io_fallback",
                shard=entry.name,
                buffered_row_bytes=finished.buffered_row_bytes,
                reason="hidden-state rows were not block-aligned in memory, so they went through the page "
                "cache although the output takes direct I/O (slower, and the commit's fsync writes them)",
            )

    def _commit_sidecar(self, shard: str, records: list[dict[str, Any]]) -> Regenerated:
        """Write and commit the regenerated conversations of a committed shard's samples."""
        name = regenerated_name(shard)
        path = self.store.local_path(name + PARTIAL)
        with path.open("wb") as f:
            for record in records:
                f.write(exact_json.dumps(record) + b"\n")
        nbytes, checksum = path.stat().st_size, crc64nvme_file(path)
        self.store.commit_file(path, name, checksum)
        return Regenerated(
            name=name,
            bytes=nbytes,
            checksum=Checksum(algorithm=ALGORITHM, value=checksum),
            counts=generation_counts(records),
        )


def _repack(
    staged: StagedShard, plan: ShardPlan, kept: list[EncodedSample], context: ShardContext, direct_io: bool
) -> tuple[str, RangeChecksums]:
    """Rewrite ``staged`` with only the ``kept`` samples (written the way the run's own writer
    writes: ``direct_io`` only where staging is the output); returns the new checksums."""
    from safetensors import safe_open

    old_offsets = np.zeros(len(plan.samples) + 1, np.int64)
    np.cumsum([s.num_tokens for s in plan.samples], out=old_offsets[1:])
    position = {s.sample_id: i for i, s in enumerate(plan.samples)}
    repacked = ShardPlan(plan.number, kept)
    layout = context.layout(repacked)
    # Beside the original, outside any budget: the original's reservation covers the larger file.
    space = StagingArea(staged.path.parent, limit=None).reserve(staged.name + ".repack", layout.total_bytes)
    assert space is not None, "an unlimited staging area always has room"
    shard = ReservedShard(repacked, layout, space)
    finished: list[FinishedShard] = []
    writer = ShardWriter(context, finished.append, direct_io=direct_io, threads=1)
    with safe_open(str(staged.path), framework="pt") as src:
        hidden = src.get_slice("hidden_states")
        scales = src.get_slice("hidden_states_scale") if "hidden_states_scale" in src.keys() else None  # noqa: SIM118
        for new_position, sample in enumerate(kept):
            i = position[sample.sample_id]
            a, b = int(old_offsets[i]), int(old_offsets[i + 1])
            writer(
                HiddenChunk(
                    sample.sample_id,
                    0,
                    hidden[a:b].contiguous(),
                    None if scales is None else scales[a:b].contiguous(),
                    last=True,
                    nonfinite=False,
                    destination=ShardSlot(shard, new_position),
                )
            )
        writer.close()
    assert finished, "repacked shard did not complete"
    os.replace(finished[0].staged.path, staged.path)
    return finished[0].checksum, finished[0].ranges
