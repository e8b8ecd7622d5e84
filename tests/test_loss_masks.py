"""Assistant-only loss masks on the two template styles the tiny models ship.

Both ways of finding assistant tokens must agree exactly: transformers'
``return_assistant_tokens_mask`` on a template with ``{% generation %}`` markers, and
the prefix-diff fallback on the same template without them (how most released models
ship it). And the mask must cover exactly each assistant message's content plus its
end-of-turn token: nothing of the system prompt, the user turns or the role headers.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
from job.tiny import CHATML_TEMPLATE, LLAMA3_TEMPLATE, strip_generation_markers

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


def masked_spans(sample: EncodedSample) -> list[np.ndarray]:
    """The token ids of each maximal run of mask == 1."""
    mask = sample.loss_mask.astype(bool)
    edges = np.flatnonzero(np.diff(np.concatenate([[False], mask, [False]]).astype(np.int8)))
    return [sample.input_ids[a:b] for a, b in zip(edges[::2], edges[1::2], strict=True)]


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
    assert style["prefix_diff"].mask_method == "prefix-diff"


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
    # The prefix diff locates turns by position, not by text: an answer that repeats the
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
