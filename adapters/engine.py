"""Engine construction: the VllmConfig the driver runs with, and its executor."""

from __future__ import annotations

import os
from typing import Any

from job.errors import ConfigError

WORKER_EXTENSION = "job.worker.extension.HiddenStateCaptureExtension"
# Engine arguments the capture depends on; engine_args may not override them.
PINNED_ENGINE_ARGS = {
    "enable_prefix_caching": False,  # a cached prefix is not recomputed: its states would be missing
    "enable_chunked_prefill": True,  # long samples span several steps; rows are accumulated per request
    "skip_tokenizer_init": True,
    "worker_extension_cls": WORKER_EXTENSION,
}
# additional_config key holding what the capture changes in the compiled graph: vLLM hashes
# additional_config into its compile-cache key, and nothing else there names the aux layers,
# so two layer sets would otherwise share (and load) one compiled graph.
CAPTURE_CONFIG_KEY = "eagle3_extract_capture"
MODEL_RUNNER_V2_ENV = "VLLM_USE_V2_MODEL_RUNNER"


def build_engine_config(
    engine_kwargs: dict[str, Any], capture: dict[str, Any], generating: bool, model_runner_v1: bool
) -> Any:
    """EngineArgs -> VllmConfig with the pinned arguments and the capture's compile-cache key;
    a clash or vLLM's refusal is a ConfigError naming backend.vllm.engine_args.

    ``generating``: Model Runner V1 where the line has it (``model_runner_v1``) unless
    ``VLLM_USE_V2_MODEL_RUNNER`` says otherwise: a tiny model's generating run on V2 (vLLM 0.26's
    default for dense models on a GPU) hung in its start-up on an H200 on 2026-12-01; on
    2026-12-05 that same run completed on V2 on an H100, and an 8B generating run on V2 neither
    hung nor lagged (0.994x plain ``LLM.generate``; V1 1.029x; docs/benchmarks.md), so the hang's
    cause is unknown and V1 stays the default. From 0.34 V2 is the only runner (vLLM
    refuses the variable set to 0), so such runs generate on V2. On a CPU build:
    whole prompts per step (no chunked prefill, a token budget of at least max_model_len): vLLM
    rewinds a seeded request's generator after a partial prefill (``Generator.set_offset``),
    which CPU generators do not have ("CPU Generator does not use offset"), and generation
    requests are seeded."""
    if generating and model_runner_v1:
        os.environ.setdefault(MODEL_RUNNER_V2_ENV, "0")  # read when the config is created
    clashes = {
        k: v for k, v in engine_kwargs.items() if k in PINNED_ENGINE_ARGS and PINNED_ENGINE_ARGS[k] != v
    }
    additional = dict(engine_kwargs.get("additional_config") or {})
    if CAPTURE_CONFIG_KEY in additional:
        clashes[f"additional_config.{CAPTURE_CONFIG_KEY}"] = additional[CAPTURE_CONFIG_KEY]
    if clashes:
        raise ConfigError(
            f"backend.vllm.engine_args: {sorted(clashes)} cannot be changed; hidden-state capture "
            f"needs { ({k: PINNED_ENGINE_ARGS.get(k, 'the job') for k in clashes}) }"
        )
    additional[CAPTURE_CONFIG_KEY] = capture
    pinned = {**engine_kwargs, **PINNED_ENGINE_ARGS, "additional_config": additional}
    vllm_config = _create(pinned)
    if generating and vllm_config.device_config.device_type == "cpu":
        budget = max(
            vllm_config.scheduler_config.max_num_batched_tokens, vllm_config.model_config.max_model_len
        )
        vllm_config = _create({**pinned, "enable_chunked_prefill": False, "max_num_batched_tokens": budget})
    if vllm_config.parallel_config.pipeline_parallel_size != 1:
        raise ConfigError(
            "backend.vllm.engine_args: pipeline_parallel_size must be 1 (use tensor parallelism)"
        )
    return vllm_config


def _create(engine_kwargs: dict[str, Any]) -> Any:
    from vllm.engine.arg_utils import EngineArgs

    try:
        return EngineArgs(**engine_kwargs).create_engine_config()
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"backend.vllm: vLLM rejected the engine arguments: {exc}") from None


def start_executor(vllm_config: Any) -> Any:
    """The executor class vLLM picks for the config (multiprocessing: one process per TP rank)."""
    from vllm.v1.executor.abstract import Executor

    return Executor.get_class(vllm_config)(vllm_config)
