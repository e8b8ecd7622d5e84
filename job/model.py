"""Resolve the target model to a local directory and read what the job needs from it.

Layer-id convention (the same for every backend, recorded in every shard):
id k is the residual stream after k decoder layers; 0 is the embedding output
and N (the number of decoder layers) is the last layer's output *before* the
final norm. This is vLLM's numbering from 0.18 (EagleModelMixin).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.errors import ConfigError
from job.pretrained import PRETRAINED_MODELS, pretrained_model_dir
from job.settings import ModelSettings
from job.tiny import BUILTIN_MODELS, BUILTIN_PREFIX, builtin_model_dir

LAYER_CONVENTION = "residual-stream-after-k-decoder-layers"
LAYER_CONVENTION_TEXT = (
    "id k = residual stream after k decoder layers; 0 = embedding output, "
    "N = last decoder layer output before the final norm"
)


@dataclass(frozen=True)
class ModelInfo:
    name: str  # what the user asked for
    path: Path  # the resolved local directory
    config: dict[str, Any]
    config_hash: str
    architecture: str
    num_layers: int
    hidden_size: int
    vocab_size: int
    dtype: str
    max_positions: int | None  # max_position_embeddings, where the config states it

    def default_layer_ids(self) -> list[int]:
        return eagle3_default_layer_ids(self.num_layers)

    def resolve_layer_ids(self, ids: list[int] | None) -> list[int]:
        if ids is None:
            return self.default_layer_ids()
        bad = [i for i in ids if not 0 <= i <= self.num_layers]
        if bad:
            raise ConfigError(
                f"layers.ids: {bad} outside [0, {self.num_layers}] for {self.name} "
                f"({self.num_layers} decoder layers; {LAYER_CONVENTION_TEXT})"
            )
        return list(ids)


def eagle3_default_layer_ids(num_layers: int) -> list[int]:
    """EAGLE-3's three auxiliary layers [2, N//2, N-3] plus the final layer N."""
    ids: list[int] = []
    for i in (2, num_layers // 2, num_layers - 3, num_layers):
        if 0 <= i <= num_layers and i not in ids:
            ids.append(i)
    return ids


def _text_config(config: dict[str, Any]) -> dict[str, Any]:
    # Multimodal wrappers (e.g. Kimi-K2.5) keep the language model's config inside.
    return config.get("text_config") or config


def resolve_model(settings: ModelSettings) -> ModelInfo:
    path = _resolve_path(settings)
    config_file = path / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ConfigError(f"model.path: cannot read {config_file}: {exc}") from None
    text = _text_config(config)
    try:
        num_layers = int(text["num_hidden_layers"])
        hidden = int(text["hidden_size"])
        vocab = int(text["vocab_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise ConfigError(f"model.path: {config_file} lacks {exc}; not a decoder LLM config") from None
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    return ModelInfo(
        name=settings.path,
        path=path,
        config=config,
        config_hash="sha256:" + hashlib.sha256(canonical).hexdigest(),
        architecture=(config.get("architectures") or [text.get("model_type", "unknown")])[0],
        num_layers=num_layers,
        hidden_size=hidden,
        vocab_size=vocab,
        dtype=settings.dtype,
        max_positions=_int_or_none(text.get("max_position_embeddings")),
    )


def _int_or_none(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _resolve_path(settings: ModelSettings) -> Path:
    name = settings.path
    if name.startswith(BUILTIN_PREFIX):
        builtin = name.removeprefix(BUILTIN_PREFIX)
        if builtin in PRETRAINED_MODELS:
            return pretrained_model_dir(builtin)
        if builtin not in BUILTIN_MODELS:
            choices = [*BUILTIN_MODELS, *PRETRAINED_MODELS]
            raise ConfigError(
                f"model.path: unknown builtin model {name!r}; "
                f"choose one of {', '.join(BUILTIN_PREFIX + n for n in choices)}"
            )
        return builtin_model_dir(builtin)
    local = Path(name).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"model.path: {local} has no config.json; point it at a model directory")
        return local.resolve()
    if name.startswith((".", "/", "~")) or name.count("/") != 1:
        raise ConfigError(f"model.path: {name!r} does not exist (neither a directory nor a hub id)")
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id=name, revision=settings.revision))
    except Exception as exc:
        raise ConfigError(
            f"model.path: {name!r} is not a local directory and could not be fetched from the hub "
            f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        ) from None
