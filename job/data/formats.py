"""Validate one raw record into a conversation or a pre-tokenized sample.

Every problem raises SampleRejected with a reason that names the field, so a
bad record lands in ``rejected.jsonl`` instead of crashing or vanishing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
}
OPENAI_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}


class SampleRejected(Exception):
    """The sample cannot be used; ``str(exc)`` says why."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, str]]  # [{"role": system|user|assistant, "content": str}]


@dataclass(frozen=True)
class PreTokenized:
    input_ids: list[int]
    loss_mask: list[int] | None


def detect_format(value: dict[str, Any]) -> str:
    for field, name in (("conversations", "sharegpt"), ("messages", "openai"), ("input_ids", "tokenized")):
        if field in value:
            return name
    raise SampleRejected(
        "no 'conversations' (sharegpt), 'messages' (openai) or 'input_ids' (tokenized) field"
    )


def parse_record(value: dict[str, Any], fmt: str) -> Conversation | PreTokenized:
    fmt = detect_format(value) if fmt == "auto" else fmt
    if fmt == "sharegpt":
        return _parse_turns(value, "conversations", "from", "value", SHAREGPT_ROLES)
    if fmt == "openai":
        return _parse_turns(value, "messages", "role", "content", OPENAI_ROLES)
    return _parse_tokenized(value)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: a list of {"type": "text", "text": ...}
    if isinstance(content, list) and content:
        texts = []
        for i, part in enumerate(content):
            if not (
                isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
            ):
                raise SampleRejected(f"{where}[{i}]: only text content parts are supported")
            texts.append(part["text"])
        return "".join(texts)
    raise SampleRejected(f"{where}: content must be a string, got {type(content).__name__}")


def _parse_turns(
    value: dict[str, Any], field: str, role_key: str, content_key: str, roles: dict[str, str]
) -> Conversation:
    turns = value.get(field)
    if turns is None:
        raise SampleRejected(f"missing '{field}' field")
    if not isinstance(turns, list):
        raise SampleRejected(f"'{field}' must be a list, got {type(turns).__name__}")
    if not turns:
        raise SampleRejected(f"empty conversation ('{field}' is [])")
    messages = []
    for i, turn in enumerate(turns):
        where = f"{field}[{i}]"
        if not isinstance(turn, dict):
            raise SampleRejected(f"{where}: expected an object, got {type(turn).__name__}")
        role = turn.get(role_key)
        if not isinstance(role, str):
            raise SampleRejected(f"{where}.{role_key}: missing or not a string")
        if role.lower() not in roles:
            raise SampleRejected(
                f"{where}.{role_key}: unknown role {role!r} (expected one of {sorted(roles)})"
            )
        if content_key not in turn:
            raise SampleRejected(f"{where}.{content_key}: missing")
        messages.append(
            {"role": roles[role.lower()], "content": _text(turn[content_key], f"{where}.{content_key}")}
        )
    if not any(m["role"] == "assistant" for m in messages):
        raise SampleRejected("no assistant turn: nothing to train on")
    return Conversation(messages)


def _int_list(raw: Any, field: str) -> list[int]:
    if not isinstance(raw, list):
        raise SampleRejected(f"'{field}' must be a list of integers, got {type(raw).__name__}")
    for i, v in enumerate(raw):
        if not isinstance(v, int) or isinstance(v, bool):
            raise SampleRejected(f"{field}[{i}]: expected an integer, got {v!r}")
    return raw


def _parse_tokenized(value: dict[str, Any]) -> PreTokenized:
    if "input_ids" not in value:
        raise SampleRejected("missing 'input_ids' field")
    ids = _int_list(value["input_ids"], "input_ids")
    if not ids:
        raise SampleRejected("'input_ids' is empty")
    mask = value.get("loss_mask")
    if mask is not None:
        mask = _int_list(mask, "loss_mask")
        if len(mask) != len(ids):
            raise SampleRejected(f"'loss_mask' has {len(mask)} entries but 'input_ids' has {len(ids)}")
        bad = next((i for i, v in enumerate(mask) if v not in (0, 1)), None)
        if bad is not None:
            raise SampleRejected(f"loss_mask[{bad}] = {mask[bad]!r}; only 0 and 1 are allowed")
    return PreTokenized(ids, mask)
