"""``python -m job.benchmarks.regeneration``: a regenerating run against its own parts, on one engine.

One vLLM engine (the job's backend, built once) does, per round and in this order:

* ``regenerate_generation``: the regeneration stage alone (every turn of every conversation
  generated through the backend, nothing extracted);
* ``regenerate_extraction``: ``python -m job run`` (``generate.mode: keep``) extracting the
  sequences that generation produced, pre-tokenized, into shards;
* ``regenerate_job``: ``python -m job run`` regenerating and extracting the same conversations
  (``generate.mode``), into shards.

``regenerate_job`` carries ``seconds`` and ``parts_seconds`` (the other two rows' seconds added
up) and their ratio; seconds are the run's ``extract_seconds`` (from the engine being ready to the
last shard committed) and, for generation alone, from its first turn to its last. Seeded
sampling makes the job's samples the ones generated alone (``same_samples`` counts them).
Every row also counts its engine steps that ran tokens (``engine_steps``): on a shared machine the
seconds move with the load and the steps do not, and on a small model a step costs about the same
whatever it holds. ``--trace`` prints, per engine step of the job's run, how many generation and extraction
requests it held: where extraction waited on generation shows there.

Defaults fit a CPU build of vLLM and a builtin tiny model (the ratio is the CPU proxy of a GPU
run's); rows are appended to ``--out``/results.jsonl and printed as a markdown table.

On a GPU, ``--bench-model`` takes a real architecture's config with vLLM's dummy weights (the models of
``python -m job bench``) and ``--user-tokens`` one-turn conversations of that median length, as the
GPU runs of docs/benchmarks.md, e.g.::

    python -m job.benchmarks.regeneration --bench-model llama-3.1-8b --user-tokens 600 \
        --conversations 200 --user-turns 1 --mode last_turn --max-new-tokens 512 --temperature 0.7 \
        --dtype bfloat16 --compiled --max-num-seqs 128 --max-num-batched-tokens 16384 \
        --max-length 8192 --shard-bytes 2GiB --engine-args '{}' --gpu-memory-utilization 0.7

Every turn the job's backend generated alone goes to ``<work-dir>/generation_requests.jsonl``, so
that ``python -m job bench --groups regenerate_plain --work-dir <work-dir>`` times plain
``LLM.generate`` on the same requests and seeds.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.backend_io import Completion, GenerationInput
from job.data.encode import EncodedSample, GenerationStart
from job.worker.ring import GENERATION_PREFIX


def _conversations(path: Path, count: int, user_turns: int) -> None:
    """``count`` conversations of ``user_turns`` user turns each, the assistant's to regenerate."""
    with path.open("w") as f:
        for i in range(count):
            messages: list[dict[str, str]] = [{"role": "system", "content": "Answer briefly."}]
            for turn in range(user_turns):
                question = f"Question {i}.{turn}: why is the sky blue?" + " Explain it again." * (i % 4)
                messages += [{"role": "user", "content": question}, {"role": "assistant", "content": "So."}]
            f.write(json.dumps({"id": f"c-{i:04d}", "messages": messages}) + "\n")


def _settings(args: argparse.Namespace, data: Path, out: Path, generating: bool) -> Any:
    from job.settings import load_settings

    cli = [
        f"--model.path={args.model_dir}",
        f"--model.dtype={args.dtype}",
        f"--data.path={data}",
        f"--data.max_length={args.max_length}",
        "--data.tokenizer_workers=0",
        "--backend.name=vllm",
        f"--backend.vllm.enforce_eager={not args.compiled}",
        f"--backend.vllm.max_num_batched_tokens={args.max_num_batched_tokens}",
        f"--backend.vllm.max_num_seqs={args.max_num_seqs}",
        f"--backend.vllm.engine_args={args.engine_args}",
        f"--output.uri={out}",
        f"--output.shard_bytes={args.shard_bytes}",
        f"--log.level={args.log_level}",
    ]
    if args.gpu_memory_utilization:
        cli.append(f"--backend.vllm.gpu_memory_utilization={args.gpu_memory_utilization}")
    if generating:
        cli += [
            "--data.format=openai",
            f"--generate.mode={args.mode}",
            f"--generate.temperature={args.temperature}",
            f"--generate.max_new_tokens={args.max_new_tokens}",
            "--generate.seed=7",
        ]
    else:
        cli += ["--data.format=tokenized"]
    return load_settings(cli_args=cli)


@dataclass
class Generated:
    """What ``regenerate_only`` did: seconds from the first turn to the last, the finished samples,
    the turns asked for (in order) and the tokens generated for them."""

    seconds: float
    samples: list[EncodedSample]
    asked: list[GenerationInput]
    tokens: int


def regenerate_only(setup: Any, backend: Any) -> Generated:
    """Every conversation of ``setup``'s data regenerated through ``backend``, nothing extracted:
    the job's regeneration stage, fed as fast as the engine takes turns. Returns the seconds from
    the first turn to the last, the finished samples and the turns asked for, in order."""
    from job.data.source import read_records

    regenerator = setup.regenerator(max_active=backend.concurrent_generations)
    records = list(read_records(setup.files, int(setup.settings.data.max_record_bytes)))
    starts: deque[GenerationStart] = deque()
    for record in records:
        start = regenerator.encoder.encode(record.sample_id, record.value, record.error)
        if not isinstance(start, GenerationStart):
            raise RuntimeError(f"sample {record.sample_id} was not regenerated: {start}")
        starts.append(start)

    asked: list[GenerationInput] = []

    def feed() -> Iterator[GenerationInput | None]:
        while True:
            while regenerator.ready:
                asked.append(regenerator.ready.popleft())
                yield asked[-1]
            if starts and regenerator.has_room:
                regenerator.start(starts.popleft())
                continue
            if not (starts or regenerator.active):
                return
            yield None  # turns in flight: the backend runs them

    started = time.perf_counter()
    tokens = 0
    for item in backend.extract(feed()):
        assert isinstance(item, Completion)
        tokens += len(item.token_ids)
        regenerator.complete(item)
    seconds = time.perf_counter() - started
    samples = [s for s in regenerator.finished if isinstance(s, EncodedSample)]
    if len(samples) != len(records):
        raise RuntimeError(f"{len(records) - len(samples)} conversations were not regenerated")
    return Generated(seconds, samples, asked, tokens)


def _write_requests(requests: list[GenerationInput], path: Path) -> None:
    """The turns as ``python -m job bench --groups regenerate_plain`` reads them."""
    with path.open("w") as f:
        for r in requests:
            line = {"prompt": r.prompt_ids.tolist(), "max_new_tokens": r.max_new_tokens, "seed": r.seed}
            f.write(json.dumps(line) + "\n")


def _write_tokenized(samples: list[EncodedSample], path: Path) -> None:
    with path.open("w") as f:
        for s in samples:
            record = {"id": s.sample_id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist()}
            f.write(json.dumps(record) + "\n")


class StepTrace:
    """Per scheduled step of the backend: (seconds since start, generation requests, extraction
    requests, extraction tokens). Wraps the scheduler's ``schedule``."""

    def __init__(self, backend: Any) -> None:
        self.rows: list[tuple[float, int, int, int]] = []
        self._scheduler = backend.scheduler
        self._schedule = backend.scheduler.schedule
        self._started = time.perf_counter()

        def schedule(*args: Any, **kwargs: Any) -> Any:
            output = self._schedule(*args, **kwargs)
            counts = output.num_scheduled_tokens
            generation = sum(1 for r in counts if r.startswith(GENERATION_PREFIX))
            extraction = {r: n for r, n in counts.items() if not r.startswith(GENERATION_PREFIX)}
            self.rows.append(
                (time.perf_counter() - self._started, generation, len(extraction), sum(extraction.values()))
            )
            return output

        backend.scheduler.schedule = schedule

    def __enter__(self) -> StepTrace:
        return self

    def __exit__(self, *_exc: object) -> None:
        self._scheduler.schedule = self._schedule

    @property
    def steps(self) -> int:
        """Steps that ran tokens."""
        return sum(1 for row in self.rows if row[1] or row[3])

    def summary(self) -> dict[str, Any]:
        """Steps with generation only, extraction only, or both, and the seconds spent in each."""
        names = ("generation_only", "extraction_only", "both", "empty")
        kinds: dict[str, list[float]] = {k: [0, 0.0] for k in names}
        for (t, gen, ext, _), nxt in zip(self.rows, [*self.rows[1:], None], strict=True):
            kind = ("both" if ext else "generation_only") if gen else ("extraction_only" if ext else "empty")
            kinds[kind][0] += 1
            kinds[kind][1] += (nxt[0] - t) if nxt else 0.0
        return {k: {"steps": int(n), "seconds": round(s, 3)} for k, (n, s) in kinds.items()}

    def timeline(self, buckets: int = 20) -> list[str]:
        """The run cut into ``buckets`` stretches: generation requests and extraction tokens per step."""
        if not self.rows:
            return []
        end = self.rows[-1][0] or 1.0
        lines = []
        for b in range(buckets):
            lo, hi = end * b / buckets, end * (b + 1) / buckets
            rows = [r for r in self.rows if lo <= r[0] < hi or (b == buckets - 1 and r[0] == end)]
            if not rows:
                lines.append(f"{lo:7.2f}s  no step scheduled")
                continue
            gen = sum(r[1] for r in rows) / len(rows)
            ext = sum(r[3] for r in rows) / len(rows)
            lines.append(
                f"{lo:7.2f}s  {len(rows):4d} steps  {gen:6.1f} generating  {ext:7.1f} extraction tokens/step"
            )
        return lines


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    from job.backends import create_backend
    from job.benchmarks.throughput import model_runner_label
    from job.logs import configure_logging
    from job.pipeline.runner import run_job
    from job.pipeline.setup import prepare_run
    from job.shards import iter_output

    work = Path(args.work_dir)
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    data = work / "conversations.jsonl"
    if args.bench_model:
        args.model_dir = _bench_model(args, data)
    else:
        args.model_dir = args.model
        _conversations(data, args.conversations, args.user_turns)
    settings = _settings(args, data, work / "out-job", generating=True)
    configure_logging(settings.log)
    setup = prepare_run(settings)
    backend = create_backend(settings, setup.model, setup.layer_ids, setup.dtype, setup.generates)
    rows: list[dict[str, Any]] = []
    try:
        warm_setup = prepare_run(_settings(args, _head(data, work, 4), work / "out-warm", generating=True))
        regenerate_only(warm_setup, backend)
        common = {
            "model": args.bench_model or args.model,
            "dummy_weights": bool(args.bench_model),
            "vllm": backend.vllm_version,
            "model_runner": model_runner_label(str(backend.info.get("model_runner") or "")),
            "device": backend.vllm_config.device_config.device_type,
            "conversations": args.conversations,
            "user_turns": args.user_turns,
            "max_new_tokens": args.max_new_tokens,
            "shard_bytes": args.shard_bytes,
            "max_num_seqs": args.max_num_seqs,
            "label": args.label,
        }
        for round_ in range(args.rounds):
            with StepTrace(backend) as generation_trace:
                generated = regenerate_only(setup, backend)
            samples = generated.samples
            if round_ == 0:
                _write_requests(generated.asked, work / "generation_requests.jsonl")
            tokenized = work / f"regenerated-{round_}.jsonl"
            _write_tokenized(samples, tokenized)
            extraction_out = work / f"out-extract-{round_}"
            with StepTrace(backend) as extraction_trace:
                extraction = run_job(_settings(args, tokenized, extraction_out, generating=False), backend)
            job_out = work / f"out-job-{round_}"
            with StepTrace(backend) as trace:
                job = run_job(_settings(args, data, job_out, generating=True), backend)
            alone = {s.sample_id: s.input_ids for s in samples}
            written = {s.sample_id: s.input_ids.numpy() for s in iter_output(job_out)}
            same = sum(1 for k, ids in written.items() if k in alone and (alone[k] == ids).all())
            parts = generated.seconds + extraction["extract_seconds"]
            parts_steps = generation_trace.steps + extraction_trace.steps
            sequence_tokens = sum(len(s.input_ids) for s in samples)
            load = {"load_average": round(os.getloadavg()[0], 1)}  # the machine's, at the round's end
            rows += [
                {
                    **common,
                    **load,
                    "config": "regenerate_generation",
                    "round": round_,
                    "seconds": round(generated.seconds, 3),
                    "generated_tokens": generated.tokens,
                    "tok_per_s": round(generated.tokens / generated.seconds, 1),
                    "engine_steps": generation_trace.steps,
                    "notes": "the regeneration stage alone on the job's engine, nothing extracted",
                },
                {
                    **common,
                    **load,
                    "config": "regenerate_extraction",
                    "round": round_,
                    "seconds": extraction["extract_seconds"],
                    "engine_steps": extraction_trace.steps,
                    "tokens": extraction["tokens"],
                    "shards": extraction["shards"],
                    "notes": "python -m job run, generate.mode keep, on the sequences generation produced",
                },
                {
                    **common,
                    **load,
                    "config": "regenerate_job",
                    "round": round_,
                    "seconds": job["extract_seconds"],
                    "parts_seconds": round(parts, 3),
                    "ratio_to_parts": round(job["extract_seconds"] / parts, 3),
                    "engine_steps": trace.steps,
                    "parts_engine_steps": parts_steps,
                    "steps_ratio_to_parts": round(trace.steps / parts_steps, 3),
                    "tokens": job["tokens"],
                    "sequence_tokens": sequence_tokens,
                    "shards": job["shards"],
                    "samples": job["written"],
                    "same_samples": same,
                    "steps": trace.summary(),
                    "notes": f"python -m job run, generate.mode {args.mode}, generating and extracting on "
                    "one engine; parts_seconds: regenerate_generation + regenerate_extraction of the round",
                },
            ]
            if args.trace:
                print(f"round {round_}: the job's steps over its run", file=sys.stderr)
                for line in trace.timeline():
                    print("  " + line, file=sys.stderr)
            for out in (extraction_out, job_out):
                shutil.rmtree(out, ignore_errors=True)
    finally:
        backend.close()
    return rows


def _bench_model(args: argparse.Namespace, data: Path) -> Path:
    """A real architecture's config (vLLM's dummy weights) with the tiny Llama's tokenizer and chat
    template, and ``--conversations`` one-turn conversations of lognormal user turns: the model and
    data of ``python -m job bench``'s regeneration groups."""
    from job.benchmarks import throughput

    if args.user_turns != 1:
        raise SystemExit("--bench-model: conversations have one user turn (--user-turns 1)")
    model_dir, _ = throughput.chat_model(args.bench_model, data.parent)
    throughput.one_turn_conversations(
        model_dir, data, args.conversations, args.user_tokens, args.max_length // 2
    )
    return model_dir


def _head(data: Path, work: Path, count: int) -> Path:
    head = work / "warm.jsonl"
    head.write_text("".join(data.read_text().splitlines(keepends=True)[:count]))
    return head


def main(argv: list[str] | None = None) -> int:
    from job.benchmarks.throughput import MODELS

    ap = argparse.ArgumentParser(
        prog="python -m job.benchmarks.regeneration", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="builtin:tiny-chatml")
    ap.add_argument(
        "--bench-model",
        choices=sorted(k for k, v in MODELS.items() if v is not None),
        help="instead of --model: this architecture with vLLM's dummy weights (GPU runs)",
    )
    ap.add_argument("--user-tokens", type=int, default=600, help="--bench-model: median user-turn tokens")
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.0, help="0: the job's default")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--mode", default="all_turns", choices=["all_turns", "last_turn"])
    ap.add_argument("--conversations", type=int, default=48)
    ap.add_argument("--user-turns", type=int, default=2, help="user turns per conversation")
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=0.8)
    ap.add_argument("--max-length", type=int, default=1024)
    ap.add_argument("--max-num-seqs", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--shard-bytes", default="256KiB")
    ap.add_argument("--compiled", action="store_true", help="vLLM's compilation (default: eager mode)")
    ap.add_argument("--engine-args", default='{"block_size": 16}', help="backend.vllm.engine_args (JSON)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the commit measured)")
    ap.add_argument("--trace", action="store_true", help="print the job's steps over time")
    ap.add_argument("--work-dir", default="/tmp/eagle3-regenerate-bench")
    ap.add_argument("--out", default="", help="results.jsonl goes here (none: print only)")
    ap.add_argument("--log-level", default="warning")
    args = ap.parse_args(argv)
    if args.bench_model:
        args.engine_args = json.dumps({**json.loads(args.engine_args), "load_format": "dummy"})
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rows = run(args)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for row in rows:
        row["run_id"] = run_id
    if args.out:
        with (Path(args.out) / "results.jsonl").open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    print("| round | config | seconds | parts s | × parts | engine steps | × parts' steps | same samples |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        print(
            f"| {row['round']} | {row['config']} | {row['seconds']} | {row.get('parts_seconds', '')} "
            f"| {row.get('ratio_to_parts', '')} | {row['engine_steps']} "
            f"| {row.get('steps_ratio_to_parts', '')} | {row.get('same_samples', '')} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
