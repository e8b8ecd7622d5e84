"""The target model's weight files: checked before any model loads, and fingerprinted.

Real files throughout: copies of builtin:tiny-llama (safetensors), split into an indexed
two-shard checkpoint, saved as torch.save pickles, truncated, with a damaged header, with
other tensor values or other shapes, other names (a PEFT save's prefix, a tensor renamed, missing
or extra), a config.json with more or fewer layers than the weights; tiny-deepseek-v3 with its
multi-token-prediction layer, and compressed to INT4 by compressed-tensors as the Kimi-class proxy
is. A model directory without weights, or with weights that cannot load, ends the run with exit 2
and an ``error:`` line naming model.path, before any model load, for the hf and the vLLM backend;
so do tensors whose names do not fit the architecture built on the meta device from config.json
(job.weight_names), and tensors of other shapes (job.weight_shapes), naming the tensors and what
was expected. Resume with other weights is tests/test_resume.py.

Without the name check (main at 233464d and b67e239, ``python -m job run --backend.name=vllm
--preflight.before_run=false`` on the six directories of MISFITS), vLLM stopped each run in its
worker after the engine's start-up, exit 1 "WorkerProc initialization failed" ("a rerun
resumes"): vLLM 0.16 after 44-103 s here, 0.26 after 146-595 s (this machine under a load of
10-25). A PEFT save: "There is no module or parameter named 'base_model' in LlamaForCausalLM"
(both); a tensor renamed, an extra one, 6 layers over 8: 0.16 a KeyError naming the first name it
did not know ('layers.6.input_layernorm.weight'), 0.26 "There is no module or parameter named
'layers.6' in LlamaModel"; a tensor missing, 10 layers over 8: "Following weights were not
initialized from checkpoint" (both). The HF backend loads each of them with a warning only
(test_transformers_would_fill_or_drop_what_the_check_names).
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

from job.architecture import build_architecture
from job.errors import ConfigError
from job.model import resolve_model
from job.pipeline.setup import check_model_weights
from job.settings import load_settings
from job.weight_names import check_tensor_names
from job.weight_shapes import ShapeCheck, check_tensor_shapes
from job.weights import check_weights, checkpoint_tensors, weights_fingerprint

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


@pytest.fixture
def run_model(run_job: Callable[..., Any], data: Path, fast_args: tuple[str, ...]) -> Callable[..., Any]:
    """``python -m job run`` of the three-sample data on MODEL into OUT, JSON logs, on BACKEND."""

    def run(model: Path, out: Path, backend: str = "hf") -> Any:
        args = (f"--model.path={model}", f"--data.path={data}", f"--output.uri={out}", "--log.format=json")
        return run_job("run", f"--backend.name={backend}", *args, *fast_args, env=VLLM_CPU_ENV)

    return run


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


def shapes_of(model: Path, config: dict[str, Any] | None = None) -> ShapeCheck:
    """check_tensor_shapes as run makes it, against ``config`` (config.json's by default)."""
    tensors = checkpoint_tensors(model)
    assert not isinstance(tensors, str), tensors
    return check_tensor_shapes(model, config or config_of(model), build_architecture(model, False), tensors)


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-deepseek-v3", "tiny-qwen3"])
def test_the_builtin_models_names_and_shapes_fit_their_configs_tensor_for_tensor(
    builtin_model: Callable[[str], Path], name: str
) -> None:
    """Every tensor by name and shape under transformers 4.57; transformers 5 fuses MoE experts as
    it loads them, so tiny-deepseek-v3's per-expert tensors fit by the names its loader gives them,
    and their shapes (the fused tensors') are not compared."""
    model = builtin_model(name)
    tensors = checkpoint_tensors(model)
    assert not isinstance(tensors, str), tensors
    architecture = build_architecture(model, False)
    names = check_tensor_names(model, config_of(model), architecture, tensors)
    assert names.skipped is None and names.by_name == names.tensors == len(tensors), names
    assert names.layers == 8 and names.by_module == 0
    shapes = check_tensor_shapes(model, config_of(model), architecture, tensors)
    converted = architecture.loading(tensors).converted
    assert shapes.skipped is None and shapes.compared == len(tensors) - len(converted) > 50, shapes


def test_other_shapes_are_named_with_both_shapes_and_an_indexed_checkpoint_too(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    want, got = with_a_row_less(model)
    with pytest.raises(ConfigError) as caught:
        shapes_of(model)
    assert str(caught.value) == (
        f"model.path {model}: 1 of 75 weight tensors do not fit its config.json (LlamaForCausalLM): "
        f"{OTHER_SHAPE} in model.safetensors has shape {got}, config.json makes it {want}; the weights "
        "belong to another model: copy or download the model's weights again, or point model.path at "
        "the model they belong to"
    )
    shards = split_in_two(model)
    with pytest.raises(ConfigError, match=re.escape(f"{OTHER_SHAPE} in {shards[0]} has shape {got}")):
        shapes_of(model)


def test_what_cannot_be_compared_is_skipped_with_the_reason(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """Conservative: a check that cannot tell a real mismatch from a layout of its own says so and
    passes; only names both sides have are compared."""
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    with_a_row_less(model)
    config = config_of(model)
    quantized = {**config, "quantization_config": {"quant_method": "compressed-tensors"}}
    assert shapes_of(model, quantized) == ShapeCheck(skipped="a quantized checkpoint (quantization_config)")
    # A tensor only the checkpoint has (per expert where the architecture fuses them): not
    # compared; the others are. (The name check refuses this one: another test.)
    tensors = load_file(model / WEIGHTS)
    tensors["model.layers.0.mlp.gate_up_proj.weight"] = tensors.pop(OTHER_SHAPE)
    save_file(tensors, model / WEIGHTS, metadata={"format": "pt"})
    assert shapes_of(model) == ShapeCheck(compared=74, tensors=75)
    # An architecture transformers does not know (remote code).
    unknown = copy_model(tiny_llama_dir, tmp_path / "unknown")
    (unknown / "config.json").write_text(json.dumps({**config, "model_type": "not-in-transformers"}))
    check = shapes_of(unknown)
    assert check.compared == 0 and (check.skipped or "").startswith(
        "transformers cannot build the architecture"
    )


@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_weights_of_other_shapes_exit_2_before_the_model_loads(
    run_model: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path, backend: str
) -> None:
    """transformers would refuse them at the load ("size mismatch"), vLLM inside its worker
    ("WorkerProc initialization failed", exit 1 after the engine's start-up): the check before
    either names the tensor and both shapes, exit 2."""
    model = copy_model(tiny_llama_dir, tmp_path / "model")
    want, got = with_a_row_less(model)
    result = run_model(model, tmp_path / "out", backend)
    assert result.rc == 2, result.describe()
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith(f"error: model.path {model}: 1 of 75 weight tensors do not fit its config.json"), (
        line
    )
    assert f"{OTHER_SHAPE} in model.safetensors has shape {got}, config.json makes it {want}" in line
    assert not [e for e in result.events if e["event"] in ("adapter_selected", "run_started")]
    assert not (tmp_path / "out").exists()


def test_a_model_that_fits_logs_what_was_compared(
    run_model: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    result = run_model(tiny_llama_dir, tmp_path / "out")
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


# --- tensor names against config.json ----------------------------------------------------------------

RENAMED = "model.layers.3.mlp.down_proj.weight"
DROPPED = "model.layers.3.post_attention_layernorm.weight"
EXTRA = "model.layers.3.mlp.extra_proj.weight"
REMEDY = (
    "point model.path at the model these weights belong to (saved with save_pretrained), or copy or "
    "download its weights again"
)


def with_tensors(model: Path, edit: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]) -> None:
    save_file(edit(load_file(model / WEIGHTS)), model / WEIGHTS, metadata={"format": "pt"})


def with_config(model: Path, **changes: Any) -> None:
    (model / "config.json").write_text(json.dumps({**config_of(model), **changes}))


def renamed(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors["model.layers.3.mlp.down.weight"] = tensors.pop(RENAMED)
    return tensors


def extra(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    tensors[EXTRA] = tensors[RENAMED].clone()
    return tensors


# How each directory is made from builtin:tiny-llama (8 decoder layers, 75 tensors), and the error
# after "model.path DIR: ".
MISFITS: dict[str, tuple[Callable[[Path], None], str]] = {
    "a PEFT save": (
        lambda m: with_tensors(m, lambda t: {f"base_model.model.{name}": v for name, v in t.items()}),
        "the weights' tensor names do not fit its config.json (LlamaForCausalLM): 0 of its 75 tensor names "
        "are names the model has; 75 would be, without the prefix 'base_model.model.' at their start (a PEFT "
        "save: merge the adapter into the model, merge_and_unload(), and save that); " + REMEDY,
    ),
    "a tensor renamed": (
        lambda m: with_tensors(m, renamed),
        "the weights' tensor names do not fit its config.json (LlamaForCausalLM): 74 of its 75 tensor names "
        f"are names the model has; 1 tensor(s) the model has are not in the weights ({RENAMED}); 1 tensor(s) "
        "in the weights are not the model's (model.layers.3.mlp.down.weight in model.safetensors); " + REMEDY,
    ),
    "a tensor missing": (
        lambda m: with_tensors(m, lambda t: {name: v for name, v in t.items() if name != DROPPED}),
        "the weights' tensor names do not fit its config.json (LlamaForCausalLM): 74 of its 74 tensor names "
        f"are names the model has; 1 tensor(s) the model has are not in the weights ({DROPPED}); " + REMEDY,
    ),
    "an extra tensor": (
        lambda m: with_tensors(m, extra),
        "the weights' tensor names do not fit its config.json (LlamaForCausalLM): 75 of its 76 tensor names "
        f"are names the model has; 1 tensor(s) in the weights are not the model's ({EXTRA} in "
        "model.safetensors); " + REMEDY,
    ),
    "10 layers in config.json, 8 in the weights": (
        lambda m: with_config(m, num_hidden_layers=10),
        "config.json's num_hidden_layers is 10, but the weights hold 8 decoder layers (model.layers.0 to "
        "model.layers.7): the model would end in 2 decoder layer(s) of random weights; if these weights are "
        "the whole model, set num_hidden_layers to 8 in config.json, else " + REMEDY,
    ),
    "6 layers in config.json, 8 in the weights": (
        lambda m: with_config(m, num_hidden_layers=6),
        "config.json's num_hidden_layers is 6, but the weights hold 8 decoder layers (model.layers.0 to "
        "model.layers.7): layers 6 to 7 would be left out, so layer ids would name other layers; if these "
        "weights are the whole model, set num_hidden_layers to 8 in config.json, else " + REMEDY,
    ),
}


@pytest.fixture(scope="module")
def misfit(tiny_llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    """The model directory of MISFITS[case], made once."""
    made: dict[str, Path] = {}

    def make(case: str) -> Path:
        if case not in made:
            model = copy_model(tiny_llama_dir, tmp_path_factory.mktemp("misfit") / "model")
            MISFITS[case][0](model)
            made[case] = model
        return made[case]

    return make


@pytest.mark.parametrize("case", list(MISFITS))
@pytest.mark.parametrize("backend", ["hf", pytest.param("vllm", marks=needs_vllm)])
def test_weights_that_do_not_fit_the_architecture_exit_2_before_anything_is_written(
    run_model: Callable[..., Any], misfit: Callable[[str], Path], tmp_path: Path, case: str, backend: str
) -> None:
    """Without the check, transformers loads each of them into a partly or wholly random model
    and the run exits 0 (the next test shows what its load report says); vLLM 0.16 and 0.26 stop
    in the worker after the engine's start-up (exit 1, "a rerun resumes", see README), or load
    the layers config.json names and leave the rest out (6 layers over 8)."""
    model = misfit(case)
    result = run_model(model, tmp_path / "out", backend)
    assert result.rc == 2, result.describe()
    assert result.stderr.strip().splitlines() == [f"error: model.path {model}: {MISFITS[case][1]}"]
    assert not [e for e in result.events if e["event"] in ("adapter_selected", "run_started")]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("case", list(MISFITS))
def test_transformers_would_fill_or_drop_what_the_check_names(
    misfit: Callable[[str], Path], case: str
) -> None:
    """transformers' own load report for each directory the check refuses: the tensors it fills
    at random (missing) or leaves unused (unexpected), with a warning only."""
    from transformers import AutoModelForCausalLM

    _, report = AutoModelForCausalLM.from_pretrained(misfit(case), output_loading_info=True)
    # (missing, unexpected): how many, the decoder layers they belong to, or their names
    expected: dict[str, tuple[Any, Any]] = {
        "a PEFT save": (75, 75),  # every tensor random, every stored one unused
        "a tensor renamed": ([RENAMED], ["model.layers.3.mlp.down.weight"]),
        "a tensor missing": ([DROPPED], []),
        "an extra tensor": ([], [EXTRA]),
        "10 layers in config.json, 8 in the weights": ({8, 9}, []),  # two layers random
        "6 layers in config.json, 8 in the weights": ([], {6, 7}),  # two layers unused
    }

    def stated(keys: list[str], like: Any) -> Any:
        if isinstance(like, int):
            return len(keys)
        if isinstance(like, set):
            return {int(re.findall(r"^model\.layers\.(\d+)\.", key)[0]) for key in keys}
        return sorted(keys)

    missing, unexpected = expected[case]
    assert stated(report["missing_keys"], missing) == missing, report
    assert stated(report["unexpected_keys"], unexpected) == unexpected, report


def checked(model: Path) -> tuple[Any, Any]:
    """check_model_weights' name and shape checks for ``model`` (the hf backend's settings)."""
    settings = load_settings(cli_args=[f"--model.path={model}"])
    weights = check_model_weights(settings, resolve_model(settings.model))
    return weights.names, weights.shapes


def test_what_loads_as_it_should_is_not_refused(
    tiny_llama_dir: Path, tmp_path: Path, inprocess_env: None
) -> None:
    """A tied head saved once (tie_word_embeddings), per-layer rotary caches of older checkpoints
    (transformers recomputes them, vLLM skips them by name)."""
    tied = copy_model(tiny_llama_dir, tmp_path / "tied")
    with_tensors(tied, lambda t: {name: v for name, v in t.items() if name != "lm_head.weight"})
    with_config(tied, tie_word_embeddings=True)
    names, shapes = checked(tied)
    assert (names.tensors, names.by_name, names.layers, shapes.compared) == (74, 74, 8, 74), (names, shapes)
    # The same checkpoint with an untied head: lm_head.weight would be random.
    with_config(tied, tie_word_embeddings=False)
    with pytest.raises(ConfigError, match=re.escape("the model has are not in the weights (lm_head.weight)")):
        checked(tied)

    rotary = copy_model(tiny_llama_dir, tmp_path / "rotary")
    caches = {f"model.layers.{i}.self_attn.rotary_emb.inv_freq": torch.ones(32) for i in range(8)}
    with_tensors(rotary, lambda t: {**t, **caches})
    names, _ = checked(rotary)
    assert (names.tensors, names.by_name, names.by_module) == (83, 75, 0), names


def test_a_deepseek_checkpoint_with_its_multi_token_prediction_layer_is_not_refused(
    builtin_model: Callable[[str], Path], tmp_path: Path, inprocess_env: None
) -> None:
    """DeepSeek-V3 ships its multi-token-prediction layer as the layer after the last
    (num_nextn_predict_layers: 1): neither loader uses it. One layer more than that is refused."""
    model = copy_model(builtin_model("tiny-deepseek-v3"), tmp_path / "mtp")
    with_config(model, num_nextn_predict_layers=1)

    def with_layer_8(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        last = {k: v for k, v in tensors.items() if k.startswith("model.layers.7.")}
        return {**tensors, **{k.replace(".layers.7.", ".layers.8."): v.clone() for k, v in last.items()}}

    with_tensors(model, with_layer_8)
    names, _ = checked(model)
    assert names.layers == 8 and names.skipped is None, names
    with_config(model, num_nextn_predict_layers=0)
    with pytest.raises(
        ConfigError, match=re.escape("config.json's num_hidden_layers is 8, but the weights hold 9")
    ):
        checked(model)


def int4_experts(model: Path) -> dict[str, Any]:
    """tiny-deepseek-v3 compressed as the benchmarks' Kimi-class proxy is: its quantization_config
    (routed experts W4A16, compressed-tensors pack-quantized, groups of 32; the rest bf16), by
    compressed-tensors itself. The quantization config written to config.json."""
    import copy

    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (
        QuantizationConfig,
        QuantizationStatus,
        apply_quantization_config,
    )
    from compressed_tensors.quantization.utils import calculate_qparams
    from transformers import AutoModelForCausalLM

    from job.benchmarks.throughput import KIMI_K2_PROXY

    loaded = AutoModelForCausalLM.from_pretrained(model, dtype=torch.bfloat16)
    config = QuantizationConfig.model_validate(copy.deepcopy(KIMI_K2_PROXY["quantization_config"]))
    config.quantization_status = QuantizationStatus.INITIALIZED
    apply_quantization_config(loaded, config)
    for module in loaded.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:  # each group's scale from its own range, as a min-max observer sets it
            groups = module.weight.data.float().unflatten(-1, (-1, scheme.weights.group_size))
            scale, _ = calculate_qparams(groups.amin(-1), groups.amax(-1), scheme.weights)
            module.weight_scale.data.copy_(scale)
    compressor = ModelCompressor.from_pretrained_model(loaded, quantization_format="pack-quantized")
    save_file(compressor.compress(loaded), model / WEIGHTS, metadata={"format": "pt"})
    quantization = compressor.quantization_config.model_dump(exclude_none=True)
    with_config(model, quantization_config=quantization)
    return quantization


def test_an_int4_checkpoint_is_checked_module_by_module(
    builtin_model: Callable[[str], Path], tmp_path: Path, inprocess_env: None
) -> None:
    """Packed and scaled tensors (weight_packed, weight_scale, weight_shape) stand for their
    module's weight; a module with none of its tensors is refused all the same."""
    model = copy_model(builtin_model("tiny-deepseek-v3"), tmp_path / "int4")
    int4_experts(model)
    tensors = load_file(model / WEIGHTS)
    packed = [name for name in tensors if name.endswith(".weight_packed")]
    assert len(packed) == 7 * 8 * 3  # 7 MoE layers of 8 experts, gate, up and down each
    names, shapes = checked(model)
    assert names.skipped is None and names.layers == 8, names
    assert names.by_module == 3 * len(packed) and names.by_name + names.by_module == len(tensors), names
    assert shapes.skipped == "a quantized checkpoint (quantization_config)"
    expert = "model.layers.4.mlp.experts.5.down_proj"
    save_file({k: v for k, v in tensors.items() if not k.startswith(expert + ".")}, model / WEIGHTS)
    with pytest.raises(ConfigError, match=re.escape(f"are not in the weights ({expert}.weight)")):
        checked(model)


def test_pickled_weights_are_checked_by_the_names_inside(
    run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path, data: Path, fast_args: tuple[str, ...]
) -> None:
    """torch.save's zip holds the names in its pickle, read memory-mapped (no tensor data read)."""
    model = copy_model(tiny_llama_dir, tmp_path / "pickled")
    tensors = load_file(model / WEIGHTS)
    (model / WEIGHTS).unlink()
    torch.save({f"base_model.model.{name}": v for name, v in tensors.items()}, model / "pytorch_model.bin")
    args = (f"--model.path={model}", f"--data.path={data}", f"--output.uri={tmp_path / 'out'}", *fast_args)
    result = run_job("run", *args)
    assert result.rc == 2, result.describe()
    assert "75 would be, without the prefix 'base_model.model.' at their start" in result.stderr
    assert "in pytorch_model.bin" not in result.stderr and not (tmp_path / "out").exists()
    torch.save(tensors, model / "pytorch_model.bin")
    result = run_job("run", *args, "--log.format=json")
    assert result.rc == 0, result.describe()
    started = result.event("run_started")
    assert started["weight_names"]["by_name"] == started["weight_shapes"]["compared"] == 75, started


def test_an_architecture_transformers_cannot_build_still_has_its_layers_counted(
    tiny_llama_dir: Path, tmp_path: Path, inprocess_env: None
) -> None:
    """Names need the architecture; the decoder layers the weights hold need only config.json."""
    model = copy_model(tiny_llama_dir, tmp_path / "unknown")
    with_config(model, model_type="not-in-transformers")
    names, _ = checked(model)
    assert names.layers == 8 and (names.skipped or "").startswith(
        "transformers cannot build the architecture"
    )
    with_config(model, num_hidden_layers=10)
    with pytest.raises(
        ConfigError, match=re.escape("config.json's num_hidden_layers is 10, but the weights hold 8")
    ):
        checked(model)


def test_a_vision_language_checkpoint_in_its_own_layout_is_not_refused(
    tmp_path: Path, inprocess_env: None
) -> None:
    """A tiny Gemma-3, saved by save_pretrained (transformers 4 writes the older layout, its language
    model under language_model.model.*): its names are those the loader renames
    (model.language_model.*), not a prefix to refuse, under transformers 4 and 5 alike."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration

    config = Gemma3Config(
        text_config={
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 2,
            "num_key_value_heads": 1,
            "head_dim": 32,
            "vocab_size": 300,
        },
        vision_config={
            "hidden_size": 32,
            "intermediate_size": 64,
            "num_hidden_layers": 1,
            "num_attention_heads": 2,
            "image_size": 28,
            "patch_size": 14,
        },
        mm_tokens_per_image=4,
    )
    model = tmp_path / "gemma3"
    Gemma3ForConditionalGeneration(config).save_pretrained(model)
    tensors = checkpoint_tensors(model)
    assert not isinstance(tensors, str), tensors
    names = check_tensor_names(model, config_of(model), build_architecture(model, False), tensors)
    assert names.skipped is None and names.by_name == names.tensors == len(tensors) and names.layers == 2, (
        names
    )
