"""Structured logging: JSON lines on stdout (console renderer on a TTY) and the
same JSON events in a file that the output sink ships to ``index-*/logs/``.

Library logs (vLLM, transformers, botocore) are routed through the same chain,
and every string is scrubbed of the secret values found in the environment. vLLM's
worker processes log through it too (``configure_worker_logging``), tagged
``component: vllm_worker``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import multiprocessing
import os
import sys
import threading
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

import structlog

if TYPE_CHECKING:
    from job.settings import LogSettings

# How the driver logs, for vLLM's worker processes, which inherit the environment:
# configure_logging and the log file set it, configure_worker_logging reads it.
WORKER_LOGGING_ENV = "EAGLE3_WORKER_LOGGING"

# Values of these variables never appear in logs, whatever logged them.
SECRET_ENV_VARS = (
    "AWS_SECRET_ACCESS_KEY",
    "AWS_SESSION_TOKEN",
    "AWS_SECURITY_TOKEN",
    "AWS_ACCESS_KEY_ID",
    "HF_TOKEN",
    "HUGGING_FACE_HUB_TOKEN",
)


class _SecretScrubber:
    def __init__(self) -> None:
        self.refresh()

    def refresh(self) -> None:
        values = {os.environ.get(name, "") for name in SECRET_ENV_VARS}
        self.values = sorted((v for v in values if len(v) >= 4), key=len, reverse=True)

    def scrub(self, value: Any) -> Any:
        if isinstance(value, str):
            for secret in self.values:
                if secret in value:
                    value = value.replace(secret, "***")
            return value
        if isinstance(value, dict):
            return {k: self.scrub(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.scrub(v) for v in value]
        return value

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        return {k: self.scrub(v) for k, v in event_dict.items()}


class _FileTee:
    """Appends each event, as one JSON line, to the current log file (if any)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._file: IO[str] | None = None
        self.path: Path | None = None
        self.failed: str | None = None  # why the file stopped receiving events

    def open(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._lock:
            if self._file is not None:
                self._file.close()
            # Line-buffered: the output sink ships this file while the run goes on (and a kill -9
            # loses nothing already logged), so every event must reach the file whole.
            self._file = path.open("a", encoding="utf-8", buffering=1)
            self.path = path
        _export_worker_logging(file=str(path))

    @property
    def open_path(self) -> str | None:
        """The file events go to now; None when none is open."""
        return None if self._file is None else str(self.path)

    def flush(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self._file is not None:
                self._file.flush()

    def close(self) -> None:
        with self._lock, contextlib.suppress(OSError):
            if self._file is not None:
                self._file.close()
        self._file = None
        _export_worker_logging(file=None)

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        if self._file is not None:
            line = json.dumps({k: v for k, v in event_dict.items() if not k.startswith("_")}, default=str)
            with self._lock:
                if self._file is not None:
                    try:
                        self._file.write(line + "\n")
                    except OSError as exc:
                        # A full disk must not turn every log call into a crash: the events go on
                        # to stdout, and the run's own error (if any) says what happened.
                        self.failed = f"{self.path}: {exc.strerror}"
                        with contextlib.suppress(OSError):
                            self._file.close()
                        self._file = None
        return event_dict


scrubber = _SecretScrubber()
log_file = _FileTee()
_configured = threading.Event()  # configure_logging ran in this process


def configure_logging(
    settings: LogSettings,
    stream: IO[str] | None = None,
    event_prefix: str = "",
    defaults: dict[str, str] | None = None,
) -> None:
    """Configure structlog and the stdlib root logger once per process. ``event_prefix`` (the
    preflight's process): every event not named with it is renamed ``<prefix>.<event>``, so the
    run that follows is the only one logging ``run_started``, ``capture_installed``, ...
    ``defaults``: fields given to every record that lacks them (a library's records)."""
    stream = stream or sys.stdout
    scrubber.refresh()
    use_console = settings.format == "console" or (settings.format == "auto" and stream.isatty())
    level = getattr(logging, settings.level.upper())
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        # Tracebacks as data, without local variables: they are huge and may hold secrets.
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        ),
        scrubber,
        log_file,
    ]
    if event_prefix:
        shared.insert(0, _EventPrefix(event_prefix))
    if defaults:
        shared.insert(0, _Defaults(defaults))
    renderer: Any = (
        structlog.dev.ConsoleRenderer(colors=False)
        if use_console
        else structlog.processors.JSONRenderer(default=str)
    )
    if use_console:  # the console renders text; the file and JSON keep the traceback as data
        shared.append(_exception_as_text)
    structlog.configure(
        processors=[*shared, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.WriteLoggerFactory(file=stream),
        cache_logger_on_first_use=False,
    )
    handler = logging.StreamHandler(stream)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]  # a library's basicConfig (xgrammar's, as vLLM imports it) included
    _configured.set()
    root.setLevel(max(level, logging.INFO))
    # vLLM installs its own handlers unless told not to; ours render its records.
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    # Whole, not merged: what a parent process exported (its own log file) is not this one's.
    os.environ[WORKER_LOGGING_ENV] = json.dumps(
        {
            "level": settings.level,
            "format": "console" if use_console else "json",
            "event_prefix": event_prefix,
            "file": log_file.open_path,
        }
    )


def _export_worker_logging(**changes: Any) -> None:
    current = json.loads(os.environ.get(WORKER_LOGGING_ENV) or "{}")
    os.environ[WORKER_LOGGING_ENV] = json.dumps({**current, **changes})


def configure_worker_logging() -> None:
    """In a vLLM worker process, which vLLM starts with the driver's environment: log as the
    driver does (format, level, secrets scrubbed), to stdout and the driver's log file, each
    record tagged ``component: vllm_worker`` and ``process: VllmWorker-<rank>``. Without this,
    vLLM's worker-side records (model load, compilation, CUDA graphs: where start-up time goes)
    were lost below warning level and printed as plain text above it (by Python's last resort, or
    a handler a library's import added). Nothing to do outside a worker of this job's driver, or
    where this process configured its logging already (an in-process worker)."""
    spec = os.environ.get(WORKER_LOGGING_ENV)
    if not spec or _configured.is_set():
        return
    from job.settings import LogSettings

    options = json.loads(spec)
    settings = LogSettings(level=options["level"], format=options["format"])
    # vLLM names its worker processes VllmWorker-<rank>: which TP rank logged a record.
    worker = {"component": "vllm_worker", "process": multiprocessing.current_process().name}
    configure_logging(settings, event_prefix=options.get("event_prefix", ""), defaults=worker)
    if options.get("file"):
        log_file.open(Path(options["file"]))


class _Defaults:
    def __init__(self, fields: dict[str, str]) -> None:
        self.fields = fields

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        for key, value in self.fields.items():
            event_dict.setdefault(key, value)
        return event_dict


class _EventPrefix:
    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def __call__(self, _logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
        event = event_dict.get("event")
        # Event names only: a library's log record has its message there.
        if isinstance(event, str) and event.isidentifier() and not event.startswith(self.prefix):
            event_dict["event"] = f"{self.prefix}.{event}"
        return event_dict


def _exception_as_text(_logger: Any, _name: str, event_dict: dict[str, Any]) -> dict[str, Any]:
    """ConsoleRenderer wants the traceback as a string, not the list of dicts the log file holds."""
    stack = event_dict.get("exception")
    if isinstance(stack, list):
        lines = []
        for exc in stack:
            for frame in exc.get("frames", []):
                lines.append(
                    f'  File "{frame.get("filename")}", line {frame.get("lineno")}, in {frame.get("name")}'
                )
            lines.append(f"{exc.get('exc_type')}: {exc.get('exc_value')}")
        event_dict["exception"] = "\n".join(lines)
    return event_dict


def get_logger(**context: Any) -> Any:
    return structlog.get_logger().bind(**context)
