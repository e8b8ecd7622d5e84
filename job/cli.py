"""Command line: ``python -m job [COMMAND] [--config FILE] [--section.key=value ...]``.

Every command has its own ``--help``; ``run`` is the default command. A failure is one
``error: ...`` line on stderr (scrubbed of secrets) and an exit code from
``job.errors``; tracebacks go to the JSON log only.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Iterator, Sequence
from importlib.metadata import PackageNotFoundError, version
from typing import Any, NoReturn

import yaml

from job.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_OK, ConfigError, JobError, is_out_of_space
from job.logs import configure_logging, get_logger, scrubber
from job.pipeline.stop import exit_on_stop_signal
from job.settings import JobSettings, load_settings, redact, settings_dump

# What a command's output piped into `head` exits with once the reader has gone (128 + SIGPIPE),
# as a program killed by SIGPIPE would.
EXIT_BROKEN_PIPE = 141
SETTINGS_HELP = (
    "Settings: --section.key=value (e.g. --output.uri=s3://bucket/run1), environment JOB_SECTION__KEY, "
    "or a YAML file with --config; `python -m job config` lists every key and its value."
)
BENCHMARK_MODULE = "job.benchmarks.throughput"
COMMANDS = {
    "run": "extract hidden states for this work index (the default command)",
    "config": "print the effective settings (secrets redacted) and exit",
    "plan": "read and tokenize the data; print samples, tokens, bytes and shards for this index",
    "preflight": "check that `run` with these settings works: data, output, and the vLLM engine on dummy "
    "weights at reduced depth (what `run` does first with the vLLM backend)",
    "inspect": "summarize a shard file or an output directory (local or s3://)",
    "compare": "compare two outputs sample by sample (PATH = candidate, --reference = e.g. the HF output)",
    "bench": f"throughput benchmark on a GPU: `python -m {BENCHMARK_MODULE}` (docs/benchmarks.md)",
    "export": "convert an output (SRC) into another trainer's layout in DST (--format speculators)",
}
_TAKE_SETTINGS = ("run", "config", "plan", "preflight")


def tool_version() -> str:
    try:
        return version("eagle3-extract")
    except PackageNotFoundError:
        return "unknown (not installed)"


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage mistake is a ConfigError (one ``error:`` line, exit 2) like any other."""

    def error(self, message: str) -> NoReturn:
        usage = " ".join(self.format_usage().split()).removeprefix("usage: ")
        raise ConfigError(f"{message}; usage: {usage} (--help says more)")


def _tolerance(text: str) -> float:
    """``compare --tolerance``: a relative error of 0 or more (nan would fail every comparison)."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not value >= 0:  # also false for nan
        raise argparse.ArgumentTypeError(f"{text!r} is not a relative error of 0 or more (e.g. 0.02)")
    return value


def _parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="python -m job",
        allow_abbrev=False,
        description="EAGLE-3 draft-training data: hidden states from a target model's prefill.",
        epilog=SETTINGS_HELP,
    )
    parser.add_argument("--version", action="version", version=f"eagle3-extract {tool_version()}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _TAKE_SETTINGS:
        sub = commands.add_parser(
            name, help=COMMANDS[name], description=COMMANDS[name], epilog=SETTINGS_HELP, allow_abbrev=False
        )
        sub.add_argument("--config", help="YAML settings file (over config/default.yaml)")
    inspect = commands.add_parser("inspect", help=COMMANDS["inspect"], description=COMMANDS["inspect"])
    inspect.add_argument("path", help="a shard file, an output directory, one index-* directory or s3://...")
    inspect.add_argument(
        "--verify", action="store_true", help="recompute every listed shard's checksum; exit 1 on a mismatch"
    )
    compare = commands.add_parser("compare", help=COMMANDS["compare"], description=COMMANDS["compare"])
    compare.add_argument("path", help="the candidate output (a directory or s3://bucket/prefix)")
    compare.add_argument("--reference", required=True, help="the reference output (a directory or s3://...)")
    compare.add_argument(
        "--tolerance", type=_tolerance, default=2e-2, help="max relative error (default 0.02)"
    )
    export = commands.add_parser(
        "export",
        help=COMMANDS["export"],
        description=COMMANDS["export"],
        usage="python -m job export --format speculators [--hidden-states copy|reference] SRC DST "
        "[--verify] [--allow-incomplete]",
    )
    export.add_argument("path", metavar="SRC", help="an output directory, one index-* or s3://...")
    export.add_argument("dest", metavar="DST", help="a new or empty directory")
    export.add_argument("--format", dest="fmt", required=True, help="the target layout: speculators")
    export.add_argument(
        "--hidden-states",
        default="copy",
        help="copy (default): a file per row with its hidden states; reference: none, the "
        "eagle3-extract speculators backend reads them from SRC's shards (python -m job.speculators)",
    )
    export.add_argument(
        "--verify",
        action="store_true",
        help="recompute local shards' checksums (s3: always); reference: read every sample through its "
        "checksum (without: headers and offsets checked, the ids and masks read alone)",
    )
    export.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="also export when some index is unfinished (only what is committed)",
    )
    commands.add_parser("bench", help=COMMANDS["bench"], add_help=False)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and not argv[0].startswith("-") and argv[0] not in COMMANDS:
        print(error_line(ConfigError(_unknown_command(argv[0]))), file=sys.stderr)
        return EXIT_CONFIG
    if not argv or (argv[0] not in COMMANDS and argv[0] not in ("-h", "--help", "--version")):
        argv.insert(0, "run")
    try:
        return _dispatch(argv)
    except BrokenPipeError:
        # The reader of our stdout went away (`inspect ... | head`): nothing left to say to it.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE


def _unknown_command(word: str) -> str:
    commands = ", ".join(f"{name} (the default)" if name == "run" else name for name in COMMANDS)
    return (
        f"unknown command {word!r}; the commands are {commands} (python -m job COMMAND --help); "
        "settings are given as --section.key=value"
    )


def _dispatch(argv: list[str]) -> int:
    if argv[0] == "bench":
        # An alias of the benchmark's own entry point, run in its place: the production command
        # line imports no benchmark code.
        os.execv(sys.executable, [sys.executable, "-m", BENCHMARK_MODULE, *argv[1:]])
    parser = _parser()
    try:
        # Settings commands pass unknown --section.key=value flags on to the settings model;
        # the other commands take none.
        args, overrides = parser.parse_known_args(argv)
        if overrides and args.command not in _TAKE_SETTINGS:
            raise ConfigError(f"{args.command} takes no settings; unexpected {' '.join(overrides)}")
        if args.command == "compare":
            from job.compare import compare_outputs

            result = compare_outputs(args.path, args.reference)
            print(result.summary(args.tolerance))
            return EXIT_OK if result.ok(args.tolerance) else EXIT_FAILURE
        if args.command == "inspect":
            from job.inspect import inspect_path

            report = inspect_path(args.path, verify=args.verify)
            print(report.text)
            return EXIT_OK if report.ok else EXIT_FAILURE
        if args.command == "export":
            from job.export import export

            summary = export(
                args.fmt, args.path, args.dest, args.allow_incomplete, args.verify, args.hidden_states
            )
            print(summary.describe())
            return EXIT_OK
        for value in _stray_positionals(overrides):
            raise ConfigError(f"unexpected argument {value!r}; settings are given as --section.key=value")
        settings = load_settings(args.config, overrides)
    except JobError as exc:
        print(error_line(exc), file=sys.stderr)
        return exc.exit_code
    if args.command == "config":
        print(yaml.safe_dump(settings_dump(settings), sort_keys=False, allow_unicode=True), end="")
        return EXIT_OK
    configure_logging(settings.log)
    return _run_command(args.command, settings)


def _stray_positionals(overrides: list[str]) -> Iterator[str]:
    """Arguments that are neither a flag nor the value after a ``--key`` (without ``=``)."""
    expects_value = False
    for item in overrides:
        if item.startswith("-"):
            expects_value = "=" not in item
        elif expects_value:
            expects_value = False
        else:
            yield item


def error_line(exc: BaseException) -> str:
    """The one stderr line for a fatal error, with the same scrubbing as the logs.

    Messages may echo a setting's value (``(got 's3://key:secret@...')``), and stderr
    does not pass through the log processors.
    """
    scrubber.refresh()
    return "error: " + scrubber.scrub(redact(" ".join(str(exc).split())))


def _run_command(command: str, settings: JobSettings) -> int:
    log = get_logger()
    try:
        if command == "plan":
            from job.plan import plan_index

            print(plan_index(settings))
            return EXIT_OK
        if command == "preflight":
            from job.logs import configure_logging as reconfigure
            from job.preflight import PREFLIGHT_EVENTS, preflight

            reconfigure(settings.log, event_prefix=PREFLIGHT_EVENTS)
            with exit_on_stop_signal("preflight"):
                print(preflight(settings).text())
            return EXIT_OK
        with exit_on_stop_signal("startup"):
            from job.run import run

            totals = run(settings)
        print(totals["summary"], file=sys.stderr)
        return EXIT_OK
    except JobError as exc:
        log.error("job_error", error=str(exc), exit_code=exc.exit_code)
        print(error_line(exc), file=sys.stderr)
        return exc.exit_code
    except OSError as exc:
        if not is_out_of_space(exc):
            return _crashed(log, exc)
        log.error("job_error", error=str(exc), exit_code=EXIT_FAILURE)
        print(error_line(OSError(f"{exc}; committed shards are kept: free space and rerun")), file=sys.stderr)
        return EXIT_FAILURE
    except Exception as exc:
        return _crashed(log, exc)


def _crashed(log: Any, exc: Exception) -> int:
    """An unexpected failure: the traceback goes to the log, one line to stderr (called from
    inside the ``except`` clause, so the log still sees the exception)."""
    log.exception("job_crashed", error=f"{type(exc).__name__}: {exc}")
    message = (
        f"unexpected failure ({type(exc).__name__}: {exc}); a rerun resumes; the traceback is in the "
        "job_crashed log event"
    )
    print(error_line(RuntimeError(message)), file=sys.stderr)
    return EXIT_FAILURE
