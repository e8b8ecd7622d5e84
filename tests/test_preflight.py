"""The preflight's parts that need no vLLM: the reduced depth (which layers the dummy-weight model
keeps for each layer kind and capture source), the output probe at a local path and on a real S3
server (create-only writes of every kind, nothing left behind), and ``python -m job preflight``
with the hf backend (data, weights, output and what an earlier run wrote there checked; a
failure is exit 2 naming the concern, the same error run gives; settings the backend ignores
reported). The engine part runs on vLLM in tests/test_vllm_preflight.py."""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file, save_file

pytest.register_assert_rewrite("s3_fixtures")

from s3_fixtures import ADMIN_KEY, ADMIN_SECRET  # noqa: E402

from job.backends.vllm_engine import EngineMemory  # noqa: E402
from job.errors import EXIT_CONFIG  # noqa: E402
from job.model import eagle3_default_layer_ids  # noqa: E402
from job.preflight import PreflightFailed, full_depth_memory, layer_kinds, reduce_depth  # noqa: E402
from job.settings import OutputSettings  # noqa: E402
from job.storage.probe import probe_output  # noqa: E402

pytest_plugins = ["s3_fixtures"]

KIMI_K2 = {  # Kimi-K2.5's language model: DeepSeek-V3 architecture, 61 layers, the first dense
    "architectures": ["KimiK25ForConditionalGeneration"],
    "text_config": {"num_hidden_layers": 61, "n_routed_experts": 384, "first_k_dense_replace": 1},
}


def test_kimi_k2_keeps_a_dense_layer_a_moe_layer_and_the_layers_each_id_reads() -> None:
    ids = eagle3_default_layer_ids(61)
    assert ids == [2, 30, 58, 61]
    reduction = reduce_depth(KIMI_K2, ids)
    assert reduction.kept == [0, 1, 29, 57, 60]  # id k reads layer k-1; the last layer for id N
    assert reduction.layer_ids == [2, 3, 4, 5]  # inside the stack stays inside, N stays N
    assert reduction.kinds == ["dense", "moe", "moe", "moe", "moe"]
    assert reduction.hf_overrides == {"text_config": {"num_hidden_layers": 5, "first_k_dense_replace": 1}}


GIB = 1024**3


def _kimi_reduced_engine(device: str, kv_cache_gib: float) -> EngineMemory:
    """A Kimi-K2-shaped rank as the preflight builds it (5 of 61 layers): 2 GiB outside the
    layers, a dense layer of 0.5 GiB, MoE layers of 8 GiB; 16 KiB of KV cache per token."""
    return EngineMemory(
        device=device,
        weight_bytes=int((2 + 0.5 + 4 * 8) * GIB),
        layer_weight_bytes=[GIB // 2, 8 * GIB, 8 * GIB, 8 * GIB, 8 * GIB],
        kv_cache_bytes=int(kv_cache_gib * GIB),
        kv_tokens=int(kv_cache_gib * GIB) // (16 * 1024),
        max_model_len=8193,
    )


def test_memory_at_full_depth_scales_each_layer_kind_and_takes_the_extra_weights_from_the_kv_cache() -> None:
    reduction = reduce_depth(KIMI_K2, eagle3_default_layer_ids(61))
    kinds = layer_kinds(KIMI_K2["text_config"])
    assert reduction.target_kinds == kinds
    estimate = full_depth_memory(_kimi_reduced_engine("cuda", 500), reduction)
    assert estimate.weight_bytes == int((2 + 0.5 + 60 * 8) * GIB)
    assert estimate.kv_cache_bytes == int((500 - 56 * 8) * GIB)  # 56 MoE layers more than built
    assert estimate.kv_tokens == int(estimate.kv_cache_bytes // (16 * 1024 * 61 / 5))  # KV per token x 61/5
    assert "weights about 482.5 GiB (34.5 GiB built)" in estimate.check(0.9)
    # On a CPU build the KV cache is a fixed space beside the weights: only the estimate is said.
    on_cpu = full_depth_memory(_kimi_reduced_engine("cpu", 20), reduction)
    assert on_cpu.kv_cache_bytes == 20 * GIB and "KV cache about 20.0 GiB" in on_cpu.check(0.9)


def test_a_gpu_without_room_for_one_sample_at_full_depth_fails_the_preflight_naming_the_settings() -> None:
    """The reduced engine fits (vLLM built it), but the 56 MoE layers it lacks take more than its
    KV cache: vLLM would stop after loading the real weights."""
    reduction = reduce_depth(KIMI_K2, eagle3_default_layer_ids(61))
    estimate = full_depth_memory(_kimi_reduced_engine("cuda", 400), reduction)
    assert estimate.kv_cache_bytes < 0
    with pytest.raises(PreflightFailed) as failed:
        estimate.check(0.85)
    assert failed.value.exit_code == EXIT_CONFIG
    message = str(failed.value)
    for words in (
        "448.0 GiB more",
        "backend.vllm.gpu_memory_utilization 0.85",
        "max_model_len 8193",
        "backend.tensor_parallel_size",
        "data.max_length",
    ):
        assert words in message, words


def test_layer_ids_at_the_ends_keep_their_capture_source() -> None:
    """Id 0 (the embedding output: a tap or hook on layer 0's input) and id N (after the last
    layer: never an aux output) keep those positions; every id inside stays inside."""
    config = {"num_hidden_layers": 40}
    reduction = reduce_depth(config, [0, 1, 20, 39, 40])
    n = reduction.depth
    assert reduction.layer_ids[0] == 0 and reduction.layer_ids[-1] == n
    assert all(0 < k < n for k in reduction.layer_ids[1:-1])
    assert reduction.hf_overrides == {"num_hidden_layers": n}


def test_every_kind_of_a_mixed_layer_pattern_is_kept() -> None:
    """layer_types (sliding/full attention) and MoE every other layer (Qwen-MoE's
    decoder_sparse_step with mlp_only_layers): the reduced model has each combination that occurs."""
    types = ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 6
    config = {"num_hidden_layers": 24, "layer_types": types, "num_experts": 8, "mlp_only_layers": [0, 1]}
    reduction = reduce_depth(config, [2, 12, 21, 24])
    assert set(reduction.kinds) == set(layer_kinds(config))
    overridden = {**config, **reduction.hf_overrides}
    assert layer_kinds(overridden) == reduction.kinds


def test_a_pattern_the_overrides_cannot_express_keeps_full_depth() -> None:
    config = {"num_hidden_layers": 12, "n_routed_experts": 8, "first_k_dense_replace": 1, "moe_layer_freq": 3}
    reduction = reduce_depth(config, [2, 6, 9, 12])
    assert reduction.why_full is not None and reduction.depth == 12 and reduction.hf_overrides == {}


def test_the_reduced_engine_keeps_the_users_own_config_overrides() -> None:
    """engine_args.hf_overrides (e.g. DeepSeek's router in float32, docs/gpu.md) stay in the
    preflight's engine; the reduction adds its layer keys, inside a text_config too."""
    from job.backends.vllm_engine import EngineSpec
    from job.model import resolve_model
    from job.settings import JobSettings

    user = {"hf_overrides": {"moe_router_dtype": "float32", "text_config": {"rope_theta": 5.0}}}
    settings = JobSettings(backend={"name": "vllm", "vllm": {"engine_args": user}})
    reduction = reduce_depth(KIMI_K2, eagle3_default_layer_ids(61))
    spec = EngineSpec.of(settings, generating=False)
    dummy = replace(spec, dummy_weights=True, hf_overrides=reduction.hf_overrides)
    kwargs = dummy.engine_kwargs(resolve_model(settings.model))
    assert kwargs["load_format"] == "dummy"
    assert kwargs["hf_overrides"] == {
        "moe_router_dtype": "float32",
        "text_config": {"rope_theta": 5.0, "num_hidden_layers": 5, "first_k_dense_replace": 1},
    }
    assert "load_format" not in spec.engine_kwargs(resolve_model(settings.model))


def test_the_reduced_engine_captures_cuda_graphs_up_to_its_cap_unless_the_user_set_sizes() -> None:
    """The preflight's engine captures CUDA graphs up to preflight.max_cudagraph_capture_size
    (vLLM's own key, beside the user's other compilation settings); the run's engine has no cap,
    and sizes the user set in engine_args stand in both."""
    from job.backends.vllm_engine import EngineSpec
    from job.model import resolve_model
    from job.settings import JobSettings

    def compilation(engine_args: dict[str, Any], cap: int | None) -> Any:
        settings = JobSettings(backend={"name": "vllm", "vllm": {"engine_args": engine_args}})
        spec = replace(EngineSpec.of(settings, generating=False), max_cudagraph_capture_size=cap)
        return spec.engine_kwargs(resolve_model(settings.model)).get("compilation_config")

    cap = JobSettings().preflight.max_cudagraph_capture_size
    assert cap == 8
    assert compilation({}, cap) == {"max_cudagraph_capture_size": 8}
    assert compilation({}, None) is None
    assert compilation({"compilation_config": {"cudagraph_mode": "PIECEWISE"}}, cap) == {
        "cudagraph_mode": "PIECEWISE",
        "max_cudagraph_capture_size": 8,
    }
    for own in ({"cudagraph_capture_sizes": [1, 64]}, {"max_cudagraph_capture_size": 32}):
        assert compilation({"compilation_config": own}, cap) == own
    assert compilation({"compilation_config": 3}, cap) == 3  # a bare mode: vLLM's own sizes


def test_the_local_probe_leaves_nothing_behind(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    (lines,) = probe_output(OutputSettings(uri=str(out), shard_bytes="1MiB"), 3)
    assert "create-only write" in lines and "nothing left behind" in lines
    assert list(tmp_path.iterdir()) == []  # the directories it had to create are gone too
    existing = tmp_path / "existing"
    existing.mkdir()
    probe_output(OutputSettings(uri=str(existing), shard_bytes="1MiB"), 0)
    assert list(existing.iterdir()) == []


def test_the_local_probe_refuses_an_output_without_room_for_a_shard(tmp_path: Path) -> None:
    from job.errors import ConfigError

    with pytest.raises(ConfigError, match="less than one shard"):
        probe_output(OutputSettings(uri=str(tmp_path), shard_bytes="1PiB"), 0)


def test_the_s3_probe_writes_every_kind_of_object_and_leaves_nothing(
    s3_endpoint: str, s3: Any, bucket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    for name, value in {
        "AWS_ACCESS_KEY_ID": ADMIN_KEY,
        "AWS_SECRET_ACCESS_KEY": ADMIN_SECRET,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": s3_endpoint,
        "AWS_EC2_METADATA_DISABLED": "true",
    }.items():
        monkeypatch.setenv(name, value)
    (line,) = probe_output(
        OutputSettings(uri=f"s3://{bucket}/probe-run", shard_bytes="1MiB", max_staged_bytes="256MiB"), 2
    )
    assert "second create-only put refused" in line and "CRC64NVME verified" in line
    assert s3.list_objects_v2(Bucket=bucket, Prefix="probe-run/").get("KeyCount", 0) == 0
    assert s3.list_multipart_uploads(Bucket=bucket, Prefix="probe-run/").get("Uploads", []) == []


def test_preflight_with_the_hf_backend_checks_data_and_output(run_job: Any, tmp_path: Path) -> None:
    out = tmp_path / "out"
    result = run_job("preflight", f"--output.uri={out}", "--log.format=json")
    assert result.rc == 0, result.describe()
    assert "preflight passed" in result.stdout
    assert "data: the first 8 samples of index 0" in result.stdout
    assert "the engine: the hf backend" in result.stdout
    assert not out.exists()


def test_preflight_names_the_data_when_every_first_sample_is_rejected(
    run_job: Any, tmp_path: Path, write_jsonl: Any
) -> None:
    data = write_jsonl(tmp_path / "bad.jsonl", [{"id": f"x{i}", "messages": "not a list"} for i in range(3)])
    result = run_job("preflight", f"--data.path={data}", f"--output.uri={tmp_path / 'out'}")
    assert result.rc == EXIT_CONFIG, result.describe()
    (line,) = [e for e in result.stderr.splitlines() if e.startswith("error: ")]
    assert line.startswith("error: data: all of the first 3 samples of index 0 were rejected"), line
    assert not (tmp_path / "out").exists()


def test_preflight_names_an_output_it_cannot_write(run_job: Any, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    result = run_job("preflight", f"--output.uri={blocker / 'out'}")
    assert result.rc == EXIT_CONFIG, result.describe()
    assert "error: output.uri: cannot write to" in result.stderr
    assert blocker.read_text() == "not a directory"


def test_preflight_refuses_the_weights_run_refuses(
    run_job: Any, tiny_llama_dir: Path, tmp_path: Path, fast_args: tuple[str, ...]
) -> None:
    """The weights' check run makes before any model loads (job.weights, job.weight_names,
    job.weight_shapes), with the same error, in the preflight: a truncated file and a renamed
    tensor, with the hf backend, where the preflight builds no engine."""
    truncated = tmp_path / "truncated"
    shutil.copytree(tiny_llama_dir, truncated)
    with (truncated / "model.safetensors").open("r+b") as f:
        f.truncate(1_000_000)
    renamed = tmp_path / "renamed"
    shutil.copytree(tiny_llama_dir, renamed)
    tensors = load_file(renamed / "model.safetensors")
    tensors["model.layers.3.mlp.down.weight"] = tensors.pop("model.layers.3.mlp.down_proj.weight")
    save_file(tensors, renamed / "model.safetensors", metadata={"format": "pt"})
    out = tmp_path / "out"
    for model, needle in (
        (truncated, "1 weight file(s) cannot load: model.safetensors: 1000000 bytes"),
        (renamed, "1 tensor(s) the model has are not in the weights (model.layers.3.mlp.down_proj.weight)"),
    ):
        errors = []
        for command in ("preflight", "run"):
            result = run_job(command, f"--model.path={model}", f"--output.uri={out}", *fast_args)
            assert result.rc == EXIT_CONFIG, result.describe()
            errors.append(result.stderr.strip().splitlines())
        assert errors[0] == errors[1] and len(errors[0]) == 1 and needle in errors[0][0], errors
        assert errors[0][0].startswith(f"error: model.path {model}: "), errors
        assert not out.exists()


def test_preflight_checks_the_settings_of_what_the_output_holds(
    run_job: Any, tmp_path: Path, write_jsonl: Any, fast_args: tuple[str, ...]
) -> None:
    """Other layer ids than an earlier run wrote: run would refuse them as it resumes (exit 2); the
    preflight says so first, reading the output only. The same settings pass, saying what the
    output holds."""
    record = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
    data = write_jsonl(tmp_path / "data.jsonl", [{"id": f"s{i}", **record} for i in range(3)])
    out = tmp_path / "out"
    args = (f"--data.path={data}", f"--output.uri={out}", *fast_args)
    assert run_job("run", *args).rc == 0
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    other = run_job("preflight", *args, "--layers.ids=[1,2,3,8]")
    assert other.rc == EXIT_CONFIG, other.describe()
    assert other.stderr.strip().splitlines() == [
        f"error: {out / 'index-00000'} was written with different settings or data: layers.ids "
        "(layer_ids: [2, 4, 5, 8] -> [1, 2, 3, 8]). Resume needs the same ones, or use a new output.uri"
    ]
    assert run_job("run", *args, "--layers.ids=[1,2,3,8]").stderr == other.stderr
    same = run_job("preflight", *args)
    assert same.rc == 0, same.describe()
    assert (
        f"output settings: {out / 'index-00000'} holds 1 shard(s) written with these settings, data and "
        "weights (complete)"
    ) in same.stdout
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_settings_of_the_backend_not_in_use_are_reported_as_ignored(
    run_job: Any, tmp_path: Path, fast_args: tuple[str, ...]
) -> None:
    """backend.vllm.* with backend.name hf: a warning in the preflight's report and a
    settings_ignored log event (run and plan log it too); none with the defaults."""
    out = tmp_path / "out"
    result = run_job(
        "preflight",
        f"--output.uri={out}",
        "--backend.vllm.max_num_seqs=4",
        '--backend.vllm.engine_args={"block_size": 16}',
        *fast_args,
    )
    assert result.rc == 0, result.describe()
    assert (
        "warnings:\n  - ignored: backend.vllm.max_num_seqs, backend.vllm.engine_args: backend.name is hf, "
        "these settings apply to the other backend only"
    ) in result.stdout
    plan = run_job("plan", "--backend.vllm.max_num_seqs=4", *fast_args, "--log.format=json")
    events = [json.loads(line) for line in plan.stdout.splitlines() if line.startswith("{")]
    (event,) = [e for e in events if e["event"] == "settings_ignored"]
    assert event["settings"] == ["backend.vllm.max_num_seqs"] and event["level"] == "warning", event
    defaults = run_job("preflight", f"--output.uri={out}", *fast_args, "--log.format=json")
    assert (
        defaults.rc == 0 and "settings_ignored" not in defaults.stdout and "warnings:" not in defaults.stdout
    )
