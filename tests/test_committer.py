"""ShardWriter and Committer, in process, on real shard files in a real local store: chunks
written in any order and from several threads, non-finite samples rejected and their shard
repacked, commit failures surfaced, staging space given back on every path."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from structlog.testing import capture_logs

from job.backend_io import HiddenChunk
from job.checksum import crc64nvme_file
from job.data.encode import EncodedSample
from job.hidden_dtype import hidden_dtype
from job.layout import index_dir_name
from job.logs import get_logger
from job.manifest import Identity, Manifest
from job.pipeline.commit import Committer
from job.shards import open_shard, read_manifest
from job.shards.format import ShardContext, ShardPlan
from job.shards.writer import (
    NONFINITE,
    FinishedShard,
    ReservedShard,
    ShardSlot,
    ShardWriter,
    _filesystem_type,
)
from job.storage.local import LocalIndexStore
from job.storage.staging import StagingArea

LAYERS, HIDDEN = 2, 8
DTYPE = hidden_dtype("float32")
CONTEXT = ShardContext(
    LAYERS, HIDDEN, DTYPE, {"dtype": "float32", "model_dtype": "float32", "layer_ids": "[1, 2]"}
)


def samples(*lengths: int, prefix: str = "s") -> list[EncodedSample]:
    return [
        EncodedSample(f"{prefix}{i}", np.arange(n, dtype=np.int32) + 3, np.ones(n, np.uint8), False)
        for i, n in enumerate(lengths)
    ]


def rows_of(sample: EncodedSample) -> torch.Tensor:
    """Each sample's rows are distinct: token id + layer + channel/100."""
    ids = torch.as_tensor(sample.input_ids, dtype=torch.float32)
    return ids[:, None, None] + torch.arange(LAYERS)[None, :, None] + torch.arange(HIDDEN) / 100


def reserve(
    staging: StagingArea, number: int, members: list[EncodedSample], context: ShardContext = CONTEXT
) -> ReservedShard:
    """``members``' shard, reserved in ``staging`` as the runner's feed does."""
    plan = ShardPlan(number, members)
    layout = context.layout(plan)
    staged = staging.reserve(plan.name, layout.total_bytes)
    assert staged is not None
    return ReservedShard(plan, layout, staged)


def slot_of(shard: ReservedShard, sample_id: str) -> ShardSlot:
    return ShardSlot(shard, [s.sample_id for s in shard.plan.samples].index(sample_id))


def chunks(
    shard: ReservedShard, sample: EncodedSample, size: int, nonfinite_at: int | None = None
) -> list[HiddenChunk]:
    rows = rows_of(sample)
    if nonfinite_at is not None:
        rows[nonfinite_at, 0, 0] = float("nan")
    out = []
    for start in range(0, sample.num_tokens, size):
        part = rows[start : start + size].contiguous()
        last = start + size >= sample.num_tokens
        nonfinite = not bool(torch.isfinite(part).all())
        out.append(
            HiddenChunk(
                sample.sample_id,
                start,
                part,
                None,
                last,
                nonfinite,
                destination=slot_of(shard, sample.sample_id),
            )
        )
    return out


def new_manifest() -> Manifest:
    identity = Identity(
        model_config_hash="h",
        layer_ids=[1, 2],
        storage="float32",
        data_fingerprint="d",
        data_format="tokenized",
        max_length=64,
        too_long="truncate",
        tokenizer_fingerprint="t",
        work_index=0,
        work_count=1,
    )
    return Manifest(
        identity=identity,
        model_name="m",
        model_path="/m",
        hidden_size=HIDDEN,
        dtype="float32",
        layer_convention="c",
        final_layer_prenorm=True,
        backend={},
    )


class Pipeline:
    """Writer -> committer -> local store, as the runner wires them."""

    def __init__(self, root: Path, threads: int = 4) -> None:
        self.store = LocalIndexStore.open(str(root), 0)
        self.directory = root / index_dir_name(0)
        self.rejected: list[tuple[str, str]] = []
        self.manifest = new_manifest()
        self.committer = Committer(
            self.store, self.manifest, None, CONTEXT, lambda *r: self.rejected.append(r), get_logger()
        )
        self.writer = ShardWriter(CONTEXT, self.committer.submit, direct_io=False, threads=threads)

    def reserve(self, number: int, members: list[EncodedSample]) -> ReservedShard:
        return reserve(self.store.staging, number, members)

    def close(self) -> None:
        self.store.close()


def test_rows_routed_in_any_order_from_threads_read_back_exactly(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    first, second = samples(7, 30, 1), samples(12, 5, prefix="t")
    shards = pipe.reserve(0, first), pipe.reserve(1, second)
    released: list[str] = []
    everything = [c for shard in shards for s in shard.plan.samples for c in chunks(shard, s, 4)]
    rng = np.random.default_rng(0)
    for chunk in [everything[i] for i in rng.permutation(len(everything))]:
        chunk.release = lambda chunk=chunk: released.append(chunk.sample_id)
        pipe.writer(chunk)
    pipe.writer.close()
    pipe.committer.close()
    assert sorted(released) == sorted(c.sample_id for c in everything)  # every buffer handed back once
    assert pipe.writer.tokens == sum(s.num_tokens for s in first + second) and pipe.writer.samples == 5
    manifest = read_manifest(pipe.directory)
    assert manifest is not None and sorted(e.name for e in manifest.shards) == [
        "shard-00000.safetensors",
        "shard-00001.safetensors",
    ]
    for entry in manifest.shards:
        assert crc64nvme_file(pipe.directory / entry.name) == entry.checksum.value
        shard = open_shard(pipe.directory / entry.name)
        expected = {s.sample_id: s for s in first + second}
        for got in shard:
            assert torch.equal(got.hidden_states, rows_of(expected[got.sample_id]))
    assert pipe.store.staging.used_bytes == 0
    pipe.close()


def test_a_chunk_larger_than_a_piece_is_written_in_pieces_and_released_once(
    tmp_path: Path,
) -> None:
    """The last step of a run often holds one long request: its rows are split into pieces that
    the writer threads share, and the step's buffer is handed back once, after the last piece."""
    pipe = Pipeline(tmp_path)
    (member,) = samples(40)
    shard = pipe.reserve(0, [member])
    writes: list[tuple[int, int]] = []  # (first row, rows) of each write
    write_rows = pipe.writer._write_rows

    def recording(slot: ShardSlot, start: int, rows: memoryview, scales: bytes | None = None) -> None:
        writes.append((start, rows.nbytes // (LAYERS * HIDDEN * 4)))
        write_rows(slot, start, rows, scales)

    pipe.writer._write_rows = recording  # type: ignore[method-assign]
    pipe.writer.PIECE_BYTES = 3 * LAYERS * HIDDEN * 4  # three rows
    released = threading.Semaphore(0)
    (whole,) = chunks(shard, member, 40)
    whole.release = released.release
    pipe.writer(whole)
    pipe.writer.close()
    pipe.committer.close()
    assert released.acquire(timeout=0) and not released.acquire(timeout=0)  # exactly once
    assert sorted(writes) == [(s, min(3, 40 - s)) for s in range(0, 40, 3)]  # pieces for the pool
    manifest = read_manifest(pipe.directory)
    assert manifest is not None and manifest.counts.written == 1
    entry = manifest.shards[0]
    assert crc64nvme_file(pipe.directory / entry.name) == entry.checksum.value
    assert torch.equal(open_shard(pipe.directory / entry.name).sample(0).hidden_states, rows_of(member))
    pipe.close()


def test_fp8_rows_and_their_scales_are_split_into_the_same_pieces(tmp_path: Path) -> None:
    """FP8 rows travel with one float32 scale per [token, layer]: a split chunk's pieces must
    cut both at the same rows."""
    fp8 = hidden_dtype("fp8_e4m3")
    metadata = {**CONTEXT.metadata, "dtype": fp8.name, "storage": fp8.encoding}
    context = ShardContext(LAYERS, HIDDEN, fp8, metadata)
    store = LocalIndexStore.open(str(tmp_path), 0)
    committer = Committer(store, new_manifest(), None, context, lambda *_: None, get_logger())
    writer = ShardWriter(context, committer.submit, direct_io=False, threads=4)
    (member,) = samples(40)
    shard = reserve(store.staging, 0, [member], context)
    states = torch.randn(40, LAYERS, HIDDEN) * torch.logspace(-3, 3, 40)[:, None, None]
    rows, scales = fp8.encode(states)
    assert scales is not None
    writer.PIECE_BYTES = 3 * LAYERS * HIDDEN  # three rows of one byte per value
    writer(
        HiddenChunk(
            member.sample_id,
            0,
            rows.contiguous(),
            scales.contiguous(),
            last=True,
            nonfinite=False,
            destination=ShardSlot(shard, 0),
        )
    )
    writer.close()
    committer.close()
    manifest = read_manifest(tmp_path / index_dir_name(0))
    assert manifest is not None and manifest.counts.written == 1
    got = open_shard(tmp_path / index_dir_name(0) / manifest.shards[0].name).sample(0).hidden_states
    assert torch.equal(got, (rows.float() * scales.unsqueeze(-1)).to(torch.float32))
    store.close()


def test_a_nonfinite_sample_is_rejected_and_its_shard_repacked(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    members = samples(6, 9, 4)
    shard = pipe.reserve(0, members)
    for sample, bad in zip(members, (None, 5, None), strict=True):
        for chunk in chunks(shard, sample, 3, nonfinite_at=bad):
            pipe.writer(chunk)
    pipe.writer.close()
    pipe.committer.close()
    assert pipe.rejected == [("s1", NONFINITE)]
    manifest = read_manifest(pipe.directory)
    assert manifest is not None and [e.sample_ids for e in manifest.shards] == [["s0", "s2"]]
    assert manifest.counts.written == 2
    entry = manifest.shards[0]
    assert crc64nvme_file(pipe.directory / entry.name) == entry.checksum.value
    shard = open_shard(pipe.directory / entry.name)
    assert [s.sample_id for s in shard] == ["s0", "s2"]
    assert torch.equal(shard.sample(1).hidden_states, rows_of(members[2]))
    assert sorted(p.name for p in pipe.directory.iterdir()) == [".lock", "manifest.json", entry.name]
    assert pipe.store.staging.used_bytes == 0
    pipe.close()


def test_a_shard_whose_samples_all_failed_is_dropped(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    members = samples(3, 3)
    shard = pipe.reserve(0, members)
    for sample in members:
        for chunk in chunks(shard, sample, 3, nonfinite_at=0):
            pipe.writer(chunk)
    pipe.writer.close()
    pipe.committer.close()
    assert sorted(pipe.rejected) == [("s0", NONFINITE), ("s1", NONFINITE)]
    assert pipe.manifest.shards == [] and pipe.store.staging.used_bytes == 0
    assert not any(p.name.startswith("shard-") for p in pipe.directory.iterdir())
    pipe.close()


def test_a_commit_failure_is_raised_and_later_shards_are_dropped(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path)
    (pipe.directory / "shard-00000.safetensors").write_bytes(b"someone else's")  # never overwritten
    for number in (0, 1):  # one after the other: shard 0 reaches the committer first
        (member,) = samples(4, prefix=f"n{number}-")
        shard = pipe.reserve(number, [member])
        writer = ShardWriter(CONTEXT, pipe.committer.submit, direct_io=False, threads=1)
        for chunk in chunks(shard, member, 4):
            writer(chunk)
        writer.close()
    with pytest.raises(FileExistsError, match="never overwritten"):
        pipe.committer.close()
    assert pipe.manifest.shards == []  # nothing listed: shard 1 was dropped once shard 0 failed
    assert pipe.store.staging.used_bytes == 0
    assert sorted(p.name for p in pipe.directory.iterdir()) == [".lock", "shard-00000.safetensors"]
    pipe.close()


def test_a_write_error_surfaces_and_the_open_shard_is_closed(tmp_path: Path) -> None:
    pipe = Pipeline(tmp_path, threads=1)
    (member,) = samples(4)
    shard = pipe.reserve(0, [member])
    too_long = HiddenChunk(
        member.sample_id,
        2,
        rows_of(member),
        None,
        last=True,
        nonfinite=False,
        destination=ShardSlot(shard, 0),
    )
    done = threading.Event()
    too_long.release = done.set
    pipe.writer(too_long)
    with pytest.raises(ValueError, match=r"rows 2\.\.6 exceed sample s0"):
        pipe.writer.close()
    assert done.is_set() and pipe.writer.error is not None
    assert list(pipe.writer._open) == [0]  # opened by the chunk, never finished
    pipe.writer.close_open()
    assert pipe.writer._open == {} and pipe.committer.committed_samples == 0
    shard.staged.discard()  # the feed's part (BackendFeed.abandon)
    assert pipe.store.staging.used_bytes == 0
    pipe.committer.close()
    pipe.close()


def test_finished_shards_carry_what_the_committer_needs(tmp_path: Path) -> None:
    """The writer's hand-over: plan, staged file, failures by sample id, combined checksum."""
    finished: list[FinishedShard] = []
    store = LocalIndexStore.open(str(tmp_path), 0)
    writer = ShardWriter(CONTEXT, finished.append, direct_io=False, threads=2)
    members = samples(2, 2)
    reserved = reserve(store.staging, 5, members)
    plan = reserved.plan
    assert store.staging.used_bytes == CONTEXT.layout(plan).total_bytes  # the shard holds its space
    for sample, bad in zip(members, (None, 1), strict=True):
        for chunk in chunks(reserved, sample, 2, nonfinite_at=bad):
            writer(chunk)
    writer.close()
    (shard,) = finished
    assert shard.plan is plan and shard.staged.name == plan.name and shard.failed == {"s1": NONFINITE}
    assert shard.checksum == crc64nvme_file(shard.staged.path)
    shard.staged.discard()
    assert store.staging.used_bytes == 0 and not shard.staged.path.exists()
    store.close()


def test_rows_that_miss_direct_io_are_reported_once(tmp_path: Path) -> None:
    """Rows of a block-sized row length that are not block-aligned in memory still read back
    exactly, but go through the page cache although the output takes direct I/O: the run says so,
    once (how a misaligned capture ring slowed every local-disk run without a word)."""
    if _filesystem_type(str(tmp_path)) in ("tmpfs", "ramfs"):
        pytest.skip("tmpfs takes no direct I/O")
    hidden = 512  # two float32 layers: 4 KiB rows
    context = ShardContext(2, hidden, DTYPE, CONTEXT.metadata)
    store = LocalIndexStore.open(str(tmp_path), 0)
    committer = Committer(store, new_manifest(), None, context, lambda *_: None, get_logger())
    writer = ShardWriter(context, committer.submit, direct_io=True, threads=2)
    expected = {}
    with capture_logs() as events:
        for number in (0, 1):
            (member,) = samples(3, prefix=f"n{number}-")
            shard = reserve(store.staging, number, [member], context)
            rows = torch.randn(3 * 2 * hidden + 1)[1:].view(3, 2, hidden)  # 4 bytes off the page
            writer(HiddenChunk(member.sample_id, 0, rows, None, True, False, destination=ShardSlot(shard, 0)))
            expected[member.sample_id] = rows.clone()
        writer.close()
        committer.close()
    warnings = [e for e in events if e["event"] == "direct_io_fallback"]
    assert len(warnings) == 1 and warnings[0]["buffered_row_bytes"] == 3 * 2 * hidden * 4
    manifest = read_manifest(tmp_path / index_dir_name(0))
    assert manifest is not None and len(manifest.shards) == 2
    for entry in manifest.shards:
        (got,) = open_shard(tmp_path / index_dir_name(0) / entry.name)
        assert torch.equal(got.hidden_states, expected[got.sample_id])
    store.close()
