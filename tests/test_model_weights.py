"""The target model's weight files: checked before any model loads, and fingerprinted.

Real files throughout: copies of builtin:tiny-llama (safetensors), split into an indexed
two-shard checkpoint, saved as torch.save pickles, truncated, with a damaged header, with
other tensor values or other shapes. A model directory without weights, or with weights that
cannot load, ends the run with exit 2 and an ``error:`` line naming model.path, before any model
load, for the hf and the vLLM backend; so do tensors of other shapes than config.json gives them
(job.weight_shapes: the architecture built on the meta device), naming the tensor and both shapes.
Resume with other weights is tests/test_resume.py.
"""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import VLLM_CPU_ENV, needs_vllm
from safetensors.torch import load_file, save_file

from job.errors import ConfigError
from job.model import resolve_model
from job.pipeline.setup import check_model_weights
from job.settings import load_settings
from job.weight_shapes import ShapeCheck, check_tensor_shapes
from job.weights import check_weights, weights_fingerprint

WEIGHTS = "model.safetensors"


def copy_model(tiny_llama_dir: Path, dst: Path) -> Path:
    shutil.copytree(tiny_llama_dir, dst)
    return dst


def fingerprint(model: Path) -> str:
    return weights_fingerprint(check_weights(model))


def safetensors_header(path: Path) -> bytes:
    data = path.read_bytes()
    return data[8 : 8 + int.from_bytes(data[:8], "little")]


def with_other_values(model: Path) -> None:
    """Every tensor shifted by small noise: another fine-tune of the same model, saved alike."""
    generator = torch.Generator().manual_seed(1)
    tensors = load_file(model / WEIGHTS)
    for name, tensor in tensors.items():
        noise = 0.05 * torch.randn(tensor.shape, generator=generator)
        tensors[name] = (tensor.float() + noise).to(tensor.dtype)
    save_file(tensors, model / WEIGHTS, metadata={"format": "pt"})


def split_in_two(model: Path) -> list[str]:
    """The weights as an indexed two-shard checkpoint, as save_pretrained writes large models."""
    tensors = load_file(model / WEIGHTS)
    names = sorted(tensors)
    shards = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    weight_map = {}
    for shard, half in zip(shards, halves, strict=True):
        save_file({n: tensors[n] for n in half}, model / shard, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(half, shard))
    (model / WEIGHTS).unlink()
    (model / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return shards


def truncate(path: Path, keep: int) -> None:
    with path.open("r+b") as f:
        f.truncate(keep)


def refused(model: Path, *needles: str) -> str:
    with pytest.raises(ConfigError) as caught:
        check_weights(model)
    message = str(caught.value)
    assert message.startswith(f"model.path {model}"), message
    for needle in needles:
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


# --- the fingerprint ------------------------------------------------------------------------------


def test_a_copy_has_the_same_fingerprint_and_other_values_another(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    original = fingerprint(tiny_llama_dir)
    assert original.startswith("sha256:")
    assert fingerprint(copy_model(tiny_llama_dir, tmp_path / "copy")) == original
    other = copy_model(tiny_llama_dir, tmp_path / "other")
    with_other_values(other)
    # Same names, dtypes, shapes and offsets: the headers alone would not tell them apart.
    assert safetensors_header(other / WEIGHTS) == safetensors_header(tiny_llama_dir / WEIGHTS)
    assert fingerprint(other) != original


def test_an_indexed_checkpoint_is_checked_shard_by_shard(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "sharded")
    shards = split_in_two(model)
    assert fingerprint(model) != fingerprint(tiny_llama_dir)
    # A download of the safetensors alone leaves the pickles' index behind: not what loads.
    (model / "pytorch_model.bin.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "pytorch_model-00001-of-00002.bin"}})
    )
    check_weights(model)
    (model / shards[1]).unlink()
    refused(
        model,
        "1 weight file(s) cannot load",
        f"model.safetensors.index.json lists 2 shard(s), 1 missing ({shards[1]})",
    )


def test_torch_pickles_are_fingerprinted_by_their_zip_checksums(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "pickled")
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    torch.save(tensors, model / "pytorch_model.bin")
    before = fingerprint(model)
    tensors["lm_head.weight"][0, 0] += 1  # one value: the member's CRC-32 changes
    torch.save(tensors, model / "pytorch_model.bin")
    assert fingerprint(model) != before
    truncate(model / "pytorch_model.bin", (model / "pytorch_model.bin").stat().st_size - 100)
    refused(model, "pytorch_model.bin: a damaged torch zip")


# --- what no retry can fix ----------------------------------------------------------------------------


def test_unloadable_weights_are_named(tiny_llama_dir: Path, tmp_path: Path) -> None:
    empty = copy_model(tiny_llama_dir, tmp_path / "no-weights")
    (empty / WEIGHTS).unlink()
    refused(empty, "holds no weights", "download the weights")

    truncated = copy_model(tiny_llama_dir, tmp_path / "truncated")
    size = (truncated / WEIGHTS).stat().st_size
    truncate(truncated / WEIGHTS, size // 2)
    refused(truncated, f"model.safetensors: {size // 2} bytes, but its header describes {size}: truncated")

    damaged = copy_model(tiny_llama_dir, tmp_path / "damaged")
    raw = bytearray((damaged / WEIGHTS).read_bytes())
    raw[8:40] = b"x" * 32  # the start of the JSON header
    (damaged / WEIGHTS).write_bytes(bytes(raw))
    refused(
        damaged, "model.safetensors: its safetensors header is damaged", "download the model's weights again"
    )


def test_vllm_dummy_weights_need_no_weight_files(
    tiny_llama_dir: Path, tmp_path: Path, inprocess_env: None
) -> None:
    """vLLM's load_format dummy (the benchmarks' real architectures without their weights) reads no
    weight file: a directory with config.json alone is not refused, and the identity says dummy."""
    model = tmp_path / "config-only"
    model.mkdir()
    shutil.copy(tiny_llama_dir / "config.json", model / "config.json")
    args = [f"--model.path={model}", "--backend.name=vllm"]
    dummy = load_settings(cli_args=[*args, '--backend.vllm.engine_args={"load_format": "dummy"}'])
    checked = check_model_weights(dummy, resolve_model(dummy.model))
    assert checked.fingerprint == "dummy (backend.vllm.engine_args load_format)" and checked.shapes is None
    real = load_settings(cli_args=args)
    with pytest.raises(ConfigError, match="holds no weights"):
        check_model_weights(real, resolve_model(real.model))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path]) -> Path:
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    return write_jsonl(tmp_path_factory.mktemp("weights") / "data.jsonl", [record] * 3)


def test_a_run_with_truncated_weights_exits_2_before_the_model_loads(
    run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path, data: Path, fast_args: tuple[str, ...]
) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    truncate(model / WEIGHTS, 1_000_000)
    out = tmp_path / "out"
    for command in ("run", "plan"):
        result = run_job(
            command, f"--model.path={model}", f"--data.path={data}", f"--output.uri={out}", *fast_args
        )
        assert result.rc == 2, result.describe()
        size = (tiny_llama_dir / WEIGHTS).stat().st_size
        assert result.stderr.strip().splitlines() == [
            f"error: model.path {model}: 1 weight file(s) cannot load: model.safetensors: 1000000 bytes, "
            f"but its header describes {size}: truncated (an interrupted download or copy?); copy or "
            "download the model's weights again"
        ]
    assert not out.exists()  # refused before the output was opened


# --- tensor shapes against config.json --------------------------------------------------------------

OTHER_SHAPE = "model.layers.0.mlp.gate_proj.weight"


def with_a_row_less(model: Path, name: str = OTHER_SHAPE) -> tuple[list[int], list[int]]:
    """One tensor a row short: a well-formed file that check_weights passes. Its shape before and after."""
    tensors = load_file(model / WEIGHTS)
    before = list(tensors[name].shape)
    tensors[name] = tensors[name][:-1].clone()
    save_file(tensors, model / WEIGHTS, metadata={"format": "pt"})
    return before, list(tensors[name].shape)


def config_of(model: Path) -> dict[str, Any]:
    return json.loads((model / "config.json").read_text())


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen3"])
def test_the_builtin_models_shapes_fit_their_configs_tensor_for_tensor(
    builtin_model: Callable[[str], Path], name: str
) -> None:
    """Every tensor under transformers 4.57; transformers 5 fuses MoE experts (other names: not
    compared), and compares the rest."""
    model = builtin_model(name)
    check = check_tensor_shapes(model, config_of(model))
    assert check.skipped is None and check.compared > 50, check


def test_other_shapes_are_named_with_both_shapes_and_an_indexed_checkpoint_too(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    want, got = with_a_row_less(model)
    with pytest.raises(ConfigError) as caught:
        check_tensor_shapes(model, config_of(model))
    assert str(caught.value) == (
        f"model.path {model}: 1 of 75 weight tensors do not fit its config.json (LlamaForCausalLM): "
        f"{OTHER_SHAPE} in model.safetensors has shape {got}, config.json makes it {want}; the weights "
        "belong to another model: copy or download the model's weights again, or point model.path at "
        "the model they belong to"
    )
    shards = split_in_two(model)
    with pytest.raises(ConfigError, match=re.escape(f"{OTHER_SHAPE} in {shards[0]} has shape {got}")):
        check_tensor_shapes(model, config_of(model))


def test_what_cannot_be_compared_is_skipped_with_the_reason(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Conservative: a check that cannot tell a real mismatch from a layout of its own says so and
    passes; only names both sides have are compared."""
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    with_a_row_less(model)
    config = config_of(model)
    quantized = {**config, "quantization_config": {"quant_method": "compressed-tensors"}}
    assert check_tensor_shapes(model, quantized) == ShapeCheck(
        skipped="a quantized checkpoint (quantization_config)"
    )
    # A tensor only the checkpoint has (renamed, fused): not compared; the others are.
    tensors = load_file(model / WEIGHTS)
    tensors["model.layers.0.mlp.gate_up_proj.weight"] = tensors.pop(OTHER_SHAPE)
    save_file(tensors, model / WEIGHTS, metadata={"format": "pt"})
    assert check_tensor_shapes(model, config) == ShapeCheck(compared=74, tensors=75)
    # An architecture transformers does not know (remote code).
    unknown = copy_model(tiny_llama_dir, tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not-in-transformers"}))
    check = check_tensor_shapes(unknown, config_of(unknown))
    assert check.compared == 0 and (check.skipped or "").startswith(
        "transformers cannot build the architecture"
    )


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_weights_of_other_shapes_exit_2_before_the_model_loads(
    run_job: Callable[..., Any],
    tiny_llama_dir: Path,
    tmp_path: Path,
    data: Path,
    fast_args: tuple[str, ...],
    backend: str,
) -> None:
    """transformers would refuse them at the load ("size mismatch"), vLLM inside its worker
    ("WorkerProc initialization failed", exit 1 after the engine's start-up): the check before
    either names the tensor and both shapes, exit 2."""
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    want, got = with_a_row_less(model)
    result = run_job(
        "run",
        f"--backend.name={backend}",
        f"--model.path={model}",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--log.format=json",
        *fast_args,
        env=VLLM_CPU_ENV,
    )
    assert result.rc == 2, result.describe()
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.path {model}: 1 of 75 weight tensors do not fit its config.json"), (
        line
    )
    assert f"{OTHER_SHAPE} in model.safetensors has shape {got}, config.json makes it {want}" in line
    assert not [e for e in result.events if e["event"] in ("adapter_selected", "run_started")]
    assert not (tmp_path / "out").exists()


def test_a_model_that_fits_logs_what_was_compared(
    run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path, data: Path, fast_args: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    result = run_job(
        "run",
        f"--model.path={tiny_llama_dir}",
        f"--data.path={data}",
        f"--output.uri={out}",
        "--log.format=json",
        *fast_args,
    )
    assert result.rc == 0, result.describe()
    assert result.event("run_finished")["written"] == 3
    checked = result.event("run_started")["weight_shapes"]
    assert checked["compared"] == checked["tensors"] == 75 and checked["skipped"] is None, checked


@needs_vllm
def test_vllm_with_truncated_weights_exits_2_before_the_engine_starts(
    run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path, data: Path
) -> None:
    """vLLM would fail inside its worker ("WorkerProc initialization failed ... See stack trace
    for root cause", the SafetensorError only in the worker's stderr): exit 1 after starting the
    engine. The check runs first."""
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    truncate(model / WEIGHTS, 1_000_000)
    result = run_job(
        "run",
        "--backend.name=vllm",
        f"--model.path={model}",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--log.format=json",
        env=VLLM_CPU_ENV,
    )
    assert result.rc == 2, result.describe()
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.path {model}: 1 weight file(s) cannot load: model.safetensors")
    assert not [e for e in result.events if e["event"] in ("adapter_selected", "run_started")]
