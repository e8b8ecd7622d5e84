"""Submitting one scheduled step to the executor without waiting for it."""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class StepResult:
    """A submitted step: ``result()`` blocks until its model output is back."""

    def __init__(self, executed: Future, sampled: Future | None) -> None:
        self._executed = executed
        self._sampled = sampled

    def result(self) -> Any:
        # execute_model's error first: after it failed, sample_tokens finds no state and returns
        # None (0.16) or an output without the step's requests (0.26), which the scheduler's
        # update would fail on with a KeyError naming a sample instead of the worker's error.
        executed = self._executed.result()
        if self._sampled is None:
            return executed
        output = self._sampled.result()
        if output is None:
            raise RuntimeError("vLLM returned no model output for a step")
        return output


def submit_step(executor: Any, scheduler: Any, scheduler_output: Any) -> StepResult:
    """Two-phase execution (0.11.1+, every supported line): ``execute_model`` runs the
    forward (None on the generative path), ``sample_tokens`` samples; both queued with
    ``non_block=True`` as EngineCore's batch queue does, so the driver schedules the next
    step while this one runs. A step without tokens is executed too (it carries finished
    request ids to the workers) but has nothing to sample."""
    executed = executor.execute_model(scheduler_output, non_block=True)
    if scheduler_output.total_num_scheduled_tokens == 0:
        return StepResult(executed, None)
    grammar = scheduler.get_grammar_bitmask(scheduler_output)
    return StepResult(executed, executor.sample_tokens(grammar, non_block=True))
