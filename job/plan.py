"""``python -m job plan``: what this index will produce, before any model runs."""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any

import numpy as np

from job.data.encode import EncodedSample, GenerationStart, RejectedSample, SampleEncoder
from job.data.source import read_records
from job.data.stream import EncodedStream
from job.logs import get_logger
from job.pipeline.feed import ShardPlanner
from job.pipeline.setup import RunSetup, prepare_run, warn_ignored_settings
from job.settings import JobSettings

# Measured on one H200, vLLM 0.26, Llama-3.1-8B shape (LLAMA_3_1_8B below), shards to local disk
# (docs/benchmarks.md, run 20261129T124456Z): the basis of the rough wall-time estimate.
MEASURED_TOK_PER_S = 39_773
# The job's generation rate, same machine and shape (docs/benchmarks.md, regenerate_generation,
# run 20261201T152220Z): 200 prompts, max_new_tokens 512, temperature 0.7, max_num_seqs 128.
# Decoding is bound by weight reads per step, so the rate also follows the number of sequences
# decoded together: an estimate for the default max_num_seqs.
MEASURED_GENERATED_TOK_PER_S = 8_244
# Plain prefill at TP=2 over 2 x TP=1, same shape (runs 20261129T130311Z and 20261129T124456Z).
TP2_SCALING_EFFICIENCY = 0.85
# Scaling by parameters assumes prefill is compute-bound; small models are bound by per-step
# overheads instead (it would put the builtin tiny model at ~235M tok/s), so the measured rate is
# never scaled up by more than this.
MAX_SCALE_UP = 4.0
# The shape the rates above were measured on (`python -m job bench --model llama-3.1-8b` builds it
# with dummy weights): estimates scale from its parameters per token.
LLAMA_3_1_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 128256,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "hidden_act": "silu",
    "attention_bias": False,
    "mlp_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
    "torch_dtype": "bfloat16",
}


def active_params(config: dict) -> float:
    """Parameters every prompt token passes through: the cost of prefill. Embedding lookups
    and the LM head (prefill computes logits for the last token only) are left out."""
    text = config.get("text_config") or config
    hidden, layers = text["hidden_size"], text["num_hidden_layers"]
    heads = text.get("num_attention_heads", 1)
    head_dim = text.get("head_dim") or hidden // heads
    kv = text.get("num_key_value_heads", heads)
    attention = hidden * head_dim * (2 * heads + 2 * kv)
    if text.get("n_routed_experts"):
        per_token_experts = text.get("num_experts_per_tok", 1) + text.get("n_shared_experts", 0)
        mlp = 3 * hidden * text.get("moe_intermediate_size", text["intermediate_size"]) * per_token_experts
    else:
        mlp = 3 * hidden * text["intermediate_size"]
    return float(layers * (attention + mlp))


def _duration(seconds: float) -> str:
    hours, rest = divmod(int(seconds), 3600)
    return f"{hours} h {rest // 60:02d} min" if hours else f"{rest // 60} min {rest % 60:02d} s"


def _human(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if nbytes < 1024 or unit == "TiB":
            return f"{nbytes:.1f} {unit}" if unit != "B" else f"{int(nbytes)} B"
        nbytes /= 1024
    raise AssertionError


def plan_index(settings: JobSettings) -> str:
    setup = prepare_run(settings)
    warn_ignored_settings(get_logger(component="settings"), settings)
    stream = EncodedStream(
        read_records(setup.files, int(settings.data.max_record_bytes)),
        setup.encoder,
        index=settings.work.index,
        count=settings.work.count,
        done_ids=set(),
        workers=settings.data.tokenizer_workers,
        prefetch=settings.data.prefetch_samples,
    )
    planner = ShardPlanner(int(settings.output.shard_bytes), setup.bytes_per_token, 0)
    generation = _GenerationGuess(setup) if setup.sampling is not None else None
    samples = tokens = truncated = rejected = shards = 0
    warnings: Counter[str] = Counter()
    try:
        for item in stream:
            if isinstance(item, GenerationStart):
                assert generation is not None
                item = generation.add(item)
            if not isinstance(item, EncodedSample):
                rejected += 1
                continue
            samples += 1
            tokens += item.num_tokens
            truncated += item.truncated
            if item.warning is not None:
                warnings[item.warning] += 1
            shards += sum(1 for _ in planner.add(item))
        shards += sum(1 for _ in planner.flush())
    finally:
        stream.close()
    model = setup.model
    rows = [
        ("work index", f"{settings.work.index} of {settings.work.count}"),
        (
            "model",
            f"{model.name} ({model.architecture}, {model.num_layers} layers, hidden {model.hidden_size})",
        ),
        ("layer ids", str(setup.layer_ids)),
        ("input files", _files_row(setup)),
        ("input records", f"{stream.stats.records_seen} ({stream.stats.owned} owned by this index)"),
        ("samples", f"{samples} ({truncated} truncated to {settings.data.max_length} tokens)"),
        ("rejected", str(rejected)),
        ("tokens", str(tokens)),
        (
            "bytes per token",
            f"{setup.bytes_per_token} ({len(setup.layer_ids)} layers x {model.hidden_size} x "
            f"{setup.dtype.name} + ids and mask)",
        ),
        ("output bytes", _human(tokens * setup.bytes_per_token)),
        ("shards", f"{shards} of about {_human(int(settings.output.shard_bytes))}"),
        ("estimated time", _estimate(tokens, model.config, settings.backend.tensor_parallel_size)),
    ]
    if warnings:
        rows.insert(7, ("written with a warning", "; ".join(f"{n} x {w}" for w, n in warnings.most_common())))
    if generation is not None:
        rows[5:5] = generation.rows()
        tp = settings.backend.tensor_parallel_size
        rows.append(("generation time", _estimate(generation.guessed, model.config, tp, generated=True)))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


class _GenerationGuess:
    """What regeneration will generate, guessed before any model runs: each turn as long as the
    data's own answer (capped at generate.max_new_tokens), a turn appended after a final user
    turn or in place of an empty answer at max_new_tokens, and all of a conversation's turns
    within what data.max_length leaves after its first prompt; the sample is then the data's
    conversation so encoded."""

    def __init__(self, setup: RunSetup) -> None:
        assert setup.sampling is not None
        self.encoder = SampleEncoder(replace(setup.encoder, generate_mode="keep"))
        self.max_new_tokens = setup.sampling.max_new_tokens
        self.max_length = setup.settings.data.max_length
        self.conversations = self.turns = self.guessed = self.most = 0

    def add(self, start: GenerationStart) -> EncodedSample | RejectedSample:
        messages = start.conversation.messages
        turns = [min(self._answer_tokens(messages, t), self.max_new_tokens) for t in start.targets]
        room = self.max_length - len(start.prompt_ids)  # the turns and what lies between them
        self.conversations += 1
        self.turns += len(turns)
        self.guessed += min(sum(turns), room)
        self.most += min(len(turns) * self.max_new_tokens, room)
        kept = [m for i, m in enumerate(messages) if i not in start.targets or m["role"] != "assistant"]
        context = len(
            self.encoder.tokenize(self.encoder.render(kept, start.conversation.tools, generation_prompt=True))
        )
        total = context + sum(turns)
        ids = np.zeros(min(total, self.max_length), np.int32)
        return EncodedSample(start.sample_id, ids, np.ones_like(ids, np.uint8), total > self.max_length)

    def _answer_tokens(self, messages: list[dict[str, Any]], target: int) -> int:
        if target >= len(messages):
            return self.max_new_tokens
        content = messages[target].get("content")
        if not isinstance(content, str) or not content.strip():  # no answer to go by
            return self.max_new_tokens
        return len(self.encoder.tokenize(content)) + 1

    def rows(self) -> list[tuple[str, str]]:
        return [
            ("conversations", f"{self.conversations} to regenerate ({self.turns} turns)"),
            (
                "generated tokens",
                f"about {self.guessed} (the data's answers as a guess) up to {self.most} "
                "(every turn at generate.max_new_tokens)",
            ),
        ]


def _files_row(setup: RunSetup) -> str:
    row = f"{len(setup.files)} read"
    if setup.skipped:
        names = ", ".join(f"{s.name} ({s.reason})" for s in setup.skipped[:3])
        more = f", and {len(setup.skipped) - 3} more" if len(setup.skipped) > 3 else ""
        row += f"; {len(setup.skipped)} skipped: {names}{more}"
    return row


def _estimate(tokens: int, config: dict, tensor_parallel_size: int, generated: bool = False) -> str:
    """A rough extraction (``generated``: generation) time: the measured 8B rate scaled by
    parameters per token.

    TP > 1 counts one GPU's rate times the GPU count times the efficiency measured
    at TP=2 (larger TP was not measured), and assumes the output keeps up."""
    measured = MEASURED_GENERATED_TOK_PER_S if generated else MEASURED_TOK_PER_S
    scale = active_params(LLAMA_3_1_8B) / active_params(config)
    if scale > MAX_SCALE_UP:
        return (
            f"none: {scale:,.0f}x fewer parameters per token than the measured Llama-3.1-8B, and a model "
            "this small is not compute-bound: time a short run on a slice of the data instead"
        )
    rate = measured * scale
    if tensor_parallel_size > 1:
        rate *= tensor_parallel_size * TP2_SCALING_EFFICIENCY
    return (
        f"about {_duration(tokens / rate)} at ~{rate:,.0f} tok/s (H200-class GPUs, "
        f"TP={tensor_parallel_size}; scaled from the Llama-3.1-8B measurement in docs/benchmarks.md; rough)"
    )
