"""Peak memory of reading and tokenizing one large record (CPU, no model weights).

``python -m job.benchmarks.record_memory --sizes 20MB,200MB`` writes, for each size, a JSONL
file holding one conversation of about that many bytes (alternating user and
assistant turns of ~1 KB of text each) and reads and tokenizes it in a fresh
process, as ``python -m job run`` does (``job.data.source.read_records`` and
``job.data.encode.SampleEncoder``). It prints each process's peak RSS, the RSS
before the record was read (interpreter, transformers, tokenizer), the outcome
and the time, as a markdown table. Not a test: the figures depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import random
import subprocess
import sys
import tempfile
import time
from dataclasses import astuple
from pathlib import Path

from pydantic import ByteSize, TypeAdapter

_TEXT = (
    "the model drafts tokens and the target verifies them while hidden states of three layers "
    "feed a small head; shards hold many samples, the manifest is written last, and a resumed run "
    "skips what is done. Prüfung, café, 東京, 42, 3.14, def f(x): return x * 2"
)
_WORDS = _TEXT.split(" ")


def write_conversation(path: Path, size: int, seed: int = 0) -> None:
    """One JSONL line of about ``size`` bytes, a conversation of ~1 KB turns, written
    piece by piece (a peak in this process would carry over into the measured one:
    Linux keeps a process's peak RSS across exec)."""
    rng = random.Random(seed)
    with path.open("wb") as f:
        f.write(b'{"id": "big", "messages": [')
        written = turn = 0
        while written < size or turn % 2 == 1:
            text = " ".join(rng.choice(_WORDS) for _ in range(160))
            role = "user" if turn % 2 == 0 else "assistant"
            message = json.dumps({"role": role, "content": f"{role} turn {turn}: {text}"}, ensure_ascii=False)
            piece = (", " if turn else "") + message
            written += f.write(piece.encode())
            turn += 1
        f.write(b"]}\n")


def _peak_mib() -> float:
    """This process's peak RSS (VmHWM: unlike getrusage's, not inherited through exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def _child(path: str, model: str, max_length: int, max_record_bytes: int, prefix_diff: bool) -> None:
    from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
    from job.data.source import list_input_files, read_records
    from job.model import resolve_model
    from job.settings import ModelSettings
    from job.tiny import strip_generation_markers

    info = resolve_model(ModelSettings(path=model))
    spec = EncoderSpec(str(info.path), None, "auto", max_length, "truncate", info.vocab_size)
    encoder = SampleEncoder(spec)
    if prefix_diff:  # the model's template without its generation markers
        template = strip_generation_markers(encoder.template())
        encoder = SampleEncoder(EncoderSpec(spec.tokenizer_path, template, *astuple(spec)[2:]))
    _ = encoder.char_budget  # loads the tokenizer
    before = _peak_mib()
    started = time.monotonic()
    outcomes = []
    for record in read_records(list_input_files(path), max_record_bytes):
        result = encoder.encode(record.sample_id, record.value, record.error)
        if isinstance(result, EncodedSample):
            truncated = " (truncated)" if result.truncated else ""
            outcomes.append(f"written, {result.num_tokens} tokens{truncated}")
        else:
            outcomes.append(f"rejected: {result.reason}")
    print(
        json.dumps(
            {
                "before_mib": round(before),
                "peak_mib": round(_peak_mib()),
                "seconds": round(time.monotonic() - started, 1),
                "outcome": "; ".join(outcomes),
                "char_budget": encoder.char_budget,
                "mask_method": encoder.mask_method,
            }
        )
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m job.benchmarks.record_memory", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--sizes", default="20MB,200MB", help="record sizes, comma-separated")
    parser.add_argument("--model", default="builtin:tiny-llama", help="whose tokenizer and template")
    parser.add_argument("--max-length", type=int, default=2048, help="data.max_length")
    parser.add_argument("--max-record-bytes", default="64MiB", help="data.max_record_bytes")
    parser.add_argument(
        "--prefix-diff", action="store_true", help="strip the template's generation markers first"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    limit = int(TypeAdapter(ByteSize).validate_python(args.max_record_bytes))
    if args.child:
        _child(args.child, args.model, args.max_length, limit, args.prefix_diff)
        return 0
    method = "rendered-turns" if args.prefix_diff else "the template's own"
    print(
        f"model {args.model} (mask: {method}), data.max_length {args.max_length}, "
        f"data.max_record_bytes {args.max_record_bytes}\n"
    )
    print("| record | RSS before | peak RSS | time | outcome |")
    print("|---|---|---|---|---|")
    with tempfile.TemporaryDirectory(prefix="record-memory-") as tmp:
        for size_text in args.sizes.split(","):
            size = int(TypeAdapter(ByteSize).validate_python(size_text.strip()))
            path = Path(tmp) / f"record-{size}.jsonl"
            write_conversation(path, size)
            command = [
                sys.executable,
                "-m",
                "job.benchmarks.record_memory",
                "--child",
                str(path),
                "--model",
                args.model,
            ]
            command += ["--max-length", str(args.max_length), "--max-record-bytes", str(limit)]
            command += ["--prefix-diff"] if args.prefix_diff else []
            out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
            row = json.loads(out.strip().splitlines()[-1])
            print(
                f"| {path.stat().st_size / 1e6:.1f} MB | {row['before_mib']} MiB | {row['peak_mib']} MiB "
                f"| {row['seconds']} s | {row['outcome']} |"
            )
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
