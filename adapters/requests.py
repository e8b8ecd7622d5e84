"""Request construction: a prefill-only v1 Request (one sampled token, then done)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def prefill_sampling_params() -> Any:
    from vllm import SamplingParams

    # One greedy token: the request finishes right after its prompt is prefilled.
    return SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)


def _request(request_id: str, prompt_token_ids: list[int], sampling_params: Any, **extra: Any) -> Any:
    from vllm.v1.request import Request

    return Request(
        request_id=request_id,
        prompt_token_ids=prompt_token_ids,
        sampling_params=sampling_params,
        pooling_params=None,
        **extra,
    )


def with_eos_token_id(
    request_id: str, prompt_token_ids: list[int], sampling_params: Any, block_hasher: Callable[..., Any]
) -> Any:
    """vLLM <= 0.16: ``eos_token_id`` is the 5th positional parameter; pass it by name."""
    return _request(
        request_id, prompt_token_ids, sampling_params, eos_token_id=None, block_hasher=block_hasher
    )


def without_eos_token_id(
    request_id: str, prompt_token_ids: list[int], sampling_params: Any, block_hasher: Callable[..., Any]
) -> Any:
    """vLLM >= 0.17: ``eos_token_id`` is gone from Request (stop checks read sampling_params)."""
    return _request(request_id, prompt_token_ids, sampling_params, block_hasher=block_hasher)
