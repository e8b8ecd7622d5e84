"""A real run read back: shards, manifest, ``inspect`` and ``plan`` against it.

What is written must be what the encoder produced (ids, masks) and what the HF
reference backend computes (hidden states), in several checksummed shards that the
manifest lists exactly.
"""

from __future__ import annotations

import itertools
import json
import re
import shutil
import struct
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors import safe_open

from job.backends import extract_all
from job.backends.hf import HFBackend
from job.checksum import crc64nvme_file
from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
from job.data.source import data_fingerprint, list_input_files
from job.hidden_dtype import hidden_dtype
from job.manifest import Manifest
from job.model import LAYER_CONVENTION, resolve_model
from job.settings import ModelSettings
from job.shards import iter_output, open_shard, read_manifest

LAYER_IDS = [0, 2, 5, 8]
MAX_LENGTH = 96
SHARD_BYTES = 256 * 1024
# float32, 4 layers x hidden 128 x 4 bytes, plus int32 id and uint8 mask per token
BYTES_PER_TOKEN = len(LAYER_IDS) * 128 * 4 + 4 + 1

TOPICS = ["the sea", "prime numbers", "Paris", "speculative decoding", "tea", "Rayleigh scattering"]


def records() -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for i, topic in enumerate(TOPICS * 2):
        out.append(
            {
                "id": f"conv-{i:02d}",
                "messages": [
                    {"role": "system", "content": "You answer in one or two sentences."},
                    {"role": "user", "content": f"Tell me about {topic}."},
                    {"role": "assistant", "content": f"Here is a short note about {topic}, number {i}."},
                ][(i % 2) :],  # every other one without the system prompt
            }
        )
    # Longer than data.max_length: truncated (too_long: truncate is the default).
    out.append(
        {
            "id": "long-1",
            "conversations": [
                {"from": "human", "value": "Count."},
                {"from": "gpt", "value": " ".join(str(n) for n in range(120))},
            ],
        }
    )
    out.append({"id": "tok-1", "input_ids": list(range(1, 60)), "loss_mask": [0] * 20 + [1] * 39})
    out.append({"id": "tok-ü🚀", "input_ids": [5, 6, 7]})  # non-ASCII id in the shard header
    return out


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
    write_jsonl: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("roundtrip")
    data = write_jsonl(root / "data" / "chat.jsonl", records())
    out = root / "out"
    args = (
        f"--data.path={data}",
        f"--output.uri={out}",
        f"--output.shard_bytes={SHARD_BYTES // 1024}KiB",
        f"--layers.ids={LAYER_IDS}".replace(" ", ""),
        f"--data.max_length={MAX_LENGTH}",
        *fast_args,
    )
    result = run_job("run", *args)
    assert result.rc == 0, result.describe()
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None
    return {"args": args, "data": data, "out": out, "index": out / "index-00000", "manifest": manifest}


@pytest.fixture(scope="module")
def expected(tiny_llama_dir: Path) -> dict[str, EncodedSample]:
    encoder = SampleEncoder(EncoderSpec(str(tiny_llama_dir), None, "auto", MAX_LENGTH, "truncate", 1024))
    encoded = {}
    for record in records():
        sample = encoder.encode(record["id"], record, None)
        assert isinstance(sample, EncodedSample)
        encoded[record["id"]] = sample
    return encoded


def test_manifest_lists_several_verified_shards(run: dict[str, Any]) -> None:
    manifest: Manifest = run["manifest"]
    assert manifest.complete
    assert len(manifest.shards) >= 3  # 256KiB shards of ~2KiB tokens: data spread over several
    on_disk = sorted(p.name for p in run["index"].glob("*.safetensors"))
    assert on_disk == sorted(s.name for s in manifest.shards)
    assert not list(run["index"].glob("*.partial"))
    for entry in manifest.shards:
        path = run["index"] / entry.name
        assert entry.bytes == path.stat().st_size
        assert entry.checksum.algorithm == "crc64nvme"
        assert entry.checksum.value == crc64nvme_file(path)
        shard = open_shard(path)
        assert entry.sample_ids == shard.sample_ids
        assert entry.num_samples == len(shard)
        assert entry.num_tokens == shard.num_tokens
        # Shards close once they reach the target size: all but the last are at least
        # that large in tokens, and no shard has more than one sample past it.
        assert entry.num_tokens * BYTES_PER_TOKEN < SHARD_BYTES + MAX_LENGTH * BYTES_PER_TOKEN


def test_every_sample_exactly_once_in_input_order(run: dict[str, Any]) -> None:
    manifest: Manifest = run["manifest"]
    listed = [sid for s in manifest.shards for sid in s.sample_ids]
    assert listed == [r["id"] for r in records()]
    assert [s.sample_id for s in iter_output(run["out"], require_complete=True)] == listed


def test_counts(run: dict[str, Any], expected: dict[str, EncodedSample]) -> None:
    counts = run["manifest"].counts
    assert counts.written == len(records())
    assert counts.rejected == 0
    truncated = [sid for sid, s in expected.items() if s.truncated]
    assert truncated == ["long-1"]
    assert counts.truncated == 1
    assert sum(s.num_truncated for s in run["manifest"].shards) == 1


def test_ids_and_masks_equal_the_encoder(run: dict[str, Any], expected: dict[str, EncodedSample]) -> None:
    for sample in iter_output(run["out"]):
        want = expected[sample.sample_id]
        assert sample.input_ids.dtype == torch.int32 and sample.loss_mask.dtype == torch.uint8
        np.testing.assert_array_equal(sample.input_ids.numpy(), want.input_ids)
        np.testing.assert_array_equal(sample.loss_mask.numpy(), want.loss_mask)
    long_sample = next(s for s in iter_output(run["out"]) if s.sample_id == "long-1")
    assert long_sample.input_ids.shape == (MAX_LENGTH,)


def test_hidden_states_equal_the_reference_backend(
    run: dict[str, Any], expected: dict[str, EncodedSample], job_torch_threads: int
) -> None:
    info = resolve_model(ModelSettings(path="builtin:tiny-llama", dtype="float32"))
    backend = HFBackend.load(info, LAYER_IDS, "cpu", hidden_dtype("float32"))
    samples = list(iter_output(run["out"]))
    reference = extract_all(backend, [expected[s.sample_id].input_ids for s in samples])
    for sample, want in zip(samples, reference, strict=True):
        assert sample.layer_ids == LAYER_IDS
        assert sample.hidden_states.dtype == torch.float32
        assert sample.hidden_states.shape == (sample.input_ids.shape[0], len(LAYER_IDS), 128)
        # Same weights, same float32 ops on the same CPU with the same thread count, one
        # sample per forward in both: the job's output is the reference's, to the bit.
        assert torch.equal(sample.hidden_states, want), (
            sample.sample_id,
            (sample.hidden_states - want).abs().max(),
        )


def test_sample_offsets(run: dict[str, Any], expected: dict[str, EncodedSample]) -> None:
    for entry in run["manifest"].shards:
        shard = open_shard(run["index"] / entry.name)
        offsets = shard.offsets.tolist()
        assert shard.offsets.dtype == torch.int64
        assert offsets[0] == 0 and offsets[-1] == shard.num_tokens
        assert len(offsets) == len(shard) + 1
        lengths = [b - a for a, b in itertools.pairwise(offsets)]
        assert lengths == [expected[sid].num_tokens for sid in shard.sample_ids]


def test_shard_metadata(run: dict[str, Any], tiny_llama_dir: Path) -> None:
    info = resolve_model(ModelSettings(path="builtin:tiny-llama", dtype="float32"))
    fingerprint = data_fingerprint(list_input_files(str(run["data"])))
    for entry in run["manifest"].shards:
        path = run["index"] / entry.name
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata()
            assert sorted(f.keys()) == ["hidden_states", "input_ids", "loss_mask", "sample_offsets"]
        assert meta["format_version"] == "1"
        assert meta["sample_ids"].startswith("[")
        assert meta["layer_ids"] == "[0, 2, 5, 8]"
        assert meta["layer_convention"] == LAYER_CONVENTION
        assert meta["final_layer_prenorm"] == "true"
        assert meta["model_path"] == str(tiny_llama_dir)
        assert meta["model_name"] == "builtin:tiny-llama"
        assert meta["model_config_hash"] == info.config_hash
        assert meta["dtype"] == "float32"
        assert meta["backend"] == "hf"
        assert meta["data_fingerprint"] == fingerprint
        assert meta["work_index"] == "0"
        assert meta["work_count"] == "1"
        assert meta["num_truncated"] == str(entry.num_truncated)
        assert meta["hidden_size"] == "128" and meta["num_model_layers"] == "8"
        assert meta["run_id"] == run["manifest"].run_ids[-1]


def test_manifest_fields(run: dict[str, Any]) -> None:
    manifest: Manifest = run["manifest"]
    assert manifest.identity.layer_ids == LAYER_IDS
    assert manifest.identity.max_length == MAX_LENGTH
    assert manifest.identity.work_index == 0 and manifest.identity.work_count == 1
    assert manifest.model_name == "builtin:tiny-llama"
    assert manifest.hidden_size == 128
    assert manifest.dtype == "float32"
    assert manifest.final_layer_prenorm is True
    assert manifest.layer_convention == LAYER_CONVENTION
    assert manifest.backend["backend"] == "hf"
    assert len(manifest.run_ids) == 1


def test_shard_bytes_follow_the_layout(run: dict[str, Any]) -> None:
    # file = 8-byte header length + JSON header (padded to 4 KiB) + hidden_states first
    # + offsets (int64, S+1) + ids and masks
    for entry in run["manifest"].shards:
        path = run["index"] / entry.name
        raw = path.read_bytes()
        (header_len,) = struct.unpack("<Q", raw[:8])
        assert (8 + header_len) % 4096 == 0
        assert json.loads(raw[8 : 8 + header_len])["hidden_states"]["data_offsets"][0] == 0
        assert (
            entry.bytes == 8 + header_len + 8 * (entry.num_samples + 1) + entry.num_tokens * BYTES_PER_TOKEN
        )


# --- inspect ----------------------------------------------------------------------------


def test_inspect_directory(run: dict[str, Any], run_job: Callable[..., Any]) -> None:
    manifest: Manifest = run["manifest"]
    result = run_job("inspect", str(run["out"]), "--verify")
    assert result.rc == 0, result.describe()
    head = result.stdout.splitlines()[0]
    assert head.startswith(f"index-00000: complete, {len(manifest.shards)} shards, {len(records())} samples")
    assert "(1 truncated), 0 rejected" in head
    for entry in manifest.shards:
        line = next(x for x in result.stdout.splitlines() if x.strip().startswith(entry.name))
        assert f"{entry.num_samples} samples, {entry.num_tokens} tokens" in line
        assert line.endswith("checksum ok")


def test_inspect_verify_finds_a_corrupted_shard(
    run: dict[str, Any], run_job: Callable[..., Any], tmp_path: Path
) -> None:
    copy = tmp_path / "out"
    shutil.copytree(run["out"], copy)
    victim = run["manifest"].shards[1].name
    path = copy / "index-00000" / victim
    data = bytearray(path.read_bytes())
    data[-100] ^= 0xFF  # one bit pattern in the hidden states
    path.write_bytes(bytes(data))
    result = run_job("inspect", str(copy), "--verify")
    assert result.rc == 1, result.describe()  # a damaged shard fails the check
    bad = [line for line in result.stdout.splitlines() if "DAMAGED" in line]
    assert len(bad) == 1 and victim in bad[0] and "differs from the manifest's" in bad[0]
    # One shard file, checked against the manifest beside it.
    result = run_job("inspect", str(path), "--verify")
    assert result.rc == 1 and "verify           DAMAGED" in result.stdout, result.describe()
    good = copy / "index-00000" / run["manifest"].shards[0].name
    result = run_job("inspect", str(good), "--verify")
    assert result.rc == 0 and "verify           checksum ok" in result.stdout, result.describe()
    # A listed shard that is gone: a line saying so, exit 1, no traceback.
    good.unlink()
    result = run_job("inspect", str(copy))
    assert result.rc == 1 and "listed in index-00000/manifest.json but missing" in result.stdout
    assert "Traceback" not in result.stderr


def test_inspect_shard_file(run: dict[str, Any], run_job: Callable[..., Any]) -> None:
    entry = run["manifest"].shards[0]
    result = run_job("inspect", str(run["index"] / entry.name))
    assert result.rc == 0, result.describe()
    text = result.stdout
    assert re.search(rf"^samples\s+{entry.num_samples}$", text, re.M)
    assert re.search(rf"^tokens\s+{entry.num_tokens}$", text, re.M)
    assert "[0, 2, 5, 8] (residual-stream-after-k-decoder-layers)" in text
    assert re.search(r"^final pre-norm\s+true$", text, re.M)
    assert f"  {entry.sample_ids[0]}: " in text


def test_inspect_bad_paths(run: dict[str, Any], run_job: Callable[..., Any], tmp_path: Path) -> None:
    result = run_job("inspect", str(tmp_path / "nothing-here"))
    assert result.rc == 2 and "does not exist" in result.stderr
    # A file that is not a shard (the manifest, say): one line, exit 2, no traceback.
    result = run_job("inspect", str(run["index"] / "manifest.json"))
    assert result.rc == 2, result.describe()
    assert "Traceback" not in result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "is not a shard file" in lines[0] and "manifest.json" in lines[0]


# --- plan -------------------------------------------------------------------------------


def test_plan_matches_the_run(run: dict[str, Any], run_job: Callable[..., Any]) -> None:
    result = run_job("plan", *run["args"])
    assert result.rc == 0, result.describe()
    rows = dict(re.split(r"\s{2,}", line.strip(), maxsplit=1) for line in result.stdout.splitlines())
    manifest: Manifest = run["manifest"]
    tokens = sum(s.num_tokens for s in manifest.shards)
    assert rows["samples"].startswith(f"{manifest.counts.written} (1 truncated")
    assert rows["rejected"] == "0"
    assert rows["tokens"] == str(tokens)
    assert rows["bytes per token"].startswith(f"{BYTES_PER_TOKEN} ")
    assert rows["shards"].startswith(f"{len(manifest.shards)} of about 256.0 KiB")
    assert rows["layer ids"] == str(LAYER_IDS)
    value, unit = rows["output bytes"].split()
    scale = {"B": 1, "KiB": 1024, "MiB": 1024**2}[unit]
    # printed with one decimal: within half a unit of the exact tensor bytes
    assert abs(float(value) * scale - tokens * BYTES_PER_TOKEN) <= 0.05 * scale
    # and the tensor bytes are the shard files minus their headers and offsets
    overhead = sum(s.bytes for s in manifest.shards) - tokens * BYTES_PER_TOKEN
    assert 0 < overhead < 16 * 1024 * len(manifest.shards)
    # a tiny model's rate cannot be scaled from an 8B measurement: no made-up figure
    assert rows["estimated time"].startswith("none: ") and "time a short run" in rows["estimated time"]


LLAMA_3_1_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
}


def test_plan_estimate_scales_the_measured_rate_by_parameters_per_token() -> None:
    from job.plan import LLAMA_3_1_8B, MEASURED_TOK_PER_S, TP2_SCALING_EFFICIENCY, _estimate, active_params

    # Published sizes less the input embedding and LM head (2 x vocab x hidden): 8.03B and 70.55B.
    assert active_params(LLAMA_3_1_8B) == 6_979_321_856
    assert active_params(LLAMA_3_1_70B) == 68_451_041_280
    assert f"at ~{MEASURED_TOK_PER_S:,} tok/s" in _estimate(MEASURED_TOK_PER_S * 3600, LLAMA_3_1_8B, 1)
    assert _estimate(MEASURED_TOK_PER_S * 3600, LLAMA_3_1_8B, 1).startswith("about 1 h 00 min")
    rate_70b_tp8 = MEASURED_TOK_PER_S * 6_979_321_856 / 68_451_041_280 * 8 * TP2_SCALING_EFFICIENCY
    assert f"at ~{rate_70b_tp8:,.0f} tok/s (H200-class GPUs, TP=8;" in _estimate(10**9, LLAMA_3_1_70B, 8)
