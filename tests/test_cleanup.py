"""Cleanup: a failing clean-up step never replaces the error that ended the run."""

from __future__ import annotations

import pytest
from structlog.testing import capture_logs

from job.errors import ConfigError
from job.logs import get_logger
from job.pipeline.cleanup import Cleanup


def failing(message: str) -> None:
    raise OSError(message)


def test_the_runs_error_stays_and_every_step_still_runs() -> None:
    ran: list[str] = []
    with (
        capture_logs() as events,
        pytest.raises(ConfigError, match="too many rejected"),
        Cleanup(get_logger()) as cleanup,
    ):
        cleanup.callback(ran.append, "first registered")
        cleanup.callback(failing, "the store is gone")
        cleanup.callback(ran.append, "last registered")
        raise ConfigError("too many rejected")
    assert ran == ["last registered", "first registered"]
    [event] = [e for e in events if e["event"] == "cleanup_failed"]
    assert event["step"] == "failing"
    assert event["error"] == "OSError: the store is gone"
    assert event["kept_error"] == "ConfigError: too many rejected"


def test_after_a_clean_run_the_first_clean_up_error_is_raised_and_the_next_logged() -> None:
    ran: list[str] = []
    with (
        capture_logs() as events,
        pytest.raises(OSError, match="first to fail"),
        Cleanup(get_logger()) as cleanup,
    ):
        cleanup.callback(failing, "second to fail")
        cleanup.callback(ran.append, "between")
        cleanup.callback(failing, "first to fail")
    assert ran == ["between"]
    [event] = [e for e in events if e["event"] == "cleanup_failed"]
    assert (event["error"], event["kept_error"]) == ("OSError: second to fail", "OSError: first to fail")


def test_a_clean_run_with_clean_steps_raises_nothing() -> None:
    ran: list[int] = []
    with Cleanup(get_logger()) as cleanup:
        cleanup.callback(ran.append, 1)
        cleanup.callback(ran.append, 2)
    assert ran == [2, 1]
