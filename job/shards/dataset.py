"""``OutputDataset``: a job's output as a PyTorch ``IterableDataset``, for many ranks and workers,
shuffled, resumable mid-epoch, local or S3, and while the job is still writing (``follow``).

How an epoch is cut (every choice is a pure function of what every reader can see, so ranks and
DataLoader workers need not talk to each other):

* Split: a shard belongs to one slot, ``slot = (shard number + offset(index)) mod slots`` with
  ``slots = world_size x num_workers`` and ``rank = slot mod world_size``. Consecutive shards of an
  index go to consecutive ranks, so each rank's share of an index differs by at most one shard from
  any other's; the offset of index i (``frac(i x golden ratio + u(seed, epoch))``) spreads those
  extra shards evenly over the ranks. The job plans shards by size (``output.shard_bytes``), so
  equal shard counts are equal token counts up to each index's last, smaller shard: ranks finish
  within about one shard of each other. A shard's number never changes once listed, so the split
  holds while shards appear (``follow``) and across the job's kills and resumes.
* Shuffle (``shuffle_seed``): a slot takes its shards in a seeded, epoch-dependent order, in windows
  of ``shuffle_shards`` shards whose samples it reads in a seeded random order. The window holds
  references (shard, position), not hidden states: its memory is the prefetch cap's.
* Resume: ``state_dict()`` names the shards a slot has finished (with their checksums) and, for the
  window it is in, its shards and how many of its samples were handed out. The window's order is a
  function of its shards and the seed, so a fresh dataset that loads the state continues with
  exactly the rest of the epoch. With DataLoader workers, use torchdata's ``StatefulDataLoader``:
  it asks every worker's dataset for its state and hands each one back on resume.
* Follow: manifests are read again every ``poll_interval_s`` (only those of unfinished indexes);
  a shard is read once a manifest lists it, never before. The epoch ends when every index of
  ``extraction.json``'s ``work_count`` has a complete manifest and every listed shard was read.
  A shard read before must stay listed with the same checksum: a manifest that no longer lists it
  (rewritten by another run, a re-extracted damaged shard) raises ``OutputChanged``.

Reading is ``job.shards.access``'s (memory maps, ranged GETs, per-sample CRC64NVME). A background
thread reads ahead in the slot's order, at most ``prefetch_bytes`` of rows not yet handed out (on
a local output it asks the kernel to read those pages ahead, ``MADV_WILLNEED``).
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from job.errors import ConfigError, JobError
from job.layout import MANIFEST, index_dir_name, shard_number
from job.manifest import Manifest, ShardEntry
from job.shards.access import Buffers, OutputReader, ShardRows, _Pending

STATE_VERSION = 1
_GOLDEN = (math.sqrt(5) - 1) / 2


class OutputChanged(JobError):
    """A shard this epoch has read (or is reading) is no longer listed as it was."""


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _unit(*parts: Any) -> float:
    return _hash(*parts) / 2**64


def _index_number(name: str) -> int:
    digits = name.removeprefix("index-")
    return int(digits) if digits.isdigit() else 0


@dataclass(frozen=True)
class _Slot:
    rank: int
    world_size: int
    worker: int
    num_workers: int

    @property
    def slots(self) -> int:
        return self.world_size * self.num_workers

    @property
    def number(self) -> int:
        return self.worker * self.world_size + self.rank


@dataclass
class _Progress:
    """What one slot has handed out this epoch (its ``state_dict``)."""

    epoch: int
    done: dict[str, dict[str, str]] = field(default_factory=dict)  # index -> shard name -> checksum
    window: list[tuple[str, str, str]] = field(default_factory=list)  # (index, name, checksum)
    taken: int = 0  # samples of ``window`` handed out
    finished: bool = False
    listing: dict[str, int] | None = None  # without follow: each index's shards this epoch reads


@dataclass(frozen=True)
class _Planned:
    """One sample in the slot's order."""

    window: tuple[tuple[str, str, str], ...]
    last_in_window: bool
    index: str
    entry: ShardEntry
    position: int


class OutputDataset(IterableDataset):
    """One dict per sample, ``{"sample_id", "input_ids", "loss_mask", "hidden_states"}``:
    ``input_ids`` int32 [T], ``loss_mask`` uint8 [T], ``hidden_states`` [T, L, H] in the model
    dtype (FP8 decoded), its layers the stored ``layers`` (ids, in that order; default all).

    ``rank``/``world_size`` default to torch.distributed's when it is initialised when the
    dataset is made (else 0 and 1). Same seed, epoch, world size and DataLoader workers: the same
    order on every run. Call ``set_epoch(n)`` before each epoch.
    """

    def __init__(
        self,
        uri: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_seed: int | None = None,
        follow: bool = False,
        layers: list[int] | None = None,
        verify: bool = True,
        shuffle_shards: int = 8,
        prefetch_bytes: int = 256 * 2**20,
        read_threads: int = 8,
        poll_interval_s: float | None = None,
    ) -> None:
        super().__init__()
        if (rank is None) != (world_size is None):
            raise ConfigError("OutputDataset: give rank and world_size together, or neither")
        if rank is None:
            initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if initialised else 0
            world_size = torch.distributed.get_world_size() if initialised else 1
        assert world_size is not None
        if not 0 <= rank < world_size:
            raise ConfigError(f"OutputDataset: rank {rank} is not in [0, world_size={world_size})")
        self.uri = str(uri)
        self.rank, self.world_size = rank, world_size
        self.shuffle_seed = shuffle_seed
        self.follow = follow
        self.layers = None if layers is None else list(layers)
        self.verify = verify
        self.shuffle_shards = max(1, shuffle_shards) if shuffle_seed is not None else 1
        self.prefetch_bytes = prefetch_bytes
        self.read_threads = read_threads
        remote = "://" in self.uri and not self.uri.startswith("file://")
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else (1.0 if remote else 0.2)
        self.epoch = 0
        self._progress: _Progress | None = None  # the current (or last) iteration's, or a loaded one
        self._restored = False

    # -- epochs and state --------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (a loaded state of another epoch is dropped)."""
        self.epoch = epoch
        if self._progress is not None and self._progress.epoch != epoch:
            self._progress, self._restored = None, False

    def state_dict(self) -> dict[str, Any]:
        """Where this dataset (in a DataLoader worker: this worker's share) stands in its epoch."""
        slot = self._slot()
        progress = self._progress or _Progress(self.epoch)
        return {
            "version": STATE_VERSION,
            "uri": self.uri,
            "epoch": progress.epoch,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_shards": self.shuffle_shards,
            "rank": slot.rank,
            "world_size": slot.world_size,
            "worker": slot.worker,
            "num_workers": slot.num_workers,
            "done": {index: dict(names) for index, names in progress.done.items()},
            "window": [list(key) for key in progress.window],
            "taken": progress.taken,
            "finished": progress.finished,
            "listing": progress.listing,
            "follow": self.follow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of a dataset with the same seed, world size,
        rank and DataLoader workers): the next iteration hands out exactly the rest of its epoch."""
        if state.get("version") != STATE_VERSION:
            raise ConfigError(
                f"OutputDataset state version {state.get('version')!r}; this reader reads {STATE_VERSION}"
            )
        slot = self._slot()
        expected = {
            "follow": self.follow,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_shards": self.shuffle_shards,
            "rank": slot.rank,
            "world_size": slot.world_size,
            "worker": slot.worker,
            "num_workers": slot.num_workers,
        }
        differ = [
            f"{key} {state[key]!r} (now {value!r})" for key, value in expected.items() if state[key] != value
        ]
        if differ:
            raise ConfigError(
                f"OutputDataset: the state was saved with {', '.join(differ)}; resume with the same "
                "shuffle_seed, world size, rank and DataLoader num_workers, or start the epoch again"
            )
        self.epoch = state["epoch"]
        self._progress = _Progress(
            epoch=state["epoch"],
            done={index: dict(names) for index, names in state["done"].items()},
            window=[tuple(key) for key in state["window"]],  # type: ignore[misc]
            taken=state["taken"],
            finished=state["finished"],
            listing=state["listing"],
        )
        self._restored = True

    def _slot(self) -> _Slot:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return _Slot(self.rank, self.world_size, worker, workers)

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        if not self._restored or self._progress is None or self._progress.epoch != self.epoch:
            self._progress = _Progress(self.epoch)
        self._restored = False
        progress = self._progress
        if progress.finished:
            return
        reader = OutputReader(
            self.uri,
            verify=self.verify,
            setting="OutputDataset",
            read_threads=self.read_threads,
            future=self.follow,
            max_open=self.shuffle_shards + 2,  # the window and the next shard read ahead
        )
        plan = _Plan(self, reader, self._slot(), progress)
        prefetch = _Prefetcher(
            plan,
            lambda index, entry: reader.shard(index, entry.name, entry),
            self.prefetch_bytes,
            self.read_threads,
        )
        try:
            while (got := prefetch.next()) is not None:
                planned, shard, pending = got
                sample = shard.build(planned.position, pending.result(), self.layers)
                if tuple(progress.window) != planned.window:
                    progress.window, progress.taken = list(planned.window), 0
                progress.taken += 1
                if planned.last_in_window:
                    for index, name, checksum in progress.window:
                        progress.done.setdefault(index, {})[name] = checksum
                    progress.window, progress.taken = [], 0
                prefetch.release(planned)
                yield {
                    "sample_id": sample.sample_id,
                    "input_ids": sample.input_ids,
                    "loss_mask": sample.loss_mask,
                    "hidden_states": sample.hidden_states,
                }
            progress.finished = True
        finally:
            prefetch.close()
            reader.close()


class _Plan:
    """The slot's order for one epoch: windows of its shards, each window's samples shuffled."""

    def __init__(
        self, dataset: OutputDataset, reader: OutputReader, slot: _Slot, progress: _Progress
    ) -> None:
        self.ds = dataset
        self.reader = reader
        self.slot = slot
        self.progress = progress
        self.seen: dict[tuple[str, str], str] = {
            (index, name): checksum
            for index, names in progress.done.items()
            for name, checksum in names.items()
        }
        for index, name, checksum in progress.window:
            self.seen[(index, name)] = checksum
        self.manifests: dict[str, Manifest | None] = {}
        self.stop = threading.Event()  # the consumer has gone: end the plan at the next poll

    def _rotation(self, index: str, size: int) -> list[int]:
        """The order in which ``size`` ranks (or workers) take ties for ``index``: rotated by
        frac(i x golden ratio + u(seed, epoch)), so the ties of successive indexes fall apart."""
        salt = (
            0.0
            if self.ds.shuffle_seed is None
            else _unit("offset", self.ds.shuffle_seed, self.progress.epoch)
        )
        offset = int(((_index_number(index) * _GOLDEN + salt) % 1.0) * size)
        return [(offset + k) % size for k in range(size)]

    def _owners(self, visible: dict[str, list[ShardEntry]]) -> dict[tuple[str, str], tuple[int, int]]:
        """(rank, worker) of every visible shard: each to the least-loaded rank in tokens, then to
        that rank's least-loaded worker (ties in the index's rotation). Without follow, over all
        shards at once, largest first: ranks end within one shard of each other. With follow, per
        index in manifest order, a manifest only growing at its end: a shard's owner depends on
        the shards listed before it in its index alone, so it never changes as others appear."""
        slot = self.slot
        owners: dict[tuple[str, str], tuple[int, int]] = {}
        if self.ds.follow:
            groups = [[(index, entry) for entry in entries] for index, entries in sorted(visible.items())]
        else:
            everything = [(index, entry) for index, entries in sorted(visible.items()) for entry in entries]
            everything.sort(key=lambda item: (-item[1].num_tokens, item[0], shard_number(item[1].name) or 0))
            groups = [everything]
        for group in groups:
            ranks = [0] * slot.world_size
            workers = [[0] * slot.num_workers for _ in range(slot.world_size)]
            for index, entry in group:
                rank = min(self._rotation(index, slot.world_size), key=lambda r: ranks[r])
                worker = min(self._rotation(index, slot.num_workers), key=lambda w, r=rank: workers[r][w])
                ranks[rank] += entry.num_tokens
                workers[rank][worker] += entry.num_tokens
                owners[(index, entry.name)] = (rank, worker)
        return owners

    def _poll(self) -> bool:
        """Read the manifests again; True when every index is complete (the epoch can end)."""
        reader = self.reader
        if reader.single_index:
            names = reader.index_names()
        elif self.ds.follow:
            extraction = reader.extraction()
            if extraction is None:
                return False  # the job has not started yet
            names = [index_dir_name(i) for i in range(int(extraction["work_count"]))]
        else:
            names = reader.index_names()
        for index in names:
            known = self.manifests.get(index)
            if known is None or not known.complete or not self.ds.follow:
                self.manifests[index] = reader.manifest(index)
        listed = {
            (index, entry.name): entry.checksum.value
            for index, manifest in self.manifests.items()
            if manifest is not None
            for entry in manifest.shards
        }
        for key, checksum in self.seen.items():
            if listed.get(key) != checksum:
                now = "no longer lists it" if key not in listed else f"lists checksum {listed[key]}"
                raise OutputChanged(
                    f"{reader.where(*key)}: this epoch read it with checksum {checksum}, but {key[0]}'s "
                    f"manifest now {now}: the index was rewritten (another run, or a re-extracted damaged "
                    "shard), so samples already read may come again; start the epoch again without the "
                    "saved state"
                )
        return all(
            self.manifests.get(index) is not None and self.manifests[index].complete for index in names
        )  # type: ignore[union-attr]

    def _visible(self) -> dict[str, list[ShardEntry]]:
        """Each index's listed shards this epoch reads: with follow, all of them; else the
        manifests' first entries as counted when the epoch began (``listing``, kept in the state)."""
        visible = {index: list(m.shards) for index, m in self.manifests.items() if m is not None}
        if self.ds.follow:
            return visible
        if self.progress.listing is None:
            self.progress.listing = {index: len(entries) for index, entries in visible.items()}
        for index, count in self.progress.listing.items():
            if (now := len(visible.get(index, []))) < count:
                raise OutputChanged(
                    f"{self.reader.where(index, MANIFEST)}: lists {now} shards, this epoch began with "
                    f"{count}: the index was rewritten; start the epoch again without the saved state"
                )
        return {index: visible[index][:count] for index, count in self.progress.listing.items()}

    def _candidates(self) -> list[tuple[str, ShardEntry]]:
        visible = self._visible()
        owners = self._owners(visible)
        mine = (self.slot.rank, self.slot.worker)
        found = [
            (index, entry)
            for index, entries in sorted(visible.items())
            for entry in entries
            if (index, entry.name) not in self.seen and owners[(index, entry.name)] == mine
        ]
        seed = self.ds.shuffle_seed
        if seed is None:
            return found
        return sorted(
            found, key=lambda item: _hash("order", seed, self.progress.epoch, item[0], item[1].name)
        )

    def _window_order(self, window: list[tuple[str, ShardEntry]]) -> list[tuple[int, int]]:
        """(shard in window, position) pairs in the order they are handed out."""
        pairs = [
            (k, position) for k, (_, entry) in enumerate(window) for position in range(entry.num_samples)
        ]
        if self.ds.shuffle_seed is None:
            return pairs
        keys = [(index, entry.name) for index, entry in window]
        rng = np.random.default_rng(_hash("window", self.ds.shuffle_seed, self.progress.epoch, keys))
        return [pairs[i] for i in rng.permutation(len(pairs))]

    def _window_items(self, window: list[tuple[str, ShardEntry]], skip: int) -> Iterator[_Planned]:
        keys = tuple((index, entry.name, entry.checksum.value) for index, entry in window)
        order = self._window_order(window)
        for n, (k, position) in enumerate(order):
            if n >= skip:
                index, entry = window[k]
                yield _Planned(keys, n == len(order) - 1, index, entry, position)

    def items(self) -> Iterator[_Planned]:
        complete = self._poll()
        if self.progress.window:
            entries = {
                (index, entry.name): entry
                for index, manifest in self.manifests.items()
                if manifest is not None
                for entry in manifest.shards
            }
            window = [(index, entries[(index, name)]) for index, name, _ in self.progress.window]
            yield from self._window_items(window, self.progress.taken)
        while True:
            candidates = self._candidates()
            if candidates:
                window = candidates[: self.ds.shuffle_shards]
                for index, entry in window:
                    self.seen[(index, entry.name)] = entry.checksum.value
                yield from self._window_items(window, 0)
                continue
            if complete or not self.ds.follow or self.stop.wait(self.ds.poll_interval_s):
                return
            complete = self._poll()


class _Prefetcher:
    """Reads ahead of the consumer in the plan's order, at most ``cap`` bytes of rows not yet
    handed out (always at least one sample), on a background thread."""

    def __init__(
        self, plan: _Plan, open_shard: Callable[[str, ShardEntry], ShardRows], cap: int, threads: int
    ) -> None:
        self._plan = plan
        self._open_shard = open_shard
        self._cap = cap
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="output-read")
        # read-ahead samples (at most cap) and those the consumer still holds, in the same pages again
        self._buffers = Buffers(2 * cap)
        self._ready: deque[tuple[_Planned, ShardRows, _Pending, int]] = deque()
        self._held = 0  # bytes of rows read or being read, not yet handed out
        self._error: BaseException | None = None
        self._ended = False
        self._closed = False
        self._cond = threading.Condition()
        self._sizes: dict[int, int] = {}
        self._thread = threading.Thread(target=self._run, name="output-prefetch", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for planned in self._plan.items():
                shard = self._open_shard(planned.index, planned.entry)
                size = shard.sample_bytes(planned.position)
                with self._cond:
                    while not self._closed and self._ready and self._held + size > self._cap:
                        self._cond.wait()
                    if self._closed:
                        return
                    self._held += size
                pending = shard.fetch(planned.position, self._pool, self._buffers)
                shard.will_need(planned.position)
                with self._cond:
                    self._ready.append((planned, shard, pending, size))
                    self._cond.notify_all()
        except BaseException as exc:
            with self._cond:
                self._error = exc
                self._cond.notify_all()
            return
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def next(self) -> tuple[_Planned, ShardRows, _Pending] | None:
        with self._cond:
            while not self._ready and self._error is None and not self._ended:
                self._cond.wait()
            if self._ready:
                planned, shard, pending, size = self._ready.popleft()
                self._sizes[id(planned)] = size
                return planned, shard, pending
            if self._error is not None:
                raise self._error
            return None

    def release(self, planned: _Planned) -> None:
        with self._cond:
            self._held -= self._sizes.pop(id(planned))
            self._cond.notify_all()

    def close(self) -> None:
        self._plan.stop.set()
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
