"""This work index's samples, tokenized ahead of the backend, in the background, in input order.

A reader thread pulls raw records, keeps the ones this work index owns (a hash of
the sample id, ``owner_index``) and has not written yet, and hands chunks to tokenizer processes (or tokenizes
itself when ``workers == 0``). Results wait in a bounded queue, so memory
stays flat whatever the data set's size.
"""

from __future__ import annotations

import contextlib
import hashlib
import itertools
import queue
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any

from job.data.encode import EncodedSample, EncoderSpec, GenerationStart, RejectedSample, SampleEncoder
from job.data.source import MAX_ID_BYTES, Record
from job.errors import JobError

CHUNK = 32
# A chunk also ends once its records hold this many raw bytes: a run of large records
# travels to the tokenizer processes a few at a time, not 32 at once.
CHUNK_BYTES = 16 * 1024**2
_DONE = object()


class TokenizerProcessDied(JobError):
    def __init__(self) -> None:
        super().__init__(
            "a tokenizer process (data.tokenizer_workers) died while tokenizing: the kernel's OOM killer "
            "is the usual cause, as a record's memory peak grows with its size; give the job more memory, "
            "or lower data.max_record_bytes or data.tokenizer_workers. Committed shards are kept; a rerun "
            "resumes"
        )


_worker_encoder: SampleEncoder | None = None


def owner_index(sample_id: str, count: int) -> int:
    """The work index that owns ``sample_id`` among ``count`` indexes.

    A hash of the id, not its position: adding or reordering input files does
    not move samples that were already assigned.
    """
    digest = hashlib.blake2b(sample_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") % count


def first_owned(records: Iterator[Record], index: int, count: int, limit: int) -> Iterator[Record]:
    """The first ``limit`` records that work index ``index`` of ``count`` owns."""
    owned = (r for r in records if count == 1 or owner_index(r.sample_id, count) == index)
    return itertools.islice(owned, limit)


def _init_worker(spec: EncoderSpec) -> None:
    global _worker_encoder
    _worker_encoder = SampleEncoder(spec)


def _encode_chunk(
    chunk: list[tuple[str, dict[str, Any] | None, str | None]],
) -> list[EncodedSample | RejectedSample | GenerationStart]:
    assert _worker_encoder is not None
    return [_worker_encoder.encode(*item) for item in chunk]


@dataclass
class StreamStats:
    records_seen: int = 0  # all records read (every index)
    owned: int = 0  # records this index owns
    skipped_done: int = 0  # owned, already in a committed shard
    # Input bytes up to the last sample handed to the consumer (not the reader's read-ahead: a
    # progress estimate of tokens per byte needs the bytes of the samples it has counted).
    bytes_done: int = 0
    duplicates: int = 0
    # Every id read, and whether it was generated (a record's place, ``<file>:<n>``) rather than given.
    seen_ids: dict[str, bool] = field(default_factory=dict)


class EncodedStream:
    """Iterate over EncodedSample | RejectedSample for one work index."""

    def __init__(
        self,
        records: Iterator[Record],
        spec: EncoderSpec,
        *,
        index: int,
        count: int,
        done_ids: set[str],
        workers: int,
        prefetch: int,
    ) -> None:
        self.stats = StreamStats()
        self._records = records
        self._spec = spec
        self._index, self._count = index, count
        self._done_ids = done_ids
        self._workers = workers
        self._queue: queue.Queue[Any] = queue.Queue(maxsize=max(1, prefetch // CHUNK))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._produce, name="tokenizer-feed", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._stop.set()
        while self._thread.is_alive():
            with contextlib.suppress(queue.Empty):
                self._queue.get(timeout=0.1)
        self._thread.join()

    def accepted(
        self, on_rejected: Callable[[str, str], None], on_warning: Callable[[str, str], None]
    ) -> Iterator[EncodedSample | GenerationStart]:
        """The encoded samples (or conversations to regenerate); each rejected one goes to
        ``on_rejected(sample_id, reason)``, each one encoded with a warning also to
        ``on_warning(sample_id, warning)``."""
        for item in self:
            if isinstance(item, RejectedSample):
                on_rejected(item.sample_id, item.reason)
                continue
            if isinstance(item, EncodedSample) and item.warning is not None:
                on_warning(item.sample_id, item.warning)
            yield item

    def __iter__(self) -> Iterator[EncodedSample | RejectedSample | GenerationStart]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            results, positions = item
            for result, position in zip(results, positions, strict=True):
                self.stats.bytes_done = position
                yield result

    def _owned_chunks(
        self,
    ) -> Iterator[tuple[list[tuple[str, dict[str, Any] | None, str | None]], list[int]]]:
        """Chunks of (id, record, error) to encode, each with the input position after each record."""
        chunk: list[tuple[str, dict[str, Any] | None, str | None]] = []
        positions: list[int] = []
        chunk_bytes = 0
        stats = self.stats
        for record in self._records:
            stats.records_seen += 1
            if self._count > 1 and owner_index(record.sample_id, self._count) != self._index:
                continue
            stats.owned += 1
            id_bytes = len(record.sample_id.encode("utf-8", "surrogatepass"))
            if id_bytes > MAX_ID_BYTES:
                chunk.append(
                    (
                        record.sample_id,
                        None,
                        f"id is {id_bytes} bytes long; at most {MAX_ID_BYTES} allowed",
                    )
                )
            elif record.sample_id in stats.seen_ids:
                # Checked before "done": a later record with the id of an already committed sample
                # is still a duplicate (rejected, as in the first run), not a second "done".
                stats.duplicates += 1
                reason = _duplicate_reason(record, earlier_generated=stats.seen_ids[record.sample_id])
                chunk.append((record.sample_id, None, reason))
            else:
                stats.seen_ids[record.sample_id] = record.generated_id
                if record.sample_id in self._done_ids:
                    stats.skipped_done += 1
                    continue
                chunk.append((record.sample_id, record.value, record.error))
                chunk_bytes += record.size
            positions += [record.bytes_done] * (len(chunk) - len(positions))
            if len(chunk) >= CHUNK or chunk_bytes >= CHUNK_BYTES:
                yield chunk, positions
                chunk, positions, chunk_bytes = [], [], 0
            if self._stop.is_set():
                return
        if chunk:
            yield chunk, positions

    def _put(self, item: Any) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _produce(self) -> None:
        try:
            if self._workers == 0:
                encoder = SampleEncoder(self._spec)
                self._run(lambda chunk: _completed([encoder.encode(*i) for i in chunk]))
            else:
                with ProcessPoolExecutor(
                    self._workers,
                    mp_context=get_context("spawn"),
                    initializer=_init_worker,
                    initargs=(self._spec,),
                ) as pool:
                    self._run(lambda chunk: pool.submit(_encode_chunk, chunk))
            self._put(_DONE)
        except BrokenProcessPool as exc:
            died = TokenizerProcessDied()
            died.__cause__ = exc
            self._put(died)
        except BaseException as exc:  # surfaced in the consumer's thread
            self._put(exc)

    def _run(self, submit: Callable[[list[Any]], Future[list[Any]]]) -> None:
        window: deque[tuple[Future[list[Any]], list[int]]] = deque()
        limit = max(2, 2 * max(self._workers, 1))
        for chunk, positions in self._owned_chunks():
            window.append((submit(chunk), positions))
            while len(window) >= limit or (window and window[0][0].done()):
                if not self._put_done(*window.popleft()):
                    return
        while window:
            if not self._put_done(*window.popleft()):
                return

    def _put_done(self, results: Future[list[Any]], positions: list[int]) -> bool:
        return self._put((results.result(), positions))


def _duplicate_reason(record: Record, earlier_generated: bool) -> str:
    """Why a record whose id an earlier record has is rejected; says when one of the two ids was
    made from a record's place (``<file>:<n>``: the n-th line, or Parquet row, of file)."""
    if earlier_generated and not record.generated_id:
        return (
            f"duplicate sample id: this record's 'id' {record.sample_id!r} collides with the id generated "
            "for an earlier record without an 'id' (its file and line, or Parquet row); give this record "
            "another id, or that record an id of its own"
        )
    if record.generated_id and not earlier_generated:
        return (
            f"duplicate sample id: this record has no 'id', and the id generated from its place, "
            f"{record.sample_id!r}, collides with an earlier record's explicit 'id'; give this record an "
            "id of its own, or that record another id"
        )
    return "duplicate sample id: an earlier record has the same id"


def _completed(value: list[Any]) -> Future[list[Any]]:
    future: Future[list[Any]] = Future()
    future.set_result(value)
    return future
