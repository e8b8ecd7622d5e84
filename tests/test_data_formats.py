"""Input formats end to end: ShareGPT, OpenAI and pre-tokenized records, in JSONL and
Parquet, as single files and as a nested directory; sample ids and their stability.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pytest
import torch

from job.data.encode import EncodedSample, EncoderSpec, SampleEncoder
from job.data.source import list_input_files, read_records
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
