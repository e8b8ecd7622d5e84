"""Backend chunks -> shard rows, written by a small thread pool so the backend's loop never
waits on the disk. A sample is finished once all its rows are written, and rejected if any
row was non-finite."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import torch

from job.backends import HiddenChunk
from job.shards.writer import ShardWriter

NONFINITE = "non-finite hidden states (NaN or Inf); not written"


class ChunkRouter:
    MAX_IN_FLIGHT = 256  # chunks handed to writer threads but not yet written

    def __init__(self, writer: ShardWriter, threads: int) -> None:
        self._writer = writer
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self._slots = threading.BoundedSemaphore(self.MAX_IN_FLIGHT)
        self._lock = threading.Lock()
        self._outstanding: dict[str, int] = {}  # sample id -> chunks not yet written
        self._complete: set[str] = set()  # samples whose last chunk has arrived
        self._bad: set[str] = set()
        self.error: BaseException | None = None
        self.tokens = 0  # rows routed
        self.samples = 0  # samples whose last chunk was routed

    def __call__(self, chunk: HiddenChunk) -> None:
        """Queue one chunk for writing (blocks while MAX_IN_FLIGHT chunks wait)."""
        sample_id = chunk.sample_id
        with self._lock:
            self._outstanding[sample_id] = self._outstanding.get(sample_id, 0) + 1
            if chunk.nonfinite:
                self._bad.add(sample_id)
            if chunk.last:
                self._complete.add(sample_id)
        self.tokens += int(chunk.rows.shape[0])
        self.samples += chunk.last
        self._slots.acquire()
        self._pool.submit(self._write, chunk)

    def _write(self, chunk: HiddenChunk) -> None:
        sample_id = chunk.sample_id
        try:
            if self.error is None:
                self._writer.write_rows(
                    sample_id,
                    chunk.start,
                    chunk.rows.view(torch.uint8).numpy().data,
                    None if chunk.scales is None else chunk.scales.numpy().tobytes(),
                )
        except BaseException as exc:
            self.error = exc
        finally:
            if chunk.release is not None:
                chunk.release()
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
        """Wait for every queued chunk; raise the first write error."""
        self._pool.shutdown(wait=True)
        if raise_error and self.error is not None:
            raise self.error
