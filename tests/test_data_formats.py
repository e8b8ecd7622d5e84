"""Input formats end to end: ShareGPT, OpenAI and pre-tokenized records, in JSONL and
Parquet, as single files and as a nested directory; sample ids and their stability.
"""

from __future__ import annotations

import gzip
import io
import json
import random
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import zstandard

from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
from job.data.formats import Conversation, SampleRejected, parse_record
from job.data.source import data_fingerprint, list_input_files, read_records, scan_input
from job.errors import ConfigError
from job.shards import iter_output, read_manifest

SHAREGPT = [
    {
        "id": "sg-explicit",
        "conversations": [
            {"from": "system", "value": "Be brief."},
            {"from": "human", "value": "Capital of France?"},
            {"from": "gpt", "value": "Paris."},
        ],
    },
    "",  # a blank line: not a sample, but it still counts for the line numbers
    {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello there!"}]},
    {
        "id": 42,  # integer ids are used as their decimal string
        "conversations": [
            {"from": "user", "value": "Two turns?"},
            {"from": "assistant", "value": "Yes."},
            {"from": "human", "value": "Sure?"},
            {"from": "chatgpt", "value": "Quite sure."},
        ],
    },
]
OPENAI = [
    {
        "messages": [
            {"role": "system", "content": "You are a careful tutor."},
            {"role": "user", "content": "What is 2 + 2?"},
            {"role": "assistant", "content": "4."},
        ]
    },
    {
        "id": "oa-parts",
        "messages": [
            {"role": "developer", "content": "Answer in one word."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "Sky "}, {"type": "text", "text": "color?"}],
            },
            {"role": "assistant", "content": "Blue."},
        ],
    },
]
TOKENIZED = [
    {"id": "tok-masked", "input_ids": [1, 20, 30, 40, 50], "loss_mask": [0, 0, 1, 1, 1]},
    {"input_ids": [7, 8, 9]},  # no loss_mask: every token is a target
]
PARQUET_CHAT = [
    {
        "id": "pq-explicit",
        "messages": [
            {"role": "system", "content": "Be kind."},
            {"role": "user", "content": "Hello?"},
            {"role": "assistant", "content": "Hello, friend."},
        ],
    },
    {
        "id": None,  # null id: falls back to <file>:<row>
        "messages": [{"role": "user", "content": "Ping"}, {"role": "assistant", "content": "Pong"}],
    },
]
PARQUET_TOKENIZED = [
    {"input_ids": [3, 4, 5, 6], "loss_mask": None},
    {"input_ids": [10, 11, 12], "loss_mask": [1, 0, 1]},
]

CHAT_SCHEMA = pa.schema(
    [
        ("id", pa.string()),
        ("messages", pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))),
    ]
)
TOKENIZED_SCHEMA = pa.schema([("input_ids", pa.list_(pa.int64())), ("loss_mask", pa.list_(pa.int64()))])

# file (relative to the data dir) -> [(sample id, record)], in the order the job reads them
EXPECTED = {
    "a/b/openai.jsonl": [("a/b/openai.jsonl:1", OPENAI[0]), ("oa-parts", OPENAI[1])],
    "a/sharegpt.jsonl": [
        ("sg-explicit", SHAREGPT[0]),
        ("a/sharegpt.jsonl:3", SHAREGPT[2]),
        ("42", SHAREGPT[3]),
    ],
    "p/chat.parquet": [("pq-explicit", PARQUET_CHAT[0]), ("p/chat.parquet:1", PARQUET_CHAT[1])],
    "p/q/tokenized.parquet": [
        ("p/q/tokenized.parquet:0", PARQUET_TOKENIZED[0]),
        ("p/q/tokenized.parquet:1", PARQUET_TOKENIZED[1]),
    ],
    "tokenized.jsonl": [("tok-masked", TOKENIZED[0]), ("tokenized.jsonl:2", TOKENIZED[1])],
}
EXPECTED_ORDER = [sid for name in sorted(EXPECTED) for sid, _ in EXPECTED[name]]
RECORDS = {sid: record for entries in EXPECTED.values() for sid, record in entries}


@pytest.fixture(scope="module")
def data_dir(
    tmp_path_factory: pytest.TempPathFactory,
    write_jsonl: Callable[..., Path],
    write_parquet: Callable[..., Path],
) -> Path:
    root = tmp_path_factory.mktemp("formats") / "data"
    write_jsonl(root / "a" / "sharegpt.jsonl", SHAREGPT)
    write_jsonl(root / "a" / "b" / "openai.jsonl", OPENAI)
    write_jsonl(root / "tokenized.jsonl", TOKENIZED)
    write_parquet(root / "p" / "chat.parquet", PARQUET_CHAT, CHAT_SCHEMA)
    write_parquet(root / "p" / "q" / "tokenized.parquet", PARQUET_TOKENIZED, TOKENIZED_SCHEMA)
    (root / "README.md").write_text("not data: ignored")
    return root


@pytest.fixture(scope="module")
def encoder(tiny_llama_dir: Path) -> SampleEncoder:
    return SampleEncoder(EncoderSpec(str(tiny_llama_dir), None, "auto", 2048, "truncate", 1024))


@pytest.fixture(scope="module")
def runs(
    data_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> list[Path]:
    """Two independent runs over the same directory.

    The second keeps the default tokenizer_workers (a process pool) where the first
    tokenizes inline: the outputs must not depend on it.
    """
    outputs = []
    for i in range(2):
        out = tmp_path_factory.mktemp(f"formats-run{i}") / "out"
        args = fast_args if i == 0 else tuple(a for a in fast_args if "tokenizer_workers" not in a)
        result = run_job("run", f"--data.path={data_dir}", f"--output.uri={out}", *args)
        assert result.rc == 0, result.describe()
        outputs.append(out)
    return outputs


def samples_of(out: Path) -> list[Any]:
    return list(iter_output(out, require_complete=True))


def test_directory_run_writes_every_format_in_input_order(runs: list[Path]) -> None:
    samples = samples_of(runs[0])
    assert [s.sample_id for s in samples] == EXPECTED_ORDER
    manifest = read_manifest(runs[0] / "index-00000")
    assert manifest is not None and manifest.complete
    assert manifest.counts.written == len(EXPECTED_ORDER)
    assert manifest.counts.rejected == 0
    assert not (runs[0] / "index-00000" / "rejected.jsonl").read_text()


def test_tokens_and_masks_match_the_encoder(runs: list[Path], encoder: SampleEncoder) -> None:
    for sample in samples_of(runs[0]):
        expected = encoder.encode(sample.sample_id, RECORDS[sample.sample_id], None)
        assert isinstance(expected, EncodedSample)
        np.testing.assert_array_equal(sample.input_ids.numpy(), expected.input_ids)
        np.testing.assert_array_equal(sample.loss_mask.numpy(), expected.loss_mask)


def test_pretokenized_records_are_used_verbatim(runs: list[Path]) -> None:
    by_id = {s.sample_id: s for s in samples_of(runs[0])}
    for sid, ids, mask in [
        ("tok-masked", [1, 20, 30, 40, 50], [0, 0, 1, 1, 1]),
        ("tokenized.jsonl:2", [7, 8, 9], [1, 1, 1]),  # absent loss_mask => all ones
        ("p/q/tokenized.parquet:0", [3, 4, 5, 6], [1, 1, 1, 1]),  # null loss_mask => all ones
        ("p/q/tokenized.parquet:1", [10, 11, 12], [1, 0, 1]),
    ]:
        assert by_id[sid].input_ids.tolist() == ids
        assert by_id[sid].loss_mask.tolist() == mask


def test_conversation_masks_cover_only_assistant_turns(runs: list[Path], encoder: SampleEncoder) -> None:
    by_id = {s.sample_id: s for s in samples_of(runs[0])}
    tok = encoder.tokenizer
    cases = {
        "sg-explicit": "Paris.<|eot_id|>",
        "a/sharegpt.jsonl:3": "Hello there!<|eot_id|>",
        "42": "Yes.<|eot_id|>Quite sure.<|eot_id|>",
        "a/b/openai.jsonl:1": "4.<|eot_id|>",
        "oa-parts": "Blue.<|eot_id|>",  # content parts were joined: "Sky color?" is a user turn
        "p/chat.parquet:1": "Pong<|eot_id|>",
    }
    for sid, expected in cases.items():
        sample = by_id[sid]
        assert tok.decode(sample.input_ids[sample.loss_mask.bool()]) == expected, sid
    assert "Sky color?" in tok.decode(by_id["oa-parts"].input_ids)


def test_ids_and_data_are_stable_across_runs(runs: list[Path]) -> None:
    first, second = (samples_of(out) for out in runs)
    assert [s.sample_id for s in first] == [s.sample_id for s in second]
    for a, b in zip(first, second, strict=True):
        assert a.input_ids.tolist() == b.input_ids.tolist()
        assert a.loss_mask.tolist() == b.loss_mask.tolist()
        assert torch.equal(a.hidden_states, b.hidden_states)
    ma, mb = (read_manifest(out / "index-00000") for out in runs)
    assert ma is not None and mb is not None
    assert ma.identity == mb.identity  # includes the data fingerprint


def test_single_file_ids_use_the_file_name(data_dir: Path, tmp_path: Path) -> None:
    # data.path pointing at one file: ids are "<file name>:<n>", not the path.
    for name in ("a/sharegpt.jsonl", "p/chat.parquet", "p/q/tokenized.parquet"):
        single = tmp_path / name.replace("/", "_")
        shutil.copy(data_dir / name, single)
        ids = [r.sample_id for r in read_records(list_input_files(str(single)))]
        expected = [sid.replace(name, single.name) for sid, _ in EXPECTED[name]]
        assert ids == expected


def test_listing_is_sorted_and_only_data_files(data_dir: Path) -> None:
    assert [f.name for f in list_input_files(str(data_dir))] == sorted(EXPECTED)


# --- the reader: line ends, bounds, compression, listing, fingerprint ----------------------


@pytest.mark.parametrize("chunk", [1, 2, 3, 7, 64])
def test_lines_split_on_every_line_end_across_read_chunks(
    monkeypatch: pytest.MonkeyPatch, chunk: int
) -> None:
    # Line ends falling on chunk edges (a CRLF split in two, a CR last), every style
    # mixed, a last line without an end, an over-long line: what _lines yields must not
    # depend on the read size, and the lengths must add up to the input.
    from job.data import source

    data = b"a\r\nbb\rccc\n\r\ndddd" + b"x" * 40 + b"\r\n\n" + b"e" * 5 + b"\r" + b"f"
    monkeypatch.setattr(source, "READ_CHUNK", chunk)
    got = list(source._lines(io.BytesIO(data), 20))
    assert [text for text, _ in got] == [b"a", b"bb", b"ccc", b"", None, b"", b"eeeee", b"f"]
    assert sum(length for _, length in got) == len(data)


def test_records_over_the_byte_bound_are_rejected_unread(tmp_path: Path, write_jsonl: Callable) -> None:
    data = write_jsonl(
        tmp_path / "d.jsonl", [{"id": "small", "input_ids": [1]}, {"id": "big", "input_ids": [1] * 500}]
    )
    records = list(read_records(list_input_files(str(data)), max_record_bytes=200))
    assert [(r.sample_id, r.value is not None) for r in records] == [("small", True), ("d.jsonl:2", False)]
    assert "over data.max_record_bytes (200)" in (records[1].error or "")


def test_compressed_and_upper_case_files_are_read(tmp_path: Path) -> None:
    import gzip

    import zstandard

    lines = [json.dumps({"id": f"r{i}", "input_ids": [i + 1]}).encode() for i in range(3)]
    (tmp_path / "a.jsonl.gz").write_bytes(gzip.compress(lines[0] + b"\n"))
    (tmp_path / "b.JSONL.ZST").write_bytes(zstandard.ZstdCompressor().compress(lines[1] + b"\n"))
    (tmp_path / "c.JSONL").write_bytes(lines[2])
    files = list_input_files(str(tmp_path))
    assert [f.name for f in files] == ["a.jsonl.gz", "b.JSONL.ZST", "c.JSONL"]
    records = list(read_records(files))
    assert [r.sample_id for r in records] == ["r0", "r1", "r2"]
    assert records[-1].bytes_done == sum(f.size for f in files)  # progress counts file bytes


def jsonl_bytes(count: int, words: int, prefix: str = "z") -> bytes:
    """``count`` pre-tokenized records ``<prefix>0``, ``<prefix>1``...; each carries ``words``
    random words of text (``0``: none), which keeps the compressed file long (random) or short."""
    rng = random.Random(0)
    return b"".join(
        json.dumps(
            {
                "id": f"{prefix}{i}",
                "input_ids": [1, 2, 3],
                "text": " ".join(rng.choice("abcdefgh") for _ in range(words)),
            }
        ).encode()
        + b"\n"
        for i in range(count)
    )


def zstd_frames(*parts: bytes) -> bytes:
    return b"".join(zstandard.ZstdCompressor().compress(part) for part in parts)


RANDOM_TEXT = jsonl_bytes(3000, 40)
REPETITIVE = jsonl_bytes(3000, 0)  # zstd: ~45-fold; half the file decompresses to no whole line
THIRD = len(RANDOM_TEXT) // 3


def cut(data: bytes, keep: float) -> bytes:
    return data[: int(len(data) * keep)]


# Compressed files that end early, each named for where it was cut.
CUT_FILES = {
    "half.jsonl.zst": cut(zstd_frames(RANDOM_TEXT), 0.5),
    "half-repetitive.jsonl.zst": cut(zstd_frames(REPETITIVE), 0.5),
    "last-byte-missing.jsonl.zst": zstd_frames(RANDOM_TEXT)[:-1],
    "frame-header-only.jsonl.zst": zstd_frames(RANDOM_TEXT)[:5],
    "cut-in-second-frame.jsonl.zst": zstd_frames(RANDOM_TEXT[:THIRD], RANDOM_TEXT[THIRD:])[:-100],
    "half.jsonl.gz": cut(gzip.compress(RANDOM_TEXT), 0.5),
    "half-repetitive.jsonl.gz": cut(gzip.compress(REPETITIVE), 0.5),
    "last-byte-missing.jsonl.gz": gzip.compress(RANDOM_TEXT)[:-1],
    "cut-in-second-member.jsonl.gz": (
        gzip.compress(RANDOM_TEXT[:THIRD]) + gzip.compress(RANDOM_TEXT[THIRD:])
    )[:-100],
}


@pytest.mark.parametrize("name", sorted(CUT_FILES))
def test_a_compressed_file_cut_anywhere_is_a_file_error(tmp_path: Path, name: str) -> None:
    # Read to its end, a cut-short file must not pass for a shorter one: the records before
    # the cut are the file's first ones, and the error names the file and the truncation.
    (tmp_path / name).write_bytes(CUT_FILES[name])
    seen = []
    with pytest.raises(ConfigError) as caught:
        seen.extend(r.sample_id for r in read_records(list_input_files(str(tmp_path / name))))
    assert seen == [f"z{i}" for i in range(len(seen))]
    assert len(seen) < 3000
    message = str(caught.value)
    assert f"cannot decompress {tmp_path / name}:" in message and "is truncated" in message


@pytest.mark.parametrize("suffix", [".jsonl.zst", ".jsonl.gz"])
def test_a_cut_short_compressed_file_stops_the_run_naming_it(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...], suffix: str
) -> None:
    whole = zstd_frames(RANDOM_TEXT) if suffix == ".jsonl.zst" else gzip.compress(RANDOM_TEXT)
    data = tmp_path / f"cut{suffix}"
    data.write_bytes(cut(whole, 0.5))
    result = run_job("run", f"--data.path={data}", f"--output.uri={tmp_path / 'out'}", *fast_args)
    assert result.rc == 2, result.describe()
    assert "Traceback" not in result.stderr
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    assert lines[-1].startswith("error: data: cannot decompress") and [
        x for x in lines if x.startswith("error: ")
    ] == [lines[-1]], result.stderr
    assert str(data) in lines[-1] and "is truncated" in lines[-1]
    manifest = read_manifest(tmp_path / "out" / "index-00000")
    assert manifest is None or not manifest.complete


def zstd_flushed(text: bytes, at: int) -> bytes:
    """One zstd stream whose writer ended a frame at ``at`` and went on."""
    out = io.BytesIO()
    with zstandard.ZstdCompressor().stream_writer(out, closefd=False) as writer:
        writer.write(text[:at])
        writer.flush(zstandard.FLUSH_FRAME)
        writer.write(text[at:])
    return out.getvalue()


def test_concatenated_zstd_frames_and_gzip_members_are_read_whole(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> None:
    # What zstd, pzstd, streaming writers and cat a.zst b.zst produce: frame edges inside a
    # line, an empty frame, many small frames within one read of the file, a frame ended
    # mid-stream; and gzip's equivalent, members one after another.
    writers: dict[str, Callable[[bytes], bytes]] = {
        "a-two-frames.jsonl.zst": lambda t: zstd_frames(t[: THIRD + 5], t[THIRD + 5 :]),
        "b-empty-frame.jsonl.zst": lambda t: zstd_frames(t[:THIRD], b"", t[THIRD:]),
        "c-small-frames.jsonl.zst": lambda t: zstd_frames(
            *(t[i : i + 50] for i in range(0, 5000, 50)), t[5000:]
        ),
        "d-flushed.jsonl.zst": lambda t: zstd_flushed(t, THIRD + 17),
        "e-two-members.jsonl.gz": lambda t: gzip.compress(t[: THIRD + 5]) + gzip.compress(t[THIRD + 5 :]),
    }
    for name, write in writers.items():
        content = write(jsonl_bytes(3000, 40, prefix=name[0]))
        (tmp_path / "data" / name).parent.mkdir(exist_ok=True)
        (tmp_path / "data" / name).write_bytes(content)
        records = list(read_records(list_input_files(str(tmp_path / "data" / name))))
        assert [r.sample_id for r in records] == [f"{name[0]}{i}" for i in range(3000)], name
        assert all(r.error is None for r in records), name
        assert records[-1].bytes_done == len(content), name  # progress reaches the file's end
    # The job reads every record of every file.
    result = run_job(
        "plan", f"--data.path={tmp_path / 'data'}", f"--output.uri={tmp_path / 'out'}", *fast_args
    )
    assert result.rc == 0, result.describe()
    assert re.search(r"^input records +15000 ", result.stdout, re.MULTILINE), result.stdout
    assert re.search(r"^rejected +0$", result.stdout, re.MULTILINE), result.stdout


def test_listing_names_what_it_skips(tmp_path: Path) -> None:
    for name in (
        "keep.jsonl",
        ".hidden.jsonl",
        "a.json",
        "b.txt",
        "c.jsonl.bz2",
        "sub/.git/x.jsonl",
        "sub/d.parquet",
    ):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_bytes(b"")
    (tmp_path / "out" / "index-00003").mkdir(parents=True)
    (tmp_path / "out" / "index-00003" / ".lock").write_bytes(b"")  # a run still writing there
    (tmp_path / "out" / "index-00003" / "logs.jsonl").write_bytes(b"")
    (tmp_path / "linked").symlink_to(tmp_path / "sub")
    listing = scan_input(str(tmp_path))
    assert [f.name for f in listing.files] == ["keep.jsonl", "sub/d.parquet"]
    skipped = {s.name: s.reason for s in listing.skipped}
    assert sorted(skipped) == [
        ".hidden.jsonl",
        "a.json",
        "b.txt",
        "c.jsonl.bz2",
        "linked/",
        "out/index-00003/",
        "sub/.git/",
    ]
    assert "not followed" in skipped["linked/"] and "output directory" in skipped["out/index-00003/"]
    assert "only .jsonl.gz and .jsonl.zst" in skipped["c.jsonl.bz2"]


def test_the_fingerprint_sees_a_same_size_edit(tmp_path: Path) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text('{"id": "a", "input_ids": [1]}\n')
    before = data_fingerprint(list_input_files(str(data)))
    assert data_fingerprint(list_input_files(str(data))) == before  # stable
    data.write_text('{"id": "a", "input_ids": [2]}\n')
    assert data_fingerprint(list_input_files(str(data))) != before


@pytest.mark.parametrize(
    ("rid", "expected"),
    [
        (2**70, None),  # orjson alone would read 1.1805916207174113e+21
        (-(2**63) - 1, None),
        (2**64 - 1, None),
        (1.5, "'id' must be a string or an integer, got float"),
    ],
    ids=["2**70", "-2**63-1", "2**64-1", "1.5"],
)
def test_integer_ids_of_any_size_are_their_exact_digits(
    tmp_path: Path, write_jsonl: Callable, rid: int | float, expected: str | None
) -> None:
    data = write_jsonl(tmp_path / "d.jsonl", [{"id": rid, "input_ids": [1, 2]}])
    [record] = read_records(list_input_files(str(data)))
    if expected is None:
        assert (record.sample_id, record.error) == (str(rid), None)
    else:
        assert record.sample_id == "d.jsonl:1" and record.value is None
        assert record.error is not None and record.error.startswith(expected), record.error


def test_a_run_writes_an_id_beyond_64_bits_as_its_digits(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...], write_jsonl: Callable
) -> None:
    records = [
        {"id": "before", "input_ids": [1, 2]},
        {"id": 2**70, "input_ids": [3]},
        {"id": 7, "input_ids": [4]},
    ]
    data = write_jsonl(tmp_path / "ids.jsonl", records)
    out = tmp_path / "out"
    result = run_job("run", f"--data.path={data}", f"--output.uri={out}", *fast_args)
    assert result.rc == 0, result.describe()
    assert [s.sample_id for s in samples_of(out)] == ["before", "1180591620717411303424", "7"]
    manifest = read_manifest(out / "index-00000")
    assert manifest is not None and manifest.counts.rejected == 0


# --- tool-calling records in the chat-template shape ---------------------------------------

WEATHER_FUNCTION = {
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
}


def test_sharegpt_tool_turns_become_openai_tool_calls() -> None:
    record = {
        "system": "Use tools.",
        "tools": json.dumps([WEATHER_FUNCTION]),
        "conversations": [
            {"from": "human", "value": "Weather in Oslo and Rome?"},
            {
                "from": "function_call",
                "value": '[{"name": "get_weather", "arguments": {"city": "Oslo"}}, '
                '{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\"}"}]',
            },
            {"from": "observation", "value": "snow; sun"},
            {"from": "gpt", "value": "Snow in Oslo, sun in Rome."},
        ],
    }
    conv = parse_record(record, "auto")
    assert isinstance(conv, Conversation)
    assert conv.tools == [{"type": "function", "function": WEATHER_FUNCTION}]
    assert conv.messages == [
        {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "Weather in Oslo and Rome?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}},
                {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Rome"}}},
            ],
        },
        {"role": "tool", "content": "snow; sun"},
        {"role": "assistant", "content": "Snow in Oslo, sun in Rome."},
    ]


def test_openai_tool_messages_keep_what_templates_read() -> None:
    record = {
        "tools": [{"type": "function", "function": WEATHER_FUNCTION}],
        "messages": [
            {"role": "user", "content": "Oslo?"},
            {
                "role": "assistant",
                "content": None,
                "reasoning": "look it up",  # vLLM's newer name for reasoning_content
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "name": "get_weather", "content": {"sky": "snow"}},
            {"role": "function", "name": "get_weather", "content": "legacy result"},
            {"role": "ipython", "content": "Llama 3.1's result"},
            {"role": "assistant", "content": [{"type": "text", "text": "Snow."}]},
        ],
    }
    conv = parse_record(record, "openai")
    assert isinstance(conv, Conversation)
    assert conv.messages[1] == {
        "role": "assistant",
        "content": "",
        "reasoning_content": "look it up",
        "tool_calls": [
            {
                "type": "function",
                "function": {"name": "get_weather", "arguments": {"city": "Oslo"}},
                "id": "c1",
            }
        ],
    }
    assert conv.messages[2] == {
        "role": "tool",
        "content": '{"sky":"snow"}',
        "tool_call_id": "c1",
        "name": "get_weather",
    }
    assert conv.messages[3] == {"role": "tool", "content": "legacy result", "name": "get_weather"}
    assert conv.messages[4] == {"role": "tool", "content": "Llama 3.1's result"}
    assert conv.messages[5] == {"role": "assistant", "content": "Snow."}


@pytest.mark.parametrize("field", ["messages", "conversations"])
def test_turns_given_as_json_text_are_read_as_the_list(field: str) -> None:
    """A string column of JSON, as a CSV or Parquet export of nested data holds the turns."""
    record = (
        {"messages": OPENAI[0]["messages"]}
        if field == "messages"
        else {"conversations": SHAREGPT[0]["conversations"]}
    )
    as_text = {field: json.dumps(record[field])}
    assert parse_record(as_text, "auto") == parse_record(record, "auto")
    with pytest.raises(
        SampleRejected, match=f"'{field}' \\(a string: read as the JSON of the list of turns\\): not valid"
    ):
        parse_record({field: "[{"}, "auto")


def test_integers_beyond_64_bits_reach_the_prompt_as_written(
    tmp_path: Path, write_jsonl: Callable, encoder: SampleEncoder
) -> None:
    """orjson alone reads such an integer as a float: the prompt would say 1.2345678901234568e+29."""
    order, total = 123456789012345678901234567890, 2**70

    def call(arguments: Any) -> dict[str, Any]:
        return {"type": "function", "function": {"name": "get_order", "arguments": arguments}}

    tool = {
        "name": "get_order",
        "parameters": {"type": "object", "properties": {"id": {"type": "integer", "maximum": 2**64}}},
    }
    record = {
        "id": "big-ints",
        "tools": [{"type": "function", "function": tool}],
        "messages": [
            {"role": "user", "content": "Where is my order?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [call({"id": order})],
            },
            {"role": "tool", "content": {"total": total}},  # a result that is not text: its JSON
            {
                "role": "assistant",
                "tool_calls": [call(json.dumps({"id": -order}))],  # arguments as JSON text
            },
            {"role": "tool", "content": "shipped"},
            {"role": "assistant", "content": "It has shipped."},
        ],
    }
    data = write_jsonl(tmp_path / "d.jsonl", [record])
    [read] = read_records(list_input_files(str(data)))
    assert read.value == record
    sample = encoder.encode(read.sample_id, read.value, None)
    assert isinstance(sample, EncodedSample)
    text = encoder.tokenizer.decode(sample.input_ids.tolist())
    for digits in (str(order), str(-order), str(total), str(2**64)):
        assert digits in text, digits
    assert "e+" not in text


def test_parquet_struct_columns_do_not_lend_a_row_the_other_rows_fields(
    tmp_path: Path, encoder: SampleEncoder
) -> None:
    """Arrow gives every row of a struct column every field any row has (nulls where it had none),
    as a Parquet export of agentic data does: each row's tools and calls must read back as written."""

    def row(sid: str, name: str, argument: str, kind: str, value: Any) -> dict[str, Any]:
        call = {"type": "function", "function": {"name": name, "arguments": {argument: value}}}
        properties = {argument: {"type": kind}}
        tool = {
            "name": name,
            "parameters": {"type": "object", "properties": properties, "required": [argument]},
        }
        return {
            "id": sid,
            "tools": [{"type": "function", "function": tool}],
            "messages": [
                {"role": "user", "content": f"Use {name}."},
                {"role": "assistant", "content": "", "tool_calls": [call]},
                {"role": "tool", "content": "done"},
                {"role": "assistant", "content": "Done."},
            ],
        }

    rows = [
        row("weather", "get_weather", "city", "string", "Oslo"),
        row("order", "get_order", "order_id", "integer", 5),
    ]
    table = pa.Table.from_pylist(rows)
    assert table.to_pylist()[0]["tools"][0]["function"]["parameters"]["properties"]["order_id"] is None
    pq.write_table(table, tmp_path / "tools.parquet")
    read = read_records(list_input_files(str(tmp_path / "tools.parquet")))
    assert [r.value for r in read] == rows
    sample = encoder.encode("weather", rows[0], None)
    assert isinstance(sample, EncodedSample)
    assert "order_id" not in encoder.tokenizer.decode(sample.input_ids.tolist())


@pytest.mark.parametrize(
    ("record", "fmt", "phrase"),
    [
        (
            {"messages": [{"role": "user", "content": "q"}]},
            "sharegpt",
            "this record is openai; use data.format: auto",
        ),
        ({"conversations": []}, "openai", "this record is sharegpt"),
        ({"messages": []}, "tokenized", "this record is openai"),
        (
            {"input_ids": [1, 2**70]},
            "tokenized",
            "input_ids[1] = 1180591620717411303424 is beyond 64-bit integers",
        ),
        (
            {"tools": {"name": "x"}, "messages": [{"role": "user", "content": "q"}]},
            "openai",
            "'tools' must be a list",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]}]},
            "openai",
            "only 'function' tool calls",
        ),
        (
            {"messages": [{"role": "assistant", "tool_calls": []}]},
            "openai",
            "must be a non-empty list of tool calls",
        ),
        ({"conversations": [{"from": "function_call", "value": "{oops"}]}, "sharegpt", "not valid JSON"),
        (
            {"tools": "get_weather", "messages": [{"role": "user", "content": "q"}]},
            "openai",
            "'tools' (a string: read as the JSON of a list of tool definitions): not valid JSON",
        ),
        # Two formats' fields: auto would read one and ignore the other.
        (
            {"messages": [{"role": "user", "content": "q"}], "input_ids": [1, 2]},
            "auto",
            "holds both 'messages' (openai) and 'input_ids' (tokenized): data.format auto cannot tell",
        ),
        (
            {"conversations": [], "messages": []},
            "auto",
            "holds both 'conversations' (sharegpt) and 'messages' (openai)",
        ),
    ],
)
def test_records_that_do_not_fit_name_the_field(record: dict[str, Any], fmt: str, phrase: str) -> None:
    with pytest.raises(SampleRejected) as caught:
        parse_record(record, fmt)
    assert phrase in str(caught.value)
