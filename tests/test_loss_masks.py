"""Assistant-only loss masks on the two template styles the tiny models ship.

Both ways of finding assistant tokens must agree exactly: transformers'
``return_assistant_tokens_mask`` on a template with ``{% generation %}`` markers, and
the rendered-turns method on the same template without them (how most released models
ship it). And the mask must cover exactly each assistant message's content plus its
end-of-turn token: nothing of the system prompt, the user turns or the role headers.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import THINKING_TEMPLATE

from job.data.encode import (
    REASONING_NOT_RENDERED,
    TEXT_DROPPED,
    EncodedSample,
    EncoderSpec,
    RejectedSample,
    SampleEncoder,
)
from job.data.formats import parse_record
from job.shards import Sample, iter_output
from job.tiny import CHATML_TEMPLATE, LLAMA3_TEMPLATE, QWEN3_TEMPLATE, strip_generation_markers

STYLES = {
    # model, template, end-of-turn token, whether the template trims message content
    "llama3": ("tiny-llama", LLAMA3_TEMPLATE, "<|eot_id|>"),
    "chatml": ("tiny-chatml", CHATML_TEMPLATE, "<|im_end|>"),
}

SYSTEM = "You are a careful tutor who explains step by step."
TURNS = [
    ("What is 17 * 23?", "17 × 23 = 391."),
    ("And in German?", "Siebzehn mal dreiundzwanzig ist dreihunderteinundneunzig."),
    ("Say hi in Japanese.", "こんにちは! 🚀"),
]


def openai_record(turns: list[tuple[str, str]], system: str | None = SYSTEM) -> dict[str, Any]:
    messages = [{"role": "system", "content": system}] if system else []
    for user, assistant in turns:
        messages += [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}]
    return {"messages": messages}


def sharegpt_record(turns: list[tuple[str, str]], system: str | None = SYSTEM) -> dict[str, Any]:
    conversations = [{"from": "system", "value": system}] if system else []
    for user, assistant in turns:
        conversations += [{"from": "human", "value": user}, {"from": "gpt", "value": assistant}]
    return {"conversations": conversations}


CONVERSATIONS = {
    "openai-3-turns": (openai_record(TURNS), [a for _, a in TURNS]),
    "sharegpt-3-turns": (sharegpt_record(TURNS), [a for _, a in TURNS]),
    "openai-1-turn-no-system": (openai_record(TURNS[:1], system=None), [TURNS[0][1]]),
    # A last user turn after the final answer: not a training target either.
    "trailing-user-turn": (
        {"messages": [*openai_record(TURNS[:2])["messages"], {"role": "user", "content": "Thanks!"}]},
        [a for _, a in TURNS[:2]],
    ),
    # Two answers in a row: each its own span.
    "consecutive-assistant-turns": (
        {
            "messages": [
                *openai_record(TURNS[:1])["messages"],
                {"role": "assistant", "content": "Need the steps?"},
            ]
        },
        [TURNS[0][1], "Need the steps?"],
    ),
}


def make_encoder(model_dir: Path, template: str) -> SampleEncoder:
    return SampleEncoder(
        EncoderSpec(
            tokenizer_path=str(model_dir),
            chat_template=template,
            data_format="auto",
            max_length=4096,
            too_long="truncate",
            vocab_size=1024,
        )
    )


def encode(encoder: SampleEncoder, record: dict[str, Any]) -> EncodedSample:
    result = encoder.encode("sample", record, None)
    assert isinstance(result, EncodedSample), result
    return result


def masked_spans(sample: EncodedSample | Sample) -> list[np.ndarray]:
    """The token ids of each maximal run of mask == 1 (of an encoded or a written sample)."""
    ids, mask = np.asarray(sample.input_ids), np.asarray(sample.loss_mask).astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [ids[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]


@pytest.fixture(scope="module", params=sorted(STYLES))
def style(request: pytest.FixtureRequest, builtin_model: Callable[[str], Path]) -> dict[str, Any]:
    model, template, eot = STYLES[request.param]
    model_dir = builtin_model(model)
    return {
        "name": request.param,
        "eot": eot,
        "markers": make_encoder(model_dir, template),
        "prefix_diff": make_encoder(model_dir, strip_generation_markers(template)),
    }


def test_templates_select_the_intended_method(style: dict[str, Any]) -> None:
    assert style["markers"].mask_method == "generation-markers"
    assert style["prefix_diff"].mask_method == "rendered-turns"


@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_generation_markers_and_prefix_diff_agree(style: dict[str, Any], conversation: str) -> None:
    record, _ = CONVERSATIONS[conversation]
    a = encode(style["markers"], record)
    b = encode(style["prefix_diff"], record)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    assert a.loss_mask.dtype == np.uint8 and a.input_ids.dtype == np.int32
    assert 0 < int(a.loss_mask.sum()) < a.num_tokens


@pytest.mark.parametrize("method", ["markers", "prefix_diff"])
@pytest.mark.parametrize("conversation", sorted(CONVERSATIONS))
def test_mask_is_exactly_assistant_content_and_end_of_turn(
    style: dict[str, Any], method: str, conversation: str
) -> None:
    record, answers = CONVERSATIONS[conversation]
    encoder: SampleEncoder = style[method]
    sample = encode(encoder, record)
    spans = [encoder.tokenizer.decode(span) for span in masked_spans(sample)]
    # One span per assistant turn, each its content followed by the end-of-turn token.
    assert spans == [answer + style["eot"] for answer in answers]
    # And the unmasked rest is everything else: decoding all tokens and removing the
    # spans leaves the system prompt, user turns and headers, but no answer text.
    unmasked = encoder.tokenizer.decode(sample.input_ids[sample.loss_mask == 0])
    for answer in answers:
        assert answer not in unmasked
    for message in record.get("messages", record.get("conversations")):
        text = message.get("content", message.get("value"))
        if text not in answers:
            assert text in unmasked


def test_same_assistant_text_as_user_text_is_masked_only_in_assistant_turn(style: dict[str, Any]) -> None:
    # The rendered turns are located by position, not by text: an answer that repeats the
    # question must not pull the user's copy into the mask.
    record = openai_record([("Echo this.", "Echo this.")])
    for method in ("markers", "prefix_diff"):
        encoder: SampleEncoder = style[method]
        spans = [encoder.tokenizer.decode(s) for s in masked_spans(encode(encoder, record))]
        assert spans == ["Echo this." + style["eot"]]


def test_builtin_chatml_model_uses_its_own_marked_template(builtin_model: Callable[[str], Path]) -> None:
    # No override: the tokenizer's own chat template (with markers) is used.
    encoder = SampleEncoder(EncoderSpec(str(builtin_model("tiny-chatml")), None, "auto", 4096, "skip", 1024))
    assert encoder.mask_method == "generation-markers"
    sample = encode(encoder, openai_record(TURNS[:1]))
    assert [encoder.tokenizer.decode(s) for s in masked_spans(sample)] == [TURNS[0][1] + "<|im_end|>"]


# --- tool calling and reasoning --------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def call(name: str, arguments: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


# An agent: a tool call without content (OpenAI's content: null) and with reasoning, its
# result, the answer, then a second round after another user message.
AGENT = {
    "tools": [WEATHER],
    "messages": [
        {"role": "system", "content": "Use tools when they help."},
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "reasoning_content": "I should look it up.",
            "tool_calls": [call("get_weather", '{"city": "Oslo"}', "c1")],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "snow", "temp": -3}'},
        {"role": "assistant", "content": "Snow, -3 °C.", "reasoning_content": "The tool answered."},
        {"role": "user", "content": "And in Rome?"},
        {"role": "assistant", "tool_calls": [call("get_weather", '{"city": "Rome"}', "c2")]},
        {"role": "tool", "tool_call_id": "c2", "content": "sunny"},
        {"role": "assistant", "content": "<think>\nRome is sunny.\n</think>\n\nSunny in Rome."},
    ],
}
# The same conversation in ShareGPT (LLaMA-Factory's function_call / observation turns).
AGENT_SHAREGPT = {
    "tools": json.dumps([WEATHER["function"]]),
    "system": "Use tools when they help.",
    "conversations": [
        {"from": "human", "value": "Weather in Oslo?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Oslo"}}'},
        {"from": "observation", "value": '{"sky": "snow", "temp": -3}'},
        {"from": "gpt", "value": "Snow, -3 °C."},
    ],
}

# What each template makes of AGENT: the masked spans, in order. Llama-3.1 style renders
# a call as JSON and no reasoning but what the content holds; Qwen3's renders
# reasoning only after the last user message (and always, if empty, for the final
# turn), so the first round's reasoning is gone from the text.
AGENT_SPANS = {
    "llama3": [
        '{"name": "get_weather", "parameters": {"city": "Oslo"}}<|eot_id|>',
        "Snow, -3 °C.<|eot_id|>",
        '{"name": "get_weather", "parameters": {"city": "Rome"}}<|eot_id|>',
        "<think>\nRome is sunny.\n</think>\n\nSunny in Rome.<|eot_id|>",
    ],
    "qwen3": [
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>',
        "Snow, -3 °C.<|im_end|>",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        "<think>\nRome is sunny.\n</think>\n\nSunny in Rome.<|im_end|>",
    ],
}
SHAREGPT_SPANS = {
    "llama3": AGENT_SPANS["llama3"][:2],
    "qwen3": [AGENT_SPANS["qwen3"][0], "<think>\n\n</think>\n\nSnow, -3 °C.<|im_end|>"],
}
TOOL_STYLES = {"llama3": ("tiny-llama", LLAMA3_TEMPLATE), "qwen3": ("tiny-qwen3", QWEN3_TEMPLATE)}


def reasoning_encoder(model_dir: Path, template: str, reasoning_in_loss: bool) -> SampleEncoder:
    return SampleEncoder(
        EncoderSpec(str(model_dir), template, "auto", 4096, "truncate", 1024, reasoning_in_loss)
    )


@pytest.fixture(scope="module", params=sorted(TOOL_STYLES))
def tool_style(request: pytest.FixtureRequest, builtin_model: Callable[[str], Path]) -> dict[str, Any]:
    model, template = TOOL_STYLES[request.param]
    model_dir = builtin_model(model)
    return {
        "name": request.param,
        "markers": make_encoder(model_dir, template),
        "prefix_diff": make_encoder(model_dir, strip_generation_markers(template)),
        "dir": model_dir,
        "template": template,
    }


@pytest.mark.parametrize("method", ["markers", "prefix_diff"])
@pytest.mark.parametrize(("record", "expected"), [(AGENT, AGENT_SPANS), (AGENT_SHAREGPT, SHAREGPT_SPANS)])
def test_tool_calls_are_in_the_mask_and_tool_results_out(
    tool_style: dict[str, Any], method: str, record: dict[str, Any], expected: dict[str, list[str]]
) -> None:
    encoder: SampleEncoder = tool_style[method]
    sample = encode(encoder, record)
    assert [encoder.tokenizer.decode(s) for s in masked_spans(sample)] == expected[tool_style["name"]]
    unmasked = encoder.tokenizer.decode(sample.input_ids[sample.loss_mask == 0])
    for result in ('{"sky": "snow", "temp": -3}', "sunny"):
        if result in encoder.tokenizer.decode(sample.input_ids):
            assert result in unmasked
    assert "get_weather" in unmasked  # the tool definition, in the system prompt


@pytest.mark.parametrize("record", [AGENT, AGENT_SHAREGPT])
def test_markers_and_prefix_diff_agree_on_tool_conversations(
    tool_style: dict[str, Any], record: dict[str, Any]
) -> None:
    a = encode(tool_style["markers"], record)
    b = encode(tool_style["prefix_diff"], record)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)


@pytest.mark.parametrize("markers", [True, False])
def test_reasoning_can_be_left_out_of_the_mask(tool_style: dict[str, Any], markers: bool) -> None:
    template = tool_style["template"] if markers else strip_generation_markers(tool_style["template"])
    with_reasoning = encode(reasoning_encoder(tool_style["dir"], template, True), AGENT)
    without = reasoning_encoder(tool_style["dir"], template, False)
    sample = encode(without, AGENT)
    np.testing.assert_array_equal(sample.input_ids, with_reasoning.input_ids)  # same tokens
    spans = [without.tokenizer.decode(s) for s in masked_spans(sample)]
    expected = [
        s.replace("<think>\nRome is sunny.\n</think>\n\n", "") for s in AGENT_SPANS[tool_style["name"]]
    ]
    assert spans == expected
    assert "Rome is sunny." in without.tokenizer.decode(sample.input_ids[sample.loss_mask == 0])


def test_qwen3_template_drops_earlier_reasoning_and_marks_the_final_turn(
    builtin_model: Callable[[str], Path],
) -> None:
    # Not prefix-stable: the render of a turn as the last one has a <think> block the
    # whole conversation's does not. The rendered turns must still be found.
    record = {
        "messages": [
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
            {"role": "user", "content": "Bye"},
            {"role": "assistant", "content": "Bye!", "reasoning_content": "leaving"},
        ]
    }
    encoder = make_encoder(builtin_model("tiny-qwen3"), strip_generation_markers(QWEN3_TEMPLATE))
    sample = encode(encoder, record)
    text = encoder.tokenizer.decode(sample.input_ids)
    assert "greet" not in text
    spans = [encoder.tokenizer.decode(s) for s in masked_spans(sample)]
    assert spans == ["Hello<|im_end|>", "<think>\nleaving\n</think>\n\nBye!<|im_end|>"]


@pytest.mark.parametrize(
    ("record", "warned"),
    [
        ("final-turn reasoning", {"llama3": True, "qwen3": False}),  # Qwen3 renders the final turn's
        ("reasoning before the last user turn", {"llama3": True, "qwen3": True}),  # both drop it
        ("no reasoning", {"llama3": False, "qwen3": False}),
    ],
)
def test_a_sample_whose_reasoning_the_template_drops_is_written_with_a_warning(
    tool_style: dict[str, Any], record: str, warned: dict[str, bool]
) -> None:
    records = {
        "final-turn reasoning": {
            "messages": [
                {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello", "reasoning_content": "greet"},
            ]
        },
        "reasoning before the last user turn": AGENT,
        "no reasoning": openai_record(TURNS),
    }
    sample = encode(tool_style["prefix_diff"], records[record])
    assert sample.warning == (REASONING_NOT_RENDERED if warned[tool_style["name"]] else None)


# An earlier answer with a literal </think>: Qwen3's template takes all before it as reasoning and
# drops it from that turn (not from the final one, which it renders whole).
LITERAL_CLOSE = {
    "messages": [
        {"role": "user", "content": "How do models end their reasoning?"},
        {"role": "assistant", "content": "EARLYTEXT They emit the tag </think> and go on answering."},
        {"role": "user", "content": "Thanks."},
        {"role": "assistant", "content": "You are welcome."},
    ]
}


@pytest.mark.parametrize("markers", [True, False], ids=["markers", "prefix_diff"])
def test_text_the_template_drops_before_a_literal_close_tag_is_warned_about(
    builtin_model: Callable[[str], Path], markers: bool
) -> None:
    # With {% generation %} markers (the builtin tiny-qwen3's own template) it used to be written
    # without the warning the rendered-turns method gives.
    template = QWEN3_TEMPLATE if markers else strip_generation_markers(QWEN3_TEMPLATE)
    encoder = make_encoder(builtin_model("tiny-qwen3"), template)
    sample = encode(encoder, LITERAL_CLOSE)
    assert sample.warning == TEXT_DROPPED
    assert "EARLYTEXT" not in encoder.tokenizer.decode(sample.input_ids)  # written as rendered
    # the tag after a leading reasoning block is the template's way, as is the final turn's tag
    kept = json.loads(json.dumps(LITERAL_CLOSE))
    kept["messages"][1]["content"] = "<think>Recall.</think>They emit the tag."
    kept["messages"][3]["content"] = "Close it with </think> always."
    assert encode(encoder, kept).warning is None


# Marked, and it tests an answer's text (its shadow would take another branch): no shadow helps,
# the content's pieces are looked for in the render instead.
TESTING_MARKED = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}"
    "{% set c = m.content.split('</think>')[-1] %}{{ c }}{% if c.startswith(' and') %} (more){% endif %}"
    "<|im_end|>{% endgeneration %}{% else %}{{ m.content }}<|im_end|>{% endif %}\n{% endfor %}"
)


def test_dropped_text_is_found_under_a_marked_template_that_tests_texts(
    builtin_model: Callable[[str], Path],
) -> None:
    encoder = make_encoder(builtin_model("tiny-qwen3"), TESTING_MARKED)
    sample = encode(encoder, LITERAL_CLOSE)
    assert sample.warning == TEXT_DROPPED
    assert " and go on answering. (more)<|im_end|>" in encoder.tokenizer.decode(sample.input_ids)
    assert encode(encoder, openai_record(TURNS)).warning is None


def test_a_run_logs_the_dropped_text_warning(
    tmp_path: Path,
    write_jsonl: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    builtin_model: Callable[[str], Path],
) -> None:
    tokenizer = make_encoder(builtin_model("tiny-qwen3"), QWEN3_TEMPLATE).tokenizer  # built before the run
    data = write_jsonl(
        tmp_path / "chat.jsonl", [{"id": "literal", **LITERAL_CLOSE}, {"id": "plain", **openai_record(TURNS)}]
    )
    out = tmp_path / "out"
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={out}", "--model.path=builtin:tiny-qwen3", *fast_args
    )
    assert result.rc == 0, result.describe()
    warned = [(e["sample_id"], e["warning"]) for e in result.events if e["event"] == "sample_warning"]
    assert warned == [("literal", TEXT_DROPPED)]
    assert result.event("run_finished")["sample_warnings"] == {TEXT_DROPPED: 1}
    assert "1 written with a warning" in result.stderr
    written = {s.sample_id: s for s in iter_output(out, require_complete=True)}
    assert sorted(written) == ["literal", "plain"]
    assert "EARLYTEXT" not in tokenizer.decode(written["literal"].input_ids)


def test_one_pass_generation_spans_equal_transformers_own(tool_style: dict[str, Any]) -> None:
    # The encoder finds {% generation %} spans with sentinels (transformers' tracking is
    # quadratic); the text and the spans must be exactly what transformers computes.
    from transformers.utils.chat_template_utils import render_jinja_template

    encoder: SampleEncoder = tool_style["markers"]
    for record in (AGENT, openai_record(TURNS)):
        conv = parse_record(record, "auto")
        rendered, indices = render_jinja_template(
            conversations=[conv.messages],
            tools=conv.tools,
            chat_template=tool_style["template"],
            return_assistant_tokens_mask=True,
            **encoder.tokenizer.special_tokens_map,
        )
        text, spans = encoder._render_marked(conv.messages, conv.tools, tool_style["template"])
        assert text == rendered[0]
        assert spans == [tuple(s) for s in indices[0]]


def test_a_template_without_tool_support_rejects_instead_of_dropping_calls(
    builtin_model: Callable[[str], Path],
) -> None:
    # Plain ChatML renders the assistant's content and silently leaves out its tool calls
    # and the tools: such a sample would teach the draft a turn the model never produced.
    encoder = make_encoder(builtin_model("tiny-chatml"), CHATML_TEMPLATE)
    record = {
        "messages": [
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": "Let me check.", "tool_calls": [call("get_weather", "{}", "c")]},
            {"role": "tool", "content": "rain"},
            {"role": "assistant", "content": "Rain."},
        ]
    }
    result = encoder.encode("s", record, None)
    assert (
        isinstance(result, RejectedSample) and "did not render the tool call 'get_weather'" in result.reason
    )
    no_calls = {
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hi!"}],
    }
    result = encoder.encode("s", no_calls, None)
    assert isinstance(result, RejectedSample) and "did not render the tool definitions" in result.reason


def test_cut_before_tokenizing_keeps_the_first_max_length_tokens_exact(tiny_llama_dir: Path) -> None:
    # The tokenizer sees only max_length x longest-token + GUARD characters: the kept
    # tokens and mask must equal those of tokenizing everything and truncating.
    turns = [(f"Question {i}: " + "why " * 50, f"Answer {i}: " + "because " * 50) for i in range(200)]
    record = openai_record(turns)
    max_length = 256
    encoder = SampleEncoder(EncoderSpec(str(tiny_llama_dir), None, "auto", max_length, "truncate", 1024))
    sample = encode(encoder, record)
    conv = parse_record(record, "auto")
    full, spans = encoder._render_marked(conv.messages, None, encoder.template())
    assert len(full) > 4 * encoder.char_budget  # the cut really happens
    enc = encoder.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
    assert sample.truncated and sample.num_tokens == max_length
    np.testing.assert_array_equal(sample.input_ids, np.asarray(enc["input_ids"][:max_length]))
    mask = [
        int(any(s < b and e > a and e > s for a, b in spans)) for s, e in enc["offset_mapping"][:max_length]
    ]
    assert sample.loss_mask.tolist() == mask


# --- reasoning_in_loss: false and a <think> tag in the answer's text --------------------------

ANSWER_ABOUT_THE_TAG = "The tag <think> opens it. Then more answer text here."
# Text about the tag, not reasoning: with data.reasoning_in_loss false it stays in the loss.
# Except where the template makes it reasoning: Qwen3's reads what precedes a "</think>" in
# the content as the turn's reasoning and renders it as the turn's <think> block.
TAG_ANSWERS = {
    ANSWER_ABOUT_THE_TAG: {},
    "Write <think> and </think> around the reasoning.": {"qwen3": " around the reasoning."},
}


@pytest.mark.parametrize("method", ["markers", "prefix_diff"])
@pytest.mark.parametrize("answer", sorted(TAG_ANSWERS))
def test_a_think_tag_in_the_answer_stays_in_the_loss(
    tool_style: dict[str, Any], method: str, answer: str
) -> None:
    template = (
        tool_style["template"] if method == "markers" else strip_generation_markers(tool_style["template"])
    )
    encoder = reasoning_encoder(tool_style["dir"], template, False)
    record = {
        "messages": [
            {"role": "user", "content": "What opens reasoning?"},
            {"role": "assistant", "content": answer},
        ]
    }
    sample = encode(encoder, record)
    eot = {"llama3": "<|eot_id|>", "qwen3": "<|im_end|>"}[tool_style["name"]]
    # Qwen3's final turn opens with an empty <think> block of its own: that one is left out.
    expected = TAG_ANSWERS[answer].get(tool_style["name"], answer)
    assert [encoder.tokenizer.decode(s) for s in masked_spans(sample)] == [expected + eot]
    with_reasoning = encode(reasoning_encoder(tool_style["dir"], template, True), record)
    np.testing.assert_array_equal(sample.input_ids, with_reasoning.input_ids)


def test_the_rendered_reasoning_block_is_left_out_and_a_later_tag_kept(
    builtin_model: Callable[[str], Path],
) -> None:
    encoder = reasoning_encoder(builtin_model("tiny-qwen3"), QWEN3_TEMPLATE, False)
    record = {
        "messages": [
            {"role": "user", "content": "What opens reasoning?"},
            {"role": "assistant", "content": ANSWER_ABOUT_THE_TAG, "reasoning_content": "Name the tag."},
        ]
    }
    sample = encode(encoder, record)
    assert [encoder.tokenizer.decode(s) for s in masked_spans(sample)] == [
        ANSWER_ABOUT_THE_TAG + "<|im_end|>"
    ]
    unmasked = encoder.tokenizer.decode(sample.input_ids[sample.loss_mask == 0])
    assert "<think>\nName the tag.\n</think>\n\n" in unmasked


@pytest.mark.parametrize("method", ["markers", "prefix_diff"])
def test_reasoning_after_a_generation_prompt_that_opens_it_is_left_out(
    builtin_model: Callable[[str], Path], method: str
) -> None:
    template = THINKING_TEMPLATE if method == "markers" else strip_generation_markers(THINKING_TEMPLATE)
    record = {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            {"role": "assistant", "content": "Snow.", "reasoning_content": "Earlier turns lose theirs."},
            {"role": "user", "content": "And in Rome?"},
            {
                "role": "assistant",
                "reasoning_content": "Look it up.",
                "tool_calls": [call("get_weather", '{"city": "Rome"}', "c1")],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            {"role": "assistant", "content": "Sunny.", "reasoning_content": "The tool answered."},
        ],
    }
    encoder = reasoning_encoder(builtin_model("tiny-qwen3"), template, False)
    sample = encode(encoder, record)
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>'
    spans = [encoder.tokenizer.decode(s) for s in masked_spans(sample)]
    assert spans == ["Snow.<|im_end|>", call_text, "Sunny.<|im_end|>"]
    with_reasoning = encode(reasoning_encoder(builtin_model("tiny-qwen3"), template, True), record)
    np.testing.assert_array_equal(sample.input_ids, with_reasoning.input_ids)  # same tokens


# --- consecutive assistant turns ---------------------------------------------------------------

# Qwen3's template renders an assistant turn that ends the conversation with a <think> block:
# the render of the turns before a second assistant turn is then no prefix of the whole render.
CONSECUTIVE = {
    "e-consec": [
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1"},
        {"role": "assistant", "content": "A1b"},
    ],
    "three-then-user": [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "U1"},
        {"role": "assistant", "content": "A1", "reasoning_content": "r1"},
        {"role": "assistant", "content": "A2"},
        {"role": "assistant", "content": "A3"},
        {"role": "user", "content": "U2"},
        {"role": "assistant", "content": "B", "reasoning_content": "r2"},
    ],
    "after-a-tool-result": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "tool_calls": [call("get_weather", '{"city": "Oslo"}', "c1")]},
        {"role": "tool", "tool_call_id": "c1", "content": "snow"},
        {"role": "assistant", "content": "Snow."},
        {"role": "assistant", "content": "Dress warmly."},
    ],
}
CONSECUTIVE_SPANS = {
    "llama3": {"e-consec": ["A1<|eot_id|>", "A1b<|eot_id|>"]},
    "qwen3": {"e-consec": ["A1<|im_end|>", "<think>\n\n</think>\n\nA1b<|im_end|>"]},
}


@pytest.mark.parametrize("record", sorted(CONSECUTIVE))
def test_prefix_diff_finds_consecutive_assistant_turns(tool_style: dict[str, Any], record: str) -> None:
    conversation = {"tools": [WEATHER], "messages": CONSECUTIVE[record]}
    a = encode(tool_style["markers"], conversation)
    b = encode(tool_style["prefix_diff"], conversation)
    np.testing.assert_array_equal(a.input_ids, b.input_ids)
    np.testing.assert_array_equal(a.loss_mask, b.loss_mask)
    expected = CONSECUTIVE_SPANS[tool_style["name"]].get(record)
    if expected is not None:
        assert [tool_style["prefix_diff"].tokenizer.decode(s) for s in masked_spans(b)] == expected


# --- record shapes of exports: null and empty fields -------------------------------------------


def decoded_spans(encoder: SampleEncoder, record: dict[str, Any]) -> list[str]:
    return [encoder.tokenizer.decode(s) for s in masked_spans(encode(encoder, record))]


def test_reasoning_content_and_reasoning_must_agree(builtin_model: Callable[[str], Path]) -> None:
    encoder = make_encoder(builtin_model("tiny-qwen3"), QWEN3_TEMPLATE)

    def record(**reasoning: Any) -> dict[str, Any]:
        answer = {"role": "assistant", "content": "ASSTL", **reasoning}
        return {"messages": [{"role": "user", "content": "Q"}, answer]}

    kept = ["<think>\nTHINKL\n</think>\n\nASSTL<|im_end|>"]
    assert decoded_spans(encoder, record(reasoning_content=None, reasoning="THINKL")) == kept
    assert decoded_spans(encoder, record(reasoning_content="THINKL", reasoning=None)) == kept
    assert decoded_spans(encoder, record(reasoning_content="", reasoning="THINKL")) == kept
    assert decoded_spans(encoder, record(reasoning_content="THINKL", reasoning="THINKL")) == kept
    sharegpt = {
        "conversations": [
            {"from": "human", "value": "Q"},
            {"from": "gpt", "value": "ASSTL", "reasoning": "THINKL"},
        ]
    }
    assert decoded_spans(encoder, sharegpt) == kept
    rejected = encoder.encode("s", record(reasoning_content="THINKL", reasoning="other"), None)
    assert isinstance(rejected, RejectedSample)
    assert rejected.reason.startswith("messages[1]: reasoning_content and reasoning hold different texts")
    rejected = encoder.encode("s", record(reasoning_content=None, reasoning=["THINKL"]), None)
    assert isinstance(rejected, RejectedSample)
    assert rejected.reason == "messages[1].reasoning: must be a string, got list"


def test_empty_tool_lists_are_no_tools(tool_style: dict[str, Any]) -> None:
    encoder: SampleEncoder = tool_style["markers"]
    plain = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}]}
    expected = encode(encoder, plain)
    for empty in ({"tools": []}, {"tools": "[]"}, {"tools": None}):
        for message in (
            {"tool_calls": []},
            {"tool_calls": [], "content": [{"type": "text", "text": "Hello!"}]},
        ):
            record = {
                **empty,
                "messages": [plain["messages"][0], {**plain["messages"][1], **message}],
            }
            sample = encode(encoder, record)
            np.testing.assert_array_equal(sample.input_ids, expected.input_ids)
            np.testing.assert_array_equal(sample.loss_mask, expected.loss_mask)
    # Nothing to train on: neither content nor a call.
    for content in ({}, {"content": None}):
        record = {"messages": [plain["messages"][0], {"role": "assistant", "tool_calls": [], **content}]}
        rejected = encoder.encode("s", record, None)
        state = "missing" if not content else "null"
        assert isinstance(rejected, RejectedSample)
        assert rejected.reason == (
            f"messages[1].tool_calls: [] and content {state}: an assistant message needs content, "
            "or tool_calls must be a non-empty list of tool calls"
        )


def test_parquet_null_fields_keep_reasoning_and_tool_calls(
    tmp_path: Path,
    write_jsonl: Callable[..., Path],
    write_parquet: Callable[..., Path],
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    read_jsonl: Callable[[Path], list[dict[str, Any]]],
    builtin_model: Callable[[str], Path],
) -> None:
    # Parquet gives every message every field of the file's schema, null where a message had
    # none: a record must come out of it as out of JSONL.
    import pyarrow.parquet as pq

    reasoning = {
        "messages": [
            {"role": "user", "content": "Q"},
            {"role": "assistant", "content": "ASSTL", "reasoning": "THINKL"},
        ]
    }
    agent = {
        "tools": [WEATHER],
        "messages": [
            {"role": "user", "content": "Weather in Oslo?"},
            # one call without "type", one with "parameters": each null-filled with the other's keys
            {
                "role": "assistant",
                "content": None,
                "reasoning_content": "Look it up.",
                "tool_calls": [
                    {"id": "c1", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
                    {"type": "function", "function": {"name": "get_weather", "parameters": {"city": "Rome"}}},
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "snow"},
            {"role": "assistant", "content": "Snow.", "tool_calls": []},
        ],
    }
    data = tmp_path / "data"
    write_jsonl(data / "chat.jsonl", [{"id": "jsonl-agent", **agent}, {"id": "jsonl-reasoning", **reasoning}])
    # The agent first: from_pylist takes the columns (not the struct fields) from the first row.
    parquet = write_parquet(
        data / "chat.parquet", [{"id": "parquet-agent", **agent}, {"id": "parquet-reasoning", **reasoning}]
    )
    rows = pq.read_table(parquet).to_pylist()
    assert rows[1]["messages"][1]["reasoning_content"] is None  # the shapes under test
    assert rows[0]["messages"][1]["tool_calls"][0]["type"] is None

    tokenizer = make_encoder(builtin_model("tiny-qwen3"), QWEN3_TEMPLATE).tokenizer  # built before the run
    out = tmp_path / "out"
    result = run_job(
        "run", f"--data.path={data}", f"--output.uri={out}", "--model.path=builtin:tiny-qwen3", *fast_args
    )
    assert result.rc == 0, result.describe()
    assert read_jsonl(out / "index-00000" / "rejected.jsonl") == []
    assert "sample_warnings" not in result.event("run_finished")
    samples = {s.sample_id: s for s in iter_output(out, require_complete=True)}
    assert sorted(samples) == ["jsonl-agent", "jsonl-reasoning", "parquet-agent", "parquet-reasoning"]
    for name in ("reasoning", "agent"):
        jsonl, from_parquet = samples[f"jsonl-{name}"], samples[f"parquet-{name}"]
        np.testing.assert_array_equal(jsonl.input_ids.numpy(), from_parquet.input_ids.numpy())
        np.testing.assert_array_equal(jsonl.loss_mask.numpy(), from_parquet.loss_mask.numpy())
    spans = [tokenizer.decode(s) for s in masked_spans(samples["parquet-reasoning"])]
    assert spans == ["<think>\nTHINKL\n</think>\n\nASSTL<|im_end|>"]
    spans = [tokenizer.decode(s) for s in masked_spans(samples["parquet-agent"])]
    assert spans == [
        "<think>\nLook it up.\n</think>\n\n<tool_call>\n"
        '{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>\n<tool_call>\n'
        '{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call><|im_end|>',
        "<think>\n\n</think>\n\nSnow.<|im_end|>",
    ]
