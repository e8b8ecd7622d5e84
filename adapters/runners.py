"""Reading a step's token layout inside a worker, for each model runner a vLLM line has."""

from __future__ import annotations

from typing import Any

from adapters.facts import VllmFacts


def step_token_order(facts: VllmFacts, model_runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
    """(request id, tokens) in the order the runner laid the step's tokens out."""
    if type(model_runner).__module__ == facts.model_runner_v2_module:
        # Model Runner V2 sorts the step's requests itself: its input batch says how.
        batch = model_runner.execute_model_state.input_batch
        return [(rid, int(n)) for rid, n in zip(batch.req_ids, batch.num_scheduled_tokens, strict=True)]
    # Model Runner V1 (GPU and CPU): the persistent input batch's order.
    counts = scheduler_output.num_scheduled_tokens
    return [(rid, counts[rid]) for rid in model_runner.input_batch.req_ids]
