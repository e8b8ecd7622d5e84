"""Worker-side capture with forward hooks on vLLM's own decoder layers.

vLLM decoder layers return ``(hidden_states, residual)`` with the residual add
fused into the next norm, so the residual stream after layer i is their sum.
Id k > 0 is taken at the output of layer k-1, id 0 at the input of layer 0
(the embedding output). No layer forward is re-implemented: whatever the
architecture computes (MLA, MoE, extra arguments) runs untouched.

Per step: hooks write into a device buffer ``[tokens, L, H]``; after the
forward, a side stream converts it to the stored dtype and copies it, with
the step's input ids, positions and finite flags, into the next free ring
slot (pinned shared memory); a publisher thread makes the slot visible to the
driver once the copy has landed. On CUDA, steps alternate between two device
buffers, so step k+1's forward runs while step k is copied out: the compute
stream only waits for the copy of step k-1.
"""

from __future__ import annotations

import inspect
import queue
import threading
from typing import Any

import torch

from adapters import AdapterSet
from job.hidden_dtype import HiddenDtype
from job.worker.ring import Ring, RingSpec

SLOT_WAIT_S = 1800.0


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    """The decoder layer list of a vLLM model (text or multimodal wrapper)."""
    candidates = [model]
    if hasattr(model, "get_language_model"):
        candidates.append(model.get_language_model())
    for candidate in candidates:
        inner = getattr(candidate, "model", None)
        layers = getattr(inner, "layers", None)
        if isinstance(layers, torch.nn.ModuleList):
            return layers
    raise TypeError(f"{type(model).__name__}: no decoder layer list at .model.layers")


def _argument(fn: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    return bound.arguments.get(name)


class DecoderLayerCapture:
    def __init__(self, worker: Any, ring: Ring, layer_ids: list[int], adapters: AdapterSet) -> None:
        self.worker = worker
        self.ring = ring
        self.spec = ring.spec
        self.layer_ids = layer_ids
        self.adapters = adapters
        model = worker.model_runner.get_model()
        self.layers = decoder_layers(model)
        for k in layer_ids:
            if not 0 <= k <= len(self.layers):
                raise ValueError(f"layer id {k} outside [0, {len(self.layers)}]")
        param = next(model.parameters())
        self.device = param.device
        self.on_cuda = self.device.type == "cuda"
        spec = self.spec
        dtype = model_dtype(worker, param)
        self.step_buffers = [_StepBuffers(spec, dtype, self.device) for _ in range(2 if self.on_cuda else 1)]
        self.active = False
        self.armed = False  # set by hs_arm once the engine is warmed up
        self.num_tokens = 0
        self.step = 0
        self.pinned = False
        self._hooks = [model.register_forward_pre_hook(self._on_model_input, with_kwargs=True)]
        self._model_forward = model.forward
        self._layer0_forward = self.layers[0].forward
        for j, k in enumerate(layer_ids):
            if k == 0:
                self._hooks.append(
                    self.layers[0].register_forward_pre_hook(self._input_hook(j), with_kwargs=True)
                )
            else:
                self._hooks.append(self.layers[k - 1].register_forward_hook(self._output_hook(j)))
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.pinned = _pin(ring.buffer)
            self._published: queue.Queue[Any] = queue.Queue()
            self._publisher = threading.Thread(target=self._publish_loop, name="hs-publisher", daemon=True)
            self._publisher.start()
        self._original_execute_model = worker.execute_model
        worker.execute_model = self._execute_model

    @classmethod
    def install(
        cls, worker: Any, spec: RingSpec, layer_ids: list[int], adapters: AdapterSet
    ) -> DecoderLayerCapture:
        return cls(worker, Ring(spec, create=False), layer_ids, adapters)

    def describe(self) -> dict[str, Any]:
        runner = type(self.worker.model_runner)
        return {
            "model_runner": f"{runner.__module__}.{runner.__qualname__}",
            "decoder_layer": type(self.layers[0]).__name__,
            "num_decoder_layers": len(self.layers),
            "device": str(self.device),
            "pinned_host_buffers": self.pinned,
            "capture_buffer_bytes": sum(b.states.nbytes for b in self.step_buffers),
        }

    @property
    def current(self) -> _StepBuffers:
        """The device buffers of the step being run (``step`` advances once it is shipped)."""
        return self.step_buffers[self.step % len(self.step_buffers)]

    # hooks -------------------------------------------------------------------
    def _on_model_input(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.active:
            return
        n = self.num_tokens
        ids = _argument(self._model_forward, "input_ids", args, kwargs)
        positions = _argument(self._model_forward, "positions", args, kwargs)
        if ids is not None:
            self.current.input_ids[:n].copy_(ids[:n])
        if positions is not None:
            self.current.positions[:n].copy_(positions[:n] if positions.dim() == 1 else positions[0, :n])

    def _input_hook(self, j: int) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.active:
                hidden = _argument(self._layer0_forward, "hidden_states", args, kwargs)
                self.current.states[: self.num_tokens, j].copy_(hidden[: self.num_tokens])

        return hook

    def _output_hook(self, j: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            if not self.active:
                return
            n, states = self.num_tokens, self.current.states
            if isinstance(output, tuple) and len(output) >= 2 and output[1] is not None:
                torch.add(output[0][:n], output[1][:n], out=states[:n, j])
            else:
                hidden = output[0] if isinstance(output, tuple) else output
                states[:n, j].copy_(hidden[:n])

        return hook

    # step bracketing ---------------------------------------------------------
    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        n = scheduler_output.total_num_scheduled_tokens
        if n == 0 or not self.armed:
            return self._original_execute_model(scheduler_output, *args, **kwargs)
        if n > self.spec.max_tokens:
            raise RuntimeError(f"step of {n} tokens exceeds the capture buffer ({self.spec.max_tokens})")
        if self.current.copy_done is not None:  # this buffer's last copy must land before it is overwritten
            torch.cuda.current_stream(self.device).wait_event(self.current.copy_done)
        self.num_tokens, self.active = n, True
        try:
            output = self._original_execute_model(scheduler_output, *args, **kwargs)
        finally:
            self.active = False
        self._ship(self.adapters.step_token_order(self.worker.model_runner, scheduler_output))
        return output

    def _ship(self, order: list[tuple[str, int]]) -> None:
        n, step, buffers = self.num_tokens, self.step, self.current
        if sum(count for _, count in order) != n:
            raise RuntimeError(f"batch order covers {sum(c for _, c in order)} tokens, step has {n}")
        try:
            slot = self.ring.wait_free(step, SLOT_WAIT_S)
        except TimeoutError as exc:
            self.ring.report_error(str(exc))
            raise
        header = {"step": step, "num_tokens": n, "reqs": order}
        if not self.on_cuda:
            _fill_slot(
                slot, buffers.states[:n], buffers.input_ids[:n], buffers.positions[:n], self.spec.dtype
            )
            self.ring.publish(step, header)
        else:
            compute = torch.cuda.current_stream(self.device)
            ready = torch.cuda.Event()
            ready.record(compute)
            with torch.cuda.stream(self.copy_stream):
                self.copy_stream.wait_event(ready)
                keep = _fill_slot(
                    slot, buffers.states[:n], buffers.input_ids[:n], buffers.positions[:n], self.spec.dtype
                )
                done = torch.cuda.Event()
                done.record(self.copy_stream)
            buffers.copy_done = done
            self._published.put((step, done, header, keep))
        self.step += 1

    def _publish_loop(self) -> None:
        while (item := self._published.get()) is not None:
            step, done, header, _keep = item  # _keep holds device temporaries until the copy is done
            done.synchronize()
            self.ring.publish(step, header)

    def close(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self.worker.execute_model = self._original_execute_model
        if self.on_cuda:
            self._published.put(None)
            self._publisher.join()
            if self.pinned:
                torch.cuda.cudart().cudaHostUnregister(self.ring.buffer.data_ptr())
        self.ring.close(unlink=False)


class _StepBuffers:
    """Device-side capture of one step: states, input ids, positions."""

    def __init__(self, spec: RingSpec, dtype: torch.dtype, device: torch.device) -> None:
        shape = (spec.max_tokens, spec.num_layers, spec.hidden_size)
        self.states = torch.empty(shape, dtype=dtype, device=device)
        self.input_ids = torch.zeros(spec.max_tokens, dtype=torch.int32, device=device)
        self.positions = torch.zeros(spec.max_tokens, dtype=torch.int32, device=device)
        self.copy_done: torch.cuda.Event | None = None


def model_dtype(worker: Any, param: torch.Tensor) -> torch.dtype:
    dtype = getattr(getattr(worker, "model_config", None), "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else param.dtype


def _fill_slot(
    slot: Any, states: torch.Tensor, input_ids: torch.Tensor, positions: torch.Tensor, dtype: HiddenDtype
) -> tuple[torch.Tensor, ...]:
    """Copy one step into a ring slot (asynchronously on CUDA); returns the
    device temporaries that must outlive the copy."""
    n = states.shape[0]
    finite = torch.isfinite(states).flatten(1).all(dim=1).to(torch.uint8)
    rows, scales = dtype.encode(states)
    slot.rows[:n].copy_(rows, non_blocking=True)
    if scales is not None:
        slot.scales[:n].copy_(scales, non_blocking=True)
    slot.input_ids[:n].copy_(input_ids, non_blocking=True)
    slot.positions[:n].copy_(positions, non_blocking=True)
    slot.finite[:n].copy_(finite, non_blocking=True)
    return (finite, rows) if scales is None else (finite, rows, scales)


def _pin(buffer: torch.Tensor) -> bool:
    """Page-lock the shared ring so device-to-host copies run asynchronously at
    full speed. Without it capture still works, with slower, synchronous copies."""
    try:
        result = torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0)
    except (AttributeError, RuntimeError):
        return False
    code = result[0] if isinstance(result, tuple) else result
    return int(code) == 0
