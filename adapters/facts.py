"""What differs between vLLM lines, as typed facts read from ``config/adapters.yaml``.

Each fact names a behaviour, never a version; the adapter code asks facts (like a
SQLAlchemy dialect's capability flags), so a vLLM release whose internals behave like an
existing set's is one YAML entry.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class VllmFacts(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    # Request(eos_token_id=...): the 5th positional parameter until 0.16, removed in 0.17
    # (stop checks read sampling_params.eos_token_id from then on).
    request_eos_token_id: bool
    # Scheduler(hash_block_size=...) beside block_size (0.20+: they differ for hybrid models).
    scheduler_hash_block_size: bool
    # get_request_block_hasher's third argument, num_hash_lookahead_tokens (0.33+).
    block_hasher_lookahead: bool
    # How the KV cache is planned and allocated (adapters/kv_cache.py has one function each):
    #   utils_initialize_cache_rpc  kv_cache_utils.get_kv_cache_configs, then the workers'
    #                               initialize_cache RPC; initialize_from_config warms up
    #   utils_registered_specs      specs registered first, cache block size from the groups,
    #                               resolve_kv_cache_block_sizes; initialize_from_config warms up
    #   planning_global_groups      kv_cache_planning with global groups, KV layout negotiated
    #                               with the workers, warm-up a separate call
    #   planning_extensible         as planning_global_groups, and the extensible KV cache (CUDA's
    #                               default from 0.34): reserved before warm-up, sized after it
    kv_cache_setup: Literal[
        "utils_initialize_cache_rpc",
        "utils_registered_specs",
        "planning_global_groups",
        "planning_extensible",
    ]
    # What prefix caching does with a Request that carries no block hasher (the failure the
    # block hasher exists for): block_pool's assertion, an IndexError, or never caching.
    prefix_cache_without_hashes: Literal["assertion_error", "index_error", "never_cached"]
    # Model Runner V1 (vllm/v1/worker/gpu_model_runner.py) exists; 0.34 removed it, and vLLM then
    # refuses VLLM_USE_V2_MODEL_RUNNER=0 (generating runs ask for V1 only where it exists).
    model_runner_v1: bool
    # The module of Model Runner V2's GPUModelRunner, whose input batch orders a step's
    # requests itself (Model Runner V1 keeps the persistent batch's order).
    model_runner_v2_module: str
    # Model Runner V1's positions buffer is a CpuGpuBuffer (.gpu) rather than a plain tensor
    # (false where there is no V1).
    runner_positions_buffer: bool
    # EagleModelMixin (0.18+): the model's aux hidden states cover every id in [0, N] in the
    # job's numbering; before it (and for models with their own loop) only [1, N-1].
    eagle_model_mixin: bool
    # Capture under compilation and CUDA graphs (aux outputs + taps) has been verified on this
    # line; where not, backend.vllm.enforce_eager must be true.
    compiled_capture: bool
    # The CPU sampler uses per-request seeds only when every request of the batch has one (else
    # one unseeded draw for all); 0.33 draws per request, and 0.34's CPU runner (built on Model
    # Runner V2) keeps a seed per request. GPU samplers always honour them.
    cpu_sampler_seeds_whole_batches_only: bool
