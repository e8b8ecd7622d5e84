"""Command line: ``python -m job [run|config|plan|inspect] [--config FILE] [--key.sub=value ...]``."""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import Any

import yaml

from job.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, EXIT_TERMINATED, ConfigError, JobError
from job.logs import configure_logging, get_logger
from job.settings import JobSettings, load_settings, settings_dump

COMMANDS = {
    "run": "extract hidden states for this work index (the default)",
    "config": "print the effective settings (secrets redacted) and exit",
    "plan": "read and tokenize the data; print samples, tokens, bytes and shards for this index",
    "inspect": "summarize a shard file or an output directory",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m job",
        description="EAGLE-3 draft-training data: hidden states from a target model's prefill.",
        epilog="Any setting can be given as --section.key=value, e.g. --output.uri=s3://bucket/run1 "
        "(environment: JOB_OUTPUT__URI). `python -m job config` lists them all.",
    )
    parser.add_argument("command", nargs="?", default="run", choices=list(COMMANDS))
    parser.add_argument("path", nargs="?", help="inspect: shard file or output directory")
    parser.add_argument("--config", help="YAML settings file (over config/default.yaml)")
    parser.add_argument("--verify", action="store_true", help="inspect: recompute shard checksums")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        if args.command == "inspect":
            from job.inspect import inspect_path

            if not args.path:
                raise ConfigError("inspect needs a PATH (a shard file or an output directory)")
            print(inspect_path(args.path, verify=args.verify))
            return EXIT_OK
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "config":
        print(yaml.safe_dump(settings_dump(settings), sort_keys=False, allow_unicode=True), end="")
        return EXIT_OK
    configure_logging(settings.log)
    return _run_command(args.command, settings)


@contextlib.contextmanager
def _exit_on_stop_signal() -> Iterator[None]:
    """Until the run touches its output, SIGTERM/SIGINT end the process at once.

    There is nothing to make consistent yet, and waiting would only let a model
    download run into the SIGKILL at the end of the grace period. The handler
    must exist even so: as a container's PID 1, Python gets no default action
    for SIGTERM (the kernel drops signals PID 1 has no handler for), so the
    signal would be ignored. ``os._exit``, not an exception: the hub
    download's thread pool would fetch every queued file before an exception
    got out, and ``resolve_model`` turns exceptions into a configuration error.
    The runner installs its graceful handler before it opens the output.
    """

    def stop_now(signum: int, _frame: Any) -> None:
        with contextlib.suppress(Exception):  # the signal may land inside a write to stdout
            get_logger().warning(
                "run_stopped", signal=signal.Signals(signum).name, phase="startup", exit_code=EXIT_TERMINATED
            )
            sys.stdout.flush()
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


def _run_command(command: str, settings: JobSettings) -> int:
    log = get_logger()
    try:
        if command == "plan":
            from job.plan import plan_index

            print(plan_index(settings))
            return EXIT_OK
        with _exit_on_stop_signal():
            from job.runner import run_job

            run_job(settings)
        return EXIT_OK
    except JobError as exc:
        log.error("job_error", error=str(exc), exit_code=exc.exit_code)
        if exc.exit_code == EXIT_CONFIG:
            print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        log.exception("job_crashed", error=f"{type(exc).__name__}: {exc}")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
