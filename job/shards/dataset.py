"""``OutputDataset``: a job's output as a PyTorch ``IterableDataset``, for many ranks and workers,
shuffled, resumable mid-epoch, local or S3, and while the job is still writing (``follow``).

How an epoch is cut (every choice is a pure function of what every reader can see, so ranks and
DataLoader workers need not talk to each other):

* Pieces: a slot (one rank's one DataLoader worker) reads pieces, each a listed shard or an equal
  run of its samples. Shards go whole, but where they are too few for every rank to get samples
  they are split by sample: without ``follow``, an output of fewer shards than ranks has its
  shards split (the one with most samples per piece first) until there are as many pieces as
  ranks; with ``follow``, each index's first shards, until ``world_size`` samples, are split into
  ``world_size`` pieces (the index's later shards cannot change that). A split that still leaves
  a rank without samples (fewer samples than ranks) raises before that rank's first sample: an
  empty rank would hang the others' first collective step.
* Split: each piece to the least-loaded rank in tokens (a split shard's tokens counted in
  proportion to its samples), then to that rank's least-loaded worker; ties in an order rotated
  per index by frac(i x golden ratio + u(seed, epoch)). Without ``follow`` over all pieces at
  once, largest first: ranks end within about one shard of each other. With ``follow`` per index
  in manifest order (a manifest only grows at its end): a piece's owner depends on its index's
  earlier shards alone, so it never changes while shards appear or the job is killed and resumed.
* Shuffle (``shuffle_seed``): a slot takes its pieces in a seeded, epoch-dependent order, in
  windows of ``shuffle_shards`` pieces whose samples it reads in a seeded random order. The window
  holds references (shard, position), not hidden states: its memory is the prefetch cap's.
* Resume: ``state_dict()`` names the pieces a slot has finished (with their shards' checksums)
  and, for the window it is in, its pieces and how many of its samples were handed out. The
  window's order is a function of its pieces and the seed, so a fresh dataset that loads the
  state continues with exactly the rest of the epoch. With DataLoader workers, use torchdata's
  ``StatefulDataLoader``: it asks every worker's dataset for its state and hands each one back on
  resume (a plain DataLoader's workers read copies the main process cannot see: its
  ``state_dict()`` raises rather than say nothing was read).
* Complete: ``extraction.json``'s ``work_count`` says which indexes the output has. Without
  ``follow`` an index missing or not complete raises ``OutputIncomplete`` naming it, unless
  ``allow_incomplete`` (the shards listed now are read, with a warning). With ``follow``,
  manifests are read again every ``poll_interval_s`` (only those of unfinished indexes); a shard
  is read once a manifest lists it, never before; the epoch ends when every index has a complete
  manifest and every listed shard was read; ``OutputStalled`` is raised after waiting
  ``stall_timeout_s`` with nothing new listed (a job that died, a path no job writes to).
  A shard read before must stay listed with the same checksum: a manifest that no longer lists
  it (rewritten by another run, a re-extracted damaged shard) raises ``OutputChanged``.

Reading is ``job.shards.access``'s (memory maps, ranged GETs, per-sample CRC64NVME). A background
thread reads ahead in the slot's order, at most ``prefetch_bytes`` of rows not yet handed out (on
a local output it asks the kernel to read those pages ahead, ``MADV_WILLNEED``).
"""

from __future__ import annotations

import hashlib
import math
import os
import threading
import time
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from pydantic import TypeAdapter, ValidationError
from torch.utils.data import IterableDataset, get_worker_info
from typing_extensions import TypedDict  # pydantic reads typing's only from Python 3.12

from job.errors import ConfigError, JobError
from job.layout import EXTRACTION, MANIFEST, index_dir_name, shard_number
from job.manifest import Manifest, ShardEntry
from job.shards.access import Buffers, OutputReader, ShardRows, _Pending, _some
from job.storage import uri_scheme

STATE_VERSION = 2  # 2: pieces (a shard, or a run of its samples) where 1 named whole shards
_GOLDEN = (math.sqrt(5) - 1) / 2
_STALL_TIMEOUT_S = 30 * 60.0

PieceKey = tuple[str, str, str, int, int]  # index, shard name, shard checksum, part, parts


class OutputChanged(JobError):
    """A shard this epoch has read (or is reading) is no longer listed as it was."""


class OutputIncomplete(JobError):
    """An index of the output is missing or not complete: an epoch over it would be short."""


class OutputStalled(OutputIncomplete):
    """``follow``: nothing new was listed for ``stall_timeout_s`` while indexes were incomplete."""


class InvalidArgument(ConfigError, ValueError):
    """An argument, or a state given to ``load_state_dict``, this dataset cannot use."""


class IncompleteOutputWarning(UserWarning):
    """``allow_incomplete``: the epoch reads only what the output lists now."""


def _hash(*parts: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(parts).encode(), digest_size=8).digest(), "big")


def _unit(*parts: Any) -> float:
    return _hash(*parts) / 2**64


def _index_number(name: str) -> int:
    digits = name.removeprefix("index-")
    return int(digits) if digits.isdigit() else 0


def _output_location(uri: str) -> str:
    """Where the output is, in one spelling (compared when a state is loaded)."""
    if uri_scheme(uri) is None:
        return os.path.abspath(os.path.expanduser(uri.removeprefix("file://")))
    return uri.rstrip("/")


@dataclass(frozen=True)
class _Slot:
    rank: int
    world_size: int
    worker: int
    num_workers: int


@dataclass(frozen=True)
class _Piece:
    """Samples of one listed shard that one slot reads: run ``part`` of ``parts`` equal runs of its
    positions (a whole shard: 0 of 1)."""

    index: str
    entry: ShardEntry
    part: int = 0
    parts: int = 1

    @property
    def id(self) -> tuple[str, str, int, int]:
        return (self.index, self.entry.name, self.part, self.parts)

    @property
    def key(self) -> PieceKey:
        return (self.index, self.entry.name, self.entry.checksum.value, self.part, self.parts)

    @property
    def positions(self) -> range:
        count = self.entry.num_samples
        return range(self.part * count // self.parts, (self.part + 1) * count // self.parts)

    @property
    def tokens(self) -> int:
        """The shard's tokens in proportion to the piece's samples (a sample's own is not listed)."""
        return self.entry.num_tokens * len(self.positions) // max(1, self.entry.num_samples)


@dataclass
class _Progress:
    """What one slot has handed out this epoch (its ``state_dict``)."""

    epoch: int
    done: list[PieceKey] = field(default_factory=list)
    window: list[PieceKey] = field(default_factory=list)
    taken: int = 0  # samples of ``window`` handed out
    finished: bool = False
    listing: dict[str, int] | None = None  # without follow: each index's shards this epoch reads
    ended_by: str | None = None  # why an iterator still reading this progress must stop


class _State(TypedDict):
    """``OutputDataset.state_dict()``, as ``load_state_dict`` checks it."""

    version: int
    uri: str
    epoch: int
    shuffle_seed: int | None
    shuffle_shards: int
    rank: int
    world_size: int
    worker: int
    num_workers: int
    done: list[PieceKey]
    window: list[PieceKey]
    taken: int
    finished: bool
    listing: dict[str, int] | None
    follow: bool


_STATE = TypeAdapter(_State)


@dataclass(frozen=True)
class _Planned:
    """One sample in the slot's order."""

    window: tuple[PieceKey, ...]
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

    ``follow``: read while the job writes; ``stall_timeout_s`` (None: forever) is the longest it
    waits with nothing new listed before it raises ``OutputStalled``. Without ``follow`` an
    output with an index missing or not complete raises ``OutputIncomplete``, unless
    ``allow_incomplete`` (the shards listed now are read, with an ``IncompleteOutputWarning``).
    """

    def __init__(
        self,
        uri: str,
        *,
        rank: int | None = None,
        world_size: int | None = None,
        shuffle_seed: int | None = None,
        follow: bool = False,
        layers: Sequence[int] | None = None,
        verify: bool = True,
        shuffle_shards: int = 8,
        prefetch_bytes: int = 256 * 2**20,
        read_threads: int = 8,
        poll_interval_s: float | None = None,
        stall_timeout_s: float | None = _STALL_TIMEOUT_S,
        allow_incomplete: bool = False,
    ) -> None:
        super().__init__()
        if (rank is None) != (world_size is None):
            raise InvalidArgument("OutputDataset: give rank and world_size together, or neither")
        if rank is None:
            initialised = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if initialised else 0
            world_size = torch.distributed.get_world_size() if initialised else 1
        _check_count("world_size", world_size, 1)
        _check_count("rank", rank, 0)
        assert world_size is not None
        if not rank < world_size:
            raise InvalidArgument(f"OutputDataset: rank {rank} is not in [0, world_size={world_size})")
        _check_count("shuffle_shards", shuffle_shards, 1)
        _check_count("read_threads", read_threads, 1)
        _check_count("prefetch_bytes", prefetch_bytes, 0)
        for name, seconds in (("poll_interval_s", poll_interval_s), ("stall_timeout_s", stall_timeout_s)):
            if seconds is not None and (
                isinstance(seconds, bool) or not isinstance(seconds, int | float) or not seconds > 0
            ):
                raise InvalidArgument(f"OutputDataset: {name}={seconds!r}; give a number of seconds above 0")
        if follow and allow_incomplete:
            raise InvalidArgument(
                "OutputDataset: follow=True waits for the indexes not yet complete, allow_incomplete=True "
                "reads without them: give one"
            )
        self.uri = str(uri)
        self.rank, self.world_size = rank, world_size
        self.shuffle_seed = shuffle_seed
        self.follow = follow
        self.allow_incomplete = allow_incomplete
        self.layers = _checked_layers(layers)
        self.verify = verify
        self.shuffle_shards = shuffle_shards if shuffle_seed is not None else 1
        self.prefetch_bytes = prefetch_bytes
        self.read_threads = read_threads
        remote = uri_scheme(self.uri) is not None
        self.poll_interval_s = poll_interval_s if poll_interval_s is not None else (1.0 if remote else 0.2)
        self.stall_timeout_s = stall_timeout_s
        self.epoch = 0
        self._progress: _Progress | None = None  # the current (or last) iteration's, or a loaded one
        self._restored: _Slot | None = None  # the slot a loaded state is for, until iterated
        self._reading: _Progress | None = None  # the progress of an iterator not yet ended
        # Set by a DataLoader worker that iterates its copy of this dataset, seen by every copy
        # (shared memory): the main process's own state then knows nothing of what was read.
        self._read_in_workers = torch.zeros(1, dtype=torch.int8).share_memory_()

    # -- epochs and state --------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """The epoch the next iteration reads (a loaded state of another epoch is dropped). An
        iterator still reading another epoch raises at its next sample: it would read on where
        ``state_dict()`` no longer looks."""
        _check_count("set_epoch's epoch", epoch, 0)
        if self._reading is not None and self._reading.epoch != epoch:
            self._reading.ended_by = (
                f"set_epoch({epoch}) was called while epoch {self._reading.epoch} was read"
            )
        self.epoch = epoch
        if self._progress is not None and self._progress.epoch != epoch:
            self._progress, self._restored = None, None

    def state_dict(self) -> dict[str, Any]:
        """Where this dataset (in a DataLoader worker: this worker's share) stands in its epoch."""
        if get_worker_info() is None and bool(self._read_in_workers[0]):
            raise RuntimeError(
                "OutputDataset.state_dict() in the main process while DataLoader workers read this "
                "dataset: each worker reads its own copy, so this one knows of nothing read and resuming "
                "from it would repeat the epoch. Use torchdata's StatefulDataLoader (pip install "
                "eagle3-extract[train]) and its state_dict(), which gathers every worker's state"
            )
        slot = self._slot()
        progress = self._progress or _Progress(self.epoch)
        return {
            "version": STATE_VERSION,
            "uri": _output_location(self.uri),
            "epoch": progress.epoch,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_shards": self.shuffle_shards,
            "rank": slot.rank,
            "world_size": slot.world_size,
            "worker": slot.worker,
            "num_workers": slot.num_workers,
            "done": [list(key) for key in progress.done],
            "window": [list(key) for key in progress.window],
            "taken": progress.taken,
            "finished": progress.finished,
            "listing": progress.listing,
            "follow": self.follow,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state`` (``state_dict()`` of a dataset over the same output, with the
        same seed, world size, rank and DataLoader workers): the next iteration hands out exactly
        the rest of its epoch. A state that is not such raises ``InvalidArgument`` (a ValueError)."""
        checked = _checked_state(state)
        slot = self._slot()
        expected = {
            "uri": _output_location(self.uri),
            "follow": self.follow,
            "shuffle_seed": self.shuffle_seed,
            "shuffle_shards": self.shuffle_shards,
            "rank": slot.rank,
            "world_size": slot.world_size,
            "worker": slot.worker,
            "num_workers": slot.num_workers,
        }
        differ = [
            f"{key} {checked[key]!r} (now {value!r})"  # type: ignore[literal-required]
            for key, value in expected.items()
            if checked[key] != value  # type: ignore[literal-required]
        ]
        if differ:
            raise InvalidArgument(
                f"OutputDataset: the state was saved with {', '.join(differ)}; resume over the same output "
                "with the same shuffle_seed, world size, rank and DataLoader num_workers, or start the "
                "epoch again without the state"
            )
        if self._reading is not None:
            self._reading.ended_by = "load_state_dict was called while it read"
        self.epoch = checked["epoch"]
        self._progress = _Progress(
            epoch=checked["epoch"],
            done=[tuple(key) for key in checked["done"]],  # type: ignore[misc]
            window=[tuple(key) for key in checked["window"]],  # type: ignore[misc]
            taken=checked["taken"],
            finished=checked["finished"],
            listing=checked["listing"],
        )
        self._restored = slot

    def _slot(self) -> _Slot:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return _Slot(self.rank, self.world_size, worker, workers)

    # -- iteration ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[dict[str, Any]]:
        slot = self._slot()
        self._read_in_workers[0] = int(get_worker_info() is not None)
        if self._restored is not None and self._restored != slot:
            raise RuntimeError(
                f"OutputDataset: a state was loaded for DataLoader worker {self._restored.worker} of "
                f"{self._restored.num_workers} but worker {slot.worker} of {slot.num_workers} reads it: "
                "a state loaded in the main process does not reach a DataLoader's workers. Use torchdata's "
                "StatefulDataLoader and its load_state_dict(), which hands each worker its own state"
            )
        if self._restored is None or self._progress is None or self._progress.epoch != self.epoch:
            self._progress = _Progress(self.epoch)
        self._restored = None
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
        try:
            plan = _Plan(self, reader, slot, progress)
            plan.begin()
        except BaseException:
            reader.close()
            raise
        prefetch = _Prefetcher(
            plan,
            lambda index, entry: reader.shard(index, entry.name, entry),
            self.prefetch_bytes,
            self.read_threads,
        )
        self._reading = progress
        try:
            while (got := prefetch.next()) is not None:
                planned, shard, pending = got
                sample = shard.build(planned.position, pending.result(), self.layers)
                if tuple(progress.window) != planned.window:
                    progress.window, progress.taken = list(planned.window), 0
                progress.taken += 1
                if planned.last_in_window:
                    progress.done += progress.window
                    progress.window, progress.taken = [], 0
                prefetch.release(planned)
                yield {
                    "sample_id": sample.sample_id,
                    "input_ids": sample.input_ids,
                    "loss_mask": sample.loss_mask,
                    "hidden_states": sample.hidden_states,
                }
                if progress.ended_by is not None:
                    raise RuntimeError(
                        f"OutputDataset: {progress.ended_by}: this iterator stops here (state_dict() "
                        "now describes the next iteration); start a new one (iter(dataset), or the "
                        "DataLoader's) after set_epoch or load_state_dict"
                    )
            progress.finished = True
        finally:
            if self._reading is progress:
                self._reading = None
            prefetch.close()
            reader.close()


def _check_count(name: str, value: object, least: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise InvalidArgument(f"OutputDataset: {name}={value!r}; give a whole number of at least {least}")


def _checked_layers(layers: object) -> list[int] | None:
    """``layers`` as a list of distinct layer ids (None: every stored layer)."""
    if layers is None:
        return None
    if isinstance(layers, str | bytes) or not isinstance(layers, Sequence):
        raise InvalidArgument(
            f"OutputDataset: layers={layers!r}; give a list of stored layer ids such as [2, 5] (None: all)"
        )
    chosen = list(layers)
    if not chosen:
        raise InvalidArgument(
            "OutputDataset: layers=[] picks no layer; give stored layer ids, or None for all"
        )
    if wrong := [layer for layer in chosen if isinstance(layer, bool) or not isinstance(layer, int)]:
        raise InvalidArgument(f"OutputDataset: layers {wrong!r} are not layer ids (whole numbers)")
    if repeated := sorted({layer for layer in chosen if chosen.count(layer) > 1}):
        raise InvalidArgument(
            f"OutputDataset: layers {chosen} name {repeated} more than once; name each once"
        )
    return chosen


def _checked_state(state: object) -> _State:
    """``state`` as ``state_dict()`` returns it, or ``InvalidArgument`` saying what it is not."""
    if isinstance(state, dict) and ("_snapshot" in state or "_num_yielded" in state):
        raise InvalidArgument(
            "OutputDataset.load_state_dict: this is a StatefulDataLoader's state; give it to the "
            "loader's load_state_dict, which hands each worker's dataset its part"
        )
    if isinstance(state, dict) and state.get("version") != STATE_VERSION and "version" in state:
        raise InvalidArgument(
            f"OutputDataset.load_state_dict: state version {state['version']!r}, this reader reads "
            f"{STATE_VERSION}; start the epoch again without the state"
        )
    try:
        checked = _STATE.validate_python(state)
    except ValidationError as exc:
        where = [
            (".".join(str(part) for part in error["loc"]) or "the state", error) for error in exc.errors()
        ]
        missing = [name for name, error in where if error["type"] == "missing"]
        problems = [f"missing {', '.join(missing)}"] if missing else []
        problems += [f"{name}: {error['msg']}" for name, error in where if error["type"] != "missing"]
        raise InvalidArgument(
            f"OutputDataset.load_state_dict: not an OutputDataset state ({_some(problems, 4)}); give "
            "what OutputDataset.state_dict() returned"
        ) from None
    wrong = [
        f"{name} {list(key)}"
        for name in ("done", "window")
        for key in checked[name]  # type: ignore[literal-required]
        if not 0 <= key[3] < key[4]
    ]
    wrong += [f"{name} {checked[name]}" for name in ("taken", "epoch") if checked[name] < 0]  # type: ignore[literal-required]
    if wrong:
        raise InvalidArgument(
            f"OutputDataset.load_state_dict: the state holds impossible values ({_some(wrong, 4)}); "
            "give what OutputDataset.state_dict() returned"
        )
    return checked


class _Plan:
    """The slot's order for one epoch: windows of its pieces, each window's samples shuffled."""

    def __init__(
        self, dataset: OutputDataset, reader: OutputReader, slot: _Slot, progress: _Progress
    ) -> None:
        self.ds = dataset
        self.reader = reader
        self.slot = slot
        self.progress = progress
        self.seen: dict[tuple[str, str, int, int], str] = {
            (index, name, part, parts): checksum
            for index, name, checksum, part, parts in [*progress.done, *progress.window]
        }
        self.work_count: int | None = None  # extraction.json's, once read
        self.names: list[str] = []  # the indexes this epoch reads
        self.manifests: dict[str, Manifest | None] = {}
        self.complete = False
        self.resumed: list[_Piece] = []  # the window a loaded state is in
        self.stop = threading.Event()  # the consumer has gone: end the plan at the next poll

    # -- what the output lists ---------------------------------------------------------------------

    def _poll(self) -> bool:
        """Read the manifests again; True when something new is listed. ``complete``: every index
        is (the epoch can end once its listed shards are read)."""
        reader = self.reader
        before = self._signature()
        if reader.single_index:
            self.names = reader.index_names()
        else:
            if self.work_count is None and (extraction := reader.extraction()) is not None:
                self.work_count = int(extraction["work_count"])
            if self.work_count is None:
                self.names = reader.index_names()  # the job has not started, or wrote no extraction.json
            else:
                self.names = [index_dir_name(i) for i in range(self.work_count)]
        for index in self.names:
            known = self.manifests.get(index)
            if known is None or not known.complete or not self.ds.follow:
                self.manifests[index] = reader.manifest(index)
        listed = {
            (index, entry.name): entry.checksum.value
            for index, manifest in self.manifests.items()
            if manifest is not None
            for entry in manifest.shards
        }
        for (index, name, _, _), checksum in self.seen.items():
            if listed.get((index, name)) != checksum:
                now = (
                    "no longer lists it"
                    if (index, name) not in listed
                    else f"lists checksum {listed[(index, name)]}"
                )
                raise OutputChanged(
                    f"{reader.where(index, name)}: this epoch read it with checksum {checksum}, but "
                    f"{index}'s manifest now {now}: the index was rewritten (another run, or a "
                    "re-extracted damaged shard), so samples already read may come again; start the epoch "
                    "again without the saved state"
                )
        self.complete = (reader.single_index or self.work_count is not None) and not self._incomplete()
        return self._signature() != before

    def _signature(self) -> tuple[Any, ...]:
        return (
            self.work_count,
            tuple(
                (index, -1 if m is None else len(m.shards), m is not None and m.complete)
                for index, m in sorted(self.manifests.items())
            ),
        )

    def _incomplete(self) -> list[str]:
        """What keeps the output from being complete, for messages."""
        found = []
        if not self.reader.single_index and self.work_count is None:
            found.append(
                f"{EXTRACTION} (missing: no run of the job has committed anything at {self.reader.location} "
                "yet, or it was not copied with the output) and so how many indexes there are"
                if self.names
                else f"everything: {self.reader.location} holds no {EXTRACTION} and no index-* (is this "
                "the output.uri the job writes to?)"
            )
        for index in self.names:
            manifest = self.manifests.get(index)
            if manifest is None:
                found.append(f"{index} (no {MANIFEST}: not started, or nothing committed)")
            elif not manifest.complete:
                found.append(f"{index} ({len(manifest.shards)} shards listed, not complete)")
        return found

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

    # -- who reads what ----------------------------------------------------------------------------

    def _pieces(self, visible: dict[str, list[ShardEntry]]) -> list[_Piece]:
        """The listed shards as pieces, split by sample where whole shards would leave a rank
        without samples (see the module's docstring)."""
        ranks = self.slot.world_size
        pieces: list[_Piece] = []
        if self.ds.follow:
            for index, entries in sorted(visible.items()):
                before = 0  # samples in the index's earlier shards: a shard's split depends on them alone
                for entry in entries:
                    parts = max(1, min(ranks, entry.num_samples)) if before < ranks else 1
                    pieces += [_Piece(index, entry, part, parts) for part in range(parts)]
                    before += entry.num_samples
            return pieces
        shards = [(index, entry) for index, entries in sorted(visible.items()) for entry in entries]
        parts = [1] * len(shards)
        while sum(parts) < ranks:
            splittable = [k for k, (_, entry) in enumerate(shards) if parts[k] < entry.num_samples]
            if not splittable:
                break
            parts[max(splittable, key=lambda k: (shards[k][1].num_samples / parts[k], -k))] += 1
        for (index, entry), count in zip(shards, parts, strict=True):
            pieces += [_Piece(index, entry, part, count) for part in range(count)]
        return pieces

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

    def _owners(self, pieces: list[_Piece]) -> dict[tuple[str, str, int, int], tuple[int, int]]:
        """(rank, worker) of every piece: to the least-loaded rank in tokens (then pieces), then
        to that rank's least-loaded worker (ties in the index's rotation). Without follow, over
        all pieces at once, largest first: ranks end within one shard of each other. With follow,
        per index in manifest order, a manifest only growing at its end: a piece's owner depends
        on the pieces listed before it in its index alone, so it never changes as others appear."""
        slot = self.slot
        if self.ds.follow:
            by_index: dict[str, list[_Piece]] = {}
            for piece in pieces:
                by_index.setdefault(piece.index, []).append(piece)
            groups = list(by_index.values())
        else:
            groups = [
                sorted(
                    pieces,
                    key=lambda p: (-p.tokens, p.index, shard_number(p.entry.name) or 0, p.part),
                )
            ]
        owners: dict[tuple[str, str, int, int], tuple[int, int]] = {}
        for group in groups:
            ranks = [(0, 0)] * slot.world_size
            workers = [[(0, 0)] * slot.num_workers for _ in range(slot.world_size)]
            for piece in group:
                rank = min(self._rotation(piece.index, slot.world_size), key=lambda r: ranks[r])
                worker = min(
                    self._rotation(piece.index, slot.num_workers), key=lambda w, r=rank: workers[r][w]
                )
                tokens, count = ranks[rank]
                ranks[rank] = (tokens + piece.tokens, count + 1)
                tokens, count = workers[rank][worker]
                workers[rank][worker] = (tokens + piece.tokens, count + 1)
                owners[piece.id] = (rank, worker)
        return owners

    def _check_every_rank(self, pieces: list[_Piece], owners: dict[Any, tuple[int, int]]) -> None:
        """Refuse a split that leaves a rank without samples: its first collective step would hang
        the others' (DDP)."""
        empty = sorted(set(range(self.slot.world_size)) - {rank for rank, _ in owners.values()})
        if empty:
            samples = sum(piece.entry.num_samples for piece in pieces if piece.part == 0)
            shards = sum(piece.part == 0 for piece in pieces)
            raise InvalidArgument(
                f"OutputDataset: {self.reader.location} holds {samples} samples in {shards} shards; split "
                f"over world_size {self.slot.world_size}, ranks {_some([str(r) for r in empty])} get none "
                "(with follow, each index is split on its own), and a rank without samples hangs the "
                f"others' first collective step. Train on fewer ranks (at most {samples}), or on more data"
            )

    # -- the order ---------------------------------------------------------------------------------

    def begin(self) -> None:
        """The first look at the output, in the consumer's thread before anything is read: without
        follow, an incomplete output (or, with ``allow_incomplete``, a warning) and a split that
        leaves a rank without samples are raised here; a loaded state's window is found again."""
        self._poll()
        if not self.ds.follow:
            if incomplete := self._incomplete():
                what = _some(incomplete)
                if not self.ds.allow_incomplete:
                    raise OutputIncomplete(
                        f"OutputDataset: {self.reader.location} is not complete: {what}. An epoch over it "
                        "would miss their samples. Wait for the job to finish (or rerun those indexes: a "
                        "rerun resumes), read while it writes with follow=True, or read the shards listed "
                        "now with allow_incomplete=True"
                    )
                warnings.warn(
                    f"OutputDataset: {self.reader.location} is not complete ({what}); this epoch reads the "
                    "shards listed now (allow_incomplete=True). Every rank must see the same: read an "
                    "output no job is writing to",
                    IncompleteOutputWarning,
                    stacklevel=3,
                )
            pieces = self._pieces(self._visible())
            self._check_every_rank(pieces, self._owners(pieces))
        if self.progress.window:
            entries = {
                (index, entry.name): entry
                for index, manifest in self.manifests.items()
                if manifest is not None
                for entry in manifest.shards
            }
            self.resumed = [
                _Piece(index, entries[(index, name)], part, parts)
                for index, name, _, part, parts in self.progress.window
            ]
            samples = sum(len(piece.positions) for piece in self.resumed)
            if self.progress.taken >= samples:
                raise InvalidArgument(
                    f"OutputDataset.load_state_dict: the state says {self.progress.taken} samples of its "
                    f"window were handed out, the window holds {samples}; give what state_dict() returned"
                )

    def _candidates(self) -> list[_Piece]:
        pieces = self._pieces(self._visible())
        owners = self._owners(pieces)
        if self.complete and self.ds.follow:
            self._check_every_rank(pieces, owners)
        mine = (self.slot.rank, self.slot.worker)
        found = [piece for piece in pieces if piece.id not in self.seen and owners[piece.id] == mine]
        seed = self.ds.shuffle_seed
        if seed is None:
            return found
        return sorted(found, key=lambda piece: _hash("order", seed, self.progress.epoch, piece.id))

    def _window_order(self, window: list[_Piece]) -> list[tuple[int, int]]:
        """(piece in window, position) pairs in the order they are handed out."""
        pairs = [(k, position) for k, piece in enumerate(window) for position in piece.positions]
        if self.ds.shuffle_seed is None:
            return pairs
        keys = [piece.id for piece in window]
        rng = np.random.default_rng(_hash("window", self.ds.shuffle_seed, self.progress.epoch, keys))
        return [pairs[i] for i in rng.permutation(len(pairs))]

    def _window_items(self, window: list[_Piece], skip: int) -> Iterator[_Planned]:
        keys = tuple(piece.key for piece in window)
        order = self._window_order(window)
        for n, (k, position) in enumerate(order):
            if n >= skip:
                yield _Planned(keys, n == len(order) - 1, window[k].index, window[k].entry, position)

    def items(self) -> Iterator[_Planned]:
        if self.resumed:
            yield from self._window_items(self.resumed, self.progress.taken)
        waiting_since: float | None = None
        while True:
            candidates = self._candidates()
            if candidates:
                window = candidates[: self.ds.shuffle_shards]
                for piece in window:
                    self.seen[piece.id] = piece.entry.checksum.value
                yield from self._window_items(window, 0)
                waiting_since = None
                continue
            if self.complete or not self.ds.follow:
                return
            now = time.monotonic()
            waiting_since = now if waiting_since is None else waiting_since
            timeout = self.ds.stall_timeout_s
            if timeout is not None and now - waiting_since >= timeout:
                raise OutputStalled(
                    f"OutputDataset: nothing new listed at {self.reader.location} for "
                    f"{now - waiting_since:.0f} s (stall_timeout_s={timeout:g}) while following it; still "
                    "incomplete: "
                    f"{_some(self._incomplete())}. Is the job running? Rerun the indexes that stopped (a "
                    "rerun resumes), give a longer stall_timeout_s (None waits forever), or read what is "
                    "listed without follow (allow_incomplete=True)"
                )
            wait = self.ds.poll_interval_s
            if timeout is not None:
                wait = min(wait, max(0.0, waiting_since + timeout - now))
            if self.stop.wait(wait):
                return
            if self._poll():
                waiting_since = None


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
