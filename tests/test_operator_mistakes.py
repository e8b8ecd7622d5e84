"""Operator mistakes, faults and damaged output: each ends in one ``error:`` line on stderr (no
traceback), the documented exit code and an output that is either untouched or consistent.

Cases (``python -m job`` in a subprocess unless said otherwise):

* settings found wrong before any sample is read (exit 2, nothing written): an environment
  name with an unknown section (JOB_OUTPUTS__URI), an empty or blank output.uri / data.path,
  tensor parallelism with the hf backend, engine_args that shadow a setting,
  backend.vllm.final_step_tokens above max_num_batched_tokens, data.max_length
  beyond the model's positions (hf: up to all of them; vLLM: one fewer, for the token it samples
  after each prompt; backend.vllm.max_model_len not above data.max_length), backend.name=vllm
  without vLLM, backend.device=cuda without a GPU;
* vLLM with data.max_length at its limit and a longer record: truncated and written whole;
* a full disk (a 3 MiB tmpfs in a mount namespace): exit 1 naming it, no SIGBUS, the committed
  shards verify, and a rerun with space completes every sample exactly once;
* every sample rejected (a chat template that does not parse, data.format=sharegpt on OpenAI
  data; also with data.max_rejected_fraction=1), or more than data.max_rejected_fraction: exit 2
  with the most common reason, index incomplete, rejected.jsonl published;
* a committed shard damaged, truncated or missing on resume, of an interrupted or a complete
  index: exit 2 naming it and output.on_damaged_shard=reextract; with reextract, its samples are
  extracted again;
* reading damaged output: iter_output raises DamagedShard (verify=False reads it), compare ends
  with an error line and exit 1, export --verify with exit 2 (the remedy named, nothing left in DST);
  compare refuses a --tolerance that is nan or negative (exit 2);
* the command line: --version, a --help per command, an unknown command (exit 2, the commands
  listed), a reader of stdout that went away (exit 141);
* an unexpected exception (an activation transformers lacks) with --log.format=console: the traceback is
  rendered in the log, stderr has one line;
* progress events (tokens, an estimated then exact total, ETA, committed samples) and the final
  ``done:`` line of a run, and of a rerun of a complete index.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from conftest import NO_VLLM, VLLM_CPU_ENV, hide_vllm, mount_namespace, needs_vllm

from job.checksum import crc64nvme_file
from job.errors import DamagedShard
from job.manifest import Manifest
from job.shards import iter_output, open_shard, read_manifest

WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "drafts", "verify"]
POSITIONS = 4096  # max_position_embeddings of the builtin tiny models


def conversation(i: int, words: int = 12) -> dict[str, Any]:
    """About 60 tokens with the tiny tokenizer at the default ``words``."""
    user = " ".join(WORDS[(i + j) % len(WORDS)] for j in range(words))
    answer = " ".join(WORDS[(3 * i + j) % len(WORDS)] for j in range(words + 2))
    return {
        "id": f"s{i:03d}",
        "messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}],
    }


def error_line(result: Any, rc: int, *needles: str) -> str:
    """Exit ``rc``, no traceback, and one ``error:`` line, the last on stderr, holding every needle."""
    assert result.rc == rc, result.describe()
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors and errors == [lines[-1]], result.stderr
    for needle in needles:
        assert needle in errors[0], f"{needle!r} not in {errors[0]!r}"
    return errors[0]


def last_line(result: Any) -> str:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines, result.describe()
    return lines[-1]


def flip_byte(path: Path, from_end: int = 100) -> None:
    """One byte of the hidden states: the file keeps its size and still parses."""
    with path.open("r+b") as f:
        f.seek(-from_end, os.SEEK_END)
        value = f.read(1)[0]
        f.seek(-from_end, os.SEEK_END)
        f.write(bytes([value ^ 0xFF]))


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path]) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("data") / "six.jsonl", [conversation(i) for i in range(6)])


@pytest.fixture(scope="module")
def hf_args(data: Path, fast_args: tuple[str, ...]) -> tuple[str, ...]:
    # 128 KiB shards hold one ~60-token sample of 4 float32 layers: six shards.
    return (f"--data.path={data}", "--backend.name=hf", "--output.shard_bytes=128KiB", *fast_args)


# --- settings that cannot work: exit 2 before anything is written ----------------------------


def test_environment_name_with_an_unknown_section(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    # pydantic-settings would ignore JOB_OUTPUTS__URI and write to the default ./out.
    # (The single-underscore typo JOB_OUTPUT_URI is tests/test_settings.py's.)
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    result = run_job("run", *hf_args, env={"JOB_OUTPUTS__URI": str(tmp_path / "out")}, cwd=scratch)
    error_line(
        result,
        2,
        "environment JOB_OUTPUTS__URI",
        "no settings section 'outputs'",
        "the sections are model, layers, data, backend, output, work, generate, preflight, log",
        "JOB_OUTPUT__URI for output.uri",
    )
    assert not (tmp_path / "out").exists() and list(scratch.iterdir()) == []


@pytest.mark.parametrize("value", ["", "   "], ids=["empty", "blank"])
@pytest.mark.parametrize("setting", ["output.uri", "data.path"])
@pytest.mark.parametrize("source", ["cli", "env"])
def test_empty_path_settings(
    run_job: Callable[..., Any],
    hf_args: tuple[str, ...],
    tmp_path: Path,
    setting: str,
    value: str,
    source: str,
) -> None:
    """An unset variable in a manifest (``--output.uri=$OUT``) must not mean "the current directory"."""
    scratch = tmp_path / "cwd"
    scratch.mkdir()
    args = [a for a in hf_args if not a.startswith(f"--{setting}=")]
    env = None
    if source == "cli":
        args.append(f"--{setting}={value}")
    else:
        env = {"JOB_" + setting.upper().replace(".", "__"): value}
    result = run_job("run", *args, env=env, cwd=scratch)
    error_line(result, 2, f"{setting}: empty", "is an environment variable that should set it unset?")
    assert list(scratch.iterdir()) == []  # not ./out, nor anything else


def test_an_empty_data_path_is_found_before_the_model_is_fetched(
    run_job: Callable[..., Any], tmp_path: Path
) -> None:
    # A hub model is downloaded (all its weights) when it is resolved: an unset $DATA must fail first.
    result = run_job(
        "run", "--data.path=", "--model.path=no-such-org/no-such-model", f"--output.uri={tmp_path}/o"
    )
    line = error_line(result, 2, "data.path: empty")
    assert "model.path" not in line


def test_tensor_parallelism_with_the_hf_backend(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    result = run_job("run", *hf_args, f"--output.uri={tmp_path / 'out'}", "--backend.tensor_parallel_size=2")
    error_line(
        result,
        2,
        "backend.tensor_parallel_size is 2",
        "hf backend runs the model on one device",
        "backend.name=vllm",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("engine_arg", "setting"),
    [
        ("tensor_parallel_size", "backend.tensor_parallel_size"),
        ("max_model_len", "backend.vllm.max_model_len"),
    ],
)
def test_engine_args_may_not_shadow_a_setting(
    run_job: Callable[..., Any], data: Path, tmp_path: Path, engine_arg: str, setting: str
) -> None:
    result = run_job(
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--backend.name=vllm",
        "--backend.vllm.engine_args=" + json.dumps({engine_arg: 2, "download_dir": "/models"}),
    )
    error_line(result, 2, "backend.vllm.engine_args", "set those instead", f"{engine_arg} -> {setting}")
    assert not (tmp_path / "out").exists()


def test_hf_max_length_beyond_the_model_positions(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    result = run_job("run", *hf_args, f"--output.uri={tmp_path / 'out'}", "--data.max_length=5000")
    line = error_line(
        result,
        2,
        "data.max_length 5000",
        f"the {POSITIONS} positions builtin:tiny-llama was built for (max_position_embeddings)",
        f"set data.max_length to {POSITIONS} or less",
    )
    assert "vLLM" not in line  # the hf backend can use every position
    assert not (tmp_path / "out").exists()


@pytest.fixture(scope="module")
def long_data(tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path]) -> Path:
    """One record of ~4100 tokens (longer than the tiny models' 4096 positions) and a short one."""
    answer = " ".join(f"{WORDS[i % len(WORDS)]}{i % 97}" for i in range(3000))
    long = {
        "id": "long",
        "messages": [{"role": "user", "content": "go"}, {"role": "assistant", "content": answer}],
    }
    return write_jsonl(tmp_path_factory.mktemp("long") / "long.jsonl", [long, conversation(0)])


def assert_truncated_to(out: Path, max_length: int) -> None:
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.complete
    assert manifest.counts.written == 2 and manifest.counts.truncated == 1
    samples = {s.sample_id: s for s in iter_output(out)}
    long = samples["long"]
    assert long.input_ids.shape[0] == long.loss_mask.shape[0] == max_length
    assert long.hidden_states.shape[0] == max_length  # a row for every token, the last one included
    assert long.hidden_states.float().isfinite().all()


def test_hf_max_length_of_all_positions_is_written_whole(
    run_job: Callable[..., Any], long_data: Path, fast_args: tuple[str, ...], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_job(
        "run",
        f"--data.path={long_data}",
        f"--output.uri={out}",
        "--backend.name=hf",
        f"--data.max_length={POSITIONS}",
        *fast_args,
    )
    assert result.rc == 0, result.describe()
    assert_truncated_to(out, POSITIONS)


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("max_length", [5000, POSITIONS])
def test_vllm_max_length_leaves_a_position_for_the_sampled_token(
    run_job: Callable[..., Any], data: Path, tmp_path: Path, max_length: int
) -> None:
    """vLLM samples a token after every prompt; a prompt of all the model's positions made its
    runner assert ("Sampled token IDs exceed the max model length") at the first such sample."""
    result = run_job(
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--backend.name=vllm",
        f"--data.max_length={max_length}",
    )
    error_line(
        result,
        2,
        f"data.max_length {max_length}",
        f"the {POSITIONS} positions builtin:tiny-llama was built for",
        "vLLM needs one more for the token it samples after each prompt",
        f"set data.max_length to {POSITIONS - 1} or less",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        pytest.param(
            ["--data.max_length=100", "--backend.vllm.max_model_len=100"],
            ["backend.vllm.max_model_len 100 is not above data.max_length 100", "at least 101"],
            marks=[pytest.mark.vllm, needs_vllm],  # found against the model, with vLLM
            id="max_model_len",
        ),
        pytest.param(
            ["--backend.vllm.max_num_batched_tokens=4096", "--backend.vllm.final_step_tokens=8192"],
            ["backend.vllm.final_step_tokens is 8192", "max_num_batched_tokens (4096)", "set it lower"],
            id="final_step_tokens",
        ),
    ],
)
def test_vllm_settings_at_odds_with_each_other(
    run_job: Callable[..., Any], data: Path, tmp_path: Path, settings: list[str], message: list[str]
) -> None:
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={tmp_path / 'out'}", "--backend.name=vllm", *settings
    )
    error_line(result, 2, *message)
    assert not (tmp_path / "out").exists()


@pytest.mark.vllm
@needs_vllm
def test_vllm_max_length_at_its_limit_writes_the_truncated_sample_whole(
    run_job: Callable[..., Any], long_data: Path, fast_args: tuple[str, ...], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_job(
        "run",
        f"--data.path={long_data}",
        f"--output.uri={out}",
        "--backend.name=vllm",
        f"--data.max_length={POSITIONS - 1}",
        *fast_args,
        env=VLLM_CPU_ENV,
        timeout=900,
    )
    assert result.rc == 0, result.describe()
    assert last_line(result).startswith("done: index 0 complete")
    assert_truncated_to(out, POSITIONS - 1)


@pytest.mark.parametrize("how", sorted(NO_VLLM))
def test_vllm_backend_without_vllm(run_job: Callable[..., Any], data: Path, tmp_path: Path, how: str) -> None:
    pythonpath = hide_vllm(tmp_path, how)
    probe = subprocess.run(
        [sys.executable, "-c", "import vllm"],
        env={**os.environ, "PYTHONPATH": pythonpath},
        capture_output=True,
    )
    assert probe.returncode == 1 and b"ModuleNotFoundError" in probe.stderr  # the simulation holds
    result = run_job(
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--backend.name=vllm",
        env={"PYTHONPATH": pythonpath},
    )
    error_line(
        result,
        2,
        "backend.name is vllm, but vLLM is not installed",
        "use the container image",
        "backend.name=hf",
    )
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("device", ["cuda", "cuda:1"])
def test_cuda_device_without_a_gpu(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path, device: str
) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    result = run_job("run", *hf_args, f"--output.uri={tmp_path / 'out'}", f"--backend.device={device}")
    error_line(result, 2, f"backend.device is {device}", "torch sees no CUDA device", "backend.device=cpu")
    assert not (tmp_path / "out").exists()


# --- a full disk ---------------------------------------------------------------------------------


# Inside the namespace: run onto a 3 MiB tmpfs, inspect --verify what is there, keep a copy; then
# give the disk room (remount) and run again. Each step's stdout, stderr and exit code are files.
FULL_DISK_SCRIPT = """
mount -t tmpfs -o size=3m tmpfs "$DISK" || exit 99
step() {
    name=$1; shift
    "$PYTHON" -m job "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"; echo $? >"$LOGS/$name.rc"
}
step full run --output.uri="$DISK/out" "$@"
step inspect inspect "$DISK/out" --verify
cp -r "$DISK/out" "$LOGS/after-full"
mount -o remount,size=64m "$DISK" || exit 98
step rerun run --output.uri="$DISK/out" "$@"
cp -r "$DISK/out" "$LOGS/after-rerun"
"""


def test_disk_full_is_an_error_and_committed_shards_survive(
    tmp_path: Path, write_jsonl: Callable[..., Path], job_env: dict[str, str], fast_args: tuple[str, ...]
) -> None:
    """Before row writes waited for a shard's blocks to be reserved, the page fault on the full
    tmpfs killed the job with SIGBUS (exit 135) and an unlisted, half-written shard."""
    prefix = mount_namespace()
    if not prefix:
        pytest.skip("no mount namespace (unshare --mount) for a private tmpfs here")
    ids = [f"s{i:03d}" for i in range(40)]
    data = write_jsonl(tmp_path / "data.jsonl", [conversation(i) for i in range(40)])
    disk, logs = tmp_path / "disk", tmp_path / "logs"
    disk.mkdir()
    logs.mkdir()
    # All 9 layers in float32, 4.5 KiB per token: one ~60-token sample (~270 KB) per 512 KiB shard,
    # so about ten shards commit before the 3 MiB are gone.
    args = [
        f"--data.path={data}",
        "--backend.name=hf",
        "--output.shard_bytes=512KiB",
        "--layers.ids=[0,1,2,3,4,5,6,7,8]",
        *fast_args,
    ]
    env = {**job_env, "DISK": str(disk), "LOGS": str(logs), "PYTHON": sys.executable}
    proc = subprocess.run(
        [*prefix, "sh", "-c", FULL_DISK_SCRIPT, "sh", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr

    def step(name: str) -> tuple[int, str, str]:
        return (
            int((logs / f"{name}.rc").read_text()),
            (logs / f"{name}.out").read_text(),
            (logs / f"{name}.err").read_text(),
        )

    rc, _, err = step("full")
    assert rc == 1, f"exit {rc} (135 is SIGBUS)\n{err}"
    assert "Bus error" not in err and "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    assert lines[0].startswith("error: no space left for shard ") and "committed shards are kept" in lines[0]
    assert "free space there" in lines[0] and "and rerun" in lines[0]

    rc, out, err = step("inspect")
    assert rc == 0, out + err  # every listed shard is whole
    assert out.startswith("index-00000: INCOMPLETE") and "checksum ok" in out
    index = logs / "after-full" / "index-00000"
    manifest = read_manifest(index)
    assert manifest is not None and not manifest.complete
    assert len(manifest.shards) >= 1 and manifest.counts.written < len(ids)
    for entry in manifest.shards:
        assert crc64nvme_file(index / entry.name) == entry.checksum.value
    assert manifest.counts.written == sum(e.num_samples for e in manifest.shards)

    rc, _, err = step("rerun")
    assert rc == 0, err
    assert err.strip().splitlines()[-1].startswith("done: index 0 complete")
    manifest = read_manifest(logs / "after-rerun" / "index-00000")
    assert manifest is not None and manifest.complete and manifest.counts.written == len(ids)
    listed = [sid for entry in manifest.shards for sid in entry.sample_ids]
    assert sorted(listed) == ids  # each sample exactly once
    assert sorted(s.sample_id for s in iter_output(logs / "after-rerun")) == ids


# --- runs whose samples are (mostly) rejected ----------------------------------------------------


def assert_rejected_run(out: Path, rejected: int, written: int) -> list[dict[str, Any]]:
    index = out / "index-00000"
    manifest = read_manifest(index)
    assert manifest is not None and not manifest.complete
    assert manifest.counts.rejected == rejected and manifest.counts.written == written
    records = [json.loads(line) for line in (index / "rejected.jsonl").read_text().splitlines()]
    assert len(records) == rejected
    return records


@pytest.mark.parametrize("fraction", [None, "1"], ids=["default-fraction", "fraction-1"])
def test_a_chat_template_that_does_not_parse_rejects_every_sample(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path, fraction: str | None
) -> None:
    template = tmp_path / "broken.jinja"
    template.write_text("{% for m in messages %}{{ m.content }\n")  # "}" where "}}" belongs
    out = tmp_path / "out"
    extra = [] if fraction is None else [f"--data.max_rejected_fraction={fraction}"]
    result = run_job("run", *hf_args, f"--output.uri={out}", f"--data.chat_template={template}", *extra)
    line = error_line(
        result,
        2,
        "6 of the 6 samples of index 0 were rejected (none was written)",
        "most common reasons: 6 x chat template rejected the conversation: unexpected '}'",
        f"every one is in rejected.jsonl ({out}/index-00000/rejected.jsonl)",
        "data.chat_template",
    )
    assert "raise data.max_rejected_fraction" not in line  # no fraction accepts an empty index
    records = assert_rejected_run(out, rejected=6, written=0)
    assert all("unexpected '}'" in r["reason"] for r in records)
    assert not list((out / "index-00000").glob("shard-*"))


def test_sharegpt_format_on_openai_data_rejects_every_sample(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    result = run_job("run", *hf_args, f"--output.uri={out}", "--data.format=sharegpt")
    error_line(
        result,
        2,
        "6 of the 6 samples of index 0 were rejected (none was written)",
        "missing 'conversations' field (data.format is sharegpt, but this record is openai",
        "rejected.jsonl",
    )
    records = assert_rejected_run(out, rejected=6, written=0)
    assert sorted(r["sample_id"] for r in records) == [f"s{i:03d}" for i in range(6)]


def test_more_rejected_than_the_fraction_stops_and_a_higher_fraction_completes(
    run_job: Callable[..., Any], write_jsonl: Callable[..., Path], fast_args: tuple[str, ...], tmp_path: Path
) -> None:
    no_answer = [{"id": f"q{i}", "messages": [{"role": "user", "content": "hi"}]} for i in range(3)]
    data = write_jsonl(tmp_path / "mostly-bad.jsonl", [conversation(0), conversation(1), *no_answer])
    out = tmp_path / "out"
    args = (f"--data.path={data}", f"--output.uri={out}", "--backend.name=hf", *fast_args)
    result = run_job("run", *args)
    error_line(
        result,
        2,
        "3 of the 5 samples of index 0 were rejected (more than data.max_rejected_fraction 0.5)",
        "raise data.max_rejected_fraction to accept it",
    )
    assert_rejected_run(out, rejected=3, written=2)
    # Accepting it: the rerun resumes (the two samples stay as they are) and completes.
    result = run_job("run", *args, "--data.max_rejected_fraction=0.6")
    assert result.rc == 0, result.describe()
    assert last_line(result) == (
        f"done: index 0 complete at {out}/index-00000: 2 samples written (0 this run), 3 rejected "
        f"(listed in {out}/index-00000/rejected.jsonl), 1 shards"
    )


# --- damaged output --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def complete_run(
    tmp_path_factory: pytest.TempPathFactory, run_job: Callable[..., Any], hf_args: tuple[str, ...]
) -> tuple[Path, Any]:
    """One complete run of the six samples (six shards); tests work on copies of it."""
    out = tmp_path_factory.mktemp("complete") / "out"
    result = run_job("run", *hf_args, f"--output.uri={out}", "--log.progress_interval_s=0.01")
    assert result.rc == 0, result.describe()
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.complete and len(manifest.shards) == 6
    return out, result


def interrupted_copy(complete_run: tuple[Path, Any], tmp_path: Path) -> tuple[Path, Manifest]:
    """A copy whose manifest says "incomplete", as an interrupted run leaves it."""
    out = tmp_path / "out"
    shutil.copytree(complete_run[0], out)
    path = out / "index-00000" / "manifest.json"
    manifest = json.loads(path.read_text())
    manifest["complete"] = False
    path.write_text(json.dumps(manifest))
    return out, Manifest.from_bytes(path.read_bytes(), str(path))


def assert_each_sample_once(out: Path) -> Manifest:
    index = out / "index-00000"
    manifest = read_manifest(index)
    assert manifest is not None and manifest.complete and manifest.counts.written == 6
    listed = [sid for entry in manifest.shards for sid in entry.sample_ids]
    assert sorted(listed) == [f"s{i:03d}" for i in range(6)]
    for entry in manifest.shards:
        assert crc64nvme_file(index / entry.name) == entry.checksum.value
        assert open_shard(index / entry.name).sample_ids == entry.sample_ids
    assert {p.name for p in index.glob("shard-*")} == {e.name for e in manifest.shards}
    return manifest


def test_a_damaged_shard_stops_the_resume_and_reextract_replaces_it(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    out, manifest = interrupted_copy(complete_run, tmp_path)
    victim = manifest.shards[1]
    flip_byte(out / "index-00000" / victim.name)
    before = (out / "index-00000" / "manifest.json").read_bytes()

    result = run_job("run", *hf_args, f"--output.uri={out}")
    error_line(
        result,
        2,
        f"1 committed shard(s) of {out}/index-00000 no longer match the manifest",
        f"{victim.name}: checksum",
        f"differs from the manifest's {victim.checksum.value}",
        "set output.on_damaged_shard=reextract",
    )
    assert (out / "index-00000" / "manifest.json").read_bytes() == before  # nothing was changed
    assert (out / "index-00000" / victim.name).exists()

    result = run_job("run", *hf_args, f"--output.uri={out}", "--output.on_damaged_shard=reextract")
    assert result.rc == 0, result.describe()
    dropped = result.event("damaged_shard_dropped")
    assert dropped["shard"] == victim.name and dropped["samples"] == 1 and "checksum" in dropped["problem"]
    assert last_line(result) == (
        f"done: index 0 complete at {out}/index-00000: 6 samples written (1 this run), 0 rejected "
        f"(listed in {out}/index-00000/rejected.jsonl), 6 shards"
    )
    after = assert_each_sample_once(out)
    assert victim.name not in {e.name for e in after.shards}
    assert not (out / "index-00000" / victim.name).exists()


def test_a_damaged_shard_of_a_complete_index_is_found_and_reextract_replaces_it(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    """A complete index is checked as an interrupted one is: "already complete" would hand the
    damaged shard to the trainer. reextract reopens the index and completes it again."""
    out = tmp_path / "out"
    shutil.copytree(complete_run[0], out)
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.complete
    victim = manifest.shards[3]
    flip_byte(out / "index-00000" / victim.name)
    before = (out / "index-00000" / "manifest.json").read_bytes()

    result = run_job("run", *hf_args, f"--output.uri={out}")
    error_line(result, 2, f"{victim.name}: checksum", "set output.on_damaged_shard=reextract")
    assert (out / "index-00000" / "manifest.json").read_bytes() == before

    result = run_job("run", *hf_args, f"--output.uri={out}", "--output.on_damaged_shard=reextract")
    assert result.rc == 0, result.describe()
    assert result.event("damaged_shard_dropped")["shard"] == victim.name
    assert result.event("complete_index_reopened")["shards"] == 5
    assert "1 this run" in last_line(result)
    after = assert_each_sample_once(out)
    assert victim.name not in {e.name for e in after.shards}

    result = run_job("run", *hf_args, f"--output.uri={out}")  # intact again: nothing to do
    assert result.rc == 0 and "was already complete" in last_line(result), result.describe()


def test_a_truncated_shard_fails_the_size_check(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    out, manifest = interrupted_copy(complete_run, tmp_path)
    victim = manifest.shards[2]
    os.truncate(out / "index-00000" / victim.name, victim.bytes - 4096)
    result = run_job("run", *hf_args, f"--output.uri={out}", "--output.verify_on_resume=size")
    error_line(
        result,
        2,
        f"{victim.name}: {victim.bytes - 4096} bytes, but the manifest lists {victim.bytes}",
        "output.on_damaged_shard=reextract",
    )


def test_the_size_check_passes_a_shard_of_the_right_size(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    """verify_on_resume=size trades the checksum's read of every shard for a stat: a flipped byte
    goes unnoticed (as documented), and the resume completes."""
    out, manifest = interrupted_copy(complete_run, tmp_path)
    flip_byte(out / "index-00000" / manifest.shards[0].name)
    result = run_job("run", *hf_args, f"--output.uri={out}", "--output.verify_on_resume=size")
    assert result.rc == 0, result.describe()
    assert "0 this run" in last_line(result)


def test_a_missing_shard_stops_the_resume(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    out, manifest = interrupted_copy(complete_run, tmp_path)
    victim = manifest.shards[-1]
    (out / "index-00000" / victim.name).unlink()
    result = run_job("run", *hf_args, f"--output.uri={out}")
    error_line(result, 2, f"{victim.name}: listed in the manifest but missing", "on_damaged_shard=reextract")
    result = run_job("run", *hf_args, f"--output.uri={out}", "--output.on_damaged_shard=reextract")
    assert result.rc == 0, result.describe()
    assert result.event("damaged_shard_dropped")["shard"] == victim.name
    assert_each_sample_once(out)


@pytest.fixture
def damaged_copy(complete_run: tuple[Path, Any], tmp_path: Path) -> tuple[Path, str]:
    """A copy of the complete output with one byte of one shard's hidden states flipped."""
    out = tmp_path / "damaged"
    shutil.copytree(complete_run[0], out)
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None
    name = manifest.shards[3].name
    flip_byte(out / "index-00000" / name)
    return out, name


def test_iter_output_refuses_a_damaged_shard(damaged_copy: tuple[Path, str]) -> None:
    out, name = damaged_copy
    with pytest.raises(DamagedShard, match=f"{name}: checksum .* differs from the manifest's"):
        list(iter_output(out))
    assert len(list(iter_output(out, verify=False))) == 6  # reading it anyway is a choice
    (out / "index-00000" / name).unlink()
    with pytest.raises(DamagedShard, match=f"{name}: listed in index-00000/manifest.json but missing"):
        list(iter_output(out, verify=False))


def test_compare_with_a_damaged_or_missing_shard(
    complete_run: tuple[Path, Any], damaged_copy: tuple[Path, str], run_job: Callable[..., Any]
) -> None:
    good, (damaged, name) = complete_run[0], damaged_copy
    for candidate, reference in ((damaged, good), (good, damaged)):
        result = run_job("compare", str(candidate), "--reference", str(reference))
        error_line(result, 1, f"{damaged}/index-00000/{name}: checksum", "the shard is damaged")
        assert result.stdout == ""
    (damaged / "index-00000" / name).unlink()
    result = run_job("compare", str(good), "--reference", str(damaged))
    error_line(result, 1, f"{name}: listed in index-00000/manifest.json but missing")


@pytest.mark.parametrize(
    ("setting", "named", "why"),
    [
        (
            "--layers.ids=[1,3,8]",
            "layers.ids: [1, 3, 8] vs the reference's [2, 4, 5, 8]",
            "6 with other layer ids",
        ),
        (
            "--data.max_length=40",
            "data.max_length: 40 vs the reference's 2048",
            "6 with another number of tokens",
        ),
    ],
    ids=["layers", "max_length"],
)
def test_compare_names_the_setting_that_differs(
    complete_run: tuple[Path, Any],
    run_job: Callable[..., Any],
    hf_args: tuple[str, ...],
    tmp_path: Path,
    setting: str,
    named: str,
    why: str,
) -> None:
    other = tmp_path / "other"
    result = run_job("run", *hf_args, f"--output.uri={other}", setting)
    assert result.rc == 0, result.describe()
    result = run_job("compare", str(other), "--reference", str(complete_run[0]))
    assert result.rc == 1 and "Traceback" not in result.stderr, result.describe()
    assert result.stdout.startswith("FAIL: 0 samples compared") and f"mismatched 6 ({why}" in result.stdout
    assert f"the outputs were written with different settings: {named}" in result.stdout, result.stdout
    # an output compared with itself: nothing differs
    same = run_job("compare", str(complete_run[0]), "--reference", str(complete_run[0]))
    assert same.rc == 0 and "different settings" not in same.stdout, same.describe()


@pytest.mark.parametrize("tolerance", ["nan", "-0.01", "-inf", "tiny"])
def test_compare_refuses_a_tolerance_that_is_no_relative_error(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], tolerance: str
) -> None:
    # nan failed every comparison (nothing is <= nan) and a negative one every sample: both
    # said FAIL (exit 1) about outputs that are equal.
    out = str(complete_run[0])
    result = run_job("compare", out, "--reference", out, f"--tolerance={tolerance}")
    error_line(result, 2, "--tolerance", repr(tolerance), "relative error of 0 or more")
    assert result.stdout == ""
    same = run_job("compare", out, "--reference", out, "--tolerance=0")
    assert same.rc == 0 and same.stdout.startswith("OK: 6 samples compared"), same.describe()


def test_export_verify_with_a_damaged_shard(
    damaged_copy: tuple[Path, str], run_job: Callable[..., Any]
) -> None:
    src, name = damaged_copy
    dest = src.parent / "export"
    result = run_job("export", "--format", "speculators", str(src), str(dest), "--verify")
    error_line(
        result,
        2,
        f"{name}: checksum",
        "differs from the manifest's",
        "on_damaged_shard=reextract",
        "export again",
    )
    assert not dest.exists()  # the unfinished export was removed


# --- the command line -------------------------------------------------------------------------------


def test_version(run_job: Callable[..., Any]) -> None:
    result = run_job("--version")
    assert result.rc == 0 and result.stdout.strip() == f"eagle3-extract {version('eagle3-extract')}"


@pytest.mark.parametrize("word", ["frobnicate", "reextract"])
def test_an_unknown_command_lists_the_commands(
    run_job: Callable[..., Any], tmp_path: Path, word: str
) -> None:
    # It used to run `run` with the word as a stray setting ("unexpected argument").
    result = run_job(word, f"--output.uri={tmp_path / 'out'}")
    line = error_line(result, 2, f"unknown command {word!r}", "run (the default)", "--section.key=value")
    for command in ("config", "plan", "preflight", "inspect", "compare", "bench", "export"):
        assert command in line
    assert not (tmp_path / "out").exists()


def test_every_command_has_its_own_help(run_job: Callable[..., Any]) -> None:
    helps = {}
    for command in ("", "run", "inspect", "export", "compare", "config", "plan"):
        result = run_job(*command.split(), "--help")
        assert result.rc == 0 and result.stderr == "", result.describe()
        helps[command] = result.stdout
    assert len(set(helps.values())) == len(helps)  # no command prints another's help
    assert "COMMAND" in helps[""] and "--version" in helps[""]
    assert helps["run"].startswith("usage: python -m job run") and "--section.key=value" in helps["run"]
    assert "--verify" in helps["inspect"] and "--config" not in helps["inspect"]
    assert "--format speculators [--hidden-states copy|reference] SRC DST" in helps["export"]
    assert "--allow-incomplete" in helps["export"]
    assert "--reference" in helps["compare"]


def test_a_reader_that_went_away_ends_inspect_quietly(
    complete_run: tuple[Path, Any], job_env: dict[str, str]
) -> None:
    """``inspect OUT | head -1`` once head has exited: exit 141 (as for SIGPIPE), no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # deterministic: the reader is gone before the first write
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "job", "inspect", str(complete_run[0])],
            stdout=write_end,
            stderr=subprocess.PIPE,
            env=job_env,
            text=True,
            timeout=120,
        )
    finally:
        os.close(write_end)
    assert proc.returncode == 141, proc.stderr
    assert proc.stderr == ""  # no BrokenPipeError, not even "Exception ignored" at exit
    # Through a shell pipe: head gets its line, the pipeline has no error output.
    piped = subprocess.run(
        ["sh", "-c", f'"{sys.executable}" -m job inspect "{complete_run[0]}" | head -1'],
        capture_output=True,
        env=job_env,
        text=True,
        timeout=120,
    )
    assert piped.returncode == 0 and piped.stderr == ""
    assert piped.stdout.startswith("index-00000: complete, 6 shards")


def test_an_unexpected_failure_with_console_logs(
    run_job: Callable[..., Any], hf_args: tuple[str, ...], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """A config.json naming an activation transformers does not have fails inside transformers'
    model construction: an exception the job has no name for. The console renderer must render its
    traceback (it raised TypeError on the dict form), and stderr must hold one line."""
    model = tmp_path / "model"
    shutil.copytree(tiny_llama_dir, model)
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "hidden_act": "no_such_activation"}))
    result = run_job(
        "run", *hf_args, f"--output.uri={tmp_path / 'out'}", f"--model.path={model}", "--log.format=console"
    )
    error_line(
        result,
        1,
        "unexpected failure (KeyError: 'no_such_activation')",
        "the traceback is in the job_crashed log event",
    )
    crashed = result.stdout[result.stdout.index("job_crashed") :]
    assert 'File "' in crashed and "job/backends/hf.py" in crashed and "in from_pretrained" in crashed
    assert crashed.rstrip().splitlines()[-1] == "KeyError: 'no_such_activation'"
    assert "TypeError" not in result.stdout and "Traceback" not in result.stderr


# --- progress and the final line ----------------------------------------------------------------------


def test_progress_events_count_tokens_against_an_estimated_then_exact_total(
    complete_run: tuple[Path, Any],
) -> None:
    out, result = complete_run
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None
    total = sum(e.num_tokens for e in manifest.shards)
    progress = [e for e in result.events if e.get("event") == "progress"]
    assert len(progress) >= 3, result.stdout
    tokens = [e["tokens"] for e in progress]
    assert tokens == sorted(tokens) and tokens[0] < tokens[-1] == total
    for event in progress:
        assert isinstance(event["total_tokens"], int) and isinstance(event["eta_s"], int | float)
        # Samples of ~60 tokens each: tokens per input byte of the first samples predict the total.
        assert abs(event["total_tokens"] - total) <= 0.15 * total, event
        # The ETA is the tokens still to come at the rate so far (both rounded to 0.1).
        remaining = (event["total_tokens"] - event["tokens"]) / event["tok_per_s"]
        assert abs(event["eta_s"] - remaining) <= 0.05 + 0.01 * remaining, event
        assert 0 <= event["written"] <= event["samples"] <= 6
    assert not progress[0]["total_exact"] and progress[0]["total_tokens"] > progress[0]["tokens"]
    assert progress[-1]["total_exact"] and progress[-1]["total_tokens"] == total
    written = [e["written"] for e in progress]
    assert written == sorted(written)
    committed = [e for e in result.events if e.get("event") == "shard_committed"]
    assert len(committed) == 6 and written[-1] <= sum(e["samples"] for e in committed)


def test_the_last_line_says_where_the_output_is(
    complete_run: tuple[Path, Any], run_job: Callable[..., Any], hf_args: tuple[str, ...], tmp_path: Path
) -> None:
    out, result = complete_run
    index = out / "index-00000"
    assert result.stderr.strip() == (
        f"done: index 0 complete at {index}: 6 samples written (6 this run), 0 rejected "
        f"(listed in {index}/rejected.jsonl), 6 shards"
    )
    copy = tmp_path / "out"
    shutil.copytree(out, copy)
    before = {p.name: crc64nvme_file(p) for p in (copy / "index-00000").glob("shard-*")}
    rerun = run_job("run", *hf_args, f"--output.uri={copy}")
    assert rerun.rc == 0, rerun.describe()
    assert rerun.stderr.strip() == f"done: index 0 was already complete at {copy}/index-00000"
    assert {p.name: crc64nvme_file(p) for p in (copy / "index-00000").glob("shard-*")} == before
