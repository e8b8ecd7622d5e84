"""StopFlag: SIGTERM and SIGINT are caught while the context lasts, and the previous handlers
come back after it."""

from __future__ import annotations

import os
import signal

import pytest

from job.pipeline.stop import StopFlag


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_sets_the_flag_and_handlers_are_restored(sig: signal.Signals) -> None:
    before = signal.getsignal(sig)
    with StopFlag() as stop:
        assert not stop.is_set()
        os.kill(os.getpid(), sig)
        assert stop.is_set() and stop.signal_name == sig.name
    assert signal.getsignal(sig) is before


def test_a_stop_can_be_requested_without_a_signal() -> None:
    with StopFlag() as stop:
        stop.request("benchmark finished")
        assert stop.is_set() and stop.signal_name == "benchmark finished"
