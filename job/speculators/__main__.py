"""``python -m job.speculators COMMAND ...``: speculators' own command line (``speculators
COMMAND ...``, every command and flag unchanged) with the ``eagle3-extract`` hidden-states
backend registered, e.g.

    python -m job.speculators train --data-path DST --hidden-states-backend eagle3-extract ...
    torchrun --nproc-per-node 8 -m job.speculators train ...   # several ranks (not run: no GPU)

speculators 0.9 collects backends' flags when its training config module is first imported,
so the backend must be registered before that: importing ``job.speculators`` (above
speculators' own imports here) does it.
"""

from __future__ import annotations

import sys
from typing import NoReturn

import job.speculators  # noqa: F401 - registers the backend
from job.errors import EXIT_CONFIG, ConfigError, DamagedShard, JobError


def main(prog_name: str = "python -m job.speculators") -> None:
    """speculators' command line; an error of the backend's (a moved output, a damaged shard) ends
    it with the job's one ``error:`` line, after whatever speculators printed, instead of a
    traceback through speculators' trainer."""
    from speculators.cli import app

    try:
        app(prog_name=prog_name)
    except JobError as exc:
        _exit_with(exc)


def _exit_with(exc: JobError) -> NoReturn:
    from job.cli import error_line

    message = str(exc)
    # Raised in a DataLoader worker, it comes back as the same type around the worker's traceback,
    # whose last line is the original error.
    if message.startswith("Caught ") and "\nOriginal Traceback" in message:
        message = message.rstrip().rpartition(f"{type(exc).__module__}.{type(exc).__qualname__}: ")[2]
    print(error_line(type(exc)(message)), file=sys.stderr)
    # Neither is mended by a retry: the output must be restored, re-extracted or found.
    sys.exit(EXIT_CONFIG if isinstance(exc, (ConfigError, DamagedShard)) else exc.exit_code)


if __name__ == "__main__":
    main()
