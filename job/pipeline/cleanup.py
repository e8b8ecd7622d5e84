"""A run's clean-up, which never replaces the error that ended the run.

With a plain ``ExitStack`` a clean-up step that fails while an error is on its way out takes
its place: a full disk that stopped the run with its own message (or a setting error, exit 2:
"do not retry") would surface as whatever the clean-up met next, under another exit code.
Here the error on its way out stays; a clean-up failure beside it is logged
(``cleanup_failed``), and every later step still runs.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from types import TracebackType
from typing import Any


class Cleanup(ExitStack):
    def __init__(self, log: Any) -> None:
        super().__init__()
        self._log = log

    def callback(self, callback: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Callable[..., Any]:
        """Run ``callback(*args, **kwargs)`` at exit, in reverse order of registration."""

        def on_exit(
            _type: type[BaseException] | None, pending: BaseException | None, _tb: TracebackType | None
        ) -> bool:
            try:
                callback(*args, **kwargs)
            except Exception as exc:
                if pending is None:
                    raise
                self._log.error(
                    "cleanup_failed",
                    step=getattr(callback, "__qualname__", repr(callback)),
                    error=f"{type(exc).__name__}: {exc}",
                    kept_error=f"{type(pending).__name__}: {pending}",
                )
            return False

        self.push(on_exit)
        return callback
