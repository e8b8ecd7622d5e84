"""Sampling for regenerated turns: the settings over the model's ``generation_config.json``.

Every value a run samples with is resolved once here and recorded (manifest, sidecar), so a
rerun samples the same way; each request's seed derives from ``generate.seed``, the sample id
and the turn, so the same sample regenerates the same tokens whatever else it is batched
with (vLLM's per-request seeds; the HF backend seeds torch before each request).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from job.errors import ConfigError
from job.settings import GenerateSettings

# What a field falls back to when neither the settings nor generation_config.json set it
# (vLLM's own SamplingParams defaults, and a length that suits chat answers).
_FALLBACK = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "max_new_tokens": 2048}


@dataclass(frozen=True)
class Sampling:
    temperature: float  # 0: greedy
    top_p: float
    top_k: int  # 0: no top-k
    max_new_tokens: int
    seed: int  # the run's; a request's own comes from request_seed
    eos_token_ids: tuple[int, ...]  # any of them ends a turn
    sources: dict[str, str]  # field -> "settings" | "generation_config.json" | "default"

    def request_seed(self, sample_id: str, turn: int) -> int:
        digest = hashlib.blake2b(f"{self.seed}\0{sample_id}\0{turn}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") & 0x7FFF_FFFF_FFFF_FFFF

    def record(self) -> dict[str, Any]:
        """The values that decide what is generated: recorded in the manifest's identity (a
        resume must match them) and in every sidecar line."""
        values = asdict(self)
        del values["sources"]
        values["eos_token_ids"] = list(self.eos_token_ids)  # as JSON has it, for the resume check
        return values


def resolve_sampling(settings: GenerateSettings, model_dir: Path, tokenizer_eos: int | None) -> Sampling:
    """Settings win; unset fields come from the model's generation_config.json (where
    ``do_sample: false`` means greedy, as in transformers), else vLLM's defaults."""
    config = _generation_config(model_dir)
    if config.get("do_sample") is False:
        config = {**config, "temperature": 0.0}
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for field, fallback in _FALLBACK.items():
        given = getattr(settings, field)
        if given is not None:
            values[field], sources[field] = given, "settings"
        elif config.get(field) is not None:
            values[field], sources[field] = config[field], "generation_config.json"
        else:
            values[field], sources[field] = fallback, "default"
    eos = config.get("eos_token_id")
    eos_ids = [eos] if isinstance(eos, int) else list(eos or [])
    if tokenizer_eos is not None and tokenizer_eos not in eos_ids:
        eos_ids.insert(0, tokenizer_eos)
    if not eos_ids:
        raise ConfigError(
            f"generate: {model_dir} names no end-of-sequence token (tokenizer nor generation_config.json): "
            "generated turns could never end"
        )
    return Sampling(
        temperature=float(values["temperature"]),
        top_p=float(values["top_p"]),
        top_k=int(values["top_k"]) if int(values["top_k"]) > 0 else 0,
        max_new_tokens=int(values["max_new_tokens"]),
        seed=settings.seed,
        eos_token_ids=tuple(int(e) for e in eos_ids),
        sources=sources,
    )


def _generation_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "generation_config.json"
    if not path.is_file():
        return {}
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"generate: cannot read {path}: {exc}") from None
    return value if isinstance(value, dict) else {}
