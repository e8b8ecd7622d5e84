"""``python -m job export --format speculators``: proven with speculators' own reader.

Real runs of the builtin tiny model (8 layers, hidden 128) write our shards; the
export is then read back three ways: plainly (datasets + safetensors), through
speculators' training dataset and collate function (``ArrowDataset``, ``CollateFn``
with ``shift_batch``, exactly as ``speculators train`` wires them) and through its
``create_train_val_loaders``, and compared with what our reader returns.

A reference export (``--hidden-states reference``) is read through the same speculators
code with our ``eagle3-extract`` hidden-states backend (``job.speculators``) and must give
exactly the full export's items, batches and training losses. The command line each export
prints is parsed by speculators' own argument parser and run for a few training steps on
the CPU (``tests/speculators_cpu.py`` replaces only the trainer's CUDA device choice).

speculators is installed without its dependencies (they would replace torch and
transformers): ``pip install --no-deps speculators==0.9.0 hs-connectors==0.9.0``
plus its other requirements but torchvision and torchaudio (docs/speculators.md has
the line; the CI venvs list ``datasets`` and ``openai``, vLLM brings the rest).
"""

from __future__ import annotations

import argparse
import fcntl
import importlib
import itertools
import json
import os
import shlex
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import mount_namespace, with_sitecustomize
from safetensors.torch import load_file

from job.cli import main
from job.errors import EXIT_CONFIG, ConfigError, DamagedShard
from job.export import METADATA, UNFINISHED, order_layers
from job.shards import Sample, iter_output, read_manifest

N = 8  # builtin:tiny-llama's decoder layers
HIDDEN = 128
RUN_ARGS = ("--data.max_length=256", "--data.tokenizer_workers=0", "--log.format=json")


def run_job(out: Path, *args: str) -> None:
    rc = main(["run", f"--output.uri={out}", *RUN_ARGS, *args])
    assert rc == 0, f"python -m job run {' '.join(args)} exited {rc}"


def export(src: Path | str, dest: Path, *extra: str) -> int:
    return main(["export", "--format", "speculators", str(src), str(dest), *extra])


def export_printing(src: Path | str, dest: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    """Export and return the ``train with`` command it printed."""
    capsys.readouterr()
    assert export(src, dest, *extra) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if line.startswith("train with")]
    assert len(lines) == 1
    return lines[0].removeprefix("train with").strip()


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
def referenced(two_indexes: Path) -> Path:
    dest = two_indexes.parent / "speculators-reference"
    assert export(two_indexes, dest, "--hidden-states", "reference") == 0
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
    return pytest.importorskip(module, reason="speculators 0.9.0 is not installed (docs/speculators.md)")


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
        "mode": "copy",
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
    # exit 2: exporting again cannot mend the shard; the unfinished export is removed
    assert export(src, tmp_path / "verified", "--verify") == EXIT_CONFIG
    assert not (tmp_path / "verified").exists()
    # a reference export reads the ids and masks alone: --verify reads each sample through its
    # checksum; without it, training does, and stops at the damaged sample naming it
    reference = ("--hidden-states", "reference")
    assert export(src, tmp_path / "reference-verified", *reference, "--verify") == EXIT_CONFIG
    assert not (tmp_path / "reference-verified").exists()
    assert export(src, tmp_path / "reference", *reference) == 0
    shards = json.loads((tmp_path / "reference" / METADATA).read_text())["source"]["indexes"][0]["shards"]
    transfer = reference_transfer(tmp_path / "reference")
    transfer.get_cached(shards[1]["rows"][0])  # a sample of another shard
    with pytest.raises(DamagedShard, match=rf"{entry.name}: checksum .* of sample \d+ .* differs"):
        transfer.get_cached(shards[0]["rows"][1] - 1)  # the damaged shard's last sample


@pytest.mark.parametrize("mode", ["copy", "reference"])
def test_a_shard_missing_from_the_source_is_named_with_the_remedy(
    two_indexes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], mode: str
) -> None:
    src = tmp_path / "src"
    shutil.copytree(two_indexes, src)
    entry = read_manifest(src / "index-00001").shards[1]  # type: ignore[union-attr]
    shard = src / "index-00001" / entry.name
    kept = shard.rename(tmp_path / entry.name)
    dest = tmp_path / "dest"
    capsys.readouterr()
    assert export(src, dest, "--hidden-states", mode) == EXIT_CONFIG  # was 1, "a rerun resumes"
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"error: export SRC: {shard}: listed in index-00001/manifest.json but missing")
    assert "output.on_damaged_shard=reextract" in err and "restore it" in err and "export again" in err
    assert len(err.splitlines()) == 1
    assert not dest.exists()  # found before anything was written
    kept.rename(shard)  # restored: the same command succeeds
    assert export(src, dest, "--hidden-states", mode) == 0
    assert json.loads((dest / METADATA).read_text())["rows"] == len(samples(two_indexes))


# The export killed (SIGKILL) as it is about to write row 5's hidden states.
KILL_AT_ROW_5 = """
import os, pathlib, signal
_write_bytes = pathlib.Path.write_bytes
def write_bytes(self, data):
    if self.name == "hs_5.safetensors":
        os.kill(os.getpid(), signal.SIGKILL)
    return _write_bytes(self, data)
pathlib.Path.write_bytes = write_bytes
"""


def test_an_export_killed_midway_is_replaced_by_the_same_command(
    two_indexes: Path,
    exported: Path,
    job_env: dict[str, str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    dest = tmp_path / "spec"
    command = ["-m", "job", "export", "--format", "speculators", str(two_indexes), str(dest)]
    env = {**job_env, "PYTHONPATH": with_sitecustomize(tmp_path / "site", KILL_AT_ROW_5)}
    killed = subprocess.run([sys.executable, *command], env=env, capture_output=True, text=True, timeout=300)
    assert killed.returncode == -9, killed.stderr
    left = {p.name for p in dest.iterdir()}
    assert left == {UNFINISHED, "hidden_states", ".staging"} and not (dest / METADATA).exists()
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == [
        f"hs_{i}.safetensors" for i in range(5)
    ]

    capsys.readouterr()
    assert export(two_indexes, dest) == 0
    assert f"{dest} held an unfinished export ({UNFINISHED}): replaced" in capsys.readouterr().out
    assert_same_export(dest, exported)
    assert export(two_indexes, dest) == EXIT_CONFIG  # a finished export is never replaced
    assert "not an empty directory" in capsys.readouterr().err


def test_an_export_another_export_is_writing_is_left_alone(
    two_indexes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    dest = tmp_path / "spec"
    dest.mkdir()
    (dest / "hidden_states").mkdir()
    with (dest / UNFINISHED).open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the export writing it holds it
        capsys.readouterr()
        assert export(two_indexes, dest) == EXIT_CONFIG
        assert f"export DST {dest}: another export is writing it" in capsys.readouterr().err
        assert sorted(p.name for p in dest.iterdir()) == [UNFINISHED, "hidden_states"]


def assert_same_export(dest: Path, reference: Path) -> None:
    """``dest`` holds what ``reference`` (an export of the same output) holds: the same files, the
    same hidden states byte for byte, the same rows."""
    from datasets import load_from_disk

    assert sorted(p.name for p in dest.iterdir()) == sorted(p.name for p in reference.iterdir())
    names = sorted(p.name for p in (reference / "hidden_states").iterdir())
    assert sorted(p.name for p in (dest / "hidden_states").iterdir()) == names
    for name in names:
        assert (dest / "hidden_states" / name).read_bytes() == (
            reference / "hidden_states" / name
        ).read_bytes()
    rows = load_from_disk(str(dest)).with_format(None).to_dict()
    assert rows == load_from_disk(str(reference)).with_format(None).to_dict()
    meta, theirs = (json.loads((d / METADATA).read_text()) for d in (dest, reference))
    assert meta["rows"] == theirs["rows"] and meta["source"] == theirs["source"]


# Inside a mount namespace: a tmpfs nearly filled by another file, an export onto it, what is left
# there; then the other file removed (room made) and the same export again. Each step's stdout,
# stderr and exit code are files in $LOGS.
FULL_DISK_EXPORT = """
mount -t tmpfs -o size="$DISK_BYTES" tmpfs "$DISK" || exit 99
head -c "$FILLER_BYTES" /dev/zero >"$DISK/other" || exit 98
step() {
    name=$1; shift
    "$PYTHON" -m job "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"; echo $? >"$LOGS/$name.rc"
}
step full export --format speculators "$SRC" "$DISK/spec"
ls -A "$DISK" >"$LOGS/after-full.ls"
rm "$DISK/other"
step rerun export --format speculators "$SRC" "$DISK/spec"
cp -r "$DISK/spec" "$LOGS/spec"
"""


def test_an_export_onto_a_full_disk_is_an_error_and_the_same_command_succeeds_with_room(
    two_indexes: Path, exported: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    prefix = mount_namespace()
    if not prefix:
        pytest.skip("no mount namespace (unshare --mount) for a private tmpfs here")
    needed = sum(p.stat().st_size for p in exported.rglob("*") if p.is_file())
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir()
    logs.mkdir()
    env = {
        **job_env,
        "DISK": str(disk),
        "LOGS": str(logs),
        "SRC": str(two_indexes),
        "PYTHON": sys.executable,
        # room for about half of the export until the other file goes
        "DISK_BYTES": str(2 * needed + 2**20),
        "FILLER_BYTES": str(2 * needed + 2**20 - needed // 2),
    }
    proc = subprocess.run(
        [*prefix, "sh", "-c", FULL_DISK_EXPORT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr

    def step(name: str) -> tuple[int, str, str]:
        rc, out, err = ((logs / f"{name}.{kind}").read_text() for kind in ("rc", "out", "err"))
        return int(rc), out, err

    rc, out, err = step("full")
    assert rc == 1 and out == "", err  # a retry may succeed: exit 1, as for a run's full disk
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    line = err.strip()
    assert line.startswith(f"error: export DST {disk}/spec: out of space (No space left on device) after ")
    assert "the unfinished export was removed: free space there and run the same command again" in line
    done = int(line.split(" after ")[1].split(" of ")[0])
    assert 0 < done < len(samples(two_indexes))  # it failed midway
    assert (logs / "after-full.ls").read_text().split() == ["other"]  # nothing of the export is left

    rc, out, err = step("rerun")
    assert rc == 0, err
    assert out.startswith(f"exported         {len(samples(two_indexes))} samples")
    assert_same_export(logs / "spec", exported)


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
    assert "--format speculators [--hidden-states copy|reference] SRC DST" in capsys.readouterr().err
    assert export(two_indexes, tmp_path / "x", "--hidden-states", "link") == EXIT_CONFIG
    assert "--hidden-states 'link': unknown; choose copy or reference" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_layer_order_needs_the_last_layer() -> None:
    assert order_layers([2, 4, 5, N], N).order == [0, 1, 2, 3]
    layers = order_layers([2, N, 0], N)
    assert layers.exported == [2, 0, N] and layers.aux == [2, 0] and layers.reordered
    with pytest.raises(ConfigError, match=r"layers\.ids including 8"):
        order_layers([2, 4, 5], N)
    with pytest.raises(ConfigError, match="auxiliary"):
        order_layers([N], N)


# --- reference exports: speculators reads the hidden states from our shards --------------------


def register_backend() -> Any:
    """Register the eagle3-extract backend, as ``python -m job.speculators`` does before speculators'
    own imports (its training config collects backends' flags when first imported); returns the
    registry's class."""
    transfer = speculators("hs_connectors.transfer")
    importlib.import_module("job.speculators")
    return transfer.HiddenStatesBackend


def reference_transfer(dest: Path, **train_args: str) -> Any:
    """What ``speculators train --hidden-states-backend eagle3-extract`` builds for ``dest``."""
    backend = register_backend().registry["eagle3-extract"]
    args = argparse.ArgumentParser()
    backend.add_train_args(args)
    flags = [item for key, value in train_args.items() for item in (f"--{key.replace('_', '-')}", value)]
    return backend.from_train_args(args.parse_args(flags), str(dest))


def test_reference_export_writes_tokens_and_the_row_map_only(
    two_indexes: Path, exported: Path, referenced: Path
) -> None:
    from datasets import load_from_disk

    assert sorted(p.name for p in referenced.iterdir()) == sorted(
        p.name for p in exported.iterdir() if p.name != "hidden_states"
    )
    full, ref = load_from_disk(str(exported)), load_from_disk(str(referenced))
    assert ref.format == full.format and len(ref) == len(full)
    assert ref.with_format(None).to_dict() == full.with_format(None).to_dict()  # every column, every row
    assert torch.load(referenced / "token_freq.pt", weights_only=True) == torch.load(
        exported / "token_freq.pt", weights_only=True
    )
    meta, full_meta = (json.loads((d / METADATA).read_text()) for d in (referenced, exported))
    assert meta["hidden_states"]["mode"] == "reference" and full_meta["hidden_states"]["mode"] == "copy"
    assert meta["source"]["location"] == str(two_indexes.resolve())  # absolute: training runs anywhere
    assert meta["source"]["indexes"] == full_meta["source"]["indexes"]
    assert meta["layers"] == full_meta["layers"]
    # the map: row r of a shard listed with rows [a, b) is that shard's sample r - a
    ours = samples(two_indexes)
    rows = [
        (index["name"], shard["name"], position)
        for index in meta["source"]["indexes"]
        for shard in index["shards"]
        for position in range(shard["rows"][1] - shard["rows"][0])
    ]
    assert len(rows) == len(ours) == len(ref)
    for row, (index, name, position) in enumerate(rows):
        shard = read_manifest(two_indexes / index).shards  # type: ignore[union-attr]
        listed = next(s for s in shard if s.name == name)
        assert listed.sample_ids[position] == ref[row]["sample_id"] == ours[row].sample_id


def test_reference_backend_gives_speculators_the_full_exports_items(
    exported: Path, referenced: Path, fp8_reordered: tuple[Path, Path], tmp_path: Path
) -> None:
    data_mod = speculators("speculators.train.data")

    fp8_out, fp8_full = fp8_reordered
    fp8_ref = tmp_path / "fp8-reference"
    assert export(fp8_out, fp8_ref, "--hidden-states", "reference") == 0
    for full_dir, ref_dir in ((exported, referenced), (fp8_full, fp8_ref)):
        full = data_mod.ArrowDataset(max_len=4096, datapath=str(full_dir), on_missing="raise")
        ours = data_mod.ArrowDataset(
            max_len=4096, datapath=str(ref_dir), transfer=reference_transfer(ref_dir), on_missing="raise"
        )
        assert len(ours) == len(full) and ours.approx_lengths == full.approx_lengths
        for i in range(len(full)):
            a, b = ours[i], full[i]
            assert (
                a.keys()
                == b.keys()
                == {
                    "hidden_states",
                    "input_ids",
                    "verifier_last_hidden_states",
                    "loss_mask",
                    "lengths",
                    "position_ids",
                }
            )
            for key in a:
                assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), (ref_dir, i, key)


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
def test_speculators_loaders_give_equal_batches_from_either_export(
    two_indexes: Path, exported: Path, referenced: Path
) -> None:
    """speculators' own loaders, packing and collate: the file backend on the full export and ours
    on the reference export, ours in a spawned DataLoader worker (the transfer travels pickled)."""
    loader_mod = speculators("speculators.train.dataloader")
    from speculators.models.eagle3.data import shift_batch

    def loaders(data: Path, transfer: Any, workers: int) -> tuple[Any, Any]:
        return loader_mod.create_train_val_loaders(
            data_path=str(data),
            total_seq_len=512,
            hidden_states_dtype=torch.bfloat16,
            transfer=transfer,
            vllm_endpoint="http://127.0.0.1:9/v1",  # never contacted: on_missing="raise"
            on_missing="raise",
            verifier_name_or_path=read_manifest(two_indexes / "index-00000").model_path,  # type: ignore[union-attr]
            request_timeout=1.0,
            max_retries=0,
            generation_validation_retries=0,
            max_consecutive_generation_failures=1,
            hidden_size=HIDDEN,
            num_target_layers=3,
            num_workers=workers,
            prefetch_factor=2,
            preprocess=shift_batch,
            train_data_ratio=0.75,
            seed=3,
        )

    batches = 0
    theirs, ours_ = loaders(exported, None, 0), loaders(referenced, reference_transfer(referenced), 1)
    for full, ours in zip(theirs, ours_, strict=True):
        assert len(full) == len(ours)
        for a, b in zip(full, ours, strict=True):
            assert a.keys() == b.keys() and a["error_records"] == b["error_records"] == 0
            for key, value in a.items():
                if isinstance(value, torch.Tensor):
                    assert torch.equal(value, b[key]), key
            batches += 1
    assert batches > 2


def test_printed_train_lines_parse_with_speculators(
    two_indexes: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The lines run as pasted: no placeholder, every flag and value speculators' parser accepts."""
    register_backend()
    from speculators.train.config import TrainConfig

    model = read_manifest(two_indexes / "index-00000").model_path  # type: ignore[union-attr]
    for mode, program in (("copy", ["speculators"]), ("reference", ["python", "-m", "job.speculators"])):
        dest = tmp_path / f"data {mode}"  # a space: the printed line quotes paths
        line = shlex.split(export_printing(two_indexes, dest, capsys, "--hidden-states", mode))
        assert line[: len(program) + 1] == [*program, "train"], line
        config = TrainConfig.resolve(line[len(program) + 1 :]).flatten()
        assert config["data_path"] == str(dest)
        assert config["verifier_name_or_path"] == model
        assert config["target_layer_ids"] == [2, N // 2, N - 3]
        assert config["hidden_states_backend"] == ("eagle3-extract" if mode == "reference" else "file")


def test_speculators_trains_on_the_reference_export_as_on_the_full_one(
    two_indexes: Path, job_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """speculators 0.9's own trainer, three steps and a validation pass from each export's printed
    line, on the CPU: the same losses, step for step."""
    speculators("speculators.train.trainer")
    cpu_only = [
        *("--draft-attn-impl", "sdpa", "--loss-implementation", "eager"),  # no flex attention, no fused loss
        *("--num-workers", "0", "--epochs", "1", "--max-steps", "3", "--log-freq", "1"),
        *("--total-seq-len", "256", "--train-data-ratio", "0.75"),
    ]
    logged: dict[str, list[dict[str, Any]]] = {}
    for mode in ("copy", "reference"):
        line = shlex.split(export_printing(two_indexes, tmp_path / mode, capsys, "--hidden-states", mode))
        args = line[line.index("train") :]
        metrics = tmp_path / f"{mode}.jsonl"
        save = ["--save-path", str(tmp_path / f"checkpoints-{mode}")]
        proc = subprocess.run(
            [sys.executable, str(Path(__file__).parent / "speculators_cpu.py"), *args, *cpu_only, *save],
            env={**job_env, "SPECULATORS_METRICS_JSONL": str(metrics)},
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert proc.returncode == 0, proc.stderr[-4000:]
        logged[mode] = [json.loads(line) for line in metrics.read_text().splitlines()]
        assert (tmp_path / f"checkpoints-{mode}" / "0").is_dir()  # the epoch's checkpoint
    steps = [record["train"] for record in logged["reference"] if "train" in record]
    assert len(steps) == 3 and all(step["error_records"] == 0 for step in steps)
    assert all(0 < step["loss"] < 10 for step in steps)
    assert [r for r in logged["reference"] if "val" in r]  # the validation pass ran too
    strip = [{k: v for k, v in r.items() if k != "profile"} for r in logged["copy"]]
    assert [{k: v for k, v in r.items() if k != "profile"} for r in logged["reference"]] == strip


def test_reference_backend_refuses_what_it_cannot_read(
    two_indexes: Path, exported: Path, referenced: Path, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match="hidden states copied"):
        reference_transfer(exported)  # a full export: speculators' file backend reads it
    with pytest.raises(ConfigError, match=r"no eagle3_extract\.json"):
        reference_transfer(tmp_path)

    # the output rewritten since the export: a shard listed with another checksum
    moved = tmp_path / "moved"
    shutil.copytree(two_indexes, moved)
    manifest_path = moved / "index-00001" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    name = manifest["shards"][0]["name"]
    manifest["shards"][0]["checksum"]["value"] = "AAAAAAAAAAA="
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(DamagedShard, match=rf"index-00001/{name}: exported with checksum .* export it again"):
        reference_transfer(referenced, eagle3_extract_source=str(moved))  # before training starts

    # a flipped byte in a sample's rows: its CRC64NVME is checked before it is handed out
    damaged = tmp_path / "damaged"
    shutil.copytree(two_indexes, damaged)
    first = read_manifest(damaged / "index-00000").shards[0]  # type: ignore[union-attr]
    with (damaged / "index-00000" / first.name).open("r+b") as f:
        f.seek(first.bytes // 2)
        byte = f.read(1)
        f.seek(first.bytes // 2)
        f.write(bytes([byte[0] ^ 1]))
    with pytest.raises(DamagedShard, match=rf"{first.name}: checksum .* of sample 0 .* differs"):
        reference_transfer(referenced, eagle3_extract_source=str(damaged)).get_cached(0)
    unchecked = reference_transfer(
        referenced, eagle3_extract_source=str(damaged), eagle3_extract_verify="off"
    )
    assert unchecked.get_cached(0)["token_ids"].numel() > 0


CPU_TRAINING = [
    *("--draft-attn-impl", "sdpa", "--loss-implementation", "eager"),
    *("--epochs", "1", "--max-steps", "1", "--total-seq-len", "256"),
]


def launch(program: list[str], args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*program, *args], env=env, capture_output=True, text=True, timeout=600)


def assert_job_error_last(proc: subprocess.CompletedProcess[str], *needles: str) -> str:
    """Exit 2, and the job's one error line last on stderr, after no traceback."""
    assert proc.returncode == 2, proc.stderr[-4000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-4000:]
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and all(n in line for n in needles), line
    return line


def test_the_launcher_ends_a_moved_output_with_the_flag_to_pass(
    two_indexes: Path, job_env: dict[str, str], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``python -m job.speculators`` itself (it fails before speculators' trainer needs CUDA): the
    error used to come last in a speculators traceback, naming --eagle3-extract-source as if
    it had been passed."""
    speculators("speculators.train.trainer")
    output, moved = tmp_path / "out", tmp_path / "moved"
    shutil.copytree(two_indexes, output)
    line = shlex.split(export_printing(output, tmp_path / "ref", capsys, "--hidden-states", "reference"))
    args = [*line[line.index("train") :], "--num-workers", "0", "--save-path", str(tmp_path / "ckpt")]
    output.rename(moved)
    proc = launch([sys.executable, "-m", "job.speculators"], args, job_env)
    assert_job_error_last(
        proc,
        f"the shards' output ({tmp_path / 'ref'}/eagle3_extract.json: source.location)",
        f"{output}: does not exist",
        "if the output moved, pass --eagle3-extract-source with where it is now",
    )
    # passed, on the CPU: one step of training from the moved output
    cpu = [sys.executable, str(Path(__file__).parent / "speculators_cpu.py")]
    proc = launch(cpu, [*args, "--eagle3-extract-source", str(moved), *CPU_TRAINING], job_env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert (tmp_path / "ckpt" / "0").is_dir()


def test_the_launcher_ends_a_damaged_shard_with_its_error_line(
    two_indexes: Path, referenced: Path, job_env: dict[str, str], tmp_path: Path
) -> None:
    """A sample read in a (spawned) DataLoader worker: its checksum fails there, and the launcher
    prints that error, not the worker's traceback wrapped in speculators'."""
    speculators("speculators.train.trainer")
    damaged = tmp_path / "damaged"
    shutil.copytree(two_indexes, damaged)
    for index in ("index-00000", "index-00001"):  # every shard: the first sample read is a damaged one
        for entry in read_manifest(damaged / index).shards:  # type: ignore[union-attr]
            with (damaged / index / entry.name).open("r+b") as f:
                f.seek(entry.bytes // 2)
                byte = f.read(1)
                f.seek(entry.bytes // 2)
                f.write(bytes([byte[0] ^ 1]))
    metadata = json.loads((referenced / METADATA).read_text())
    args = [
        "train",
        *("--verifier-name-or-path", metadata["model"]["path"], "--data-path", str(referenced)),
        *("--target-layer-ids", *map(str, metadata["layers"]["speculators"]["target_layer_ids"])),
        *("--hidden-states-backend", "eagle3-extract", "--eagle3-extract-source", str(damaged)),
        *("--num-workers", "1", "--save-path", str(tmp_path / "ckpt"), *CPU_TRAINING),
    ]
    proc = launch([sys.executable, str(Path(__file__).parent / "speculators_cpu.py")], args, job_env)
    line = assert_job_error_last(proc, f"{damaged}/index-0000", ": checksum ", "differs from the manifest's")
    assert "on_damaged_shard=reextract" in line and "DataLoader worker" not in line
