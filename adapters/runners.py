"""Reading a step's token layout inside a worker, for each model runner a vLLM line has."""

from __future__ import annotations

from typing import Any

from adapters.facts import VllmFacts


def _is_v2(facts: VllmFacts, model_runner: Any) -> bool:
    """V2's GPUModelRunner or a runner built on it (0.34's CPUModelRunner subclasses it)."""
    return any(cls.__module__ == facts.model_runner_v2_module for cls in type(model_runner).__mro__)


def step_token_order(facts: VllmFacts, model_runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
    """(request id, tokens) in the order the runner laid the step's tokens out."""
    if _is_v2(facts, model_runner):
        # Model Runner V2 sorts the step's requests itself: its input batch says how.
        batch = model_runner.execute_model_state.input_batch
        return [(rid, int(n)) for rid, n in zip(batch.req_ids, batch.num_scheduled_tokens, strict=True)]
    # Model Runner V1 (GPU and CPU): the persistent input batch's order.
    counts = scheduler_output.num_scheduled_tokens
    return [(rid, counts[rid]) for rid in model_runner.input_batch.req_ids]


def step_inputs(facts: VllmFacts, model_runner: Any) -> tuple[Any, Any]:
    """The last step's input ids and positions, from the runner's persistent device buffers
    (read after the forward: with a FULL CUDA graph no Python forward sees them)."""
    if _is_v2(facts, model_runner):
        batch = model_runner.execute_model_state.input_batch
        return batch.input_ids, batch.positions
    positions = model_runner.positions
    return model_runner.input_ids.gpu, positions.gpu if facts.runner_positions_buffer else positions
