"""``python -m job export --format speculators [--hidden-states copy|reference] SRC DST``: our
shards as speculators' training data.

speculators (>= 0.5; read against 0.9.0, whose trainer loads data with
``speculators.train.data.ArrowDataset``) trains from one directory holding

* an HF ``datasets`` dataset (``save_to_disk``, torch format), one row per sample:
  ``input_ids`` and ``loss_mask`` (int64 [T]) and ``seq_len`` (0.9 packs batches by
  it). We add ``sample_id``, so every row traces back to our shards;
* with ``--hidden-states copy`` (the default), ``hidden_states/hs_{row}.safetensors``:
  ``hidden_states`` [T, L, H] and ``token_ids`` int64 [T]. The trainer takes
  ``hidden_states[:, :-1]`` as the auxiliary layers and ``hidden_states[:, -1]`` as the
  verifier's last hidden state, and drops a row whose ``token_ids`` differ from its
  ``input_ids``. With ``--hidden-states reference`` there are no such files: the
  ``eagle3-extract`` hidden-states backend (``job.speculators``) reads each row's states
  from our shards when the trainer asks for them;
* ``token_freq.pt``: {token id: count among assistant tokens}, from which
  ``--draft-vocab-size`` builds the draft vocabulary.

Beside them ``eagle3_extract.json`` records the layer ids in both numberings, that the
last layer is pre-norm, the model and the manifests the rows came from, with each
shard's row range: row r of a shard whose range is [a, b) is its sample r - a (the map
the reference backend reads by). It is written last: an export without it is unfinished.

Only shards that a manifest lists are read: for a full export through a ``ShardSource``
(job.storage), one sample's hidden states in memory at a time; for a reference export through
``job.shards.access.OutputReader``, token ids and loss masks alone (from S3: each shard's header
and tail, no rows), unless ``--verify`` reads every sample through its checksum. FP8 shards
are decoded to the model dtype, which is what speculators' default (file) hidden-states
backend reads.
"""

from __future__ import annotations

import dataclasses
import fcntl
import io
import json
import os
import shlex
import shutil
import sys
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import UTC, datetime
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pyarrow as pa
import torch
from safetensors.torch import save as safetensors_bytes
from tqdm import tqdm

from job.errors import ConfigError, DamagedShard, OutOfSpace, is_out_of_space
from job.hidden_dtype import hidden_dtype
from job.layout import MANIFEST, SPECULATORS_BACKEND, SPECULATORS_EXPORT_RECORD, index_dir_name
from job.manifest import Manifest, ShardEntry
from job.model import LAYER_CONVENTION, LAYER_CONVENTION_TEXT
from job.shards import Shard
from job.shards.access import OutputReader, ShardRows
from job.shards.format import read_metadata
from job.storage import open_shard_source, uri_scheme
from job.storage.base import ShardSource

FORMATS = ("speculators",)
# copy: every row's hidden states as a file of its own (speculators' `file` backend reads them);
# reference: none, the `eagle3-extract` backend reads them from the shards.
HIDDEN_STATES_MODES = ("copy", "reference")
BACKEND_NAME = SPECULATORS_BACKEND  # registered by job.speculators
METADATA = SPECULATORS_EXPORT_RECORD
HIDDEN_STATES_DIR = "hidden_states"
TOKEN_FREQ = "token_freq.pt"
# In DST from its claim until METADATA is written: with no METADATA beside it, an unfinished export
# (one killed before it could remove its files), which the next export into DST replaces.
UNFINISHED = "eagle3_extract.unfinished"
SPECULATORS_VERIFIED = "0.9.0"  # the release the tests load exports with

_ROWS = pa.schema(
    [
        ("input_ids", pa.list_(pa.int64())),
        ("loss_mask", pa.list_(pa.int64())),
        ("seq_len", pa.int64()),
        ("sample_id", pa.string()),
    ]
)
_ROWS_PER_BATCH = 1024  # Arrow record batches of this many rows (ids and masks only: small)


@dataclass(frozen=True)
class LayerOrder:
    """Which stored layers go where: speculators wants the verifier's layer (id N) last."""

    stored: list[int]  # layer ids as the shards hold them (our numbering)
    num_layers: int  # N, the model's decoder layers
    order: list[int]  # positions along the stored L axis, in export order

    @property
    def exported(self) -> list[int]:
        return [self.stored[i] for i in self.order]

    @property
    def aux(self) -> list[int]:
        return self.exported[:-1]

    @property
    def reordered(self) -> bool:
        return self.order != list(range(len(self.stored)))

    def reorder(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """A sample's [T, L, H] states as stored, in export order (layer N last), contiguous."""
        if self.reordered:
            return hidden_states.index_select(1, torch.tensor(self.order))
        return hidden_states.contiguous()


def order_layers(layer_ids: list[int], num_layers: int) -> LayerOrder:
    """Move layer N to the end (auxiliary layers keep their order), or refuse without it.

    Reordering is safe because the draft's fc layer sees the auxiliary layers in the order
    of its target_layer_ids, which the metadata states. Without N there is nothing to
    build the training targets from: the trainer would silently take an auxiliary layer
    as the verifier's output.
    """
    if num_layers not in layer_ids:
        raise ConfigError(
            f"export: the shards hold layers {layer_ids} but not {num_layers}, the last layer's "
            "output, which speculators uses as the verifier's last hidden state (its training "
            f"targets); re-extract with layers.ids including {num_layers}, e.g. the default"
        )
    if len(layer_ids) < 2:
        raise ConfigError(
            f"export: the shards hold only layer {num_layers}; speculators needs auxiliary "
            "layers besides it (EAGLE-3's default: layers.ids omitted)"
        )
    last = layer_ids.index(num_layers)
    order = [i for i in range(len(layer_ids)) if i != last] + [last]
    return LayerOrder(list(layer_ids), num_layers, order)


@dataclass(frozen=True)
class ExportSummary:
    dest: Path
    rows: int
    tokens: int
    assistant_tokens: int
    rows_without_assistant_tokens: int
    layers: LayerOrder
    hidden_dtype: str
    model_path: str
    hidden_states: str  # one of HIDDEN_STATES_MODES
    replaced_unfinished: bool = False  # DST held an unfinished export, whose files were removed first

    def train_command(self) -> list[str]:
        """The command that trains on this export, as speculators' parser takes it: the
        verifier, the data and the auxiliary layer ids (anything else keeps speculators' defaults)."""
        args = [
            "train",
            "--verifier-name-or-path",
            self.model_path,
            "--data-path",
            str(self.dest),
            "--target-layer-ids",
            *map(str, self.layers.aux),
        ]
        if self.hidden_states == "reference":
            return ["python", "-m", "job.speculators", *args, "--hidden-states-backend", BACKEND_NAME]
        return ["speculators", *args]

    def describe(self) -> str:
        layers = self.layers
        note = f" (reordered from stored {layers.stored})" if layers.reordered else ""
        where = "in the shards (read by reference)" if self.hidden_states == "reference" else "copied"
        return "\n".join(
            [
                f"exported         {self.rows} samples, {self.tokens} tokens "
                f"({self.assistant_tokens} assistant) to {self.dest}",
                f"hidden states    {where}: layers {layers.exported}{note}, {self.hidden_dtype}, "
                f"last = verifier (layer {layers.num_layers}, before the final norm)",
                f"train with       {shlex.join(self.train_command())}",
                *(
                    [f"note             {self.dest} held an unfinished export ({UNFINISHED}): replaced"]
                    if self.replaced_unfinished
                    else []
                ),
                *(
                    [f"note             {self.rows_without_assistant_tokens} rows have no assistant tokens"]
                    if self.rows_without_assistant_tokens
                    else []
                ),
            ]
        )


def export(
    fmt: str,
    src: str,
    dest: str,
    allow_incomplete: bool = False,
    verify: bool = False,
    hidden_states: str = "copy",
) -> ExportSummary:
    if fmt not in FORMATS:
        raise ConfigError(f"export --format {fmt!r}: unknown; choose one of {', '.join(FORMATS)}")
    if hidden_states not in HIDDEN_STATES_MODES:
        raise ConfigError(
            f"export --hidden-states {hidden_states!r}: unknown; choose {' or '.join(HIDDEN_STATES_MODES)}"
        )
    source = open_shard_source(src, "export SRC", verify)
    if hidden_states == "copy":
        return export_speculators(source, Path(dest), allow_incomplete)
    reader = OutputReader(src, verify=True, setting="export SRC")
    try:
        return export_speculators(source, Path(dest), allow_incomplete, reader, verify)
    finally:
        reader.close()


def export_speculators(
    source: ShardSource,
    dest: Path,
    allow_incomplete: bool = False,
    reader: OutputReader | None = None,
    verify: bool = False,
) -> ExportSummary:
    """Write the export: with ``reader``, a reference export, whose samples' token ids and loss masks
    come through ``reader`` (rows unread unless ``verify``), else every sample copied whole.

    A failure leaves DST as it was (an export's files removed), so the same command can run again:
    a full disk is an OutOfSpace error saying how far the export got; a shard that is missing or
    damaged in SRC, a DamagedShard with exit 2 (an export again cannot mend it) and the remedy."""
    datasets = _import_datasets()
    indexes = _usable_indexes(source, allow_incomplete)
    entries = [(index.name, entry) for index in indexes for entry in index.manifest.shards]
    try:
        for index_name, entry in entries:  # before anything is written: a stat or a listing each
            source.check(index_name, entry, checksum=False)
        first_shard = _shard_metadata(source, *entries[0])
    except DamagedShard as exc:
        raise _unusable_source(exc) from None
    layers = order_layers(indexes[0].manifest.identity.layer_ids, int(first_shard["num_model_layers"]))
    progress = _Progress(sum(e.num_samples for _, e in entries))
    with _claimed(dest) as replaced_unfinished:
        try:
            summary = _write(
                datasets, source, dest, indexes, entries, layers, first_shard, reader, verify, progress
            )
        except DamagedShard as exc:
            raise _unusable_source(exc) from None
        except OSError as exc:
            if not is_out_of_space(exc):
                raise
            raise OutOfSpace(
                f"export DST {dest}: out of space ({os.strerror(exc.errno)}) after {progress.done} of "
                f"{progress.total} samples; the unfinished export was removed: free space there and run the "
                "same command again"
            ) from None
        finally:
            progress.close()
    return dataclasses.replace(summary, replaced_unfinished=replaced_unfinished)


def _write(
    datasets: Any,
    source: ShardSource,
    dest: Path,
    indexes: list[_Index],
    entries: list[tuple[str, ShardEntry]],
    layers: LayerOrder,
    first_shard: dict[str, str],
    reader: OutputReader | None,
    verify: bool,
    progress: _Progress,
) -> ExportSummary:
    """The export's files in claimed, empty ``dest``, METADATA last. Files are written from bytes
    in memory (one sample's at most), so that a full disk is an OSError with its errno."""
    reference = indexes[0].manifest
    hidden_dir = dest / HIDDEN_STATES_DIR
    if reader is None:
        hidden_dir.mkdir()
    staging = dest / ".staging"  # not dest itself: datasets refuses to save a dataset over its own files
    staging.mkdir()
    rows_file = staging / "rows.arrow"
    token_freq: Counter[int] = Counter()
    row = tokens = assistant = unsupervised = 0
    row_ranges: dict[tuple[str, str], list[int]] = {}
    with pa.OSFile(str(rows_file), "wb") as sink, pa.ipc.new_stream(sink, _ROWS) as writer:
        batch = _RowBatch()
        for index_name, entry in entries:
            first_row = row
            if reader is None:
                samples = _copied(source, index_name, entry, layers)
            else:
                samples = _referenced(reader, index_name, entry, layers, verify)
            for sample_id, input_ids, loss_mask, states in samples:
                ids, mask = input_ids.long(), loss_mask.long()
                if states is not None:
                    hs_file = hidden_dir / f"hs_{row}.safetensors"
                    hs_file.write_bytes(safetensors_bytes({"hidden_states": states, "token_ids": ids}))
                targets = ids[mask.bool()]
                token_freq.update(targets.tolist())
                batch.add(ids, mask, sample_id)
                if len(batch) == _ROWS_PER_BATCH:
                    writer.write_batch(batch.take())
                row += 1
                tokens += len(ids)
                assistant += len(targets)
                unsupervised += not len(targets)
                progress.advance()
            row_ranges[(index_name, entry.name)] = [first_row, row]
        if len(batch):
            writer.write_batch(batch.take())

    datasets.disable_progress_bars()  # a CLI command: one summary, not a bar per internal step
    dataset = datasets.Dataset.from_file(str(rows_file)).with_format("torch")
    dataset.save_to_disk(str(dest))
    del dataset
    shutil.rmtree(staging)
    frequencies = io.BytesIO()
    torch.save(dict(token_freq), frequencies)
    (dest / TOKEN_FREQ).write_bytes(frequencies.getbuffer())

    mode = "copy" if reader is None else "reference"
    summary = ExportSummary(
        dest,
        row,
        tokens,
        assistant,
        unsupervised,
        layers,
        first_shard["model_dtype"],
        reference.model_path,
        mode,
    )
    _write_metadata(summary, reference, indexes, row_ranges, _absolute(source.location))
    return summary


class _Progress:
    """How many samples are exported, shown as a bar where stderr is a terminal."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.done = 0
        self._bar = tqdm(total=total, unit="sample", disable=not sys.stderr.isatty())

    def advance(self) -> None:
        self.done += 1
        self._bar.update()

    def close(self) -> None:
        self._bar.close()


_Exported = tuple[str, torch.Tensor, torch.Tensor, torch.Tensor | None]  # id, ids, mask, states to copy


def _copied(source: ShardSource, index: str, entry: ShardEntry, layers: LayerOrder) -> Iterator[_Exported]:
    """A shard's samples with their hidden states in export order (a remote shard: streamed to a
    temporary file through the manifest's CRC64NVME first; a local one: checked where the source
    verifies)."""
    with source.fetch(index, entry) as path:
        shard = Shard(path)
        _check_shard(shard, entry, layers, index)
        for sample in shard:
            yield sample.sample_id, sample.input_ids, sample.loss_mask, layers.reorder(sample.hidden_states)


def _referenced(
    reader: OutputReader, index: str, entry: ShardEntry, layers: LayerOrder, verify: bool
) -> Iterator[_Exported]:
    """A shard's samples without hidden states. The shard's header and sample offsets are checked
    against the manifest; the token ids and loss masks are read alone (a remote shard: from its tail,
    one ranged GET) unless ``verify``, which reads each whole sample through its checksum. Training
    reads every sample through that checksum anyway, and speculators compares its token ids with
    the row's."""
    shard = reader.shard(index, entry.name, entry)
    _check_shard(shard, entry, layers, index)
    for position, sample_id in enumerate(shard.sample_ids):
        if verify:
            sample = shard.sample(position)
            yield sample_id, sample.input_ids, sample.loss_mask, None
        else:
            yield sample_id, *shard.token_ids(position), None


class _RowBatch:
    """Input ids and masks of up to _ROWS_PER_BATCH samples, waiting to become one Arrow record batch."""

    def __init__(self) -> None:
        self._ids: list[list[int]] = []
        self._masks: list[list[int]] = []
        self._sample_ids: list[str] = []

    def __len__(self) -> int:
        return len(self._ids)

    def add(self, ids: torch.Tensor, mask: torch.Tensor, sample_id: str) -> None:
        self._ids.append(ids.tolist())
        self._masks.append(mask.tolist())
        self._sample_ids.append(sample_id)

    def take(self) -> pa.RecordBatch:
        batch = pa.record_batch(
            [
                pa.array(self._ids, pa.list_(pa.int64())),
                pa.array(self._masks, pa.list_(pa.int64())),
                pa.array([len(i) for i in self._ids], pa.int64()),
                pa.array(self._sample_ids, pa.string()),
            ],
            schema=_ROWS,
        )
        self._ids, self._masks, self._sample_ids = [], [], []
        return batch


def _shard_metadata(source: ShardSource, index: str, entry: ShardEntry) -> dict[str, str]:
    """A shard's metadata from its header alone (a remote source reads just that)."""
    where = f"{source.location}/{index}/{entry.name}"
    with source.open_stream(index, entry) as stream:
        try:
            return read_metadata(stream, where)
        except ValueError as exc:
            raise DamagedShard(str(exc)) from None


def _import_datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise ConfigError(
            "export --format speculators writes an HF `datasets` dataset and needs that package: "
            "pip install 'eagle3-extract[export]'"
        ) from None
    return datasets


@dataclass(frozen=True)
class _Index:
    name: str
    manifest: Manifest
    manifest_sha256: str


# Manifest fields every exported index must share: one dataset, one model, one layer layout.
_SAME_IDENTITY = ("model_config_hash", "layer_ids", "tokenizer_fingerprint", "data_fingerprint", "work_count")
_SAME_MANIFEST = ("hidden_size", "dtype", "layer_convention")


def _usable_indexes(source: ShardSource, allow_incomplete: bool) -> list[_Index]:
    """The indexes to export, after checking they are complete (or allowed not to be) and alike."""
    found = source.indexes()
    indexes = [_Index(i.name, i.manifest, i.manifest_sha256 or "") for i in found if i.manifest is not None]
    if not any(i.manifest.shards for i in indexes):
        raise ConfigError(f"export SRC {source.location}: no index-* directory has committed shards")
    reference = indexes[0]
    problems = [f"{i.name} has no {MANIFEST} (nothing committed)" for i in found if i.manifest is None]
    problems += [
        f"{i.name} is incomplete ({i.manifest.counts.written} samples so far)"
        for i in indexes
        if not i.manifest.complete
    ]
    if not source.single_index:
        count = reference.manifest.identity.work_count
        present = {i.name for i in found}
        missing = [name for k in range(count) if (name := index_dir_name(k)) not in present]
        if missing:
            problems.append(f"{', '.join(missing)} missing (work.count was {count})")
    if problems and not allow_incomplete:
        raise ConfigError(
            f"export SRC {source.location}: {'; '.join(problems)}. Finish those indexes (re-run them), "
            "or pass --allow-incomplete to export what is committed"
        )
    for index in indexes:
        ours, theirs = reference.manifest.identity.model_dump(), index.manifest.identity.model_dump()
        differ = [k for k in _SAME_IDENTITY if ours[k] != theirs[k]]
        differ += [k for k in _SAME_MANIFEST if getattr(reference.manifest, k) != getattr(index.manifest, k)]
        if differ:
            raise ConfigError(
                f"export SRC {source.location}: {index.name} differs from {reference.name} in "
                f"{', '.join(differ)}; one export takes the indexes of one run (export the others separately)"
            )
        if not index.manifest.final_layer_prenorm:
            raise ConfigError(
                f"export SRC {source.location}: {index.name} stores its last layer after the final norm; "
                "speculators applies the verifier's norm itself (speculators #313): it would be normed twice"
            )
    return indexes


def _check_shard(shard: Shard | ShardRows, entry: ShardEntry, layers: LayerOrder, index: str) -> None:
    where = f"{index}/{entry.name}"
    if shard.layer_ids != layers.stored or int(shard.metadata["num_model_layers"]) != layers.num_layers:
        raise DamagedShard(
            f"{where}: layers {shard.layer_ids} of {shard.metadata['num_model_layers']} differ from the "
            f"manifest's {layers.stored} of {layers.num_layers}"
        )
    if shard.sample_ids != entry.sample_ids:
        raise DamagedShard(f"{where}: its samples differ from those its manifest lists; the index is damaged")


_REEXTRACT = (
    "restore it, or rerun that index of the job with output.verify_on_resume=checksum and "
    "output.on_damaged_shard=reextract (it extracts the shard's samples again)"
)


def _unusable_source(exc: DamagedShard) -> ConfigError:
    """A shard of SRC missing or damaged: exit 2 (exporting again cannot mend it), with the remedy."""
    remedy = "" if "on_damaged_shard=reextract" in str(exc) else f": {_REEXTRACT}"
    return ConfigError(f"export SRC: {exc}{remedy}; then export again")


@contextmanager
def _claimed(dest: Path) -> Iterator[bool]:
    """DST for one export, held (a lock on its UNFINISHED marker) until the context ends: a new or
    empty directory, or an unfinished export's, whose files are removed first (yields whether there
    were any). If the context ends in an exception, the export's files are removed again (DST itself
    too, where the export created it)."""
    created = not dest.exists()
    marker = dest / UNFINISHED
    unfinished = not created and marker.is_file() and not (dest / METADATA).exists()
    if not (created or unfinished) and (not dest.is_dir() or any(dest.iterdir())):
        raise ConfigError(
            f"export DST {dest}: exists and is not an empty directory; an export never overwrites"
        )
    try:
        dest.mkdir(parents=True, exist_ok=True)
        lock = marker.open("a")
    except OSError as exc:
        raise ConfigError(f"export DST {dest}: cannot create it: {exc.strerror}") from None
    try:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise ConfigError(f"export DST {dest}: another export is writing it") from None
        if unfinished:
            _remove_contents(dest, keep=UNFINISHED)
        lock.truncate(0)  # append mode: what follows is the whole file
        lock.write(
            "an export in progress, or one that did not finish: python -m job export into this "
            "directory replaces it\n"
        )
        lock.flush()
        try:
            yield unfinished
        except BaseException:
            if created:
                shutil.rmtree(dest, ignore_errors=True)
            else:
                _remove_contents(dest)
            raise
        marker.unlink()
    finally:
        lock.close()


def _remove_contents(directory: Path, keep: str | None = None) -> None:
    for path in directory.iterdir():
        if path.name == keep:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path, ignore_errors=True)
        else:
            path.unlink(missing_ok=True)


def _absolute(location: str) -> str:
    """A local source as an absolute path: a reference export is read from wherever training runs."""
    return location if uri_scheme(location) else str(Path(location).resolve())


def _legacy_ids(ids: list[int]) -> list[int | None]:
    return [k - 1 if k > 0 else None for k in ids]


def _write_metadata(
    summary: ExportSummary,
    manifest: Manifest,
    indexes: list[_Index],
    row_ranges: dict[tuple[str, str], list[int]],
    location: str,
) -> None:
    layers = summary.layers
    try:
        tool_version = version("eagle3-extract")
    except PackageNotFoundError:
        tool_version = "unknown"
    reference = summary.hidden_states == "reference"
    files = (
        f"hidden states read from the shards of source.location by the speculators backend {BACKEND_NAME}"
        if reference
        else f"{HIDDEN_STATES_DIR}/hs_{{row}}.safetensors (hidden_states [T, L, H], token_ids [T])"
    )
    metadata = {
        "format": "speculators",
        "layout": "HF datasets save_to_disk (input_ids, loss_mask, seq_len, sample_id) + "
        f"{files} + {TOKEN_FREQ}",
        "speculators_min_version": "0.5.0",
        "speculators_verified_version": SPECULATORS_VERIFIED,
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        "producer": f"eagle3-extract {tool_version}",
        "rows": summary.rows,
        "tokens": summary.tokens,
        "assistant_tokens": summary.assistant_tokens,
        "rows_without_assistant_tokens": summary.rows_without_assistant_tokens,
        "model": {
            "name": manifest.model_name,
            "path": manifest.model_path,
            "config_hash": manifest.identity.model_config_hash,
            "num_layers": layers.num_layers,
            "hidden_size": manifest.hidden_size,
        },
        "hidden_states": {
            "mode": summary.hidden_states,
            "dtype": summary.hidden_dtype,
            "source_storage": manifest.identity.storage,
            "note": "FP8 shards are decoded to the model dtype (value = fp8 * per-token-per-layer scale)"
            if hidden_dtype(manifest.identity.storage).scaled
            else "unchanged from the shards",
        },
        "layers": {
            "exported": layers.exported,
            "stored": layers.stored,
            "order": layers.order,
            "reordered": layers.reordered,
            "ours": {"convention": LAYER_CONVENTION, "meaning": LAYER_CONVENTION_TEXT},
            "speculators": {
                "layer_ids": layers.exported,
                "target_layer_ids": layers.aux,
                "verifier_layer_id": layers.num_layers,
                "train_args": ["--target-layer-ids", *map(str, layers.aux)],
                "meaning": "speculators >= 0.5 numbers layers as vLLM >= 0.18 does "
                "(eagle_aux_hidden_state_layer_ids; launch_vllm --target-layer-ids plus the last layer N): "
                "id k = input of decoder layer k = output of layer k-1, N = output of the last layer before "
                "the final norm. That is our numbering, so the ids carry over unchanged; hidden_states[:, i] "
                "is layer_ids[i] and the last one is the verifier's.",
            },
            "legacy_generator_layer_ids": _legacy_ids(layers.exported),
            "legacy_generator_meaning": "speculators 0.3/0.4 (VllmHiddenStatesGenerator, data_{idx}.pt) "
            "captured the output of 0-based decoder layer idx: our id k = legacy k-1 (its default "
            "[2, N//2, N-3, N-1] is our [3, N//2+1, N-2, N]); our id 0, the embeddings, has no legacy id",
        },
        "final_layer_prenorm": True,
        "final_layer_note": f"layer {layers.num_layers} is the residual stream before the model's "
        "final norm; the trainer applies the verifier's norm before lm_head (speculators >= 0.4 does, #313)",
        "source": {
            "location": location,
            "indexes": [
                {
                    "name": index.name,
                    "complete": index.manifest.complete,
                    "manifest_sha256": index.manifest_sha256,
                    "run_ids": index.manifest.run_ids,
                    "written": index.manifest.counts.written,
                    "shards": [
                        {
                            "name": entry.name,
                            "bytes": entry.bytes,
                            "checksum": entry.checksum.model_dump(),
                            "rows": row_ranges[(index.name, entry.name)],
                        }
                        for entry in index.manifest.shards
                    ],
                }
                for index in indexes
            ],
        },
    }
    partial = summary.dest / (METADATA + ".partial")
    partial.write_text(json.dumps(metadata, indent=1) + "\n")
    os.replace(partial, summary.dest / METADATA)
