"""SIGTERM/SIGINT -> stop taking new work; the run then ends consistently."""

from __future__ import annotations

import signal
import threading
from typing import Any


class StopFlag:
    """Set by SIGTERM or SIGINT while the context lasts (signal handlers are installed only from the
    main thread; elsewhere, e.g. a benchmark's worker thread, ``request`` sets it)."""

    def __init__(self) -> None:
        self._event = threading.Event()
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

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
        self.signal_name = reason
        self._event.set()

    def _handle(self, signum: int, _frame: Any) -> None:
        self.request(signal.Signals(signum).name)
