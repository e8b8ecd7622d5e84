"""``python -m job export --format speculators``: proven with speculators' own reader.

Real runs of the builtin tiny model (8 layers, hidden 128) write our shards; the
export is then read back three ways: plainly (datasets + safetensors), through
speculators' training dataset and collate function (``ArrowDataset``, ``CollateFn``
with ``shift_batch``, exactly as ``speculators train`` wires them) and through its
``create_train_val_loaders``, and compared with what our reader returns.

speculators is installed without its dependencies (they would replace torch and
transformers): ``pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0``
plus ``datasets`` and ``openai``, which its data modules import.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from job.cli import main
from job.errors import EXIT_CONFIG, EXIT_FAILURE, ConfigError
from job.export import METADATA, order_layers
from job.shards import Sample, iter_output, read_manifest

N = 8  # builtin:tiny-llama's decoder layers
HIDDEN = 128
RUN_ARGS = ("--data.max_length=256", "--data.tokenizer_workers=0", "--log.format=json")


def run_job(out: Path, *args: str) -> None:
    rc = main(["run", f"--output.uri={out}", *RUN_ARGS, *args])
    assert rc == 0, f"python -m job run {' '.join(args)} exited {rc}"


def export(src: Path | str, dest: Path, *extra: str) -> int:
    return main(["export", "--format", "speculators", str(src), str(dest), *extra])


@pytest.fixture(scope="module")
def two_indexes(inprocess_env: None, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Default layers, bfloat16, two work indexes of several small shards each."""
    out = tmp_path_factory.mktemp("src") / "out"
    for index in (0, 1):
        run_job(out, f"--work.index={index}", "--work.count=2", "--output.shard_bytes=64KiB")
    listed = read_manifest(out / "index-00000")
    assert listed is not None and len(listed.shards) > 1
    # a leftover no manifest lists (an interrupted run's) must not be exported
    shutil.copy(out / "index-00000" / listed.shards[0].name, out / "index-00000" / "shard-00999.safetensors")
    return out


@pytest.fixture(scope="module")
def exported(two_indexes: Path) -> Path:
    dest = two_indexes.parent / "speculators"
    assert export(two_indexes, dest) == 0
    return dest


@pytest.fixture(scope="module")
def fp8_reordered(inprocess_env: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """FP8 storage and the verifier's layer stored first: the export decodes and moves it last.

    float32 (faster on CPU than bfloat16) also covers a model dtype other than the default.
    """
    out = tmp_path_factory.mktemp("fp8") / "out"
    run_job(
        out,
        "--work.index=0",
        "--work.count=1",
        "--model.dtype=float32",
        "--output.hidden_dtype=fp8_e4m3",
        f"--layers.ids=[{N},2,4,5]",
    )
    dest = out.parent / "speculators"
    assert export(out, dest) == 0
    return out, dest


def speculators(module: str) -> Any:
    return pytest.importorskip(module, reason="pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0")


def samples(out: Path) -> list[Sample]:
    return list(iter_output(out, require_complete=True))


def test_export_rows_match_our_shards(two_indexes: Path, exported: Path) -> None:
    from datasets import load_from_disk

    ours = samples(two_indexes)
    assert {s.sample_id for s in ours} >= {"openai-005", "sharegpt-010"}  # both indexes are in
    data = load_from_disk(str(exported))
    assert data.format["type"] == "torch" and len(data) == len(ours)
    assert len(list((exported / "hidden_states").iterdir())) == len(ours)
    freq: Counter[int] = Counter()
    for i, sample in enumerate(ours):
        row = data[i]
        assert row["sample_id"] == sample.sample_id
        assert row["input_ids"].dtype == row["loss_mask"].dtype == torch.int64
        assert torch.equal(row["input_ids"], sample.input_ids.long())
        assert torch.equal(row["loss_mask"], sample.loss_mask.long())
        assert int(row["seq_len"]) == len(sample.input_ids)
        hs = load_file(exported / "hidden_states" / f"hs_{i}.safetensors")
        assert set(hs) == {"hidden_states", "token_ids"}
        assert hs["token_ids"].dtype == torch.int64  # as vLLM's hidden-states connector writes them
        assert torch.equal(hs["token_ids"], sample.input_ids.long())
        assert hs["hidden_states"].dtype == torch.bfloat16
        assert torch.equal(hs["hidden_states"], sample.hidden_states)  # default ids already end with N
        freq.update(sample.input_ids[sample.loss_mask.bool()].tolist())
    assert torch.load(exported / "token_freq.pt", weights_only=True) == dict(freq)

    meta = json.loads((exported / METADATA).read_text())
    layers = meta["layers"]
    assert layers["stored"] == layers["exported"] == [2, N // 2, N - 3, N] and not layers["reordered"]
    assert layers["speculators"]["target_layer_ids"] == [2, N // 2, N - 3]
    assert layers["speculators"]["verifier_layer_id"] == N
    assert layers["legacy_generator_layer_ids"] == [1, N // 2 - 1, N - 4, N - 1]
    assert meta["final_layer_prenorm"] is True and meta["rows"] == len(ours)
    assert meta["model"] == {
        "name": "builtin:tiny-llama",
        "path": meta["model"]["path"],
        "config_hash": read_manifest(two_indexes / "index-00000").identity.model_config_hash,  # type: ignore[union-attr]
        "num_layers": N,
        "hidden_size": HIDDEN,
    }
    # every listed shard, and only those, accounts for consecutive rows
    indexes = meta["source"]["indexes"]
    assert [i["name"] for i in indexes] == ["index-00000", "index-00001"]
    ranges = [s["rows"] for i in indexes for s in i["shards"]]
    assert ranges[0][0] == 0 and ranges[-1][1] == len(ours)
    assert all(a[1] == b[0] for a, b in itertools.pairwise(ranges))
    assert "shard-00999.safetensors" not in {s["name"] for i in indexes for s in i["shards"]}


def test_speculators_dataset_and_collate_see_our_tensors(two_indexes: Path, exported: Path) -> None:
    data_mod = speculators("speculators.train.data")
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.recovery import SampleUnavailable

    ours = samples(two_indexes)
    dataset = data_mod.ArrowDataset(max_len=4096, datapath=str(exported), on_missing="raise")
    assert len(dataset) == len(ours)
    assert dataset.approx_lengths == [len(s.input_ids) for s in ours]
    items: list[dict[str, Any]] = []
    for i, sample in enumerate(ours):
        item = dataset[i]
        assert not isinstance(item, SampleUnavailable), f"row {i}: {item}"
        aux, final = sample.hidden_states[:, :3], sample.hidden_states[:, 3]  # layers 2, 4, 5 | 8
        assert torch.equal(item["hidden_states"], aux.flatten(1))  # [T, 3H]
        assert torch.equal(item["verifier_last_hidden_states"], final)  # layer N, pre-norm
        assert torch.equal(item["input_ids"], sample.input_ids.long())
        assert torch.equal(item["loss_mask"], sample.loss_mask.long())
        items.append(item)

    # the trainer's collate: shift by one (hidden state t predicts token t+1), then pack
    max_len = 1024
    collate = data_mod.CollateFn(max_len, HIDDEN, num_target_layers=3, preprocess=shift_batch)
    batch = collate(items[:3])
    assert batch["error_records"] == 0
    offset = 0
    for doc, sample in enumerate(ours[:3]):
        n = len(sample.input_ids) - 1
        span = slice(offset, offset + n)
        assert torch.equal(batch["input_ids"][0, span], sample.input_ids[1:].long())
        assert torch.equal(batch["loss_mask"][0, span], sample.loss_mask[1:].long())
        assert torch.equal(batch["hidden_states"][0, span], sample.hidden_states[:-1, :3].flatten(1))
        assert torch.equal(batch["verifier_last_hidden_states"][0, span], sample.hidden_states[1:, 3])
        assert (batch["document_ids"][0, span] == doc).all()
        offset += n
    assert (batch["document_ids"][0, offset:] == -1).all()  # padding


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_speculators_training_loaders_take_every_row(two_indexes: Path, exported: Path) -> None:
    loader_mod = speculators("speculators.train.dataloader")
    from speculators.models.eagle3.data import shift_batch

    ours = samples(two_indexes)
    train, val = loader_mod.create_train_val_loaders(
        data_path=str(exported),
        total_seq_len=1024,
        hidden_states_dtype=torch.bfloat16,
        vllm_endpoint="http://127.0.0.1:9/v1",  # never contacted: on_missing="raise"
        on_missing="raise",
        verifier_name_or_path=read_manifest(two_indexes / "index-00000").model_path,  # type: ignore[union-attr]
        request_timeout=1.0,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=HIDDEN,
        num_target_layers=3,
        num_workers=0,
        prefetch_factor=2,
        preprocess=shift_batch,
        train_data_ratio=0.75,
    )
    positions = supervised = 0
    for loader in (train, val):
        for batch in loader:
            assert batch["error_records"] == 0  # no row was dropped as unreadable or mismatched
            real = batch["document_ids"][0] >= 0
            positions += int(real.sum())
            supervised += int(batch["loss_mask"][0][real].sum())
    assert positions == sum(len(s.input_ids) - 1 for s in ours)
    assert supervised == sum(int(s.loss_mask[1:].sum()) for s in ours)


def test_export_decodes_fp8_and_puts_the_verifier_layer_last(fp8_reordered: tuple[Path, Path]) -> None:
    out, dest = fp8_reordered
    ours = samples(out)
    assert ours[0].layer_ids == [N, 2, 4, 5]
    meta = json.loads((dest / METADATA).read_text())
    assert meta["layers"]["stored"] == [N, 2, 4, 5]
    assert meta["layers"]["exported"] == [2, 4, 5, N] and meta["layers"]["reordered"]
    assert meta["layers"]["speculators"]["train_args"] == ["--target-layer-ids", "2", "4", "5"]
    assert meta["hidden_states"] == {
        "dtype": "float32",
        "source_storage": "fp8_e4m3",
        "note": meta["hidden_states"]["note"],
    }
    for i, sample in enumerate(ours):
        hs = load_file(dest / "hidden_states" / f"hs_{i}.safetensors")["hidden_states"]
        assert hs.dtype == torch.float32  # decoded to the model dtype, not FP8
        assert torch.equal(hs, sample.hidden_states[:, [1, 2, 3, 0]])

    data_mod = speculators("speculators.train.data")
    item = data_mod.ArrowDataset(max_len=4096, datapath=str(dest), on_missing="raise")[0]
    assert torch.equal(item["verifier_last_hidden_states"], ours[0].hidden_states[:, 0])  # layer N


def test_export_wants_whole_runs_unless_told(two_indexes: Path, tmp_path: Path) -> None:
    partial = tmp_path / "partial"
    shutil.copytree(two_indexes / "index-00000", partial / "index-00000")
    assert export(partial, tmp_path / "refused") == EXIT_CONFIG
    assert not (tmp_path / "refused").exists()  # refused before writing anything
    assert export(partial, tmp_path / "allowed", "--allow-incomplete") == 0
    meta = json.loads((tmp_path / "allowed" / METADATA).read_text())
    assert meta["rows"] == read_manifest(partial / "index-00000").counts.written  # type: ignore[union-attr]
    # one index directory given directly is a whole source on its own
    assert export(partial / "index-00000", tmp_path / "one") == 0


def test_export_verify_catches_a_damaged_shard(two_indexes: Path, tmp_path: Path) -> None:
    src = tmp_path / "damaged"
    shutil.copytree(two_indexes / "index-00001", src)
    entry = read_manifest(src).shards[0]  # type: ignore[union-attr]
    with (src / entry.name).open("r+b") as f:
        f.seek(-1, os.SEEK_END)  # the last byte: a loss-mask value, readable but wrong
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))
    assert export(src, tmp_path / "unverified") == 0
    assert export(src, tmp_path / "verified", "--verify") == EXIT_FAILURE


def test_export_refuses_bad_arguments(
    two_indexes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "keep.txt").write_text("mine")
    assert export(two_indexes, taken) == EXIT_CONFIG
    assert "not an empty directory" in capsys.readouterr().err
    assert [p.name for p in taken.iterdir()] == ["keep.txt"]

    assert main(["export", "--format", "specforge", str(two_indexes), str(tmp_path / "x")]) == EXIT_CONFIG
    assert "speculators" in capsys.readouterr().err
    assert main(["export", str(two_indexes), str(tmp_path / "x")]) == EXIT_CONFIG  # no --format
    assert "--format speculators SRC DST" in capsys.readouterr().err


def test_layer_order_needs_the_last_layer() -> None:
    assert order_layers([2, 4, 5, N], N).order == [0, 1, 2, 3]
    layers = order_layers([2, N, 0], N)
    assert layers.exported == [2, 0, N] and layers.aux == [2, 0] and layers.reordered
    with pytest.raises(ConfigError, match=r"layers\.ids including 8"):
        order_layers([2, 4, 5], N)
    with pytest.raises(ConfigError, match="auxiliary"):
        order_layers([N], N)
