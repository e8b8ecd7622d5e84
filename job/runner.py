"""``python -m job run``: one work index, end to end.

settings -> model -> input files -> (resume state from the manifest) ->
background tokenization -> shard plans -> backend -> shard writer ->
committer (storage + manifest) -> final manifest, rejected.jsonl, logs.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from job.backends import Backend, BackendInput, HiddenChunk, create_backend
from job.commit import Committer
from job.data.encode import EncodedSample, EncoderSpec, RejectedSample, read_chat_template
from job.data.source import data_fingerprint, list_input_files, read_records
from job.data.stream import EncodedStream
from job.errors import JobError, Terminated
from job.logs import get_logger, log_file
from job.manifest import Identity, Manifest
from job.model import LAYER_CONVENTION, ModelInfo, resolve_model
from job.progress import Progress
from job.settings import JobSettings, settings_dump
from job.shards.format import SAFETENSORS_DTYPES, shard_number
from job.shards.writer import ShardContext, ShardPlan, ShardPlanner, ShardWriter
from job.storage import open_index_store
from job.storage.base import LOGS, MANIFEST, REJECTED, IndexStore

# Everything that decides input_ids and loss masks. Current transformers saves a model's
# chat template to chat_template.jinja (or .json), not inside tokenizer_config.json.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def tokenizer_fingerprint(model: ModelInfo, chat_template: str | None) -> str:
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = model.path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    digest.update(b"template\0" + (chat_template or "").encode())
    return "sha256:" + digest.hexdigest()


def storage_dtype(settings: JobSettings) -> str:
    storage = settings.output.storage
    return settings.model.dtype if storage == "model" else storage


@dataclass
class RunPlan:
    """Everything derived from settings before any model runs (also used by ``plan``)."""

    settings: JobSettings
    model: ModelInfo
    layer_ids: list[int]
    storage: str
    encoder: EncoderSpec
    identity: Identity
    files: list[Any]

    @property
    def bytes_per_token(self) -> int:
        itemsize = SAFETENSORS_DTYPES[self.storage][1]
        per_token = len(self.layer_ids) * self.model.hidden_size * itemsize + 4 + 1
        if self.storage == "fp8_e4m3":
            per_token += 4 * len(self.layer_ids)
        return per_token


def prepare(settings: JobSettings) -> RunPlan:
    model = resolve_model(settings.model)
    layer_ids = model.resolve_layer_ids(settings.layers.ids)
    files = list_input_files(settings.data.path)
    template = read_chat_template(settings.data.chat_template)
    storage = storage_dtype(settings)
    encoder = EncoderSpec(
        tokenizer_path=str(model.path),
        chat_template=template,
        data_format=settings.data.format,
        max_length=settings.data.max_length,
        too_long=settings.data.too_long,
        vocab_size=model.vocab_size,
    )
    identity = Identity(
        model_config_hash=model.config_hash,
        layer_ids=layer_ids,
        storage=storage,
        data_fingerprint=data_fingerprint(files),
        data_format=settings.data.format,
        max_length=settings.data.max_length,
        too_long=settings.data.too_long,
        tokenizer_fingerprint=tokenizer_fingerprint(model, template),
        work_index=settings.work.index,
        work_count=settings.work.count,
    )
    return RunPlan(settings, model, layer_ids, storage, encoder, identity, files)


class _StopFlag:
    """SIGTERM/SIGINT -> stop taking new work; the run then ends consistently."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.signal_name = ""
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _StopFlag:
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum: int, _frame: Any) -> None:
        self.signal_name = signal.Signals(signum).name
        self.event.set()

    def __exit__(self, *_exc: object) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def run_job(settings: JobSettings, backend: Backend | None = None) -> dict[str, Any]:
    """Run one work index. A caller-provided ``backend`` (benchmarks reuse one
    engine across runs) is used as is and left open."""
    run_id = new_run_id()
    log = get_logger(run_id=run_id, work_index=settings.work.index)
    plan = prepare(settings)
    # Graceful from here on: opening the store may already write to the output (a lock).
    with _StopFlag() as stop:
        store = open_index_store(settings.output, settings.work.index)
        try:
            return _run_index(plan, store, run_id, log, stop, backend)
        finally:
            store.close()


def _load_manifest(
    plan: RunPlan, store: IndexStore, backend_info: dict[str, Any]
) -> tuple[Manifest, str | None]:
    data, version = store.read_manifest()
    if data is not None:
        manifest = Manifest.from_bytes(data, store.location)
        manifest.check_resumable(plan.identity, store.location)
        return manifest, version
    model = plan.model
    return Manifest(
        identity=plan.identity,
        model_name=model.name,
        model_path=str(model.path),
        hidden_size=model.hidden_size,
        dtype=model.dtype,
        layer_convention=LAYER_CONVENTION,
        final_layer_prenorm=True,
        backend=backend_info,
    ), None


def _run_index(
    plan: RunPlan, store: IndexStore, run_id: str, log: Any, stop: _StopFlag, given_backend: Backend | None
) -> dict[str, Any]:
    settings = plan.settings
    manifest, version = _load_manifest(plan, store, {})
    if manifest.complete:
        log.info("index_already_complete", location=store.location, written=manifest.counts.written)
        return {"status": "already_complete", **manifest.counts.model_dump()}
    names = store.list_names()
    listed = {s.name for s in manifest.shards}
    keep = listed | {MANIFEST, REJECTED}
    for name in names:
        if name not in keep and not name.startswith(LOGS + "/"):
            store.discard(name)
    log_path = store.local_path(f"{LOGS}/{run_id}.jsonl")
    log_file.open(log_path)
    started = time.monotonic()
    written_before = manifest.counts.written
    log.info(
        "run_started",
        settings=settings_dump(settings),
        model_path=str(plan.model.path),
        layer_ids=plan.layer_ids,
        resumed_shards=len(manifest.shards),
        resumed_samples=written_before,
        output=store.location,
    )
    rejections = _Rejections(store.local_path(REJECTED + ".partial"), log)
    backend: Backend | None = None
    stream: EncodedStream | None = None
    committer: Committer | None = None
    writer: ShardWriter | None = None
    route: _ChunkRouter | None = None
    status = "failed"
    try:
        # Tokenization starts first: it fills its queue while the engine loads. Its
        # thread and this one both import from transformers, whose lazy module is not
        # safe to populate from two threads at once: resolve what both need here.
        import transformers

        _ = transformers.AutoTokenizer, transformers.AutoModelForCausalLM
        stream = EncodedStream(
            read_records(plan.files),
            plan.encoder,
            index=settings.work.index,
            count=settings.work.count,
            done_ids=manifest.done_sample_ids(),
            workers=settings.data.tokenizer_workers,
            prefetch=settings.data.prefetch_samples,
        )
        backend = given_backend or create_backend(settings, plan.model, plan.layer_ids, plan.storage)
        manifest.backend = backend.info
        manifest.run_ids.append(run_id)
        context = ShardContext(
            num_layers=len(plan.layer_ids),
            hidden_size=plan.model.hidden_size,
            storage_dtype=plan.storage,
            metadata=_shard_metadata(plan, backend.info, run_id),
        )
        committer = Committer(store, manifest, version, context, rejections.add, log)
        committer.write_manifest()
        writer = ShardWriter(
            context, store.shard_staging_path, committer.submit, direct_io=store.staging_is_output
        )
        planner = ShardPlanner(
            int(settings.output.shard_bytes),
            plan.bytes_per_token,
            max((n for name in names if (n := shard_number(name)) is not None), default=-1) + 1,
        )
        progress = Progress(log, settings.log.progress_interval_s, sum(f.size for f in plan.files))
        route = _ChunkRouter(writer, progress, settings.output.writer_threads)
        inputs = _backend_inputs(stream, planner, writer, store, rejections.add, stop)
        extract_started = time.monotonic()
        for chunk in backend.extract(inputs):
            route(chunk)
            progress.maybe_report(stream.stats.bytes_done, committer.committed_samples, rejections.count)
            for error in (route.error, committer.error):
                if error is not None:
                    raise error
        backend_seconds = time.monotonic() - extract_started
        route.close()
        if stop.event.is_set():
            abandoned = _abandon_open(writer, store)
            committer.close()
            status = "terminated"
            log.warning(
                "run_stopped",
                signal=stop.signal_name,
                committed_shards=len(manifest.shards),
                abandoned_shards=[p.name for p in abandoned],
                abandoned_samples=sum(len(p.samples) for p in abandoned),
            )
            raise Terminated(f"stopped by {stop.signal_name}; committed shards are listed, a rerun resumes")
        committer.close()
        stats = stream.stats
        accounted = stats.skipped_done + (manifest.counts.written - written_before) + rejections.count
        if stats.owned != accounted:
            raise JobError(
                f"accounting mismatch: this index owns {stats.owned} samples but {accounted} are "
                "written, resumed or rejected"
            )
        rejections.publish(store)
        committer.write_manifest(complete=True, rejected=rejections.count)
        status = "complete"
        now = time.monotonic()
        elapsed, extract_seconds = now - started, now - extract_started
        totals = {
            "status": status,
            "written": manifest.counts.written,
            "written_this_run": manifest.counts.written - written_before,
            "rejected": rejections.count,
            "truncated": manifest.counts.truncated,
            "shards": len(manifest.shards),
            "tokens": progress.tokens,
            "seconds": round(elapsed, 3),
            "tok_per_s": round(progress.tokens / elapsed, 1) if elapsed > 0 else None,
            # from the backend being ready to its last rows / to the last shard committed
            "backend_seconds": round(backend_seconds, 3),
            "extract_seconds": round(extract_seconds, 3),
            "extract_tok_per_s": round(progress.tokens / extract_seconds, 1) if extract_seconds > 0 else None,
            "bytes_written": sum(s.bytes for s in manifest.shards),
            "direct_io_bytes": committer.direct_io_bytes,
        }
        log.info("run_finished", **totals)
        return totals
    except BaseException as exc:
        if status == "failed":
            log.error("run_failed", error=f"{type(exc).__name__}: {exc}")
        raise
    finally:
        if stream is not None:
            stream.close()
        if route is not None:
            route.close(raise_error=False)
        if writer is not None:
            _abandon_open(writer, store)
        if committer is not None and status == "failed":
            try:  # keep what was already finished: its shards still get listed
                committer.close()
            except BaseException as exc:
                log.error("commit_failed", error=f"{type(exc).__name__}: {exc}")
        if backend is not None and given_backend is None:
            backend.close()
        rejections.close()
        log_file.flush()
        store.put_file(log_path, f"{LOGS}/{run_id}.jsonl")
        log_file.close()


def _abandon_open(writer: ShardWriter, store: IndexStore) -> list[ShardPlan]:
    abandoned = writer.abandon_open()
    for shard_plan in abandoned:
        store.release_staging(shard_plan.name)
    return abandoned


class _Rejections:
    """rejected.jsonl: written as samples are rejected, published when the run completes."""

    def __init__(self, path: Path, log: Any) -> None:
        self.path = path
        self._file = path.open("w", encoding="utf-8")
        self._lock = threading.Lock()
        self._log = log
        self.count = 0

    def add(self, sample_id: str, reason: str) -> None:
        with self._lock:
            self.count += 1
            self._file.write(
                json.dumps({"sample_id": sample_id, "reason": reason}, ensure_ascii=False) + "\n"
            )
        self._log.warning("sample_rejected", sample_id=sample_id, reason=reason)

    def publish(self, store: IndexStore) -> None:
        self.close()
        store.put_file(self.path, REJECTED)

    def close(self) -> None:
        with self._lock:
            if not self._file.closed:
                self._file.close()


class _ChunkRouter:
    """Backend chunks -> shard rows, written by a small thread pool so the
    backend's loop never waits on the disk; a sample is finished once all its
    rows are written, and rejected if any row was non-finite."""

    NONFINITE = "non-finite hidden states (NaN or Inf); not written"
    MAX_IN_FLIGHT = 256  # chunks handed to writer threads but not yet written

    def __init__(self, writer: ShardWriter, progress: Progress, threads: int) -> None:
        self._writer = writer
        self._progress = progress
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="shard-writer")
        self._slots = threading.BoundedSemaphore(self.MAX_IN_FLIGHT)
        self._lock = threading.Lock()
        self._outstanding: dict[int, int] = {}
        self._complete: set[int] = set()  # keys whose last chunk has arrived
        self._bad: set[int] = set()
        self.error: BaseException | None = None

    def __call__(self, chunk: HiddenChunk) -> None:
        with self._lock:
            self._outstanding[chunk.key] = self._outstanding.get(chunk.key, 0) + 1
            if chunk.nonfinite:
                self._bad.add(chunk.key)
            if chunk.last:
                self._complete.add(chunk.key)
        self._progress.tokens += int(chunk.rows.shape[0])
        self._progress.samples += chunk.last
        self._slots.acquire()
        self._pool.submit(self._write, chunk)

    def _write(self, chunk: HiddenChunk) -> None:
        try:
            if self.error is None:
                self._writer.write_rows(
                    chunk.key,
                    chunk.start,
                    chunk.rows.view(torch.uint8).numpy().data,
                    None if chunk.scales is None else chunk.scales.numpy().tobytes(),
                )
        except BaseException as exc:
            self.error = exc
        finally:
            if chunk.release is not None:
                chunk.release()
            self._slots.release()
        with self._lock:
            self._outstanding[chunk.key] -= 1
            finished = self._outstanding[chunk.key] == 0 and chunk.key in self._complete
            if finished:
                del self._outstanding[chunk.key]
                self._complete.discard(chunk.key)
                failed = chunk.key in self._bad
                self._bad.discard(chunk.key)
        if finished and self.error is None:
            try:
                self._writer.finish_sample(chunk.key, self.NONFINITE if failed else None)
            except BaseException as exc:
                self.error = exc

    def close(self, raise_error: bool = True) -> None:
        self._pool.shutdown(wait=True)
        if raise_error and self.error is not None:
            raise self.error


def _backend_inputs(
    stream: EncodedStream,
    planner: ShardPlanner,
    writer: ShardWriter,
    store: IndexStore,
    reject: Any,
    stop: _StopFlag,
) -> Iterator[BackendInput | None]:
    next_key = 0

    def start(shard_plan: Any) -> Iterator[BackendInput | None]:
        nonlocal next_key
        # While staging is full, hand the backend None ("nothing new yet") instead of
        # blocking: it may hold unfinished samples whose shards must complete (and
        # upload) before space frees up.
        while not store.reserve_staging(shard_plan.name, writer.layout(shard_plan).total_bytes, 0.05):
            yield None
        keys = writer.open(shard_plan, next_key)
        next_key += len(keys)
        for key, sample in zip(keys, shard_plan.samples, strict=True):
            yield BackendInput(key, sample.input_ids)

    for item in stream:
        if stop.event.is_set():
            return
        if isinstance(item, RejectedSample):
            reject(item.sample_id, item.reason)
            continue
        assert isinstance(item, EncodedSample)
        for shard_plan in planner.add(item):
            yield from start(shard_plan)
    if stop.event.is_set():
        return
    for shard_plan in planner.flush():
        yield from start(shard_plan)


def _shard_metadata(plan: RunPlan, backend_info: dict[str, Any], run_id: str) -> dict[str, str]:
    model = plan.model
    return {
        "layer_ids": json.dumps(plan.layer_ids),
        "layer_convention": LAYER_CONVENTION,
        "final_layer_prenorm": "true",
        "model_path": str(model.path),
        "model_name": model.name,
        "model_config_hash": model.config_hash,
        "model_dtype": model.dtype,
        "dtype": plan.storage,
        "storage": "fp8_e4m3" if plan.storage == "fp8_e4m3" else "model",
        "hidden_size": str(model.hidden_size),
        "num_model_layers": str(model.num_layers),
        "backend": str(backend_info.get("backend", "")),
        "backend_info": json.dumps(backend_info),
        "data_fingerprint": plan.identity.data_fingerprint,
        "work_index": str(plan.identity.work_index),
        "work_count": str(plan.identity.work_count),
        "run_id": run_id,
    }
