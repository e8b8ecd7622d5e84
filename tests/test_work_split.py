"""Work split: with work.count = 3, indexes 0, 1 and 2 (run side by side into one
output, as Kubernetes' Indexed Job does) cover every record exactly once, and a rerun
splits identically.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from job.data.source import list_input_files, read_records
from job.data.stream import owner_index
from job.shards import iter_output, open_shard, read_manifest

COUNT = 3


def dataset() -> list[Any]:
    lines: list[Any] = []
    for i in range(18):
        record: dict[str, Any] = {
            "messages": [
                {"role": "user", "content": f"Item {i}?"},
                {"role": "assistant", "content": f"Answer {i}."},
            ]
        }
        if i % 3:  # a third without an id: they are split by "<file>:<line>"
            record["id"] = f"s-{i}"
        lines.append(record)
    lines += [
        '{"id": "broken",',  # malformed: rejected by whichever index owns "split.jsonl:19"
        {"id": "no-answer", "messages": [{"role": "user", "content": "?"}]},
        {"id": "tok", "input_ids": [1, 2, 3]},
    ]
    return lines


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path]) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("split") / "split.jsonl", dataset())


@pytest.fixture(scope="module")
def all_ids(data: Path) -> list[str]:
    ids = [r.sample_id for r in read_records(list_input_files(str(data)))]
    assert len(ids) == len(dataset()) == len(set(ids))
    return ids


def run_all_indexes(out: Path, data: Path, job_env: dict[str, str], fast_args: tuple[str, ...]) -> None:
    """Indexes 0..2 concurrently; index 2 gets its slice the Kubernetes way (env)."""
    procs = []
    for index in range(COUNT):
        args = [sys.executable, "-m", "job", "run", f"--data.path={data}", f"--output.uri={out}", *fast_args]
        env = dict(job_env)
        if index == COUNT - 1:
            env.update(JOB_COMPLETION_INDEX=str(index), JOB_COMPLETION_COUNT=str(COUNT))
        else:
            args += [f"--work.index={index}", f"--work.count={COUNT}"]
        procs.append(
            subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    for index, proc in enumerate(procs):
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, (
            f"index {index}: rc={proc.returncode}\n{stdout[-3000:]}\n{stderr[-3000:]}"
        )


@pytest.fixture(scope="module")
def outputs(
    tmp_path_factory: pytest.TempPathFactory,
    data: Path,
    job_env: dict[str, str],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> list[Path]:
    """The whole split, run twice into two outputs."""
    result = []
    for attempt in range(2):
        out = tmp_path_factory.mktemp(f"split-run{attempt}") / "out"
        run_all_indexes(out, data, job_env, fast_args)
        result.append(out)
    return result


def index_result(out: Path, index: int, read_jsonl: Callable) -> tuple[list[str], list[str]]:
    """(written ids in shard order, rejected ids) of one index."""
    index_dir = out / f"index-{index:05d}"
    manifest = read_manifest(index_dir)
    assert manifest is not None and manifest.complete
    assert manifest.identity.work_index == index and manifest.identity.work_count == COUNT
    written = [sid for s in manifest.shards for sid in s.sample_ids]
    rejected = [e["sample_id"] for e in read_jsonl(index_dir / "rejected.jsonl")]
    assert manifest.counts.written == len(written) and manifest.counts.rejected == len(rejected)
    return written, rejected


def test_owner_index_is_a_pure_function_in_range(all_ids: list[str]) -> None:
    owners = [owner_index(sid, COUNT) for sid in all_ids]
    assert owners == [owner_index(sid, COUNT) for sid in all_ids]
    assert set(owners) == set(range(COUNT)), "every index should own something in this data set"
    assert all(owner_index(sid, 1) == 0 for sid in all_ids)


def test_indexes_partition_the_records(outputs: list[Path], all_ids: list[str], read_jsonl: Callable) -> None:
    seen: list[set[str]] = []
    for index in range(COUNT):
        written, rejected = index_result(outputs[0], index, read_jsonl)
        mine = set(written) | set(rejected)
        assert len(written) + len(rejected) == len(mine)  # nothing twice within an index
        assert mine == {sid for sid in all_ids if owner_index(sid, COUNT) == index}
        seen.append(mine)
    for a in range(COUNT):
        for b in range(a + 1, COUNT):
            assert not seen[a] & seen[b], (a, b)
    assert set().union(*seen) == set(all_ids)
    rejected_all = set().union(*(set(index_result(outputs[0], i, read_jsonl)[1]) for i in range(COUNT)))
    assert rejected_all == {"split.jsonl:19", "no-answer"}


def test_readers_see_every_written_sample_once(outputs: list[Path], all_ids: list[str]) -> None:
    ids = [s.sample_id for s in iter_output(outputs[0], require_complete=True)]
    assert sorted(ids) == sorted(set(all_ids) - {"split.jsonl:19", "no-answer"})


def test_shards_record_their_slice(outputs: list[Path]) -> None:
    for index in range(COUNT):
        index_dir = outputs[0] / f"index-{index:05d}"
        for shard_path in index_dir.glob("*.safetensors"):
            meta = open_shard(shard_path).metadata
            assert (meta["work_index"], meta["work_count"]) == (str(index), str(COUNT))


def test_rerun_splits_identically(outputs: list[Path], read_jsonl: Callable) -> None:
    for index in range(COUNT):
        assert index_result(outputs[0], index, read_jsonl) == index_result(outputs[1], index, read_jsonl)
        first, second = (read_manifest(out / f"index-{index:05d}") for out in outputs)
        assert first is not None and second is not None
        assert [(s.name, s.sample_ids, s.num_tokens) for s in first.shards] == [
            (s.name, s.sample_ids, s.num_tokens) for s in second.shards
        ]
    for a, b in zip(iter_output(outputs[0]), iter_output(outputs[1]), strict=True):
        assert a.sample_id == b.sample_id
        assert a.input_ids.tolist() == b.input_ids.tolist()
