"""Validate one raw record into a conversation or a pre-tokenized sample.

Every problem raises SampleRejected with a reason that names the field, so a
bad record lands in ``rejected.jsonl`` instead of crashing or vanishing.

Conversations come out in the shape Hugging Face chat templates take, tool
calling included (the OpenAI shape):

* ``{"role": "system" | "user", "content": str}``;
* ``{"role": "assistant", "content": str, "reasoning_content": str,
  "tool_calls": [{"type": "function", "function": {"name": str, "arguments": ...},
  "id": str}]}``: ``content`` is "" when the turn only calls tools (OpenAI's
  ``content: null``, which vLLM also hands templates as ""), the other keys only
  when given; ``arguments`` parsed from OpenAI's JSON string into the object
  most templates serialize themselves (the record's own string is kept in
  ``Conversation.argument_texts`` for templates that join strings, DeepSeek-V3.1's);
* ``{"role": "tool", "content": str, "tool_call_id": str, "name": str}``;
* tool definitions as ``[{"type": "function", "function": {...}}]``.

OpenAI: roles system/developer, user, assistant, tool (and Llama 3.1's ipython, the legacy
``function`` role and ``function_call`` field); ``tool_calls: []`` is no tool
calls, as null is. ShareGPT: ``function_call`` turns (a JSON object, or a list
of them, with ``name`` and ``arguments``) become assistant tool calls and
``observation`` / ``tool`` turns tool results; record-level ``tools`` (a list,
or a JSON string of one, of bare function specs or OpenAI tool objects) and
``system`` as LLaMA-Factory writes them. In both, the list of turns may be given as
its JSON text (a string column of a CSV or Parquet export); assistant turns may carry
``reasoning_content`` or ``reasoning`` (null is absent; two different texts
reject the sample).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from job.data import exact_json

SHAREGPT_ROLES = {
    "system": "system",
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "model": "assistant",
    "function_call": "assistant",
    "observation": "tool",
    "tool": "tool",
}
OPENAI_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "assistant": "assistant",
    "tool": "tool",
    "function": "tool",  # OpenAI's legacy function-calling results
    "ipython": "tool",  # Llama 3.1's tool results
}
INT64 = 2**63


class SampleRejected(Exception):
    """The sample cannot be used; ``str(exc)`` says why."""


@dataclass(frozen=True)
class Conversation:
    messages: list[dict[str, Any]]  # in the shape described in the module docstring
    tools: list[dict[str, Any]] | None = None
    # (message, call) -> the arguments as the record wrote them, where it wrote a JSON string
    argument_texts: dict[tuple[int, int], str] = dataclasses.field(default_factory=dict)


@dataclass(frozen=True)
class PreTokenized:
    input_ids: list[int]
    loss_mask: list[int] | None


_FORMAT_FIELDS = (("conversations", "sharegpt"), ("messages", "openai"), ("input_ids", "tokenized"))


def detect_format(value: dict[str, Any]) -> str:
    present = [(field, name) for field, name in _FORMAT_FIELDS if field in value]
    if len(present) > 1:  # reading one would silently ignore the other
        fields = " and ".join(f"'{field}' ({name})" for field, name in present)
        raise SampleRejected(
            f"holds both {fields}: data.format auto cannot tell which to read; set data.format"
        )
    if present:
        return present[0][1]
    raise SampleRejected(
        "no 'conversations' (sharegpt), 'messages' (openai) or 'input_ids' (tokenized) field"
    )


def parse_record(value: dict[str, Any], fmt: str) -> Conversation | PreTokenized:
    fmt = detect_format(value) if fmt == "auto" else fmt
    if fmt == "sharegpt":
        return _parse_sharegpt(value)
    if fmt == "openai":
        return _parse_openai(value)
    return _parse_tokenized(value)


def _missing(value: dict[str, Any], field: str, fmt: str) -> SampleRejected:
    """A missing top-level field; says so when the record is in another format."""
    other = next((name for f, name in _FORMAT_FIELDS if f in value and name != fmt), None)
    if other is None:
        return SampleRejected(f"missing '{field}' field")
    return SampleRejected(
        f"missing '{field}' field (data.format is {fmt}, but this record is {other}; use data.format: auto)"
    )


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    # OpenAI content parts: a list of {"type": "text", "text": ...}
    if isinstance(content, list):  # [] is no parts: empty text
        return "".join(_text_part(part, f"{where}[{i}]") for i, part in enumerate(content))
    raise SampleRejected(f"{where}: content must be a string, got {_type_name(content)}")


def _text_part(part: Any, where: str) -> str:
    """The text of one OpenAI content part; anything else is rejected naming what it is."""
    if not isinstance(part, dict):
        raise SampleRejected(
            f"{where}: a content part must be an object like {{'type': 'text', 'text': ...}}, "
            f"got {_type_name(part)}"
        )
    kind = part.get("type")
    if kind != "text":
        found = "a part without a 'type'" if kind is None else f"a part of type {kind!r}"
        raise SampleRejected(
            f"{where}: {found}; only text parts ({{'type': 'text', 'text': ...}}) can be tokenized "
            "(the job extracts from text prompts): drop the part, or the sample"
        )
    text = part.get("text")
    if not isinstance(text, str):
        found = "missing" if "text" not in part else _type_name(text)
        raise SampleRejected(f"{where}.text: a text part's 'text' must be a string, got {found}")
    return text


def _type_name(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _turns(value: dict[str, Any], field: str, fmt: str) -> list[Any]:
    turns = value.get(field)
    if turns is None:
        raise _missing(value, field, fmt)
    if isinstance(turns, str):  # a column of JSON text, as CSV and some Parquet exports hold it
        turns = _json_value(turns, f"'{field}' (a string: read as the JSON of the list of turns)")
    if not isinstance(turns, list):
        raise SampleRejected(f"'{field}' must be a list, got {_type_name(turns)}")
    if not turns:
        raise SampleRejected(f"empty conversation ('{field}' is [])")
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SampleRejected(f"{field}[{i}]: expected an object, got {_type_name(turn)}")
    return turns


def _role(turn: dict[str, Any], where: str, key: str, roles: dict[str, str]) -> tuple[str, str]:
    role = turn.get(key)
    if not isinstance(role, str):
        raise SampleRejected(f"{where}.{key}: missing or not a string")
    if role.lower() not in roles:
        raise SampleRejected(f"{where}.{key}: unknown role {role!r} (expected one of {sorted(roles)})")
    return role.lower(), roles[role.lower()]


def _parse_openai(value: dict[str, Any]) -> Conversation:
    messages = []
    for i, turn in enumerate(_turns(value, "messages", "openai")):
        where = f"messages[{i}]"
        given, role = _role(turn, where, "role", OPENAI_ROLES)
        if role == "assistant":
            calls = turn.get("tool_calls")
            if calls == []:  # how OpenAI-style exports write "no tool calls"
                if turn.get("content") is None and turn.get("function_call") is None:
                    content = "null" if "content" in turn else "missing"
                    raise SampleRejected(
                        f"{where}.tool_calls: [] and content {content}: an assistant message needs "
                        "content, or tool_calls must be a non-empty list of tool calls"
                    )
                calls = None
            if calls is None and turn.get("function_call") is not None:
                calls = [{"type": "function", "function": turn["function_call"]}]
                where_calls = f"{where}.function_call"
            else:
                where_calls = f"{where}.tool_calls"
            messages.append(_assistant(turn, "content", where, calls, where_calls, _reasoning(turn, where)))
        elif role == "tool":
            if "content" not in turn:
                raise SampleRejected(f"{where}.content: missing")
            message = {"role": "tool", "content": _tool_result(turn["content"], f"{where}.content")}
            for key in ("tool_call_id", "name"):
                if turn.get(key) is not None:
                    if not isinstance(turn[key], str):
                        raise SampleRejected(f"{where}.{key}: must be a string, got {_type_name(turn[key])}")
                    message[key] = turn[key]
            if given == "function" and "name" not in message:
                raise SampleRejected(f"{where}.name: a 'function' message needs the function's name")
            messages.append(message)
        else:
            if "content" not in turn:
                raise SampleRejected(f"{where}.content: missing")
            messages.append({"role": role, "content": _text(turn["content"], f"{where}.content")})
    return _conversation(messages, _tools(value.get("tools"), "tools"))


def _parse_sharegpt(value: dict[str, Any]) -> Conversation:
    messages: list[dict[str, Any]] = []
    system = value.get("system")
    if system is not None and not isinstance(system, str):
        raise SampleRejected(f"'system' must be a string, got {_type_name(system)}")
    for i, turn in enumerate(_turns(value, "conversations", "sharegpt")):
        where = f"conversations[{i}]"
        given, role = _role(turn, where, "from", SHAREGPT_ROLES)
        if "value" not in turn:
            raise SampleRejected(f"{where}.value: missing")
        if given == "function_call":
            calls = _function_call_value(turn["value"], f"{where}.value")
            messages.append(_assistant({}, "value", where, calls, f"{where}.value", None))
        elif role == "assistant":
            messages.append(_assistant(turn, "value", where, None, "", _reasoning(turn, where)))
        elif role == "tool":
            messages.append({"role": "tool", "content": _tool_result(turn["value"], f"{where}.value")})
        else:
            messages.append({"role": role, "content": _text(turn["value"], f"{where}.value")})
    if system and not (messages and messages[0]["role"] == "system"):
        messages.insert(0, {"role": "system", "content": system})
    return _conversation(messages, _tools(value.get("tools"), "tools"))


_ARGUMENTS_TEXT = "\ue0ffarguments_text"  # a call's key until _conversation moves it out of the message


def _conversation(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> Conversation:
    texts = {
        (i, j): call.pop(_ARGUMENTS_TEXT)
        for i, message in enumerate(messages)
        for j, call in enumerate(message.get("tool_calls", ()))
        if _ARGUMENTS_TEXT in call
    }
    return Conversation(messages, tools, texts)


def _assistant(
    turn: dict[str, Any],
    content_key: str,
    where: str,
    calls: Any,
    where_calls: str,
    reasoning: str | None,
) -> dict[str, Any]:
    content = turn.get(content_key)
    if content_key not in turn and calls is None:
        raise SampleRejected(f"{where}.{content_key}: missing")
    # A turn that only calls tools has content "" (as vLLM passes OpenAI's null to the
    # template: the rendering served is the one to train on; templates test it as a string).
    text = "" if content is None and calls is not None else _text(content, f"{where}.{content_key}")
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if reasoning is not None:
        message["reasoning_content"] = reasoning
    if calls is not None:
        message["tool_calls"] = _tool_calls(calls, where_calls)
    return message


def _first(value: dict[str, Any], *keys: str) -> Any:
    """The value of the first of ``keys`` that ``value`` holds and is not null (None if none is).
    Null is absent: Parquet rows hold every key of the file's schema, those a record lacks null."""
    return next((value[key] for key in keys if value.get(key) is not None), None)


_REASONING_FIELDS = ("reasoning_content", "reasoning")


def _reasoning(turn: dict[str, Any], where: str) -> str | None:
    """An assistant turn's reasoning from ``reasoning_content`` or ``reasoning`` (vLLM's newer
    name), null being absent as in ``_first``: in Parquet a message written with one has both."""
    given = {field: turn[field] for field in _REASONING_FIELDS if turn.get(field) is not None}
    for field, value in given.items():
        if not isinstance(value, str):
            raise SampleRejected(f"{where}.{field}: must be a string, got {_type_name(value)}")
    texts = {value for value in given.values() if value}
    if len(texts) > 1:  # picking one would silently drop the other
        raise SampleRejected(
            f"{where}: reasoning_content and reasoning hold different texts; keep the turn's "
            "reasoning in one of them (or the same text in both)"
        )
    return texts.pop() if texts else next(iter(given.values()), None)  # "" stays an empty reasoning


def _function_call_value(raw: Any, where: str) -> list[dict[str, Any]]:
    """ShareGPT's function_call turn: a JSON object (or list) of {name, arguments}."""
    parsed = _json_value(raw, where) if isinstance(raw, str) else raw
    functions = parsed if isinstance(parsed, list) else [parsed]
    return [{"type": "function", "function": f} for f in functions]


def _json_value(raw: str, where: str) -> Any:
    try:
        return exact_json.loads(raw)
    except exact_json.JSONDecodeError as exc:
        raise SampleRejected(f"{where}: not valid JSON ({exc})") from None


def _tool_calls(calls: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(calls, list) or not calls:
        raise SampleRejected(f"{where}: must be a non-empty list of tool calls, got {_type_name(calls)}")
    normalized = []
    for j, call in enumerate(calls):
        at = f"{where}[{j}]"
        if not isinstance(call, dict):
            raise SampleRejected(f"{at}: expected an object, got {_type_name(call)}")
        kind = _first(call, "type")
        if kind not in (None, "function"):
            raise SampleRejected(f"{at}.type: only 'function' tool calls are supported, got {kind!r}")
        function = _first(call, "function")
        function = call if function is None else function  # ShareGPT lists bare {name, arguments}
        if not isinstance(function, dict):
            raise SampleRejected(f"{at}.function: expected an object, got {_type_name(function)}")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise SampleRejected(f"{at}.function.name: missing or not a string")
        arguments = _first(function, "arguments", "parameters")
        arguments = {} if arguments is None else arguments
        text = arguments if isinstance(arguments, str) and arguments.strip() else None
        if isinstance(arguments, str):
            arguments = _json_value(arguments, f"{at}.function.arguments") if arguments.strip() else {}
        if not isinstance(arguments, dict):
            raise SampleRejected(
                f"{at}.function.arguments: must be a JSON object, got {_type_name(arguments)}"
            )
        entry: dict[str, Any] = {"type": "function", "function": {"name": name, "arguments": arguments}}
        if isinstance(call.get("id"), str):
            entry["id"] = call["id"]
        if text is not None:
            entry[_ARGUMENTS_TEXT] = text
        normalized.append(entry)
    return normalized


def _tool_result(content: Any, where: str) -> str:
    """A tool's result: text, or any other JSON value as its JSON text."""
    if isinstance(content, str | list) and (isinstance(content, str) or _text_parts(content)):
        return _text(content, where)
    if content is None:
        raise SampleRejected(f"{where}: a tool result must not be null")
    return exact_json.dumps(content).decode()


def _text_parts(content: list[Any]) -> bool:
    return bool(content) and all(isinstance(p, dict) and p.get("type") == "text" for p in content)


def _tools(raw: Any, where: str) -> list[dict[str, Any]] | None:
    if raw is None or raw == "" or raw == []:
        return None
    if isinstance(raw, str):
        raw = _json_value(raw, f"'{where}' (a string: read as the JSON of a list of tool definitions)")
    if not isinstance(raw, list):
        raise SampleRejected(f"'{where}' must be a list of tool definitions, got {_type_name(raw)}")
    tools = []
    for i, tool in enumerate(raw):
        if not isinstance(tool, dict):
            raise SampleRejected(f"{where}[{i}]: expected an object, got {_type_name(tool)}")
        function = tool.get("function", tool) if tool.get("type", "function") == "function" else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise SampleRejected(f"{where}[{i}]: expected a function with a 'name'")
        tools.append({"type": "function", "function": function})
    return tools or None  # "[]" given as a string: no tools, as [] is


def _int_list(raw: Any, field: str) -> list[int]:
    if not isinstance(raw, list):
        raise SampleRejected(f"'{field}' must be a list of integers, got {_type_name(raw)}")
    for i, v in enumerate(raw):
        if not isinstance(v, int) or isinstance(v, bool):
            raise SampleRejected(f"{field}[{i}]: expected an integer, got {v!r}")
        if not -INT64 <= v < INT64:
            raise SampleRejected(f"{field}[{i}] = {v} is beyond 64-bit integers")
    return raw


def _parse_tokenized(value: dict[str, Any]) -> PreTokenized:
    if "input_ids" not in value:
        raise _missing(value, "input_ids", "tokenized")
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
