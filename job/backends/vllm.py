"""The production backend: vLLM's v1 internals driven for prefill only.

The driver builds the executor, KV cache and Scheduler itself and feeds it
hand-built Requests (one sampled token each, prefix caching off, chunked
prefill on), keeping two steps in flight like EngineCore's batch queue.
Everything that differs between vLLM releases goes through the adapter set
chosen for the installed version.
Hidden states arrive through a shared-memory ring from the TP rank-0 worker;
rows are matched to samples by request id and checked against the step's own
input ids and positions before they are handed on.
"""

from __future__ import annotations

import multiprocessing.connection
import os
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from adapters import select_adapter_set
from adapters.requests import generation_sampling_params, prefill_sampling_params
from job.backends import Backend, BackendInput, Completion, GenerationInput, HiddenChunk
from job.data.source import MAX_ID_BYTES
from job.errors import ConfigError
from job.hidden_dtype import HiddenDtype
from job.logs import get_logger
from job.model import ModelInfo
from job.settings import JobSettings
from job.worker.capture import COMPILED, HOOKS
from job.worker.ring import GENERATION_ID_EXTRA_BYTES, GENERATION_PREFIX, Ring, captured_step, header_bytes

_EXHAUSTED = object()
STEPS_IN_FLIGHT = 2


@dataclass
class _Pending:
    input_ids: np.ndarray
    destination: Any
    received: int = 0


class _Releases:
    """Slot refcounts; advances the ring's ``released`` word in step order."""

    def __init__(self, ring: Ring) -> None:
        self._ring = ring
        self._lock = threading.Lock()
        self._remaining: dict[int, int] = {}
        self._next = 0

    def hold(self, step: int, count: int) -> None:
        with self._lock:
            self._remaining[step] = count
            self._advance()

    def release(self, step: int) -> None:
        with self._lock:
            self._remaining[step] -= 1
            self._advance()

    def _advance(self) -> None:
        while self._remaining.get(self._next) == 0:
            del self._remaining[self._next]
            self._next += 1
        self._ring.set_released(self._next)


class VllmBackend(Backend):
    name = "vllm"

    def __init__(
        self, settings: JobSettings, model: ModelInfo, layer_ids: list[int], dtype: HiddenDtype
    ) -> None:
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
        import vllm

        self.log = get_logger(component="vllm_backend")
        options = settings.backend.vllm
        self.vllm_version = vllm.__version__
        self.adapters = select_adapter_set(
            self.vllm_version, options.adapter_set, options.allow_nearest_adapter
        )
        self.log.info("adapter_selected", vllm_version=self.vllm_version, adapter_set=self.adapters.name)
        mode = HOOKS if options.enforce_eager else COMPILED
        if mode == COMPILED and not self.adapters.facts.compiled_capture:
            raise ConfigError(
                f"backend.vllm.enforce_eager is false, but capture under compilation has not been verified "
                f"on vLLM {self.vllm_version} (adapter set {self.adapters.name}); set "
                "backend.vllm.enforce_eager: true (eager mode, forward hooks)"
            )
        engine_kwargs: dict[str, Any] = {
            "model": str(model.path),
            "tokenizer": str(model.path),
            "dtype": model.dtype,
            "trust_remote_code": settings.model.trust_remote_code,
            "seed": 0,
            "tensor_parallel_size": settings.backend.tensor_parallel_size,
            "max_num_batched_tokens": options.max_num_batched_tokens,
            "max_num_seqs": options.max_num_seqs,
            "gpu_memory_utilization": options.gpu_memory_utilization,
            # A prompt of data.max_length tokens plus the one token sampled after it (check_backend
            # made sure that fits the model's positions).
            "max_model_len": options.max_model_len or settings.data.max_length + 1,
            "attention_backend": options.attention_backend,
            # Model runner in its own process even at TP=1: its Python (kernel
            # launches in eager mode) then never waits on the driver's GIL, which
            # the writer and committer threads share.
            "distributed_executor_backend": "mp",
            "enforce_eager": options.enforce_eager,
            **options.engine_args,
        }
        generating = settings.generate.mode != "keep"
        vllm_config = self.adapters.engine_config(
            engine_kwargs, {"mode": mode, "layer_ids": layer_ids}, generating
        )
        if generating and not vllm_config.scheduler_config.enable_chunked_prefill:
            self.log.info(
                "whole_prompts_per_step",
                reason="seeded generation on a CPU build of vLLM, whose generators cannot rewind "
                "after a partial prefill",
                max_num_batched_tokens=vllm_config.scheduler_config.max_num_batched_tokens,
            )
        self.vllm_config = vllm_config
        self.max_num_seqs = vllm_config.scheduler_config.max_num_seqs
        self.concurrent_requests = 2 * self.max_num_seqs  # extract() keeps this many admitted
        self.token_budget = vllm_config.scheduler_config.max_num_batched_tokens
        # Without chunked prefill a step holds whole prompts: capping it below the longest would stall.
        chunked = vllm_config.scheduler_config.enable_chunked_prefill
        self.final_step_tokens = options.final_step_budget if chunked else None
        self.executor = self.adapters.start_executor(vllm_config)
        self.ring = Ring.create(
            None,
            slots=options.capture_slots,
            max_tokens=self.token_budget,
            num_layers=len(layer_ids),
            hidden_size=model.hidden_size,
            dtype_name=dtype.name,
            header_bytes=header_bytes(self.max_num_seqs, MAX_ID_BYTES + GENERATION_ID_EXTRA_BYTES),
        )
        self._closed = False
        try:
            infos = self.executor.collective_rpc(
                "hs_install", args=(self.ring.spec.to_dict(), layer_ids, self.adapters.name, mode)
            )
            self.capture_info = next(i for i in infos if i["capturing"])
            self.log.info(
                "capture_installed",
                **self.capture_info,
                tp_ranks=len(infos),
                capturing_ranks=[i["tp_rank"] for i in infos if i["capturing"]],
            )
            kv = self.adapters.set_up_kv_cache(self.executor, vllm_config)
            self.scheduler = self.adapters.scheduler(
                vllm_config, kv.config, kv.block_size, kv.hash_block_size
            )
            self.block_hasher = self.adapters.block_hasher(vllm_config, kv.hash_block_size)
            self.executor.collective_rpc("hs_arm")
        except BaseException:
            self.close()
            raise
        on_cpu = vllm_config.device_config.device_type == "cpu"
        self.sampling_params = prefill_sampling_params(
            seeded=on_cpu and self.adapters.facts.cpu_sampler_seeds_whole_batches_only and generating
        )
        self.async_scheduling = bool(vllm_config.scheduler_config.async_scheduling)
        self._generating: dict[str, tuple[str, list[int]]] = {}  # request id -> (caller's id, tokens)
        # Steps run / steps whose ring slot was read, over the backend's lifetime: the ring's
        # counters run across extract() calls.
        self._executed = self._taken = 0
        self._releases = _Releases(self.ring)
        # Shape of the work done, for logs and tests: steps that batched several
        # requests, requests whose prefill was chunked over several steps, and
        # whether a step was submitted while the previous one still ran.
        self.stats = {
            "max_requests_per_step": 0,
            "chunked_requests": 0,
            "tokens": 0,
            "max_steps_in_flight": 0,
            "generation_requests": 0,
            "generated_tokens": 0,
            "recomputed_rows": 0,
            # backend.vllm.final_step_tokens: the steps run at that size, and the most tokens one had
            "final_steps": 0,
            "largest_final_step": 0,
        }
        self.log.info(
            "vllm_ready",
            kv_blocks=kv.config.num_blocks,
            block_size=kv.block_size,
            max_num_batched_tokens=self.token_budget,
            max_num_seqs=self.max_num_seqs,
            final_step_tokens=self.final_step_tokens,
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
        }

    def extract(
        self, inputs: Iterator[BackendInput | GenerationInput | None]
    ) -> Iterator[HiddenChunk | Completion]:
        try:
            yield from self._steps(inputs)
        except Exception:
            # A dead worker surfaces as whichever vLLM call comes next: a step's result ("cancelled"),
            # the next step's submission ("Executor failed."), an RPC. Name the death instead.
            self._check_executor()
            raise

    def _steps(
        self, inputs: Iterator[BackendInput | GenerationInput | None]
    ) -> Iterator[HiddenChunk | Completion]:
        source = iter(inputs)
        exhausted = False
        pending: dict[str, _Pending] = {}  # extraction requests, by sample id
        unscheduled = 0  # prompt tokens added but not yet scheduled
        # Steps submitted and not yet updated, oldest first: with two in flight the
        # workers run step k while the driver schedules step k+1 (EngineCore's batch
        # queue). A scheduler output with no tokens is submitted too (it carries the
        # finished request ids to the workers) but never twice in a row.
        in_flight: deque[tuple[Any, Any]] = deque()
        slots = self.ring.spec.slots
        step_tokens = self.scheduler.max_num_scheduled_tokens
        final_steps = False
        while True:
            while (
                not exhausted
                and len(pending) + len(self._generating) < self.concurrent_requests
                and unscheduled < 2 * self.token_budget
            ):
                item = next(source, _EXHAUSTED)
                if item is _EXHAUSTED:
                    exhausted = True
                    break
                if item is None:  # nothing new right now (e.g. staging full): run what is pending
                    break
                unscheduled += self._admit(item, pending)
            if (
                not final_steps
                and self.final_step_tokens
                and exhausted
                and not self._generating
                and unscheduled <= self.token_budget
            ):
                # The rows of the last step are written after the GPU is done: make it a small one.
                final_steps = True
                self.set_step_tokens(min(step_tokens, self.final_step_tokens))
            last_was_empty = bool(in_flight) and in_flight[-1][0].total_num_scheduled_tokens == 0
            if (
                self.scheduler.get_num_unfinished_requests()
                and len(in_flight) < self._steps_in_flight()
                and not last_was_empty
            ):
                # The worker takes slot `executed % slots`; make sure the driver let go of it.
                yield from self._drain(pending, lambda: self._executed - self.ring.released < slots)
                scheduler_output = self.scheduler.schedule()
                scheduled = scheduler_output.total_num_scheduled_tokens
                if scheduled == 0 and not in_flight:
                    raise RuntimeError(
                        f"vLLM scheduled nothing with {len(pending)} requests waiting; the KV cache is too "
                        "small for the longest sample: raise gpu_memory_utilization or lower data.max_length"
                    )
                step = self.adapters.submit_step(self.executor, self.scheduler, scheduler_output)
                in_flight.append((scheduler_output, step))
                self.stats["max_steps_in_flight"] = max(self.stats["max_steps_in_flight"], len(in_flight))
                if final_steps and scheduled:
                    self.stats["final_steps"] += 1
                    self.stats["largest_final_step"] = max(self.stats["largest_final_step"], scheduled)
                self._executed += captured_step(scheduler_output.num_scheduled_tokens)
                unscheduled = max(0, unscheduled - scheduled)
                if len(in_flight) < self._steps_in_flight() and scheduled:
                    continue
            if not in_flight:
                if exhausted:
                    break
                continue
            scheduler_output, step = in_flight.popleft()
            output = step.result()
            yield from self._completions(self.scheduler.update_from_output(scheduler_output, output))
            yield from self._take(pending)
        yield from self._drain(pending, lambda: self._taken >= self._executed)
        self.set_step_tokens(step_tokens)  # the next extract() starts where this one did
        if pending or self._generating:
            raise RuntimeError(
                f"{len(pending) + len(self._generating)} requests finished without their output"
            )
        self.log.info("vllm_extract_finished", steps=self._executed, **self.stats)

    def _steps_in_flight(self) -> int:
        # vLLM's synchronous scheduler (CPU) has nothing to schedule for a decoding request whose
        # last token it has not seen: a second step in flight would halve decoding.
        return 1 if self._generating and not self.async_scheduling else STEPS_IN_FLIGHT

    def _admit(self, item: BackendInput | GenerationInput, pending: dict[str, _Pending]) -> int:
        """Add one request to the scheduler; returns its prompt tokens."""
        if isinstance(item, BackendInput):
            request_id, prompt, params = item.sample_id, item.input_ids, self.sampling_params
            pending[item.sample_id] = _Pending(item.input_ids, item.destination)
        else:
            request_id, prompt = GENERATION_PREFIX + item.request_id, item.prompt_ids
            params = generation_sampling_params(item)
            self._generating[request_id] = (item.request_id, [])
            self.stats["generation_requests"] += 1
        self.scheduler.add_request(
            self.adapters.request(request_id, prompt.tolist(), params, self.block_hasher)
        )
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

    def _check_worker(self) -> None:
        error = self.ring.worker_error
        if error:
            raise RuntimeError(f"capture worker failed: {error}")
        self._check_executor()

    def _check_executor(self) -> None:
        """vLLM's multiprocessing executor watches its worker processes and marks itself failed
        when one dies (the kernel's OOM killer, a crash in a kernel): without this check the driver
        would wait on the ring for rows that never come."""
        if self._executor_failed:
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
    def _executor_failed(self) -> bool:
        return bool(getattr(self.executor, "is_failed", False))

    def _drain(self, pending: dict[str, _Pending], done: Callable[[], bool]) -> Iterator[HiddenChunk]:
        """Hand on published steps until ``done()``: the worker publishes asynchronously."""
        while not done():
            chunks = self._take(pending)
            yield from chunks
            self._check_worker()
            if not chunks:
                time.sleep(0.0005)

    def _take(self, pending: dict[str, _Pending]) -> list[HiddenChunk]:
        """Chunks of every step the worker has published and the driver has not read yet. A
        step's rows of generation requests are dropped; so are an extraction request's rows it
        already has (vLLM recomputes a preempted request from its start)."""
        chunks: list[HiddenChunk] = []
        published = self.ring.published
        while self._taken < published:
            step = self._taken
            header = self.ring.read_header(step)
            slot = self.ring.slots[step % self.ring.spec.slots]
            self.stats["max_requests_per_step"] = max(
                self.stats["max_requests_per_step"], len(header["reqs"])
            )
            self.stats["tokens"] += header["num_tokens"]
            step_chunks: list[HiddenChunk] = []
            offset = 0
            for request_id, count in header["reqs"]:
                if request_id in pending:
                    chunk = self._rows(step, slot, pending, request_id, offset, count)
                    if chunk is not None:
                        step_chunks.append(chunk)
                elif not request_id.startswith(GENERATION_PREFIX):
                    raise RuntimeError(
                        f"capture: step {step} holds rows of request {request_id}, which is not pending"
                    )
                offset += count
            self._releases.hold(step, len(step_chunks))
            chunks.extend(step_chunks)
            self._taken += 1
        return chunks

    def _rows(
        self, step: int, slot: Any, pending: dict[str, _Pending], sample_id: str, offset: int, count: int
    ) -> HiddenChunk | None:
        """One extraction request's rows of a step, checked against its own ids and positions."""
        state = pending[sample_id]
        a, b = offset, offset + count
        positions = slot.positions.numpy()[a:b]
        first = int(positions[0]) if count else state.received
        if not (
            first <= state.received
            and np.array_equal(positions, np.arange(first, first + count))
            and np.array_equal(slot.input_ids.numpy()[a:b], state.input_ids[first : first + count])
        ):
            raise RuntimeError(
                f"capture misaligned for sample {sample_id} at step {step}: tokens {first}..{first + count} "
                f"(after {state.received} received) do not match the step's input ids/positions"
            )
        if first < state.received:  # recomputed after a preemption: keep only the rows that are new
            self.stats["recomputed_rows"] += min(count, state.received - first)
            a += state.received - first
        start, stop = state.received, first + count
        if stop <= start:
            return None
        state.received = stop
        last = stop == len(state.input_ids)
        if start == 0 and not last:
            self.stats["chunked_requests"] += 1
        if last:
            del pending[sample_id]
        releases = self._releases
        return HiddenChunk(
            sample_id=sample_id,
            start=start,
            rows=slot.rows[a:b],
            scales=None if slot.scales is None else slot.scales[a:b],
            last=last,
            nonfinite=not bool(slot.finite.numpy()[a:b].all()),
            release=lambda: releases.release(step),
            destination=state.destination,
        )

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
        if self._closed:
            return
        self._closed = True
        try:
            if not self._executor_failed:  # a failed executor takes no calls
                self.executor.collective_rpc("hs_close")
        finally:
            self.executor.shutdown()
            self.ring.close(unlink=True)


def _exit_status(code: int | None) -> str:
    if code is None:
        return "(no exit status yet)"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with {code}"
