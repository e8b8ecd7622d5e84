"""Contract tests of the selected adapter set against the installed, real vLLM.

They build vLLM's own v1 Scheduler / KV-cache manager / Request on the CPU (no
model forward) and check the behaviour each adapter exists for. CI runs this
file once per installed vLLM line (0.16 and 0.26 with the CPU builds, 0.33 and 0.34 with
the scheduler-only installs); REQUIRE_VLLM=1 turns a missing vLLM into a failure.
"""

from __future__ import annotations

import inspect
import os
from pathlib import Path
from typing import Any

import pytest

if os.environ.get("REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

import vllm

from adapters import select_adapter_set
from adapters.requests import prefill_sampling_params

# Every test here goes through what differs between vLLM lines: .ci/run runs it on each (vllm_line).
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_line]

BLOCK = 16
ADAPTERS = select_adapter_set(vllm.__version__)


def _vllm_config(model_dir: Path, prefix_caching: bool) -> Any:
    from vllm.config import CacheConfig, DeviceConfig, ModelConfig, SchedulerConfig, VllmConfig

    scheduler_kwargs: dict[str, Any] = dict(
        max_num_seqs=8, max_num_batched_tokens=256, max_model_len=1024, enable_chunked_prefill=True
    )
    if "is_encoder_decoder" in inspect.signature(SchedulerConfig).parameters:
        scheduler_kwargs["is_encoder_decoder"] = False
    return VllmConfig(
        scheduler_config=SchedulerConfig(**scheduler_kwargs),
        model_config=ModelConfig(
            model=str(model_dir), dtype="bfloat16", seed=0, skip_tokenizer_init=True, max_model_len=1024
        ),
        cache_config=CacheConfig(block_size=BLOCK, enable_prefix_caching=prefix_caching),
        # The CUDA wheels on a CPU box cannot infer a device; the CPU build can.
        device_config=DeviceConfig(device="cpu"),
    )


def _kv_cache_config(vllm_config: Any) -> Any:
    import torch
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    hf = vllm_config.model_config.hf_config
    spec = FullAttentionSpec(
        block_size=BLOCK,
        num_kv_heads=hf.num_key_value_heads,
        head_size=hf.hidden_size // hf.num_attention_heads,
        dtype=torch.bfloat16,
    )
    names = [f"model.layers.{i}.self_attn.attn" for i in range(hf.num_hidden_layers)]
    vllm_config.cache_config.num_gpu_blocks = 256
    return KVCacheConfig(num_blocks=256, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(names, spec)])


def _scheduler(model_dir: Path, prefix_caching: bool) -> tuple[Any, Any]:
    vllm_config = _vllm_config(model_dir, prefix_caching)
    scheduler = ADAPTERS.scheduler(vllm_config, _kv_cache_config(vllm_config), BLOCK, BLOCK)
    return scheduler, vllm_config


def _prompt(seed: int, length: int) -> list[int]:
    return [(7 * seed + j) % 900 + 10 for j in range(length)]


def _model_output(scheduler_output: Any) -> Any:
    """A stand-in model output for a scheduled step: one sampled token per request."""
    import dataclasses

    from vllm.v1.outputs import ModelRunnerOutput

    ids = list(scheduler_output.num_scheduled_tokens)
    # req_id_to_index went in 0.34 (the scheduler finds a request by its place in req_ids)
    with_index = "req_id_to_index" in {f.name for f in dataclasses.fields(ModelRunnerOutput)}
    index = {"req_id_to_index": {r: i for i, r in enumerate(ids)}} if with_index else {}
    return ModelRunnerOutput(req_ids=ids, sampled_token_ids=[[5] for _ in ids], **index)


def _drive(scheduler: Any, requests: list[Any], max_steps: int = 20) -> dict[str, str]:
    """Run the scheduler loop with a stand-in model output (one sampled token)."""
    for request in requests:
        scheduler.add_request(request)
    finished: dict[str, str] = {}
    for _ in range(max_steps):
        if not scheduler.get_num_unfinished_requests():
            break
        output = scheduler.schedule()
        runner_output = _model_output(output)
        for outputs in scheduler.update_from_output(output, runner_output).values():
            for out in outputs.outputs:
                if out.finish_reason is not None:
                    finished[out.request_id] = str(out.finish_reason)
    return finished


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    os.environ.setdefault("JOB_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))
    from job.tiny import builtin_model_dir

    return builtin_model_dir("tiny-llama")


def test_request_without_block_hasher_breaks_prefix_caching(model_dir: Path) -> None:
    """The failure the block-hasher adapter exists for, as each vLLM line shows it."""
    scheduler, _ = _scheduler(model_dir, prefix_caching=True)
    length = int(3.5 * BLOCK)
    bare = [
        ADAPTERS.request(f"bare-{i}", _prompt(i, length), prefill_sampling_params(), None) for i in range(2)
    ]
    assert all(r.block_hashes == [] for r in bare)
    failure = ADAPTERS.facts.prefix_cache_without_hashes
    if failure == "assertion_error":
        for request in bare:
            scheduler.add_request(request)
        with pytest.raises(AssertionError) as info:
            scheduler.schedule()
        assert info.traceback[-1].path.name == "block_pool.py"
        assert "len(request.block_hashes) >= num_full_blocks" in str(info.traceback[-1].statement)
    elif failure == "index_error":
        for request in bare:
            scheduler.add_request(request)
        with pytest.raises(IndexError):
            scheduler.schedule()
    else:  # no crash, but those blocks are silently never cached
        _drive(scheduler, bare)
        again = ADAPTERS.request("bare-again", _prompt(0, length), prefill_sampling_params(), None)
        scheduler.add_request(again)
        assert scheduler.schedule().scheduled_new_reqs[0].num_computed_tokens == 0


def test_adapter_requests_carry_block_hashes_schedule_and_finish(model_dir: Path) -> None:
    scheduler, vllm_config = _scheduler(model_dir, prefix_caching=True)
    hasher = ADAPTERS.block_hasher(vllm_config, BLOCK)
    lengths = [int(3.5 * BLOCK), 5 * BLOCK, 7]
    requests = [
        ADAPTERS.request(f"req-{i}", _prompt(i, n), prefill_sampling_params(), hasher)
        for i, n in enumerate(lengths)
    ]
    assert [len(r.block_hashes) for r in requests] == [n // BLOCK for n in lengths]
    finished = _drive(scheduler, requests)
    assert sorted(finished) == ["req-0", "req-1", "req-2"]
    assert set(finished.values()) == {"length"}  # max_tokens=1: done right after the prefill
    # The hashes are the engine's: a repeated prompt hits the prefix cache.
    again = ADAPTERS.request("again", _prompt(0, lengths[0]), prefill_sampling_params(), hasher)
    scheduler.add_request(again)
    assert scheduler.schedule().scheduled_new_reqs[0].num_computed_tokens == 3 * BLOCK


def test_prefix_caching_off_recomputes_every_token(model_dir: Path) -> None:
    """The job runs with prefix caching off: a repeated prompt is computed again in full."""
    scheduler, vllm_config = _scheduler(model_dir, prefix_caching=False)
    hasher = ADAPTERS.block_hasher(vllm_config, BLOCK)
    prompt = _prompt(3, 4 * BLOCK)
    assert _drive(scheduler, [ADAPTERS.request("first", prompt, prefill_sampling_params(), hasher)])
    scheduler.add_request(ADAPTERS.request("second", prompt, prefill_sampling_params(), hasher))
    output = scheduler.schedule()
    assert output.scheduled_new_reqs[0].num_computed_tokens == 0
    assert output.num_scheduled_tokens["second"] == len(prompt)


def test_chunked_prefill_spreads_a_long_prompt_over_steps(model_dir: Path) -> None:
    scheduler, vllm_config = _scheduler(model_dir, prefix_caching=False)
    hasher = ADAPTERS.block_hasher(vllm_config, BLOCK)
    scheduler.add_request(ADAPTERS.request("long", _prompt(1, 600), prefill_sampling_params(), hasher))
    first = scheduler.schedule()
    assert first.num_scheduled_tokens["long"] == 256  # max_num_batched_tokens


def test_the_scheduler_reads_its_token_budget_every_step(model_dir: Path) -> None:
    """What VllmBackend.set_step_tokens (bench --step-budgets) relies on: lowering the scheduler's
    max_num_scheduled_tokens on a running scheduler limits its next step."""
    scheduler, vllm_config = _scheduler(model_dir, prefix_caching=False)
    hasher = ADAPTERS.block_hasher(vllm_config, BLOCK)
    scheduler.add_request(ADAPTERS.request("long", _prompt(1, 600), prefill_sampling_params(), hasher))
    scheduler.max_num_scheduled_tokens = 100
    assert scheduler.schedule().num_scheduled_tokens["long"] == 100


def test_a_request_aborted_while_its_step_runs_is_left_out_of_that_steps_output(model_dir: Path) -> None:
    """What VllmBackend relies on to abandon the generations in flight at a stop: finish_requests
    with FINISHED_ABORTED ends a request that a step still running holds, the step's output for it
    is dropped, and the step's other requests go on to their end."""
    from vllm import SamplingParams
    from vllm.v1.request import RequestStatus

    scheduler, vllm_config = _scheduler(model_dir, prefix_caching=False)
    hasher = ADAPTERS.block_hasher(vllm_config, BLOCK)
    params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, detokenize=False)
    for name in ("abandoned", "kept"):
        scheduler.add_request(ADAPTERS.request(name, _prompt(len(name), 20), params, hasher))
    step = scheduler.schedule()
    assert set(step.num_scheduled_tokens) == {"abandoned", "kept"}
    scheduler.finish_requests(["abandoned"], RequestStatus.FINISHED_ABORTED)
    outputs = scheduler.update_from_output(step, _model_output(step))
    assert {o.request_id for engine in outputs.values() for o in engine.outputs} == {"kept"}
    assert scheduler.get_num_unfinished_requests() == 1
    assert _drive(scheduler, []) == {"kept": "length"}


def test_the_selected_facts_hold_for_the_installed_vllm() -> None:
    """Every fact of the selected set, checked against the installed vLLM's own signatures
    (the KV set-up needs a model to run: here it is checked at this level)."""
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.executor.abstract import Executor
    from vllm.v1.request import Request

    facts = ADAPTERS.facts
    scheduler_params = inspect.signature(Scheduler.__init__).parameters
    request_params = inspect.signature(Request.__init__).parameters
    hasher_params = inspect.signature(kv_cache_utils.get_request_block_hasher).parameters
    executor_methods = ("get_kv_cache_specs", "determine_available_memory", "initialize_from_config")
    assert all(hasattr(Executor, m) for m in (*executor_methods, "execute_model", "sample_tokens"))
    assert "block_hasher" in request_params and "block_size" in scheduler_params
    assert ("eos_token_id" in request_params) == facts.request_eos_token_id
    assert ("hash_block_size" in scheduler_params) == facts.scheduler_hash_block_size
    assert ("num_hash_lookahead_tokens" in hasher_params) == facts.block_hasher_lookahead
    vllm_root = Path(vllm.__file__).parent.parent  # the module's file, found without importing it
    assert (vllm_root / (facts.model_runner_v2_module.replace(".", "/") + ".py")).is_file()
    # Read, not imported: the GPU runner and the model interfaces need no device to be read.
    v1_runner = vllm_root / "vllm/v1/worker/gpu_model_runner.py"
    assert v1_runner.is_file() == facts.model_runner_v1
    gpu_worker = (vllm_root / "vllm/v1/worker/gpu_worker.py").read_text()
    assert ("vllm.v1.worker.gpu_model_runner" in gpu_worker) == facts.model_runner_v1
    if facts.model_runner_v1:
        runner_source = v1_runner.read_text()
        assert ("self.positions = self._make_buffer(" in runner_source) == facts.runner_positions_buffer
    else:
        assert not facts.runner_positions_buffer
        # vLLM now refuses the variable that asked for V1: the job must not set it
        platforms = (vllm_root / "vllm/platforms/interface.py").read_text()
        assert "VLLM_USE_V2_MODEL_RUNNER={value} is no longer supported" in platforms
    interfaces = (vllm_root / "vllm/model_executor/models/interfaces.py").read_text()
    assert ("class EagleModelMixin" in interfaces) == facts.eagle_model_mixin
    from vllm.v1.sample.ops import topk_topp_sampler

    if hasattr(topk_topp_sampler, "TopKTopPSampler"):  # Model Runner V1's sampler
        cpu_sampler = inspect.getsource(topk_topp_sampler.TopKTopPSampler.forward_cpu)
        whole_batches_only = "len(generators) != logits.shape[0]" in cpu_sampler
    else:  # the CPU runner on Model Runner V2 (0.34) keeps a seed per request
        cpu_sampler = (vllm_root / "vllm/v1/worker/cpu/sampler.py").read_text()
        whole_batches_only = "self.seeds_np[req_idx] = seed" not in cpu_sampler
    assert whole_batches_only == facts.cpu_sampler_seeds_whole_batches_only
    if facts.kv_cache_setup == "utils_initialize_cache_rpc":
        assert hasattr(kv_cache_utils, "get_kv_cache_configs")
        assert not hasattr(kv_cache_utils, "resolve_kv_cache_block_sizes")
    elif facts.kv_cache_setup == "utils_registered_specs":
        assert hasattr(kv_cache_utils, "get_kv_cache_configs")
        assert hasattr(kv_cache_utils, "resolve_kv_cache_block_sizes")
        assert not hasattr(Executor, "set_kv_cache_layout")
    else:
        from vllm.v1.core import kv_cache_planning

        assert {"global_kv_cache_groups"} <= set(
            inspect.signature(kv_cache_planning.get_kv_cache_configs).parameters
        )
        assert hasattr(Executor, "compile_or_warm_up_model") and hasattr(Executor, "set_kv_cache_layout")
        extensible = facts.kv_cache_setup == "planning_extensible"
        methods = ("extend_kv_cache", "extensible_kv_cache_unsupported_reason", "disable_extensible_kv_cache")
        assert all(hasattr(Executor, m) for m in methods) == extensible
        assert hasattr(kv_cache_planning, "finalize_extensible_kv_cache") == extensible


def test_a_generating_run_asks_for_model_runner_v1_only_where_vllm_has_it(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Generation runs on V1 where the line has it (V2 hung at start-up on an H200, 0.26); 0.34
    has only V2 and refuses VLLM_USE_V2_MODEL_RUNNER=0, so there the job must not set it."""
    from adapters.engine import MODEL_RUNNER_V2_ENV

    monkeypatch.delenv(MODEL_RUNNER_V2_ENV, raising=False)
    engine_kwargs = {"model": str(model_dir), "tokenizer": str(model_dir), "max_model_len": 512}
    try:
        ADAPTERS.engine_config(engine_kwargs, {"mode": "hooks", "layer_ids": [1]}, generating=True)
    except RuntimeError as exc:  # the CUDA wheels on a CPU box cannot infer a device, after the choice
        assert "Device string must not be empty" in str(exc)
    runner_v1 = ADAPTERS.facts.model_runner_v1
    assert os.environ.get(MODEL_RUNNER_V2_ENV) == ("0" if runner_v1 else None)
    from vllm.platforms import current_platform
    from vllm.platforms.interface import Platform

    if hasattr(Platform, "validate_environ"):  # vLLM's own check of its variables (0.33+)
        monkeypatch.setenv(MODEL_RUNNER_V2_ENV, "0")
        if runner_v1:
            current_platform.validate_environ(True)
        else:
            with pytest.raises(ValueError, match="Model Runner V1 has been removed"):
                current_platform.validate_environ(True)
