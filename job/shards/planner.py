"""Group tokenized samples, in input order, into shards of about ``output.shard_bytes``.

Token counts are known once a sample is tokenized, so a shard's members, and therefore
its whole safetensors header, are fixed before the backend sees them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from job.data.encode import EncodedSample
from job.layout import shard_name


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

    def flush(self) -> Iterator[ShardPlan]:
        """The last, partly filled shard (at the end of the input)."""
        if self._pending:
            yield self._emit()

    def _emit(self) -> ShardPlan:
        plan = ShardPlan(self.next_number, self._pending)
        self.next_number += 1
        self._pending, self._pending_bytes = [], 0
        return plan
