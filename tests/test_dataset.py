"""``OutputDataset`` and ``OutputReader`` over outputs the job wrote (HF backend, local; the S3
side is tests/test_dataset_s3.py).

* the writer's per-range checksums, recomputed from the file's bytes by this file's own parser;
* 4 ranks x 2 DataLoader workers: every sample exactly once, equal to the output, ranks within
  about a shard of each other in tokens, the same order on every run for a seed and epoch;
* the reading process SIGKILLed mid-epoch, resumed from its saved StatefulDataLoader state;
* following a job that is SIGKILLed twice and resumed: every sample once, the epoch ends alone;
* a flipped byte (rows, header), a missing shard, a superseded index: errors naming the shard;
* FP8 shards decoded as the safetensors-based reader decodes them; stored layers picked;
* importing and reading with vLLM and pydantic-settings made unimportable;
* more ranks than shards: shards split by sample, every rank reads some, resumed exactly; more
  ranks than samples refused before the first sample;
* an incomplete output refused without follow (read with allow_incomplete); a follower that
  waits stall_timeout_s with nothing new listed raises, naming what is incomplete;
* arguments, states of other outputs or of no dataset, set_epoch mid-epoch, a main-process state
  of a plain DataLoader's workers, OutputReader.sample's unknown places: clear errors.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from awscrt.checksums import combine_crc64nvme, crc64nvme
from conftest import with_sitecustomize
from torch.utils.data import DataLoader

from job.checksum import encode
from job.errors import ConfigError, DamagedShard
from job.shards import (
    IncompleteOutputWarning,
    OutputChanged,
    OutputDataset,
    OutputIncomplete,
    OutputReader,
    OutputStalled,
    Shard,
    iter_output,
    read_manifest,
)

REPO = Path(__file__).resolve().parent.parent
CHAT = REPO / "config" / "examples" / "chat.jsonl"
LINES = 30  # of chat.jsonl: about 6k tokens
# 4 float32 layers of the tiny model are 2 KiB a token: ~250-token shards, several samples each
ARGS = ("--output.shard_bytes=512KiB", "--data.max_length=512", "--log.format=json")


def chat_lines(tmp: Path, lines: int = LINES) -> Path:
    path = tmp / "chat.jsonl"
    path.write_bytes(b"".join(CHAT.read_bytes().splitlines(keepends=True)[:lines]))
    return path


@pytest.fixture(scope="module")
def output(
    tmp_path_factory: pytest.TempPathFactory, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> Path:
    """An output of two indexes (work.count 2), written by the job."""
    root = tmp_path_factory.mktemp("dataset")
    data, out = chat_lines(root), root / "out"
    for index in (0, 1):
        result = run_job(
            "run", f"--data.path={data}", f"--output.uri={out}", "--work.count=2", f"--work.index={index}",
            *ARGS, *fast_args,
        )  # fmt: skip
        assert result.rc == 0, result.describe()
    return out


@pytest.fixture(scope="module")
def expected(output: Path) -> dict[str, Any]:
    return {s.sample_id: s for s in iter_output(output, require_complete=True)}


@pytest.fixture(scope="module")
def one_shard(
    tmp_path_factory: pytest.TempPathFactory, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> Path:
    """An output of one index holding one shard, written by the job."""
    root = tmp_path_factory.mktemp("one-shard")
    out = root / "out"
    result = run_job(
        "run", f"--data.path={chat_lines(root)}", f"--output.uri={out}", "--output.shard_bytes=64MiB",
        "--data.max_length=512", *fast_args,
    )  # fmt: skip
    assert result.rc == 0, result.describe()
    assert len(listed(out)) == 1
    return out


def copy_of(output: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    shutil.copytree(output, target)
    return target


def listed(out: Path) -> list[tuple[str, Any]]:
    """(index, shard entry) of every listed shard."""
    found = []
    for index in sorted(p.name for p in out.glob("index-*")):
        manifest = read_manifest(out / index)
        assert manifest is not None
        found += [(index, entry) for entry in manifest.shards]
    return found


def read_all(dataset: OutputDataset, workers: int) -> list[dict[str, Any]]:
    return list(DataLoader(dataset, batch_size=None, num_workers=workers))


# -- the writer's per-range checksums -----------------------------------------------------------


def test_range_checksums_cover_each_samples_bytes(output: Path) -> None:
    """Recomputed from the raw file: the header with the offsets, and per sample its rows, ids
    and mask in file order."""
    for index, entry in listed(output):
        data = (output / index / entry.name).read_bytes()
        (length,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + length])
        base = 8 + length

        def tensor(name: str, data: bytes = data, header: dict[str, Any] = header, base: int = base) -> bytes:
            start, stop = header[name]["data_offsets"]
            return data[base + start : base + stop]

        offsets = tensor("sample_offsets")
        assert entry.ranges is not None and entry.ranges.algorithm == "crc64nvme"
        assert encode(crc64nvme(offsets, crc64nvme(data[:base]))) == entry.ranges.layout
        bounds = struct.unpack(f"<{len(offsets) // 8}q", offsets)
        rows, ids, mask = tensor("hidden_states"), tensor("input_ids"), tensor("loss_mask")
        row = len(rows) // bounds[-1]
        assert len(entry.ranges.samples) == entry.num_samples > 0
        for i, checksum in enumerate(entry.ranges.samples):
            a, b = bounds[i], bounds[i + 1]
            crc = 0
            for part in (rows[a * row : b * row], ids[a * 4 : b * 4], mask[a:b]):
                crc = combine_crc64nvme(crc, crc64nvme(part), len(part))
            assert encode(crc) == checksum, (entry.name, i)


# -- split, shuffle, balance --------------------------------------------------------------------


def test_four_ranks_two_workers_read_the_output_exactly_once(output: Path, expected: dict[str, Any]) -> None:
    shards = listed(output)
    assert len(shards) >= 10 and len({index for index, _ in shards}) == 2
    by_rank = {
        rank: read_all(OutputDataset(str(output), rank=rank, world_size=4, shuffle_seed=11), workers=2)
        for rank in range(4)
    }
    ids = [s["sample_id"] for samples in by_rank.values() for s in samples]
    assert sorted(ids) == sorted(expected) and len(ids) == len(set(ids))
    for samples in by_rank.values():
        for got in samples:
            want = expected[got["sample_id"]]
            assert torch.equal(got["input_ids"], want.input_ids)
            assert torch.equal(got["loss_mask"], want.loss_mask)
            assert torch.equal(got["hidden_states"], want.hidden_states)
    tokens = [sum(len(s["input_ids"]) for s in samples) for samples in by_rank.values()]
    largest = max(entry.num_tokens for _, entry in shards)
    assert max(tokens) - min(tokens) <= largest, (tokens, largest)


def test_the_order_is_a_function_of_seed_and_epoch(output: Path) -> None:
    def order(seed: int | None, epoch: int) -> list[str]:
        dataset = OutputDataset(str(output), rank=1, world_size=2, shuffle_seed=seed)
        dataset.set_epoch(epoch)
        return [s["sample_id"] for s in read_all(dataset, workers=2)]

    first = order(5, 0)
    assert order(5, 0) == first
    assert order(5, 1) != first and sorted(order(5, 1)) != sorted(first)  # another split too
    assert order(6, 0) != first
    plain = order(None, 0)
    assert plain == order(None, 0) != first


def test_more_ranks_than_shards_split_shards_by_sample(one_shard: Path) -> None:
    """Four ranks over one shard: each reads a quarter of its samples (whole shards gave 0/0/0/n,
    and a rank without samples hangs the others' first DDP step), with and without follow."""
    (_, entry), *_ = listed(one_shard)
    for follow in (False, True):
        by_rank = [
            [
                s["sample_id"]
                for s in read_all(
                    OutputDataset(str(one_shard), rank=rank, world_size=4, shuffle_seed=3, follow=follow),
                    workers=2,
                )
            ]
            for rank in range(4)
        ]
        counts = [len(ids) for ids in by_rank]
        print(f"\nfollow={follow}: {entry.num_samples} samples of one shard over 4 ranks: {counts}")
        assert min(counts) == entry.num_samples // 4 and max(counts) - min(counts) <= 1, (follow, counts)
        everything = [sid for ids in by_rank for sid in ids]
        assert sorted(everything) == sorted(entry.sample_ids) and len(set(everything)) == len(everything)


def test_more_ranks_than_shards_over_two_indexes(output: Path, expected: dict[str, Any]) -> None:
    world = len(listed(output)) + 3
    by_rank = [
        [s["sample_id"] for s in read_all(OutputDataset(str(output), rank=rank, world_size=world), workers=0)]
        for rank in range(world)
    ]
    assert all(by_rank), [len(ids) for ids in by_rank]
    everything = [sid for ids in by_rank for sid in ids]
    assert sorted(everything) == sorted(expected) and len(set(everything)) == len(everything)


def test_more_ranks_than_samples_are_refused_before_the_first_sample(one_shard: Path) -> None:
    (_, entry), *_ = listed(one_shard)
    world = entry.num_samples + 1
    for follow in (False, True):
        dataset = OutputDataset(str(one_shard), rank=0, world_size=world, follow=follow)
        refused = (
            rf"holds {entry.num_samples} samples in 1 shards; split over world_size {world}, ranks \d+ get"
        )
        with pytest.raises(ValueError, match=refused):
            next(iter(dataset))


# -- resume ---------------------------------------------------------------------------------------

READER = r"""
import os, sys, time, torch
from torchdata.stateful_dataloader import StatefulDataLoader
from job.shards import OutputDataset

uri, checkpoint, pause = sys.argv[1], sys.argv[2], float(sys.argv[3])
dataset = OutputDataset(uri, rank=0, world_size=1, shuffle_seed=7, shuffle_shards=3)
dataset.set_epoch(2)
loader = StatefulDataLoader(dataset, batch_size=None, num_workers=2)
ids = []
if os.path.exists(checkpoint):
    saved = torch.load(checkpoint, weights_only=False)
    loader.load_state_dict(saved["state"])
    ids = saved["ids"]
for sample in loader:
    ids.append(sample["sample_id"])
    torch.save({"state": loader.state_dict(), "ids": ids}, checkpoint + ".tmp")
    os.replace(checkpoint + ".tmp", checkpoint)  # the ids and the state that follows them, at once
    print(len(ids), flush=True)
    time.sleep(pause)
print("END", flush=True)
"""


def run_reader(output: Path, checkpoint: Path, env: dict[str, str], pause: float) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", READER, str(output), str(checkpoint), str(pause)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip


def test_a_reader_killed_mid_epoch_resumes_from_its_state(
    output: Path, expected: dict[str, Any], job_env: dict[str, str], tmp_path: Path
) -> None:
    if not os.environ.get("CI"):  # CI installs it (the [train] extra); a shared dev venv may not
        pytest.importorskip("torchdata", reason="torchdata (eagle3-extract[train]) is not installed")
    whole = tmp_path / "whole.pt"
    proc = run_reader(output, whole, job_env, 0)
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    uninterrupted = torch.load(whole, weights_only=False)["ids"]
    assert sorted(uninterrupted) == sorted(expected)

    checkpoint = tmp_path / "killed.pt"
    proc = run_reader(output, checkpoint, job_env, 0.2)
    assert proc.stdout is not None
    for line in proc.stdout:
        if int(line) >= len(expected) // 3:
            break
    os.killpg(proc.pid, signal.SIGKILL)  # the reader and its DataLoader workers
    proc.wait()
    before = torch.load(checkpoint, weights_only=False)["ids"]
    assert 0 < len(before) < len(expected)
    proc = run_reader(output, checkpoint, job_env, 0)
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0 and out.endswith("END\n"), err
    resumed = torch.load(checkpoint, weights_only=False)["ids"]
    assert resumed == uninterrupted  # none twice, none lost, in the same order


def test_a_split_shard_resumes_mid_epoch_exactly(one_shard: Path) -> None:
    """A state taken inside a piece of a split shard continues with exactly the rest: in one
    process, and through StatefulDataLoader workers (one of which has nothing to read)."""

    def dataset(rank: int = 1, world: int = 3) -> OutputDataset:
        return OutputDataset(str(one_shard), rank=rank, world_size=world, shuffle_seed=5, shuffle_shards=2)

    whole = [s["sample_id"] for s in dataset()]
    first = dataset()
    iterator = iter(first)
    head = [next(iterator)["sample_id"] for _ in range(3)]
    state = first.state_dict()
    iterator.close()  # type: ignore[attr-defined]
    assert [key[4] for key in state["window"]] == [3] and state["taken"] == 3  # a third of the shard
    resumed = dataset()
    resumed.load_state_dict(state)
    assert head + [s["sample_id"] for s in resumed] == whole

    if not os.environ.get("CI"):  # CI installs it (the [train] extra); a shared dev venv may not
        pytest.importorskip("torchdata", reason="torchdata (eagle3-extract[train]) is not installed")
    from torchdata.stateful_dataloader import StatefulDataLoader

    whole = [s["sample_id"] for s in StatefulDataLoader(dataset(0, 2), batch_size=None, num_workers=2)]
    loader = StatefulDataLoader(dataset(0, 2), batch_size=None, num_workers=2)
    iterator = iter(loader)
    head = [next(iterator)["sample_id"] for _ in range(4)]
    state = loader.state_dict()
    del iterator, loader
    loader = StatefulDataLoader(dataset(0, 2), batch_size=None, num_workers=2)
    loader.load_state_dict(state)
    assert head + [s["sample_id"] for s in loader] == whole


def test_state_of_another_world_size_is_refused(output: Path) -> None:
    dataset = OutputDataset(str(output), rank=0, world_size=2, shuffle_seed=1)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    with pytest.raises(ConfigError, match=r"world_size 2 \(now 4\)"):
        OutputDataset(str(output), rank=0, world_size=4, shuffle_seed=1).load_state_dict(state)


# -- following a running job --------------------------------------------------------------------

FOLLOWER = r"""
import sys
from torch.utils.data import DataLoader
from job.shards import OutputDataset

dataset = OutputDataset(sys.argv[1], follow=True, shuffle_seed=3, poll_interval_s=0.1)
for sample in DataLoader(dataset, batch_size=None, num_workers=2):
    print(sample["sample_id"], flush=True)
print("END", flush=True)
"""


def committed_shards(out: Path) -> int:
    manifest = (
        read_manifest(out / "index-00000") if (out / "index-00000" / "manifest.json").exists() else None
    )
    return 0 if manifest is None else len(manifest.shards)


def test_following_a_job_killed_twice(
    tmp_path: Path, job_env: dict[str, str], fast_args: tuple[str, ...]
) -> None:
    out = tmp_path / "out"
    args = [sys.executable, "-m", "job", "run", f"--data.path={chat_lines(tmp_path)}", f"--output.uri={out}"]
    args += [*ARGS, *fast_args]
    follower = subprocess.Popen(
        [sys.executable, "-c", FOLLOWER, str(out)], env=job_env, stdout=subprocess.PIPE, text=True
    )
    lines: list[str] = []
    assert follower.stdout is not None
    collector = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in follower.stdout))
    collector.start()
    try:
        for _ in range(2):
            job = subprocess.Popen(args, env=job_env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            at_start = committed_shards(out)
            deadline = time.monotonic() + 240
            while committed_shards(out) < at_start + 2 and job.poll() is None and time.monotonic() < deadline:
                time.sleep(0.05)
            assert job.poll() is None, "the job finished before it could be killed"
            job.send_signal(signal.SIGKILL)
            job.wait()
        time.sleep(1)
        assert follower.poll() is None  # the output is not complete: the follower waits
        read_while_killed = len(lines)
        job = subprocess.run(args, env=job_env, capture_output=True, text=True, timeout=600)
        assert job.returncode == 0, job.stderr[-3000:]
        follower.wait(timeout=120)
        collector.join()
    finally:
        if follower.poll() is None:
            follower.kill()
    assert read_while_killed > 0  # it read the killed runs' committed shards as they came
    assert lines[-1] == "END"
    written = [s.sample_id for s in iter_output(out, require_complete=True)]
    assert sorted(lines[:-1]) == sorted(written) and len(set(lines[:-1])) == len(written)


def test_follow_never_reads_a_shard_no_manifest_lists(output: Path, tmp_path: Path) -> None:
    """A shard file the manifest does not list (a killed run's) is never read; a second index
    that has not started keeps the epoch open."""
    out = copy_of(output, tmp_path)
    manifest = json.loads((out / "index-00000" / "manifest.json").read_text())
    unlisted = manifest["shards"].pop()
    manifest["complete"] = False
    (out / "index-00000" / "manifest.json").write_text(json.dumps(manifest))
    shutil.rmtree(out / "index-00001")
    dataset = OutputDataset(str(out), follow=True, poll_interval_s=0.05)
    got: list[str] = []
    iterator = iter(dataset)
    expected_ids = [sid for entry in manifest["shards"] for sid in entry["sample_ids"]]
    while len(got) < len(expected_ids):
        got.append(next(iterator)["sample_id"])
    assert sorted(got) == sorted(expected_ids)
    assert not set(got) & set(unlisted["sample_ids"])
    iterator.close()  # type: ignore[attr-defined]


# -- errors ---------------------------------------------------------------------------------------


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        value = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([value ^ 0x01]))


def test_a_flipped_byte_stops_the_epoch_naming_the_shard(output: Path, tmp_path: Path) -> None:
    out = copy_of(output, tmp_path)
    index, entry = listed(out)[2]
    flip_byte(out / index / entry.name, entry.bytes // 3)  # in the hidden-state rows
    damaged = rf"{entry.name}: checksum .* of sample \d+ .* differs from the manifest's"
    with pytest.raises(DamagedShard, match=damaged):
        read_all(OutputDataset(str(out)), workers=0)
    with pytest.raises(Exception, match=rf"{entry.name}: checksum .* of sample"):
        read_all(OutputDataset(str(out)), workers=2)  # raised in a worker, re-raised here
    assert len(read_all(OutputDataset(str(out), verify=False), workers=0)) == len(list(iter_output(output)))
    flip_byte(out / index / entry.name, entry.bytes // 3)
    flip_byte(out / index / entry.name, 100)  # in the header's JSON
    with pytest.raises(DamagedShard, match=rf"{entry.name}: .*damaged.*on_damaged_shard=reextract"):
        read_all(OutputDataset(str(out)), workers=0)


def test_a_shard_listed_without_range_checksums_is_verified_whole(output: Path, tmp_path: Path) -> None:
    """A manifest from before per-range checksums: the whole shard is checked when opened."""
    out = copy_of(output, tmp_path)
    for index in ("index-00000", "index-00001"):
        path = out / index / "manifest.json"
        manifest = json.loads(path.read_text())
        for entry in manifest["shards"]:
            del entry["ranges"]
        path.write_text(json.dumps(manifest))
    assert len(read_all(OutputDataset(str(out)), workers=0)) == len(list(iter_output(output)))
    index, entry = listed(out)[-1]
    flip_byte(out / index / entry.name, entry.bytes - 3)  # the last sample's mask
    with pytest.raises(DamagedShard, match=rf"{entry.name}: checksum .* differs from the manifest's"):
        read_all(OutputDataset(str(out)), workers=0)


def test_a_missing_shard_is_named(output: Path, tmp_path: Path) -> None:
    out = copy_of(output, tmp_path)
    index, entry = listed(out)[1]
    (out / index / entry.name).unlink()
    with pytest.raises(DamagedShard, match=rf"{entry.name}: listed in {index}/manifest.json but missing"):
        read_all(OutputDataset(str(out), shuffle_seed=1), workers=0)


def test_a_superseded_index_stops_a_resumed_epoch(
    output: Path, tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> None:
    """The state names shards by name and checksum: an index written again by another run (here
    deleted and rerun with other shard sizes) is refused, naming a shard, not read half twice."""
    out = copy_of(output, tmp_path)
    dataset = OutputDataset(str(out), shuffle_seed=2, shuffle_shards=2)
    iterator = iter(dataset)
    for _ in range(12):
        next(iterator)
    state = dataset.state_dict()
    iterator.close()  # type: ignore[attr-defined]
    read = {key[1] for key in state["done"] + state["window"]}
    assert read
    shutil.rmtree(out / "index-00000")
    shutil.rmtree(out / "index-00001")
    for index in (0, 1):
        result = run_job(
            "run", f"--data.path={chat_lines(tmp_path)}", f"--output.uri={out}", "--work.count=2",
            f"--work.index={index}", "--output.shard_bytes=300KiB", "--data.max_length=512", *fast_args,
        )  # fmt: skip
        assert result.rc == 0, result.describe()
    resumed = OutputDataset(str(out), shuffle_seed=2, shuffle_shards=2)
    resumed.load_state_dict(state)
    changed = r"shard-\d+\.safetensors: this epoch read it with checksum .* start the epoch again"
    with pytest.raises(OutputChanged, match=changed):
        read_all(resumed, workers=0)


# -- what is read ---------------------------------------------------------------------------------


def test_layers_pick_stored_layers(output: Path, expected: dict[str, Any]) -> None:
    stored = next(iter(expected.values())).layer_ids
    picked = [stored[-1], stored[0]]
    for got in read_all(OutputDataset(str(output), layers=picked), workers=0):
        want = expected[got["sample_id"]].hidden_states
        assert torch.equal(got["hidden_states"], want[:, [len(stored) - 1, 0]])
    with pytest.raises(ConfigError, match=r"layers \[999\] are not stored"):
        read_all(OutputDataset(str(output), layers=[999]), workers=0)


def test_fp8_shards_are_decoded_to_the_model_dtype(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> None:
    out = tmp_path / "fp8"
    result = run_job(
        "run", f"--data.path={chat_lines(tmp_path, 8)}", f"--output.uri={out}",
        "--output.hidden_dtype=fp8_e4m3", *ARGS, *fast_args,
    )  # fmt: skip
    assert result.rc == 0, result.describe()
    reference = {}  # decoded by the safetensors-based reader (job.shards.reader.Shard)
    for index, entry in listed(out):
        for sample in Shard(out / index / entry.name):
            reference[sample.sample_id] = sample
    got = read_all(OutputDataset(str(out), shuffle_seed=0), workers=2)
    assert sorted(s["sample_id"] for s in got) == sorted(reference)
    for sample in got:
        assert sample["hidden_states"].dtype == torch.float32
        assert torch.equal(sample["hidden_states"], reference[sample["sample_id"]].hidden_states)


REFUSE = (
    "import sys\n"
    "class Refuse:\n"
    "    def find_spec(self, name, path=None, target=None):\n"
    "        if name.split('.')[0] in ('vllm', 'pydantic_settings'):\n"
    "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
    "        return None\n"
    "sys.meta_path.insert(0, Refuse())\n"
)


def test_the_reading_side_needs_neither_vllm_nor_the_settings(
    output: Path, expected: dict[str, Any], job_env: dict[str, str], tmp_path: Path
) -> None:
    script = (
        "import sys\n"
        "from job.shards import OutputDataset, iter_output\n"
        f"ids = [s['sample_id'] for s in OutputDataset({str(output)!r}, shuffle_seed=1)]\n"
        "assert 'job.settings' not in sys.modules and 'vllm' not in sys.modules, sorted(sys.modules)\n"
        "print(len(ids))\n"
    )
    env = {**job_env, "PYTHONPATH": with_sitecustomize(tmp_path / "site", REFUSE)}
    proc = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) == len(expected)
    env_check = subprocess.run(
        [sys.executable, "-c", "import pydantic_settings"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert env_check.returncode != 0  # the refusal works


# -- incomplete outputs -------------------------------------------------------------------------


def stop_index(out: Path, index: str, keep: int) -> list[str]:
    """Index ``index``'s manifest as a killed run leaves it: its first ``keep`` shards, not complete
    (the job's own manifest, cut). Returns the listed samples."""
    path = out / index / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["shards"] = manifest["shards"][:keep]
    manifest["complete"] = False
    path.write_text(json.dumps(manifest))
    return [sid for entry in manifest["shards"] for sid in entry["sample_ids"]]


def test_an_incomplete_output_is_refused_without_follow(output: Path, tmp_path: Path) -> None:
    out = copy_of(output, tmp_path)
    shutil.rmtree(out / "index-00001")  # as after running work.index=0 of work.count=2 alone
    kept = stop_index(out, "index-00000", 2)
    incomplete = r"index-00000 \(2 shards listed, not complete\), index-00001 \(no manifest.json"
    for workers in (0, 2):  # raised in the worker, re-raised here
        with pytest.raises(OutputIncomplete, match=rf"{out} is not complete: {incomplete}"):
            read_all(OutputDataset(str(out)), workers=workers)
    with pytest.warns(IncompleteOutputWarning, match=rf"not complete \({incomplete}"):
        got = [s["sample_id"] for s in OutputDataset(str(out), allow_incomplete=True, shuffle_seed=1)]
    assert sorted(got) == sorted(kept)
    (out / "extraction.json").unlink()
    with pytest.raises(OutputIncomplete, match=r"extraction.json \(missing: .* how many indexes there are"):
        read_all(OutputDataset(str(out)), workers=0)


def test_following_never_waits_forever(output: Path, expected: dict[str, Any], tmp_path: Path) -> None:
    """A path no job writes to, a job that died, an output without extraction.json: what is listed
    is read, then OutputStalled names what is missing after stall_timeout_s with nothing new."""

    def follow(uri: Path, got: list[str]) -> None:
        for sample in OutputDataset(str(uri), follow=True, stall_timeout_s=1, poll_interval_s=0.1):
            got.append(sample["sample_id"])

    started = time.monotonic()
    with pytest.raises(OutputStalled, match=r"holds no extraction.json and no index-\*"):
        follow(tmp_path / "never", [])
    assert time.monotonic() - started < 10
    out = copy_of(output, tmp_path)
    whole = (out / "index-00001" / "manifest.json").read_text()
    stop_index(out, "index-00001", 1)
    listed_now = [sid for _, entry in listed(out) for sid in entry.sample_ids]
    got: list[str] = []
    with pytest.raises(
        OutputStalled, match=r"still incomplete: index-00001 \(1 shards listed, not complete\)"
    ):
        follow(out, got)
    assert sorted(got) == sorted(listed_now) and len(listed_now) < len(expected)
    (out / "index-00001" / "manifest.json").write_text(whole)
    (out / "extraction.json").unlink()  # read anyway: today it yields nothing and never ends
    got = []
    with pytest.raises(OutputStalled, match=r"still incomplete: extraction.json \(missing"):
        follow(out, got)
    assert sorted(got) == sorted(expected)


def test_a_follower_waits_while_shards_keep_coming(
    output: Path, expected: dict[str, Any], tmp_path: Path
) -> None:
    """The stall timer counts from the last new listing: manifests growing a shard every 0.4 s
    keep a follower with stall_timeout_s=1.5 reading for longer than that, to the end."""
    out = copy_of(output, tmp_path)
    manifests = {
        index: json.loads((out / index / "manifest.json").read_text())
        for index in ("index-00000", "index-00001")
    }
    for index in manifests:
        (out / index / "manifest.json").unlink()
    steps = max(len(m["shards"]) for m in manifests.values())

    def commit() -> None:
        for step in range(1, steps + 1):
            time.sleep(0.4)
            for index, manifest in manifests.items():
                grown = {
                    **manifest,
                    "shards": manifest["shards"][:step],
                    "complete": step >= len(manifest["shards"]),
                }
                (out / index / "manifest.tmp").write_text(json.dumps(grown))
                os.replace(out / index / "manifest.tmp", out / index / "manifest.json")

    writer = threading.Thread(target=commit)
    started = time.monotonic()
    writer.start()
    try:
        got = [
            s["sample_id"]
            for s in OutputDataset(str(out), follow=True, stall_timeout_s=1.5, poll_interval_s=0.05)
        ]
    finally:
        writer.join()
    assert time.monotonic() - started > 1.5 and sorted(got) == sorted(expected)


# -- arguments and states -----------------------------------------------------------------------


def test_arguments_are_checked_when_the_dataset_is_made(output: Path) -> None:
    for arguments, refused in [
        ({"layers": []}, r"layers=\[\] picks no layer"),
        ({"layers": [2, 5, 2]}, r"layers \[2, 5, 2\] name \[2\] more than once"),
        ({"layers": "2,5"}, r"layers='2,5'; give a list of stored layer ids"),
        ({"layers": [2.0]}, r"layers \[2.0\] are not layer ids"),
        ({"read_threads": 0}, r"read_threads=0; give a whole number of at least 1"),
        ({"shuffle_shards": 0}, r"shuffle_shards=0"),
        ({"stall_timeout_s": 0}, r"stall_timeout_s=0; give a number of seconds above 0"),
        ({"follow": True, "allow_incomplete": True}, r"give one"),
    ]:
        with pytest.raises(ValueError, match=refused):
            OutputDataset(str(output), **arguments)


def test_states_not_of_this_dataset_are_refused(output: Path, tmp_path: Path) -> None:
    dataset = OutputDataset(str(output), shuffle_seed=1)
    iterator = iter(dataset)
    next(iterator)
    state = dataset.state_dict()
    iterator.close()  # type: ignore[attr-defined]
    other = copy_of(output, tmp_path)
    for given, refused in [
        ({k: v for k, v in state.items() if k not in ("window", "taken")}, r"missing window, taken"),
        ({**state, "done": {"index-00000": {}}}, r"done: Input should be a valid list"),
        (
            {**state, "window": [["index-00000", "shard-00000.safetensors"]]},
            r"missing window\.0\.2, window\.0\.3",
        ),
        ({**state, "version": 1}, r"state version 1, this reader reads 2"),
        ([state], r"the state: Input should be a valid dictionary"),
        ({"_snapshot": {}, "_steps_since_snapshot": 0}, r"a StatefulDataLoader's state"),
    ]:
        with pytest.raises(ValueError, match=refused):
            OutputDataset(str(output), shuffle_seed=1).load_state_dict(given)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"uri '{output}' \(now '{other}'\)"):
        OutputDataset(str(other), shuffle_seed=1).load_state_dict(state)
    resumed = OutputDataset(str(output) + "/", shuffle_seed=1)  # the same output, spelled otherwise
    resumed.load_state_dict(state)
    assert len(list(resumed)) == len(list(iter_output(output))) - 1


def test_set_epoch_while_reading_stops_that_iterator(output: Path, expected: dict[str, Any]) -> None:
    """The open iterator would go on with epoch 0 while state_dict() speaks of epoch 1: it raises
    at its next sample; a new iteration reads epoch 1 whole."""
    dataset = OutputDataset(str(output), shuffle_seed=4)
    iterator = iter(dataset)
    for _ in range(3):
        next(iterator)
    assert dataset.state_dict()["taken"] == 3
    dataset.set_epoch(1)
    state = dataset.state_dict()
    assert (state["epoch"], state["done"], state["window"], state["taken"]) == (1, [], [], 0)
    with pytest.raises(RuntimeError, match=r"set_epoch\(1\) was called while epoch 0 was read"):
        next(iterator)
    assert sorted(s["sample_id"] for s in dataset) == sorted(expected)


def test_a_main_process_state_of_dataloader_workers_is_refused(output: Path) -> None:
    """A plain DataLoader's workers read copies: the main process's state_dict() would say nothing
    was read (resuming repeats the epoch), and a state loaded there would reach every worker."""
    dataset = OutputDataset(str(output), shuffle_seed=2)
    iterator = iter(DataLoader(dataset, batch_size=None, num_workers=2))
    next(iterator)
    with pytest.raises(
        RuntimeError, match=r"main process while DataLoader workers read .* StatefulDataLoader"
    ):
        dataset.state_dict()
    del iterator
    single = OutputDataset(str(output), shuffle_seed=2)
    iterator = iter(single)
    next(iterator)
    state = single.state_dict()
    iterator.close()  # type: ignore[attr-defined]
    loaded = OutputDataset(str(output), shuffle_seed=2)
    loaded.load_state_dict(state)
    with pytest.raises(
        RuntimeError, match=r"loaded for DataLoader worker 0 of 1 but worker \d of 2 reads it"
    ):
        read_all(loaded, workers=2)


def test_reader_sample_says_what_the_output_holds(output: Path) -> None:
    reader = OutputReader(str(output))
    manifest = reader.manifest("index-00000")
    assert manifest is not None
    entry = manifest.shards[0]
    count = entry.num_samples
    for last in (count - 1, np.int64(count - 1)):  # numpy's integers too (speculators' loader gives them)
        assert reader.sample("index-00000", entry.name, last).sample_id == entry.sample_ids[-1]
    for position in (count, -1):
        holds = rf"{entry.name}: no sample at position {position}; it holds {count} \(positions 0 to"
        with pytest.raises(IndexError, match=holds):
            reader.sample("index-00000", entry.name, position)
    shards = len(manifest.shards)
    lists = rf"shard-99999.safetensors: not listed in index-00000/manifest.json; it lists {shards} shards: s"
    with pytest.raises(LookupError, match=lists):
        reader.sample("index-00000", "shard-99999.safetensors", 0)
    with pytest.raises(
        LookupError,
        match=r"index-00007/manifest.json: no such manifest; .* holds indexes index-00000, index-00001$",
    ):
        reader.sample("index-00007", entry.name, 0)
    reader.close()
