"""Scheduler construction. The class follows vLLM's resolved
``async_scheduling`` like EngineCore does (AsyncScheduler when on); the driver
keeps at most two steps in flight either way."""

from __future__ import annotations

from typing import Any


def _scheduler(vllm_config: Any, kv_cache_config: Any, **block_sizes: int) -> Any:
    from vllm.v1.structured_output import StructuredOutputManager

    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as cls
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
        **block_sizes,
    )


def with_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int) -> Any:
    """0.11.1 - 0.19: ``block_size`` is required (positional #4)."""
    return _scheduler(vllm_config, kv_cache_config, block_size=block_size)


def with_hash_block_size(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int
) -> Any:
    """0.20+: ``hash_block_size`` may differ from the scheduler block size (hybrid models)."""
    return _scheduler(vllm_config, kv_cache_config, block_size=block_size, hash_block_size=hash_block_size)
