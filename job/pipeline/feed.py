"""Accepted samples -> shard plans -> staged, opened shards -> backend inputs.

A shard is opened (its staging space reserved, its file created) before any of its
samples reaches the backend, so every row the backend returns has a place to go. With
regeneration (generate.mode), conversations first become generation requests; the samples
they turn into are planned as they finish (job.generate.stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from job.backends import BackendInput, GenerationInput
from job.data.encode import EncodedSample, GenerationStart, RejectedSample
from job.generate.stage import Regenerator
from job.pipeline.stop import StopFlag
from job.shards.planner import ShardPlan, ShardPlanner
from job.shards.writer import ShardWriter
from job.storage.staging import StagingArea

STAGING_POLL_S = 0.05


class BackendFeed:
    """The backend's input stream; it ends early, leaving any partly planned shard unopened, once
    ``stop`` is set. While staging is full, or while only generation is under way, it yields
    None ("nothing new yet") instead of blocking: the backend holds work that must go on first.
    Counts what it planned, for progress."""

    def __init__(
        self,
        samples: Iterator[EncodedSample | GenerationStart],
        planner: ShardPlanner,
        writer: ShardWriter,
        staging: StagingArea,
        stop: StopFlag,
        regenerator: Regenerator | None = None,
        reject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._samples, self._planner, self._writer = samples, planner, writer
        self._staging, self._stop = staging, stop
        self._regenerator, self._reject = regenerator, reject
        self.planned_tokens = 0
        self.all_planned = False  # the input ran out (not a stop): planned_tokens is the total

    def __iter__(self) -> Iterator[BackendInput | GenerationInput | None]:
        samples = iter(self._samples)
        exhausted = False
        regenerator = self._regenerator
        while not self._stop.is_set():
            if regenerator is not None:
                yield from self._regenerated(regenerator)
            if exhausted or (regenerator is not None and not regenerator.has_room):
                if regenerator is None or not (
                    regenerator.active or regenerator.ready or regenerator.finished
                ):
                    break
                yield None  # turns in flight: the backend runs them
                continue
            item = next(samples, None)
            if item is None:
                exhausted = True
            elif isinstance(item, GenerationStart):
                assert regenerator is not None, "a conversation to regenerate without generate.mode"
                regenerator.start(item)
            else:
                yield from self._plan(item)
        if self._stop.is_set():
            return
        self.all_planned = True
        for plan in self._planner.flush():
            yield from self._start(plan)

    def _regenerated(self, regenerator: Regenerator) -> Iterator[BackendInput | GenerationInput | None]:
        """Turns ready to generate, then the samples regeneration finished."""
        while regenerator.ready:
            yield regenerator.ready.popleft()
        while regenerator.finished:
            item = regenerator.finished.popleft()
            if isinstance(item, RejectedSample):
                assert self._reject is not None
                self._reject(item.sample_id, item.reason)
            else:
                yield from self._plan(item)

    def _plan(self, sample: EncodedSample) -> Iterator[BackendInput | None]:
        self.planned_tokens += sample.num_tokens
        for plan in self._planner.add(sample):
            yield from self._start(plan)

    def _start(self, plan: ShardPlan) -> Iterator[BackendInput | None]:
        while not self._writer.open(plan, self._staging, STAGING_POLL_S):
            yield None
        for sample in plan.samples:
            yield BackendInput(sample.sample_id, sample.input_ids)
