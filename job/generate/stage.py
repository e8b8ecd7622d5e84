"""The regeneration stage between the tokenizer stream and the shard planner.

Conversations come in as GenerationStarts; each turn goes to the backend as a GenerationInput
(the same engine that then extracts); its Completion comes back through the run's extract loop; the
next turn's prompt is built (job.generate.turns) until the conversation is done, and the
finished sample waits for the planner. What it generated is kept per sample until the shard
holding it is committed (the sidecar, job.pipeline.commit).
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from job.backend_io import Completion, GenerationInput
from job.data.encode import EncodedSample, GenerationStart, RejectedSample, SampleEncoder
from job.data.formats import SampleRejected
from job.generate.sampling import Sampling
from job.generate.turns import Regeneration, TurnAssembler
from job.manifest import GenerationCounts


def generation_counts(records: list[dict[str, Any]]) -> GenerationCounts:
    """What these sidecar lines hold (recorded per shard in the manifest)."""
    counts = GenerationCounts(conversations=len(records))
    for record in records:
        for turn in record["turns"]:
            counts.turns += 1
            counts.generated_tokens += turn["generated_tokens"]
            counts.cut_by_length += turn["finish_reason"] == "length"
        counts.turns_not_generated += record["turns_not_generated"]
    return counts


@dataclass
class Regenerator:
    encoder: SampleEncoder  # this process's own: it renders the template between turns
    sampling: Sampling
    mode: str
    max_length: int
    reasoning_in_loss: bool
    on_length: str
    max_active: int  # conversations between their first turn and their last at once
    ready: deque[GenerationInput] = field(default_factory=deque)  # turns to hand to the backend
    finished: deque[EncodedSample | RejectedSample] = field(default_factory=deque)
    records: dict[str, dict[str, Any]] = field(default_factory=dict)  # sample id -> sidecar line
    generated_tokens: int = 0
    _active: dict[str, Regeneration] = field(default_factory=dict)  # request id -> conversation
    _records_lock: threading.Lock = field(default_factory=threading.Lock)  # committer threads take them

    def __post_init__(self) -> None:
        self._turns = TurnAssembler(self.encoder, self.sampling, self.max_length, self.reasoning_in_loss)

    @property
    def active(self) -> int:
        return len(self._active)

    @property
    def has_room(self) -> bool:
        return len(self._active) < self.max_active

    def start(self, start: GenerationStart) -> None:
        """Queue a conversation's first turn."""
        regeneration = Regeneration(start, self.mode)
        self._queue(regeneration)

    def complete(self, completion: Completion) -> None:
        """Take a generated turn: queue the next, or finish the sample."""
        regeneration = self._active.pop(completion.request_id)
        self.generated_tokens += len(completion.token_ids)
        sample_id = regeneration.start.sample_id
        seed = self.sampling.request_seed(sample_id, len(regeneration.turns))
        try:
            self._turns.add_turn(regeneration, completion.token_ids, completion.finish_reason, seed)
        except SampleRejected as exc:
            self.finished.append(RejectedSample(sample_id, str(exc)))
            return
        if not regeneration.done:
            self._queue(regeneration)
            return
        self._finish(regeneration)

    def _finish(self, regeneration: Regeneration) -> None:
        """The sample, and its sidecar line to keep until its shard is committed."""
        sample = self._turns.finish(regeneration, self.on_length)
        if isinstance(sample, EncodedSample):
            record = self._turns.record(regeneration)
            with self._records_lock:
                self.records[regeneration.start.sample_id] = record
        self.finished.append(sample)

    def _queue(self, regeneration: Regeneration) -> None:
        sample_id, turn = regeneration.start.sample_id, len(regeneration.turns)
        budget = self._turns.budget(regeneration)
        if budget <= 0:
            # The turns so far fill data.max_length. data.too_long decides, as for a conversation
            # kept as it is: truncate keeps what was generated (the sample is cut there, counted
            # as truncated, the turns left ungenerated); skip rejects it.
            if self.encoder.spec.too_long == "skip":
                self.finished.append(
                    RejectedSample(
                        sample_id,
                        f"no room to generate turn {turn + 1}: the conversation already fills "
                        f"data.max_length {self.max_length} (data.too_long: skip)",
                    )
                )
            else:
                self._finish(regeneration)
            return
        request_id = f"{sample_id}#{turn}"
        self._active[request_id] = regeneration
        sampling = self.sampling
        self.ready.append(
            GenerationInput(
                request_id=request_id,
                prompt_ids=np.asarray(regeneration.ids, np.int32),
                max_new_tokens=budget,
                temperature=sampling.temperature,
                top_p=sampling.top_p,
                top_k=sampling.top_k,
                seed=sampling.request_seed(sample_id, turn),
                stop_token_ids=sampling.eos_token_ids,
            )
        )

    def take_records(self, sample_ids: list[str]) -> list[dict[str, Any]]:
        """The sidecar lines of these samples (a shard's), no longer held here."""
        with self._records_lock:
            return [self.records.pop(s) for s in sample_ids if s in self.records]
