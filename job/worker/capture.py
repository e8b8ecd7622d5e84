"""Worker-side capture of hidden states, in one of two modes.

``compiled`` (vLLM's default compilation and CUDA graphs): the layers come from the model's
own EAGLE-3 aux-hidden-state outputs (``SupportsEagle3``), set before the first forward so
that the compiled graph returns them; ids the version's interface cannot give (``aux_ids``),
and every id of a model without the interface, come from "taps": forward hooks that Dynamo
traces into the graph, copying the layer's residual stream into a persistent buffer. After
each forward both are copied into the step's device buffer.

``hooks`` (``enforce_eager``): forward hooks on vLLM's own decoder layers write straight into
the step's buffer during the forward. vLLM decoder layers return ``(hidden_states, residual)``
with the residual add fused into the next norm, so the residual stream after layer i is
their sum; id k > 0 is taken at the output of layer k-1, id 0 at the input of layer 0.

Either way no layer forward is re-implemented, and per step a side stream converts the
buffer to the stored dtype and copies it, with the step's input ids and positions (read
from the runner after the forward: a FULL CUDA-graph replay runs no Python forward), into
the next free ring slot (pinned shared memory); a publisher thread makes the slot visible
to the driver once the copy has landed. On CUDA, steps alternate between two device
buffers, so step k+1's forward runs while step k is copied out.
"""

from __future__ import annotations

import collections
import functools
import inspect
import itertools
import queue
import threading
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.profiler import record_function

from adapters import AdapterSet
from job.hidden_dtype import HiddenDtype
from job.worker.ring import Ring, RingSpec, captured_step

SLOT_WAIT_S = 1800.0
HOOKS, COMPILED = "hooks", "compiled"
# Worker-side concerns whose failure says the capture or the adapter set does not fit this vLLM
# (or this model): the worker reports "<concern>: <error>" through the ring before its forward
# fails, and the driver names the concern (exit 2) instead of the worker's bare error.
CAPTURE_HOOK = "capture hook (decoder-layer outputs)"
CAPTURE_TAP = "capture tap (decoder-layer outputs, traced into the compiled graph)"
STEP_LAYOUT = "step layout (the runner's input ids, positions and request order)"
WORKER_MISMATCHES = (CAPTURE_HOOK, CAPTURE_TAP, STEP_LAYOUT)
# Worker methods that run the model's first forwards, and with them torch.compile's tracing of the
# taps: the profiling run (CUDA) and the warm-up (CPU); execute_model is wrapped anyway.
_COMPILING_METHODS = ("determine_available_memory", "compile_or_warm_up_model")


def inner_model(model: torch.nn.Module) -> torch.nn.Module:
    """The decoder stack of a vLLM model (text or multimodal wrapper): ``.model`` with ``.layers``."""
    candidates = [model]
    if hasattr(model, "get_language_model"):
        candidates.append(model.get_language_model())
    for candidate in candidates:
        inner = getattr(candidate, "model", None)
        if isinstance(getattr(inner, "layers", None), torch.nn.ModuleList):
            return inner
    raise TypeError(f"{type(model).__name__}: no decoder layer list at .model.layers")


def plan_compiled(
    model: torch.nn.Module, layer_ids: list[int], adapters: AdapterSet
) -> tuple[list[int], list[int]]:
    """(aux ids, tap ids) for compiled capture: what the model's EAGLE-3 interface gives on this
    vLLM line, the rest from taps. Runs on every TP rank (their graphs must agree)."""
    from vllm.model_executor.models.interfaces import supports_eagle3

    if not supports_eagle3(model):
        return [], list(layer_ids)
    inner = inner_model(model)
    num_layers = len(inner.layers)
    if adapters.facts.eagle_model_mixin:
        from vllm.model_executor.models.interfaces import EagleModelMixin

        if isinstance(inner, EagleModelMixin):  # every k in [0, N], as the job numbers them
            return list(layer_ids), []
    # A model's own loop appends hidden + residual *before* layer idx: k in [1, N-1] only
    # (k = 0 has no residual yet; the stream after the last layer is never appended).
    aux = [k for k in layer_ids if 1 <= k < num_layers]
    return aux, [k for k in layer_ids if k not in aux]


def configure_aux(worker: Any, aux_ids: list[int]) -> None:
    """Make the model return the aux layers and the runner accept its (hidden, aux) output."""
    if aux_ids:
        worker.model_runner.get_model().set_aux_hidden_state_layers(tuple(sorted(aux_ids)))
        worker.model_runner.use_aux_hidden_state_outputs = True


def _argument(fn: Any, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
    bound = inspect.signature(fn).bind_partial(*args, **kwargs)
    return bound.arguments.get(name)


class StepCapture:
    def __init__(
        self, worker: Any, ring: Ring, layer_ids: list[int], adapters: AdapterSet, mode: str
    ) -> None:
        self.worker = worker
        self.ring = ring
        self.spec = ring.spec
        self.layer_ids = layer_ids
        self.adapters = adapters
        self.mode = mode
        model = worker.model_runner.get_model()
        self.layers = inner_model(model).layers
        for k in layer_ids:
            if not 0 <= k <= len(self.layers):
                raise ValueError(f"layer id {k} outside [0, {len(self.layers)}]")
        param = next(model.parameters())
        self.device = param.device
        self.on_cuda = self.device.type == "cuda"
        self.dtype = model_dtype(worker, param)
        self.step_buffers = [
            _StepBuffers(self.spec, self.dtype, self.device) for _ in range(2 if self.on_cuda else 1)
        ]
        self.active = False
        self.armed = False  # set by hs_arm once the engine is warmed up
        self.num_tokens = 0
        self.step = 0
        self.pinned = False
        self._hooks: list[Any] = []
        self.aux_ids: list[int] = []
        self.taps: dict[int, torch.Tensor] = {}  # compiled: layer id -> persistent [tokens, H] buffer
        self._tap_lines: dict[int, tuple[str, set[int]]] = {}  # layer id -> its tap's file and lines
        self._wrapped: dict[str, Any] = {}  # compiled: worker methods wrapped by _reporting_taps
        if mode == COMPILED:
            self.aux_ids, tap_ids = plan_compiled(model, layer_ids, adapters)
            configure_aux(worker, self.aux_ids)
            self._install_taps(tap_ids)
        else:
            self._install_hooks()
        if self.on_cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.pinned = _pin(ring.buffer)
            self._published: queue.Queue[Any] = queue.Queue()
            self._publisher = threading.Thread(target=self._publish_loop, name="hs-publisher", daemon=True)
            self._publisher.start()
        self._original_execute_model = worker.execute_model
        # Compiled: the forward (Dynamo may trace the taps again for a new shape) reports a failing tap.
        self._forward = (
            self._reporting_taps(worker.execute_model) if mode == COMPILED else worker.execute_model
        )
        worker.execute_model = self._execute_model
        if mode == COMPILED:
            for name in _COMPILING_METHODS:
                if callable(method := getattr(worker, name, None)):
                    self._wrapped[name] = method
                    setattr(worker, name, self._reporting_taps(method))

    @classmethod
    def install(
        cls, worker: Any, spec: RingSpec, layer_ids: list[int], adapters: AdapterSet, mode: str
    ) -> StepCapture:
        return cls(worker, Ring(spec, create=False), layer_ids, adapters, mode)

    def describe(self) -> dict[str, Any]:
        runner = type(self.worker.model_runner)
        sources = {
            str(k): "aux" if k in self.aux_ids else "tap" if k in self.taps else "hook"
            for k in self.layer_ids
        }
        return {
            "mode": self.mode,
            "layer_sources": sources,
            "model_runner": f"{runner.__module__}.{runner.__qualname__}",
            "decoder_layer": type(self.layers[0]).__name__,
            "num_decoder_layers": len(self.layers),
            "device": str(self.device),
            "pinned_host_buffers": self.pinned,
            "capture_buffer_bytes": sum(b.states.nbytes for b in self.step_buffers)
            + sum(t.nbytes for t in self.taps.values()),
            # this rank's weights, and each decoder layer's: the preflight scales them to full depth
            "weight_bytes": sum(t.nbytes for t in _tensors(self.worker.model_runner.get_model())),
            "layer_weight_bytes": _own_bytes(list(self.layers)),
        }

    @property
    def current(self) -> _StepBuffers:
        """The device buffers of the step being run (``step`` advances once it is shipped)."""
        return self.step_buffers[self.step % len(self.step_buffers)]

    # compiled: taps --------------------------------------------------------------
    def _install_taps(self, tap_ids: list[int]) -> None:
        """Hooks traced into the compiled graph: always on (no Python state to guard on), writing
        every row of every forward, warm-up included, into buffers that live as long as the
        graph. Closures, not default arguments: Dynamo fails on hooks with defaults."""
        rows = max(self.spec.max_tokens, int(getattr(self.worker.model_runner, "max_num_tokens", 0)))
        for k in tap_ids:
            buffer = torch.zeros(rows, self.spec.hidden_size, dtype=self.dtype, device=self.device)
            self.taps[k] = buffer
            if k == 0:
                position = list(inspect.signature(self.layers[0].forward).parameters).index("hidden_states")
                tap = _input_tap(buffer, position)
                self._hooks.append(self.layers[0].register_forward_pre_hook(tap, with_kwargs=True))
            else:
                tap = _output_tap(buffer)
                self._hooks.append(self.layers[k - 1].register_forward_hook(tap))
            self._tap_lines[k] = _code_lines(tap)

    def _reporting_taps(self, method: Callable[..., Any]) -> Callable[..., Any]:
        """``method`` of the worker, whose failure inside a tap's code (torch.compile traces the
        taps, so a tap that does not fit the decoder layers fails in the worker's compilation, not
        in a hook call) is reported through the ring as the capture tap's."""

        @functools.wraps(method)
        def reporting(*args: Any, **kwargs: Any) -> Any:
            try:
                return method(*args, **kwargs)
            except Exception as exc:
                if (layer_id := self._failed_tap(exc)) is not None:
                    layer = type(self.layers[max(layer_id - 1, 0)]).__name__
                    # Dynamo's message goes on with the user-code stack, which the layer id says.
                    text = " ".join(str(exc).split()).split(" from user code:")[0]
                    error = f"{type(exc).__name__}: {text[:600]}"
                    self._report(CAPTURE_TAP, f"layer id {layer_id} on {layer}: {error}")
                raise

        return reporting

    def _failed_tap(self, exc: BaseException) -> int | None:
        """The layer id whose tap the failure's stack passes through: Dynamo's user-code stack of
        a tracing error (``real_stack``) or a traceback, of ``exc`` or an exception it chains."""
        for frame in _stack_frames(exc):
            for layer_id, (filename, lines) in self._tap_lines.items():
                if frame.filename == filename and frame.lineno in lines:
                    return layer_id
        return None

    def _gather_compiled(self, n: int) -> None:
        """After the forward: aux outputs (graph memory, padded to the graph's size) and taps into
        the step's buffer, on the compute stream, before the next forward can overwrite them."""
        states = self.current.states
        if self.aux_ids:
            aux = self.worker.model_runner.execute_model_state.aux_hidden_states
            if len(aux) != len(self.aux_ids):
                self._report(CAPTURE_HOOK, f"{len(aux)} aux hidden states for layers {sorted(self.aux_ids)}")
                raise RuntimeError(
                    f"{type(self.worker.model_runner.get_model()).__name__} returned {len(aux)} aux hidden "
                    f"states for layers {sorted(self.aux_ids)}: this vLLM's interface does not give them all"
                )
            for k, tensor in zip(sorted(self.aux_ids), aux, strict=True):
                states[:n, self.layer_ids.index(k)].copy_(tensor[:n])
        for k, buffer in self.taps.items():
            states[:n, self.layer_ids.index(k)].copy_(buffer[:n])

    # eager: hooks ----------------------------------------------------------------
    def _install_hooks(self) -> None:
        layer0_forward = self.layers[0].forward
        for j, k in enumerate(self.layer_ids):
            if k == 0:
                self._hooks.append(
                    self.layers[0].register_forward_pre_hook(
                        self._reported(k, self._input_hook(j, layer0_forward)), with_kwargs=True
                    )
                )
            else:
                self._hooks.append(
                    self.layers[k - 1].register_forward_hook(self._reported(k, self._output_hook(j)))
                )

    def _reported(self, layer_id: int, hook: Any) -> Any:
        """``hook``, whose failure is reported through the ring as the capture hook's (eager mode
        only: compiled taps are traced, and fail in the worker's compilation: ``_reporting_taps``)."""

        def reported(*args: Any) -> None:
            try:
                hook(*args)
            except Exception as exc:
                layer = type(self.layers[max(layer_id - 1, 0)]).__name__
                self._report(CAPTURE_HOOK, f"layer id {layer_id} on {layer}: {type(exc).__name__}: {exc}")
                raise

        return reported

    def _report(self, concern: str, detail: str) -> None:
        self.ring.report_error(f"{concern}: {detail}")

    def _input_hook(self, j: int, layer0_forward: Any) -> Any:
        def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
            if self.active:
                hidden = _argument(layer0_forward, "hidden_states", args, kwargs)
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

    # step bracketing -------------------------------------------------------------
    def _execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        n = scheduler_output.total_num_scheduled_tokens
        if not (self.armed and captured_step(scheduler_output.num_scheduled_tokens)):
            return self._forward(scheduler_output, *args, **kwargs)
        if n > self.spec.max_tokens:
            raise RuntimeError(f"step of {n} tokens exceeds the capture buffer ({self.spec.max_tokens})")
        if self.current.copy_done is not None:  # this buffer's last copy must land before it is overwritten
            torch.cuda.current_stream(self.device).wait_event(self.current.copy_done)
        self.num_tokens, self.active = n, self.mode == HOOKS
        try:
            output = self._forward(scheduler_output, *args, **kwargs)
        finally:
            self.active = False
        with record_function("eagle3_capture: gather"):
            if self.mode == COMPILED:
                self._gather_compiled(n)
            runner = self.worker.model_runner
            try:
                input_ids, positions = self.adapters.step_inputs(runner)
                self.current.input_ids[:n].copy_(input_ids[:n])
                self.current.positions[:n].copy_(positions[:n])
                order = self.adapters.step_token_order(runner, scheduler_output)
            except Exception as exc:
                self._report(STEP_LAYOUT, f"{type(exc).__name__}: {exc}")
                raise
        self._ship(order)
        return output

    def _ship(self, order: list[tuple[str, int]]) -> None:
        n, step, buffers = self.num_tokens, self.step, self.current
        if sum(count for _, count in order) != n:
            raise RuntimeError(f"batch order covers {sum(c for _, c in order)} tokens, step has {n}")
        try:
            with record_function("eagle3_capture: wait for a free slot"):
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
            with torch.cuda.stream(self.copy_stream), record_function("eagle3_capture: copy out"):
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
        for name, method in self._wrapped.items():
            setattr(self.worker, name, method)
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


def _tensors(module: torch.nn.Module) -> list[torch.Tensor]:
    """A module's parameters and buffers on this rank (quantized ones as stored), each once."""
    return list({id(t): t for t in itertools.chain(module.parameters(), module.buffers())}.values())


def _own_bytes(layers: list[torch.nn.Module]) -> list[int]:
    """Each layer's bytes, less tensors it shares with another layer (vLLM hands every layer the
    same rotary-embedding module): those are the model's once, not the layer's."""
    held = [_tensors(layer) for layer in layers]
    owners = collections.Counter(id(t) for tensors in held for t in tensors)
    return [sum(t.nbytes for t in tensors if owners[id(t)] == 1) for tensors in held]


def _input_tap(buffer: torch.Tensor, position: int) -> Any:
    """Layer 0's input (the embedding output, however the model scales it) into ``buffer``."""

    def hook(_module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        hidden = args[position] if len(args) > position else kwargs["hidden_states"]
        buffer[: hidden.shape[0]].copy_(hidden)

    return hook


def _output_tap(buffer: torch.Tensor) -> Any:
    """A decoder layer's residual stream (hidden + residual) into ``buffer``."""

    def hook(_module: Any, _args: Any, output: Any) -> None:
        torch.add(output[0], output[1], out=buffer[: output[0].shape[0]])

    return hook


def _code_lines(function: Any) -> tuple[str, set[int]]:
    code = function.__code__
    return code.co_filename, {line for _, _, line in code.co_lines() if line is not None}


def _stack_frames(exc: BaseException) -> Iterator[traceback.FrameSummary]:
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        error = pending.pop()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield from getattr(error, "real_stack", None) or []
        yield from traceback.extract_tb(error.__traceback__)
        pending += [error.__cause__, error.__context__]


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
