"""Scheduler construction. The class follows vLLM's resolved ``async_scheduling`` like
EngineCore does (AsyncScheduler when on); the driver keeps at most two steps in flight
either way."""

from __future__ import annotations

from typing import Any

from adapters.facts import VllmFacts


def build_scheduler(
    facts: VllmFacts, vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int
) -> Any:
    from vllm.v1.structured_output import StructuredOutputManager

    if vllm_config.scheduler_config.async_scheduling:
        from vllm.v1.core.sched.async_scheduler import AsyncScheduler as cls
    else:
        from vllm.v1.core.sched.scheduler import Scheduler as cls
    # block_size is required (positional #4) from 0.11.1; hash_block_size may differ from it
    # (hybrid models) from 0.20.
    sizes = {"hash_block_size": hash_block_size} if facts.scheduler_hash_block_size else {}
    return cls(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        log_stats=False,
        block_size=block_size,
        **sizes,
    )
