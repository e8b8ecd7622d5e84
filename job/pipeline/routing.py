"""Backend chunks -> shard rows, written by a small thread pool so the backend's loop never
waits on the disk. A chunk larger than ``PIECE_BYTES`` is written as several pieces by as many
threads: one step's rows for one long request would otherwise go through one thread, and the
run's last step is then what the run waits for. A sample is finished once all its rows are
written, and rejected if any row was non-finite."""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from job.backends import HiddenChunk
from job.shards.writer import ShardWriter

NONFINITE = "non-finite hidden states (NaN or Inf); not written"


class _Pieces:
    """The pieces of one chunk still to write; its buffer is released after the last."""

    def __init__(self, chunk: HiddenChunk, count: int) -> None:
        self.chunk = chunk
        self.left = count
        self.lock = threading.Lock()

    def done(self) -> None:
        with self.lock:
            self.left -= 1
            last = self.left == 0
        if last and self.chunk.release is not None:
            self.chunk.release()


class ChunkRouter:
    MAX_IN_FLIGHT = 256  # pieces handed to writer threads but not yet written
    PIECE_BYTES = 16 * 2**20  # large sequential writes, yet a 16k-token step of an 8B is 32 pieces

    def __init__(self, writer: ShardWriter, threads: int) -> None:
        self._writer = writer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self._slots = threading.BoundedSemaphore(self.MAX_IN_FLIGHT)
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}  # sample id -> pieces not yet written
        self._complete: set[str] = set()  # samples whose last chunk has arrived
        self._bad: set[str] = set()
        self.error: BaseException | None = None
        self.tokens = 0  # rows routed
        self.samples = 0  # samples whose last chunk was routed

    def __call__(self, chunk: HiddenChunk) -> None:
        """Queue one chunk for writing (blocks while MAX_IN_FLIGHT pieces wait)."""
        sample_id, count = chunk.sample_id, int(chunk.rows.shape[0])
        row_bytes = math.prod(chunk.rows.shape[1:]) * chunk.rows.element_size()
        step = max(1, self.PIECE_BYTES // row_bytes)
        starts = range(0, count, step) if count else range(1)
        pieces = _Pieces(chunk, len(starts))
        with self._lock:
            self._outstanding[sample_id] = self._outstanding.get(sample_id, 0) + len(starts)
            if chunk.nonfinite:
                self._bad.add(sample_id)
            if chunk.last:
                self._complete.add(sample_id)
        self.tokens += count
        self.samples += chunk.last
        for first in starts:
            self._slots.acquire()
            self._pool.submit(self._write, pieces, first, min(first + step, count))

    def _write(self, pieces: _Pieces, first: int, stop: int) -> None:
        chunk = pieces.chunk
        sample_id = chunk.sample_id
        try:
            if self.error is None:
                self._writer.write_rows(
                    sample_id,
                    chunk.start + first,
                    chunk.rows[first:stop].view(torch.uint8).numpy().data,
                    None if chunk.scales is None else chunk.scales[first:stop].numpy().tobytes(),
                )
        except BaseException as exc:
            self.error = exc
        finally:
            pieces.done()
            self._slots.release()
        with self._lock:
            self._outstanding[sample_id] -= 1
            finished = self._outstanding[sample_id] == 0 and sample_id in self._complete
            if finished:
                del self._outstanding[sample_id]
                self._complete.discard(sample_id)
                failed = sample_id in self._bad
                self._bad.discard(sample_id)
        if finished and self.error is None:
            try:
                self._writer.finish_sample(sample_id, NONFINITE if failed else None)
            except BaseException as exc:
                self.error = exc

    def close(self, raise_error: bool = True) -> None:
        """Wait for every queued piece; raise the first write error."""
        self._pool.shutdown(wait=True)
        if raise_error and self.error is not None:
            raise self.error
