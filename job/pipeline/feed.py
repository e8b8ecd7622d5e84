"""Accepted samples -> shard plans -> reserved shards -> backend inputs.

Samples are grouped, in input order, into shards of about ``output.shard_bytes``: token counts
are known once a sample is tokenized, so a shard's members, and therefore its whole safetensors
header, are fixed before the backend sees them. A shard's staging space is reserved (its file
created at its final size) before any of its samples reaches the backend, and each sample goes
to the backend with its place in that shard (``ShardSlot``), so every row the backend returns
has a place to go. With regeneration (generate.mode), conversations first become generation
requests; the samples they turn into are planned as they finish (job.generate.stage).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from job.backend_io import AbandonGenerations, BackendInput, GenerationInput
from job.data.encode import EncodedSample, GenerationStart, RejectedSample
from job.generate.stage import Regenerator
from job.pipeline.stop import StopFlag
from job.shards.format import ShardContext, ShardPlan
from job.shards.writer import ReservedShard, ShardSlot
from job.storage.staging import StagingArea

STAGING_POLL_S = 0.05


class ShardPlanner:
    """A shard closes when the next sample would push it past ``shard_bytes`` (a sample larger
    than that gets a shard of its own); numbers count up from ``first_number``."""

    def __init__(self, shard_bytes: int, bytes_per_token: int, first_number: int) -> None:
        self.shard_bytes = shard_bytes
        self.bytes_per_token = bytes_per_token
        self.next_number = first_number
        self._pending: list[EncodedSample] = []
        self._pending_bytes = 0

    def add(self, sample: EncodedSample) -> Iterator[ShardPlan]:
        """The shards ``sample`` completes (none, one, or two when it does not fit the open one)."""
        size = sample.num_tokens * self.bytes_per_token
        if self._pending and self._pending_bytes + size > self.shard_bytes:
            yield self._emit()
        self._pending.append(sample)
        self._pending_bytes += size
        if self._pending_bytes >= self.shard_bytes:
            yield self._emit()

    @property
    def open_samples(self) -> int:
        """Samples of the shard being filled."""
        return len(self._pending)

    def flush(self) -> Iterator[ShardPlan]:
        """The partly filled shard: at the end of the input, or early (see BackendFeed)."""
        if self._pending:
            yield self._emit()

    def _emit(self) -> ShardPlan:
        plan = ShardPlan(self.next_number, self._pending)
        self.next_number += 1
        self._pending, self._pending_bytes = [], 0
        return plan


class BackendFeed:
    """The backend's input stream; it ends early, leaving any partly planned shard unreserved,
    once ``stop`` is set. While staging is full, or while only generation is under way, it
    yields None ("nothing new yet") instead of blocking: the backend holds work that must go on
    first. Counts what it planned, for progress.

    With regeneration, once every conversation has started, a shard closes before it is full as
    soon as it holds as many samples as there are conversations still under way: no conversation
    will start any more, so waiting would leave its samples to be extracted after the last turn,
    with nothing to generate beside them. Closing at half of what is left keeps such shards few:
    about log2(conversations under way) of them."""

    def __init__(
        self,
        samples: Iterator[EncodedSample | GenerationStart],
        planner: ShardPlanner,
        context: ShardContext,
        staging: StagingArea,
        stop: StopFlag,
        regenerator: Regenerator | None = None,
        reject: Callable[[str, str], None] | None = None,
    ) -> None:
        self._samples, self._planner, self._context = samples, planner, context
        self._staging, self._stop = staging, stop
        self._regenerator, self._reject = regenerator, reject
        self._reserved: list[ReservedShard] = []  # reserved and not yet given back
        self.planned_tokens = 0
        self.all_planned = False  # the input ran out (not a stop): planned_tokens is the total

    def __iter__(self) -> Iterator[BackendInput | GenerationInput | AbandonGenerations | None]:
        samples = iter(self._samples)
        exhausted = False
        regenerator = self._regenerator
        while not self._stop.is_set():
            if regenerator is not None:
                yield from self._regenerated(regenerator, all_started=exhausted)
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
            if regenerator is not None:
                yield AbandonGenerations()
            return
        self.all_planned = True
        for plan in self._planner.flush():
            yield from self._start(plan)

    def _regenerated(
        self, regenerator: Regenerator, all_started: bool
    ) -> Iterator[BackendInput | GenerationInput | None]:
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
        if all_started and regenerator.active and self._planner.open_samples >= regenerator.active:
            for plan in self._planner.flush():
                yield from self._start(plan)

    def _plan(self, sample: EncodedSample) -> Iterator[BackendInput | None]:
        self.planned_tokens += sample.num_tokens
        for plan in self._planner.add(sample):
            yield from self._start(plan)

    def under_way(self) -> list[ShardPlan]:
        """The shards reserved and not yet committed (any thread: a snapshot)."""
        return [r.plan for r in list(self._reserved) if not r.staged.released]

    def abandon(self) -> list[ShardPlan]:
        """Give back the staging space of every reserved shard not committed (its file is
        deleted; its samples are redone by a later run); returns their plans. Call it once
        nothing writes or commits any more."""
        left = [r for r in self._reserved if not r.staged.released]
        for reserved in left:
            reserved.staged.discard()
        self._reserved = []
        return [r.plan for r in left]

    def _start(self, plan: ShardPlan) -> Iterator[BackendInput | None]:
        layout = self._context.layout(plan)
        while (staged := self._staging.reserve(plan.name, layout.total_bytes, STAGING_POLL_S)) is None:
            yield None
        shard = ReservedShard(plan, layout, staged)
        self._reserved = [r for r in self._reserved if not r.staged.released] + [shard]
        for position, sample in enumerate(plan.samples):
            yield BackendInput(sample.sample_id, sample.input_ids, ShardSlot(shard, position))
