"""Exit codes and the errors that map onto them.

The codes are part of the job's contract: Kubernetes' podFailurePolicy uses
EXIT_CONFIG to stop retrying an index that can never succeed.
"""

from __future__ import annotations

import errno

EXIT_OK = 0
EXIT_FAILURE = 1  # unexpected failure; a retry may succeed (and resumes)
EXIT_CONFIG = 2  # settings, model, data path or output unusable: fix them, retrying won't help
# Another pod took over this index (a Kubernetes retry overlap): this pod stops and lists nothing more,
# the other one carries on. Not a failure of the index: podFailurePolicy should Ignore it, not count it.
EXIT_SUPERSEDED = 3
EXIT_TERMINATED = 143  # SIGTERM honoured: committed work is consistent, a rerun resumes


class JobError(Exception):
    """An error with a message meant for the user and an exit code."""

    exit_code = EXIT_FAILURE


class ConfigError(JobError):
    """Something the user must change before the job can run."""

    exit_code = EXIT_CONFIG


class StorageError(JobError):
    """The output storage failed in a way retries did not fix."""


class OutOfSpace(StorageError):
    """A local disk (output, staging, shared memory) is full; committed work is kept."""


def is_out_of_space(exc: OSError) -> bool:
    """A full disk, or the user's quota on it spent: the same remedy (free space, run again)."""
    return exc.errno in (errno.ENOSPC, errno.EDQUOT)


class DamagedShard(JobError):
    """A shard a manifest lists is missing, or its bytes differ from the manifest's record."""


class Superseded(JobError):
    """The index's manifest was changed by another run since this run last wrote it."""

    exit_code = EXIT_SUPERSEDED


class Terminated(JobError):
    """The job was asked to stop (SIGTERM) and stopped cleanly."""

    exit_code = EXIT_TERMINATED
