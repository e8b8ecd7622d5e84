"""One work index, in five phases (``python -m job run`` runs it after the preflight: ``job.run``).

resume (what the manifest holds) -> wire (tokenizer stream, backend, feed, committer,
shard writer) -> extract (backend chunks written into their shards) -> commit (every finished
shard listed; a stop signal ends the run here, consistent) -> finish (accounting,
rejected.jsonl, the final manifest, totals). Clean-up runs in reverse order of set-up
whatever happens (job.pipeline.cleanup: a failing step never replaces the run's own error),
and the run's log is shipped last.
"""

from __future__ import annotations

import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass
from typing import Any

from job.backend_io import Backend, Completion
from job.backends import create_backend
from job.data.source import log_skipped, read_records
from job.data.stream import EncodedStream, first_owned
from job.errors import ConfigError, JobError, Terminated
from job.generate.stage import Regenerator
from job.layout import REJECTED, log_name
from job.logs import get_logger, log_file
from job.pipeline.cleanup import Cleanup
from job.pipeline.commit import Committer
from job.pipeline.feed import BackendFeed, ShardPlanner
from job.pipeline.rejections import Rejections, SampleWarnings
from job.pipeline.resume import Resumed, pin_output, resume
from job.pipeline.setup import RunSetup, new_run_id, prepare_run, warn_ignored_settings
from job.pipeline.stop import StopFlag, exit_on_stop_signal
from job.progress import Progress, Snapshot
from job.settings import JobSettings, settings_dump
from job.shards.format import ShardContext
from job.shards.writer import ShardWriter
from job.storage import open_index_store
from job.storage.base import IndexStore


def run_job(
    settings: JobSettings,
    backend: Backend | None = None,
    sample_limit: int | None = None,
    check_weights: bool = True,
) -> dict[str, Any]:
    """Prepare and run one work index (``run_index``). ``check_weights`` False: the model's weight
    files are neither checked nor fingerprinted (the preflight's engine loads none)."""
    return run_index(prepare_run(settings, check_weights), backend, sample_limit)


def run_index(
    setup: RunSetup, backend: Backend | None = None, sample_limit: int | None = None
) -> dict[str, Any]:
    """Run one work index as ``setup`` describes it. A caller-provided ``backend`` (benchmarks
    reuse one engine across runs; the preflight brings its reduced one) is used as is and left
    open. ``sample_limit``: only the index's first so many samples (the preflight's)."""
    settings = setup.settings
    run_id = new_run_id()
    log = get_logger(run_id=run_id, work_index=settings.work.index)
    # Graceful from here on: opening the store may already write to the output (a lock).
    with StopFlag() as stop, open_index_store(settings.output, settings.work.index) as store:
        resumed = resume(setup, store, log)
        if resumed.manifest.complete:
            counts = resumed.manifest.counts
            log.info("index_already_complete", location=store.location, written=counts.written)
            summary = f"done: index {settings.work.index} was already complete at {store.location}"
            return {"status": "already_complete", **counts.model_dump(), "summary": summary}
        return IndexRun(setup, store, resumed, run_id, log, stop, backend, sample_limit).run()


@dataclass
class _Wiring:
    stream: EncodedStream
    backend: Backend
    inputs: BackendFeed
    writer: ShardWriter
    committer: Committer
    rejections: Rejections
    warnings: SampleWarnings
    progress: Progress
    regenerator: Regenerator | None


@dataclass
class _Clock:
    """Monotonic instants of a run's extract and commit phases (for the tail's breakdown)."""

    extract_started: float
    backend_done: float = 0.0
    rows_written: float = 0.0
    committed: float = 0.0


class IndexRun:
    def __init__(
        self,
        setup: RunSetup,
        store: IndexStore,
        resumed: Resumed,
        run_id: str,
        log: Any,
        stop: StopFlag,
        backend: Backend | None,
        sample_limit: int | None = None,
    ) -> None:
        self.setup, self.store, self.resumed = setup, store, resumed
        self.run_id, self.log, self.stop = run_id, log, stop
        self._given_backend = backend
        self.sample_limit = sample_limit
        self.status = "failed"
        self.started = time.monotonic()
        self._wiring: _Wiring | None = None
        stop.on_request = self._report_stop

    def run(self) -> dict[str, Any]:
        with Cleanup(self.log) as cleanup:
            self._open_log(cleanup)
            try:
                wiring = self._wiring = self._wire(cleanup)
                clock = _Clock(extract_started=time.monotonic())
                clock.backend_done = self._extract(wiring)
                clock.rows_written, clock.committed = self._commit(wiring)
                return self._finish(wiring, clock)
            except BaseException as exc:
                if self.status == "failed":
                    self.log.error("run_failed", error=f"{type(exc).__name__}: {exc}")
                raise
        raise AssertionError("unreachable")

    def _open_log(self, cleanup: ExitStack) -> None:
        name = log_name(self.run_id)
        path = self.store.local_path(name)
        log_file.open(path)

        def ship() -> None:
            try:
                log_file.flush()
                self.store.put_file(path, name)
            finally:
                log_file.close()

        cleanup.callback(ship)
        manifest = self.resumed.manifest
        self.log.info(
            "run_started",
            settings=settings_dump(self.setup.settings),
            model_path=str(self.setup.model.path),
            layer_ids=self.setup.layer_ids,
            resumed_shards=len(manifest.shards),
            resumed_samples=self.resumed.written_before,
            output=self.store.location,
            weight_names=None if self.setup.weights.names is None else asdict(self.setup.weights.names),
            weight_shapes=None if self.setup.weights.shapes is None else asdict(self.setup.weights.shapes),
        )
        warn_ignored_settings(self.log, self.setup.settings)
        if self.setup.skipped:
            log_skipped(self.setup.skipped)

    def _wire(self, cleanup: ExitStack) -> _Wiring:
        """Set up every stage, each registered for clean-up as soon as it exists."""
        setup, settings, manifest = self.setup, self.setup.settings, self.resumed.manifest
        rejections = Rejections(self.store.local_path(REJECTED + ".partial"), self.log)
        cleanup.callback(rejections.close)
        warnings = SampleWarnings(self.log)
        stream = self._start_tokenization()  # first: it fills its queue while the engine loads
        cleanup.callback(stream.close)
        backend = self._start_backend(cleanup)
        manifest.backend = backend.info
        manifest.run_ids.append(self.run_id)
        regenerator = self._regenerator(backend)
        context = ShardContext(
            len(setup.layer_ids),
            setup.model.hidden_size,
            setup.dtype,
            setup.shard_metadata(backend.info, self.run_id),
        )
        planner = ShardPlanner(
            int(settings.output.shard_bytes), setup.bytes_per_token, self.resumed.next_shard_number
        )
        inputs = BackendFeed(
            stream.accepted(rejections.add, warnings.add),
            planner,
            context,
            self.store.staging,
            self.stop,
            regenerator,
            rejections.add,
        )
        cleanup.callback(inputs.abandon)  # last: what the committer did not take
        uploads = 1 if self.store.staging_is_output else settings.output.parallel_uploads
        committer = Committer(
            self.store,
            manifest,
            self.resumed.version,
            context,
            rejections.add,
            self.log,
            workers=uploads,
            regenerated=None if regenerator is None else regenerator.take_records,
            pin=lambda: pin_output(setup.identity, self.store),
        )
        cleanup.callback(self._close_committer_if_failed, committer)
        committer.write_manifest()
        writer = ShardWriter(
            context,
            committer.submit,
            direct_io=self.store.staging_is_output,
            threads=settings.output.writer_threads,
        )
        cleanup.callback(writer.close_open)
        cleanup.callback(writer.close, raise_error=False)
        progress = Progress(self.log, settings.log.progress_interval_s)
        cleanup.callback(progress.close)
        return _Wiring(
            stream, backend, inputs, writer, committer, rejections, warnings, progress, regenerator
        )

    def _start_tokenization(self) -> EncodedStream:
        settings = self.setup.settings
        # Its thread and this one both import from transformers, whose lazy module is not safe to
        # populate from two threads at once: resolve what both need here.
        import transformers

        _ = transformers.AutoTokenizer, transformers.AutoModelForCausalLM
        records = read_records(self.setup.files, int(settings.data.max_record_bytes))
        if self.sample_limit is not None:
            records = first_owned(records, settings.work.index, settings.work.count, self.sample_limit)
        return EncodedStream(
            records,
            self.setup.encoder,
            index=settings.work.index,
            count=settings.work.count,
            done_ids=self.resumed.manifest.done_sample_ids(),
            workers=settings.data.tokenizer_workers,
            prefetch=settings.data.prefetch_samples,
        )

    def _start_backend(self, cleanup: ExitStack) -> Backend:
        if self._given_backend is not None:
            return self._given_backend
        setup = self.setup
        with exit_on_stop_signal("engine_startup"):  # vLLM's start-up does not look at the stop flag
            backend = create_backend(
                setup.settings, setup.model, setup.layer_ids, setup.dtype, setup.generates
            )
        cleanup.callback(backend.close)
        return backend

    def _regenerator(self, backend: Backend) -> Regenerator | None:
        """generate.mode other than keep: the stage that has the backend write the turns first."""
        regenerator = self.setup.regenerator(max_active=backend.concurrent_generations)
        if regenerator is not None:
            sampling = regenerator.sampling
            self.log.info(
                "generation_configured",
                mode=regenerator.mode,
                sources=sampling.sources,
                max_active=regenerator.max_active,
                **sampling.record(),
            )
        return regenerator

    def _report_stop(self, reason: str) -> None:
        """``stop_requested``, at once (on its own thread): what the run still finishes before it
        stops, as the stop itself may take minutes (a large shard on a CPU)."""
        w = self._wiring
        if w is None:
            self.log.warning(
                "stop_requested", signal=reason, shards_being_filled=[], shards_being_committed=[]
            )
            return
        committing = w.committer.pending()
        left = w.writer.samples_left()
        filling = [
            {
                "shard": plan.name,
                "samples": len(plan.samples),
                "samples_left": left.get(plan.number, len(plan.samples)),
            }
            for plan in w.inputs.under_way()
            if plan.name not in committing
        ]
        self.log.warning(
            "stop_requested",
            signal=reason,
            shards_being_filled=filling,
            shards_being_committed=sorted(committing),
            next="the backend finishes the samples it has under way and the shards they complete are "
            "committed; what is left is abandoned and redone by the next run; then run_stopped, exit 143",
        )

    def _check_rejections(self, w: _Wiring, records: int, owned: int) -> None:
        """A run that wrote nothing, or rejected more than data.max_rejected_fraction, stops with exit
        2 instead of completing: the data or a setting is wrong, and no retry can help."""
        data, rejected = self.setup.settings.data, w.rejections.count
        where = f"rejected.jsonl ({self.store.location}/{REJECTED})"
        if records == 0:
            raise ConfigError(f"data.path {data.path}: the input holds no records at all")
        if owned == 0:
            self.log.warning(
                "index_owns_no_samples", records=records, work_count=self.setup.settings.work.count
            )
            return
        written = self.resumed.manifest.counts.written
        if written == 0 or rejected / owned > data.max_rejected_fraction:
            w.committer.write_manifest(complete=False, rejected=rejected)
            self.log.error("too_many_rejected", owned=owned, rejected=rejected, written=written)
            self.status = "rejected"
            # No data.max_rejected_fraction accepts an index without a single sample.
            what, accept = (
                ("none was written", "")
                if written == 0
                else (
                    f"more than data.max_rejected_fraction {data.max_rejected_fraction}",
                    ", or raise data.max_rejected_fraction to accept it",
                )
            )
            raise ConfigError(
                f"{rejected} of the {owned} samples of index {self.setup.settings.work.index} were rejected "
                f"({what}); most common reasons: {w.rejections.most_common()}; every one is in {where}. "
                f"Fix the data or settings (data.format, data.chat_template, model.path){accept}"
            )

    def _close_committer_if_failed(self, committer: Committer) -> None:
        if self.status != "failed":
            return
        try:  # keep what was already finished: its shards still get listed
            committer.close()
        except BaseException as exc:
            self.log.error("commit_failed", error=f"{type(exc).__name__}: {exc}")

    def _extract(self, w: _Wiring) -> float:
        """Run the backend over every input; returns when it gave its last rows (monotonic)."""
        input_bytes = max(sum(f.size for f in self.setup.files), 1)
        for item in w.backend.extract(iter(w.inputs)):
            if isinstance(item, Completion):
                assert w.regenerator is not None
                w.regenerator.complete(item)
            else:
                w.writer(item)
            w.progress.maybe_report(
                Snapshot(
                    extracted_tokens=w.writer.tokens,
                    extracted_samples=w.writer.samples,
                    planned_tokens=w.inputs.planned_tokens,
                    input_fraction=min(w.stream.stats.bytes_done / input_bytes, 1.0),
                    all_planned=w.inputs.all_planned,
                    written=w.committer.committed_samples,
                    rejected=w.rejections.count,
                    generated_tokens=0 if w.regenerator is None else w.regenerator.generated_tokens,
                )
            )
            for error in (w.writer.error, w.committer.error):
                if error is not None:
                    raise error
        return time.monotonic()

    def _commit(self, w: _Wiring) -> tuple[float, float]:
        """List every finished shard; returns when the last row was written and when the last
        shard was committed (monotonic). After a stop signal, the open shards are abandoned (their
        samples are redone by the next run) and the run ends here, consistent."""
        w.writer.close()
        rows_written = time.monotonic()
        if not self.stop.is_set():
            w.committer.close()
            return rows_written, time.monotonic()
        w.writer.close_open()
        w.committer.close()
        abandoned = w.inputs.abandon()
        self.status = "terminated"
        self.log.warning(
            "run_stopped",
            signal=self.stop.signal_name,
            committed_shards=len(self.resumed.manifest.shards),
            abandoned_shards=[p.name for p in abandoned],
            abandoned_samples=sum(len(p.samples) for p in abandoned),
        )
        raise Terminated(f"stopped by {self.stop.signal_name}; committed shards are listed, a rerun resumes")

    def _finish(self, w: _Wiring, clock: _Clock) -> dict[str, Any]:
        """Check that every owned sample is accounted for and that the data was usable, then mark
        the index complete."""
        manifest, stats = self.resumed.manifest, w.stream.stats
        written_now = manifest.counts.written - self.resumed.written_before
        accounted = stats.skipped_done + written_now + w.rejections.count
        if stats.owned != accounted:
            raise JobError(
                f"accounting mismatch: this index owns {stats.owned} samples but {accounted} are "
                "written, resumed or rejected"
            )
        w.rejections.publish(self.store)
        self._check_rejections(w, stats.records_seen, stats.owned)
        w.committer.write_manifest(complete=True, rejected=w.rejections.count)
        self.status = "complete"
        now = time.monotonic()
        elapsed, extract_seconds, tokens = now - self.started, now - clock.extract_started, w.writer.tokens
        totals = {
            "status": self.status,
            "written": manifest.counts.written,
            "written_this_run": written_now,
            "rejected": w.rejections.count,
            "truncated": manifest.counts.truncated,
            "shards": len(manifest.shards),
            "tokens": tokens,
            "seconds": round(elapsed, 3),
            "tok_per_s": round(tokens / elapsed, 1) if elapsed > 0 else None,
            # from the backend being ready to its last rows / to the last shard committed
            "backend_seconds": round(clock.backend_done - clock.extract_started, 3),
            "extract_seconds": round(extract_seconds, 3),
            # the part after the backend's last rows: writing the rows left, committing the shards
            # left, then the final manifest and rejected.jsonl
            "tail_write_seconds": round(clock.rows_written - clock.backend_done, 3),
            "tail_commit_seconds": round(clock.committed - clock.rows_written, 3),
            "tail_finish_seconds": round(now - clock.committed, 3),
            "extract_tok_per_s": round(tokens / extract_seconds, 1) if extract_seconds > 0 else None,
            "bytes_written": sum(s.bytes for s in manifest.shards),
            "direct_io_bytes": w.committer.direct_io_bytes,
        }
        if manifest.generation is not None:  # over every run of the index, like "written"
            totals["generation"] = manifest.generation.model_dump()
        if w.warnings.counts:  # this run's samples, by warning
            totals["sample_warnings"] = dict(w.warnings.counts)
        self.log.info("run_finished", **totals)
        totals["summary"] = (
            f"done: index {self.setup.settings.work.index} complete at {self.store.location}: "
            f"{totals['written']} samples written ({written_now} this run), {totals['rejected']} rejected "
            f"(listed in {self.store.location}/{REJECTED}), {totals['shards']} shards"
        )
        if w.warnings.counts:
            totals["summary"] += (
                f"; {w.warnings.counts.total()} written with a warning (sample_warning in the log)"
            )
        return totals
