"""The shard writer's two write paths and its combined checksum, on real files.

Rows whose size is a multiple of 4 KiB, coming from page-aligned memory (as the
capture ring's do), go to disk with direct I/O; anything else, and anything on
tmpfs, is copied into a mapping of the file. Either way the file must read back
exactly and carry the checksum of its bytes.
"""

from __future__ import annotations

import mmap
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from awscrt.checksums import crc64nvme

from job.backend_io import HiddenChunk
from job.checksum import crc64nvme_bytes, crc64nvme_file
from job.data.encode import EncodedSample
from job.hidden_dtype import hidden_dtype
from job.shards import open_shard
from job.shards.format import ShardContext, ShardPlan
from job.shards.writer import (
    FinishedShard,
    ReservedShard,
    ShardSlot,
    ShardWriter,
    _filesystem_type,
    combined_checksum,
)
from job.storage.staging import StagingArea
from job.worker.ring import Ring, header_bytes

LAYERS, HIDDEN = 4, 512  # bf16 rows of 4 KiB
LENGTHS = [37, 300, 5, 128]
CONTEXT = ShardContext(
    LAYERS,
    HIDDEN,
    hidden_dtype("bfloat16"),
    {"model_dtype": "bfloat16", "dtype": "bfloat16", "layer_ids": "[1, 2, 3, 4]"},
)


def _reserve(directory: Path, plan: ShardPlan) -> ReservedShard:
    """Reserve ``plan``'s shard in ``directory``, as the runner's feed does."""
    layout = CONTEXT.layout(plan)
    staged = StagingArea(directory, limit=None).reserve(plan.name, layout.total_bytes)
    assert staged is not None
    return ReservedShard(plan, layout, staged)


def _samples() -> list[EncodedSample]:
    rng = np.random.default_rng(0)
    return [
        EncodedSample(
            f"s{i}", rng.integers(0, 1000, n).astype(np.int32), (rng.random(n) < 0.5).astype(np.uint8), False
        )
        for i, n in enumerate(LENGTHS)
    ]


def _page_aligned_rows(tokens: int) -> tuple[mmap.mmap, torch.Tensor]:
    buffer = mmap.mmap(-1, tokens * LAYERS * HIDDEN * 2)  # anonymous mappings are page-aligned
    rows = torch.frombuffer(buffer, dtype=torch.bfloat16).view(tokens, LAYERS, HIDDEN)
    rows.copy_(torch.randn(tokens, LAYERS, HIDDEN))
    return buffer, rows


def _supports_direct_io(directory: Path) -> bool:
    if _filesystem_type(str(directory)) in ("tmpfs", "ramfs"):
        return False
    probe = directory / "probe"
    try:
        os.close(os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o644))
        return True
    except OSError:
        return False
    finally:
        probe.unlink(missing_ok=True)


def _write(
    directory: Path, rows: torch.Tensor, chunk: int, direct_io: bool = True
) -> tuple[FinishedShard, list[EncodedSample]]:
    samples = _samples()
    finished: list[FinishedShard] = []
    writer = ShardWriter(CONTEXT, finished.append, direct_io=direct_io, threads=4)
    shard = _reserve(directory, ShardPlan(0, samples))
    # Samples interleaved chunk by chunk, as rows of several requests arrive per step.
    slots = {s.sample_id: ShardSlot(shard, i) for i, s in enumerate(samples)}
    lengths = {s.sample_id: s.num_tokens for s in samples}
    position = dict.fromkeys(lengths, 0)
    while position:
        for sample_id in list(position):
            start = position[sample_id]
            stop = min(start + chunk, lengths[sample_id])
            last = stop == lengths[sample_id]
            writer(
                HiddenChunk(
                    sample_id, start, rows[start:stop], None, last, False, destination=slots[sample_id]
                )
            )
            if last:
                del position[sample_id]
            else:
                position[sample_id] = stop
    writer.close()
    assert len(finished) == 1
    return finished[0], samples


@pytest.mark.parametrize("aligned", [True, False], ids=["page-aligned rows", "unaligned rows"])
@pytest.mark.parametrize("where", ["tmp_path", "/dev/shm"])
def test_rows_read_back_exactly_with_the_files_checksum(
    aligned: bool, where: str, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    directory = (
        tmp_path
        if where == "tmp_path"
        else Path("/dev/shm") / f"writer-test-{os.getpid()}-{request.node.name}"
    )
    directory.mkdir(parents=True, exist_ok=True)
    try:
        buffer, rows = _page_aligned_rows(max(LENGTHS) + 1)
        if not aligned:  # one row in: still 4 KiB multiples, but 2 bytes off the page
            rows = torch.frombuffer(buffer, dtype=torch.bfloat16)[1 : 1 + max(LENGTHS) * LAYERS * HIDDEN]
            rows = rows.view(max(LENGTHS), LAYERS, HIDDEN)
        finished, samples = _write(directory, rows, chunk=64)

        assert finished.checksum == crc64nvme_file(finished.staged.path)
        direct = aligned and _supports_direct_io(directory)
        hidden_bytes = sum(LENGTHS) * LAYERS * HIDDEN * 2
        assert finished.direct_bytes == (hidden_bytes if direct else 0), _filesystem_type(str(directory))
        fell_back = not aligned and _supports_direct_io(directory)  # reported: see test_committer
        assert finished.buffered_row_bytes == (hidden_bytes if fell_back else 0)
        shard = open_shard(finished.staged.path)
        for i, sample in enumerate(samples):
            got = shard.sample(i)
            assert got.sample_id == sample.sample_id
            assert torch.equal(got.input_ids, torch.from_numpy(sample.input_ids))
            assert torch.equal(got.loss_mask, torch.from_numpy(sample.loss_mask))
            assert torch.equal(got.hidden_states, rows[: sample.num_tokens])
    finally:
        if where != "tmp_path":
            for path in directory.iterdir():
                path.unlink()
            directory.rmdir()


@pytest.mark.parametrize("max_request_id_bytes", [32, 77])
def test_rows_from_a_capture_ring_slot_go_to_disk_with_direct_io(
    max_request_id_bytes: int, tmp_path: Path
) -> None:
    """The driver writes rows straight from the ring's slots: whatever the size of a step's
    header (it grows with the longest request id), every slot's rows start on a page."""
    if not _supports_direct_io(tmp_path):
        pytest.skip(f"{_filesystem_type(str(tmp_path))} at {tmp_path} has no direct I/O")
    ring = Ring.create(
        str(tmp_path),
        slots=2,
        max_tokens=max(LENGTHS),
        num_layers=LAYERS,
        hidden_size=HIDDEN,
        dtype_name="bfloat16",
        header_bytes=header_bytes(max_requests=128, max_request_id_bytes=max_request_id_bytes),
    )
    try:
        rows = ring.slots[1].rows
        rows.copy_(torch.randn(rows.shape))
        finished, _ = _write(tmp_path, rows, chunk=64)
        assert finished.direct_bytes == sum(LENGTHS) * LAYERS * HIDDEN * 2
        assert finished.buffered_row_bytes == 0
    finally:
        ring.close(unlink=True)


def test_the_checksum_refuses_pieces_that_do_not_tile_the_file() -> None:
    data = os.urandom(100)
    pieces = [(0, 40, crc64nvme(data[:40])), (40, 60, crc64nvme(data[40:]))]
    assert combined_checksum(pieces, 100, "x") == crc64nvme_bytes(data)
    with pytest.raises(ValueError, match=r"x: bytes 40\.\.50 written twice or never"):
        combined_checksum([pieces[0], (50, 50, crc64nvme(data[50:]))], 100, "x")
    with pytest.raises(ValueError, match=r"x: bytes 40\.\.100 never written"):
        combined_checksum(pieces[:1], 100, "x")


def test_page_aligned_memory_of_an_odd_length_is_not_written_directly(tmp_path: Path) -> None:
    """Direct I/O needs address, offset and length aligned: rows in a page-aligned buffer of an
    odd size must take the mapping, not fail with EINVAL. (Headers and ids never go directly:
    test_only_hidden_state_rows_take_direct_io; this is the rows' own length check.)"""
    writer = ShardWriter(CONTEXT, lambda _finished: None, direct_io=True, threads=1)
    reserved = _reserve(tmp_path, ShardPlan(0, _samples()[:1]))
    shard = writer._shard(reserved)
    odd = mmap.mmap(-1, 4096)
    odd[:100] = os.urandom(100)
    shard.put(0, memoryview(odd)[:100], rows=True)  # would raise EINVAL through O_DIRECT
    assert shard.direct_bytes == 0
    assert bytes(shard.data[:100]) == odd[:100]
    writer.close_open()
    reserved.staged.discard()


def test_only_hidden_state_rows_take_direct_io(tmp_path: Path) -> None:
    """A header, ids, masks or scales take the mapping however they lie in memory: whether they
    went directly once depended on where the allocator had put them, and so did direct_bytes
    (a full .ci/run found 4096 more than the rows, in four tests at once)."""
    if not _supports_direct_io(tmp_path):
        pytest.skip(f"{_filesystem_type(str(tmp_path))} at {tmp_path} has no direct I/O")
    writer = ShardWriter(CONTEXT, lambda _finished: None, direct_io=True, threads=1)
    reserved = _reserve(tmp_path, ShardPlan(0, _samples()[:1]))
    shard = writer._shard(reserved)
    page = mmap.mmap(-1, 4096)  # aligned in memory, at an aligned offset, of an aligned length
    page[:] = os.urandom(4096)
    shard.put(0, memoryview(page))  # where the header goes
    assert shard.direct_bytes == 0
    assert bytes(shard.data[:4096]) == page[:]
    shard.put(shard.layout.offsets["hidden_states"], memoryview(page), rows=True)
    assert shard.direct_bytes == 4096
    writer.close_open()
    reserved.staged.discard()


def test_transient_staging_keeps_rows_in_the_page_cache(tmp_path: Path) -> None:
    """S3 staging (uploaded, then deleted) asks for no direct I/O even where it would apply."""
    _buffer, rows = _page_aligned_rows(max(LENGTHS))
    finished, samples = _write(tmp_path, rows, chunk=64, direct_io=False)
    assert finished.direct_bytes == 0
    assert finished.checksum == crc64nvme_file(finished.staged.path)
    shard = open_shard(finished.staged.path)
    assert all(
        torch.equal(shard.sample(i).hidden_states, rows[: s.num_tokens]) for i, s in enumerate(samples)
    )
