"""Local space for shards being filled or waiting to be committed, with one owner per shard.

``StagingArea.reserve`` hands out a ``StagedShard``: the file path the writer fills and
the bytes reserved for it. The shard's space is given back exactly once, by
``StagedShard.discard`` (abandoned, failed, or after a commit, which calls it too):
whatever path a shard takes, nobody else counts its bytes. An area with a limit
(object stores: staging is a bounded local disk) makes ``reserve`` wait for space; an
unlimited one (a local output directory, where staging is the output) never waits.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from job.errors import ConfigError
from job.layout import PARTIAL


@dataclass(eq=False)
class StagedShard:
    name: str  # the shard's planned name, e.g. shard-00003.safetensors
    path: Path  # where the writer builds it
    nbytes: int
    _area: StagingArea = field(repr=False)
    _released: bool = False

    def discard(self) -> None:
        """Delete the staged file (if still there) and give its space back; idempotent."""
        self.path.unlink(missing_ok=True)
        if not self._released:
            self._released = True
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
        None if it is not free by then."""
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
        return StagedShard(name, self.directory / (name + PARTIAL), nbytes, self)

    def _release(self, nbytes: int) -> None:
        with self._space:
            self._used -= nbytes
            self._space.notify_all()
