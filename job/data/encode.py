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
* any other template (``rendered-turns``): the conversation is rendered a second
  time as a *shadow*, each text character of message j (content, reasoning, tool
  call names and argument values) replaced by a private-use character naming j,
  whitespace, quotes and the markup templates test for (``</think>``) kept: same
  length, same structure, so comparing the two renders position by position says
  which message each character comes from. An assistant turn then runs from the
  end of its generation prompt (the render of the turns before it with the prompt,
  where the whole render begins with that; else the prompt's text found last
  before the turn; else where the message's text would go were its empty content
  and reasoning filled in) to the end of the text the template renders after its
  last character when it is the final message (its end-of-turn token), and may
  hold no other message's character; a token in the loss may not either. A
  template that leaves turns open (GLM's) adds the next role's token the model
  generates to end it. Where this cannot be established the sample is rejected,
  naming the template.

Special tokens spelled out in an assistant's text (an end-of-turn token and a user
header, say) are tokenized as the text they are (as ``split_special_tokens`` does):
a model that writes them wrote text, so a record cannot plant a turn. In system,
user and tool texts they stay special tokens, as ``apply_chat_template`` and vLLM
serve them (mask 0 there). ``<think>``/``</think>`` always stay tokens. A template
that joins tool call ``arguments`` as a string (DeepSeek-V3.1's) gets them as the
record's JSON text.

A template that drops a record's tool calls, tool definitions or tool results
from the text (one written for plain chat, or DeepSeek-V3.1's, which takes no
``tools=``) rejects the sample instead of silently training on half of it; a
definition counts as rendered where its name is outside the assistant's turns.
One that drops part of an assistant's content (a literal ``</think>`` in an
earlier answer, read as the end of its reasoning) writes the sample as rendered
with the TEXT_DROPPED warning.

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
from collections.abc import Callable, Iterator
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
        self._open_turns: dict[str, bool] = {}  # per template: _ends_turns_by_next_role
        self._argument_form: dict[str, bool] = {}  # per template: _arguments_as_text

    @property
    def template_name(self) -> str:
        """The chat template in use, as a reason names it."""
        if self.spec.chat_template is not None:
            return "the chat template of data.chat_template"
        return f"the chat template of {self.spec.tokenizer_path}"

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
        return "generation-markers" if self.uses_generation_markers else "rendered-turns"

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
        messages = self._with_argument_texts(conv, template)
        located: dict[int, Span] | None = None
        owners: _Owners | None = None
        role_tokens: list[Span] = []
        if _GENERATION_MARKER.search(template):
            full, spans = self._render_marked(messages, conv.tools, template)
        else:
            full, _ = self._render(messages, conv.tools, template)
            owners = self._ownership(messages, conv.tools, template, full)
            located, role_tokens = self._rendered_spans(messages, conv.tools, template, full, owners)
            spans = list(located.values())
        _check_tools_rendered(conv, full, spans, located)
        if not self.spec.reasoning_in_loss:
            spans = _without_reasoning(full, spans)
        as_text: list[Span] = []
        if self._special_in_assistant_text(messages):
            if owners is None:
                owners = self._ownership(messages, conv.tools, template, full)
            as_text = _spelled_out(full, [*spans, *role_tokens], owners, messages, self._special_pattern)
        ids, mask, exact, (starts, ends) = self._tokenize(full, [*spans, *role_tokens], as_text)
        if owners is not None and located:
            self._check_masked_tokens(starts, ends, len(mask), located, owners)
        warnings = [
            _reasoning_warning(conv, full),
            self._dropped_text_warning(conv, messages, template, full, owners, located),
        ]
        return ids, mask, exact, "; ".join(w for w in warnings if w) or None

    def _dropped_text_warning(
        self,
        conv: Conversation,
        messages: list[dict[str, Any]],
        template: str,
        full: str,
        owners: _Owners | None,
        located: dict[int, Span] | None,
    ) -> str | None:
        """TEXT_DROPPED where the render holds fewer of an assistant content's characters than the
        content has outside a leading <think>...</think> block (reasoning, whose dropping is the
        template's way), and the content has a '</think>' further in. Turns the tokenizer does not
        see whole (past the char budget) are not judged."""
        suspects = {
            i: text
            for i, m in enumerate(messages)
            if m["role"] == "assistant" and (text := _past_reasoning(m)) is not None
        }
        if not suspects:
            return None
        if owners is None:  # a template with {% generation %} markers: its spans need no shadow
            try:
                owners = self._ownership(messages, conv.tools, template, full)
            except SampleRejected:  # it tests texts: each piece of the content must be in the render
                pieces = (piece.strip() for text in suspects.values() for piece in text.split(THINK_CLOSE))
                return TEXT_DROPPED if any(piece not in full for piece in pieces) else None
        special = self._special_tokens - REASONING_MARKERS
        for i, text in suspects.items():
            if owners.limit < owners.length and not owners.seen_whole(i, located):
                continue
            mark = _mark(i, _CONTENT)
            if owners.count(i, _CONTENT) < _hide(text, mark, special).count(mark):
                return TEXT_DROPPED
        return None

    def _with_argument_texts(self, conv: Conversation, template: str) -> list[dict[str, Any]]:
        """The messages as the template takes them: tool call arguments as their JSON text
        (the record's own string where it gave one) for a template that joins strings."""
        if not conv.argument_texts and not any(m.get("tool_calls") for m in conv.messages):
            return conv.messages
        if not self._arguments_as_text(template):
            return conv.messages
        messages = []
        for i, message in enumerate(conv.messages):
            if message.get("tool_calls"):
                calls = []
                for j, call in enumerate(message["tool_calls"]):
                    function = call["function"]
                    text = conv.argument_texts.get((i, j))
                    if text is None:
                        text = json.dumps(function["arguments"], ensure_ascii=False)
                    calls.append({**call, "function": {**function, "arguments": text}})
                message = {**message, "tool_calls": calls}
            messages.append(message)
        return messages

    def _special_in_assistant_text(self, messages: list[dict[str, Any]]) -> bool:
        """Whether an assistant message's text spells out one of the tokenizer's special tokens."""
        pattern = self._special_pattern
        if pattern is None:
            return False
        return any(pattern.search(text) for m in messages if m["role"] == "assistant" for text in _texts(m))

    def _check_masked_tokens(
        self, starts: np.ndarray, ends: np.ndarray, kept: int, located: dict[int, Span], owners: _Owners
    ) -> None:
        """Reject a sample where a token in the loss (of the first ``kept``) joins an assistant
        turn's characters with another message's: every masked token must lie in the assistant's
        own text or the template's."""
        for i, (a, b) in located.items():
            first = int(np.searchsorted(ends, a, "right"))
            last = min(int(np.searchsorted(starts, b, "left")), kept)
            if first >= last:
                continue
            reach = (int(starts[first]), int(ends[last - 1]))
            other = owners.foreign(reach[0], a, i)
            other = owners.foreign(b, reach[1], i) if other is None else other
            if other is not None:
                raise SampleRejected(
                    f"{self.template_name}: a token of assistant message {i}'s turn also holds text of "
                    f"message {other}, so it can be neither in the loss nor out of it"
                )

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

    def _rendered_spans(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
        owners: _Owners,
    ) -> tuple[dict[int, Span], list[Span]]:
        """Each assistant message's generated characters in ``full`` (by message index, those
        within the char budget), and the next-role tokens that end turns (GLM's), found from the
        template's own renders of the real conversation and checked against ``owners``."""
        located: dict[int, Span] = {}
        role_tokens: list[Span] = []
        previous_end = 0
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            try:
                extent = owners.extent(i)
            except SampleRejected as exc:
                raise SampleRejected(f"{self.template_name}: {exc}") from None
            if extent is None:  # no text of its own (an empty answer): where text would go
                at = self._insertion_point(messages, tools, template, full, i)
                extent = (at, at, owners.before(at), owners.after(at))
            first, last, lo, hi = extent
            if first >= owners.limit:
                break  # this turn and the later ones lie beyond what the tokenizer sees
            lo = max(lo, previous_end)
            start = self._turn_start(messages, tools, template, full, i, first, lo)
            end = self._turn_end(messages, tools, template, full, i, last, hi)
            if not lo <= start <= first or not last <= end <= hi:
                raise SampleRejected(
                    f"{self.template_name}: the generated text of message {i} cannot be told apart from "
                    "the other messages' (it would reach into them); use a template with {% generation %} "
                    "markers (data.chat_template)"
                )
            located[i] = (start, end)
            previous_end = end
            if self._ends_turns_by_next_role(template) and i + 1 < len(messages):
                token = self._next_role_token(full, end, hi, messages[i + 1]["role"])
                if token is not None:
                    role_tokens.append(token)
                    previous_end = token[1]
        return located, role_tokens

    def _turn_start(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
        i: int,
        first: int,
        lo: int,
    ) -> int:
        """Where assistant message ``i``'s generated text starts: after the generation prompt.

        The render of the turns before it with the generation prompt, where ``full`` begins
        with it; else that prompt's own text, the last one between the previous message's text
        and the turn's (a template that renders a final message differently, as Qwen3's adds an
        empty <think> block, changes the render before a second assistant turn in a row); else,
        for a template that puts the prompt inside the previous message (DeepSeek-V3.2's ends a
        user turn with ``<｜Assistant｜><think>`` and renders its generation prompt as an empty
        user turn), where the message's text would go were its empty fields filled in (so an
        empty reasoning's ``</think>`` counts), or its first character."""
        try:
            prompt, _ = self._render(messages[:i], tools, template, generation_prompt=True)
        except SampleRejected:  # a template that will not render the turns before it alone
            prompt = ""
        if prompt and lo <= len(prompt) <= first and full.startswith(prompt):
            return len(prompt)
        context = self._render(messages[:i], tools, template)[0] if prompt else ""
        if prompt.startswith(context) and len(prompt) > len(context):
            header = prompt[len(context) :]
            # Without its trailing whitespace too: a prompt that opens the reasoning block
            # (``<think>\n``) renders an earlier turn's empty block closed (Nemotron 3's
            # ``<think></think>``), and the model generated that ``</think>``.
            for text in dict.fromkeys((header, header.rstrip())):
                at = full.rfind(text, lo, first) if text else -1
                if at >= 0:
                    return at + len(text)
        at = self._insertion_point(messages, tools, template, full, i)
        return at if lo <= at <= first else first

    def _turn_end(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
        i: int,
        last: int,
        hi: int,
    ) -> int:
        """Where assistant message ``i``'s generated text ends: after the text the template
        renders after its last character when it is the final message (the end-of-turn token,
        whitespace after it excluded), as ``full`` has it."""
        upto, _ = self._render(messages[: i + 1], tools, template)
        if full.startswith(upto):
            return max(len(upto.rstrip()), last)
        shadow, _ = self._render([*messages[:i], self._shadow(messages[i], i)], tools, template)
        own = _own_positions(upto, shadow, i)
        if own is None:
            raise SampleRejected(
                f"{self.template_name}: the end of message {i}'s turn cannot be located (the template "
                "renders the turn differently when its text changes); use a template with "
                "{% generation %} markers (data.chat_template)"
            )
        if own.size:
            after = int(own[-1]) + 1
        else:
            after = self._insertion_point(messages[: i + 1], tools, template, upto, i)
        tail = upto[after:].rstrip()
        return last + _common_prefix(full[last : last + len(tail)], tail)

    def _insertion_point(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None,
        template: str,
        full: str,
        i: int,
    ) -> int:
        """The first character of ``full`` that changes when message ``i``'s empty content and
        reasoning are filled in: where its text would start."""
        filled = dict(messages[i])
        mark = _mark(i, _CONTENT)
        for key in ("content", "reasoning_content"):
            if not filled.get(key):
                filled[key] = mark
        try:
            probe, _ = self._render([*messages[:i], filled, *messages[i + 1 :]], tools, template)
        except SampleRejected:
            return len(full)
        return _common_prefix(full, probe)

    def _ends_turns_by_next_role(self, template: str) -> bool:
        """Whether the template leaves an assistant turn open, the model ending it by generating
        the next role's token (GLM's: ``<|user|>``, ``<|observation|>``)."""
        if template not in self._open_turns:
            probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
            try:
                text, _ = self._render(probe, None, template)
                self._open_turns[template] = text.rstrip().endswith("Hello")
            except SampleRejected:
                self._open_turns[template] = False
        return self._open_turns[template]

    def _next_role_token(self, full: str, end: int, hi: int, role: str) -> Span | None:
        """The special token that opens the next message right after a turn (whitespace
        between them aside), where that message is the user's or a tool's: the model hands over
        to them by generating it."""
        if role not in ("user", "tool"):
            return None
        at = end
        while at < hi and full[at].isspace():
            at += 1
        match = self._special_pattern.match(full, at) if self._special_pattern else None
        return (at, match.end()) if match and match.end() <= hi else None

    def _arguments_as_text(self, template: str) -> bool:
        """Whether the template wants a tool call's ``arguments`` as the JSON string (it
        renders a call's arguments only that way, as DeepSeek-V3.1's joins them with ``+``);
        otherwise they go as the object most templates serialize themselves."""
        if template not in self._argument_form:
            value = "\ue021probe\ue021"

            def renders(arguments: Any) -> bool:
                call = {"type": "function", "function": {"name": "probe", "arguments": arguments}}
                probe = [
                    {"role": "user", "content": "Hi"},
                    {"role": "assistant", "content": "", "tool_calls": [call]},
                    {"role": "tool", "content": "ok"},
                ]
                try:
                    return value in self._render(probe, None, template)[0]
                except SampleRejected:
                    return False

            as_text = json.dumps({"key": value}, ensure_ascii=False)
            self._argument_form[template] = not renders({"key": value}) and renders(as_text)
        return self._argument_form[template]

    @functools.cached_property
    def _special_pattern(self) -> re.Pattern[str] | None:
        """The special tokens that an assistant's text may not produce as such, longest first."""
        tokens = self._special_tokens - REASONING_MARKERS
        return re.compile("|".join(map(re.escape, sorted(tokens, key=len, reverse=True)))) if tokens else None

    @functools.cached_property
    def _special_tokens(self) -> frozenset[str]:
        """The tokenizer's special tokens: those ``split_special_tokens`` splits."""
        tokenizer = self.tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", {})
        tokens = {t.content for t in decoder.values() if getattr(t, "special", False)}
        return frozenset(t for t in tokens | set(tokenizer.all_special_tokens) if t)

    def _shadow(self, message: dict[str, Any], j: int) -> dict[str, Any]:
        """``message`` with each character of its texts (content, reasoning, tool call names and
        argument values, a tool's name) replaced by a character that says message ``j`` and the
        field. Kept as they are, so that the template takes the same branches and JSON-escapes
        the same: whitespace, quotes, backslashes, control characters, and markup templates test
        texts for (``</think>``, ``<tool_response>``, ``/no_think``) unless it is a special token."""
        special = self._special_tokens - REASONING_MARKERS
        shadow = dict(message)
        for key, field in (("content", _CONTENT), ("reasoning_content", _REASONING), ("name", _NAME)):
            if isinstance(shadow.get(key), str):
                shadow[key] = _hide(shadow[key], _mark(j, field), special)
        if message.get("tool_calls"):
            mark = _mark(j, _CALLS)
            shadow["tool_calls"] = [
                {
                    **call,
                    "function": {
                        **call["function"],
                        "name": _hide(call["function"]["name"], mark, special),
                        "arguments": _hide_values(call["function"]["arguments"], mark, special),
                    },
                }
                for call in message["tool_calls"]
            ]
        return shadow

    def _ownership(
        self, messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str, full: str
    ) -> _Owners:
        """Which message each character of ``full`` (up to the char budget) comes from: the
        conversation rendered again with every text character of message j replaced by a
        character of j's own (a shadow: same lengths, same structure, same tool calls), and the
        two renders compared position by position."""
        limit = min(len(full), self.char_budget)
        named = min(len(messages), _SHADOW_CODES // 4)
        if named < len(messages):
            # More messages than shadow characters: the later ones must lie past what the
            # tokenizer sees, the render of the first ones alone covering all of it.
            head, _ = self._render(messages[:named], tools, template)
            if _common_prefix(full, head) < limit:
                raise SampleRejected(
                    f"{self.template_name}: more than {named} messages, and the first {named} do not render "
                    "all the text the tokenizer sees: the turns cannot be located"
                )
        shadowed = [self._shadow(m, j) if j < named else m for j, m in enumerate(messages)]
        shadow, _ = self._render(shadowed, tools, template)
        codes = _shadow_codes(full[:limit], shadow[:limit]) if len(shadow) == len(full) else None
        if codes is None or (codes.size and int(codes.max()) >= 4 * len(messages)):
            raise SampleRejected(
                f"{self.template_name}: the assistant turns cannot be located: the template renders this "
                "conversation differently when only the characters of its texts change (it tests them); use "
                "a template with {% generation %} markers (data.chat_template)"
            )
        return _Owners(codes, len(full))

    def _tokenize(
        self, full: str, spans: list[Span], as_text: list[Span]
    ) -> tuple[np.ndarray, np.ndarray, bool, tuple[np.ndarray, np.ndarray]]:
        """Token ids and mask of ``full`` (cut to what max_length can use); whether the
        ids are all of ``full``'s tokens; the tokens' character offsets. The special tokens
        at ``as_text`` (spelled out in an assistant's text) are tokenized as text."""
        budget = self.char_budget
        cut = len(full) > budget
        ids, starts, ends = self._text_tokens(full[:budget] if cut else full, as_text)
        if cut:
            keep = self.spec.max_length
            if len(ids) <= keep or ends[keep - 1] > budget - GUARD:
                cut = False
                ids, starts, ends = self._text_tokens(full, as_text)
        mask = np.zeros(len(ids), np.bool_)
        reach = int(ends[-1]) if len(ends) else 0
        for a, b in spans:
            if a < reach:  # a span past the last token kept masks none
                mask |= (starts < b) & (ends > a) & (ends > starts)
        return ids, mask.astype(np.uint8), not cut, (starts, ends)

    def _text_tokens(self, text: str, as_text: list[Span]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``_tokens``, except that the special tokens at ``as_text`` are split into the tokens
        of their text (``split_special_tokens``): the text between the two special tokens around
        each is tokenized again that way (a tokenizer splits text at special tokens first, so the
        rest of the tokens are the same)."""
        ids, starts, ends = self._tokens(text)
        if not as_text:
            return ids, starts, ends
        special = np.isin(ids, self._special_ids)
        split = {(a, b) for a, b in as_text}
        at = [t for t in np.flatnonzero(special) if (int(starts[t]), int(ends[t])) in split]
        if not at:
            return ids, starts, ends
        special[at] = False
        kept = np.flatnonzero(special)
        pieces = sorted({(int(np.searchsorted(kept, t)) - 1, int(np.searchsorted(kept, t))) for t in at})
        parts_ids, parts_starts, parts_ends, done = [], [], [], 0
        for before, after in pieces:
            first = int(kept[before]) + 1 if before >= 0 else 0
            last = int(kept[after]) if after < kept.size else len(ids)
            a = int(ends[first - 1]) if first > 0 else 0
            b = int(starts[last]) if last < len(ids) else len(text)
            piece_ids, piece_starts, piece_ends = self._tokens(text[a:b], split_special_tokens=True)
            parts_ids += [ids[done:first], piece_ids]
            parts_starts += [starts[done:first], piece_starts + a]
            parts_ends += [ends[done:first], piece_ends + a]
            done = last
        parts_ids.append(ids[done:])
        parts_starts.append(starts[done:])
        parts_ends.append(ends[done:])
        return np.concatenate(parts_ids), np.concatenate(parts_starts), np.concatenate(parts_ends)

    @functools.cached_property
    def _special_ids(self) -> np.ndarray:
        return np.asarray(self.tokenizer.convert_tokens_to_ids(sorted(self._special_tokens)), np.int64)

    def _tokens(
        self, text: str, *, split_special_tokens: bool = False
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        try:
            enc = self.tokenizer(
                text,
                add_special_tokens=False,
                return_offsets_mapping=True,
                **({"split_special_tokens": True} if split_special_tokens else {}),
            )
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


# Shadow characters (Supplementary Private Use Area-A), four a message: one a field.
_SHADOW_BASE = 0xF0000
_SHADOW_CODES = 0xFFFFE - _SHADOW_BASE
_CONTENT, _REASONING, _CALLS, _NAME = range(4)
# Markup templates test texts for: kept in a shadow (unless a special token), so that a
# template splits or tests the shadow's texts as it does the real ones.
_MARKUP = re.compile(r"</?[A-Za-z_][\w:.-]*>|/no_?think\b|/think\b")
# What a shadow replaces: all but whitespace, quotes, backslashes and control characters,
# which JSON (tojson) would escape to other lengths.
_HIDDEN = re.compile(r'[^\s"\\\x00-\x1f]+')
# Reasoning markers: templates parse them out of texts and models generate them, so they are
# never split as text, even where a tokenizer calls them special.
REASONING_MARKERS = frozenset({THINK_OPEN, THINK_CLOSE})


def _mark(j: int, field: int) -> str:
    return chr(_SHADOW_BASE + 4 * j + field)


def _hide(text: str, mark: str, special: frozenset[str]) -> str:
    """``text`` with each character ``_HIDDEN`` matches replaced by ``mark``, except in markup
    other than special tokens."""

    def hide(run: re.Match[str]) -> str:
        return mark * len(run.group())

    parts, position = [], 0
    for markup in _MARKUP.finditer(text):
        parts.append(_HIDDEN.sub(hide, text[position : markup.start()]))
        tag = markup.group()
        parts.append(_HIDDEN.sub(hide, tag) if tag in special else tag)
        position = markup.end()
    parts.append(_HIDDEN.sub(hide, text[position:]))
    return "".join(parts)


def _texts(message: dict[str, Any]) -> Iterator[str]:
    """A message's texts: content, reasoning, tool call names and argument strings."""
    for key in ("content", "reasoning_content"):
        if isinstance(message.get(key), str):
            yield message[key]
    for call in message.get("tool_calls") or ():
        yield call["function"]["name"]
        yield from _leaves(call["function"]["arguments"])


def _leaves(value: Any) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        yield from value.keys()
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)


def _hide_values(value: Any, mark: str, special: frozenset[str]) -> Any:
    """Tool call arguments with their strings (text, or an object's values) hidden; keys kept."""
    if isinstance(value, str):
        return _hide(value, mark, special)
    if isinstance(value, dict):
        return {key: _hide_values(item, mark, special) for key, item in value.items()}
    if isinstance(value, list):
        return [_hide_values(item, mark, special) for item in value]
    return value


def _shadow_codes(text: str, shadow: str) -> np.ndarray | None:
    """Per character of ``text``: the shadow code (4 x message + field) where ``shadow`` has a
    shadow character instead, else -1; None where the two differ otherwise (not aligned)."""
    a = np.frombuffer(text.encode("utf-32-le", "surrogatepass"), np.uint32)
    b = np.frombuffer(shadow.encode("utf-32-le", "surrogatepass"), np.uint32)
    if a.shape != b.shape:
        return None
    differ = a != b
    marks = b[differ].astype(np.int64) - _SHADOW_BASE
    if marks.size and (int(marks.min()) < 0 or int(marks.max()) >= _SHADOW_CODES):
        return None
    codes = np.full(a.shape, -1, np.int32)
    codes[differ] = marks
    return codes


def _own_positions(text: str, shadow: str, i: int) -> np.ndarray | None:
    """The positions of message ``i``'s characters in ``text`` (None: not aligned)."""
    codes = _shadow_codes(text, shadow)
    return None if codes is None else np.flatnonzero((codes >= 0) & (codes // 4 == i))


class _Owners:
    """Which message each character of a render comes from (up to ``limit``), from its shadow."""

    def __init__(self, codes: np.ndarray, length: int) -> None:
        self.codes = codes
        self.limit = len(codes)
        self.length = length  # of the whole render
        self.owner = np.where(codes >= 0, codes // 4, -1)
        self.positions = np.flatnonzero(codes >= 0)
        owners = self.owner[self.positions]
        self._order = np.argsort(owners, kind="stable")
        self._sorted = owners[self._order]

    @property
    def _end(self) -> int:
        """The end of the render: past ``limit`` nothing is known, nor needed (the tokens kept
        end GUARD characters before it)."""
        return self.length

    def extent(self, i: int) -> tuple[int, int, int, int] | None:
        """Message ``i``'s characters: (first, end, after the previous message's, the next
        message's first); None if it has none. SampleRejected where another message's
        characters lie between its own."""
        a = int(np.searchsorted(self._sorted, i, "left"))
        b = int(np.searchsorted(self._sorted, i, "right"))
        if a == b:
            return None
        first = int(self.positions[self._order[a]])
        last = int(self.positions[self._order[b - 1]]) + 1
        k = int(np.searchsorted(self.positions, first, "left"))
        k_end = int(np.searchsorted(self.positions, last, "left"))
        if k_end - k != b - a:
            other = int(self.owner[self.positions[k:k_end]][self.owner[self.positions[k:k_end]] != i][0])
            raise SampleRejected(
                f"the chat template renders message {other}'s text inside assistant message {i}'s turn: "
                "the turn cannot be masked"
            )
        return first, last, self.before(first), self.after(last)

    def before(self, at: int) -> int:
        """Just after the last owned character before ``at`` (0 if none)."""
        k = int(np.searchsorted(self.positions, at, "left"))
        return int(self.positions[k - 1]) + 1 if k else 0

    def after(self, at: int) -> int:
        """The first owned character at or after ``at`` (the end if none)."""
        k = int(np.searchsorted(self.positions, at, "left"))
        return int(self.positions[k]) if k < self.positions.size else self._end

    def foreign(self, a: int, b: int, i: int) -> int | None:
        """A message other than ``i`` with a character in [a, b), if any."""
        owner = self.owner[max(a, 0) : min(b, self.limit)]
        other = owner[(owner >= 0) & (owner != i)]
        return int(other[0]) if other.size else None

    def count(self, i: int, field: int) -> int:
        return int(np.count_nonzero(self.codes == 4 * i + field))

    def seen_whole(self, i: int, located: dict[int, Span] | None) -> bool:
        """Whether message ``i`` lies wholly within ``limit``: its turn ends before it (``located``),
        else a later message's character comes before it."""
        if located is not None:
            return i in located and located[i][1] < self.limit
        return bool(np.any(self.owner[self.positions] > i))


def _spelled_out(
    full: str,
    spans: list[Span],
    owners: _Owners,
    messages: list[dict[str, Any]],
    pattern: re.Pattern[str] | None,
) -> list[Span]:
    """The special tokens in ``spans`` whose characters all come from an assistant message's
    text: to be tokenized as the text they are."""
    found: list[Span] = []
    if pattern is None:
        return found
    for a, b in spans:
        for match in pattern.finditer(full, a, min(b, owners.limit)):
            owner = owners.owner[match.start() : match.end()]
            if (owner >= 0).all() and (owner == owner[0]).all() and messages[owner[0]]["role"] == "assistant":
                found.append((match.start(), match.end()))
    return found


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
    """Reject a conversation whose tool parts the template left out of the text: a tool call
    missing from its turn, a tool result from the text, a tool definition's name from the text
    outside the assistant's turns (``spans``).

    ``located``: each assistant message's span where known (rendered-turns); a message
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
    # A tool's name in a call the assistant makes is no definition: look outside the turns.
    outside, at = [], 0
    for a, b in sorted(spans):
        outside.append(full[at:a])
        at = max(at, b)
    text = "\0".join([*outside, full[at:]])
    missing = [name for t in conv.tools or () if (name := t["function"]["name"]) not in text]
    if missing:
        raise SampleRejected(
            f"the chat template did not render the tool definitions ({', '.join(missing)}): it ignores "
            "the record's tools; set data.chat_template to one that renders them (the template the model "
            "is served with tools), or describe the tools in the system message (where a model whose "
            "template takes none, as DeepSeek-V3.1's, expects them)"
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


TEXT_DROPPED = (
    "the chat template left out part of an assistant message's content: it holds a literal '</think>' "
    "(not after a leading <think>), and the template takes all before it as reasoning, which it drops "
    "from this turn; the sample is written as rendered; to keep the text, rephrase the tag in the record "
    "or put the reasoning in reasoning_content"
)


def _past_reasoning(message: dict[str, Any]) -> str | None:
    """An assistant content's text after the leading <think>...</think> block it may open with,
    where a literal '</think>' is still in it (which a template may read as the end of reasoning);
    else None."""
    content = message.get("content")
    if not isinstance(content, str) or THINK_CLOSE not in content:
        return None
    text = content.lstrip()
    if text.startswith(THINK_OPEN):
        text = text[text.index(THINK_CLOSE) + len(THINK_CLOSE) :]
    return text if THINK_CLOSE in text else None


def _json_escaped(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)[1:-1]
