"""The driver's row reader (job/backends/vllm_rows.py) against an in-memory ring: rows matched to
pending samples by request id and checked against their ids and positions, slots released in step
order once every chunk of a step is written, recomputed rows dropped, generation rows skipped, and
the worker's errors and a dead executor surfacing while the reader waits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

from job.backends.vllm_rows import RowReader
from job.worker.ring import GENERATION_PREFIX

LAYERS, HIDDEN, MAX_TOKENS, SLOTS = 2, 4, 8, 2


@dataclass
class FakeSlot:
    rows: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_TOKENS, LAYERS, HIDDEN))
    input_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_TOKENS, dtype=torch.int32))
    positions: torch.Tensor = field(default_factory=lambda: torch.zeros(MAX_TOKENS, dtype=torch.int32))
    finite: torch.Tensor = field(default_factory=lambda: torch.ones(MAX_TOKENS, dtype=torch.uint8))
    scales: torch.Tensor | None = None


class FakeRing:
    """What the worker side of job.worker.ring.Ring does, in memory: steps published into
    ``step % SLOTS``, each only once the driver released the step that used the slot before."""

    slot_count = SLOTS

    def __init__(self) -> None:
        self.slots = [FakeSlot() for _ in range(SLOTS)]
        self.headers: dict[int, dict[str, Any]] = {}
        self.published = 0
        self.released = 0
        self.worker_error: str | None = None

    def slot(self, step: int) -> FakeSlot:
        return self.slots[step % SLOTS]

    def set_released(self, value: int) -> None:
        assert value >= self.released, "released only moves forward"
        self.released = value

    def read_header(self, step: int) -> dict[str, Any]:
        return self.headers[step]

    def publish(self, reqs: list[tuple[str, list[int], list[int]]]) -> None:
        """One step: (request id, input ids, positions) in batch order; row values = position."""
        step = self.published
        assert step - self.released < SLOTS, "the worker would overwrite a slot the driver holds"
        slot, offset = self.slot(step), 0
        for _, ids, positions in reqs:
            n = len(ids)
            slot.input_ids[offset : offset + n] = torch.tensor(ids, dtype=torch.int32)
            slot.positions[offset : offset + n] = torch.tensor(positions, dtype=torch.int32)
            slot.rows[offset : offset + n] = torch.tensor(positions, dtype=torch.float32)[:, None, None]
            offset += n
        self.headers[step] = {"step": step, "num_tokens": offset, "reqs": [[r, len(i)] for r, i, _ in reqs]}
        self.published += 1


def _reader(ring: FakeRing, executor_alive: bool = True) -> RowReader:
    def check_executor() -> None:
        if not executor_alive:
            raise RuntimeError("a vLLM worker process died")

    return RowReader(ring, check_executor)


IDS_A = np.arange(100, 106, dtype=np.int32)  # 6 tokens
IDS_B = np.arange(200, 203, dtype=np.int32)  # 3 tokens


def test_rows_are_matched_checked_and_released_in_step_order() -> None:
    ring = FakeRing()
    reader = _reader(ring)
    reader.expect("a", IDS_A, destination="slot-a")
    reader.expect("b", IDS_B, destination="slot-b")
    ring.publish([("a", [100, 101, 102, 103], [0, 1, 2, 3]), ("b", [200, 201, 202], [0, 1, 2])])
    ring.publish([("a", [104, 105], [4, 5])])
    first, second = reader.take(), reader.take()
    assert [(c.sample_id, c.start, c.last, c.destination) for c in first] == [
        ("a", 0, False, "slot-a"),
        ("b", 0, True, "slot-b"),
        ("a", 4, True, "slot-a"),
    ]
    assert second == [] and not reader.pending and reader.taken == 2
    assert first[0].rows[:, 0, 0].tolist() == [0, 1, 2, 3] and first[2].rows[:, 0, 0].tolist() == [4, 5]
    assert reader.stats["chunked_requests"] == 1 and reader.stats["max_requests_per_step"] == 2
    # Step 0's slot is free only once both of its chunks are written; step 1 waits for step 0.
    first[2].release()
    assert ring.released == 0
    first[0].release()
    assert ring.released == 0
    first[1].release()
    assert ring.released == 2


def test_recomputed_rows_after_a_preemption_are_dropped() -> None:
    ring = FakeRing()
    reader = _reader(ring)
    reader.expect("a", IDS_A, destination=None)
    ring.publish([("a", [100, 101, 102], [0, 1, 2])])
    (chunk,) = reader.take()
    chunk.release()
    ring.publish([("a", [100, 101, 102, 103, 104], [0, 1, 2, 3, 4])])  # recomputed from the start
    (again,) = reader.take()
    assert (again.start, again.rows[:, 0, 0].tolist()) == (3, [3, 4])
    assert reader.stats["recomputed_rows"] == 3


def test_generation_rows_are_skipped_and_unknown_requests_refused() -> None:
    ring = FakeRing()
    reader = _reader(ring)
    reader.expect("b", IDS_B, destination=None)
    ring.publish([(GENERATION_PREFIX + "x#0", [7, 8], [0, 1]), ("b", [200, 201, 202], [0, 1, 2])])
    (chunk,) = reader.take()
    assert chunk.sample_id == "b" and chunk.rows[:, 0, 0].tolist() == [0, 1, 2]
    ring.publish([("stranger", [1], [0])])
    with pytest.raises(RuntimeError, match="request stranger, which is not pending"):
        reader.take()


def test_rows_that_do_not_match_the_samples_ids_are_refused() -> None:
    ring = FakeRing()
    reader = _reader(ring)
    reader.expect("a", IDS_A, destination=None)
    ring.publish([("a", [100, 999], [0, 1])])
    with pytest.raises(RuntimeError, match="capture misaligned for sample a at step 0"):
        reader.take()


def test_drain_waits_for_the_worker_and_names_its_error_or_death() -> None:
    ring = FakeRing()
    reader = _reader(ring)
    reader.expect("b", IDS_B, destination=None)
    ring.publish([("b", [200, 201, 202], [0, 1, 2])])
    assert [c.sample_id for c in reader.drain(lambda: reader.taken >= 1)] == ["b"]
    ring.worker_error = "capture hook (decoder-layer outputs): layer id 2: TypeError: boom"
    with pytest.raises(RuntimeError, match="capture worker failed: capture hook"):
        list(reader.drain(lambda: reader.taken >= 2))
    dead = _reader(FakeRing(), executor_alive=False)
    with pytest.raises(RuntimeError, match="worker process died"):
        list(dead.drain(lambda: dead.taken >= 1))
