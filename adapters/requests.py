"""Request construction: a v1 Request built the way EngineCore builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.facts import VllmFacts


def prefill_sampling_params(seeded: bool = False) -> Any:
    """One token (never used): the request finishes right after its prompt is prefilled. Greedy,
    or ``seeded`` where a sampler honours per-request seeds only in batches of seeded requests
    (VllmFacts.cpu_sampler_seeds_whole_batches_only) and generation requests share the batch."""
    from vllm import SamplingParams

    if seeded:
        return SamplingParams(max_tokens=1, temperature=1.0, seed=0, ignore_eos=True, detokenize=False)
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)


def generation_sampling_params(item: Any) -> Any:
    """One turn's sampling (a job.backend_io.GenerationInput): its stop tokens end it and are part
    of its output; no text is produced (token ids only)."""
    from vllm import SamplingParams

    return SamplingParams(
        max_tokens=item.max_new_tokens,
        temperature=item.temperature,
        top_p=item.top_p,
        top_k=item.top_k,  # 0: all tokens
        seed=item.seed if item.temperature > 0 else None,
        stop_token_ids=list(item.stop_token_ids),
        detokenize=False,
    )


def build_request(
    facts: VllmFacts,
    request_id: str,
    prompt_token_ids: list[int],
    sampling_params: Any,
    block_hasher: Callable[..., Any] | None,
) -> Any:
    """Everything after ``pooling_params`` by keyword: the only positional prefix every
    supported version shares is (request_id, prompt_token_ids, sampling_params, pooling_params)."""
    from vllm.v1.request import Request

    extra: dict[str, Any] = {"eos_token_id": None} if facts.request_eos_token_id else {}
    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        block_hasher=block_hasher,
        **extra,
    )
