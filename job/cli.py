"""Command line: ``python -m job [run|config|plan|inspect] [--config FILE] [--key.sub=value ...]``
and ``python -m job export --format speculators SRC DST``."""

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
from job.logs import configure_logging, get_logger, scrubber
from job.settings import JobSettings, load_settings, redact, settings_dump

COMMANDS = {
    "run": "extract hidden states for this work index (the default)",
    "config": "print the effective settings (secrets redacted) and exit",
    "plan": "read and tokenize the data; print samples, tokens, bytes and shards for this index",
    "inspect": "summarize a shard file or an output directory",
    "compare": "compare two outputs sample by sample (PATH = candidate, --reference = e.g. the HF output)",
    "bench": "throughput benchmark on a GPU (see docs/benchmarks.md)",
    "export": "convert an output directory (SRC) into another trainer's layout in DST (--format speculators)",
}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m job",
        description="EAGLE-3 draft-training data: hidden states from a target model's prefill.",
        epilog="Any setting can be given as --section.key=value, e.g. --output.uri=s3://bucket/run1 "
        "(environment: JOB_OUTPUT__URI). `python -m job config` lists them all.",
    )
    parser.add_argument("command", nargs="?", default="run", choices=list(COMMANDS))
    parser.add_argument("path", nargs="?", help="inspect: shard file or output directory; export: SRC")
    parser.add_argument("dest", nargs="?", help="export: DST, a new or empty directory")
    parser.add_argument("--config", help="YAML settings file (over config/default.yaml)")
    parser.add_argument("--verify", action="store_true", help="inspect, export: recompute shard checksums")
    parser.add_argument("--reference", help="compare: the reference output directory")
    parser.add_argument("--tolerance", type=float, default=2e-2, help="compare: max relative error")
    parser.add_argument("--format", dest="fmt", help="export: the target layout (speculators)")
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="export: also export when some index is unfinished (only what is committed)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if argv is None:
        argv = sys.argv[1:]
    if argv[:1] == ["bench"]:
        from job.bench import main as bench_main

        return bench_main(list(argv[1:]))
    # intermixed: positionals may follow options (export --format speculators SRC DST)
    args, overrides = _parser().parse_known_intermixed_args(argv)
    try:
        # argparse takes an unknown "--key=value" whose value holds a space for a
        # positional (PATH, DEST); a command without those would silently drop the
        # setting. They were the first overrides: put them back first, in order.
        takes = {"inspect": 1, "compare": 1, "export": 2}.get(args.command, 0)
        stray = [p for p in (args.path, args.dest)[takes:] if p is not None]
        for value in stray:
            if not value.startswith("-"):
                raise ConfigError(f"unexpected argument {value!r}; settings are given as --section.key=value")
        overrides[:0] = stray
        if args.command == "compare":
            from job.compare import compare_outputs

            if not (args.path and args.reference):
                raise ConfigError("compare needs PATH (the candidate output) and --reference DIR")
            result = compare_outputs(args.path, args.reference)
            print(result.summary(args.tolerance))
            return EXIT_OK if result.ok(args.tolerance) else EXIT_FAILURE
        if args.command == "inspect":
            from job.inspect import inspect_path

            if not args.path:
                raise ConfigError("inspect needs a PATH (a shard file or an output directory)")
            print(inspect_path(args.path, verify=args.verify))
            return EXIT_OK
        if args.command == "export":
            return _export(args, overrides)
        settings = load_settings(args.config, overrides)
    except ConfigError as exc:
        print(_error_line(exc), file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "config":
        print(yaml.safe_dump(settings_dump(settings), sort_keys=False, allow_unicode=True), end="")
        return EXIT_OK
    configure_logging(settings.log)
    return _run_command(args.command, settings)


def _error_line(exc: Exception) -> str:
    """The one stderr line for a fatal error, with the same scrubbing as the logs.

    Messages may echo a setting's value (``(got 's3://key:secret@...')``), and stderr
    does not pass through the log processors.
    """
    scrubber.refresh()
    return "error: " + scrubber.scrub(redact(" ".join(str(exc).split())))


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


def _export(args: argparse.Namespace, extra: list[str]) -> int:
    if extra:
        raise ConfigError(f"export takes no settings; unexpected {' '.join(extra)}")
    if not args.fmt or not args.path or not args.dest:
        raise ConfigError("usage: python -m job export --format speculators SRC DST")
    from job.export import export

    try:
        summary = export(args.fmt, args.path, args.dest, args.allow_incomplete, args.verify)
    except JobError as exc:  # ConfigError included: its exit code tells a retry won't help
        print(f"error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(summary.describe())
    return EXIT_OK


def _run_command(command: str, settings: JobSettings) -> int:
    log = get_logger()
    try:
        if command == "plan":
            from job.plan import plan_index

            print(plan_index(settings))
            return EXIT_OK
        with _exit_on_stop_signal():
            from job.pipeline.runner import run_job

            run_job(settings)
        return EXIT_OK
    except JobError as exc:
        log.error("job_error", error=str(exc), exit_code=exc.exit_code)
        if exc.exit_code == EXIT_CONFIG:
            print(_error_line(exc), file=sys.stderr)
        return exc.exit_code
    except Exception as exc:
        log.exception("job_crashed", error=f"{type(exc).__name__}: {exc}")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
