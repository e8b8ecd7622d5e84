"""``index-*/manifest.json``: the commit record of one work index.

Only shards listed here exist as far as any reader or resumed run is
concerned. It is rewritten (atomically, compare-and-swap on S3) after every
shard commit and once more at the end with ``complete: true``.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from job.errors import ConfigError

MANIFEST_VERSION = 1


class Checksum(BaseModel):
    algorithm: str
    value: str


class StoredFile(BaseModel):
    """A committed file: its name in the index directory, size and checksum."""

    model_config = ConfigDict(extra="allow")
    described_as: ClassVar[str] = "file"  # in messages about it

    name: str
    bytes: int
    checksum: Checksum


class GenerationCounts(BaseModel):
    """What regeneration (generate.mode) produced for a set of samples."""

    conversations: int = 0
    turns: int = 0
    generated_tokens: int = 0
    cut_by_length: int = 0  # turns that ended at generate.max_new_tokens or data.max_length
    turns_not_generated: int = 0  # after a turn that filled data.max_length (data.too_long: truncate)

    def add(self, other: GenerationCounts, sign: int = 1) -> None:
        for field in GenerationCounts.model_fields:
            setattr(self, field, getattr(self, field) + sign * getattr(other, field))


class Regenerated(StoredFile):
    """A shard's sidecar (layout.regenerated_name): the regenerated conversations of its samples."""

    described_as: ClassVar[str] = "sidecar"

    counts: GenerationCounts


class RangeChecksums(BaseModel):
    """Checksums of the parts of a shard a reader fetches on its own (ranged GETs, one sample of a
    memory map), so that every byte it hands out is checked without reading the whole shard.

    ``layout``: the safetensors header (its 8-byte length prefix included) followed by the
    ``sample_offsets`` tensor. ``samples[i]``: sample i's bytes in file order, its
    ``hidden_states`` rows, its ``hidden_states_scale`` rows (FP8 only), its ``input_ids``, its
    ``loss_mask``. Combined by the writer from the checksums of its own writes (no read-back).
    Absent from manifests written before it existed: such shards are verified whole."""

    algorithm: str
    layout: str
    samples: list[str]


class ShardEntry(StoredFile):
    described_as: ClassVar[str] = "shard"

    num_samples: int
    num_tokens: int
    sample_ids: list[str]
    num_truncated: int = 0
    regenerated: Regenerated | None = None  # generate.mode other than keep
    ranges: RangeChecksums | None = None  # None in manifests written before per-range checksums


class Counts(BaseModel):
    written: int = 0
    rejected: int = 0
    truncated: int = 0


# The setting (or input) each identity field comes from, for messages about a change.
IDENTITY_SETTINGS = {
    "model_config_hash": "model.path (the model's config.json)",
    "weights_fingerprint": "model.path (the model's weight files)",
    "layer_ids": "layers.ids",
    "storage": "the stored dtype (model.dtype, output.hidden_dtype)",
    "data_fingerprint": "data.path (the input files' names, sizes or contents)",
    "data_format": "data.format",
    "max_length": "data.max_length",
    "too_long": "data.too_long",
    "reasoning_in_loss": "data.reasoning_in_loss",
    "generation": "generate.*",
    "tokenizer_fingerprint": "the tokenizer (model.path) or data.chat_template",
    "work_index": "work.index",
    "work_count": "work.count",
}


class Identity(BaseModel):
    """What must match for a run to resume (append to) an existing index."""

    model_config = ConfigDict(extra="forbid")

    model_config_hash: str
    # job.weights: names, sizes and headers of the weight files. None in manifests written before
    # it existed: those resume without a weights check.
    weights_fingerprint: str | None = None
    layer_ids: list[int]
    storage: str  # the stored hidden dtype's name (format_version 1 calls it storage)
    data_fingerprint: str
    data_format: str
    max_length: int
    too_long: str
    reasoning_in_loss: bool = True  # absent in manifests written before the setting existed
    generation: dict[str, Any] | None = None  # generate.mode and its sampling; None: the data's turns
    tokenizer_fingerprint: str
    work_index: int
    work_count: int

    def changes(self, new: Identity) -> list[str]:
        """What differs from ``new``, each named by the setting behind it."""
        old_values, new_values = self.model_dump(), new.model_dump()
        if old_values["weights_fingerprint"] is None:  # recorded before weights were fingerprinted
            old_values["weights_fingerprint"] = new_values["weights_fingerprint"]
        return [
            f"{IDENTITY_SETTINGS[key]} ({key}: {old_values[key]!r} -> {value!r})"
            for key, value in new_values.items()
            if old_values[key] != value
        ]


class Manifest(BaseModel):
    model_config = ConfigDict(extra="allow")

    format_version: int = MANIFEST_VERSION
    complete: bool = False
    identity: Identity
    model_name: str
    model_path: str
    hidden_size: int
    dtype: str
    layer_convention: str
    final_layer_prenorm: bool
    backend: dict[str, Any]
    shards: list[ShardEntry] = Field(default_factory=list)
    counts: Counts = Field(default_factory=Counts)
    run_ids: list[str] = Field(default_factory=list)
    # generate.mode other than keep: what was generated, summed over the listed shards.
    generation: GenerationCounts | None = None
    updated_at: str = ""

    def done_sample_ids(self) -> set[str]:
        return {sid for shard in self.shards for sid in shard.sample_ids}

    def add_shard(self, entry: ShardEntry) -> None:
        self.shards.append(entry)
        self._count(entry, 1)

    def drop_shard(self, entry: ShardEntry) -> None:
        self.shards.remove(entry)
        self._count(entry, -1)

    def _count(self, entry: ShardEntry, sign: int) -> None:
        self.counts.written += sign * entry.num_samples
        self.counts.truncated += sign * entry.num_truncated
        if entry.regenerated is not None:
            if self.generation is None:
                self.generation = GenerationCounts()
            self.generation.add(entry.regenerated.counts, sign)

    def listed_names(self) -> set[str]:
        """Every file a listed shard consists of (the shard, and its sidecar)."""
        names = {s.name for s in self.shards}
        return names | {s.regenerated.name for s in self.shards if s.regenerated is not None}

    def to_bytes(self) -> bytes:
        self.updated_at = datetime.now(UTC).isoformat(timespec="seconds")
        return json.dumps(self.model_dump(mode="json"), indent=1).encode()

    @classmethod
    def from_bytes(cls, data: bytes, where: str) -> Manifest:
        try:
            return cls.model_validate_json(data)
        except ValueError as exc:
            raise ConfigError(
                f"{where}: manifest.json is not a manifest this job understands ({exc}); use a new output.uri"
            ) from None

    def check_resumable(self, identity: Identity, where: str) -> None:
        changed = "; ".join(self.identity.changes(identity))
        if not changed:
            return
        raise ConfigError(
            f"{where} was written with different settings or data: {changed}. "
            "Resume needs the same ones, or use a new output.uri"
        )
