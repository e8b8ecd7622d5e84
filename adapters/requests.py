"""Request construction: a v1 Request built the way EngineCore builds one."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from adapters.facts import VllmFacts


def prefill_sampling_params() -> Any:
    from vllm import SamplingParams

    # One greedy token: the request finishes right after its prompt is prefilled.
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)


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
