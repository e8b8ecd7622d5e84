"""Running one scheduled step on the executor."""

from __future__ import annotations

from typing import Any


def two_phase(executor: Any, scheduler: Any, scheduler_output: Any) -> Any:
    """0.11.1+: ``execute_model`` runs the forward and returns None on the
    generative path; ``sample_tokens`` then samples and returns the output."""
    output = executor.execute_model(scheduler_output)
    if output is None:
        output = executor.sample_tokens(scheduler.get_grammar_bitmask(scheduler_output))
    return output
