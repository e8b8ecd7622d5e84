"""Scheduler construction (always the synchronous Scheduler: async scheduling
would hide outputs from a driver that reads them step by step)."""

from __future__ import annotations

from typing import Any


def with_block_size(vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int) -> Any:
    """0.11.1 - 0.19: ``block_size`` is required (positional #4)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        log_stats=False,
    )


def with_hash_block_size(
    vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int
) -> Any:
    """0.20+: ``hash_block_size`` may differ from the scheduler block size (hybrid models)."""
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.structured_output import StructuredOutputManager

    return Scheduler(
        vllm_config=vllm_config,
        kv_cache_config=kv_cache_config,
        structured_output_manager=StructuredOutputManager(vllm_config),
        block_size=block_size,
        hash_block_size=hash_block_size,
        log_stats=False,
    )
