"""Bad input: every bad record becomes a rejected.jsonl entry and the run still
succeeds; fatal problems stop the run with one readable line. And the logs of such a
run: JSON lines on stdout, the same events in index-*/logs/<run_id>.jsonl, no secrets.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from job.backends import extract_all
from job.backends.hf import HFBackend
from job.data.encode import (
    REASONING_NOT_RENDERED,
    EncodedSample,
    EncoderSpec,
    RejectedSample,
    SampleEncoder,
)
from job.hidden_dtype import hidden_dtype
from job.model import resolve_model
from job.settings import ModelSettings
from job.shards import iter_output, read_manifest

SECRET = "some-secret-value-123"
MAX_LENGTH = 64


def chat(sid: str, answer: str = "Fine, thanks.") -> dict[str, Any]:
    return {
        "id": sid,
        "messages": [{"role": "user", "content": "How are you?"}, {"role": "assistant", "content": answer}],
    }


# (line, expected sample id, a word the rejection reason must contain; None: written)
CASES: list[tuple[Any, str, str | None]] = [
    (chat("ok-1"), "ok-1", None),
    ('{"id": "broken", "messages": [', "bad.jsonl:2", "malformed JSON"),
    (b'{"id": "caf\xe9", "text": "latin-1, not UTF-8"}', "bad.jsonl:3", "UTF-8"),
    ("[1, 2, 3]", "bad.jsonl:4", "JSON object"),
    ({"id": "no-fields", "text": "hello"}, "no-fields", "'messages'"),
    ({"id": "conv-not-list", "conversations": {"from": "human"}}, "conv-not-list", "must be a list"),
    (
        {"id": "conv-text-not-json", "conversations": "hello"},
        "conv-text-not-json",
        "'conversations' (a string: read as the JSON of the list of turns): not valid JSON",
    ),
    ({"id": "turn-not-object", "messages": ["hello"]}, "turn-not-object", "expected an object"),
    (
        {"id": "missing-role", "messages": [{"content": "hi"}, {"role": "assistant", "content": "x"}]},
        "missing-role",
        "messages[0].role",
    ),
    (
        {"id": "missing-content", "messages": [{"role": "user"}, {"role": "assistant", "content": "x"}]},
        "missing-content",
        "messages[0].content",
    ),
    ({"id": "empty", "conversations": []}, "empty", "empty conversation"),
    (
        {
            "id": "no-assistant",
            "messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}],
        },
        "no-assistant",
        "no assistant turn",
    ),
    (
        {
            "id": "unknown-role",
            "conversations": [{"from": "narrator", "value": "x"}, {"from": "gpt", "value": "y"}],
        },
        "unknown-role",
        "unknown role 'narrator'",
    ),
    (
        {
            "id": "int-content-ü🚀",  # non-ASCII: rejected.jsonl and logs are UTF-8 JSON
            "messages": [{"role": "user", "content": 7}, {"role": "assistant", "content": "x"}],
        },
        "int-content-ü🚀",
        "must be a string",
    ),
    (
        {
            "id": "null-content",
            "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}],
        },
        "null-content",
        "must be a string",
    ),
    (chat("too-long", "word " * 200), "too-long", "too long"),
    (chat("ok-1", "a different answer, same id"), "ok-1", "duplicate"),
    ({"id": "oov", "input_ids": [1, 2, 5000]}, "oov", "vocabulary"),
    ({"id": "negative-id", "input_ids": [1, -1]}, "negative-id", "vocabulary"),
    ({"id": "mask-length", "input_ids": [1, 2, 3], "loss_mask": [1, 1]}, "mask-length", "'loss_mask' has 2"),
    ({"id": "mask-value", "input_ids": [1, 2], "loss_mask": [1, 2]}, "mask-value", "loss_mask[1]"),
    ({"id": "ids-not-ints", "input_ids": [1, "2"]}, "ids-not-ints", "input_ids[1]"),
    ({"id": "ids-bool", "input_ids": [True, 2]}, "ids-bool", "input_ids[0]"),
    ({"id": "ids-empty", "input_ids": []}, "ids-empty", "empty"),
    (
        {"id": "mask-all-zero", "input_ids": [1, 2], "loss_mask": [0, 0]},
        "mask-all-zero",
        "no assistant tokens",
    ),
    (
        {"id": "ok-2", "conversations": [{"from": "human", "value": "q"}, {"from": "gpt", "value": "a"}]},
        "ok-2",
        None,
    ),
    ({"id": "ok-3", "input_ids": [5, 6, 7, 8]}, "ok-3", None),
]
# Written, with a warning: tiny-llama's Llama 3.1 template renders no reasoning_content.
WARNED = ["reasoning-dropped-1", "reasoning-dropped-2"]
CASES += [
    (
        {
            "id": sid,
            "messages": [
                {"role": "user", "content": "2 + 2?"},
                {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
            ],
        },
        sid,
        None,
    )
    for sid in WARNED
]
WRITTEN = [sid for _, sid, reason in CASES if reason is None]
REJECTED = [(sid, reason) for _, sid, reason in CASES if reason is not None]


@pytest.fixture(scope="module")
def bad_run(
    tmp_path_factory: pytest.TempPathFactory,
    write_jsonl: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bad")
    data = write_jsonl(root / "bad.jsonl", [line for line, _, _ in CASES])
    out = root / "out"
    args = (
        f"--data.path={data}",
        f"--output.uri={out}",
        f"--data.max_length={MAX_LENGTH}",
        "--data.too_long=skip",
        "--data.max_rejected_fraction=1",  # this data set is mostly bad on purpose
        # The secret inside a setting that is not secret-looking by name, so redaction
        # by key does not catch it: only the log scrubber (by value) can.
        '--backend.vllm.engine_args={"download_dir": "/models/' + SECRET + '"}',
        # The default model.dtype (bfloat16): the other pipeline tests use float32.
        *(a for a in fast_args if not a.startswith("--model.dtype")),
    )
    result = run_job("run", *args, env={"AWS_SECRET_ACCESS_KEY": SECRET})
    assert result.rc == 0, result.describe()
    return {"result": result, "args": args, "out": out, "index": out / "index-00000"}


# --- per-record rejections --------------------------------------------------------------


def test_each_bad_record_is_rejected_with_a_reason(bad_run: dict[str, Any], read_jsonl: Callable) -> None:
    entries = read_jsonl(bad_run["index"] / "rejected.jsonl")
    assert all(set(e) == {"sample_id", "reason"} for e in entries)
    assert [e["sample_id"] for e in entries] == [sid for sid, _ in REJECTED]
    for entry, (sid, needle) in zip(entries, REJECTED, strict=True):
        assert needle in entry["reason"], (sid, entry["reason"])


def test_good_records_are_written_once(bad_run: dict[str, Any]) -> None:
    samples = list(iter_output(bad_run["out"], require_complete=True))
    assert [s.sample_id for s in samples] == WRITTEN
    # the first "ok-1" is the one kept; the later duplicate is the rejected one
    assert samples[0].input_ids.shape[0] < 40


def test_default_bfloat16_output_matches_the_reference(
    bad_run: dict[str, Any], tiny_llama_dir: Path, job_torch_threads: int
) -> None:
    samples = list(iter_output(bad_run["out"]))
    info = resolve_model(ModelSettings(path="builtin:tiny-llama"))
    assert info.dtype == "bfloat16"
    reference = extract_all(
        HFBackend.load(info, [2, 4, 5, 8], "cpu", hidden_dtype("bfloat16")),
        [s.input_ids.numpy() for s in samples],
    )
    for sample, want in zip(samples, reference, strict=True):
        assert sample.hidden_states.dtype == torch.bfloat16
        assert torch.equal(sample.hidden_states, want), sample.sample_id
    manifest = read_manifest(bad_run["index"])
    assert manifest is not None and manifest.dtype == "bfloat16"
    # 4 layers x 128 x 2 bytes + id + mask per token
    tokens = sum(s.num_tokens for s in manifest.shards)
    assert sum(s.bytes for s in manifest.shards) - tokens * (4 * 128 * 2 + 5) < 8192 * len(manifest.shards)


def test_counts_account_for_every_record(bad_run: dict[str, Any]) -> None:
    manifest = read_manifest(bad_run["index"])
    assert manifest is not None and manifest.complete
    assert manifest.counts.written == len(WRITTEN)
    assert manifest.counts.rejected == len(REJECTED)
    assert manifest.counts.truncated == 0  # too_long: skip rejects instead of truncating
    assert manifest.counts.written + manifest.counts.rejected == len(CASES)


def test_plan_counts_what_the_run_rejects_and_warns_of(
    bad_run: dict[str, Any], run_job: Callable[..., Any]
) -> None:
    result = run_job("plan", *bad_run["args"])
    assert result.rc == 0, result.describe()
    # the table, without the log's JSON lines (bad_run's backend.vllm.engine_args: settings_ignored)
    rows = dict(line.split("  ", 1) for line in result.stdout.splitlines() if not line.startswith("{"))
    assert rows["rejected"].strip() == str(len(REJECTED))
    assert rows["written with a warning"].strip() == f"{len(WARNED)} x {REASONING_NOT_RENDERED}"


def test_encoder_truncate_versus_skip(tiny_llama_dir: Path) -> None:
    # The run above uses too_long: skip; truncation itself, in-process (cheap).
    record = chat("long", "word " * 200)

    def encoder(too_long: str) -> SampleEncoder:
        return SampleEncoder(EncoderSpec(str(tiny_llama_dir), None, "auto", MAX_LENGTH, too_long, 1024))

    truncated = encoder("truncate").encode("long", record, None)
    assert isinstance(truncated, EncodedSample) and truncated.truncated
    assert truncated.num_tokens == MAX_LENGTH and truncated.loss_mask[-1] == 1
    skipped = encoder("skip").encode("long", record, None)
    assert isinstance(skipped, RejectedSample) and f"> data.max_length {MAX_LENGTH}" in skipped.reason
    # Truncation that cuts off every assistant token leaves nothing to train on.
    early = {"messages": [{"role": "user", "content": "q " * 100}, {"role": "assistant", "content": "a"}]}
    cut = encoder("truncate").encode("early", early, None)
    assert isinstance(cut, RejectedSample) and "within the first 64 tokens" in cut.reason
    short = encoder("truncate").encode("short", chat("short"), None)
    assert isinstance(short, EncodedSample) and not short.truncated
    assert np.all(short.loss_mask[-3:] == 1)


# --- logs -------------------------------------------------------------------------------


def test_stdout_is_json_lines_with_the_run_events(bad_run: dict[str, Any]) -> None:
    result = bad_run["result"]
    events = result.events  # raises if any stdout line is not JSON
    names = [e["event"] for e in events]
    assert names[0] == "run_started" and names[-1] == "run_finished"
    started = result.event("run_started")
    assert started["settings"]["output"]["uri"] == str(bad_run["out"])
    assert started["settings"]["data"]["too_long"] == "skip"
    assert started["layer_ids"] == [2, 4, 5, 8]  # the EAGLE-3 default for N = 8

    rejected = [e for e in events if e["event"] == "sample_rejected"]
    assert [e["sample_id"] for e in rejected] == [sid for sid, _ in REJECTED]
    assert all(e["level"] == "warning" and e["reason"] for e in rejected)

    manifest = read_manifest(bad_run["index"])
    assert manifest is not None
    committed = [e for e in events if e["event"] == "shard_committed"]
    assert [e["shard"] for e in committed] == [s.name for s in manifest.shards]
    assert [e["checksum"] for e in committed] == [s.checksum.value for s in manifest.shards]

    finished = result.event("run_finished")
    assert finished["status"] == "complete"
    assert finished["written"] == manifest.counts.written == len(WRITTEN)
    assert finished["rejected"] == manifest.counts.rejected == len(REJECTED)
    assert finished["shards"] == len(manifest.shards)
    assert finished["tokens"] == sum(s.num_tokens for s in manifest.shards)
    assert len({e["run_id"] for e in events}) == 1

    # A sample written without part of its record says so: its kind logged once, every one counted.
    warned = [e for e in events if e["event"] == "sample_warning"]
    assert [(e["sample_id"], e["warning"]) for e in warned] == [(WARNED[0], REASONING_NOT_RENDERED)]
    assert finished["sample_warnings"] == {REASONING_NOT_RENDERED: len(WARNED)}
    assert f"{len(WARNED)} written with a warning" in result.stderr


def test_log_file_holds_the_same_events(bad_run: dict[str, Any], read_jsonl: Callable) -> None:
    result = bad_run["result"]
    run_id = result.event("run_started")["run_id"]
    files = list((bad_run["index"] / "logs").iterdir())
    assert [f.name for f in files] == [f"{run_id}.jsonl"]
    assert read_jsonl(files[0]) == result.events


def test_secrets_appear_nowhere(bad_run: dict[str, Any]) -> None:
    result = bad_run["result"]
    assert SECRET not in result.stdout
    assert SECRET not in result.stderr
    for path in (bad_run["index"] / "logs").iterdir():
        assert SECRET not in path.read_text()
    # Not vacuous: the secret was logged, and scrubbed.
    engine_args = result.event("run_started")["settings"]["backend"]["vllm"]["engine_args"]
    assert engine_args == {"download_dir": "/models/***"}


# --- fatal problems ---------------------------------------------------------------------


def one_error_line(result: Any) -> str:
    assert result.rc == 2, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def test_unreadable_input_file(
    tmp_path: Path, write_jsonl: Callable[..., Path], run_job: Callable[..., Any], tiny_llama_dir: Path
) -> None:
    if os.geteuid() == 0:
        pytest.skip("running as root: chmod 000 does not stop root from reading the file")
    data = write_jsonl(tmp_path / "data" / "secret.jsonl", [chat("a")])
    data.chmod(0)
    try:
        line = one_error_line(
            run_job("run", f"--data.path={tmp_path / 'data'}", f"--output.uri={tmp_path / 'o'}")
        )
    finally:
        data.chmod(0o644)
    assert "secret.jsonl" in line and "data" in line


def test_input_file_with_read_errors(
    tmp_path: Path, run_job: Callable[..., Any], tiny_llama_dir: Path
) -> None:
    # Works as root too: reading /proc/self/mem at offset 0 fails with EIO for anyone.
    # Every local input is read once for the data fingerprint before the output is
    # touched, so that is where the error surfaces; progress bars of the model build may
    # precede it on stderr: the error is the last line, and the only one. (A file that
    # fails later, mid-run, is tests/test_bad_inputs.py's cut .jsonl.gz.)
    data = tmp_path / "data"
    data.mkdir()
    (data / "broken.jsonl").symlink_to("/proc/self/mem")
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={tmp_path / 'o'}", "--data.tokenizer_workers=0"
    )
    assert result.rc == 2, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error: ")]
    assert errors == [lines[-1]], result.stderr
    assert "cannot read" in errors[0] and "broken.jsonl" in errors[0] and "Input/output error" in errors[0]
    assert "Traceback" not in result.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("model", ["builtin:no-such-model", "no-such-org/no-such-model"])
def test_unknown_model(tmp_path: Path, run_job: Callable[..., Any], model: str) -> None:
    line = one_error_line(run_job("run", f"--model.path={model}", f"--output.uri={tmp_path / 'o'}"))
    assert "model.path" in line and model in line


def test_unwritable_output(
    tmp_path: Path, write_jsonl: Callable[..., Path], run_job: Callable[..., Any], tiny_llama_dir: Path
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [chat("a")])
    blocker = tmp_path / "a-regular-file"
    blocker.write_text("not a directory")
    line = one_error_line(run_job("run", f"--data.path={data}", f"--output.uri={blocker / 'out'}"))
    assert "output.uri" in line and str(blocker) in line
    assert blocker.read_text() == "not a directory"
