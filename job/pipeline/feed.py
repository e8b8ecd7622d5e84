"""Accepted samples -> shard plans -> staged, opened shards -> backend inputs.

A shard is opened (its staging space reserved, its file created) before any of its
samples reaches the backend, so every row the backend returns has a place to go.
"""

from __future__ import annotations

from collections.abc import Iterator

from job.backends import BackendInput
from job.data.encode import EncodedSample
from job.pipeline.stop import StopFlag
from job.shards.planner import ShardPlan, ShardPlanner
from job.shards.writer import ShardWriter
from job.storage.base import IndexStore

STAGING_POLL_S = 0.05


class BackendFeed:
    """The backend's input stream; it ends early, leaving any partly planned shard unopened, once
    ``stop`` is set. While staging is full it yields None ("nothing new yet") instead of blocking:
    the backend may hold unfinished samples whose shards must complete (and upload) before space
    frees up. Counts what it planned, for progress."""

    def __init__(
        self,
        samples: Iterator[EncodedSample],
        planner: ShardPlanner,
        writer: ShardWriter,
        store: IndexStore,
        stop: StopFlag,
    ) -> None:
        self._samples, self._planner, self._writer = samples, planner, writer
        self._store, self._stop = store, stop
        self.planned_tokens = 0
        self.all_planned = False  # the input ran out (not a stop): planned_tokens is the total

    def __iter__(self) -> Iterator[BackendInput | None]:
        for sample in self._samples:
            if self._stop.is_set():
                return
            self.planned_tokens += sample.num_tokens
            for plan in self._planner.add(sample):
                yield from self._start(plan)
        if self._stop.is_set():
            return
        self.all_planned = True
        for plan in self._planner.flush():
            yield from self._start(plan)

    def _start(self, plan: ShardPlan) -> Iterator[BackendInput | None]:
        nbytes = self._writer.layout(plan).total_bytes
        while (staged := self._store.stage_shard(plan.name, nbytes, STAGING_POLL_S)) is None:
            yield None
        self._writer.open(plan, staged)
        for sample in plan.samples:
            yield BackendInput(sample.sample_id, sample.input_ids)
