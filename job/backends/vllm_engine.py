"""Building the vLLM engine the driver runs: adapter set, VllmConfig, executor, capture ring,
capture in the workers, KV cache, Scheduler and block hasher, in that order.

The run's engine and the preflight's (vLLM's dummy weights at reduced depth, ``EngineSpec``'s
``dummy_weights`` and ``hf_overrides``) are built by this same code. Each step that goes
through the adapter set is a named concern: an error there that says the adapter code does not
fit the installed vLLM (a signature, an attribute, an assertion) is an ``AdapterMismatch``, exit
2 naming ``backend.vllm.adapter_set``, wherever in start-up it surfaces (issue 33): no retry of
the same set on the same vLLM can succeed.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from adapters import AdapterSet, select_adapter_set
from job.data.source import MAX_ID_BYTES
from job.errors import ConfigError
from job.hidden_dtype import HiddenDtype
from job.model import ModelInfo
from job.settings import JobSettings, VllmSettings
from job.worker.capture import COMPILED, HOOKS, WORKER_MISMATCHES
from job.worker.ring import GENERATION_ID_EXTRA_BYTES, Ring, header_bytes

# What an adapter call raises when its code does not fit the installed vLLM: a changed
# signature or return type, a renamed attribute or module, an internal assertion.
MISMATCH_ERRORS = (TypeError, AttributeError, AssertionError, ImportError, KeyError, IndexError)

# vLLM's CompilationConfig keys that choose which batch sizes get a CUDA graph.
CAPTURE_SIZE_KEYS = {"cudagraph_capture_sizes", "max_cudagraph_capture_size"}

# The concerns, as errors and the preflight's report name them.
ENGINE_CONFIG = "engine configuration (EngineArgs -> VllmConfig)"
CAPTURE_INSTALL = "capture install in the workers (hs_install)"
KV_CACHE = "KV cache set-up"
SCHEDULER = "scheduler (Scheduler construction)"
BLOCK_HASHER = "block hasher"
REQUESTS = "requests (Request with the engine's block hasher)"
STEP = "step execution (execute_model, then sample_tokens)"
SCHEDULER_UPDATE = "scheduler update from a step's output"


class AdapterMismatch(ConfigError):
    """The selected adapter set's code does not fit the installed vLLM at ``concern``."""

    def __init__(self, concern: str, adapter_set: str, vllm_version: str, detail: str) -> None:
        self.concern = concern
        super().__init__(
            f"backend.vllm.adapter_set: {concern} failed with adapter set {adapter_set} on vLLM "
            f"{vllm_version} ({detail}); this set does not fit the installed vLLM: install a vLLM the "
            "set supports, choose another set (backend.vllm.adapter_set), or add one to "
            "config/adapters.yaml"
        )


@dataclass(frozen=True)
class EngineSpec:
    """What the engine is built from: the backend.vllm settings and the few others it needs."""

    options: VllmSettings
    tensor_parallel_size: int
    trust_remote_code: bool
    max_length: int  # data.max_length: the longest prompt
    generating: bool  # the run regenerates turns (RunSetup.generates)
    # The preflight's engine: vLLM's dummy weights (no weight file is read) and config overrides
    # (fewer layers).
    dummy_weights: bool = False
    hf_overrides: dict[str, Any] = field(default_factory=dict)
    # The preflight's engine: the largest batch size it captures a CUDA graph of (None: vLLM's
    # choice, as the run).
    max_cudagraph_capture_size: int | None = None

    @classmethod
    def of(cls, settings: JobSettings, generating: bool) -> EngineSpec:
        return cls(
            options=settings.backend.vllm,
            tensor_parallel_size=settings.backend.tensor_parallel_size,
            trust_remote_code=settings.model.trust_remote_code,
            max_length=settings.data.max_length,
            generating=generating,
        )

    @property
    def capture_mode(self) -> str:
        return HOOKS if self.options.enforce_eager else COMPILED

    def engine_kwargs(self, model: ModelInfo) -> dict[str, Any]:
        options = self.options
        kwargs: dict[str, Any] = {
            "model": str(model.path),
            "tokenizer": str(model.path),
            "dtype": model.dtype,
            "trust_remote_code": self.trust_remote_code,
            "seed": 0,
            "tensor_parallel_size": self.tensor_parallel_size,
            "max_num_batched_tokens": options.max_num_batched_tokens,
            "max_num_seqs": options.max_num_seqs,
            "gpu_memory_utilization": options.gpu_memory_utilization,
            # A prompt of data.max_length tokens plus the one token sampled after it (check_backend
            # made sure that fits the model's positions).
            "max_model_len": options.max_model_len or self.max_length + 1,
            "attention_backend": options.attention_backend,
            # Model runner in its own process even at TP=1: its Python (kernel
            # launches in eager mode) then never waits on the driver's GIL, which
            # the writer and committer threads share.
            "distributed_executor_backend": "mp",
            "enforce_eager": options.enforce_eager,
            **options.engine_args,
        }
        if self.dummy_weights:
            kwargs["load_format"] = "dummy"
        if self.hf_overrides:  # over the user's own (engine_args), which keep what they set
            kwargs["hf_overrides"] = _merged(options.engine_args.get("hf_overrides") or {}, self.hf_overrides)
        compilation = options.engine_args.get("compilation_config") or {}
        largest = self.max_cudagraph_capture_size
        # Sizes the user set (or a compilation_config that is no mapping) stand.
        user_sized = not isinstance(compilation, dict) or bool(CAPTURE_SIZE_KEYS & compilation.keys())
        if largest is not None and not user_sized:
            kwargs["compilation_config"] = {**compilation, "max_cudagraph_capture_size": largest}
        return kwargs


def _merged(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` on top of ``base``, nested dicts (a ``text_config``) merged key by key."""
    out = dict(base)
    for key, value in over.items():
        nested = isinstance(value, dict) and isinstance(out.get(key), dict)
        out[key] = _merged(out[key], value) if nested else value
    return out


@dataclass(frozen=True)
class EngineMemory:
    """What one rank of a started engine holds: its weights (the whole model's, and each decoder
    layer's) and its KV cache, in bytes, and how many tokens the KV cache holds."""

    device: str  # vLLM's device type: cuda, cpu, ...
    weight_bytes: int
    layer_weight_bytes: list[int]
    kv_cache_bytes: int
    kv_tokens: int
    max_model_len: int


@dataclass
class Engine:
    """A started engine: executor (one worker process per TP rank) with capture installed and
    armed, KV cache allocated, Scheduler and block hasher. ``close()`` ends the workers and
    removes the ring."""

    adapters: AdapterSet
    vllm_version: str
    vllm_config: Any
    executor: Any
    ring: Ring
    capture_info: dict[str, Any] = field(default_factory=dict)
    scheduler: Any = None
    block_hasher: Callable[[Any], list[Any]] | None = None
    hash_block_size: int = 0
    kv_blocks: int = 0
    block_size: int = 0
    kv_cache_bytes: int = 0  # one rank's KV cache
    _closed: bool = False

    @property
    def executor_failed(self) -> bool:
        return bool(getattr(self.executor, "is_failed", False))

    @contextlib.contextmanager
    def concern(self, name: str, every_error: bool = False) -> Iterator[None]:
        """Adapter code at ``name``: an error that says it does not fit this vLLM (``every_error``:
        any error, e.g. a worker's, which arrives as vLLM's RuntimeError) is an AdapterMismatch;
        a dead worker is not (vLLM then marks its executor failed)."""
        errors = (Exception,) if every_error else MISMATCH_ERRORS
        with adapter_concern(name, self.adapters, self.vllm_version, lambda: self.executor_failed, errors):
            yield

    def worker_mismatch(self) -> AdapterMismatch | None:
        """A worker-side concern (capture hook or tap, step layout) that reported through the ring
        that it does not fit, before the worker's own error reached the driver."""
        error = self.ring.worker_error or ""
        concern = next((c for c in WORKER_MISMATCHES if error.startswith(c + ":")), None)
        if concern is None:
            return None
        detail = error.removeprefix(concern + ":").strip()
        return AdapterMismatch(concern, self.adapters.name, self.vllm_version, detail)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            if not self.executor_failed:  # a failed executor takes no calls
                self.executor.collective_rpc("hs_close")
        finally:
            self.executor.shutdown()
            self.ring.close(unlink=True)


@contextlib.contextmanager
def adapter_concern(
    name: str,
    adapters: AdapterSet,
    vllm_version: str,
    executor_failed: Callable[[], bool] = lambda: False,
    errors: tuple[type[BaseException], ...] = MISMATCH_ERRORS,
) -> Iterator[None]:
    try:
        yield
    except ConfigError:
        raise
    except errors as exc:
        if executor_failed():
            raise
        raise AdapterMismatch(name, adapters.name, vllm_version, f"{type(exc).__name__}: {exc}") from exc


def build_engine(
    spec: EngineSpec, model: ModelInfo, layer_ids: list[int], dtype: HiddenDtype, log: Any
) -> Engine:
    os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")
    import vllm

    options = spec.options
    version = vllm.__version__
    adapters = select_adapter_set(version, options.adapter_set, options.allow_nearest_adapter)
    log.info("adapter_selected", vllm_version=version, adapter_set=adapters.name)
    mode = spec.capture_mode
    if mode == COMPILED and not adapters.facts.compiled_capture:
        raise ConfigError(
            f"backend.vllm.enforce_eager is false, but capture under compilation has not been verified "
            f"on vLLM {version} (adapter set {adapters.name}); set "
            "backend.vllm.enforce_eager: true (eager mode, forward hooks)"
        )
    with adapter_concern(ENGINE_CONFIG, adapters, version):
        vllm_config = adapters.engine_config(
            spec.engine_kwargs(model), {"mode": mode, "layer_ids": layer_ids}, spec.generating
        )
    scheduler_config = vllm_config.scheduler_config
    if spec.generating and not scheduler_config.enable_chunked_prefill:
        log.info(
            "whole_prompts_per_step",
            reason="seeded generation on a CPU build of vLLM, whose generators cannot rewind "
            "after a partial prefill",
            max_num_batched_tokens=scheduler_config.max_num_batched_tokens,
        )
    executor = adapters.start_executor(vllm_config)
    try:
        ring = Ring.create(
            None,
            slots=options.capture_slots,
            max_tokens=scheduler_config.max_num_batched_tokens,
            num_layers=len(layer_ids),
            hidden_size=model.hidden_size,
            dtype_name=dtype.name,
            header_bytes=header_bytes(
                scheduler_config.max_num_seqs, MAX_ID_BYTES + GENERATION_ID_EXTRA_BYTES
            ),
        )
    except BaseException:
        executor.shutdown()
        raise
    engine = Engine(adapters, version, vllm_config, executor, ring)
    try:
        _start(engine, layer_ids, mode, log)
    except BaseException as exc:
        # A compiled tap fails in the workers' first forwards (the KV cache's profiling or warm-up),
        # which vLLM reports as a RuntimeError; the tap said so through the ring (read before close).
        mismatch = engine.worker_mismatch() if isinstance(exc, Exception) else None
        engine.close()
        if mismatch is not None:
            raise mismatch from exc
        raise
    return engine


def _start(engine: Engine, layer_ids: list[int], mode: str, log: Any) -> None:
    adapters, executor, vllm_config = engine.adapters, engine.executor, engine.vllm_config
    # The capture's set-up runs in the workers: whatever fails there cannot work with this set on
    # this vLLM (the model's decoder stack, its EAGLE-3 interface, the layer ids).
    with engine.concern(CAPTURE_INSTALL, every_error=True):
        infos = executor.collective_rpc(
            "hs_install", args=(engine.ring.spec.to_dict(), layer_ids, adapters.name, mode)
        )
    engine.capture_info = next(i for i in infos if i["capturing"])
    log.info(
        "capture_installed",
        **engine.capture_info,
        tp_ranks=len(infos),
        capturing_ranks=[i["tp_rank"] for i in infos if i["capturing"]],
    )
    with engine.concern(KV_CACHE):
        kv = adapters.set_up_kv_cache(executor, vllm_config)
    with engine.concern(SCHEDULER):
        engine.scheduler = adapters.scheduler(vllm_config, kv.config, kv.block_size, kv.hash_block_size)
    with engine.concern(BLOCK_HASHER):
        engine.block_hasher = adapters.block_hasher(vllm_config, kv.hash_block_size)
    engine.hash_block_size, engine.block_size = kv.hash_block_size, kv.block_size
    engine.kv_blocks = kv.config.num_blocks
    engine.kv_cache_bytes = sum(t.size for t in kv.config.kv_cache_tensors)
    executor.collective_rpc("hs_arm")
