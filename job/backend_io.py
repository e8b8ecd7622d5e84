"""What a backend takes and gives, below both the backends and the run's stages that use them.

A backend consumes token-id sequences and produces, per sample, hidden states ``[T, L, H]`` for
the configured layer ids in the job's convention (id k = residual stream after k decoder layers,
N = last layer before the final norm), possibly in several row chunks; with regeneration it also
generates turns. The requests (``BackendInput``, ``GenerationInput``), the answers
(``HiddenChunk``, ``Completion``) and the ``Backend`` interface live here so that generation
(``job.generate``), the feed, the shard writer and the committer share them without importing a
backend; ``job.backends`` holds the backends themselves and picks one for a run.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


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
class AbandonGenerations:
    """The feed's last input after a stop signal: no turn generated from here on can be written
    (the conversations under way are redone by a later run), so every generation in flight ends
    now, without its Completion, instead of running to its end (minutes of a long answer)."""


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
        self, inputs: Iterator[BackendInput | GenerationInput | AbandonGenerations | None]
    ) -> Iterator[HiddenChunk | Completion]:
        """Hidden states for every BackendInput, in any order, chunk by chunk, and a Completion
        for every GenerationInput not abandoned. An input of None means "nothing new right now":
        go on with pending work, then ask again; AbandonGenerations: end every generation in
        flight (the BackendInputs in flight still get their rows)."""

    def close(self) -> None:  # noqa: B027 - optional hook
        """Free devices and worker processes."""
