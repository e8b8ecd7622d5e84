"""The weights' tensor names against the model's ``config.json``, before any model loads.

transformers fills every tensor a checkpoint lacks at random and ignores the names it does not
know, with a warning only: weights saved under other names (a PEFT save prefixes every name with
``base_model.model.``), with a tensor renamed or missing, or a ``config.json`` that gives another
number of decoder layers than the weights hold would load into a partly or wholly random model,
and the run would write wrong hidden states with exit 0. This check compares the names in the
safetensors headers with the architecture transformers builds from ``config.json``
(``job.architecture``), as its loader matches them, and refuses a mismatch with exit 2, naming
the tensors and what was expected.

Names need no shapes, so quantized checkpoints are checked too, module by module: a quantized
module's tensors carry the scheme's names (``weight_packed``, ``weight_scale``), so a module is
covered when the checkpoint holds any tensor of it. Allowed without a word: a tensor the model
shares with one the checkpoint holds (``lm_head.weight`` under ``tie_word_embeddings``), buffers
(``rotary_emb.inv_freq``: transformers recomputes them, vLLM skips them by name), the
multi-token-prediction layers after the last decoder layer (``num_nextn_predict_layers``), the
names transformers itself ignores, and per-expert tensors of an architecture that fuses its
experts (transformers 5 does).

Where transformers cannot build the architecture (remote code not allowed, an architecture only
vLLM has), the decoder layers the weights hold are still counted against ``num_hidden_layers``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.architecture import Architecture
from job.errors import ConfigError

_SHOWN = 3  # tensors named in one message
# Rotary caches older checkpoints hold in every layer: vLLM skips them by name, and transformers
# (which keeps one model-wide copy, not a per-layer one) ignores them.
_ROTARY_CACHES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
# Where the decoder layers are in a checkpoint of an architecture transformers cannot build: causal
# LMs, and vision-language models' language models in their older and newer layouts.
_DECODER_PATHS = ("model.layers", "language_model.model.layers", "model.language_model.layers")
_QUANTIZATION_KEYS = ("quantization_config", "compression_config")
_REMEDY = (
    "point model.path at the model these weights belong to (saved with save_pretrained), or copy or "
    "download its weights again"
)


@dataclass(frozen=True)
class NameCheck:
    """Of the checkpoint's ``tensors``: how many the architecture has by name (``by_name``) and how
    many hold one of its modules in another layout (``by_module``: quantized, per-expert); how many
    decoder layers they hold; or why the names were not compared (``skipped``: the layers may
    still have been counted)."""

    tensors: int = 0
    by_name: int = 0
    by_module: int = 0
    layers: int | None = None
    skipped: str | None = None
    seconds: float = 0.0


def quantized(config: dict[str, Any]) -> str | None:
    """The key of ``config`` (or its text_config) that makes it a quantized checkpoint, if any."""
    text = config.get("text_config") or config
    return next((key for key in _QUANTIZATION_KEYS if key in config or key in text), None)


def check_tensor_names(
    directory: Path,
    config: dict[str, Any],
    architecture: Architecture | str,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> NameCheck:
    """ConfigError (exit 2, naming model.path and the tensors) when the checkpoint's ``tensors``
    (name -> file, shape) do not fit the architecture of ``config``; ``architecture`` is why there is
    none where transformers could not build it."""
    text = config.get("text_config") or config
    num_layers, mtp_layers = int(text["num_hidden_layers"]), int(text.get("num_nextn_predict_layers") or 0)
    if isinstance(architecture, str):
        path = max(_DECODER_PATHS, key=lambda p: len(_layer_numbers(tensors, p)))
        layers = _check_layer_count(directory, tensors, path, num_layers, mtp_layers)
        return NameCheck(tensors=len(tensors), layers=layers, skipped=architecture)
    loaded = {architecture.loaded_name(name): name for name in tensors}
    layers, mtp = None, ()
    if architecture.layers is not None:
        layers = _check_layer_count(directory, loaded, architecture.layers, num_layers, mtp_layers)
        mtp = tuple(f"{architecture.layers}.{i}." for i in range(num_layers, num_layers + mtp_layers))
    ignored = _any_of(architecture.ignored_unexpected)
    unknown = [
        name
        for name in loaded
        if name not in architecture.shapes
        and name not in architecture.buffers
        and not name.endswith(_ROTARY_CACHES)
        and not (mtp and name.startswith(mtp))
        and not (ignored and ignored.search(name))
    ]
    is_quantized = quantized(config) is not None
    owners = {name: _layout_owner(name, architecture, is_quantized) for name in unknown}
    covered = {owner for owner in owners.values() if owner is not None}
    unexpected = [name for name, owner in owners.items() if owner is None]
    may_lack = _any_of(architecture.ignored_missing)
    missing = sorted(
        name
        for name in architecture.shapes
        if name not in loaded
        and not architecture.tied.get(name, frozenset()) & loaded.keys()
        and name.rpartition(".")[0] not in covered
        and not (may_lack and may_lack.search(name))
    )
    if missing or unexpected:
        what = _describe(missing, unexpected, loaded, tensors, architecture)
        raise ConfigError(
            f"model.path {directory}: the weights' tensor names do not fit its config.json "
            f"({architecture.name}): {what}; {_REMEDY}"
        )
    return NameCheck(
        tensors=len(tensors),
        by_name=len(loaded.keys() & architecture.shapes.keys()),
        by_module=len(unknown),
        layers=layers,
    )


def _any_of(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def _layout_owner(name: str, architecture: Architecture, is_quantized: bool) -> str | None:
    """The module of the architecture whose tensors ``name`` holds in a layout of its own: any
    tensor under a module of a quantized checkpoint (packed, scaled), or one expert's tensor
    where the architecture fuses its experts (a name further down than the module that holds the
    fused tensors); None if neither."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        module = ".".join(parts[:end])
        if module in architecture.owners:
            return module if is_quantized or end < len(parts) - 1 else None
    return None


def _layer_numbers(names: Iterable[str], path: str) -> set[int]:
    """The decoder layer numbers under ``path`` that ``names`` hold."""
    pattern = re.compile(re.escape(path) + r"\.(\d+)\.")
    return {int(match.group(1)) for name in names if (match := pattern.match(name))}


def _check_layer_count(
    directory: Path, names: Iterable[str], path: str, num_layers: int, mtp_layers: int
) -> int | None:
    """How many of config.json's decoder layers the weights hold under ``path`` (None: nothing
    there); ConfigError when the weights' layers end before config.json's ``num_hidden_layers``,
    or go on past it (and past the multi-token-prediction layers that may follow)."""
    numbers = _layer_numbers(names, path)
    if not numbers:
        return None
    held = max(numbers) + 1
    if num_layers <= held <= num_layers + mtp_layers:
        return num_layers
    mtp = f" (and {mtp_layers} multi-token-prediction layer(s) after them)" if mtp_layers else ""
    effect = (
        f"the model would end in {num_layers - held} decoder layer(s) of random weights"
        if held < num_layers
        else f"layers {num_layers} to {held - 1} would be left out, so layer ids would name other layers"
    )
    raise ConfigError(
        f"model.path {directory}: config.json's num_hidden_layers is {num_layers}{mtp}, but the weights hold "
        f"{held} decoder layers ({path}.0 to {path}.{held - 1}): {effect}; if these weights are the whole "
        f"model, set num_hidden_layers to {held - mtp_layers if held > num_layers else held} in config.json, "
        f"else {_REMEDY}"
    )


def _describe(
    missing: list[str],
    unexpected: list[str],
    loaded: dict[str, str],
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    architecture: Architecture,
) -> str:
    """What does not fit, in words: a change of prefix that makes the names the model's, else the
    missing and the foreign tensors."""
    fitting = len(loaded.keys() & architecture.shapes.keys())
    change = _prefix_change(unexpected, architecture)
    if change is not None and change[1] * 2 >= len(tensors):
        (strip, add), fits = change
        how = (
            f"{add!r} in place of {strip!r}"
            if strip and add
            else f"without the prefix {strip!r}"
            if strip
            else f"with the prefix {add!r}"
        )
        peft = (
            " (a PEFT save: merge the adapter into the model, merge_and_unload(), and save that)"
            if strip.startswith("base_model.")
            else ""
        )
        return (
            f"{fitting} of its {len(tensors)} tensor names are names the model has; {fits} would be, "
            f"{how} at their start{peft}"
        )
    parts = []
    if missing:
        parts.append(f"{len(missing)} tensor(s) the model has are not in the weights ({_names(missing)})")
    if unexpected:
        named = [f"{loaded[name]} in {tensors[loaded[name]][0]}" for name in unexpected]
        parts.append(f"{len(unexpected)} tensor(s) in the weights are not the model's ({_names(named)})")
    return f"{fitting} of its {len(tensors)} tensor names are names the model has; " + "; ".join(parts)


def _names(names: list[str]) -> str:
    more = f", and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def _prefix_change(unexpected: list[str], architecture: Architecture) -> tuple[tuple[str, str], int] | None:
    """The change of prefix (one removed, another put in its place; either may be empty) that turns
    the most ``unexpected`` names into names the architecture has, and how many it turns. Each name
    counts for the shortest part of it that ends an architecture name, where exactly one does."""
    starts: dict[str, str | None] = {}  # the end of an architecture name -> its start (None: several)
    for name in architecture.shapes:
        parts = name.split(".")
        for cut in range(len(parts)):
            end, start = ".".join(parts[cut:]), "".join(p + "." for p in parts[:cut])
            starts[end] = start if starts.get(end, start) == start else None
    changes = Counter[tuple[str, str]]()
    for name in unexpected:
        parts = name.split(".")
        for cut in range(len(parts)):
            end = ".".join(parts[cut:])
            if end in starts:
                start = starts[end]
                if start is not None:
                    changes["".join(p + "." for p in parts[:cut]), start] += 1
                break
    return changes.most_common(1)[0] if changes else None
