"""The ``eagle3-extract`` hidden-states backend: speculators reads each row's hidden states from
our shards (the seam of hs-connectors 0.9, ``hs_connectors.transfer``).

speculators' ``ArrowDataset`` asks its ``HiddenStatesTransfer`` for row ``file_idx`` with
``get_cached(file_idx)`` and expects ``{"hidden_states": [T, L, H], "token_ids": [T]}``, the
auxiliary layers first and the verifier's layer (N) last; it drops (and counts) a row whose
``token_ids`` differ from the row's ``input_ids``. A reference export
(``python -m job export --format speculators --hidden-states reference``) records where
each row lives: ``eagle3_extract.json`` lists every shard it read with its checksum and row
range [a, b), row r being the shard's sample r - a. ``ReferenceTransfer`` reads that sample
from the shard and picks the stored layers in export order.

Where the shards are: the export's source (``source.location``: a local directory or
``s3://bucket/prefix``), or ``--eagle3-extract-source`` (the same output moved or mirrored).
They are read through ``job.shards.access.OutputReader``: local shards by memory map, S3 ones by
ranged GETs of a shard's header and tail once, then of one sample's rows; every sample's bytes
are checked against the manifest's per-range CRC64NVME before a tensor is made of them
(``--eagle3-extract-verify off`` skips that). Before the first row, each process checks that
every index's manifest still lists the exported shards with the same checksums (an output
rewritten by another run is an error naming the shard, never other samples under the same
row numbers).

A transfer is pickled into speculators' DataLoader workers (spawned); the reader is opened
lazily in the process that reads.
"""

from __future__ import annotations

import bisect
import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from hs_connectors.transfer import HiddenStatesBackend, HiddenStatesTransfer

from job.errors import ConfigError, DamagedShard
from job.layout import SPECULATORS_BACKEND as BACKEND_NAME
from job.layout import SPECULATORS_EXPORT_RECORD as METADATA
from job.manifest import ShardEntry
from job.shards.access import OutputReader

if TYPE_CHECKING:
    import argparse

SOURCE_FLAG = "--eagle3-extract-source"
VERIFY_FLAG = "--eagle3-extract-verify"


@dataclass(frozen=True)
class ExportedShard:
    """One shard a reference export read: where it is, its checksum then, the rows [first, stop)."""

    index: str
    name: str
    checksum: str  # CRC64NVME, base64, as the manifest listed it at export time
    first: int
    stop: int


class RowMap:
    """Row number -> (shard, position), from a reference export's ``eagle3_extract.json``."""

    def __init__(self, shards: list[ExportedShard]) -> None:
        self.shards = sorted(shards, key=lambda s: s.first)
        self._firsts = [s.first for s in self.shards]
        self.rows = self.shards[-1].stop if self.shards else 0

    @classmethod
    def from_metadata(cls, metadata: dict[str, Any]) -> RowMap:
        return cls(
            [
                ExportedShard(
                    index["name"],
                    shard["name"],
                    shard["checksum"]["value"],
                    shard["rows"][0],
                    shard["rows"][1],
                )
                for index in metadata["source"]["indexes"]
                for shard in index["shards"]
            ]
        )

    def locate(self, row: int) -> tuple[ExportedShard, int]:
        at = bisect.bisect_right(self._firsts, row) - 1
        if row < 0 or at < 0 or row >= self.shards[at].stop:
            raise IndexError(f"row {row}: the export has rows 0..{self.rows - 1}")
        shard = self.shards[at]
        return shard, row - shard.first


class ReferenceTransfer(HiddenStatesTransfer):
    """Hidden states of a reference export's rows, read from the shards at ``source``, which
    ``setting`` names in errors (the flag, or the export's record that gave it)."""

    def __init__(
        self, source: str, rows: RowMap, layers: list[int], verify: bool = True, setting: str = SOURCE_FLAG
    ) -> None:
        self.source = source
        self.rows = rows
        self.layers = layers  # stored layer ids in export order: auxiliary first, N last
        self.verify = verify
        self.setting = setting
        self._shards: _ShardReader | None = None

    def __getstate__(self) -> dict[str, Any]:
        # Open files and mappings stay in the process that opened them; a worker opens its own.
        return {**self.__dict__, "_shards": None}

    def setup(self) -> None:
        self._reader()

    def _reader(self) -> _ShardReader:
        # speculators calls setup() only before generating on demand, never before get_cached
        if self._shards is None:
            shards = _ShardReader(self.source, self.verify, self.setting)
            shards.check_listed(self.rows)
            self._shards = shards
        return self._shards

    def get_cached(self, file_idx: int) -> dict[str, torch.Tensor]:
        shard, position = self.rows.locate(file_idx)
        input_ids, hidden_states = self._reader().read(shard, position, self.layers)
        return {"hidden_states": hidden_states, "token_ids": input_ids.long()}

    def get_generated(self, hs_transfer_params: dict[str, Any]) -> dict[str, torch.Tensor] | None:
        raise ConfigError(
            f"the {BACKEND_NAME} hidden-states backend reads what python -m job run wrote; it has nothing "
            "to do with hidden states speculators generates on demand (every exported row has its states)"
        )


class _ShardReader:
    """The exported shards, read through ``job.shards.access`` (local: memory maps; S3: ranged
    GETs), each sample checked against its manifest's per-range CRC64NVME before it is handed out."""

    def __init__(self, source: str, verify: bool, setting: str) -> None:
        self.reader = OutputReader(source, verify=verify, setting=setting)
        self._entries: dict[tuple[str, str], ShardEntry] = {}

    def check_listed(self, rows: RowMap) -> None:
        """Every exported shard still listed, with the checksum the export read it under."""
        listed: dict[tuple[str, str], ShardEntry] = {}
        for index in sorted({shard.index for shard in rows.shards}):
            manifest = self.reader.manifest(index)
            for entry in manifest.shards if manifest is not None else []:
                listed[(index, entry.name)] = entry
        for shard in rows.shards:
            entry = listed.get((shard.index, shard.name))
            if entry is None or entry.checksum.value != shard.checksum:
                now = "no longer listed" if entry is None else f"listed with checksum {entry.checksum.value}"
                raise DamagedShard(
                    f"{self.reader.where(shard.index, shard.name)}: exported with checksum {shard.checksum}, "
                    f"now {now} in {shard.index}'s manifest (the output was rewritten since the export, or "
                    f"{SOURCE_FLAG} names another output): export it again"
                )
            self._entries[(shard.index, shard.name)] = entry

    def read(
        self, shard: ExportedShard, position: int, layers: list[int]
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample ``position`` of ``shard``: its input ids [T] and hidden states [T, len(layers), H]."""
        entry = self._entries[(shard.index, shard.name)]
        sample = self.reader.shard(shard.index, shard.name, entry).sample(position, layers)
        return sample.input_ids, sample.hidden_states


def read_reference_export(data_path: str | Path) -> dict[str, Any]:
    """A reference export's ``eagle3_extract.json``, or a ConfigError saying what ``data_path`` is."""
    path = Path(data_path) / METADATA
    try:
        metadata: dict[str, Any] = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(
            f"--data-path {data_path}: no {METADATA}; the {BACKEND_NAME} backend reads an export made with "
            "python -m job export --format speculators --hidden-states reference (an unfinished export "
            "has none)"
        ) from None
    mode = metadata.get("hidden_states", {}).get("mode", "copy")
    if mode != "reference":
        raise ConfigError(
            f"--data-path {data_path}: an export with its hidden states copied ({mode}); train on it with "
            f"speculators' file backend (leave --hidden-states-backend at its default), not {BACKEND_NAME}"
        )
    return metadata


@HiddenStatesBackend.register(BACKEND_NAME)
class Eagle3ExtractBackend(HiddenStatesBackend):
    """``--hidden-states-backend eagle3-extract``: rows' hidden states from the job's shards."""

    @staticmethod
    def add_train_args(parser: argparse.ArgumentParser) -> None:
        parser.add_argument(
            SOURCE_FLAG,
            type=str,
            default=None,
            help=f"({BACKEND_NAME}) the output holding the shards (a directory or s3://bucket/prefix); "
            f"default: the export's SRC, as {METADATA} records it",
        )
        parser.add_argument(
            VERIFY_FLAG,
            type=str,
            choices=["on", "off"],
            default="on",
            help=f"({BACKEND_NAME}) on (default): check every sample's bytes against its manifest's "
            "CRC64NVME before handing it out",
        )

    @staticmethod
    def add_launch_args(parser: argparse.ArgumentParser) -> None:
        """Nothing: this backend reads what ``python -m job run`` wrote; it launches no vLLM."""

    @staticmethod
    def from_train_args(args: argparse.Namespace, data_path: str) -> ReferenceTransfer:
        metadata = read_reference_export(data_path)
        given = getattr(args, "eagle3_extract_source", None)
        rows = RowMap.from_metadata(metadata)
        if rows.rows != metadata["rows"]:
            raise ConfigError(
                f"--data-path {data_path}: {METADATA} maps {rows.rows} rows but lists {metadata['rows']}; "
                "the export is damaged: export again"
            )
        verify = getattr(args, "eagle3_extract_verify", "on") != "off"
        setting = SOURCE_FLAG if given else f"the shards' output ({data_path}/{METADATA}: source.location)"
        transfer = ReferenceTransfer(
            given or metadata["source"]["location"], rows, metadata["layers"]["exported"], verify, setting
        )
        try:  # here, before training starts: the output there, and its manifests as exported
            transfer.setup()
        except ConfigError as exc:
            if given:
                raise
            raise ConfigError(
                f"{exc}; if the output moved, pass {SOURCE_FLAG} with where it is now (a directory or "
                "s3://bucket/prefix) to read the shards there"
            ) from None
        return transfer

    @staticmethod
    def build_kv_transfer_config(args: argparse.Namespace) -> dict[str, Any]:
        raise ConfigError(
            f"the {BACKEND_NAME} hidden-states backend reads the output of python -m job run; it has no "
            "vLLM side to launch (generate the data with python -m job run)"
        )
