"""Turn a validated record into token ids and an assistant-only loss mask.

Conversations are rendered with the model's chat template (record-level tools
passed as ``tools=``, tool calls and results as the template expects them,
see job.data.formats). Loss mask = 1 on what the assistant generates: its
content, its tool calls, its reasoning where the template renders it, and its
end-of-turn token; 0 on system and user turns, tool results, role headers and
generation prompts. ``reasoning_in_loss: false`` also leaves out the closed
``<think>...</think>`` block an assistant turn opens with (and the whitespace
after it), or, after a generation prompt that opens the block itself, the turn's
text up to the first ``</think>``. Two ways to find the assistant's characters in the rendered text:

* templates with ``{% generation %}`` markers: what the markers enclose;
* any other template (``prefix-diff``): for each assistant message, the render
  of the conversation before it with the generation prompt gives its start (or,
  when the whole render does not begin with that, the generation prompt's text
  found last between the previous turn and the first character that changes
  when the message is replaced by a placeholder, else that character); the
  render with the placeholder gives its end: the two differ exactly where the
  message's reasoning, content and tool calls are, and the end-of-turn text
  that follows (from a render that ends with the message, trailing whitespace
  excluded) is included. Templates need not be prefix-stable: Qwen3's, which
  renders ``<think>`` only after the last user query and differently for the
  final message, works, two assistant turns in a row included.

A template that drops a record's tool calls, tool definitions or tool results
from the text (one written for plain chat) rejects the sample instead of
silently training on half of it.

Memory: the tokenizer sees at most ``max_length * L + GUARD`` characters of
the rendered text, L being the longest token of the vocabulary in characters
(byte-level BPE: in bytes): the first ``max_length`` tokens cannot reach
further, since a token covers at most L characters. ``GUARD`` (4096 characters)
keeps the cut away from the tokens kept: text before a cut tokenizes as in the
whole text except within the pre-token the cut falls into (pre-tokenizers split
at whitespace, punctuation and letter/digit changes, so that pre-token would
need to be a 4 KiB word). Should the ``max_length``-th token of the cut text end
within GUARD of the cut anyway (a normalizer that shortens text), the whole
text is tokenized. Rendering holds the whole record; records are bounded in
bytes by ``data.max_record_bytes`` (job.data.source).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from job.data.formats import Conversation, PreTokenized, SampleRejected, parse_record
from job.errors import ConfigError

Record = Conversation | PreTokenized
_Built = TypeVar("_Built")

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")
GUARD = 4096
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"
MAX_REASON_CHARS = 1000
# Private-use characters: a placeholder for an assistant message that no real text contains.
_PLACEHOLDERS = ("\ue000", "\ue001\ue002", "\ue003\ue004\ue005")
_COMPARE_STEP = 4096

Span = tuple[int, int]  # [start, end) in characters of the rendered text


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a (possibly separate) process needs to build a SampleEncoder."""

    tokenizer_path: str
    chat_template: str | None
    data_format: str
    max_length: int
    too_long: str
    vocab_size: int
    reasoning_in_loss: bool = True
    trust_remote_code: bool = False  # model.trust_remote_code: tokenizers with their own code (Kimi)
    generate_mode: str = "keep"  # generate.mode: keep | last_turn | all_turns (job.generate.turns)


@dataclass(frozen=True, slots=True)
class EncodedSample:
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool
    # written, but with something of the record left out (REASONING_NOT_RENDERED)
    warning: str | None = None

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class GenerationStart:
    """A conversation whose assistant turns are to be generated again (job.generate.turns)."""

    sample_id: str
    conversation: Conversation
    targets: tuple[int, ...]  # message positions of the turns to generate (len(messages): append)
    prompt_ids: np.ndarray  # int32: the first turn's prompt


@dataclass(frozen=True, slots=True)
class RejectedSample:
    sample_id: str
    reason: str


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        template = Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"data.chat_template: cannot read {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"data.chat_template: {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        ) from None
    if not template.strip():  # as the tokenizer's template it would read as "the tokenizer has none"
        raise ConfigError(
            f"data.chat_template: {path} is empty; write the Jinja chat template into it, or unset "
            "data.chat_template to use the tokenizer's own"
        )
    return template


def clean_reason(reason: str) -> str:
    """A reason that fits a UTF-8 JSON line: surrogates escaped, length capped."""
    reason = reason.encode("utf-8", "backslashreplace").decode("utf-8")
    return reason if len(reason) <= MAX_REASON_CHARS else reason[: MAX_REASON_CHARS - 3] + "..."


class SampleEncoder:
    def __init__(self, spec: EncoderSpec) -> None:
        self.spec = spec
        self._tokenizer: Any = None

    @property
    def tokenizer(self) -> Any:
        """Loaded on first use: pre-tokenized data needs no tokenizer at all."""
        if self._tokenizer is None:
            from transformers import AutoTokenizer

            try:
                tokenizer = AutoTokenizer.from_pretrained(
                    self.spec.tokenizer_path, trust_remote_code=self.spec.trust_remote_code
                )
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"model.path: no usable tokenizer at {self.spec.tokenizer_path} ({exc}); "
                    "conversations need one (pre-tokenized data does not)"
                ) from None
            if self.spec.chat_template is not None:
                tokenizer.chat_template = self.spec.chat_template
            self._tokenizer = tokenizer
        return self._tokenizer

    def template(self, tools: list[dict[str, Any]] | None = None) -> str:
        """The chat template for a conversation (with ``tools``: a tokenizer's tool_use
        template where it has named ones)."""
        try:
            template = self.tokenizer.get_chat_template(None, tools)
        except ValueError:
            template = None
        if not isinstance(template, str) or not template:
            raise ConfigError(
                f"the tokenizer at {self.spec.tokenizer_path} has no chat template, so conversations "
                "cannot be tokenized; set data.chat_template to a Jinja template file"
            )
        return template

    @property
    def chat_template(self) -> str | None:
        try:
            return self.template()
        except ConfigError:
            return None

    @property
    def uses_generation_markers(self) -> bool:
        template = self.chat_template
        return template is not None and bool(_GENERATION_MARKER.search(template))

    @property
    def mask_method(self) -> str:
        return "generation-markers" if self.uses_generation_markers else "prefix-diff"

    @functools.cached_property
    def char_budget(self) -> int:
        """The most characters of rendered text the first max_length tokens can cover, plus GUARD."""
        tokenizer = self.tokenizer
        tokens = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        longest = max((len(t) for t in tokens if isinstance(t, str)), default=1)
        return self.spec.max_length * max(longest, 1) + GUARD

    def encode(
        self, sample_id: str, value: dict[str, Any] | None, error: str | None
    ) -> EncodedSample | RejectedSample | GenerationStart:
        if self.spec.generate_mode != "keep":
            return self.start_generation(sample_id, value, error)
        return self._guarded(sample_id, value, error, self._encode_parsed)

    def start_generation(
        self, sample_id: str, value: dict[str, Any] | None, error: str | None
    ) -> GenerationStart | RejectedSample:
        """A record as a conversation to regenerate: which turns (``generate_mode``), and the
        template's tokens before the first of them."""
        return self._guarded(sample_id, value, error, self._generation_start)

    def _guarded(
        self,
        sample_id: str,
        value: dict[str, Any] | None,
        error: str | None,
        build: Callable[[str, Record], _Built],
    ) -> _Built | RejectedSample:
        """``build`` on the parsed record; the record's read error, a SampleRejected or any
        unexpected failure becomes its rejection (one record must not end the run)."""
        if error is not None:
            return RejectedSample(sample_id, clean_reason(error))
        assert value is not None
        try:
            return build(sample_id, parse_record(value, self.spec.data_format))
        except SampleRejected as exc:
            reason = str(exc)
        except ConfigError:
            raise
        except Exception as exc:  # the reason says what happened
            reason = f"could not be encoded (unexpected {type(exc).__name__}: {exc})"
        return RejectedSample(sample_id, clean_reason(reason))

    def _encode_parsed(self, sample_id: str, parsed: Record) -> EncodedSample | RejectedSample:
        if isinstance(parsed, PreTokenized):
            ids, mask = self._pretokenized(parsed)
            return self._limit(sample_id, ids, mask, exact=True)
        ids, mask, exact, warning = self._conversation(parsed)
        encoded = self._limit(sample_id, ids, mask, exact)
        if warning is not None and isinstance(encoded, EncodedSample):
            return dataclasses.replace(encoded, warning=warning)
        return encoded

    def _generation_start(self, sample_id: str, parsed: Record) -> GenerationStart | RejectedSample:
        if isinstance(parsed, PreTokenized):
            raise SampleRejected("a pre-tokenized record has no turns to regenerate (generate.mode: keep)")
        targets = generation_targets(parsed, self.spec.generate_mode)
        history = parsed.messages[: targets[0]]
        if not any(m["role"] in ("user", "tool") for m in history):
            raise SampleRejected("nothing to answer: no user or tool turn before the first regenerated turn")
        prompt = self.tokenize(self.render(history, parsed.tools, generation_prompt=True))
        if len(prompt) >= self.spec.max_length:
            return RejectedSample(
                sample_id,
                f"the prompt of the first regenerated turn has {len(prompt)} tokens, data.max_length "
                f"{self.spec.max_length} leaves none to generate",
            )
        return GenerationStart(sample_id, parsed, targets, prompt)

    def render(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, *, generation_prompt: bool
    ) -> str:
        """The chat template's text for ``messages`` (SampleRejected if the template refuses them)."""
        return self._render(messages, tools, self.template(tools), generation_prompt=generation_prompt)[0]

    def tokenize(self, text: str) -> np.ndarray:
        """``text``'s token ids (int32), no special tokens added: a template's text holds its own."""
        return self._tokens(text)[0]

    def _pretokenized(self, sample: PreTokenized) -> tuple[np.ndarray, np.ndarray]:
        ids = np.asarray(sample.input_ids, dtype=np.int64)
        out_of_range = np.flatnonzero((ids < 0) | (ids >= self.spec.vocab_size))
        if out_of_range.size:
            i = int(out_of_range[0])
            raise SampleRejected(
                f"input_ids[{i}] = {int(ids[i])} is outside the model's vocabulary "
                f"[0, {self.spec.vocab_size})"
            )
        # No loss_mask given: every token is a training target.
        mask = (
            np.ones(len(ids), np.uint8)
            if sample.loss_mask is None
            else np.asarray(sample.loss_mask, np.uint8)
        )
        return ids.astype(np.int32), mask

    def _conversation(self, conv: Conversation) -> tuple[np.ndarray, np.ndarray, bool, str | None]:
        if not any(m["role"] == "assistant" for m in conv.messages):
            raise SampleRejected("no assistant turn: nothing to train on")
        template = self.template(conv.tools)
        located: dict[int, Span] | None = None
        if _GENERATION_MARKER.search(template):
            full, spans = self._render_marked(conv.messages, conv.tools, template)
        else:
            full, _ = self._render(conv.messages, conv.tools, template)
            located = self._diff_spans(conv.messages, conv.tools, template, full)
            spans = list(located.values())
        _check_tools_rendered(conv, full, spans, located)
        if not self.spec.reasoning_in_loss:
            spans = _without_reasoning(full, spans)
        return *self._tokenize(full, spans), _reasoning_warning(conv, full)

    def _render(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        *,
        generation_prompt: bool = False,
        spans: bool = False,
    ) -> tuple[str, list[Span]]:
        from transformers.utils.chat_template_utils import render_jinja_template

        try:
            rendered, indices = render_jinja_template(
                conversations=[messages],
                tools=tools,
                chat_template=template,
                return_assistant_tokens_mask=spans,
                add_generation_prompt=generation_prompt,
                **self.tokenizer.special_tokens_map,
            )
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise SampleRejected(f"chat template rejected the conversation: {exc}") from None
        return rendered[0], [tuple(s) for s in indices[0]] if spans else []

    def _render_marked(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str
    ) -> tuple[str, list[Span]]:
        """The render and the spans its {% generation %} blocks enclose.

        transformers' own tracking re-joins the whole output at every block (quadratic:
        minutes for a 20 MB conversation), so the blocks become plain ``if`` blocks that
        emit a sentinel character at each end, found in one pass afterwards."""
        if any(s in _strings(messages, tools) for s in (_SPAN_OPEN, _SPAN_CLOSE)):
            return self._render(messages, tools, template, spans=True)
        rendered, _ = self._render(messages, tools, _with_sentinels(template))
        parts = _SENTINELS.split(rendered)
        text: list[str] = []
        spans: list[Span] = []
        position, opened = 0, None
        for part in parts:
            if part == _SPAN_OPEN:
                opened = position if opened is None else opened
            elif part == _SPAN_CLOSE:
                if opened is not None:
                    spans.append((opened, position))
                opened = None
            else:
                text.append(part)
                position += len(part)
        return "".join(text), spans

    def _diff_spans(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
    ) -> dict[int, Span]:
        """The span of each assistant message (by index) that starts within the char budget."""
        placeholder = next((p for p in _PLACEHOLDERS if p not in full), None)
        if placeholder is None:
            raise SampleRejected("the conversation holds the placeholders used to locate assistant turns")
        stand_in = {"role": "assistant", "content": placeholder}
        spans: dict[int, Span] = {}
        previous_end = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            alternative, _ = self._render([*messages[:i], stand_in, *messages[i + 1 :]], tools, template)
            first = _common_prefix(full, alternative)
            if first >= self.char_budget:
                break  # this turn and the later ones lie beyond what the tokenizer sees
            region_end = len(full) - _common_suffix(full, alternative, first)
            start = first
            if i > 0:
                start = self._turn_start(messages[:i], tools, template, full, previous_end, first, region_end)
            upto, _ = self._render(messages[: i + 1], tools, template)
            upto_alternative, _ = self._render([*messages[:i], stand_in], tools, template)
            shared = _common_suffix(upto, upto_alternative, _common_prefix(upto, upto_alternative))
            tail = upto[len(upto) - shared :].rstrip()  # the end-of-turn text
            end = region_end + _common_prefix(full[region_end : region_end + len(tail)], tail)
            if start < previous_end:
                raise SampleRejected(
                    f"chat template: the assistant tokens of message {i} cannot be located (its render "
                    "overlaps the previous turn's); use a template with {% generation %} markers "
                    "(data.chat_template)"
                )
            spans[i] = (start, end)
            previous_end = end
        return spans

    def _turn_start(
        self,
        before: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
        previous_end: int,
        first: int,
        region_end: int,
    ) -> int:
        """Where the assistant turn after ``before`` starts in ``full``: after the render of
        ``before`` with the generation prompt where ``full`` begins with it; else after the
        generation prompt's own text, the last one between the previous turn's end and ``first``
        (the turn's first character that depends on its message); else ``first``.

        The second case: a template that renders the final message differently changes the
        render of ``before`` when that ends in an assistant turn (Qwen3's adds an empty <think>
        block to it), but the text it renders at the turn's start (that block) still follows
        the generation prompt. The last one: only template text lies between it and ``first``,
        the record's earlier turns before it."""
        try:
            prompt, _ = self._render(before, tools, template, generation_prompt=True)
            if full.startswith(prompt) and len(prompt) <= region_end:
                return len(prompt)
            context, _ = self._render(before, tools, template)
        except SampleRejected:  # a template that will not end on this message
            return first
        header = prompt[len(context) :] if prompt.startswith(context) else ""
        at = full.rfind(header, previous_end, first) if header else -1
        return first if at < 0 else at + len(header)

    def _tokenize(self, full: str, spans: list[Span]) -> tuple[np.ndarray, np.ndarray, bool]:
        """Token ids and mask of ``full`` (cut to what max_length can use); whether the
        ids are all of ``full``'s tokens."""
        budget = self.char_budget
        cut = len(full) > budget
        ids, starts, ends = self._tokens(full[:budget] if cut else full)
        if cut:
            keep = self.spec.max_length
            if len(ids) <= keep or ends[keep - 1] > budget - GUARD:
                cut = False
                ids, starts, ends = self._tokens(full)
        mask = np.zeros(len(ids), np.bool_)
        for a, b in spans:
            mask |= (starts < b) & (ends > a) & (ends > starts)
        return ids, mask.astype(np.uint8), not cut

    def _tokens(self, text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            enc = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        except Exception as exc:
            raise SampleRejected(f"the tokenizer rejected the rendered text: {exc}") from None
        ids = np.asarray(enc["input_ids"], np.int32)
        offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        return ids, offsets[:, 0], offsets[:, 1]

    def _limit(
        self, sample_id: str, ids: np.ndarray, mask: np.ndarray, exact: bool
    ) -> EncodedSample | RejectedSample:
        max_length = self.spec.max_length
        truncated = False
        if len(ids) > max_length:
            if self.spec.too_long == "skip":
                count = f"{len(ids)} tokens" if exact else f"over {len(ids)} tokens"
                return RejectedSample(
                    sample_id,
                    f"too long: {count} > data.max_length {max_length} (data.too_long: skip)",
                )
            ids, mask, truncated = ids[:max_length], mask[:max_length], True
        if not mask.any():
            where = f" within the first {max_length} tokens" if truncated else ""
            return RejectedSample(sample_id, f"no assistant tokens{where}: nothing to train on")
        return EncodedSample(sample_id, np.ascontiguousarray(ids), np.ascontiguousarray(mask), truncated)


_GENERATION_TAG = re.compile(r"\{%(-?)\s*(end)?generation\s*(-?)%\}")
_SPAN_OPEN, _SPAN_CLOSE = "\ue010", "\ue011"
_SENTINELS = re.compile(f"([{_SPAN_OPEN}{_SPAN_CLOSE}])")


def generation_targets(conversation: Conversation, mode: str) -> tuple[int, ...]:
    """The turns ``generate.mode`` regenerates, as message positions (``len(messages)``: one
    appended after a final user or tool turn): last_turn the final one, all_turns every one."""
    messages = conversation.messages
    assistants = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    ends_open = not messages or messages[-1]["role"] != "assistant"
    if mode == "last_turn":
        return (len(messages),) if ends_open else (assistants[-1],)
    return (*assistants, *((len(messages),) if ends_open else ()))


@functools.lru_cache(maxsize=8)
def _with_sentinels(template: str) -> str:
    """``template`` with each generation block an ``if true`` block that emits a sentinel
    at its ends: two block tags where there was one, so whitespace control (the tag's own
    dashes, trim_blocks, lstrip_blocks) acts on the text around them as before."""

    def swap(tag: re.Match[str]) -> str:
        left, end, right = tag.group(1), tag.group(2), tag.group(3)
        if end:
            return f"{{%{left} endif %}}{{{{ '{_SPAN_CLOSE}' }}}}{{% endif {right}%}}"
        return f"{{%{left} if true %}}{{{{ '{_SPAN_OPEN}' }}}}{{% if true {right}%}}"

    return _GENERATION_TAG.sub(swap, template)


def _strings(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> str:
    """All the text of a conversation, as JSON (to look for characters in it)."""
    return json.dumps([messages, tools], ensure_ascii=False, default=str)


def _common_prefix(a: str, b: str) -> int:
    """Length of the longest common prefix, compared a block at a time (C speed)."""
    n = min(len(a), len(b))
    i = 0
    while i < n:
        j = min(i + _COMPARE_STEP, n)
        if a[i:j] != b[i:j]:
            while a[i] == b[i]:
                i += 1
            return i
        i = j
    return n


def _common_suffix(a: str, b: str, prefix: int) -> int:
    """Length of the longest common suffix that does not reach into the first ``prefix`` characters."""
    n = min(len(a), len(b)) - prefix
    i = 0
    while i < n:
        j = min(i + _COMPARE_STEP, n)
        if a[len(a) - j : len(a) - i] != b[len(b) - j : len(b) - i]:
            while a[len(a) - 1 - i] == b[len(b) - 1 - i]:
                i += 1
            return i
        i = j
    return n


def _without_reasoning(text: str, spans: list[Span]) -> list[Span]:
    """``spans`` less the closed <think>...</think> block each opens with (after whitespace
    only) and the whitespace after it. Reasoning comes first in a turn, both as templates render
    reasoning_content and as contents hold their own; a <think> further in, or one never closed,
    is the answer's text (one about the tag) and stays in the loss. A turn after a generation
    prompt that itself opens the block (``<think>\n``, as Qwen3-Thinking-2507's does) begins
    inside it: its reasoning runs to the first </think>."""
    kept: list[Span] = []
    for a, b in spans:
        open_at = a
        while open_at < b and text[open_at].isspace():
            open_at += 1
        if text.startswith(THINK_OPEN, open_at, b):
            close_at = text.find(THINK_CLOSE, open_at, b)
        elif _opened_before(text, a):  # the prompt opened the block
            open_at, close_at = a, text.find(THINK_CLOSE, a, b)
        else:
            close_at = -1
        if close_at < 0:
            kept.append((a, b))
            continue
        pos = close_at + len(THINK_CLOSE)
        while pos < b and text[pos].isspace():
            pos += 1
        kept += [(a, open_at), (pos, b)]
    return [(a, b) for a, b in kept if b > a]


def _opened_before(text: str, end: int) -> bool:
    """Whether ``text[:end]``, trailing whitespace aside, ends in <think> (without copying it)."""
    while end > 0 and text[end - 1].isspace():
        end -= 1
    return text.endswith(THINK_OPEN, 0, end)


def _check_tools_rendered(
    conv: Conversation, full: str, spans: list[Span], located: dict[int, Span] | None
) -> None:
    """Reject a conversation whose tool parts the template left out of the text.

    ``located``: each assistant message's span where known (prefix-diff); a message
    without one lies beyond what the tokenizer sees and is not checked."""
    generated = "".join(full[a:b] for a, b in spans)
    for i, message in enumerate(conv.messages):
        calls = message.get("tool_calls", ())
        if calls and (located is None or i in located):
            turn = generated if located is None else full[located[i][0] : located[i][1]]
            for call in calls:
                name = call["function"]["name"]
                if name not in turn:
                    raise SampleRejected(
                        f"the chat template did not render the tool call {name!r} of message {i} in the "
                        "assistant's turn: it does not support tool calls; set data.chat_template to one "
                        "that does"
                    )
        if message["role"] == "tool":
            result = message["content"].strip()
            if result and result not in full and _json_escaped(result) not in full:
                raise SampleRejected(
                    f"the chat template left out the tool result of message {i}: it does not support "
                    "tool messages; set data.chat_template to one that does"
                )
    missing = [t["function"]["name"] for t in conv.tools or () if t["function"]["name"] not in full]
    if missing:
        raise SampleRejected(
            f"the chat template did not render the tool definitions ({', '.join(missing)}): it ignores "
            "tools; set data.chat_template to one that renders them"
        )


REASONING_NOT_RENDERED = (
    "the chat template rendered none of the record's reasoning_content: the sample is written without "
    "its reasoning; to keep it, set data.chat_template to a template that renders reasoning"
)


def _reasoning_warning(conv: Conversation, full: str) -> str | None:
    """REASONING_NOT_RENDERED where the record's assistant messages carry reasoning and the render
    holds none of it (a template without reasoning support; Qwen3's drops only earlier turns').
    Written all the same: what the template renders is what the target sees."""
    reasoning = [r.strip() for m in conv.messages if (r := m.get("reasoning_content")) and r.strip()]
    if reasoning and not any(r in full for r in reasoning):
        return REASONING_NOT_RENDERED
    return None


def _json_escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]
