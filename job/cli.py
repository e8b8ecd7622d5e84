"""Command line: ``python -m job [run|config|plan|inspect] [--config FILE] [--key.sub=value ...]``
and ``python -m job export --format speculators SRC DST``."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import yaml

from job.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, JobError
from job.logs import configure_logging, get_logger
from job.settings import JobSettings, load_settings, settings_dump

COMMANDS = {
    "run": "extract hidden states for this work index (the default)",
    "config": "print the effective settings (secrets redacted) and exit",
    "plan": "read and tokenize the data; print samples, tokens, bytes and shards for this index",
    "inspect": "summarize a shard file or an output directory",
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
    parser.add_argument("--format", dest="fmt", help="export: the target layout (speculators)")
    parser.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="export: also export when some index is unfinished (only what is committed)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # intermixed: positionals may follow options (export --format speculators SRC DST)
    args, overrides = _parser().parse_known_intermixed_args(argv)
    try:
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
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_CONFIG
    if args.command == "config":
        print(yaml.safe_dump(settings_dump(settings), sort_keys=False, allow_unicode=True), end="")
        return EXIT_OK
    configure_logging(settings.log)
    return _run_command(args.command, settings)


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
