"""``python -m job preflight``: know in about a minute, before the model loads, that a run works.

Same settings as ``run``; checks in this order and stops at the first failure (exit 2, the
concern named; an error that a retry may fix, e.g. a storage outage, keeps its own exit code):

1. data: what ``plan`` checks, on this index's first ``preflight.samples`` samples (templates,
   masks, lengths, rejections), and the regeneration set-up when ``generate.mode`` is set;
2. weights: what ``run`` checks before any model loads (``check_model_weights``: the files load,
   the tensors' names and shapes fit ``config.json``; none of their values is read);
3. output: create-only writes at the real ``output.uri``, nothing left behind
   (``job.storage.probe``), and that what an earlier run wrote to this index and output was
   written with the same settings, data and weights (what ``run`` checks as it resumes);
4. engine (vLLM backend): the target's own ``config.json`` and quantization config with vLLM's
   **dummy weights** (no weight file is read) at **reduced depth** (``hf_overrides``: enough
   layers that every layer kind and every capture source the real layer ids use occurs), at the
   real TP, vLLM version, adapter set and compile mode, built by the run's own engine code;
   those samples (regenerated first when ``generate.mode`` is set) go through the whole
   pipeline into a scratch output that is read back, checked (shapes, finite, layer sources)
   and removed;
5. a report: what was proven, what was not (the weights' values; memory at full depth,
   estimated), and how long each part took.

``run`` with the vLLM backend does this first (``preflight.before_run``), in a child process
(``preflight_in_subprocess``; ``job.run`` owns that order), so the reduced engine and its memory
are gone before the real one starts.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from job.data.encode import EncodedSample, GenerationStart, RejectedSample
from job.data.source import read_records
from job.data.stream import EncodedStream, first_owned
from job.errors import EXIT_CONFIG, EXIT_FAILURE, ConfigError, JobError
from job.logs import configure_logging, get_logger
from job.manifest import Manifest
from job.pipeline.resume import check_output_settings, starts_over
from job.pipeline.runner import run_job
from job.pipeline.setup import (
    CheckedWeights,
    RunSetup,
    check_model_weights,
    ignored_backend_settings,
    prepare_run,
)
from job.settings import JobSettings

if TYPE_CHECKING:
    from job.backends.vllm_engine import EngineMemory

PREFLIGHT_EVENTS = "preflight"  # the prefix of the preflight's own log events (others get "preflight.")
DATA, WEIGHTS, OUTPUT, ENGINE = "data", "weights", "output", "engine"


class PreflightFailed(ConfigError):
    """A preflight check failed with an error of no more specific kind: exit 2, the concern named."""


@dataclass
class Reduction:
    """The target at reduced depth: which of its decoder layers the preflight's model keeps, and
    the run's layer ids in that model's numbering."""

    num_layers: int  # the target's
    kept: list[int]  # the target's layer indices the reduced model has, in order
    layer_ids: list[int]  # the run's layer ids, renumbered
    hf_overrides: dict[str, Any]  # for vLLM's ModelConfig
    target_kinds: list[str]  # kind of each of the target's layers (MLP dense/MoE, layer_types)
    why_full: str | None = None  # why no reduction was possible

    @property
    def depth(self) -> int:
        return len(self.kept)

    @property
    def kinds(self) -> list[str]:
        """Kind of each kept layer."""
        return [self.target_kinds[i] for i in self.kept]


def layer_kinds(text: dict[str, Any]) -> list[str]:
    """Each decoder layer's kind as vLLM builds it: dense or MoE MLP (DeepSeek-V2/V3 and Kimi-K2:
    MoE from ``first_k_dense_replace`` on, every ``moe_layer_freq``-th; Qwen-MoE:
    ``decoder_sparse_step`` and ``mlp_only_layers``; Mixtral: all), and ``layer_types`` where the
    config lists them (sliding/full/linear attention)."""
    n = int(text["num_hidden_layers"])
    mlp = ["dense"] * n
    if text.get("n_routed_experts"):
        first, every = int(text.get("first_k_dense_replace") or 0), int(text.get("moe_layer_freq") or 1)
        mlp = ["moe" if i >= first and i % every == 0 else "dense" for i in range(n)]
    elif text.get("num_experts") or text.get("num_local_experts"):
        step, only = int(text.get("decoder_sparse_step") or 1), set(text.get("mlp_only_layers") or [])
        mlp = ["moe" if i not in only and (i + 1) % step == 0 else "dense" for i in range(n)]
    types = text.get("layer_types")
    if isinstance(types, list) and len(types) == n:
        return [f"{m}/{t}" for m, t in zip(mlp, types, strict=True)]
    return mlp


def reduce_depth(config: dict[str, Any], layer_ids: list[int]) -> Reduction:
    """Keep the first layer of every kind, the layer each captured id reads (id k is layer k-1's
    output; id 0 layer 0's input), and the last layer: the capture sources (aux for ids inside
    the stack, taps or hooks at its ends) and the layer kinds they read stay what they are at
    full depth."""
    text = config.get("text_config") or config
    n = int(text["num_hidden_layers"])
    kinds = layer_kinds(text)
    keep = {kinds.index(kind) for kind in set(kinds)} | {k - 1 for k in layer_ids if k > 0} | {0, n - 1}
    kept = sorted(keep)
    position = {layer: i for i, layer in enumerate(kept)}
    ids = [0 if k == 0 else position[k - 1] + 1 for k in layer_ids]
    overrides: dict[str, Any] = {"num_hidden_layers": len(kept)}
    if text.get("n_routed_experts") and text.get("first_k_dense_replace"):
        overrides["first_k_dense_replace"] = sum(1 for i in kept if kinds[i].startswith("dense"))
    if text.get("mlp_only_layers"):
        overrides["mlp_only_layers"] = [j for j, i in enumerate(kept) if kinds[i].startswith("dense")]
    if isinstance(text.get("layer_types"), list):
        overrides["layer_types"] = [text["layer_types"][i] for i in kept]
    expected = [kinds[i] for i in kept]
    if layer_kinds({**text, **overrides}) != expected:
        full = list(range(n))
        return Reduction(n, full, list(layer_ids), {}, kinds, why_full="the config's layer pattern")
    nested = {"text_config": overrides} if "text_config" in config else overrides
    return Reduction(n, kept, ids, nested, kinds)


@dataclass
class PreflightReport:
    proven: list[str] = field(default_factory=list)
    not_proven: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)  # by stage, and "total"
    engine_seconds: dict[str, float] = field(default_factory=dict)  # the engine stage's parts
    memory: dict[str, Any] = field(default_factory=dict)  # FullDepthMemory's fields, where estimated
    warnings: list[str] = field(default_factory=list)  # what passes but is likely not what was meant

    def text(self) -> str:
        lines = ["preflight passed", "proven:"]
        lines += [f"  - {p}" for p in self.proven]
        lines += ["not proven:"] + [f"  - {p}" for p in self.not_proven]
        if self.warnings:
            lines += ["warnings:"] + [f"  - {w}" for w in self.warnings]
        times = ", ".join(f"{k} {v:.1f} s" for k, v in self.seconds.items() if k != "total")
        if self.engine_seconds:
            times += " (" + ", ".join(f"{k} {v:.1f} s" for k, v in self.engine_seconds.items()) + ")"
        lines.append(f"time: {self.seconds.get('total', 0):.1f} s ({times})")
        return "\n".join(lines)


def preflight(settings: JobSettings, weights: CheckedWeights | None = None) -> PreflightReport:
    """Run the checks; PreflightReport, or the first failure as an exception (module docstring).
    ``weights``: as ``run`` checked them just before its preflight (checked here otherwise)."""
    log = get_logger(component="preflight")
    report = PreflightReport()
    started = time.monotonic()
    log.info("preflight_started", samples=settings.preflight.samples, backend=settings.backend.name)
    with _stage(report, DATA):
        setup = prepare_run(settings, check_weights=False)  # the weights are the next stage's
        owned = _check_data(setup, report)
    if ignored := ignored_backend_settings(settings):
        report.warnings.append(
            f"ignored: {', '.join(ignored)}: backend.name is {settings.backend.name}, these settings apply "
            "to the other backend only"
        )
    with _stage(report, WEIGHTS):
        checked_by_run = weights is not None
        setup = setup.with_weights(weights or check_model_weights(settings, setup.model))
        report.proven.append(_weights_checked(setup.weights, checked_by_run))
    with _stage(report, OUTPUT):
        from job.storage.probe import probe_output

        report.proven += probe_output(settings.output, settings.work.index)
        report.proven.append(_check_output_settings(setup))
    if settings.backend.name != "vllm":
        report.not_proven.append("the engine: the hf backend loads the weights in process (no preflight)")
    elif owned == 0:
        report.not_proven.append(f"the engine: work index {settings.work.index} owns no samples to send")
    else:
        with _stage(report, ENGINE):
            _check_engine(setup, report, log)
    report.seconds["total"] = round(time.monotonic() - started, 2)
    log.info("preflight_passed", **asdict(report))
    return report


@contextlib.contextmanager
def _timed(seconds: dict[str, float], name: str) -> Iterator[None]:
    started = time.monotonic()
    try:
        yield
    finally:
        seconds[name] = round(time.monotonic() - started, 2)


@contextlib.contextmanager
def _stage(report: PreflightReport, name: str) -> Iterator[None]:
    """Time a stage; an error in it that is no JobError (those name their setting and keep their
    exit code) becomes PreflightFailed naming the stage and the error."""
    with _timed(report.seconds, name):
        try:
            yield
        except JobError:
            raise
        except Exception as exc:
            raise PreflightFailed(
                f"preflight: {name} check failed ({type(exc).__name__}: {exc}); nothing was written "
                "to output.uri"
            ) from exc


def _check_data(setup: RunSetup, report: PreflightReport) -> int:
    """Tokenize this index's first samples as the run would; returns how many it owns of them."""
    settings = setup.settings
    limit = settings.preflight.samples
    records = first_owned(
        read_records(setup.files, int(settings.data.max_record_bytes)),
        settings.work.index,
        settings.work.count,
        limit,
    )
    stream = EncodedStream(
        records,
        setup.encoder,
        index=settings.work.index,
        count=settings.work.count,
        done_ids=set(),
        workers=0,
        prefetch=limit,
    )
    regenerator = setup.regenerator(max_active=limit)
    accepted, tokens, reasons = 0, 0, Counter[str]()
    try:
        for item in stream:
            if isinstance(item, GenerationStart):
                assert regenerator is not None
                regenerator.start(item)
                accepted += 1
            elif isinstance(item, RejectedSample):
                reasons[item.reason] += 1
            elif isinstance(item, EncodedSample):
                accepted += 1
                tokens += item.num_tokens
    finally:
        stream.close()
    if regenerator is not None:  # turns the set-up cannot start (no room left to generate)
        for finished in regenerator.finished:
            if isinstance(finished, RejectedSample):
                reasons[finished.reason] += 1
                accepted -= 1
    owned = stream.stats.owned
    if owned and not accepted:
        common = "; ".join(f"{n} x {r}" for r, n in reasons.most_common(3))
        raise ConfigError(
            f"data: all of the first {owned} samples of index {settings.work.index} were rejected "
            f"({common}); fix the data or settings (data.format, data.chat_template, data.max_length, "
            "model.path)"
        )
    what = f"data: the first {owned} samples of index {settings.work.index}: {accepted} accepted"
    what += (
        f" ({tokens} tokens)"
        if regenerator is None
        else f", their turns to regenerate set up (generate.mode {settings.generate.mode})"
    )
    report.proven.append(what + (f", {sum(reasons.values())} rejected" if reasons else ""))
    return owned


def _weights_checked(weights: CheckedWeights, checked_by_run: bool) -> str:
    """What the weights' check proved, as a report line."""
    by = " (checked by run, before its preflight)" if checked_by_run else ""
    names, shapes = weights.names, weights.shapes
    if names is None or shapes is None:
        return f"weights: {weights.fingerprint}{by}"
    if names.skipped is not None:
        layers = f"; their {names.layers} decoder layers fit config.json" if names.layers is not None else ""
        fit = f"tensor names not compared ({names.skipped}){layers}"
    else:
        layout = f", {names.by_module} by quantized module" if names.by_module else ""
        layers = f", {names.layers} decoder layers" if names.layers is not None else ""
        fit = f"the {names.tensors} tensors' names fit config.json ({names.by_name} by name{layout}{layers})"
    shaped = (
        f"shapes not compared ({shapes.skipped})"
        if shapes.skipped is not None
        else f"{shapes.compared} tensors' shapes fit it"
    )
    return f"weights: the files load; {fit}; {shaped}{by}"


def _check_output_settings(setup: RunSetup) -> str:
    """What an earlier run wrote to this index and output: ConfigError unless it was written with
    this run's settings, data and weights; the report line if so."""
    from job.storage.probe import read_output_records

    settings = setup.settings
    data, claim, location = read_output_records(settings.output, settings.work.index)
    manifest = None if data is None else Manifest.from_bytes(data, location)
    if manifest is not None and starts_over(manifest):
        manifest = None
    check_output_settings(setup.identity, manifest, claim, location)
    if manifest is not None:
        state = "complete" if manifest.complete else "resumed by run"
        return (
            f"output settings: {location} holds {len(manifest.shards)} shard(s) written with these settings, "
            f"data and weights ({state})"
        )
    if claim is not None:
        return (
            "output settings: the output's other indexes were written with these settings, data and weights"
        )
    return f"output settings: nothing committed at {location} yet"


def _check_engine(setup: RunSetup, report: PreflightReport, log: Any) -> None:
    from job.backends.vllm import VllmBackend
    from job.backends.vllm_engine import EngineSpec

    settings, model = setup.settings, setup.model
    reduction = reduce_depth(model.config, setup.layer_ids)
    spec = replace(
        EngineSpec.of(settings, generating=setup.generates),
        dummy_weights=True,
        hf_overrides=reduction.hf_overrides,
        max_cudagraph_capture_size=settings.preflight.max_cudagraph_capture_size,
    )
    log.info(
        "preflight_engine",
        depth=reduction.depth,
        full_depth=reduction.num_layers,
        kept_layers=reduction.kept,
        layer_ids=reduction.layer_ids,
        layer_kinds=sorted(set(reduction.kinds)),
        hf_overrides=reduction.hf_overrides,
    )
    scratch = Path(tempfile.mkdtemp(prefix="eagle3-preflight-"))
    try:
        scratch_settings = settings.model_copy(
            update={
                "output": settings.output.model_copy(update={"uri": str(scratch / "out")}),
                # a few samples: only "none written" says something about the settings
                "data": settings.data.model_copy(update={"max_rejected_fraction": 1.0}),
            }
        )
        parts = report.engine_seconds
        with _timed(parts, "start"):
            backend = VllmBackend(
                spec, replace(model, num_layers=reduction.depth), reduction.layer_ids, setup.dtype
            )
        try:
            with _timed(parts, "pipeline"):
                totals = run_job(
                    scratch_settings,
                    backend=backend,
                    sample_limit=settings.preflight.samples,
                    check_weights=False,
                )
            info, memory = backend.info, backend.memory
        finally:
            with _timed(parts, "stop"):
                backend.close()
        with _timed(parts, "read_back"):
            checked = _read_back(scratch / "out", setup, totals)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    sources = {
        real: info["layer_sources"][str(reduced)]
        for real, reduced in zip(setup.layer_ids, reduction.layer_ids, strict=True)
    }
    _check_sources(sources, info.get("capture"))
    depth = (
        f"{reduction.depth} of {reduction.num_layers} layers (layers {reduction.kept}; kinds "
        f"{', '.join(sorted(set(reduction.kinds)))})"
        if reduction.why_full is None
        else f"all {reduction.num_layers} layers (not reduced: {reduction.why_full})"
    )
    graphs = info.get("cudagraph_capture_sizes")
    report.proven += [
        f"engine: {model.architecture} from its own config.json with dummy weights at {depth}, "
        f"TP={info['tensor_parallel_size']}, vLLM {info['vllm_version']}, adapter set {info['adapter_set']}, "
        f"capture {info['capture']} ({info['model_runner']})"
        + (f", CUDA graphs of batch sizes {graphs}" if graphs else ""),
        f"pipeline: {checked}",
        f"layer sources at full depth: {sources}",
    ]
    estimate = full_depth_memory(memory, reduction)
    report.memory = asdict(estimate)
    report.not_proven += [
        "the weights' values (the engine ran on dummy weights)",
        estimate.check(settings.backend.vllm.gpu_memory_utilization),
    ]


def _read_back(out: Path, setup: RunSetup, totals: dict[str, Any]) -> str:
    from job.shards import iter_output

    layers, hidden = len(setup.layer_ids), setup.model.hidden_size
    samples = tokens = 0
    for sample in iter_output(out, require_complete=True, setting="the preflight's scratch output"):
        t = sample.input_ids.shape[0]
        if tuple(sample.hidden_states.shape) != (t, layers, hidden):
            raise RuntimeError(
                f"sample {sample.sample_id}: hidden states {tuple(sample.hidden_states.shape)}, expected "
                f"({t}, {layers}, {hidden})"
            )
        if not bool(torch.isfinite(sample.hidden_states.float()).all()):
            raise RuntimeError(f"sample {sample.sample_id}: non-finite hidden states")
        samples, tokens = samples + 1, tokens + t
    if samples != totals["written"]:
        raise RuntimeError(f"read back {samples} samples, the run wrote {totals['written']}")
    generated = totals.get("generation")
    regenerated = "" if generated is None else f" (turns regenerated first: {generated})"
    return (
        f"{samples} samples{regenerated}, {tokens} tokens written to a scratch output, read back: "
        f"[T, {layers}, {hidden}] each, all finite; scratch output removed"
    )


def _check_sources(sources: dict[int, str], mode: str | None) -> None:
    allowed = {"hooks": {"hook"}, "compiled": {"aux", "tap"}}.get(mode or "", set())
    wrong = {k: s for k, s in sources.items() if s not in allowed}
    if wrong:
        raise RuntimeError(f"capture mode {mode}: layer ids {wrong} have sources outside {sorted(allowed)}")


@dataclass(frozen=True)
class FullDepthMemory:
    """One rank's memory at the target's full depth, estimated from the reduced engine: each
    kind of decoder layer weighs what the reduced model's layer of that kind weighs, and on a GPU
    the weights the reduced model lacks come out of the KV cache vLLM sized for it. Activations
    and the CUDA graphs the run captures beyond the preflight's are not in it: on an H100 the
    Kimi-class proxy's estimate was 10.9 % (about 0.2 GiB) above the KV cache its run got
    (docs/benchmarks.md). On a CPU build the KV cache is a fixed space (VLLM_CPU_KVCACHE_SPACE)
    beside the weights."""

    device: str
    reduced_weight_bytes: int  # as built
    reduced_kv_cache_bytes: int  # as built
    weight_bytes: int  # at full depth
    kv_cache_bytes: int  # at full depth
    kv_tokens: int  # tokens that KV cache holds at full depth
    max_model_len: int

    def check(self, gpu_memory_utilization: float) -> str:
        """The estimate as a report line; on a GPU, ConfigError where vLLM would find no room for
        one sample's KV cache at full depth (it would stop only after the real model's load)."""
        gib = 1024**3
        weights, built = self.weight_bytes / gib, self.reduced_weight_bytes / gib
        text = (
            f"memory at full depth (estimated from the reduced model, per GPU): weights about "
            f"{weights:.1f} GiB ({built:.1f} GiB built), KV cache about {self.kv_cache_bytes / gib:.1f} "
            f"GiB, about {self.kv_tokens} tokens"
        )
        if self.device != "cuda" or self.kv_tokens >= self.max_model_len:
            return text
        raise PreflightFailed(
            f"preflight: memory: at full depth the weights need about {weights:.1f} GiB per GPU, "
            f"{weights - built:.1f} GiB more than the reduced model the preflight built, which had "
            f"{self.reduced_kv_cache_bytes / gib:.1f} GiB left for its KV cache at "
            f"backend.vllm.gpu_memory_utilization {gpu_memory_utilization}: about {max(self.kv_tokens, 0)} "
            f"tokens would fit at full depth, fewer than one sample of max_model_len {self.max_model_len}, "
            "and vLLM would stop after loading the real weights. Raise backend.vllm.gpu_memory_utilization, "
            "spread the model over more GPUs (backend.tensor_parallel_size), or lower data.max_length"
        )


def full_depth_memory(memory: EngineMemory, reduction: Reduction) -> FullDepthMemory:
    """``memory`` of the reduced engine scaled to the kinds of every layer of the target."""
    kinds = reduction.target_kinds
    built = memory.weight_bytes
    if reduction.why_full is not None:  # the engine was built at full depth
        full, kv_bytes, kv_tokens = built, memory.kv_cache_bytes, memory.kv_tokens
    else:
        by_kind: dict[str, int] = {}
        for kind, size in zip(reduction.kinds, memory.layer_weight_bytes, strict=True):
            by_kind[kind] = max(by_kind.get(kind, 0), size)
        full = built - sum(memory.layer_weight_bytes) + sum(by_kind[kind] for kind in kinds)
        kv_bytes = memory.kv_cache_bytes - (full - built if memory.device == "cuda" else 0)
        per_token = memory.kv_cache_bytes / max(memory.kv_tokens, 1) * len(kinds) / reduction.depth
        kv_tokens = int(kv_bytes // per_token) if per_token else 0
    return FullDepthMemory(
        memory.device, built, memory.kv_cache_bytes, full, kv_bytes, kv_tokens, memory.max_model_len
    )


def preflight_in_subprocess(settings: JobSettings, weights: CheckedWeights) -> PreflightReport:
    """The preflight in a child process (spawned: no CUDA state is shared), which has ended, its
    engine and memory with it, when this returns or raises; ``weights`` as run checked them."""
    context = multiprocessing.get_context("spawn")
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=_child, args=(settings, weights, send), name="preflight")
    process.start()
    send.close()
    try:
        result = receive.recv()
    except EOFError:
        result = None
    process.join()
    if result is None:
        raise JobError(f"the preflight process ended without a result (exit code {process.exitcode})")
    kind, payload = result
    if kind == "passed":
        return PreflightReport(**payload)
    exit_code, message = payload
    error = ConfigError(message) if exit_code == EXIT_CONFIG else JobError(message)
    error.exit_code = exit_code
    raise error


def _child(settings: JobSettings, weights: CheckedWeights, send: Any) -> None:
    configure_logging(settings.log, event_prefix=PREFLIGHT_EVENTS)
    try:
        report = preflight(settings, weights)
    except JobError as exc:
        get_logger(component="preflight").error("preflight_failed", error=str(exc), exit_code=exc.exit_code)
        send.send(("failed", (exc.exit_code, str(exc))))
        return
    except Exception as exc:
        get_logger(component="preflight").exception("preflight_failed", error=f"{type(exc).__name__}: {exc}")
        send.send(("failed", (EXIT_FAILURE, f"preflight: {type(exc).__name__}: {exc}")))
        return
    send.send(("passed", asdict(report)))
