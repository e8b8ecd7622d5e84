"""Extraction backends behind one interface.

A backend consumes token-id sequences and produces, per sample, hidden states
``[T, L, H]`` for the configured layer ids in the job's convention (id k =
residual stream after k decoder layers, N = last layer before the final
norm), possibly in several row chunks. The HF transformers backend is the
correctness oracle; the vLLM backend is the production path.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

if TYPE_CHECKING:
    from job.pipeline.setup import RunSetup


@dataclass(frozen=True, slots=True)
class BackendInput:
    sample_id: str  # unique per run; results refer to it, never to positions
    input_ids: np.ndarray  # int32 [T]
    # where the caller wants the rows (the job: a job.shards.writer.ShardSlot); opaque to the
    # backend, which hands it back on every HiddenChunk of this input
    destination: Any = None


@dataclass(frozen=True, slots=True)
class GenerationInput:
    """One turn to generate: the prompt's token ids and how to sample."""

    request_id: str  # unique per run; its Completion carries it back
    prompt_ids: np.ndarray  # int32 [T]
    max_new_tokens: int
    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: none
    seed: int
    stop_token_ids: tuple[int, ...]  # any of them ends the turn (and is part of it)


@dataclass(frozen=True, slots=True)
class Completion:
    request_id: str
    token_ids: list[int]  # as generated, a final stop token included
    finish_reason: str  # "stop" | "length"


@dataclass(slots=True)
class HiddenChunk:
    sample_id: str
    start: int  # first token row of ``rows`` within the sample
    rows: torch.Tensor  # [n, L, H] on the CPU, contiguous, in the stored dtype
    scales: torch.Tensor | None  # FP8: float32 [n, L]
    last: bool  # the sample is complete with this chunk
    nonfinite: bool  # NaN/Inf seen in these rows
    release: Callable[[], None] | None = None  # frees the backend's buffer once written
    destination: Any = None  # the BackendInput's, handed back


class Backend(ABC):
    name: str
    # Requests it takes before it needs the output of one: what keeps it busy.
    concurrent_requests: int = 1
    # Conversations worth having between their first turn and their last: as many as it generates
    # at once. More would wait in its queue, each turn behind every other conversation's, so all of
    # them would finish together at the end and none could be extracted while others generate.
    concurrent_generations: int = 1

    @property
    @abstractmethod
    def info(self) -> dict[str, Any]:
        """What produced the data (recorded in shards and the manifest)."""

    @abstractmethod
    def extract(
        self, inputs: Iterator[BackendInput | GenerationInput | None]
    ) -> Iterator[HiddenChunk | Completion]:
        """Hidden states for every BackendInput, in any order, chunk by chunk, and a Completion
        for every GenerationInput. An input of None means "nothing new right now": go on with
        pending work, then ask again."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free devices and worker processes."""


def generate_all(backend: Backend, requests: list[GenerationInput]) -> dict[str, Completion]:
    """Convenience for tests and comparisons: every request's completion, by request id."""
    done = {}
    for item in backend.extract(iter(requests)):
        assert isinstance(item, Completion)
        done[item.request_id] = item
    return done


def create_backend(setup: RunSetup) -> Backend:
    """The backend ``backend.name`` names, for this run's model, layers and stored dtype."""
    backend = setup.settings.backend
    if backend.name == "hf":
        from job.backends.hf import HFBackend

        return HFBackend.load(setup.model, setup.layer_ids, backend.device, setup.dtype)
    from job.backends.vllm import VllmBackend
    from job.backends.vllm_engine import EngineSpec

    spec = EngineSpec.of(setup.settings, generating=setup.generates)
    return VllmBackend(spec, setup.model, setup.layer_ids, setup.dtype)


def extract_all(backend: Backend, sequences: list[np.ndarray]) -> list[torch.Tensor]:
    """Convenience for tests and comparisons: full ``[T, L, H]`` per sequence."""
    out: list[list[HiddenChunk]] = [[] for _ in sequences]
    inputs = (BackendInput(str(i), np.asarray(s, np.int32)) for i, s in enumerate(sequences))
    for chunk in backend.extract(inputs):
        assert isinstance(chunk, HiddenChunk)
        out[int(chunk.sample_id)].append(
            HiddenChunk(
                chunk.sample_id, chunk.start, chunk.rows.clone(), chunk.scales, chunk.last, chunk.nonfinite
            )
        )
        if chunk.release is not None:
            chunk.release()
    return [torch.cat([c.rows for c in sorted(chunks, key=lambda c: c.start)]) for chunks in out]
