"""Random access to an output: one sample by (index, shard, position), checked, local or remote.

>>> reader = OutputReader("s3://bucket/run")           # or a local output directory
>>> manifest = reader.manifest("index-00000")           # None: the index has committed nothing
>>> sample = reader.sample("index-00000", manifest.shards[0].name, 3)

What is read where:

* a local output: each shard is memory-mapped (copy-on-write, so tensors are writable views and
  writing to one never reaches the file); a sample's tensors are views of the mapping, no copy;
* an object store (``s3://``): a shard's header and its tail (``sample_offsets``, FP8 scales,
  ``input_ids``, ``loss_mask``: a few bytes per token) are fetched once when the shard is opened,
  two ranged GETs; a sample then costs one ranged GET of its hidden-state rows, split into parts
  of about ``PART_BYTES`` (cut where the object's own 8 MiB boundaries are) fetched in parallel
  (``read_threads``) straight into memory reused from sample to sample (``Buffers``). Every GET
  is pinned to the version (ETag) the shard had when it was opened, and is retried like the
  job's own transport does (``job.storage.s3``): botocore's retries, and a body that breaks off
  is fetched again from where it stopped.

Checksums (``verify=True``, the default): the manifest lists each shard's CRC64NVME and, since
per-range checksums exist, a ``RangeChecksums`` entry (``job.manifest``): one CRC64NVME over the
header with the sample offsets, and one per sample over exactly the bytes a sample is built from
(its rows, its FP8 scales, its ids, its mask, in file order). A shard's layout is checked when it
is opened, a sample's bytes each time it is read, before any tensor is made of them: every byte
handed out is covered by a checked CRC64NVME, and reading one sample reads no other. A shard
listed without ``ranges`` (a manifest from before them) is verified whole when opened: its file
checksummed through the mapping, or its object streamed once through the checksum (then read by
ranges pinned to the same version). A mismatch raises ``DamagedShard`` naming the shard and
sample; nothing is handed out from it.
"""

from __future__ import annotations

import itertools
import json
import mmap
import os
import struct
import threading
import weakref
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from numbers import Integral
from pathlib import Path
from typing import Any

import numpy as np
import torch
from awscrt.checksums import combine_crc64nvme, crc64nvme

from job.checksum import crc64nvme_file, encode
from job.errors import ConfigError, DamagedShard
from job.hidden_dtype import SCALE_BYTES, hidden_dtype
from job.layout import EXTRACTION, MANIFEST
from job.manifest import Manifest, ShardEntry
from job.shards.format import FORMAT_VERSION
from job.storage import connect_transport, uri_scheme
from job.storage.transport import ObjectInfo, ObjectTransport

PART_BYTES = 8 * 2**20  # one ranged GET of a sample's rows at most: large requests, yet parallel
_HEADER_GUESS = 64 * 1024  # the first GET of a shard: its header (padded to 4 KiB) is usually less
_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
_REEXTRACT = (
    "rerun that index of the job with output.verify_on_resume=checksum and "
    "output.on_damaged_shard=reextract (it drops and extracts the damaged shard again), or restore it"
)


@dataclass(frozen=True)
class Sample:
    sample_id: str
    input_ids: torch.Tensor  # int32 [T]
    loss_mask: torch.Tensor  # uint8 [T]
    hidden_states: torch.Tensor  # [T, L, H] in the model dtype (FP8 is decoded)
    layer_ids: list[int]


@dataclass(frozen=True)
class _Tensor:
    dtype: str
    shape: tuple[int, ...]
    start: int  # absolute offset in the file
    stop: int


class ShardRows:
    """One open shard: its header, sample offsets and the means to read any sample's bytes."""

    def __init__(self, where: str, entry: ShardEntry, header: bytes, body: _Body, verify: bool) -> None:
        self.where = where
        self.entry = entry
        self._body = body
        self._verify = verify
        try:
            parsed = json.loads(header[8:])
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise DamagedShard(
                f"{where}: header is not JSON ({exc}); the shard is damaged: {_REEXTRACT}"
            ) from None
        raw = parsed.pop("__metadata__", None) or {}
        if raw.get("format_version") != FORMAT_VERSION:
            raise ConfigError(
                f"{where}: shard format_version {raw.get('format_version')!r}, this reader reads "
                f"{FORMAT_VERSION}; read it with the job version that wrote it"
            )
        base = len(header)
        self.tensors = {
            name: _Tensor(
                spec["dtype"],
                tuple(spec["shape"]),
                base + spec["data_offsets"][0],
                base + spec["data_offsets"][1],
            )
            for name, spec in parsed.items()
        }
        self.metadata = raw
        self.sample_ids: list[str] = json.loads(raw["sample_ids"])
        self.layer_ids: list[int] = json.loads(raw["layer_ids"])
        self.stored = hidden_dtype(raw["dtype"])
        self.model_dtype = hidden_dtype(raw["model_dtype"]).torch
        hidden = self.tensors["hidden_states"]
        self.num_tokens, self.num_layers, self.hidden_size = hidden.shape
        self.row_bytes = self.num_layers * self.hidden_size * self.stored.itemsize
        spec = self.tensors["sample_offsets"]
        self.offsets = np.frombuffer(body.read(spec.start, spec.stop), np.int64)
        if verify and entry.ranges is not None:
            crc = crc64nvme(self.offsets, crc64nvme(header))
            if encode(crc) != entry.ranges.layout:
                raise DamagedShard(
                    f"{where}: header and sample offsets have checksum {encode(crc)}, the manifest lists "
                    f"{entry.ranges.layout}; the shard is damaged: {_REEXTRACT}"
                )
        if self.sample_ids != entry.sample_ids or int(self.offsets[-1]) != self.num_tokens:
            raise DamagedShard(
                f"{where}: its header lists other samples than the manifest does; the shard is damaged "
                f"or was replaced: {_REEXTRACT}"
            )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def _check(self, position: int) -> None:
        if isinstance(position, bool) or not isinstance(position, Integral) or not 0 <= position < len(self):
            raise IndexError(
                f"{self.where}: no sample at position {position!r}; it holds {len(self)} "
                f"(positions 0 to {len(self) - 1})"
            )

    def tokens(self, position: int) -> int:
        return int(self.offsets[position + 1] - self.offsets[position])

    def token_ids(self, position: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``position``'s input ids and loss mask alone, its rows unread (remote: from the tail
        fetched when the shard was opened). Unchecked: the sample's checksum covers them only with
        its rows (``sample``)."""
        self._check(position)
        a, b = int(self.offsets[position]), int(self.offsets[position + 1])
        ids, mask = self.tensors["input_ids"], self.tensors["loss_mask"]
        return (
            _tensor(self._body.read(ids.start + a * 4, ids.start + b * 4), torch.int32),
            _tensor(self._body.read(mask.start + a, mask.start + b), torch.uint8),
        )

    def sample_bytes(self, position: int) -> int:
        """Bytes read for sample ``position`` (its rows; the tail came with the shard)."""
        return self.tokens(position) * self.row_bytes

    def positions(self, layers: list[int] | None) -> list[int] | None:
        """Where stored layers ``layers`` sit in a row; None for all of them in stored order."""
        if layers is None or layers == self.layer_ids:
            return None
        missing = [layer for layer in layers if layer not in self.layer_ids]
        if missing:
            raise ConfigError(f"{self.where}: layers {missing} are not stored (stored: {self.layer_ids})")
        return [self.layer_ids.index(layer) for layer in layers]

    def fetch(
        self, position: int, pool: ThreadPoolExecutor | None = None, buffers: Buffers | None = None
    ) -> _Pending:
        """Start reading sample ``position``'s rows (``pool``: remote parts go there; ``buffers``:
        where their memory comes from)."""
        self._check(position)
        a, b = int(self.offsets[position]), int(self.offsets[position + 1])
        start = self.tensors["hidden_states"].start
        return self._body.fetch(start + a * self.row_bytes, start + b * self.row_bytes, pool, buffers)

    def will_need(self, position: int) -> None:
        """Ask the kernel to read sample ``position``'s rows ahead (a local shard; remote ones are
        read ahead by ``fetch``)."""
        a, b = int(self.offsets[position]), int(self.offsets[position + 1])
        start = self.tensors["hidden_states"].start
        self._body.will_need(start + a * self.row_bytes, start + b * self.row_bytes)

    def sample(self, position: int, layers: list[int] | None = None) -> Sample:
        """Sample ``position`` (read now)."""
        return self.build(position, self.fetch(position).result(), layers)

    def build(self, position: int, rows: memoryview, layers: list[int] | None = None) -> Sample:
        """Sample ``position`` from its rows' bytes (``fetch``), checked first."""
        self._check(position)
        a, b = int(self.offsets[position]), int(self.offsets[position + 1])
        parts = [rows]
        scales = None
        if self.stored.scaled:
            spec = self.tensors["hidden_states_scale"]
            scales = self._body.read(
                spec.start + a * self.num_layers * SCALE_BYTES, spec.start + b * self.num_layers * SCALE_BYTES
            )
            parts.append(scales)
        spec = self.tensors["input_ids"]
        ids = self._body.read(spec.start + a * 4, spec.start + b * 4)
        spec = self.tensors["loss_mask"]
        mask = self._body.read(spec.start + a, spec.start + b)
        parts += [ids, mask]
        if self._verify and self.entry.ranges is not None:
            crc = 0
            for part in parts:
                crc = combine_crc64nvme(crc, crc64nvme(part), len(part))
            expected = self.entry.ranges.samples[position]
            if encode(crc) != expected:
                raise DamagedShard(
                    f"{self.where}: checksum {encode(crc)} of sample {position} "
                    f"({self.sample_ids[position]}) differs from the manifest's {expected}; "
                    f"the shard is damaged: {_REEXTRACT}"
                )
        count = b - a
        hidden = _tensor(rows, self.stored.torch).view(count, self.num_layers, self.hidden_size)
        if scales is not None:
            factors = _tensor(scales, torch.float32).view(count, self.num_layers, 1)
            hidden = (hidden.to(torch.float32) * factors).to(self.model_dtype)
        chosen = self.positions(layers)
        if chosen is not None:
            hidden = hidden[:, chosen]
        return Sample(
            sample_id=self.sample_ids[position],
            input_ids=_tensor(ids, torch.int32),
            loss_mask=_tensor(mask, torch.uint8),
            hidden_states=hidden,
            layer_ids=self.layer_ids if chosen is None else [self.layer_ids[i] for i in chosen],
        )


def _tensor(data: memoryview, dtype: torch.dtype) -> torch.Tensor:
    """A tensor over ``data``'s memory (writable memory: a private mapping or a fetched buffer)."""
    if len(data) == 0:
        return torch.empty(0, dtype=dtype)
    if dtype == torch.float8_e4m3fn:  # frombuffer has no FP8
        return torch.frombuffer(data, dtype=torch.uint8).view(dtype)
    return torch.frombuffer(data, dtype=dtype)


class _Pending:
    """A sample's rows being read: ``result()`` waits for every part."""

    def __init__(self, buffer: memoryview, parts: list[Future[None]]) -> None:
        self._buffer = buffer
        self._parts = parts

    def done(self) -> bool:
        return all(part.done() for part in self._parts)

    def result(self) -> memoryview:
        for part in self._parts:
            part.result()
        return self._buffer


class Buffers:
    """Memory for fetched rows: regions of one array of ``ring_bytes``, each sample's the lowest
    free one that fits, so the same pages serve sample after sample. Fresh memory costs a page
    fault per page: a pool of whole buffers, of sizes as varied as samples', had none large
    enough for 26 of 65 samples, and 1.2 of 2 GB were read into fresh pages (1.3-2.1 s of
    system time where boto3 took 0.6 s). A region is free again once nothing refers to its view
    of the array: the tensors made over it (``torch.frombuffer``) keep the view alive while any
    of them lives; this keeps only a weak reference. Where no free region fits (the consumer
    keeps samples), and for a sample larger than ``ring_bytes``, the buffer is fresh memory,
    dropped with its sample."""

    def __init__(self, ring_bytes: int) -> None:
        self._size = ring_bytes
        self._ring: np.ndarray | None = None  # made on first use; its pages are touched as they are used
        self._regions: list[tuple[int, int, weakref.ref[np.ndarray]]] = []  # handed out, by start
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        with self._lock:
            self._regions = [r for r in self._regions if r[2]() is not None]
            # the lowest gap that fits: the pages touched are about those of the bytes held at once
            start = 0
            for a, b, _ in self._regions:
                if a - start >= nbytes:
                    break
                start = b
            if 0 < nbytes <= self._size - start:
                if self._ring is None:
                    self._ring = _anonymous(self._size)
                view = self._ring[start : start + nbytes]
                self._regions.append((start, start + nbytes, weakref.ref(view)))
                self._regions.sort(key=lambda r: r[0])
                return memoryview(view)
            return memoryview(_anonymous(nbytes))


def _anonymous(nbytes: int) -> np.ndarray:
    """Fresh memory, its pages zeroed by the kernel as they are first written: no zero-filling
    pass (bytearray's), and small pages. numpy asks for huge pages for large arrays
    (``MADV_HUGEPAGE``), which on a host with fragmented memory made first writes 4 times as
    slow (512 MiB: 1.1 s of system time against 0.2 s), the kernel compacting memory for huge
    pages it then often did not find."""
    if nbytes == 0:
        return np.empty(0, np.uint8)
    return np.frombuffer(mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE), np.uint8)


class _Body:
    """A shard's bytes by absolute offset."""

    def read(self, start: int, stop: int) -> memoryview:
        raise NotImplementedError

    def fetch(
        self, start: int, stop: int, pool: ThreadPoolExecutor | None, buffers: Buffers | None = None
    ) -> _Pending:
        raise NotImplementedError

    def will_need(self, start: int, stop: int) -> None:
        """Bytes about to be read (a hint)."""


class _MappedBody(_Body):
    def __init__(self, path: Path) -> None:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            # Copy-on-write: tensors over it are writable (torch needs that), the file never changes.
            self._mapping = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY) if size else None
        self._view = memoryview(self._mapping) if self._mapping is not None else memoryview(b"")

    def read(self, start: int, stop: int) -> memoryview:
        return self._view[start:stop]

    def fetch(
        self, start: int, stop: int, pool: ThreadPoolExecutor | None, buffers: Buffers | None = None
    ) -> _Pending:
        return _Pending(self._view[start:stop], [])

    def will_need(self, start: int, stop: int) -> None:
        if self._mapping is not None and stop > start:
            first = start - start % mmap.PAGESIZE
            self._mapping.madvise(mmap.MADV_WILLNEED, first, stop - first)


class _ObjectBody(_Body):
    def __init__(
        self, transport: ObjectTransport, info: ObjectInfo, tail_start: int, tail: bytearray
    ) -> None:
        self._transport = transport
        self._info = info
        self._tail_start = tail_start
        self._tail = memoryview(tail)

    def read(self, start: int, stop: int) -> memoryview:
        if start >= self._tail_start:
            return self._tail[start - self._tail_start : stop - self._tail_start]
        return self.fetch(start, stop, None).result()

    def fetch(
        self, start: int, stop: int, pool: ThreadPoolExecutor | None, buffers: Buffers | None = None
    ) -> _Pending:
        buffer = (buffers or Buffers(0)).take(stop - start)
        parts = []
        for first, last in _parts(start, stop):
            target = buffer[first - start : last - start]
            if pool is None:
                future: Future[None] = Future()
                try:
                    self._transport.read_range(self._info, first, target)
                    future.set_result(None)
                except BaseException as exc:
                    future.set_exception(exc)
            else:
                future = pool.submit(self._transport.read_range, self._info, first, target)
            parts.append(future)
        return _Pending(buffer, parts)


def _parts(start: int, stop: int) -> list[tuple[int, int]]:
    """Bytes ``[start, stop)`` of an object as ranged GETs: cut at multiples of ``PART_BYTES`` in
    the object, as stores keep it (an upload's parts, SeaweedFS's chunks: 2 GiB in unaligned 8 MiB
    ranges cost SeaweedFS 2.5-2.7 s of CPU time here, aligned 2.1-2.3 s), a piece under half a
    part at either end joined to its neighbour."""
    cuts = list(range(start - start % PART_BYTES + PART_BYTES, stop, PART_BYTES))
    if cuts and cuts[0] - start < PART_BYTES // 2:
        cuts.pop(0)
    if cuts and stop - cuts[-1] < PART_BYTES // 2:
        cuts.pop()
    return list(itertools.pairwise([start, *cuts, stop])) if stop > start else []


class OutputReader:
    """An output (a local directory or ``s3://bucket/prefix``; or one ``index-*`` of it) for readers.

    ``manifest(index)`` reads an index's manifest as it is now (``refresh`` reads every index's
    again); ``shard(index, name)`` opens a listed shard (kept open, up to ``max_open``);
    ``sample(index, name, position)`` reads one sample. Thread-safe.
    """

    def __init__(
        self,
        uri: str | Path,
        *,
        verify: bool = True,
        setting: str = "output",
        read_threads: int = 8,
        future: bool = False,
        max_open: int = 64,
    ) -> None:
        """``future``: the output may not exist yet (a reader following a job about to start);
        ``max_open``: shards kept open (a local one's pages stay resident while it is mapped)."""
        for name, value in (("read_threads", read_threads), ("max_open", max_open)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{setting}: {name}={value!r}; give a whole number of at least 1")
        self.uri = str(uri)
        self.max_open = max_open
        self.verify = verify
        self.setting = setting
        self.read_threads = read_threads
        self._lock = threading.Lock()
        self._open: OrderedDict[tuple[str, str], ShardRows] = OrderedDict()
        self._manifests: dict[str, Manifest | None] = {}
        self._transport: ObjectTransport | None = None
        if uri_scheme(self.uri) is None:
            self.root = Path(self.uri.removeprefix("file://")).expanduser()
            self.location = str(self.root)
            if not self.root.exists() and not future:
                raise ConfigError(f"{setting} {self.root}: does not exist")
            if self.root.exists() and not self.root.is_dir():
                raise ConfigError(
                    f"{setting} {self.root}: not a directory (give an output directory or one index-*)"
                )
            self.single_index = (self.root / MANIFEST).is_file() and not any(self.root.glob("index-*"))
            self._prefix = ""
            found = self.single_index or any(d.is_dir() for d in self.root.glob("index-*"))
        else:
            self._transport, prefix = connect_transport(self.uri, setting, read_threads=read_threads)
            self._prefix = f"{prefix}/" if prefix else ""
            self.location = self._transport.url(prefix).rstrip("/")
            indexes = self._transport.list(self._prefix + "index-")
            self.single_index = not indexes and self._transport.head(self._prefix + MANIFEST) is not None
            self.root = Path()
            found = self.single_index or bool(indexes)
        if not found and not future:  # a follower may start before the job has written anything
            raise ConfigError(
                f"{setting} {self.location}: holds no index-* and no {MANIFEST} "
                "(give an output or one index-*)"
            )
        self.single_name = self.location.rstrip("/").rsplit("/", 1)[-1]

    # -- what the output holds ---------------------------------------------------------------------

    def index_names(self) -> list[str]:
        """Every index present (``index-NNNNN``), in order; the index itself for a single index."""
        if self.single_index:
            return [self.single_name]
        if self._transport is None:
            return sorted(d.name for d in self.root.glob("index-*") if d.is_dir())  # none if no root yet
        base = len(self._prefix)
        keys = self._transport.list(self._prefix + "index-")
        return sorted({info.key[base:].split("/", 1)[0] for info in keys if "/" in info.key[base:]})

    def _key(self, index: str, name: str) -> str:
        return name if self.single_index else f"{index}/{name}"

    def where(self, index: str, name: str) -> str:
        """A shard's (or file's) address, for messages."""
        if self._transport is None:
            return str(self.root / self._key(index, name))
        return self._transport.url(self._prefix + self._key(index, name))

    def _read_small(self, relative: str) -> bytes | None:
        if self._transport is None:
            try:
                return (self.root / relative).read_bytes()
            except FileNotFoundError:
                return None
        found = self._transport.get(self._prefix + relative)
        return None if found is None else found[0]

    def extraction(self) -> dict[str, Any] | None:
        """The output's ``extraction.json`` (what every index shares, work_count among it)."""
        if self.single_index:
            return None
        data = self._read_small(EXTRACTION)
        return None if data is None else json.loads(data)

    def manifest(self, index: str) -> Manifest | None:
        """Index ``index``'s manifest as it is now (None: nothing committed yet)."""
        data = self._read_small(self._key(index, MANIFEST))
        found = None if data is None else Manifest.from_bytes(data, self.where(index, MANIFEST))
        with self._lock:
            self._manifests[index] = found
        return found

    def refresh(self) -> dict[str, Manifest | None]:
        """Every present index's manifest, read again."""
        return {index: self.manifest(index) for index in self.index_names()}

    def entry(self, index: str, name: str) -> ShardEntry:
        """Shard ``name``'s entry in the last manifest read of ``index``."""
        with self._lock:
            manifest = self._manifests.get(index)
        if manifest is None:
            manifest = self.manifest(index)
        for entry in manifest.shards if manifest is not None else []:
            if entry.name == name:
                return entry
        raise DamagedShard(
            f"{self.where(index, name)}: not listed in {index}/{MANIFEST} (was the index rewritten by "
            "another run?); start reading again from the output as it is now"
        )

    # -- shards and samples ------------------------------------------------------------------------

    def shard(self, index: str, name: str, entry: ShardEntry | None = None) -> ShardRows:
        """Listed shard ``name`` of ``index`` (its ``entry``, else the last manifest read's), open."""
        key = (index, name)
        with self._lock:
            found = self._open.get(key)
            if found is not None and (entry is None or found.entry == entry):
                self._open.move_to_end(key)
                return found
        entry = entry or self.entry(index, name)
        opened = self._open_shard(index, entry)
        with self._lock:
            self._open[key] = opened
            while len(self._open) > self.max_open:
                self._open.popitem(last=False)
        return opened

    def sample(self, index: str, name: str, position: int, layers: list[int] | None = None) -> Sample:
        """One sample: ``position`` among shard ``name``'s samples (the manifest's ``sample_ids`` order).
        An index, shard or position the output does not hold raises ``LookupError`` (``IndexError``
        for a position) saying what it holds."""
        with self._lock:
            manifest = self._manifests.get(index)
        if manifest is None or name not in {entry.name for entry in manifest.shards}:
            manifest = self.manifest(index)  # the last one read may be older than the shard
        if manifest is None:
            present = self.index_names()
            raise LookupError(
                f"{self.where(index, MANIFEST)}: no such manifest; {self.location} holds "
                + (f"indexes {_some(present)}" if present else "no index-*")
            )
        names = [entry.name for entry in manifest.shards]
        if name not in names:
            raise LookupError(
                f"{self.where(index, name)}: not listed in {index}/{MANIFEST}; it lists "
                + (f"{len(names)} shards: {_some(names)}" if names else "no shard")
            )
        return self.shard(index, name).sample(position, layers)

    def _open_shard(self, index: str, entry: ShardEntry) -> ShardRows:
        where = self.where(index, entry.name)
        if self._transport is None:
            path = self.root / self._key(index, entry.name)
            if not path.is_file():
                raise DamagedShard(f"{where}: listed in {index}/{MANIFEST} but missing: {_REEXTRACT}")
            size = path.stat().st_size
            _check_size(where, size, entry)
            if self.verify and entry.ranges is None and (crc := crc64nvme_file(path)) != entry.checksum.value:
                raise DamagedShard(
                    f"{where}: checksum {crc} differs from the manifest's {entry.checksum.value}; "
                    f"the shard is damaged: {_REEXTRACT}"
                )
            body: _Body = _MappedBody(path)
            header = bytes(body.read(0, _header_length(where, body.read(0, 8), size)))
            return ShardRows(where, entry, header, body, self.verify)
        transport = self._transport
        info = transport.head(self._prefix + self._key(index, entry.name))
        if info is None:
            raise DamagedShard(f"{where}: listed in {index}/{MANIFEST} but missing: {_REEXTRACT}")
        _check_size(where, info.size, entry)
        if self.verify and entry.ranges is None:
            _stream_checked(transport, info, entry, where)
        first = bytearray(min(_HEADER_GUESS, info.size))
        transport.read_range(info, 0, memoryview(first))
        length = _header_length(where, memoryview(first)[:8], info.size)
        if length > len(first):
            rest = bytearray(length - len(first))
            transport.read_range(info, len(first), memoryview(rest))
            first += rest
        header = bytes(first[:length])
        tail_start = _tail_start(header)
        tail = bytearray(info.size - tail_start)
        transport.read_range(info, tail_start, memoryview(tail))
        return ShardRows(where, entry, header, _ObjectBody(transport, info, tail_start, tail), self.verify)

    def close(self) -> None:
        with self._lock:
            self._open.clear()
        if self._transport is not None:
            self._transport.close()

    def __getstate__(self) -> dict[str, Any]:
        raise TypeError("an OutputReader is opened where it is used (connections and mappings do not travel)")


def _some(items: Sequence[str], limit: int = 8) -> str:
    """``items`` for a message: the first ``limit`` and how many more."""
    shown = ", ".join(items[:limit])
    return shown if len(items) <= limit else f"{shown} and {len(items) - limit} more"


def _check_size(where: str, size: int, entry: ShardEntry) -> None:
    if size != entry.bytes:
        raise DamagedShard(
            f"{where}: {size} bytes, but the manifest lists {entry.bytes}; the shard is damaged: {_REEXTRACT}"
        )


def _header_length(where: str, prefix: memoryview, size: int) -> int:
    """The header's length with its 8-byte prefix."""
    if len(prefix) < 8 or not 0 < (length := struct.unpack("<Q", prefix)[0]) <= min(
        _MAX_HEADER_BYTES, size - 8
    ):
        raise DamagedShard(f"{where}: not a safetensors file (no header); the shard is damaged: {_REEXTRACT}")
    return 8 + length


def _tail_start(header: bytes) -> int:
    """Where the shard's small tensors start: everything after hidden_states (format.py: it
    comes first)."""
    spec = json.loads(header[8:])["hidden_states"]
    return len(header) + spec["data_offsets"][1]


def _stream_checked(transport: ObjectTransport, info: ObjectInfo, entry: ShardEntry, where: str) -> None:
    """The whole object through CRC64NVME (a shard listed without per-range checksums)."""
    crc, buffer = 0, bytearray(PART_BYTES)
    view = memoryview(buffer)
    for start in range(0, info.size, PART_BYTES):
        part = view[: min(PART_BYTES, info.size - start)]
        transport.read_range(info, start, part)
        crc = crc64nvme(part, crc)
    if encode(crc) != entry.checksum.value:
        raise DamagedShard(
            f"{where}: checksum {encode(crc)} differs from the manifest's {entry.checksum.value}; "
            f"the shard is damaged: {_REEXTRACT}"
        )
