"""The background tokenization stream: same results, in input order, whatever the
number of tokenizer processes; ownership, resume skipping and duplicates per record.

The pipeline tests run with ``tokenizer_workers: 0`` for speed; this is where the
process-pool path (the default) is checked against it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.data.encode import EncodedSample, EncoderSpec, RejectedSample
from job.data.source import list_input_files, read_records
from job.data.stream import CHUNK, EncodedStream, TokenizerProcessDied, owner_index

NUM = 3 * CHUNK + 5  # several chunks, so several workers really interleave


def dataset() -> list[Any]:
    lines: list[Any] = []
    for i in range(NUM):
        lines.append(
            {
                "id": f"r-{i:03d}",
                "messages": [
                    {"role": "user", "content": f"Number {i}?"},
                    {"role": "assistant", "content": f"It is {i}."},
                ],
            }
        )
    lines[10] = "{not json"
    lines[20] = {"id": "r-005", "input_ids": [1, 2]}  # duplicate id of an earlier record
    lines[30] = {"id": "bad-role", "messages": [{"role": "robot", "content": "x"}]}
    return lines


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path]) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("stream") / "s.jsonl", dataset())


@pytest.fixture(scope="module")
def spec(tiny_llama_dir: Path) -> EncoderSpec:
    return EncoderSpec(str(tiny_llama_dir), None, "auto", 256, "truncate", 1024)


def collect(data: Path, spec: EncoderSpec, **kwargs: Any) -> tuple[list[Any], Any]:
    options: dict[str, Any] = {"index": 0, "count": 1, "done_ids": set(), "workers": 0, "prefetch": 64}
    options.update(kwargs)
    stream = EncodedStream(read_records(list_input_files(str(data))), spec, **options)
    try:
        items = list(stream)
    finally:
        stream.close()
    return items, stream.stats


def as_tuples(items: list[Any]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for item in items:
        if isinstance(item, EncodedSample):
            out.append((item.sample_id, item.input_ids.tolist(), item.loss_mask.tolist(), item.truncated))
        else:
            assert isinstance(item, RejectedSample)
            out.append((item.sample_id, item.reason))
    return out


@pytest.fixture(scope="module")
def inline(data: Path, spec: EncoderSpec) -> tuple[list[Any], Any]:
    return collect(data, spec, workers=0)


def test_inline_stream_order_and_rejections(inline: tuple[list[Any], Any]) -> None:
    items, stats = inline
    ids = [i.sample_id for i in items]
    assert ids[:10] == [f"r-{i:03d}" for i in range(10)]
    assert ids[10] == "s.jsonl:11"
    assert len(ids) == NUM and stats.records_seen == stats.owned == NUM
    rejected = {i.sample_id: i.reason for i in items if isinstance(i, RejectedSample)}
    assert set(rejected) == {"s.jsonl:11", "r-005", "bad-role"}
    assert "duplicate" in rejected["r-005"] and stats.duplicates == 1
    # the first r-005 (a conversation) is the one encoded, the later one is the duplicate
    first = next(i for i in items if i.sample_id == "r-005")
    assert isinstance(first, EncodedSample) and first.num_tokens > 2


def test_worker_processes_give_identical_results_in_order(
    data: Path, spec: EncoderSpec, inline: tuple[list[Any], Any]
) -> None:
    pooled, stats = collect(data, spec, workers=2)
    assert as_tuples(pooled) == as_tuples(inline[0])
    assert stats.owned == NUM


def test_owned_slice_and_resume_skip(data: Path, spec: EncoderSpec, inline: tuple[list[Any], Any]) -> None:
    everything = as_tuples(inline[0])
    records = [r.sample_id for r in read_records(list_input_files(str(data)))]
    done = {"r-001", "r-002", "r-005", "r-040"}
    seen: list[tuple[Any, ...]] = []
    for index in range(3):
        items, stats = collect(data, spec, index=index, count=3, done_ids=done)
        owned = [sid for sid in records if owner_index(sid, 3) == index]
        assert stats.owned == len(owned)
        got = as_tuples(items)
        # Done ids are skipped; a duplicate of a done id is still rejected as a duplicate
        # (so a resumed run rejects exactly what the first run rejected).
        expected = [t for t in everything if owner_index(t[0], 3) == index]
        expected = [t for t in expected if not (t[0] in done and len(t) == 4)]
        assert got == expected
        skipped = sum(1 for t in everything if owner_index(t[0], 3) == index and t[0] in done and len(t) == 4)
        assert stats.skipped_done == skipped
        assert stats.owned == stats.skipped_done + len(got)
        seen += got
    assert sorted(t[0] for t in seen) == sorted(
        t[0] for t in everything if not (t[0] in done and len(t) == 4)
    )


def test_close_mid_stream_returns(data: Path, spec: EncoderSpec) -> None:
    # A consumer that stops early (SIGTERM) must be able to close the stream while the
    # producer is blocked on a full queue.
    stream = EncodedStream(
        read_records(list_input_files(str(data))),
        spec,
        index=0,
        count=1,
        done_ids=set(),
        workers=1,
        prefetch=1,
    )
    first = next(iter(stream))
    stream.close()
    assert first.sample_id == "r-000"
    assert not stream._thread.is_alive()
    assert np.all(np.asarray(first.loss_mask)[-2:] == 1)


def test_a_tokenizer_process_killed_mid_stream_ends_it_with_a_clear_error(
    tmp_path: Path, write_jsonl: Callable[..., Path], spec: EncoderSpec
) -> None:
    """What the kernel's OOM killer does to a tokenizer process: the stream ends with an error
    naming the tokenizer processes and what to change, not the pool's bare BrokenProcessPool."""
    import psutil

    records = [
        {
            "id": f"k-{i}",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
        }
        for i in range(100 * CHUNK)
    ]
    data = write_jsonl(tmp_path / "many.jsonl", records)
    stream = EncodedStream(
        read_records(list_input_files(str(data))),
        spec,
        index=0,
        count=1,
        done_ids=set(),
        workers=1,
        prefetch=CHUNK,
    )
    try:
        items = iter(stream)
        next(items)  # the pool is up; the bounded queue holds the producer far from the end
        (tokenizer,) = [
            p for p in psutil.Process().children() if "multiprocessing.spawn" in " ".join(p.cmdline())
        ]
        tokenizer.kill()
        with pytest.raises(
            TokenizerProcessDied, match=r"a tokenizer process \(data.tokenizer_workers\) died"
        ):
            for _ in items:
                pass
    finally:
        stream.close()
