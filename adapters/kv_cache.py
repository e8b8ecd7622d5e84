"""KV-cache set-up: profile free memory, plan the cache, allocate it in the workers,
and derive the scheduler's block sizes. One function per ``VllmFacts.kv_cache_setup``
value, each following ``EngineCore._initialize_kv_caches`` (and the block-size lines of
``EngineCore.__init__``) of the vLLM lines that behave so, minus elastic-EP and
connector paths this job never uses.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from adapters.facts import VllmFacts


@dataclass(frozen=True)
class KvCacheSetup:
    config: Any  # the scheduler's KVCacheConfig
    block_size: int  # Scheduler(block_size=...)
    hash_block_size: int  # block hasher / Scheduler(hash_block_size=...)


def _planned_configs(
    executor: Any, vllm_config: Any, specs: list[dict[str, Any]], plan: Callable[[list[int]], list[Any]]
) -> list[Any]:
    """Profile free memory, plan the per-worker KV-cache configs with ``plan(available)``,
    and pass a max_model_len shrunk by auto-fit on to the workers, which cached the old one."""
    available = executor.determine_available_memory() if any(specs) else [0] * len(specs)
    before = vllm_config.model_config.max_model_len
    configs = plan(available)
    if vllm_config.model_config.max_model_len != before:
        executor.collective_rpc("update_max_model_len", args=(vllm_config.model_config.max_model_len,))
    return configs


def _utils_initialize_cache_rpc(executor: Any, vllm_config: Any) -> KvCacheSetup:
    """get_kv_cache_configs; the workers' ``initialize_cache`` RPC still exists (0.16)."""
    from vllm.v1.core.kv_cache_utils import generate_scheduler_kv_cache_config, get_kv_cache_configs

    specs = executor.get_kv_cache_specs()
    configs = _planned_configs(
        executor, vllm_config, specs, lambda available: get_kv_cache_configs(vllm_config, specs, available)
    )
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    executor.initialize_from_config(configs)  # allocates and warms up
    vllm_config.cache_config.num_gpu_blocks = scheduler_config.num_blocks
    vllm_config.cache_config.num_cpu_blocks = 0
    executor.collective_rpc("initialize_cache", args=(scheduler_config.num_blocks, 0))
    parallel = vllm_config.parallel_config
    block_size = (
        vllm_config.cache_config.block_size
        * parallel.decode_context_parallel_size
        * parallel.prefill_context_parallel_size
    )
    return KvCacheSetup(scheduler_config, block_size, block_size)


def _utils_registered_specs(executor: Any, vllm_config: Any) -> KvCacheSetup:
    """Specs registered first; the cache block size follows the groups;
    ``initialize_from_config`` still warms up (0.26; it stops doing so in 0.27)."""
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        get_kv_cache_capacity,
        get_kv_cache_configs,
        resolve_kv_cache_block_sizes,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    register_all_kvcache_specs(vllm_config)
    specs = executor.get_kv_cache_specs()
    configs = _planned_configs(
        executor, vllm_config, specs, lambda available: get_kv_cache_configs(vllm_config, specs, available)
    )
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    cache = vllm_config.cache_config
    cache.num_gpu_blocks = scheduler_config.num_blocks
    if scheduler_config.kv_cache_groups:
        cache.block_size = min(g.kv_cache_spec.block_size for g in scheduler_config.kv_cache_groups)
        cache.kv_cache_size_tokens, cache.kv_cache_max_concurrency = get_kv_cache_capacity(
            vllm_config, scheduler_config
        )
    vllm_config.validate_block_size()
    executor.initialize_from_config(configs)
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    return KvCacheSetup(scheduler_config, block_size, hash_block_size)


def _planning_global_groups(executor: Any, vllm_config: Any) -> KvCacheSetup:
    """Planning in ``kv_cache_planning`` with global groups; the KV layout is negotiated
    with the workers; warm-up is a separate call (0.33)."""
    return _planning(executor, vllm_config, extensible_cache=False)


def _planning_extensible(executor: Any, vllm_config: Any) -> KvCacheSetup:
    """As 0.33, with 0.34's extensible KV cache (on by default on CUDA): a worker that cannot
    have it turns it off everywhere; otherwise the cache is reserved at its planned size and
    committed after warm-up at the size the workers measured then, the context length fitted
    again if vLLM chose it."""
    return _planning(executor, vllm_config, extensible_cache=True)


def _planning(executor: Any, vllm_config: Any, extensible_cache: bool) -> KvCacheSetup:
    from vllm.v1.attention.backends.utils import resolve_kv_cache_layout
    from vllm.v1.core.kv_cache_planning import get_global_kv_cache_groups, get_kv_cache_configs
    from vllm.v1.core.kv_cache_utils import (
        generate_scheduler_kv_cache_config,
        resolve_cache_hit_alignment_tokens,
        resolve_kv_cache_block_sizes,
        update_kv_cache_capacity,
    )
    from vllm.v1.core.single_type_kv_cache_manager import register_all_kvcache_specs

    cache = vllm_config.cache_config
    register_all_kvcache_specs(vllm_config)
    specs = executor.get_kv_cache_specs()
    if extensible_cache and cache.enable_extensible_kv_cache:
        reason = executor.extensible_kv_cache_unsupported_reason(specs)
        if reason is not None:
            executor.disable_extensible_kv_cache(reason)
    extensible = extensible_cache and bool(cache.enable_extensible_kv_cache)
    layout = resolve_kv_cache_layout(
        vllm_config,
        executor.get_supported_kv_cache_layouts(),
        [s for worker_specs in specs for s in worker_specs.values()],
    )
    global_groups = get_global_kv_cache_groups(vllm_config, specs)
    vllm_config.adjust_dcp_kv_cache_interleave_size(global_groups)
    executor.set_kv_cache_layout(layout.name, vllm_config.parallel_config.cp_kv_cache_interleave_size)
    configs = _planned_configs(
        executor,
        vllm_config,
        specs,
        lambda available: get_kv_cache_configs(vllm_config, specs, available, global_groups),
    )
    for config in configs:
        config.kv_cache_layout = cache.kv_cache_layout
    scheduler_config = generate_scheduler_kv_cache_config(configs)
    cache.num_gpu_blocks = scheduler_config.num_blocks
    groups = scheduler_config.kv_cache_groups
    if groups:
        cacheable = [g.kv_cache_spec.block_size for g in groups if g.kv_cache_spec.prefix_cacheable]
        cache.block_size = min(cacheable or [g.kv_cache_spec.block_size for g in groups])
        if not extensible:  # an extensible cache's capacity is known after warm-up
            update_kv_cache_capacity(vllm_config, scheduler_config)
    vllm_config.validate_block_size()
    block_size, hash_block_size = resolve_kv_cache_block_sizes(scheduler_config, vllm_config)
    alignment = resolve_cache_hit_alignment_tokens(scheduler_config, vllm_config, block_size, hash_block_size)
    for config in (*configs, scheduler_config):
        config.hash_block_size = hash_block_size
        config.cache_hit_alignment_tokens = alignment
    executor.initialize_from_config(configs)
    compilation_times = executor.compile_or_warm_up_model()
    if extensible:
        from vllm.v1.core.kv_cache_planning import finalize_extensible_kv_cache

        planned_len = vllm_config.model_config.max_model_len
        num_blocks = finalize_extensible_kv_cache(vllm_config, configs, scheduler_config, compilation_times)
        if vllm_config.model_config.max_model_len != planned_len:
            executor.collective_rpc("update_max_model_len", args=(vllm_config.model_config.max_model_len,))
        executor.extend_kv_cache(num_blocks)
    return KvCacheSetup(scheduler_config, block_size, hash_block_size)


_SETUPS: dict[str, Callable[[Any, Any], KvCacheSetup]] = {
    "utils_initialize_cache_rpc": _utils_initialize_cache_rpc,
    "utils_registered_specs": _utils_registered_specs,
    "planning_global_groups": _planning_global_groups,
    "planning_extensible": _planning_extensible,
}


def set_up_kv_cache(facts: VllmFacts, executor: Any, vllm_config: Any) -> KvCacheSetup:
    return _SETUPS[facts.kv_cache_setup](executor, vllm_config)
