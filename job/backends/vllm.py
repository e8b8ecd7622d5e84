"""The production backend: vLLM's v1 internals driven for prefill only.

``job.backends.vllm_engine`` builds the engine (executor, KV cache, Scheduler, block hasher,
capture); this module feeds it hand-built Requests (one sampled token each, prefix caching off,
chunked prefill on), keeping two steps in flight like EngineCore's batch queue, with one call's
loop state in ``_Loop``. Everything that differs between vLLM releases goes through the adapter
set chosen for the installed version. Hidden states arrive through a shared-memory ring from the
TP rank-0 worker; ``job.backends.vllm_rows.RowReader`` matches rows to samples by request id and
checks them against the step's own input ids and positions before they are handed on.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import signal
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from adapters.requests import generation_sampling_params, prefill_sampling_params
from job.backend_io import (
    AbandonGenerations,
    Backend,
    BackendInput,
    Completion,
    GenerationInput,
    HiddenChunk,
)
from job.backends.vllm_engine import (
    REQUESTS,
    SCHEDULER_UPDATE,
    STEP,
    Engine,
    EngineMemory,
    EngineSpec,
    build_engine,
)
from job.backends.vllm_rows import RowReader
from job.hidden_dtype import HiddenDtype
from job.logs import get_logger
from job.model import ModelInfo
from job.worker.ring import GENERATION_PREFIX, captured_step

_EXHAUSTED = object()
STEPS_IN_FLIGHT = 2


@dataclass
class _Loop:
    """One ``extract()`` call's state."""

    source: Iterator[BackendInput | GenerationInput | AbandonGenerations | None]
    full_step_tokens: int  # the scheduler's step size when the call began (restored at its end)
    exhausted: bool = False  # the source has nothing more
    unscheduled: int = 0  # prompt tokens added but not yet scheduled
    final_steps: bool = False  # steps shrunk to final_step_tokens
    # Steps submitted and not yet updated, oldest first: with two in flight the
    # workers run step k while the driver schedules step k+1 (EngineCore's batch
    # queue). A scheduler output with no tokens is submitted too (it carries the
    # finished request ids to the workers) but never twice in a row.
    in_flight: deque[tuple[Any, Any]] = field(default_factory=deque)

    @property
    def last_was_empty(self) -> bool:
        return bool(self.in_flight) and self.in_flight[-1][0].total_num_scheduled_tokens == 0


class VllmBackend(Backend):
    name = "vllm"

    def __init__(self, spec: EngineSpec, model: ModelInfo, layer_ids: list[int], dtype: HiddenDtype) -> None:
        self.log = get_logger(component="vllm_backend")
        self.engine: Engine = build_engine(spec, model, layer_ids, dtype, self.log)
        engine = self.engine
        self.adapters, self.vllm_version = engine.adapters, engine.vllm_version
        self.vllm_config = engine.vllm_config
        self.executor, self.ring, self.scheduler = engine.executor, engine.ring, engine.scheduler
        scheduler_config = self.vllm_config.scheduler_config
        self.max_num_seqs = scheduler_config.max_num_seqs
        self.concurrent_requests = 2 * self.max_num_seqs  # extract() keeps this many admitted
        self.concurrent_generations = self.max_num_seqs  # conversations under way: one decode batch
        self.token_budget = scheduler_config.max_num_batched_tokens
        # Without chunked prefill a step holds whole prompts: capping it below the longest would stall.
        self.final_step_tokens = (
            spec.options.final_step_budget if scheduler_config.enable_chunked_prefill else None
        )
        on_cpu = self.vllm_config.device_config.device_type == "cpu"
        self.sampling_params = prefill_sampling_params(
            seeded=on_cpu and self.adapters.facts.cpu_sampler_seeds_whole_batches_only and spec.generating
        )
        self.async_scheduling = bool(scheduler_config.async_scheduling)
        self._generating: dict[str, tuple[str, list[int]]] = {}  # request id -> (caller's id, tokens)
        self.rows = RowReader(self.ring, self._check_executor)
        # Steps run over the backend's lifetime (the ring's counters run across extract() calls),
        # and steps whose scheduler update went through (the first is the end of start-up).
        self._executed = self._updated = 0
        # Shape of the work done, for logs and tests: whether a step was submitted while the
        # previous one still ran, generation, and the final steps (backend.vllm.final_step_tokens:
        # how many ran at that size, and the most tokens one had); the row reader adds its own.
        self.stats = {
            "max_steps_in_flight": 0,
            "generation_requests": 0,
            "generated_tokens": 0,
            "generations_abandoned": 0,
            "final_steps": 0,
            "largest_final_step": 0,
        }
        self.log.info(
            "vllm_ready",
            kv_blocks=engine.kv_blocks,
            block_size=engine.block_size,
            max_num_batched_tokens=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            final_step_tokens=self.final_step_tokens,
        )

    @property
    def capture_info(self) -> dict[str, Any]:
        return self.engine.capture_info

    @property
    def memory(self) -> EngineMemory:
        """One rank's weights (whole model and per decoder layer) and KV cache, as built."""
        return EngineMemory(
            device=self.vllm_config.device_config.device_type,
            weight_bytes=int(self.capture_info["weight_bytes"]),
            layer_weight_bytes=[int(b) for b in self.capture_info["layer_weight_bytes"]],
            kv_cache_bytes=self.engine.kv_cache_bytes,
            kv_tokens=self.engine.kv_blocks * self.engine.block_size,
            max_model_len=self.vllm_config.model_config.max_model_len,
        )

    @property
    def info(self) -> dict[str, Any]:
        return {
            "backend": "vllm",
            "vllm_version": self.vllm_version,
            "adapter_set": self.adapters.name,
            "tensor_parallel_size": self.vllm_config.parallel_config.tensor_parallel_size,
            "model_runner": self.capture_info.get("model_runner"),
            "capture": self.capture_info.get("mode"),
            "layer_sources": self.capture_info.get("layer_sources"),
            "cudagraph_capture_sizes": self._cudagraph_capture_sizes(),
        }

    def _cudagraph_capture_sizes(self) -> list[int] | None:
        """The batch sizes whose CUDA graphs the engine captured; None without CUDA graphs
        (eager mode, a CPU build)."""
        compilation = self.vllm_config.compilation_config
        mode = getattr(compilation.cudagraph_mode, "name", "NONE")
        return None if mode == "NONE" else list(compilation.cudagraph_capture_sizes or [])

    def extract(
        self, inputs: Iterator[BackendInput | GenerationInput | AbandonGenerations | None]
    ) -> Iterator[HiddenChunk | Completion]:
        try:
            yield from self._steps(inputs)
        except Exception:
            # A capture hook or the step layout inside the worker that does not fit this vLLM said
            # so through the ring before the worker's forward failed: name that. A dead worker
            # surfaces as whichever vLLM call comes next: a step's result ("cancelled"), the next
            # step's submission ("Executor failed."), an RPC. Name the death instead.
            self._check_worker_mismatch()
            self._check_executor()
            raise

    def _steps(
        self, inputs: Iterator[BackendInput | GenerationInput | AbandonGenerations | None]
    ) -> Iterator[HiddenChunk | Completion]:
        loop = _Loop(iter(inputs), full_step_tokens=self.scheduler.max_num_scheduled_tokens)
        rows = self.rows
        while True:
            self._admit_from(loop)
            if (
                not loop.final_steps
                and self.final_step_tokens
                and loop.exhausted
                and not self._generating
                and loop.unscheduled <= self.token_budget
            ):
                # The rows of the last step are written after the GPU is done: make it a small one.
                loop.final_steps = True
                self.set_step_tokens(min(loop.full_step_tokens, self.final_step_tokens))
            if (
                self.scheduler.get_num_unfinished_requests()
                and len(loop.in_flight) < self._steps_in_flight()
                and not loop.last_was_empty
            ):
                # The worker takes slot `executed % slots`; make sure the driver let go of it.
                yield from rows.drain(lambda: self._executed - self.ring.released < self.ring.slot_count)
                scheduled = self._submit(loop)
                if len(loop.in_flight) < self._steps_in_flight() and scheduled:
                    continue
            if not loop.in_flight:
                if loop.exhausted:
                    break
                continue
            yield from self._update(loop)
            yield from rows.take()
        yield from rows.drain(lambda: rows.taken >= self._executed)
        self.set_step_tokens(loop.full_step_tokens)  # the next extract() starts where this one did
        if rows.pending or self._generating:
            raise RuntimeError(
                f"{len(rows.pending) + len(self._generating)} requests finished without their output"
            )
        self.log.info("vllm_extract_finished", steps=self._executed, **self.stats, **rows.stats)

    def _admit_from(self, loop: _Loop) -> None:
        """Take inputs while there is room: requests admitted, prompt tokens waiting."""
        while (
            not loop.exhausted
            and len(self.rows.pending) + len(self._generating) < self.concurrent_requests
            and loop.unscheduled < 2 * self.token_budget
        ):
            item = next(loop.source, _EXHAUSTED)
            if item is _EXHAUSTED:
                loop.exhausted = True
                return
            if item is None:  # nothing new right now (e.g. staging full): run what is pending
                return
            if isinstance(item, AbandonGenerations):
                self._abandon_generations()
                continue
            loop.unscheduled += self._admit(item)

    def _abandon_generations(self) -> None:
        """End every generation in flight as vLLM aborts a request (a step in flight may still
        hold one: its output for a request no longer known is dropped by the scheduler)."""
        from vllm.v1.request import RequestStatus

        if not self._generating:
            return
        self.scheduler.finish_requests(list(self._generating), RequestStatus.FINISHED_ABORTED)
        self.log.info(
            "generations_abandoned",
            requests=len(self._generating),
            generated_tokens=sum(len(tokens) for _, tokens in self._generating.values()),
        )
        self.stats["generations_abandoned"] += len(self._generating)
        self._generating.clear()

    def _submit(self, loop: _Loop) -> int:
        """Schedule one step and queue it on the workers; returns its tokens."""
        scheduler_output = self.scheduler.schedule()
        scheduled = scheduler_output.total_num_scheduled_tokens
        if scheduled == 0 and not loop.in_flight:
            raise RuntimeError(
                f"vLLM scheduled nothing with {len(self.rows.pending)} requests waiting; the KV cache is too "
                "small for the longest sample: raise gpu_memory_utilization or lower data.max_length"
            )
        with self._startup_concern(STEP):
            step = self.adapters.submit_step(self.executor, self.scheduler, scheduler_output)
        loop.in_flight.append((scheduler_output, step))
        self.stats["max_steps_in_flight"] = max(self.stats["max_steps_in_flight"], len(loop.in_flight))
        if loop.final_steps and scheduled:
            self.stats["final_steps"] += 1
            self.stats["largest_final_step"] = max(self.stats["largest_final_step"], scheduled)
        self._executed += captured_step(scheduler_output.num_scheduled_tokens)
        loop.unscheduled = max(0, loop.unscheduled - scheduled)
        return scheduled

    def _update(self, loop: _Loop) -> Iterator[Completion]:
        """Wait for the oldest step in flight and hand its output to the scheduler."""
        scheduler_output, step = loop.in_flight.popleft()
        output = step.result()
        if output is None:
            # What a step that skipped sample_tokens gives on the generative path: it is the adapter
            # set's step submission that does not fit (a failed execute_model raised above instead).
            with self._startup_concern(STEP):
                raise TypeError("the step returned no model output (execute_model without sample_tokens?)")
        with self._startup_concern(SCHEDULER_UPDATE):
            outputs = self.scheduler.update_from_output(scheduler_output, output)
        self._updated += 1
        yield from self._completions(outputs)

    def _startup_concern(self, name: str) -> Any:
        """Up to the first step's scheduler update, the step path is still start-up: an error
        saying the adapter set does not fit is an AdapterMismatch. After that the same error is a
        failure of this run (exit 1)."""
        if self._updated:
            return contextlib.nullcontext()
        return self.engine.concern(name)

    def _steps_in_flight(self) -> int:
        # vLLM's synchronous scheduler (CPU) has nothing to schedule for a decoding request whose
        # last token it has not seen: a second step in flight would halve decoding.
        return 1 if self._generating and not self.async_scheduling else STEPS_IN_FLIGHT

    def _admit(self, item: BackendInput | GenerationInput) -> int:
        """Add one request to the scheduler; returns its prompt tokens."""
        if isinstance(item, BackendInput):
            request_id, prompt, params = item.sample_id, item.input_ids, self.sampling_params
            self.rows.expect(item.sample_id, item.input_ids, item.destination)
        else:
            request_id, prompt = GENERATION_PREFIX + item.request_id, item.prompt_ids
            params = generation_sampling_params(item)
            self._generating[request_id] = (item.request_id, [])
            self.stats["generation_requests"] += 1
        with self.engine.concern(REQUESTS):
            request = self.adapters.request(request_id, prompt.tolist(), params, self.engine.block_hasher)
            # What the block hasher is for: every full block of the prompt hashed, as EngineCore's
            # requests are (without it, prefix caching and KV connectors break, or never cache).
            blocks = len(prompt) // self.engine.hash_block_size
            if len(request.block_hashes) < blocks:
                raise AssertionError(
                    f"request {item.sample_id if isinstance(item, BackendInput) else item.request_id} "
                    f"carries {len(request.block_hashes)} block hashes for {blocks} full blocks"
                )
        self.scheduler.add_request(request)
        return len(prompt)

    def _completions(self, outputs: dict[int, Any]) -> Iterator[Completion]:
        """The generation requests' new tokens, from the scheduler's update; a Completion each
        time one finishes (extraction requests' sampled tokens are of no interest)."""
        for engine_outputs in outputs.values():
            for output in engine_outputs.outputs:
                state = self._generating.get(output.request_id)
                if state is None:
                    continue
                state[1].extend(output.new_token_ids)
                if output.finish_reason is not None:
                    del self._generating[output.request_id]
                    reason = str(output.finish_reason)
                    if reason not in ("stop", "length"):
                        raise RuntimeError(f"vLLM ended generation request {state[0]} with {reason!r}")
                    self.stats["generated_tokens"] += len(state[1])
                    yield Completion(state[0], state[1], reason)

    def _check_worker_mismatch(self) -> None:
        """A worker-side concern (capture hook or tap, step layout) that reported through the ring."""
        if (mismatch := self.engine.worker_mismatch()) is not None:
            raise mismatch

    def _check_executor(self) -> None:
        """vLLM's multiprocessing executor watches its worker processes and marks itself failed
        when one dies (the kernel's OOM killer, a crash in a kernel): without this check the driver
        would wait on the ring for rows that never come."""
        if self.engine.executor_failed:
            processes = [w.proc for w in getattr(self.executor, "workers", None) or []]
            # vLLM marks the executor failed when a worker's sentinel fires, which can be a moment
            # before the dead process is reaped: wait for the exit status of those that ended, and
            # name only them (at TP=8 the others are alive, or stopped by vLLM's shutdown).
            ended = set(multiprocessing.connection.wait([p.sentinel for p in processes], timeout=0))
            exits = []
            for process in processes:
                if process.sentinel in ended:
                    process.join(timeout=5)
                    exits.append(f"{process.name} {_exit_status(process.exitcode)}")
            which = f" ({', '.join(exits)})" if exits else ""
            raise RuntimeError(f"a vLLM worker process died, and vLLM shut its executor down{which}")

    @property
    def steps(self) -> int:
        """Steps run that captured rows, over the backend's lifetime."""
        return self._executed

    def set_step_tokens(self, tokens: int) -> None:
        """The most tokens the scheduler puts in one step from now on, up to the token budget the
        engine and the ring were sized for (``bench --step-budgets`` measures what a step's size
        does to tokens per second with it)."""
        if not 0 < tokens <= self.token_budget:
            raise ValueError(f"step tokens {tokens} outside 1..{self.token_budget} (max_num_batched_tokens)")
        self.scheduler.max_num_scheduled_tokens = tokens

    def close(self) -> None:
        self.engine.close()


def _exit_status(code: int | None) -> str:
    if code is None:
        return "(no exit status yet)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"
