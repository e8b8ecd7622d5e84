"""SIGTERM/SIGINT -> stop taking new work; the run then ends consistently."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import psutil
import structlog

from job.errors import EXIT_TERMINATED
from job.logs import get_logger

LOG_WAIT_S = 1.0  # for the stop event to be logged before the process ends
TIMESTAMP = structlog.processors.TimeStamper(fmt="iso", utc=True)  # as job.logs stamps events


class StopFlag:
    """Set by SIGTERM or SIGINT while the context lasts (signal handlers are installed only from the
    main thread; elsewhere, e.g. a benchmark's worker thread, ``request`` sets it)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name = ""
        self._previous: dict[int, Any] = {}
        # Called once, with the reason, when the first stop is requested: the run says at once what
        # it still has to finish (the stop itself may take minutes, a large shard on a CPU).
        self.on_request: Callable[[str], None] | None = None

    def __enter__(self) -> StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def is_set(self) -> bool:
        return self._event.is_set()

    def request(self, reason: str) -> None:
        first = not self._event.is_set()
        self.signal_name = reason
        self._event.set()
        if first and self.on_request is not None:
            # From another thread: a signal may land while this (main) thread holds the logger's lock.
            threading.Thread(target=self.on_request, args=(reason,), name="stop-report", daemon=True).start()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.request(signal.Signals(signum).name)


@contextlib.contextmanager
def exit_on_stop_signal(phase: str) -> Iterator[None]:
    """While the context lasts, SIGTERM/SIGINT end the process at once (``run_stopped`` with
    ``phase``, exit EXIT_TERMINATED).

    For the phases with nothing to make consistent: start-up, before the run touches its output
    (waiting would only let a model download run into the SIGKILL at the end of the grace
    period), and the engine's start-up, which may block for minutes in vLLM (an exit there is a
    kill -9 as far as the output goes: resume handles it). The handler must exist even so: as a
    container's PID 1, Python gets no default action for SIGTERM (the kernel drops signals PID 1
    has no handler for), so the signal would be ignored. ``os._exit``, not an exception: the hub
    download's thread pool would fetch every queued file before an exception got out, and
    ``resolve_model`` turns exceptions into a configuration error. The handlers before the
    context (the runner's graceful StopFlag) come back after it.
    """

    def stop_now(signum: int, _frame: Any) -> None:
        event = {"signal": signal.Signals(signum).name, "phase": phase, "exit_code": EXIT_TERMINATED}
        logged = threading.Event()

        def report() -> None:
            with contextlib.suppress(Exception):
                get_logger().warning("run_stopped", **event)
                sys.stdout.flush()
                logged.set()

        # Logged from another thread: the signal may have landed while this (main) thread held the
        # logger's lock, which it cannot release while in here; that thread would then wait forever.
        threading.Thread(target=report, daemon=True).start()
        if not logged.wait(LOG_WAIT_S):
            line = TIMESTAMP(None, "warning", {"event": "run_stopped", **event, "level": "warning"})
            with contextlib.suppress(OSError):
                os.write(sys.stdout.fileno(), (json.dumps(line) + "\n").encode())
        # vLLM's workers watch for their parent's end, the tokenizer pool's workers do not (they
        # wait on their queue forever): none outlives the job.
        for child in psutil.Process().children(recursive=True):
            with contextlib.suppress(psutil.Error):
                child.kill()
        os._exit(EXIT_TERMINATED)

    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return
    previous = {sig: signal.signal(sig, stop_now) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
