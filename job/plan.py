"""``python -m job plan``: what this index will produce, before any model runs."""

from __future__ import annotations

from job.data.encode import EncodedSample
from job.data.source import read_records
from job.data.stream import EncodedStream
from job.runner import prepare
from job.settings import JobSettings
from job.shards.writer import ShardPlanner


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError


def plan_index(settings: JobSettings) -> str:
    plan = prepare(settings)
    stream = EncodedStream(
        read_records(plan.files),
        plan.encoder,
        index=settings.work.index,
        count=settings.work.count,
        done_ids=set(),
        workers=settings.data.tokenizer_workers,
        prefetch=settings.data.prefetch_samples,
    )
    planner = ShardPlanner(int(settings.output.shard_bytes), plan.bytes_per_token, 0)
    samples = tokens = truncated = rejected = shards = 0
    try:
        for item in stream:
            if not isinstance(item, EncodedSample):
                rejected += 1
                continue
            samples += 1
            tokens += item.num_tokens
            truncated += item.truncated
            shards += sum(1 for _ in planner.add(item))
        shards += sum(1 for _ in planner.flush())
    finally:
        stream.close()
    model = plan.model
    rows = [
        ("work index", f"{settings.work.index} of {settings.work.count}"),
        (
            "model",
            f"{model.name} ({model.architecture}, {model.num_layers} layers, hidden {model.hidden_size})",
        ),
        ("layer ids", str(plan.layer_ids)),
        ("input records", f"{stream.stats.records_seen} ({stream.stats.owned} owned by this index)"),
        ("samples", f"{samples} ({truncated} truncated to {settings.data.max_length} tokens)"),
        ("rejected", str(rejected)),
        ("tokens", str(tokens)),
        (
            "bytes per token",
            f"{plan.bytes_per_token} ({len(plan.layer_ids)} layers x {model.hidden_size} x {plan.storage}"
            " + ids and mask)",
        ),
        ("output bytes", _human(tokens * plan.bytes_per_token)),
        ("shards", f"{shards} of about {_human(int(settings.output.shard_bytes))}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
