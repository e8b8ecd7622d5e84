"""Turn a validated record into token ids and an assistant-only loss mask.

Loss mask = 1 on the tokens the assistant produced (its content and its
end-of-turn token), 0 elsewhere. Two ways to find them:

* templates with ``{% generation %}`` markers: transformers'
  ``return_assistant_tokens_mask``;
* any other template: render the conversation up to each assistant turn with
  and without that turn and take the difference (trailing whitespace the
  template adds after the end-of-turn token is not something the model
  generates, so it is left out). A template whose renders are not prefixes of
  each other cannot be diffed; such samples are rejected with a reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from job.data.formats import Conversation, PreTokenized, SampleRejected, parse_record
from job.errors import ConfigError

_GENERATION_MARKER = re.compile(r"\{%-?\s*generation\s*-?%\}")


@dataclass(frozen=True)
class EncoderSpec:
    """Everything a (possibly separate) process needs to build a SampleEncoder."""

    tokenizer_path: str
    chat_template: str | None
    data_format: str
    max_length: int
    too_long: str
    vocab_size: int


@dataclass(frozen=True, slots=True)
class EncodedSample:
    sample_id: str
    input_ids: np.ndarray  # int32 [T]
    loss_mask: np.ndarray  # uint8 [T]
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(frozen=True, slots=True)
class RejectedSample:
    sample_id: str
    reason: str


def read_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    try:
        return Path(path).expanduser().read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(f"data.chat_template: cannot read {path}: {exc.strerror}") from None


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
                tokenizer = AutoTokenizer.from_pretrained(self.spec.tokenizer_path)
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"model.path: no usable tokenizer at {self.spec.tokenizer_path} ({exc}); "
                    "conversations need one (pre-tokenized data does not)"
                ) from None
            if self.spec.chat_template is not None:
                tokenizer.chat_template = self.spec.chat_template
            self._tokenizer = tokenizer
        return self._tokenizer

    @property
    def chat_template(self) -> str | None:
        template = self.tokenizer.chat_template
        return template if isinstance(template, str) and template else None

    @property
    def uses_generation_markers(self) -> bool:
        template = self.chat_template
        return template is not None and bool(_GENERATION_MARKER.search(template))

    @property
    def mask_method(self) -> str:
        return "generation-markers" if self.uses_generation_markers else "prefix-diff"

    def encode(
        self, sample_id: str, value: dict[str, Any] | None, error: str | None
    ) -> EncodedSample | RejectedSample:
        if error is not None:
            return RejectedSample(sample_id, error)
        assert value is not None
        try:
            parsed = parse_record(value, self.spec.data_format)
            if isinstance(parsed, PreTokenized):
                ids, mask = self._pretokenized(parsed)
            else:
                ids, mask = self._conversation(parsed)
            return self._limit(sample_id, ids, mask)
        except SampleRejected as exc:
            return RejectedSample(sample_id, str(exc))

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

    def _conversation(self, conv: Conversation) -> tuple[np.ndarray, np.ndarray]:
        if self.chat_template is None:
            raise ConfigError(
                f"the tokenizer at {self.spec.tokenizer_path} has no chat template, so conversations "
                "cannot be tokenized; set data.chat_template to a Jinja template file"
            )
        if self.uses_generation_markers:
            encoded = self._render(
                conv.messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
            )
            ids = np.asarray(encoded["input_ids"], np.int32)
            mask = np.asarray(encoded["assistant_masks"], np.uint8)
            return ids, mask
        return self._prefix_diff(conv.messages)

    def _render(self, messages: list[dict[str, str]], **kwargs: Any) -> Any:
        try:
            return self.tokenizer.apply_chat_template(messages, **kwargs)
        except Exception as exc:  # the template's own raise_exception, jinja errors
            raise SampleRejected(f"chat template rejected the conversation: {exc}") from None

    def _prefix_diff(self, messages: list[dict[str, str]]) -> tuple[np.ndarray, np.ndarray]:
        full = self._render(messages, tokenize=False)
        spans = []
        for i, message in enumerate(messages):
            if message["role"] != "assistant":
                continue
            prefix = self._render(messages[:i], tokenize=False, add_generation_prompt=True)
            upto = self._render(messages[: i + 1], tokenize=False)
            if not (upto.startswith(prefix) and full.startswith(upto)):
                raise SampleRejected(
                    f"chat template is not prefix-stable at message {i}, so the assistant tokens "
                    "cannot be located; use a template with {% generation %} markers (data.chat_template)"
                )
            end = len(prefix) + len(upto[len(prefix) :].rstrip())
            spans.append((len(prefix), end))
        enc = self.tokenizer(full, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(enc["input_ids"], np.int32)
        offsets = np.asarray(enc["offset_mapping"], np.int64).reshape(-1, 2)
        starts, ends = offsets[:, 0], offsets[:, 1]
        mask = np.zeros(len(ids), np.bool_)
        for a, b in spans:
            mask |= (starts < b) & (ends > a) & (ends > starts)
        return ids, mask.astype(np.uint8)

    def _limit(self, sample_id: str, ids: np.ndarray, mask: np.ndarray) -> EncodedSample | RejectedSample:
        max_length = self.spec.max_length
        truncated = False
        if len(ids) > max_length:
            if self.spec.too_long == "skip":
                return RejectedSample(
                    sample_id,
                    f"too long: {len(ids)} tokens > data.max_length {max_length} (data.too_long: skip)",
                )
            ids, mask, truncated = ids[:max_length], mask[:max_length], True
        if not mask.any():
            where = f" within the first {max_length} tokens" if truncated else ""
            return RejectedSample(sample_id, f"no assistant tokens{where}: nothing to train on")
        return EncodedSample(sample_id, np.ascontiguousarray(ids), np.ascontiguousarray(mask), truncated)
