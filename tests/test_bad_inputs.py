"""Real-world data and operator slips: no record, file or setting may crash a run,
corrupt its output or empty it without a word.

A bad-input corpus generated here (nothing committed as data) is run through
``python -m job run``: every case's outcome is asserted (exit code, written ids,
rejected ids with their reasons, the files skipped and named, no traceback). Cases
that stop the run get their own runs: one ``error:`` line naming the file or setting.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from job.data.source import DEFAULT_MAX_RECORD_BYTES, MAX_ID_BYTES
from job.shards import iter_output, read_manifest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def chat(sid: str, answer: str = "Fine.") -> dict[str, Any]:
    return {
        "id": sid,
        "messages": [{"role": "user", "content": "Hi?"}, {"role": "assistant", "content": answer}],
    }


def line(record: Any) -> bytes:
    """A JSONL line; ``ensure_ascii`` so a lone surrogate is written as its ``\\udc80`` escape."""
    return record if isinstance(record, bytes) else json.dumps(record).encode()


def nested(depth: int) -> bytes:
    return b'{"id": "deep", "x": ' + b"[" * depth + b"]" * depth + b"}"


TOOL_CALL = {
    "id": "tool-openai",
    "tools": [WEATHER],
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "c1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": '{"sky": "snow"}'},
        {"role": "assistant", "content": "Snow in Oslo."},
    ],
}
TOOL_SHAREGPT = {
    "id": "tool-sharegpt",
    "tools": json.dumps([WEATHER["function"]]),
    "conversations": [
        {"from": "human", "value": "Weather in Rome?"},
        {"from": "function_call", "value": '{"name": "get_weather", "arguments": {"city": "Rome"}}'},
        {"from": "observation", "value": "sunny"},
        {"from": "gpt", "value": "Sunny."},
    ],
}


def bad_call(sid: str, arguments: Any) -> dict[str, Any]:
    call = {"type": "function", "function": {"name": "get_weather", "arguments": arguments}}
    return {
        "id": sid,
        "tools": [WEATHER],
        "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "tool_calls": [call]}],
    }


# records.jsonl: (line, sample id, a phrase the rejection reason holds; None: written).
# An id of None stands for the line's own "records.jsonl:<n>".
RECORDS: list[tuple[bytes, str | None, str | None]] = [
    (line(chat("ok-first")), "ok-first", None),
    (line(TOOL_CALL), "tool-openai", None),
    (line(TOOL_SHAREGPT), "tool-sharegpt", None),
    # 1. corruption: a lone surrogate must never reach a shard header or the manifest
    (line(chat("\udc80")), None, "surrogate"),
    (
        line({**chat("surrogate-text"), "messages": [{"role": "user", "content": "a\ud800b"}]}),
        None,
        "surrogate",
    ),
    # 2. one record must not sink the run
    (line({"id": "int64-overflow", "input_ids": [1, 2**63]}), "int64-overflow", "beyond 64-bit"),
    (line({"id": "uint64-max", "input_ids": [2**64 - 1]}), "uint64-max", "beyond 64-bit"),
    (
        line({"id": "beyond-uint64", "input_ids": [2**64]}),
        "beyond-uint64",
        "input_ids[0] = 18446744073709551616 is beyond 64-bit",
    ),
    (nested(5000), None, "malformed JSON"),  # orjson's own limit: no RecursionError
    (b'{"id": "digits", "input_ids": [' + b"9" * 300 + b"]}", "digits", "beyond 64-bit"),
    # nested within orjson's limit but past Python's, with an integer only Python reads exactly
    (b"[" * 1000 + b"12345678901234567890" + b"]" * 1000, None, "malformed JSON"),
    (nested(100), None, "nested deeper than 64"),
    (b'{"id": "nan", "input_ids": [NaN]}', None, "malformed JSON"),
    # ids that cannot be a sample's name
    (line(chat("x" * (MAX_ID_BYTES + 1))), None, f"at most {MAX_ID_BYTES}"),
    (line({**chat("unused"), "id": 1.5}), None, "must be a string or an integer"),
    (line({**chat("unused"), "id": ["a"]}), None, "must be a string or an integer"),
    # tool calls that cannot be rendered
    (line(bad_call("args-not-json", "{city: Oslo")), "args-not-json", "not valid JSON"),
    (line(bad_call("args-not-object", "[1, 2]")), "args-not-object", "must be a JSON object"),
    (
        line(
            {
                "id": "null-no-calls",
                "messages": [{"role": "user", "content": "?"}, {"role": "assistant", "content": None}],
            }
        ),
        "null-no-calls",
        "must be a string, got null",
    ),
    # content parts other than text: the rejection names what was found
    (
        line(
            {
                **chat("part-null-text"),
                "messages": [{"role": "user", "content": [{"type": "text", "text": None}]}],
            }
        ),
        "part-null-text",
        "messages[0].content[0].text: a text part's 'text' must be a string, got null",
    ),
    (
        line(
            {
                **chat("part-image"),
                "messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x.png"}}]},
                    {"role": "assistant", "content": "A cat."},
                ],
            }
        ),
        "part-image",
        "messages[0].content[0]: a part of type 'image_url'; only text parts",
    ),
    (
        line({**chat("part-string"), "messages": [{"role": "user", "content": ["Hi?"]}]}),
        "part-string",
        "messages[0].content[0]: a content part must be an object like {'type': 'text', 'text': ...}, got",
    ),
    (line(chat("spark-twin", "Hello.")), "spark-twin", None),  # spark.parquet's row 0 as JSON
    (line(chat("ok-last")), "ok-last", None),  # the run went on
]
MAX_RECORD = DEFAULT_MAX_RECORD_BYTES


def giant_line() -> bytes:
    text = b"x" * (MAX_RECORD + 1)
    return b'{"id": "giant", "messages": [{"role": "user", "content": "' + text + b'"}]}'


def parquet_with_invalid_utf8(path: Path) -> None:
    """Two rows; the second row's id is not UTF-8 (writers that do not validate exist)."""
    offsets = pa.py_buffer(bytes([0, 0, 0, 0, 5, 0, 0, 0, 9, 0, 0, 0]))
    ids = pa.Array.from_buffers(pa.string(), 2, [None, offsets, pa.py_buffer(b"pq-okbad\xff")])
    pq.write_table(pa.table({"id": ids, "input_ids": pa.array([[1, 2], [3]])}), path)


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("bad-inputs") / "data"
    root.mkdir()
    (root / "records.jsonl").write_bytes(b"\n".join(r for r, _, _ in RECORDS) + b"\n")
    # line endings: CR only, and CRLF after a byte order mark, upper-case suffix
    (root / "cr-only.jsonl").write_bytes(line(chat("cr-1")) + b"\r" + line(chat("cr-2")) + b"\r")
    (root / "crlf-bom.JSONL").write_bytes(
        b"\xef\xbb\xbf" + line(chat("bom-1")) + b"\r\n" + line(chat("bom-2"))
    )
    (root / "c" / "gz.jsonl.gz").parent.mkdir()
    (root / "c" / "gz.jsonl.gz").write_bytes(gzip.compress(line(chat("gz-1")) + b"\n"))
    (root / "c" / "zst.jsonl.zst").write_bytes(
        zstandard.ZstdCompressor().compress(line(chat("zst-1")) + b"\n")
    )
    (root / "huge.jsonl").write_bytes(
        line(chat("huge-before")) + b"\n" + giant_line() + b"\n" + line(chat("huge-after"))
    )
    # a writer that left a line break raw inside a string: one rejection, under the record's id
    (root / "multiline.jsonl").write_bytes(
        line(chat("multi-before"))
        + b"\n"
        + b'{"id": "multi", "messages": [{"role": "user", "content": "one\ntwo\r\n\nthree"}]}\n'
        + line(chat("multi-after"))
        + b"\n"
    )
    # Spark's list<map<string,string>> messages, read as objects; a map holding a key twice is no object
    spark = pa.list_(pa.map_(pa.string(), pa.string()))
    turns = [[("role", "user"), ("content", "Hi?")], [("role", "assistant"), ("content", "Hello.")]]
    twice = [[("role", "user"), ("role", "assistant"), ("content", "Hi?")]]
    messages = pa.array([turns, twice], type=spark)
    pq.write_table(pa.table({"id": ["spark-1", "spark-2"], "messages": messages}), root / "spark.parquet")
    # ids colliding with the id generated for a record without one (<file>:<line>, <file>:<row>)
    (root / "z-ids.jsonl").write_bytes(
        line(chat("z-ids.jsonl:2"))  # explicit, equal to the next line's generated id
        + b"\n"
        + line({"messages": chat("-")["messages"]})
        + b"\n"
        + line(chat("u64.parquet:1"))  # explicit, equal to the id of u64.parquet's row 1, read earlier
        + b"\n"
    )
    # a link that leads back to itself: skipped, named as a loop
    (root / "loop.jsonl").symlink_to("loop.jsonl")
    uint64 = pa.array([[1, 2**64 - 1], [5, 6]], type=pa.list_(pa.uint64()))
    pq.write_table(pa.table({"input_ids": uint64}), root / "u64.parquet")
    parquet_with_invalid_utf8(root / "utf8.parquet")
    # never read, each named in input_files_skipped
    (root / ".hidden.jsonl").write_bytes(line(chat("hidden")))
    (root / ".cache").mkdir()
    (root / ".cache" / "x.jsonl").write_bytes(line(chat("cached")))
    (root / "array.json").write_text("[]")
    (root / "notes.txt").write_text("not data")
    (root / "old.jsonl.bz2").write_bytes(b"BZh")
    previous = root / "out" / "index-00000"  # an earlier run's output inside the data dir
    previous.mkdir(parents=True)
    (previous / "manifest.json").write_text("{}")
    (previous / "rejected.jsonl").write_text(json.dumps({"sample_id": "x", "reason": "y"}) + "\n")
    return {"root": root}


@pytest.fixture(scope="module")
def run(
    corpus: dict[str, Any],
    tmp_path_factory: pytest.TempPathFactory,
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    tiny_llama_dir: Path,
) -> dict[str, Any]:
    out = tmp_path_factory.mktemp("bad-inputs-out") / "out"
    # Mostly bad on purpose: accept any rejection rate (the default 0.5 is tested below).
    result = run_job(
        "run",
        f"--data.path={corpus['root']}",
        f"--output.uri={out}",
        "--data.max_rejected_fraction=1",
        *fast_args,
    )
    return {"result": result, "out": out, "index": out / "index-00000"}


def record_id(sid: str | None, n: int) -> str:
    return sid if sid is not None else f"records.jsonl:{n}"


# Written, in input order: files sorted by path, records in file order.
WRITTEN = [
    "gz-1",
    "zst-1",
    "cr-1",
    "cr-2",
    "bom-1",
    "bom-2",
    "huge-before",
    "huge-after",
    "multi-before",
    "multi-after",
    *(record_id(sid, n) for n, (_, sid, reason) in enumerate(RECORDS, 1) if reason is None),
    "spark-1",
    "u64.parquet:1",
    "pq-ok",
    "z-ids.jsonl:2",
]
REJECTED = [
    ("huge.jsonl:2", "over data.max_record_bytes"),
    ("multi", "a line break inside a JSON string: this record runs over lines 2-5 of multiline.jsonl"),
    *((record_id(sid, n), reason) for n, (_, sid, reason) in enumerate(RECORDS, 1) if reason is not None),
    ("spark.parquet:1", "row cannot be read: a map holds a key twice, so it is no object"),
    ("u64.parquet:0", "beyond 64-bit"),
    ("utf8.parquet:1", "row cannot be read"),
    # the first of two records keeps an id; the second one is rejected, naming the collision
    (
        "z-ids.jsonl:2",
        "this record has no 'id', and the id generated from its place, 'z-ids.jsonl:2', collides",
    ),
    (
        "u64.parquet:1",
        "this record's 'id' 'u64.parquet:1' collides with the id generated for an earlier record",
    ),
]
SKIPPED = [
    ".cache/",
    ".hidden.jsonl",
    "array.json",
    "loop.jsonl",
    "notes.txt",
    "old.jsonl.bz2",
    "out/index-00000/",
]


def test_the_run_completes_without_a_traceback(run: dict[str, Any]) -> None:
    result = run["result"]
    assert result.rc == 0, result.describe()
    assert "Traceback" not in result.stderr and "error:" not in result.stderr
    assert result.event("run_finished")["status"] == "complete"


def test_good_records_are_written(run: dict[str, Any]) -> None:
    assert [s.sample_id for s in iter_output(run["out"], require_complete=True)] == WRITTEN


def test_bad_records_are_rejected_with_reasons(run: dict[str, Any], read_jsonl: Callable) -> None:
    entries = read_jsonl(run["index"] / "rejected.jsonl")
    assert [e["sample_id"] for e in entries] == [sid for sid, _ in REJECTED]
    for entry, (sid, phrase) in zip(entries, REJECTED, strict=True):
        assert phrase in entry["reason"], (sid, entry["reason"])
    manifest = read_manifest(run["index"])
    assert manifest is not None and manifest.complete
    assert (manifest.counts.written, manifest.counts.rejected) == (len(WRITTEN), len(REJECTED))


def test_no_invalid_unicode_reaches_the_output(run: dict[str, Any]) -> None:
    # Every file the run wrote is valid UTF-8 JSON where it is JSON (the manifest, the
    # shard headers: iter_output parsed them above), and the rejected lone-surrogate id
    # appears nowhere, not even escaped.
    for path in run["index"].rglob("*"):
        if path.suffix in (".json", ".jsonl"):
            text = path.read_bytes().decode("utf-8")
            assert "\\udc80" not in text and "\\ud800" not in text, path


def test_skipped_files_are_named(run: dict[str, Any]) -> None:
    event = run["result"].event("input_files_skipped")
    assert [s["name"] for s in event["skipped"]] == SKIPPED
    assert event["count"] == len(SKIPPED)
    reasons = {s["name"]: s["reason"] for s in event["skipped"]}
    assert "output directory" in reasons["out/index-00000/"]
    assert "hidden" in reasons[".hidden.jsonl"] and "hidden" in reasons[".cache/"]
    assert ".jsonl" in reasons["array.json"]
    assert "symbolic link loop" in reasons["loop.jsonl"]


def test_a_spark_map_column_reads_as_the_object_it_is(run: dict[str, Any]) -> None:
    """spark.parquet's row 0 holds the conversation of the JSONL record spark-twin as maps."""
    samples = {s.sample_id: s for s in iter_output(run["out"]) if s.sample_id in ("spark-1", "spark-twin")}
    spark, twin = samples["spark-1"], samples["spark-twin"]
    assert spark.input_ids.tolist() == twin.input_ids.tolist()
    assert spark.loss_mask.tolist() == twin.loss_mask.tolist() and spark.loss_mask.sum() > 0


# --- problems that stop the run ---------------------------------------------------------------


def cut_gzip() -> bytes:
    """A .jsonl.gz that ends halfway (an interrupted copy)."""
    whole = gzip.compress(b"".join(line(chat(f"g-{i}")) + b"\n" for i in range(200)))
    return whole[: len(whole) // 2]


def error_line(result: Any) -> str:
    """The run's one ``error:`` line, its last on stderr (model loading may print before it)."""
    assert result.rc == 2, result.describe()
    assert "Traceback" not in result.stderr
    lines = [x for x in result.stderr.splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert errors == [lines[-1]], result.stderr
    return errors[0]


@pytest.mark.parametrize(
    ("name", "content", "phrase"),
    [
        ("array.jsonl", b'[\n  {"id": "a", "input_ids": [1]}\n]\n', "is a JSON array, not JSON Lines"),
        ("one-line-array.jsonl", b'[{"id": "a", "input_ids": [1]}]\n', "is a JSON array, not JSON Lines"),
        ("pretty.jsonl", b'{\n  "id": "a",\n  "input_ids": [1]\n}\n', "pretty-printed JSON"),
        ("cut.jsonl.gz", cut_gzip(), "cannot decompress"),
        # UTF-16/32 text (Windows tools write it): one error naming the encoding, not a rejection per line
        (
            "utf16.jsonl",
            (line(chat("a")) + b"\n" + line(chat("b")) + b"\n").decode().encode("utf-16"),
            "is UTF-16-LE text (byte order mark FF FE), not UTF-8",
        ),
        (
            "utf16be.jsonl.gz",
            gzip.compress((line(chat("a")) + b"\n").decode().encode("utf-16-be")),
            "is UTF-16-BE text (no byte order mark; NUL bytes between its characters)",
        ),
        ("utf32.jsonl", (line(chat("a")) + b"\n").decode().encode("utf-32"), "is UTF-32-LE text"),
    ],
)
def test_a_file_that_is_not_json_lines_stops_the_run_naming_it(
    tmp_path: Path,
    run_job: Callable[..., Any],
    fast_args: tuple[str, ...],
    name: str,
    content: bytes,
    phrase: str,
) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / name).write_bytes(content)
    message = error_line(run_job("run", f"--data.path={data}", f"--output.uri={tmp_path / 'o'}", *fast_args))
    assert phrase in message and name in message
    manifest = read_manifest(tmp_path / "o" / "index-00000")
    assert manifest is None or not manifest.complete


def test_a_run_that_rejects_most_samples_does_not_complete(
    corpus: dict[str, Any], tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...]
) -> None:
    """The same corpus under the default data.max_rejected_fraction (0.5): exit 2, a summary of
    the reasons, rejected.jsonl published, the index left incomplete (a fixed rerun goes on)."""
    out = tmp_path / "out"
    result = run_job("run", f"--data.path={corpus['root']}", f"--output.uri={out}", *fast_args)
    assert result.rc == 2, result.describe()
    message = error_line(result)
    assert re.search(r"\d+ of the \d+ samples of index 0 were rejected", message), message
    assert "data.max_rejected_fraction 0.5" in message and "most common reasons" in message
    assert "rejected.jsonl" in message and "Traceback" not in result.stderr
    manifest = json.loads((out / "index-00000" / "manifest.json").read_text())
    assert not manifest["complete"] and manifest["counts"]["rejected"] == len(REJECTED)
    assert len((out / "index-00000" / "rejected.jsonl").read_text().splitlines()) == len(REJECTED)


@pytest.mark.parametrize("value", ["", "   "])
def test_an_empty_data_path_is_an_error(tmp_path: Path, run_job: Callable[..., Any], value: str) -> None:
    message = error_line(run_job("run", f"--data.path={value}", f"--output.uri={tmp_path / 'o'}"))
    assert "data.path: empty" in message
    assert not (tmp_path / "o").exists()


def test_a_symbolic_link_loop_as_data_path_is_named(tmp_path: Path, run_job: Callable[..., Any]) -> None:
    data = tmp_path / "data.jsonl"
    data.symlink_to(tmp_path / "data.jsonl")
    message = error_line(run_job("run", f"--data.path={data}", f"--output.uri={tmp_path / 'o'}"))
    assert f"data.path: {data} is a symbolic link loop" in message and "does not exist" not in message
    (tmp_path / "link.jsonl").symlink_to(tmp_path / "gone.jsonl")
    message = error_line(
        run_job("run", f"--data.path={tmp_path / 'link.jsonl'}", f"--output.uri={tmp_path / 'o'}")
    )
    assert f"is a broken symbolic link (to {tmp_path / 'gone.jsonl'}, which does not exist)" in message


@pytest.mark.parametrize("content", ["", "\n  \n"], ids=["empty", "blank"])
def test_an_empty_chat_template_file_is_named(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...], content: str
) -> None:
    template = tmp_path / "template.jinja"
    template.write_text(content)
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat("a")) + "\n")
    result = run_job(
        "run",
        f"--data.path={data}",
        f"--output.uri={tmp_path / 'o'}",
        f"--data.chat_template={template}",
        *fast_args,
    )
    message = error_line(result)
    assert f"data.chat_template: {template} is empty" in message and "tokenizer" not in message.split(";")[0]


def test_a_directory_of_unread_files_names_them(tmp_path: Path, run_job: Callable[..., Any]) -> None:
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.json").write_text("[]")
    (data / ".train.jsonl").write_text("{}")
    message = error_line(run_job("run", f"--data.path={data}", f"--output.uri={tmp_path / 'o'}"))
    assert "no .jsonl" in message and "train.json: a .json file is not read" in message
    assert ".train.jsonl: hidden file" in message


def test_a_same_size_edit_is_not_resumed_over(
    tmp_path: Path, run_job: Callable[..., Any], fast_args: tuple[str, ...], tiny_llama_dir: Path
) -> None:
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(chat("a", "Yes.")) + "\n")
    out = tmp_path / "o"
    first = run_job("run", f"--data.path={data}", f"--output.uri={out}", *fast_args)
    assert first.rc == 0, first.describe()
    data.write_text(json.dumps(chat("a", "Nope")) + "\n")  # same size, other content
    message = error_line(run_job("run", f"--data.path={data}", f"--output.uri={out}", *fast_args))
    assert "data_fingerprint" in message and "use a new output.uri" in message
