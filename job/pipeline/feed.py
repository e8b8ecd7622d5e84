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


def backend_inputs(
    samples: Iterator[EncodedSample],
    planner: ShardPlanner,
    writer: ShardWriter,
    store: IndexStore,
    stop: StopFlag,
) -> Iterator[BackendInput | None]:
    """The backend's input stream; it ends early, leaving any partly planned shard unopened, once
    ``stop`` is set. While staging is full it yields None ("nothing new yet") instead of blocking:
    the backend may hold unfinished samples whose shards must complete (and upload) before space
    frees up."""

    def start(plan: ShardPlan) -> Iterator[BackendInput | None]:
        nbytes = writer.layout(plan).total_bytes
        while (staged := store.stage_shard(plan.name, nbytes, STAGING_POLL_S)) is None:
            yield None
        writer.open(plan, staged)
        for sample in plan.samples:
            yield BackendInput(sample.sample_id, sample.input_ids)

    for sample in samples:
        if stop.is_set():
            return
        for plan in planner.add(sample):
            yield from start(plan)
    if stop.is_set():
        return
    for plan in planner.flush():
        yield from start(plan)
