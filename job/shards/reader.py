"""Read shards: ``open_shard(path)`` and ``iter_output(output)``.

Only shards listed in an index's manifest are read; anything else in the
directory is an interrupted run's leftover and is ignored. ``iter_output``
reads a local output or an object-store one (``s3://bucket/prefix``) in index and
manifest order through ``job.shards.access`` (memory maps, ranged GETs), which
checks every sample against the manifest's checksums before handing it out
(DamagedShard names the shard otherwise); ``verify=False`` skips the checksums.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from job.hidden_dtype import hidden_dtype
from job.layout import MANIFEST
from job.manifest import Manifest
from job.shards.access import OutputReader, Sample, ShardRows
from job.shards.format import FORMAT_VERSION


class Shard:
    """A read-only view of one shard file; samples are loaded lazily."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._file = safe_open(str(self.path), framework="pt")
        raw = self._file.metadata() or {}
        if raw.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{self.path}: unsupported shard format_version {raw.get('format_version')!r}")
        self.metadata: dict[str, Any] = {
            k: json.loads(v) if k in ("sample_ids", "layer_ids", "backend_info") else v
            for k, v in raw.items()
        }
        self.sample_ids: list[str] = self.metadata["sample_ids"]
        self.layer_ids: list[int] = self.metadata["layer_ids"]
        self.dtype = hidden_dtype(self.metadata["dtype"])
        self.model_dtype = hidden_dtype(self.metadata["model_dtype"]).torch
        self.offsets = self._file.get_tensor("sample_offsets")
        self._input_ids = self._file.get_tensor("input_ids")
        self._loss_mask = self._file.get_tensor("loss_mask")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @property
    def num_tokens(self) -> int:
        return int(self.offsets[-1])

    def hidden_rows(self, start: int, stop: int) -> torch.Tensor:
        """Hidden states of token rows [start, stop) decoded to the model dtype."""
        rows = self._file.get_slice("hidden_states")[start:stop]
        if self.dtype.scaled:
            scales = self._file.get_slice("hidden_states_scale")[start:stop]
            return (rows.to(torch.float32) * scales.unsqueeze(-1)).to(self.model_dtype)
        return rows

    def sample(self, i: int) -> Sample:
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return Sample(
            sample_id=self.sample_ids[i],
            input_ids=self._input_ids[a:b],
            loss_mask=self._loss_mask[a:b],
            hidden_states=self.hidden_rows(a, b),
            layer_ids=self.layer_ids,
        )

    def __iter__(self) -> Iterator[Sample]:
        for i in range(len(self)):
            yield self.sample(i)


def open_shard(path: str | Path) -> Shard:
    return Shard(path)


def read_manifest(index_dir: str | Path) -> Manifest | None:
    path = Path(index_dir) / MANIFEST
    if not path.is_file():
        return None
    return Manifest.from_bytes(path.read_bytes(), str(path))


def iter_output(
    output: str | Path, require_complete: bool = False, verify: bool = True, *, setting: str = "iter_output"
) -> Iterator[Sample]:
    """Samples of every shard listed in the manifests of ``output`` (an output or one index: a
    directory, or an object-store URI, whose shards are always verified); ``setting`` names the
    argument in errors."""
    for shard in iter_listed_shards(output, require_complete, verify, setting=setting):
        for position in range(len(shard)):
            yield shard.sample(position)


def iter_listed_shards(
    output: str | Path, require_complete: bool = False, verify: bool = True, *, setting: str = "iter_output"
) -> Iterator[ShardRows]:
    """Every shard listed in the manifests of ``output``, in index and manifest order, its
    samples unread (``iter_output``'s arguments)."""
    reader = OutputReader(output, verify=verify, setting=setting)
    try:
        for index in reader.index_names():
            manifest = reader.manifest(index)
            if manifest is None:
                continue
            if require_complete and not manifest.complete:
                raise ValueError(f"{reader.location}/{index}: manifest is not complete")
            for entry in manifest.shards:
                yield reader.shard(index, entry.name, entry)
    finally:
        reader.close()
