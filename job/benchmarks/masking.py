"""Samples per second of tokenizing and masking agentic conversations (CPU, one process).

``python -m job.benchmarks.masking --template $CHAT_TEMPLATES_DIR/Qwen-Qwen3-0.6B.jinja`` generates
``--records`` conversations (a system prompt, two user questions, each answered after one to
three rounds of reasoning and one or two tool calls (``--most-calls``) with their results: 9 to
23 messages), encodes them with ``job.data.encode.SampleEncoder`` as a data worker does, and
prints samples and tokens per CPU second of the process (on a shared machine steadier than wall
time; both are printed) for the template given (``data.chat_template``) on the tokenizer of
``--model``. Run it against another checkout's ``job`` (``PYTHONPATH``) to compare. Not a test:
the figures depend on the machine."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

_WORDS = [
    "the",
    "weather",
    "in",
    "Oslo",
    "turns",
    "to",
    "snow",
    "while",
    "Rome",
    "stays",
    "sunny",
    "and",
    "the",
    "tool",
    "answers",
    "in",
    "JSON",
]
_TOOLS = [
    {
        "type": "function",
        "function": {
            "name": name,
            "description": f"{name} for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
    for name in ("get_weather", "get_time")
]


def _text(rng: random.Random, words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(words))


def conversation(rng: random.Random, most_calls: int) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": "Use the tools. " + _text(rng, 20)}]
    for question in range(2):
        messages.append({"role": "user", "content": f"Question {question}: " + _text(rng, 30)})
        for _ in range(rng.randint(1, 3)):
            calls = [
                {
                    "id": f"functions.{tool['function']['name']}:{n}",
                    "type": "function",
                    "function": {
                        "name": tool["function"]["name"],
                        "arguments": json.dumps({"city": _text(rng, 2)}),
                    },
                }
                for n, tool in enumerate(rng.sample(_TOOLS, rng.randint(1, most_calls)))
            ]
            messages.append(
                {
                    "role": "assistant",
                    "content": None,
                    "reasoning_content": _text(rng, 40),
                    "tool_calls": calls,
                }
            )
            messages += [{"role": "tool", "tool_call_id": c["id"], "content": _text(rng, 25)} for c in calls]
        messages.append({"role": "assistant", "content": _text(rng, 60), "reasoning_content": _text(rng, 40)})
    return {"tools": _TOOLS, "messages": messages}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m job.benchmarks.masking", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--template", required=True, help="a chat template file (data.chat_template)")
    parser.add_argument("--model", default="builtin:tiny-qwen3", help="whose tokenizer")
    parser.add_argument("--records", type=int, default=300)
    parser.add_argument(
        "--most-calls", type=int, choices=(1, 2), default=2, help="tool calls a turn (Llama 3.x: 1)"
    )
    parser.add_argument("--max-length", type=int, default=8192, help="data.max_length")
    args = parser.parse_args(argv)

    from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
    from job.model import resolve_model
    from job.settings import ModelSettings

    info = resolve_model(ModelSettings(path=args.model))
    template = Path(args.template).read_text(encoding="utf-8")
    encoder = SampleEncoder(
        EncoderSpec(str(info.path), template, "auto", args.max_length, "truncate", info.vocab_size)
    )
    _ = encoder.char_budget  # loads the tokenizer
    rng = random.Random(0)
    records = [conversation(rng, args.most_calls) for _ in range(args.records)]
    encoder.encode("warm-up", records[0], None)
    started, cpu_started = time.perf_counter(), time.process_time()
    written = tokens = 0
    reasons: set[str] = set()
    for n, record in enumerate(records):
        result = encoder.encode(f"r{n}", record, None)
        if isinstance(result, EncodedSample):
            written, tokens = written + 1, tokens + result.num_tokens
        else:
            reasons.add(result.reason)
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu_started
    print(
        f"{args.records} records, {Path(args.template).name} on {args.model}'s tokenizer: "
        f"{args.records / cpu:.1f} samples per CPU second ({args.records / seconds:.1f} samples/s wall), "
        f"{tokens / cpu:,.0f} tokens per CPU second, {written} written"
        + (f", rejected: {sorted(reasons)}" if reasons else "")
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
