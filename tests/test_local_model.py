"""A local model directory (not a builtin name), including a broken one.

A copy of tiny-llama whose embedding row for one token is NaN: every sample that
contains the token gets non-finite hidden states and must be rejected, while the good
samples that shared its shard are repacked into a shard of their own, intact.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from job.backends import extract_all
from job.backends.hf import HFBackend
from job.checksum import crc64nvme_file
from job.hidden_dtype import hidden_dtype
from job.model import resolve_model
from job.pipeline.setup import tokenizer_fingerprint
from job.settings import ModelSettings
from job.shards import iter_output, open_shard, read_manifest

POISON = 7  # token id whose embedding is NaN


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


@pytest.fixture(scope="module")
def poisoned_model(tmp_path_factory: pytest.TempPathFactory, tiny_llama_dir: Path) -> Path:
    model = copy_model(tiny_llama_dir, tmp_path_factory.mktemp("models") / "poisoned")
    weights = load_file(model / "model.safetensors")
    weights["model.embed_tokens.weight"][POISON] = float("nan")
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    return model


def samples() -> list[dict[str, Any]]:
    rng = np.random.default_rng(0)
    out = []
    for i in range(12):
        ids = [int(t) for t in rng.integers(20, 1000, size=10 + i)]
        if i in (2, 3, 9):
            ids[len(ids) // 2] = POISON
        out.append({"id": f"t-{i:02d}", "input_ids": ids})
    return out


BAD = {"t-02", "t-03", "t-09"}


@pytest.fixture(scope="module")
def run(
    tmp_path_factory: pytest.TempPathFactory,
    poisoned_model: Path,
    write_jsonl: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("nonfinite")
    data = write_jsonl(root / "tok.jsonl", samples())
    out = root / "out"
    # ~4 samples per shard: shards mix good and poisoned samples
    result = run_job(
        "run",
        f"--model.path={poisoned_model}",
        f"--data.path={data}",
        f"--output.uri={out}",
        "--output.shard_bytes=100KiB",
        *fast_args,
    )
    assert result.rc == 0, result.describe()
    return {"result": result, "out": out, "index": out / "index-00000"}


def test_nonfinite_samples_are_rejected(run: dict[str, Any], read_jsonl: Callable) -> None:
    rejected = read_jsonl(run["index"] / "rejected.jsonl")
    assert {e["sample_id"] for e in rejected} == BAD
    assert all("non-finite" in e["reason"] for e in rejected)
    manifest = read_manifest(run["index"])
    assert manifest is not None and manifest.complete
    assert manifest.counts.written == len(samples()) - len(BAD)
    assert manifest.counts.rejected == len(BAD)


def test_good_samples_survive_the_repack(
    run: dict[str, Any], poisoned_model: Path, job_torch_threads: int
) -> None:
    manifest = read_manifest(run["index"])
    assert manifest is not None
    want_ids = [s["id"] for s in samples() if s["id"] not in BAD]
    assert [sid for s in manifest.shards for sid in s.sample_ids] == want_ids
    names = {p.name for p in run["index"].iterdir() if p.is_file()}
    assert names == {s.name for s in manifest.shards} | {"manifest.json", "rejected.jsonl", ".lock"}
    for entry in manifest.shards:
        path = run["index"] / entry.name
        assert crc64nvme_file(path) == entry.checksum.value and path.stat().st_size == entry.bytes
        shard = open_shard(path)
        assert shard.sample_ids == entry.sample_ids and shard.num_tokens == entry.num_tokens
    info = resolve_model(ModelSettings(path=str(poisoned_model), dtype="float32"))
    got = list(iter_output(run["out"]))
    by_id = {s["id"]: s for s in samples()}
    reference = extract_all(
        HFBackend.load(info, [2, 4, 5, 8], "cpu", hidden_dtype("float32")),
        [np.asarray(by_id[s.sample_id]["input_ids"], np.int32) for s in got],
    )
    for sample, want in zip(got, reference, strict=True):
        assert sample.input_ids.tolist() == by_id[sample.sample_id]["input_ids"]
        assert torch.isfinite(sample.hidden_states).all()
        assert torch.equal(sample.hidden_states, want)


def test_local_model_metadata(run: dict[str, Any], poisoned_model: Path) -> None:
    started = run["result"].event("run_started")
    assert started["model_path"] == str(poisoned_model)
    manifest = read_manifest(run["index"])
    assert manifest is not None
    assert manifest.model_name == str(poisoned_model)
    meta = open_shard(run["index"] / manifest.shards[0].name).metadata
    assert meta["model_path"] == meta["model_name"] == str(poisoned_model)


def test_tokenizer_fingerprint_covers_the_chat_template_file(tmp_path: Path, tiny_llama_dir: Path) -> None:
    # transformers keeps a model's chat template in chat_template.jinja: a changed
    # template changes the masks, so a resume across it must be refused.
    model = copy_model(tiny_llama_dir, tmp_path / "m")
    assert (model / "chat_template.jinja").is_file()
    info = resolve_model(ModelSettings(path=str(model)))
    before = tokenizer_fingerprint(info, None)
    assert tokenizer_fingerprint(info, None) == before
    template = model / "chat_template.jinja"
    template.write_text(template.read_text().replace("<|eot_id|>", "<|eot_id|>\n"))
    assert tokenizer_fingerprint(info, None) != before
    # an explicit data.chat_template is part of it too
    assert tokenizer_fingerprint(info, "{{ messages }}") != tokenizer_fingerprint(info, None)
