"""The driver's side of the capture ring: which rows of a published step belong to which pending
sample, checked against the sample's own token ids and positions, and when a slot may be reused.

``RowReader`` knows the ring only through ``RingView`` (what ``job.worker.ring.Ring`` offers the
driver), so it is tested against an in-memory ring (``tests/test_vllm_rows.py``).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from job.backend_io import HiddenChunk
from job.worker.ring import GENERATION_PREFIX


class RingView(Protocol):
    """The driver's view of the capture ring."""

    @property
    def published(self) -> int: ...

    @property
    def released(self) -> int: ...

    @property
    def worker_error(self) -> str | None: ...

    @property
    def slot_count(self) -> int: ...

    def slot(self, step: int) -> Any: ...

    def set_released(self, value: int) -> None: ...

    def read_header(self, step: int) -> dict[str, Any]: ...


@dataclass
class Pending:
    input_ids: np.ndarray
    destination: Any
    received: int = 0


class Releases:
    """Slot refcounts; advances the ring's ``released`` word in step order."""

    def __init__(self, ring: RingView) -> None:
        self._ring = ring
        self._lock = threading.Lock()
        self._remaining: dict[int, int] = {}
        self._next = 0

    def hold(self, step: int, count: int) -> None:
        with self._lock:
            self._remaining[step] = count
            self._advance()

    def release(self, step: int) -> None:
        with self._lock:
            self._remaining[step] -= 1
            self._advance()

    def _advance(self) -> None:
        while self._remaining.get(self._next) == 0:
            del self._remaining[self._next]
            self._next += 1
        self._ring.set_released(self._next)


class RowReader:
    """Pending extraction requests and the steps the worker published for them.

    ``taken`` counts the steps read over the reader's lifetime (the ring's counters run across
    ``extract()`` calls). ``check_executor`` raises when vLLM marked its executor failed (a
    worker died): the reader then stops waiting for rows that never come."""

    def __init__(self, ring: RingView, check_executor: Callable[[], None]) -> None:
        self.ring = ring
        self.pending: dict[str, Pending] = {}  # by sample id
        self.releases = Releases(ring)
        self.taken = 0
        self._check_executor = check_executor
        self.stats = {"max_requests_per_step": 0, "chunked_requests": 0, "tokens": 0, "recomputed_rows": 0}

    def expect(self, sample_id: str, input_ids: np.ndarray, destination: Any) -> None:
        self.pending[sample_id] = Pending(input_ids, destination)

    def check_worker(self) -> None:
        error = self.ring.worker_error
        if error:
            raise RuntimeError(f"capture worker failed: {error}")
        self._check_executor()

    def drain(self, done: Callable[[], bool]) -> Iterator[HiddenChunk]:
        """Hand on published steps until ``done()``: the worker publishes asynchronously."""
        while not done():
            chunks = self.take()
            yield from chunks
            self.check_worker()
            if not chunks:
                time.sleep(0.0005)

    def take(self) -> list[HiddenChunk]:
        """Chunks of every step the worker has published and the driver has not read yet. A
        step's rows of generation requests are dropped; so are an extraction request's rows it
        already has (vLLM recomputes a preempted request from its start)."""
        chunks: list[HiddenChunk] = []
        published = self.ring.published
        while self.taken < published:
            step = self.taken
            header = self.ring.read_header(step)
            slot = self.ring.slot(step)
            self.stats["max_requests_per_step"] = max(
                self.stats["max_requests_per_step"], len(header["reqs"])
            )
            self.stats["tokens"] += header["num_tokens"]
            step_chunks: list[HiddenChunk] = []
            offset = 0
            for request_id, count in header["reqs"]:
                if request_id in self.pending:
                    chunk = self._rows(step, slot, request_id, offset, count)
                    if chunk is not None:
                        step_chunks.append(chunk)
                elif not request_id.startswith(GENERATION_PREFIX):
                    raise RuntimeError(
                        f"capture: step {step} holds rows of request {request_id}, which is not pending"
                    )
                offset += count
            self.releases.hold(step, len(step_chunks))
            chunks.extend(step_chunks)
            self.taken += 1
        return chunks

    def _rows(self, step: int, slot: Any, sample_id: str, offset: int, count: int) -> HiddenChunk | None:
        """One extraction request's rows of a step, checked against its own ids and positions."""
        state = self.pending[sample_id]
        a, b = offset, offset + count
        positions = slot.positions.numpy()[a:b]
        first = int(positions[0]) if count else state.received
        if not (
            first <= state.received
            and np.array_equal(positions, np.arange(first, first + count))
            and np.array_equal(slot.input_ids.numpy()[a:b], state.input_ids[first : first + count])
        ):
            raise RuntimeError(
                f"capture misaligned for sample {sample_id} at step {step}: tokens {first}..{first + count} "
                f"(after {state.received} received) do not match the step's input ids/positions"
            )
        if first < state.received:  # recomputed after a preemption: keep only the rows that are new
            self.stats["recomputed_rows"] += min(count, state.received - first)
            a += state.received - first
        start, stop = state.received, first + count
        if stop <= start:
            return None
        state.received = stop
        last = stop == len(state.input_ids)
        if start == 0 and not last:
            self.stats["chunked_requests"] += 1
        if last:
            del self.pending[sample_id]
        releases = self.releases
        return HiddenChunk(
            sample_id=sample_id,
            start=start,
            rows=slot.rows[a:b],
            scales=None if slot.scales is None else slot.scales[a:b],
            last=last,
            nonfinite=not bool(slot.finite.numpy()[a:b].all()),
            release=lambda: releases.release(step),
            destination=state.destination,
        )
