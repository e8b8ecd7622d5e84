"""The bytes a run writes do not change unless the format does.

A run over a fixed, pre-tokenized data set with a deterministic backend (rows are a
function of token id, position and layer, so no model and no float kernel is involved)
must write exactly the files recorded here: every shard's data bytes, its header minus
the values that name the run or this machine, the manifest on the same terms, and
rejected.jsonl. The digests were recorded with the code before the storage/runner/
adapter restructuring (commit b1f73d5) and must survive any refactoring; a deliberate
format or fingerprint change updates them in the same commit, saying why. Updated once
since: the data fingerprint covers file contents and the identity records
data.reasoning_in_loss (shard data bytes unchanged; headers and manifest equal to the
recorded ones with the old fingerprint put back). Updated again for regeneration: the manifest
gained `generation` (run totals), `identity.generation` and each shard entry's `regenerated`,
all null for a run that keeps the data's turns (shard bytes unchanged; the manifest equal to
the recorded one with those three keys removed). Updated again for per-range checksums: each shard
entry gained `ranges` (shard bytes unchanged; the manifest equal to the recorded one without it;
its `layout` checksum covers the header's run id, so it is checked against the file and set aside).
Updated for the weights fingerprint: the identity gained `weights_fingerprint` (the model directory
now holds one fixed tensor; shard bytes unchanged; the manifest equal to the recorded one with that
key removed). Updated for the weights' name check: the model directory holds the architecture's
tensors (zeros) instead of one tensor no model has, which changed the weights fingerprint (shard
data bytes unchanged; headers and manifest new).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from transformers import LlamaConfig, LlamaForCausalLM

from job.backend_io import Backend, BackendInput, HiddenChunk
from job.checksum import crc64nvme_bytes, crc64nvme_file
from job.hidden_dtype import HiddenDtype, hidden_dtype
from job.pipeline.runner import run_job
from job.settings import load_settings

HIDDEN = 64
VOCAB = 1000
# A sample starting with this token gets a NaN row: rejected after extraction, its shard repacked.
POISON_TOKEN = VOCAB - 1
# Values that identify the run or this machine (paths), not the data: replaced before hashing.
RUN_SPECIFIC = {"run_id", "model_path", "model_name", "run_ids", "updated_at"}

EXPECTED = {
    "model": {
        "files": {
            "manifest.json": "b76723be3be11286",
            "rejected.jsonl": "f177ff369ede098e",
            "shard-00000.safetensors": {"header": "63edcdd142020a68", "data": "4f95e9afa0e82ff4"},
            "shard-00001.safetensors": {"header": "c2a443bfa5ca4d68", "data": "2c88e998bf422fb1"},
            "shard-00002.safetensors": {"header": "0b54807261f4882e", "data": "b380512b3bf60a07"},
            "shard-00003.safetensors": {"header": "35701b974deb0961", "data": "ce78ee0979547367"},
        }
    },
    "fp8_e4m3": {
        "files": {
            "manifest.json": "4d54fbc8e1225bb6",
            "rejected.jsonl": "f177ff369ede098e",
            "shard-00000.safetensors": {"header": "7692a78568c8858c", "data": "542adbf290ccc89c"},
            "shard-00001.safetensors": {"header": "b2797e280c33f0b6", "data": "54aa97a23462070e"},
        }
    },
}


class DeterministicBackend(Backend):
    """Rows from a formula over (token id, position, layer, channel), two chunks per sample."""

    name = "deterministic"

    def __init__(self, num_layers: int, dtype: HiddenDtype) -> None:
        self.num_layers = num_layers
        self.dtype = dtype

    @property
    def info(self) -> dict[str, Any]:
        return {"backend": "deterministic"}

    def extract(self, inputs: Iterator[BackendInput | None]) -> Iterator[HiddenChunk]:
        channel = torch.arange(HIDDEN, dtype=torch.float32)
        layer = torch.arange(self.num_layers, dtype=torch.float32)
        for item in inputs:
            if item is None:
                continue
            ids = torch.as_tensor(item.input_ids, dtype=torch.float32)
            pos = torch.arange(len(ids), dtype=torch.float32)
            states = (
                (ids[:, None, None] * 31 + pos[:, None, None] * 7 + layer[None, :, None] * 3 + channel) % 251
                - 125
            ) / 16
            if int(item.input_ids[0]) == POISON_TOKEN:
                states[len(ids) // 2, 0, 0] = float("nan")
            states = states.to(torch.bfloat16)
            half = len(ids) // 2
            for start, stop in ((0, half), (half, len(ids))):
                part = states[start:stop]
                rows, scales = self.dtype.encode(part)
                yield HiddenChunk(
                    item.sample_id,
                    start,
                    rows.contiguous(),
                    None if scales is None else scales.contiguous(),
                    last=stop == len(ids),
                    nonfinite=not bool(torch.isfinite(part).all()),
                    destination=item.destination,
                )


def _records() -> list[dict[str, Any]]:
    rng = np.random.default_rng(1234)
    records: list[dict[str, Any]] = []
    for i in range(24):
        n = int(rng.integers(8, 90))
        ids = [int(t) for t in rng.integers(0, VOCAB, size=n)]
        mask = [int(m) for m in (rng.random(n) < 0.6)]
        records.append({"id": f"rec-{i:02d}", "input_ids": ids, "loss_mask": mask})
    records[5]["input_ids"][3] = VOCAB + 5  # outside the vocabulary: rejected before extraction
    records[11]["loss_mask"] = [0] * len(records[11]["input_ids"])  # nothing to train on
    records[17]["input_ids"] = list(range(300))  # truncated to data.max_length
    records[17]["loss_mask"] = [1] * 300
    records[7]["input_ids"][0] = POISON_TOKEN
    return records


def _model_dir(root: Path) -> Path:
    model = root / "model"
    model.mkdir()
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": HIDDEN,
        "intermediate_size": 128,
        "num_hidden_layers": 8,
        "num_attention_heads": 2,
        "num_key_value_heads": 1,
        "vocab_size": VOCAB,
        "max_position_embeddings": 1024,
    }
    (model / "config.json").write_text(json.dumps(config, indent=1))
    # The backend needs no weights, the run's identity their fingerprint and the run's check their
    # names and shapes: the architecture's tensors, all zeros.
    with torch.device("meta"):
        names = LlamaForCausalLM(LlamaConfig(**config)).state_dict()
    save_file({name: torch.zeros(t.shape) for name, t in names.items()}, model / "model.safetensors")
    return model


def _digest(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()[:16]


def _normalize(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<run>" if k in RUN_SPECIFIC else _normalize(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_normalize(v) for v in value]
    return value


def _shard_digests(path: Path) -> dict[str, str]:
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + length])
    header["__metadata__"] = _normalize(header["__metadata__"])
    return {
        "header": _digest(json.dumps(header, sort_keys=True).encode()),
        "data": _digest(data[8 + length :]),
    }


def _layout_checksum(path: Path) -> str:
    """CRC64NVME of a shard's header followed by its sample_offsets tensor (RangeChecksums.layout)."""
    data = path.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    start, stop = json.loads(data[8 : 8 + length])["sample_offsets"]["data_offsets"]
    return crc64nvme_bytes(data[: 8 + length] + data[8 + length + start : 8 + length + stop])


def _output_digests(index_dir: Path) -> dict[str, Any]:
    manifest = json.loads((index_dir / "manifest.json").read_bytes())
    manifest["shards"].sort(key=lambda entry: entry["name"])  # commit order follows the writer threads
    for entry in manifest["shards"]:
        # The whole-file checksum covers the run id in the header: checked here, then set aside.
        assert crc64nvme_file(index_dir / entry["name"]) == entry["checksum"]["value"]
        entry["checksum"]["value"] = "<checked>"
        # So does the per-range checksum of the header (with the sample offsets): checked the same way.
        assert _layout_checksum(index_dir / entry["name"]) == entry["ranges"]["layout"]
        entry["ranges"]["layout"] = "<checked>"
    files: dict[str, Any] = {
        "manifest.json": _digest(json.dumps(_normalize(manifest), sort_keys=True).encode()),
        "rejected.jsonl": _digest((index_dir / "rejected.jsonl").read_bytes()),
    }
    for shard in manifest["shards"]:
        files[shard["name"]] = _shard_digests(index_dir / shard["name"])
    return {"files": files}


@pytest.mark.parametrize("storage", ["model", "fp8_e4m3"])
def test_a_run_writes_the_recorded_bytes(
    storage: str, tmp_path: Path, write_jsonl: Any, inprocess_env: None
) -> None:
    data = write_jsonl(tmp_path / "data.jsonl", _records())
    settings = load_settings(
        cli_args=[
            f"--model.path={_model_dir(tmp_path)}",
            f"--data.path={data}",
            "--data.max_length=256",
            "--data.tokenizer_workers=0",
            f"--output.uri={tmp_path / 'out'}",
            f"--output.hidden_dtype={storage}",
            "--output.shard_bytes=256KiB",
            "--log.format=json",
        ]
    )
    backend = DeterministicBackend(
        num_layers=4, dtype=hidden_dtype(storage if storage != "model" else "bfloat16")
    )
    totals = run_job(settings, backend=backend)
    assert totals["status"] == "complete"
    got = _output_digests(tmp_path / "out" / "index-00000")
    print(json.dumps(got, indent=1))
    assert got == EXPECTED[storage]
