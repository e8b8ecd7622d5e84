"""Local space for shards being filled or waiting to be committed, with one owner per shard.

``StagingArea.reserve`` hands out a ``StagedShard``: the file the writer fills, created at its
final size, and the bytes reserved for it, counted and then claimed on disk in the background
(``allocated``). The shard's space is given back exactly once, by ``StagedShard.discard``
(abandoned, failed, or after a commit, which calls it too): whatever path a shard takes, nobody
else counts its bytes. An area with a limit (object stores: staging is a bounded local disk)
makes ``reserve`` wait for space; an unlimited one (a local output directory, where staging is
the output) never waits.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from job.errors import ConfigError, OutOfSpace, is_out_of_space
from job.layout import PARTIAL

# Claiming a shard's blocks before anything is copied into a mapping of it turns "disk full"
# into an error instead of SIGBUS on a page fault. It runs off the caller's thread (on tmpfs it
# allocates every page: ~0.5 s per 2 GiB), while the backend already works on the shard.
_ALLOCATOR = ThreadPoolExecutor(1, thread_name_prefix="shard-allocate")


@dataclass(eq=False)
class StagedShard:
    name: str  # the shard's planned name, e.g. shard-00003.safetensors
    path: Path  # where the writer builds it
    nbytes: int
    _area: StagingArea = field(repr=False)
    # done once the file's blocks are claimed (OutOfSpace if the disk is full)
    allocated: Future[None] = field(default_factory=Future, repr=False)
    released: bool = False

    def discard(self) -> None:
        """Delete the staged file (if still there) and give its space back; idempotent."""
        self.path.unlink(missing_ok=True)
        if not self.released:
            self.released = True
            self._area._release(self.nbytes)


class StagingArea:
    def __init__(self, directory: Path, limit: int | None, limit_setting: str = "") -> None:
        self.directory = directory
        self.limit = limit
        self._limit_setting = limit_setting  # named when one shard cannot fit at all
        self._used = 0
        self._space = threading.Condition()
        self.high_water_bytes = 0
        self.waits = 0
        self.wait_s = 0.0

    @property
    def used_bytes(self) -> int:
        return self._used

    def reserve(self, name: str, nbytes: int, timeout_s: float | None = None) -> StagedShard | None:
        """Space for shard ``name``, waiting at most ``timeout_s`` (None: as long as it takes);
        None if it is not free by then. The file exists at its size on return; its blocks are
        claimed in the background (``StagedShard.allocated``)."""
        limit = self.limit
        if limit is not None and nbytes > limit:
            raise ConfigError(
                f"shard {name} needs {nbytes} bytes of staging but {self._limit_setting} is "
                f"{limit}; raise {self._limit_setting} or lower output.shard_bytes "
                "(a single sample longer than shard_bytes makes a shard of its own)"
            )
        with self._space:
            started = time.monotonic()
            deadline = None if timeout_s is None else started + timeout_s
            waited = False
            while limit is not None and self._used + nbytes > limit:
                waited = True
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    self.wait_s += time.monotonic() - started
                    return None
                self._space.wait(left)
            if waited:
                self.waits += 1
                self.wait_s += time.monotonic() - started
            self._used += nbytes
            self.high_water_bytes = max(self.high_water_bytes, self._used)
        staged = StagedShard(name, self.directory / (name + PARTIAL), nbytes, self)
        try:
            fd = os.open(staged.path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        except BaseException:
            staged.discard()
            raise
        try:
            os.ftruncate(fd, nbytes)
        except BaseException:
            os.close(fd)
            staged.discard()
            raise
        staged.allocated = _ALLOCATOR.submit(_allocate, fd, staged)
        return staged

    def _release(self, nbytes: int) -> None:
        with self._space:
            self._used -= nbytes
            self._space.notify_all()


def _allocate(fd: int, staged: StagedShard) -> None:
    try:
        os.posix_fallocate(fd, 0, staged.nbytes)
    except OSError as exc:
        if is_out_of_space(exc):
            raise OutOfSpace(
                f"no space left for shard {staged.path.name} ({staged.nbytes:,} bytes) in "
                f"{staged.path.parent}: committed shards are kept; free space there (or lower "
                "output.shard_bytes / output.max_staged_bytes) and rerun"
            ) from None
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):  # filesystems without fallocate
            raise
    finally:
        os.close(fd)
