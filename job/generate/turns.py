"""One conversation's regeneration, turn by turn, token-exact.

``generate.mode``:

* ``last_turn``: the final assistant turn is generated again from the conversation before it
  (or, when the conversation ends with a user or tool turn, one is written after it);
* ``all_turns``: every assistant turn is generated again, each from the *regenerated* history
  (system, user and tool turns are kept as they are), plus one after a final user or tool turn.

A sample's ``input_ids`` are the chat template's tokens of the kept turns and the token ids the
model produced, never a re-tokenization of decoded text: the first prompt is the template's
render of the conversation before the first regenerated turn (with its generation prompt); the
model's tokens follow; between two regenerated turns come the tokens of the template's text
that follows the earlier turn's end-of-turn token up to the next generation prompt, and after
the final turn what the template renders after it (context, where it fits). That needs
a template that renders an earlier assistant turn as its content followed by the end-of-turn
text, right after the generation prompt it was generated from (prefix-stable); one that
rewrites earlier turns (Qwen3's drops their reasoning) rejects the sample under ``all_turns``,
naming the template, and ``last_turn`` works. The loss mask is 1 on the generated tokens, the
end-of-turn token included (with ``data.reasoning_in_loss: false``, not on their
``<think>...</think>`` block, which a generation prompt ending in ``<think>`` opens), 0 elsewhere.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from job.data.encode import EncodedSample, GenerationStart, RejectedSample, SampleEncoder
from job.data.formats import SampleRejected
from job.generate.sampling import Sampling


@dataclass
class GeneratedTurn:
    message_index: int
    prompt_tokens: int
    token_ids: list[int]
    finish_reason: str  # "stop" | "length"
    seed: int


@dataclass
class Regeneration:
    """The state of one conversation between its turns."""

    start: GenerationStart
    mode: str
    ids: list[int] = field(default_factory=list)  # the sample so far (prompt, turns, bridges)
    mask: list[int] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)  # the regenerated history
    turns: list[GeneratedTurn] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.ids = [int(t) for t in self.start.prompt_ids]
        self.mask = [0] * len(self.ids)
        self.messages = copy.deepcopy(self.start.conversation.messages)

    @property
    def done(self) -> bool:
        return len(self.turns) == len(self.start.targets)

    @property
    def next_target(self) -> int:
        return self.start.targets[len(self.turns)]


class TurnAssembler:
    """Builds each turn's prompt and the final sample (main process: it renders the template
    between turns with the run's tokenizer)."""

    def __init__(
        self, encoder: SampleEncoder, sampling: Sampling, max_length: int, reasoning_in_loss: bool
    ) -> None:
        self.encoder = encoder
        self.sampling = sampling
        self.max_length = max_length
        self.reasoning_in_loss = reasoning_in_loss
        tokenizer = encoder.tokenizer
        spec = encoder.spec
        self._template_name = (
            "the chat template of data.chat_template"
            if spec.chat_template is not None
            else f"the chat template of {spec.tokenizer_path}"
        )
        self._eos = set(sampling.eos_token_ids)
        self._eos_text = {e: tokenizer.decode([e]) for e in sampling.eos_token_ids}
        self._think = _single_token_ids(tokenizer, ("<think>", "</think>"))

    def budget(self, regeneration: Regeneration) -> int:
        """New tokens the next turn may take: max_new_tokens, within data.max_length."""
        return min(self.sampling.max_new_tokens, self.max_length - len(regeneration.ids))

    def add_turn(
        self, regeneration: Regeneration, token_ids: list[int], finish_reason: str, seed: int
    ) -> None:
        """Take a generated turn, and (unless it was the last) the bridge to the next prompt."""
        target = regeneration.next_target
        regeneration.turns.append(
            GeneratedTurn(target, len(regeneration.ids), list(token_ids), finish_reason, seed)
        )
        regeneration.mask.extend(self._turn_mask(token_ids, prompt_ids=regeneration.ids))
        regeneration.ids.extend(int(t) for t in token_ids)
        content = self._content(token_ids)
        message = {"role": "assistant", "content": content}
        if target < len(regeneration.messages):
            regeneration.messages[target] = message
        else:
            regeneration.messages.append(message)
        following = self._following_text(regeneration, token_ids)
        if not regeneration.done:
            if following is None:
                raise SampleRejected(
                    f"{self._template_name} is not prefix-stable across turns: it renders generated turn "
                    f"{len(regeneration.turns)} other than as the text generated after its prompt (it "
                    "rewrites earlier turns: trims them, drops their reasoning), so generate.mode: "
                    "all_turns cannot keep the generated tokens; use generate.mode: last_turn"
                )
        elif not following or len(regeneration.ids) >= self.max_length:
            return  # the template's text after the final turn is context only: none, or no room
        tokens = [int(t) for t in self.encoder.tokenize(following)]
        if regeneration.done:
            tokens = tokens[: self.max_length - len(regeneration.ids)]
        regeneration.ids.extend(tokens)
        regeneration.mask.extend([0] * len(tokens))

    def _following_text(self, regeneration: Regeneration, token_ids: list[int]) -> str | None:
        """The template's text from the end of the turn just generated to the next turn's
        generation prompt (after the final turn: to the end of the conversation, as the template
        renders the whole of it); None where the template renders the turn other than as the
        tokens generated after its prompt (not prefix-stable)."""
        tools, messages = regeneration.start.conversation.tools, regeneration.messages
        previous, final = regeneration.turns[-1].message_index, regeneration.done
        upto = len(messages) if final else regeneration.next_target
        prompt = self.encoder.render(messages[:previous], tools, generation_prompt=True)
        text = self.encoder.render(messages[:upto], tools, generation_prompt=not final)
        ended = token_ids[-1] if token_ids and token_ids[-1] in self._eos else None
        head = prompt + messages[previous]["content"] + (self._eos_text[ended] if ended is not None else "")
        return text[len(head) :] if text.startswith(head) else None

    def _turn_mask(self, token_ids: list[int], prompt_ids: list[int]) -> list[int]:
        mask = [1] * len(token_ids)
        if self.reasoning_in_loss or self._think is None:
            return mask
        # The model's own think tokens: each <think>...</think> block and the whitespace after it
        # are out, and a block still open where the turn was cut runs to its end. A prompt ending
        # in <think> (and whitespace), as Qwen3-Thinking-2507's generation prompt does, opened the
        # first one. (The data's turns, job.data.encode, lose only the block a turn opens with:
        # later "<think>" there is text.)
        open_id, close_id = self._think
        last = len(prompt_ids) - 1
        while last >= 0 and self._is_space(prompt_ids[last]):
            last -= 1
        inside, after_block = last >= 0 and prompt_ids[last] == open_id, False
        for i, token in enumerate(token_ids):
            if token == open_id:
                inside = True
            after_block = after_block and not inside and self._is_space(token)
            if inside or after_block:
                mask[i] = 0
            if token == close_id:
                inside, after_block = False, True
        return mask

    def _is_space(self, token: int) -> bool:
        text = self.encoder.tokenizer.decode([token])
        return bool(text) and text.isspace()

    def _content(self, token_ids: list[int]) -> str:
        body = token_ids[:-1] if token_ids and token_ids[-1] in self._eos else token_ids
        return self.encoder.tokenizer.decode(body, skip_special_tokens=False)

    def finish(self, regeneration: Regeneration, on_length: str) -> EncodedSample | RejectedSample:
        sample_id = regeneration.start.sample_id
        cut = [t for t in regeneration.turns if t.finish_reason == "length"]
        if cut and on_length == "reject":
            return RejectedSample(
                sample_id,
                f"a regenerated turn was cut at {len(cut[0].token_ids)} tokens by generate.max_new_tokens "
                "or data.max_length (generate.on_length: reject)",
            )
        ids = np.asarray(regeneration.ids[: self.max_length], np.int32)
        mask = np.asarray(regeneration.mask[: self.max_length], np.uint8)
        if not mask.any():
            return RejectedSample(sample_id, "the regenerated turns left no tokens to train on")
        # truncated: cut at data.max_length, or stopped before its last turn (no room left for it)
        truncated = len(regeneration.ids) > self.max_length or not regeneration.done
        return EncodedSample(sample_id, ids, mask, truncated)

    def record(self, regeneration: Regeneration) -> dict[str, Any]:
        """The sidecar line: the regenerated conversation, as text, with what made it (where
        data.max_length left no room for a turn: the messages before that turn)."""
        messages = regeneration.messages
        return {
            "sample_id": regeneration.start.sample_id,
            "messages": messages if regeneration.done else messages[: regeneration.next_target],
            "tools": regeneration.start.conversation.tools,
            "turns": [
                {
                    "message_index": t.message_index,
                    "prompt_tokens": t.prompt_tokens,
                    "generated_tokens": len(t.token_ids),
                    "finish_reason": t.finish_reason,
                    "seed": t.seed,
                }
                for t in regeneration.turns
            ],
            "turns_not_generated": len(regeneration.start.targets) - len(regeneration.turns),
            "tokens": len(regeneration.ids),
        }


def _single_token_ids(tokenizer: Any, words: tuple[str, str]) -> tuple[int, int] | None:
    """The ids of two marker words where the vocabulary has each as one token."""
    ids = []
    for word in words:
        encoded = tokenizer.encode(word, add_special_tokens=False)
        if len(encoded) != 1:
            return None
        ids.append(int(encoded[0]))
    return ids[0], ids[1]
