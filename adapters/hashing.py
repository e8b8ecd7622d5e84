"""Block hasher, built the way EngineCore builds it.

A Request without a hasher never gets ``block_hashes``; with prefix caching on, vLLM
then fails or silently never caches (``VllmFacts.prefix_cache_without_hashes``). We run
with prefix caching off (a cached prefix would not be recomputed, so its hidden states
would be missing), but every Request still carries the engine's hasher so the KV
manager sees exactly what the engine would give it.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from adapters.facts import VllmFacts

_none_hash_lock = threading.Lock()
_none_hash_fns: set[Any] = set()


def _hash_fn(vllm_config: Any) -> Callable[[Any], bytes]:
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import init_none_hash

    fn = get_hash_fn_by_name(vllm_config.cache_config.prefix_caching_hash_algo)
    # init_none_hash resets a module-global seed: a second call would orphan the
    # parent-hash chains of blocks hashed before it. Once per process and function.
    with _none_hash_lock:
        if fn not in _none_hash_fns:
            init_none_hash(fn)
            _none_hash_fns.add(fn)
    return fn


def build_block_hasher(
    facts: VllmFacts, vllm_config: Any, hash_block_size: int
) -> Callable[[Any], list[Any]]:
    """``get_request_block_hasher(hash_block_size, fn[, num_hash_lookahead_tokens])``; the first
    argument is the scheduler block size before 0.24 and hash_block_size after (positional)."""
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher

    lookahead = (vllm_config.num_hash_lookahead_tokens,) if facts.block_hasher_lookahead else ()
    return get_request_block_hasher(hash_block_size, _hash_fn(vllm_config), *lookahead)
