"""Resume: a rerun continues an index exactly once, whatever state a crash left.

The invariant under test: after any sequence of (crashed) runs and one complete run,
every owned record is in exactly one listed shard or in rejected.jsonl, no file that
the manifest does not list remains, and the manifest counts are exact.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from job.checksum import crc64nvme_file
from job.shards import open_shard, read_manifest

MAX_LENGTH = 48
SHARD_KIB = 128  # ~64 float32 tokens of 4 layers: one or two samples per shard


def conversation(i: int) -> dict[str, Any]:
    return {
        "id": f"c-{i:03d}",
        "messages": [
            {"role": "user", "content": f"Question {i}: what is {i} + {i}?"},
            {"role": "assistant", "content": f"{i} + {i} = {2 * i}."},
        ],
    }


def dataset() -> list[Any]:
    lines: list[Any] = [conversation(i) for i in range(10)]
    lines.insert(3, '{"id": "broken", ')  # malformed: rejected as resume.jsonl:4
    lines.append(conversation(1))  # duplicate id of an early (committed) sample: rejected
    # Last, so it lands in the last shard (the one the simulated crash un-lists):
    # truncated, and the rerun must count it again.
    lines.append(
        {
            "id": "long",
            "messages": [
                {"role": "user", "content": "Count to forty."},
                {"role": "assistant", "content": " ".join(str(n) for n in range(40))},
            ],
        }
    )
    return lines


WRITTEN = [f"c-{i:03d}" for i in range(10)] + ["long"]
REJECTED = ["resume.jsonl:4", "c-001"]


@pytest.fixture(scope="module")
def base(
    tmp_path_factory: pytest.TempPathFactory,
    write_jsonl: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> dict[str, Any]:
    """One complete run; tests work on copies of its output."""
    root = tmp_path_factory.mktemp("resume")
    data = write_jsonl(root / "resume.jsonl", dataset())
    out = root / "out"
    args = (
        f"--data.path={data}",
        f"--data.max_length={MAX_LENGTH}",
        f"--output.shard_bytes={SHARD_KIB}KiB",
        *fast_args,
    )
    result = run_job("run", f"--output.uri={out}", *args)
    assert result.rc == 0, result.describe()
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.complete
    assert len(manifest.shards) >= 3, "the crash simulations need several shards"
    return {"out": out, "args": args, "data": data}


def copy_output(base: dict[str, Any], tmp_path: Path) -> Path:
    out = tmp_path / "out"
    shutil.copytree(base["out"], out)
    return out


def file_digests(directory: Path) -> dict[str, str]:
    return {
        p.relative_to(directory).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != ".lock"
    }


def assert_exactly_once(out: Path, read_jsonl: Callable[[Path], list[dict[str, Any]]]) -> None:
    """The invariant: each record once, in a listed, intact shard or in rejected.jsonl."""
    index = out / "index-00000"
    manifest = read_manifest(index)
    assert manifest is not None and manifest.complete
    listed = [sid for s in manifest.shards for sid in s.sample_ids]
    assert sorted(listed) == sorted(WRITTEN)
    assert len(listed) == len(set(listed)), Counter(listed).most_common(3)
    rejected = [e["sample_id"] for e in read_jsonl(index / "rejected.jsonl")]
    assert sorted(rejected) == sorted(REJECTED)
    assert manifest.counts.written == len(WRITTEN)
    assert manifest.counts.rejected == len(REJECTED)
    assert manifest.counts.truncated == 1
    assert manifest.counts.written + manifest.counts.rejected == len(dataset())
    # Only listed shards remain, and each is what the manifest says it is.
    names = {p.name for p in index.iterdir() if p.is_file()}
    assert names == {s.name for s in manifest.shards} | {"manifest.json", "rejected.jsonl", ".lock"}
    for entry in manifest.shards:
        assert crc64nvme_file(index / entry.name) == entry.checksum.value
        assert open_shard(index / entry.name).sample_ids == entry.sample_ids


def simulate_crash_before_manifest(index: Path) -> dict[str, Any]:
    """The state a crash between a shard's commit and the manifest rewrite leaves.

    The shard holding the sample "long" is committed but unlisted, as if it had been the last
    to commit (which shard commits last depends on the writer threads); the manifest is the
    previous one (incomplete, rejected not yet counted); rejected.jsonl is not yet published.
    Add the debris other crash points leave: half-written files and a stray shard.
    """
    path = index / "manifest.json"
    manifest = json.loads(path.read_text())
    last = next(i for i, s in enumerate(manifest["shards"]) if "long" in s["sample_ids"])
    dropped = manifest["shards"].pop(last)
    manifest["counts"]["written"] -= dropped["num_samples"]
    manifest["counts"]["truncated"] -= dropped["num_truncated"]
    manifest["counts"]["rejected"] = 0
    manifest["complete"] = False
    path.write_text(json.dumps(manifest))
    (index / "rejected.jsonl").rename(index / "rejected.jsonl.partial")
    shutil.copy(index / manifest["shards"][0]["name"], index / "shard-00040.safetensors")
    (index / "shard-00041.safetensors.partial").write_bytes(b"\0" * 4096)
    (index / "manifest.json.partial").write_text("{")
    return dropped


def test_rerun_of_a_complete_index_changes_nothing(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any]
) -> None:
    out = copy_output(base, tmp_path)
    before = file_digests(out)
    result = run_job("run", f"--output.uri={out}", *base["args"])
    assert result.rc == 0, result.describe()
    assert result.event("index_already_complete")["written"] == len(WRITTEN)
    assert not [e for e in result.events if e["event"] in ("run_started", "shard_committed")]
    assert file_digests(out) == before


def test_rerun_after_crash_before_manifest_write(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any], read_jsonl: Callable
) -> None:
    out = copy_output(base, tmp_path)
    index = out / "index-00000"
    dropped = simulate_crash_before_manifest(index)
    kept = json.loads((index / "manifest.json").read_text())["shards"]
    assert "long" in dropped["sample_ids"]

    result = run_job("run", f"--output.uri={out}", *base["args"])
    assert result.rc == 0, result.describe()
    assert result.event("run_started")["resumed_samples"] == sum(s["num_samples"] for s in kept)
    assert_exactly_once(out, read_jsonl)
    manifest = read_manifest(index)
    assert manifest is not None
    # Shards listed before the crash are kept as they were; the redone samples are in a
    # new shard whose number no earlier file (listed or not) ever used.
    assert [s.model_dump() for s in manifest.shards[: len(kept)]] == kept
    redone = manifest.shards[len(kept) :]
    assert [sid for s in redone for sid in s.sample_ids] == dropped["sample_ids"]
    assert all(int(s.name[6:11]) > 41 for s in redone)
    assert len(manifest.run_ids) == 2


def start_and_signal_after_first_commit(args: list[str], env: dict[str, str], sig: int) -> tuple[int, str]:
    """Run ``python -m job ARGS``; send ``sig`` once it logs its first shard_committed."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,  # its own process group: SIGKILL takes any children too
    )
    lines = []
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line)
            if json.loads(line)["event"] == "shard_committed":
                if sig == signal.SIGKILL:
                    os.killpg(proc.pid, sig)  # like an OOM kill: no cleanup at all
                else:
                    proc.send_signal(sig)  # like Kubernetes stopping the pod
                break
        lines += proc.stdout.read().splitlines(keepends=True)
    finally:
        if proc.poll() is None and sig == signal.SIGKILL:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=300)
    return proc.returncode, "".join(lines)


def test_crash_mid_run_sigterm_then_kill_9(
    tmp_path: Path,
    write_jsonl: Callable[..., Path],
    job_env: dict[str, str],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    read_jsonl: Callable,
    tiny_llama_dir: Path,
) -> None:
    # Many short samples and small shards: a run commits shard after shard for a while,
    # so a signal right after the first commit lands in the middle of the work.
    count = 300
    data = write_jsonl(tmp_path / "many.jsonl", [conversation(i) for i in range(count)])
    out = tmp_path / "out"
    index = out / "index-00000"
    args = ["run", f"--data.path={data}", f"--output.uri={out}", "--output.shard_bytes=64KiB", *fast_args]

    # 1. SIGTERM: a clean stop, exit 143, open shards abandoned, what is listed is intact.
    rc, stdout = start_and_signal_after_first_commit(args, job_env, signal.SIGTERM)
    assert rc == 143, stdout[-3000:]
    events = [json.loads(line)["event"] for line in stdout.splitlines()]
    assert "run_stopped" in events and "run_finished" not in events
    stopped = read_manifest(index)
    assert stopped is not None and not stopped.complete
    assert 0 < stopped.counts.written < count
    assert not list(index.glob("shard-*.partial"))
    assert {p.name for p in index.glob("shard-*")} == {s.name for s in stopped.shards}

    # 2. A rerun, killed with SIGKILL after its first commit: no cleanup at all.
    rc, stdout = start_and_signal_after_first_commit(args, job_env, signal.SIGKILL)
    assert rc == -signal.SIGKILL, stdout[-3000:]
    crashed = read_manifest(index)
    assert crashed is not None and not crashed.complete
    assert stopped.counts.written < crashed.counts.written < count

    # 3. A rerun to the end: every sample exactly once.
    result = run_job(*args)
    assert result.rc == 0, result.describe()
    manifest = read_manifest(index)
    assert manifest is not None and manifest.complete
    listed = [sid for s in manifest.shards for sid in s.sample_ids]
    assert sorted(listed) == [f"c-{i:03d}" for i in range(count)]  # each exactly once
    assert manifest.counts.written == count and manifest.counts.rejected == 0
    assert result.event("run_finished")["written_this_run"] == count - crashed.counts.written
    # The shards committed before each crash are still listed, unchanged.
    assert [s.model_dump() for s in manifest.shards[: len(crashed.shards)]] == [
        s.model_dump() for s in crashed.shards
    ]
    assert len(manifest.run_ids) == 3
    names = {p.name for p in index.iterdir() if p.is_file()}
    assert names == {s.name for s in manifest.shards} | {"manifest.json", "rejected.jsonl", ".lock"}
    assert read_jsonl(index / "rejected.jsonl") == []
    for entry in manifest.shards:
        assert crc64nvme_file(index / entry.name) == entry.checksum.value


def test_resume_with_other_layers_is_refused(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any]
) -> None:
    out = copy_output(base, tmp_path)
    simulate_crash_before_manifest(out / "index-00000")
    before = file_digests(out)
    result = run_job("run", f"--output.uri={out}", *base["args"], "--layers.ids=[1,8]")
    assert result.rc == 2, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "different settings" in lines[0]
    assert "layer_ids: [2, 4, 5, 8] -> [1, 8]" in lines[0]
    assert file_digests(out) == before  # a refused run touches nothing, not even debris


def test_resume_with_other_data_is_refused(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any]
) -> None:
    # Same data.path, one more record: the data fingerprint changes. Refused even for a
    # complete index: "nothing to do" would silently skip the new record.
    out = copy_output(base, tmp_path)
    before = file_digests(out)
    data = tmp_path / "resume.jsonl"
    shutil.copy(base["data"], data)
    with data.open("a") as f:
        f.write(json.dumps(conversation(99)) + "\n")
    args = [f"--data.path={data}" if a.startswith("--data.path=") else a for a in base["args"]]
    result = run_job("run", f"--output.uri={out}", *args)
    assert result.rc == 2, result.describe()
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "different settings or data" in lines[0] and "data_fingerprint" in lines[0]
    assert file_digests(out) == before


def test_resume_with_other_weights_is_refused(
    base: dict[str, Any],
    tmp_path: Path,
    run_job: Callable[..., Any],
    read_jsonl: Callable,
    tiny_llama_dir: Path,
) -> None:
    """model.path at a copy with the same config and tokenizer but other weights (every tensor
    shifted, as another fine-tune of the model): refused, naming model.path, before anything is
    touched. A copy with the same weights resumes: the identity holds the weights, not the path."""
    out = copy_output(base, tmp_path)
    simulate_crash_before_manifest(out / "index-00000")
    before = file_digests(out)
    extraction = json.loads((out / "extraction.json").read_text())
    assert extraction["weights_fingerprint"].startswith("sha256:")

    other = tmp_path / "other-weights"
    shutil.copytree(tiny_llama_dir, other)
    generator = torch.Generator().manual_seed(1)
    tensors = load_file(other / "model.safetensors")
    for name, tensor in tensors.items():
        tensors[name] = (tensor.float() + 0.05 * torch.randn(tensor.shape, generator=generator)).to(
            tensor.dtype
        )
    save_file(tensors, other / "model.safetensors", metadata={"format": "pt"})
    result = run_job("run", f"--output.uri={out}", *base["args"], f"--model.path={other}")
    assert result.rc == 2, result.describe()
    (line,) = result.stderr.strip().splitlines()
    assert "different settings or data: model.path (the model's weight files) (weights_fingerprint: " in line
    assert f"'{extraction['weights_fingerprint']}' -> 'sha256:" in line and "use a new output.uri" in line
    assert file_digests(out) == before

    same = tmp_path / "same-weights"
    shutil.copytree(tiny_llama_dir, same)
    result = run_job("run", f"--output.uri={out}", *base["args"], f"--model.path={same}")
    assert result.rc == 0, result.describe()
    assert_exactly_once(out, read_jsonl)


def test_an_index_written_before_the_weights_fingerprint_resumes(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any], read_jsonl: Callable
) -> None:
    """Manifests and extraction.json written before the identity held weights_fingerprint: the
    resume has no weights to compare and goes ahead, the manifest keeping what it recorded."""
    out = copy_output(base, tmp_path)
    simulate_crash_before_manifest(out / "index-00000")
    for path, identity in (
        (out / "index-00000" / "manifest.json", "identity"),
        (out / "extraction.json", None),
    ):
        recorded = json.loads(path.read_text())
        (recorded[identity] if identity else recorded).pop("weights_fingerprint")
        path.write_text(json.dumps(recorded))
    result = run_job("run", f"--output.uri={out}", *base["args"])
    assert result.rc == 0, result.describe()
    assert_exactly_once(out, read_jsonl)
    assert (
        json.loads((out / "index-00000" / "manifest.json").read_text())["identity"]["weights_fingerprint"]
        is None
    )


@pytest.mark.parametrize("mistake", ["data without records", "a tokenizer without a chat template"])
def test_a_first_run_that_commits_nothing_pins_nothing(
    mistake: str,
    base: dict[str, Any],
    tmp_path: Path,
    run_job: Callable[..., Any],
    read_jsonl: Callable,
    tiny_llama_dir: Path,
) -> None:
    """A first run that fails (exit 2) before committing a shard leaves neither extraction.json nor a
    manifest that pins the index: the corrected run on the same output.uri goes ahead."""
    out = tmp_path / "out"
    if mistake == "data without records":
        empty = tmp_path / "empty.jsonl"
        empty.write_bytes(b"")
        args = [f"--data.path={empty}" if a.startswith("--data.path=") else a for a in base["args"]]
        expected = "the input holds no records at all"
    else:
        model = tmp_path / "no-template"
        shutil.copytree(tiny_llama_dir, model)
        (model / "chat_template.jinja").unlink()
        config = json.loads((model / "tokenizer_config.json").read_text())
        config.pop("chat_template", None)
        (model / "tokenizer_config.json").write_text(json.dumps(config))
        args = [*base["args"], f"--model.path={model}"]
        expected = "has no chat template"
    result = run_job("run", f"--output.uri={out}", *args)
    assert result.rc == 2 and expected in result.stderr, result.describe()
    assert not (out / "extraction.json").exists()

    result = run_job("run", f"--output.uri={out}", *base["args"])
    assert result.rc == 0, result.describe()
    assert_exactly_once(out, read_jsonl)
    assert json.loads((out / "extraction.json").read_text()) == json.loads(
        (base["out"] / "extraction.json").read_text()
    )


def test_an_index_with_another_work_count_than_the_outputs_others_is_refused(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any]
) -> None:
    """Index 1 of 2 beside a finished index 0 of 1 would hash the samples differently and write
    some a second time: the output's extraction.json, written by its first run, refuses it before
    anything is written, and the refused run leaves no index directory for readers to trip on."""
    out = copy_output(base, tmp_path)
    before = file_digests(out)
    result = run_job("run", f"--output.uri={out}", *base["args"], "--work.index=1", "--work.count=2")
    assert result.rc == 2, result.describe()
    (line,) = result.stderr.strip().splitlines()
    assert "the other indexes of this output were extracted with different settings" in line
    assert "work.count (work_count: 1 -> 2)" in line and "use a new output.uri" in line
    assert file_digests(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["extraction.json", "index-00000"]
    assert json.loads((out / "extraction.json").read_text())["work_count"] == 1


def test_two_runs_on_one_index_are_refused(
    base: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any]
) -> None:
    out = copy_output(base, tmp_path)
    index = out / "index-00000"
    simulate_crash_before_manifest(index)
    with (index / ".lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running job holds it
        result = run_job("run", f"--output.uri={out}", *base["args"])
    assert result.rc == 2, result.describe()
    assert "another run holds" in result.stderr
    assert (index / "shard-00040.safetensors").exists()  # the holder's files were left alone
