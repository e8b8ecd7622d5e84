"""The capture ring between a TP worker and the driver, in process: two views of one
shared-memory file, as the worker and the driver map it."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
import torch

from job.worker.ring import Ring, header_bytes


@pytest.fixture(params=["bfloat16", "fp8_e4m3"])
def rings(request: pytest.FixtureRequest, tmp_path) -> Iterator[tuple[Ring, Ring]]:
    driver = Ring.create(
        str(tmp_path),
        slots=2,
        max_tokens=16,
        num_layers=3,
        hidden_size=8,
        dtype_name=request.param,
        header_bytes=header_bytes(max_requests=4, max_request_id_bytes=32),
    )
    worker = Ring(driver.spec, create=False)
    yield driver, worker
    worker.close(unlink=False)
    driver.close(unlink=True)


def test_a_published_step_reaches_the_driver(rings: tuple[Ring, Ring]) -> None:
    driver, worker = rings
    slot = worker.wait_free(0, timeout_s=1)
    rows = torch.randn(5, 3, 8).to(driver.spec.dtype.torch)
    slot.rows[:5].copy_(rows)
    slot.input_ids[:5].copy_(torch.arange(5, dtype=torch.int32))
    assert driver.published == 0
    worker.publish(0, {"step": 0, "num_tokens": 5, "reqs": [["a", 2], ["b", 3]]})
    assert driver.published == 1
    assert driver.read_header(0)["reqs"] == [["a", 2], ["b", 3]]
    view = driver.slots[0]
    assert torch.equal(view.rows[:5].view(torch.uint8), rows.view(torch.uint8))
    assert view.input_ids[:5].tolist() == [0, 1, 2, 3, 4]
    assert (view.scales is not None) == driver.spec.dtype.scaled


def test_a_slot_is_reused_only_after_the_driver_released_its_step(rings: tuple[Ring, Ring]) -> None:
    driver, worker = rings
    for step in (0, 1):  # two slots
        worker.wait_free(step, timeout_s=1)
        worker.publish(step, {"step": step, "num_tokens": 0, "reqs": []})
    with pytest.raises(TimeoutError, match="slot for step 2 not released"):
        worker.wait_free(2, timeout_s=0.05)
    driver.set_released(1)
    assert worker.wait_free(2, timeout_s=1) is worker.slots[0]


def test_a_worker_error_is_visible_to_the_driver(rings: tuple[Ring, Ring]) -> None:
    driver, worker = rings
    assert driver.worker_error is None
    worker.report_error("capture failed: boom")
    assert driver.worker_error == "capture failed: boom"


def test_the_header_holds_the_longest_ids_it_was_sized_for(rings: tuple[Ring, Ring]) -> None:
    driver, worker = rings
    worst = "\x00" * 32  # every byte JSON-escaped to six
    header = {"step": 0, "num_tokens": 4 * 10**6, "reqs": [[worst, 10**6]] * 4}
    assert len(json.dumps(header)) + 8 <= driver.spec.header_bytes
    worker.publish(0, header)
    assert driver.read_header(0)["reqs"][0][0] == worst
    with pytest.raises(ValueError, match="does not fit"):
        worker.publish(1, {"reqs": [["x" * driver.spec.header_bytes, 1]]})
