"""Regeneration (generate.mode): turns assembled token-exact, and whole runs with the HF backend.

The assembly tests hand the regeneration stage the token ids a model would produce for known
answers (its real input: a backend's completions) and check the sample it builds against the
chat template's own render of the regenerated conversation, text and loss mask. The run tests
use the HF backend's seeded sampling on the tiny model: sidecars, manifest, resume after kill
-9 and damaged sidecars.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import THINKING_TEMPLATE

from job.backend_io import Completion, GenerationInput
from job.data.encode import EncodedSample, EncoderSpec, GenerationStart, RejectedSample, SampleEncoder
from job.generate.sampling import resolve_sampling
from job.generate.stage import Regenerator, generation_counts
from job.settings import GenerateSettings
from job.shards import Shard, iter_output

SYSTEM = {"role": "system", "content": "You are terse."}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict[str, str]:
    return {"role": "assistant", "content": text}


def make_regenerator(
    model_dir: Path,
    mode: str,
    *,
    reasoning_in_loss: bool = True,
    max_length: int = 4096,
    on_length: str = "keep",
    max_new_tokens: int = 64,
    chat_template: str | None = None,
    too_long: str = "truncate",
) -> Regenerator:
    spec = EncoderSpec(
        str(model_dir),
        chat_template,
        "auto",
        max_length,
        too_long,
        1024,
        reasoning_in_loss,
        generate_mode=mode,
    )
    encoder = SampleEncoder(spec)
    generate = GenerateSettings(mode=mode, temperature=0.0, max_new_tokens=max_new_tokens)
    sampling = resolve_sampling(generate, model_dir, encoder.tokenizer.eos_token_id)
    return Regenerator(encoder, sampling, mode, max_length, reasoning_in_loss, on_length, max_active=4)


def regenerate(
    regenerator: Regenerator, messages: list[dict[str, Any]], answers: list[str], *, stop: bool = True
) -> tuple[EncodedSample | RejectedSample, list[GenerationInput]]:
    """Feed one conversation through the stage, answering its i-th turn with ``answers[i]``'s
    tokens (and the end-of-turn token where ``stop``)."""
    start = regenerator.encoder.encode("s", {"messages": messages}, None)
    assert isinstance(start, GenerationStart), start
    regenerator.start(start)
    requests = []
    eos = regenerator.sampling.eos_token_ids[0]
    while regenerator.ready:
        request = regenerator.ready.popleft()
        requests.append(request)
        tokens = [int(t) for t in regenerator.encoder.tokenize(answers[len(requests) - 1])]
        tokens = tokens[: request.max_new_tokens - stop] + ([eos] if stop else [])
        reason = "stop" if stop else "length"
        regenerator.complete(Completion(request.request_id, tokens, reason))
    assert len(regenerator.finished) == 1 and regenerator.active == 0
    return regenerator.finished.popleft(), requests


def as_text(encoder: SampleEncoder, ids: np.ndarray) -> str:
    return encoder.tokenizer.decode(ids.tolist(), skip_special_tokens=False)


def masked_text(encoder: SampleEncoder, sample: EncodedSample) -> list[str]:
    """The loss-masked runs of a sample, as text."""
    mask = np.concatenate([[0], sample.loss_mask.astype(int), [0]])
    edges = np.flatnonzero(np.diff(mask))
    return [as_text(encoder, sample.input_ids[a:b]) for a, b in zip(edges[::2], edges[1::2], strict=True)]


CONVERSATION = [
    SYSTEM,
    user("What is 2+2?"),
    assistant("It is 4."),
    user("And 3+3?"),
    assistant("It is 6."),
]


@pytest.mark.parametrize("model", ["tiny-llama", "tiny-chatml"])
def test_all_turns_sample_is_the_template_render_of_the_regenerated_conversation(
    builtin_model: Callable[[str], Path], model: str
) -> None:
    regenerator = make_regenerator(builtin_model(model), "all_turns")
    encoder = regenerator.encoder
    answers = ["Four, of course.", "Six, plainly."]
    sample, requests = regenerate(regenerator, CONVERSATION, answers)
    assert isinstance(sample, EncodedSample), sample
    regenerated = [
        SYSTEM,
        user("What is 2+2?"),
        assistant(answers[0]),
        user("And 3+3?"),
        assistant(answers[1]),
    ]
    assert as_text(encoder, sample.input_ids) == encoder.render(regenerated, None, generation_prompt=False)
    eot = encoder.tokenizer.decode([regenerator.sampling.eos_token_ids[0]])
    assert masked_text(encoder, sample) == [answers[0] + eot, answers[1] + eot]
    # Each turn's prompt is exactly the sample so far: the second continues the first's tokens.
    assert as_text(encoder, requests[0].prompt_ids) == encoder.render(
        regenerated[:2], None, generation_prompt=True
    )
    second = requests[1].prompt_ids
    assert np.array_equal(sample.input_ids[: len(second)], second)
    assert as_text(encoder, second) == encoder.render(regenerated[:4], None, generation_prompt=True)
    # And the keep path encodes the regenerated conversation to the same tokens and mask.
    keep = SampleEncoder(EncoderSpec(str(builtin_model(model)), None, "auto", 4096, "truncate", 1024))
    kept = keep.encode("s", {"messages": regenerated}, None)
    assert isinstance(kept, EncodedSample)
    assert np.array_equal(kept.input_ids, sample.input_ids)
    assert np.array_equal(kept.loss_mask, sample.loss_mask)


def test_last_turn_keeps_the_history_and_answers_a_final_user_turn(tiny_llama_dir: Path) -> None:
    regenerator = make_regenerator(tiny_llama_dir, "last_turn")
    encoder = regenerator.encoder
    sample, requests = regenerate(regenerator, CONVERSATION, ["Six."])
    assert isinstance(sample, EncodedSample)
    assert len(requests) == 1
    assert as_text(encoder, sample.input_ids) == encoder.render(
        [*CONVERSATION[:4], assistant("Six.")], None, generation_prompt=False
    )
    assert masked_text(encoder, sample) == ["Six.<|eot_id|>"]  # the kept turn is context only
    # A conversation that ends with a user turn gets its answer appended.
    sample, _ = regenerate(regenerator, CONVERSATION[:4], ["Six."])
    assert isinstance(sample, EncodedSample)
    assert as_text(encoder, sample.input_ids) == encoder.render(
        [*CONVERSATION[:4], assistant("Six.")], None, generation_prompt=False
    )
    record = regenerator.take_records(["s"])
    assert [t["message_index"] for t in record[-1]["turns"]] == [4]


def test_a_turn_cut_by_length_is_kept_or_rejected_per_on_length(tiny_llama_dir: Path) -> None:
    long = "one two three four five six seven eight nine ten eleven twelve"
    for on_length in ("keep", "reject"):
        regenerator = make_regenerator(tiny_llama_dir, "last_turn", on_length=on_length, max_new_tokens=5)
        sample, requests = regenerate(regenerator, CONVERSATION[:2], [long], stop=False)
        assert requests[0].max_new_tokens == 5
        if on_length == "keep":
            assert isinstance(sample, EncodedSample)
            assert int(sample.loss_mask.sum()) == 5
            assert regenerator.take_records(["s"])[0]["turns"][0]["finish_reason"] == "length"
        else:
            assert isinstance(sample, RejectedSample)
            assert "cut at 5 tokens" in sample.reason and "generate.on_length: reject" in sample.reason
            assert regenerator.take_records(["s"]) == []


def test_data_max_length_bounds_every_turn_and_a_full_conversation_follows_too_long(
    tiny_llama_dir: Path,
) -> None:
    probe = make_regenerator(tiny_llama_dir, "all_turns")
    first_prompt = len(
        probe.encoder.tokenize(probe.encoder.render(CONVERSATION[:2], None, generation_prompt=True))
    )
    max_length = first_prompt + 8
    for too_long in ("truncate", "skip"):
        regenerator = make_regenerator(tiny_llama_dir, "all_turns", max_length=max_length, too_long=too_long)
        start = regenerator.encoder.encode("s", {"messages": CONVERSATION}, None)
        assert isinstance(start, GenerationStart)
        regenerator.start(start)
        request = regenerator.ready.popleft()
        assert request.max_new_tokens == 8  # data.max_length, not max_new_tokens (64), bounds the turn
        regenerator.complete(Completion(request.request_id, [7] * 8, "length"))
        # The first turn filled data.max_length: no request for the second.
        assert not regenerator.ready and regenerator.active == 0
        sample = regenerator.finished.popleft()
        if too_long == "skip":
            assert isinstance(sample, RejectedSample)
            assert "no room to generate turn 2" in sample.reason
            assert f"data.max_length {max_length} (data.too_long: skip)" in sample.reason
            assert regenerator.take_records(["s"]) == []
            continue
        # truncate: the turn generated is kept, the sample counted as truncated, the rest named.
        assert isinstance(sample, EncodedSample) and sample.truncated
        assert sample.input_ids.tolist() == [*request.prompt_ids.tolist(), *[7] * 8]
        assert sample.loss_mask.tolist() == [0] * first_prompt + [1] * 8
        (record,) = regenerator.take_records(["s"])
        # the conversation up to the turn not generated: the data's answer is not shown as made
        assert record["messages"][:2] == CONVERSATION[:2] and record["messages"][3:] == [CONVERSATION[3]]
        assert record["messages"][2]["content"] != CONVERSATION[2]["content"]
        assert [t["finish_reason"] for t in record["turns"]] == ["length"]
        assert record["turns_not_generated"] == 1
        assert generation_counts([record]).turns_not_generated == 1


def test_a_conversation_whose_next_prompt_passes_max_length_is_cut_within_it(tiny_llama_dir: Path) -> None:
    # The first answer ends with room to spare, but the next user turn does not fit: the sample
    # ends inside that user turn, at data.max_length, as data.too_long: truncate cuts any sample.
    probe = make_regenerator(tiny_llama_dir, "all_turns")
    render = probe.encoder.render
    first_prompt = len(probe.encoder.tokenize(render(CONVERSATION[:2], None, generation_prompt=True)))
    max_length = first_prompt + 12
    sample, requests = regenerate(
        make_regenerator(tiny_llama_dir, "all_turns", max_length=max_length), CONVERSATION, ["It is 4."]
    )
    assert len(requests) == 1 and isinstance(sample, EncodedSample) and sample.truncated
    assert len(sample.input_ids) == max_length
    full = probe.encoder.tokenize(render([*CONVERSATION[:3], CONVERSATION[3]], None, generation_prompt=True))
    assert sample.input_ids.tolist() == [int(t) for t in full[:max_length]]
    assert masked_text(probe.encoder, sample) == ["It is 4.<|eot_id|>"]


def test_a_template_that_rewrites_earlier_turns_rejects_all_turns_and_last_turn_works(
    builtin_model: Callable[[str], Path],
) -> None:
    # Qwen3's template drops an earlier turn's reasoning: the tokens generated for it are not
    # what the template renders in the next prompt.
    model_dir = builtin_model("tiny-qwen3")
    answers = ["<think>\nadd them\n</think>\n\nIt is 4.", "<think>\nagain\n</think>\n\nIt is 6."]
    sample, _ = regenerate(make_regenerator(model_dir, "all_turns"), CONVERSATION, answers)
    assert isinstance(sample, RejectedSample)
    assert "not prefix-stable" in sample.reason and "generate.mode: last_turn" in sample.reason
    regenerator = make_regenerator(model_dir, "last_turn", reasoning_in_loss=False)
    sample, _ = regenerate(regenerator, CONVERSATION, answers[1:])
    assert isinstance(sample, EncodedSample)
    # data.reasoning_in_loss: false leaves the <think> block out of the loss, the answer in.
    assert masked_text(regenerator.encoder, sample) == ["It is 6.<|im_end|>"]


def test_reasoning_after_a_generation_prompt_that_opens_it_is_left_out(
    builtin_model: Callable[[str], Path],
) -> None:
    """The model generates no <think> of its own after "<think>\\n" in the prompt."""
    regenerator = make_regenerator(
        builtin_model("tiny-qwen3"), "last_turn", reasoning_in_loss=False, chat_template=THINKING_TEMPLATE
    )
    sample, requests = regenerate(regenerator, CONVERSATION, ["add them\n</think>\n\nIt is 6."])
    assert as_text(regenerator.encoder, requests[0].prompt_ids).endswith("<|im_start|>assistant\n<think>\n")
    assert isinstance(sample, EncodedSample)
    assert masked_text(regenerator.encoder, sample) == ["It is 6.<|im_end|>"]


def test_records_that_cannot_be_regenerated_are_rejected_with_the_reason(tiny_llama_dir: Path) -> None:
    encoder = make_regenerator(tiny_llama_dir, "last_turn").encoder
    cases = {
        "no-user": ({"messages": [SYSTEM, assistant("Hi.")]}, "nothing to answer"),
        "tokenized": ({"input_ids": [1, 2, 3], "loss_mask": [0, 1, 1]}, "pre-tokenized record"),
    }
    for sample_id, (record, reason) in cases.items():
        result = encoder.encode(sample_id, record, None)
        assert isinstance(result, RejectedSample) and reason in result.reason, result


def test_an_unexpected_failure_rejects_the_conversation_instead_of_ending_the_run(
    tiny_llama_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As for the data's own turns (encode with generate.mode keep): one record must not end the run."""
    encoder = make_regenerator(tiny_llama_dir, "last_turn").encoder

    def failing_tokenizer(text: str) -> np.ndarray:  # an injected fault: a tokenizer bug
        raise IndexError("piece id out of range")

    monkeypatch.setattr(encoder, "tokenize", failing_tokenizer)
    result = encoder.encode("c1", {"messages": [user("Hi?"), assistant("Hello.")]}, None)
    assert isinstance(result, RejectedSample), result
    assert result.reason == "could not be encoded (unexpected IndexError: piece id out of range)"


# --- whole runs (HF backend) ---------------------------------------------------------------


def dataset(count: int) -> list[dict[str, Any]]:
    """Conversations of several shapes: multi-turn with a system turn, one ending with a user
    turn, single-turn."""
    records = []
    for i in range(count):
        if i % 3 == 0:
            messages = [
                SYSTEM,
                user(f"Question {i}?"),
                assistant("Answer."),
                user("Why?"),
                assistant("Because."),
            ]
        elif i % 3 == 1:
            messages = [user(f"Tell me {i}."), assistant("Told."), user("More?")]
        else:
            messages = [user(f"Hello {i}")]
        records.append({"id": f"c{i:03d}", "messages": messages})
    return records


GENERATE_ARGS = (
    "--model.path=builtin:tiny-chatml",  # its template keeps a turn as generated (Llama 3's trims it)
    "--generate.mode=all_turns",
    "--generate.temperature=0.8",
    "--generate.top_p=0.95",
    "--generate.max_new_tokens=12",
    "--generate.seed=7",
    "--backend.name=hf",
    "--data.tokenizer_workers=0",
    "--model.dtype=float32",
)


def sidecar_lines(index_dir: Path) -> dict[str, dict[str, Any]]:
    manifest = json.loads((index_dir / "manifest.json").read_text())
    lines = {}
    for shard in manifest["shards"]:
        for line in (index_dir / shard["regenerated"]["name"]).read_text().splitlines():
            record = json.loads(line)
            lines[record["sample_id"]] = record
    return lines


@pytest.fixture(scope="module")
def regenerated_run(
    tmp_path_factory: pytest.TempPathFactory, write_jsonl: Callable[..., Path], run_job: Callable[..., Any]
) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("regen")
    data = write_jsonl(root / "data" / "chat.jsonl", dataset(24))
    out = root / "out"
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={out}", "--output.shard_bytes=1MiB", *GENERATE_ARGS
    )
    assert result.rc == 0, result.describe()
    return data, out / "index-00000"


def test_a_regenerated_run_lists_its_sidecars_and_counts(regenerated_run: tuple[Path, Path]) -> None:
    _, index_dir = regenerated_run
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["complete"] and manifest["counts"]["written"] == 24
    generation = manifest["identity"]["generation"]
    assert generation["mode"] == "all_turns" and generation["temperature"] == 0.8 and generation["seed"] == 7
    samples = {s.sample_id: s for s in iter_output(index_dir, require_complete=True)}
    lines = sidecar_lines(index_dir)
    assert set(lines) == set(samples)
    # Turns per conversation: two assistant turns; one plus one after the final user turn; one.
    expected_turns = {0: 2, 1: 2, 2: 1}
    for sample_id, line in lines.items():
        assert len(line["turns"]) == expected_turns[int(sample_id[1:]) % 3], line
        assert line["tokens"] == samples[sample_id].input_ids.shape[0]
        generated = sum(t["generated_tokens"] for t in line["turns"])
        assert int(samples[sample_id].loss_mask.sum()) == generated  # only generated tokens train
    totals = manifest["generation"]
    assert totals["conversations"] == 24
    assert totals["turns"] == sum(len(line["turns"]) for line in lines.values())
    assert totals["generated_tokens"] == sum(int(s.loss_mask.sum()) for s in samples.values())
    shard = Shard(index_dir / manifest["shards"][0]["name"])
    assert json.loads(shard.metadata["generation"]) == generation


def test_conversations_that_fill_max_length_are_kept_truncated_and_counted(
    tmp_path: Path, write_jsonl: Callable[..., Path], run_job: Callable[..., Any]
) -> None:
    # data.max_length 40: the two-turn conversations fill it before their second turn.
    data = write_jsonl(tmp_path / "chat.jsonl", dataset(12))
    out = tmp_path / "out"
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={out}", "--data.max_length=40", *GENERATE_ARGS
    )
    assert result.rc == 0, result.describe()
    index_dir = out / "index-00000"
    manifest = json.loads((index_dir / "manifest.json").read_text())
    assert manifest["counts"]["written"] == 12 and manifest["counts"]["rejected"] == 0
    samples = {s.sample_id: s for s in iter_output(index_dir, require_complete=True)}
    lines = sidecar_lines(index_dir)
    left = {sample_id: line["turns_not_generated"] for sample_id, line in lines.items()}
    assert sum(left.values()) > 0, "no conversation filled data.max_length: the test needs a smaller one"
    for sample_id, line in lines.items():
        expected = {0: 2, 1: 2, 2: 1}[int(sample_id[1:]) % 3]
        assert len(line["turns"]) + left[sample_id] == expected, line
        assert len(samples[sample_id].input_ids) <= 40
        assert int(samples[sample_id].loss_mask.sum()) == sum(t["generated_tokens"] for t in line["turns"])
    assert manifest["generation"]["turns_not_generated"] == sum(left.values())
    assert manifest["counts"]["truncated"] >= sum(n > 0 for n in left.values())
    shown = run_job("inspect", str(out))
    assert f"{sum(left.values())} not generated" in shown.stdout, shown.describe()
    # plan's bound: every turn at max_new_tokens (12), within what max_length leaves after the
    # first prompt; the run generated no more
    planned = run_job("plan", f"--data.path={data}", "--data.max_length=40", *GENERATE_ARGS)
    guess, most = generated_guess(plan_rows(planned))
    bound = sum(
        min((len(line["turns"]) + line["turns_not_generated"]) * 12, 40 - line["turns"][0]["prompt_tokens"])
        for line in lines.values()
    )
    assert manifest["generation"]["generated_tokens"] <= most == bound
    assert 0 < guess <= most


def test_plan_guesses_max_new_tokens_for_an_answer_left_empty(
    tmp_path: Path, write_jsonl: Callable[..., Path], run_job: Callable[..., Any]
) -> None:
    # the acceptance benchmark's multi-turn prompts: user turns, their answers left to the target
    records = [
        {"id": f"e{i}", "messages": [user(f"Question {i}?"), assistant(""), user("Why?")]} for i in range(3)
    ]
    data = write_jsonl(tmp_path / "empty.jsonl", records)
    guess, most = generated_guess(plan_rows(run_job("plan", f"--data.path={data}", *GENERATE_ARGS)))
    assert guess == most == 3 * 2 * 12


def plan_rows(planned: Any) -> dict[str, str]:
    """``plan``'s table: each row's name and its text."""
    assert planned.rc == 0, planned.describe()
    return dict(re.split(r"\s{2,}", line, maxsplit=1) for line in planned.stdout.splitlines() if line.strip())


def generated_guess(rows: dict[str, str]) -> tuple[int, int]:
    """``plan``'s generated tokens: (the guess, the most)."""
    ((guess, most),) = re.findall(r"about (\d+) .* up to (\d+)", rows["generated tokens"])
    return int(guess), int(most)


def test_plan_counts_the_turns_and_bounds_the_tokens_the_run_generated(
    regenerated_run: tuple[Path, Path], run_job: Callable[..., Any]
) -> None:
    data, index_dir = regenerated_run
    rows = plan_rows(run_job("plan", f"--data.path={data}", *GENERATE_ARGS))
    guess, most = generated_guess(rows)
    totals = json.loads((index_dir / "manifest.json").read_text())["generation"]
    assert rows["conversations"] == f"24 to regenerate ({totals['turns']} turns)"
    assert totals["generated_tokens"] <= most == totals["turns"] * 12
    assert 0 < guess <= most
    assert "generation time" in rows


def test_inspect_verifies_sidecars_and_finds_a_damaged_one(
    regenerated_run: tuple[Path, Path], run_job: Callable[..., Any], tmp_path: Path
) -> None:
    _, index_dir = regenerated_run
    result = run_job("inspect", str(index_dir.parent), "--verify")
    assert result.rc == 0, result.describe()
    assert "generated" in result.stdout and "regenerated.jsonl" in result.stdout
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(index_dir.parent), str(copy)], check=True)
    sidecar = next((copy / "index-00000").glob("*.regenerated.jsonl"))
    data = bytearray(sidecar.read_bytes())
    data[10] ^= 0x01
    sidecar.write_bytes(bytes(data))
    result = run_job("inspect", str(copy), "--verify")
    assert result.rc == 1
    assert f"{sidecar.name}: checksum" in result.stdout and "the sidecar is damaged" in result.stdout


def test_the_same_settings_regenerate_the_same_bytes(
    regenerated_run: tuple[Path, Path], run_job: Callable[..., Any], tmp_path: Path
) -> None:
    data, index_dir = regenerated_run
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={tmp_path}", "--output.shard_bytes=1MiB", *GENERATE_ARGS
    )
    assert result.rc == 0, result.describe()
    assert sidecar_lines(tmp_path / "index-00000") == sidecar_lines(index_dir)
    again = {s.sample_id: s for s in iter_output(tmp_path)}
    for sample in iter_output(index_dir):
        assert np.array_equal(sample.input_ids.numpy(), again[sample.sample_id].input_ids.numpy())


def test_resume_needs_the_same_sampling(
    regenerated_run: tuple[Path, Path], run_job: Callable[..., Any]
) -> None:
    data, index_dir = regenerated_run
    same = run_job("run", f"--data.path={data}", f"--output.uri={index_dir.parent}", *GENERATE_ARGS)
    assert same.rc == 0 and "was already complete" in same.stderr, same.describe()
    args = [a for a in GENERATE_ARGS if not a.startswith("--generate.temperature")]
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={index_dir.parent}", *args, "--generate.temperature=0.5"
    )
    assert result.rc == 2, result.describe()
    assert "generation" in result.stderr and "'temperature': 0.8" in result.stderr
    assert "'temperature': 0.5" in result.stderr


def test_kill_9_then_resume_gives_the_uninterrupted_output(
    regenerated_run: tuple[Path, Path], job_env: dict[str, str], run_job: Callable[..., Any], tmp_path: Path
) -> None:
    """A run killed after its first committed shard resumes exactly once, and the resumed output
    holds the same samples, tokens and sidecar lines as the run that was never interrupted; a
    damaged sidecar of a committed shard stops the resume until on_damaged_shard=reextract."""
    data, index_dir = regenerated_run
    args = [
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path}",
        "--output.shard_bytes=48KiB",
        *GENERATE_ARGS,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", *args, "--log.format=json"],
        env=job_env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if '"shard_committed"' in line:
            os.kill(proc.pid, signal.SIGKILL)
            break
    proc.wait(timeout=120)
    assert proc.returncode == -signal.SIGKILL
    out = tmp_path / "index-00000"
    manifest = json.loads((out / "manifest.json").read_text())
    assert not manifest["complete"] and 0 < manifest["counts"]["written"] < 24
    sidecar = out / manifest["shards"][0]["regenerated"]["name"]
    sidecar.write_bytes(sidecar.read_bytes()[:-3])
    result = run_job(*args)
    assert result.rc == 2, result.describe()
    assert sidecar.name in result.stderr and "the sidecar is damaged" in result.stderr
    result = run_job(*args, "--output.on_damaged_shard=reextract")
    assert result.rc == 0, result.describe()
    assert sidecar_lines(out) == sidecar_lines(index_dir)
    resumed = {s.sample_id: s for s in iter_output(out, require_complete=True)}
    reference = {s.sample_id: s for s in iter_output(index_dir)}
    assert resumed.keys() == reference.keys()
    for sample_id, sample in reference.items():
        assert np.array_equal(sample.input_ids.numpy(), resumed[sample_id].input_ids.numpy())
        assert np.array_equal(sample.loss_mask.numpy(), resumed[sample_id].loss_mask.numpy())
    assert json.loads((out / "manifest.json").read_text())["generation"]["conversations"] == 24


def test_a_sidecar_keeps_integers_beyond_64_bits_as_written(
    tmp_path: Path, write_jsonl: Callable[..., Path], run_job: Callable[..., Any]
) -> None:
    """The sidecar holds the record's tool calls and tools; orjson cannot write such an integer."""
    order = 123456789012345678901234567890
    tool = {"name": "get_order", "parameters": {"type": "object", "properties": {"id": {"maximum": 2**64}}}}
    call = {"type": "function", "function": {"name": "get_order", "arguments": {"id": order}}}
    messages = [
        user("Where is my order?"),
        {"role": "assistant", "content": "", "tool_calls": [call]},
        {"role": "tool", "content": {"total": 2**70}},
        user("And now?"),
    ]
    data = write_jsonl(
        tmp_path / "tools.jsonl",
        [{"id": "big", "tools": [{"type": "function", "function": tool}], "messages": messages}],
    )
    args = [a for a in GENERATE_ARGS if not a.startswith(("--model.path", "--generate.mode"))]
    result = run_job(
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'out'}",
        "--model.path=builtin:tiny-qwen3",
        "--generate.mode=last_turn",
        *args,
    )
    assert result.rc == 0, result.describe()
    line = sidecar_lines(tmp_path / "out" / "index-00000")["big"]  # json.loads keeps integers exact
    assert line["messages"][1]["tool_calls"][0]["function"]["arguments"] == {"id": order}
    assert line["tools"][0]["function"]["parameters"]["properties"]["id"]["maximum"] == 2**64
