"""The weights' tensor names against the model's ``config.json``, before any model loads.

transformers fills every tensor a checkpoint lacks at random and ignores the names it does not
know, with a warning only: weights saved under other names (a PEFT save prefixes every name with
``base_model.model.``), with a tensor renamed or missing, or a ``config.json`` that gives another
number of decoder layers than the weights hold would load into a partly or wholly random model,
and the run would write wrong hidden states with exit 0. This check compares the names in the
safetensors headers with the architecture transformers builds from ``config.json``
(``job.architecture``), as its loader matches them, and refuses a mismatch with exit 2, naming
the tensors and what was expected.

Names are compared as transformers' loader renames them (transformers 5's weight conversions,
which turn per-expert tensors into the fused ones of an architecture that fuses its experts;
transformers 4's older vision-language layouts). Names need no shapes, so quantized checkpoints
are checked too, module by module: a quantized module's tensors carry the scheme's names
(``weight_packed``, ``weight_scale``), so a module is covered when the checkpoint holds any
tensor of it. Allowed without a word: a tensor the model shares with one the checkpoint holds
(``lm_head.weight`` under ``tie_word_embeddings``), buffers (``rotary_emb.inv_freq``: transformers
recomputes them, vLLM skips them by name), the multi-token-prediction layers after the last
decoder layer (``num_nextn_predict_layers``), and the names transformers itself ignores.

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
    """Of the checkpoint's ``tensors``: how many the architecture has by name, as transformers'
    loader renames them (``by_name``), and how many hold a quantized module's weights
    (``by_module``); how many decoder layers they hold; or why the names were not compared
    (``skipped``: the layers may still have been counted)."""

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
    loaded = architecture.loading(tensors).names  # checkpoint name -> the model's name
    layers, mtp = None, ()
    if architecture.layers is not None:
        layers = _check_layer_count(directory, loaded.values(), architecture.layers, num_layers, mtp_layers)
        mtp = tuple(f"{architecture.layers}.{i}." for i in range(num_layers, num_layers + mtp_layers))
    ignored = _any_of(architecture.ignored_unexpected)
    unknown = [
        name
        for name, target in loaded.items()
        if target not in architecture.shapes
        and target not in architecture.buffers
        and not target.endswith(_ROTARY_CACHES)
        and not (mtp and target.startswith(mtp))
        and not (ignored and ignored.search(target))
    ]
    is_quantized = quantized(config) is not None
    covered, unexpected = set(), []  # quantized modules the checkpoint holds; names of no module
    for name in unknown:
        if is_quantized and (module := _module_of(loaded[name], architecture)) is not None:
            covered.add(module)
        else:
            unexpected.append(name)
    targets = set(loaded.values())
    may_lack = _any_of(architecture.ignored_missing)
    missing = sorted(
        name
        for name in architecture.shapes
        if name not in targets
        and not architecture.tied.get(name, frozenset()) & targets
        and name.rpartition(".")[0] not in covered
        and not (may_lack and may_lack.search(name))
    )
    by_name = sum(1 for target in loaded.values() if target in architecture.shapes)
    if missing or unexpected:
        what = _describe(missing, unexpected, tensors, by_name, architecture)
        raise ConfigError(
            f"model.path {directory}: the weights' tensor names do not fit its config.json "
            f"({architecture.name}): {what}; {_REMEDY}"
        )
    return NameCheck(tensors=len(tensors), by_name=by_name, by_module=len(unknown), layers=layers)


def _any_of(patterns: tuple[str, ...]) -> re.Pattern[str] | None:
    return re.compile("|".join(f"(?:{p})" for p in patterns)) if patterns else None


def _module_of(name: str, architecture: Architecture) -> str | None:
    """The module of the architecture that holds parameters and whose tensor ``name`` is, as a
    quantized checkpoint names them (``...down_proj.weight_packed``, bitsandbytes'
    ``...down_proj.weight.absmax``); None if none is."""
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if (module := ".".join(parts[:end])) in architecture.owners:
            return module
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
    tensors: dict[str, tuple[str, tuple[int, ...]]],
    by_name: int,
    architecture: Architecture,
) -> str:
    """What does not fit, in words: a change of prefix that makes the names the model's, else the
    missing and the foreign tensors."""
    fitting = f"{by_name} of its {len(tensors)} tensor names are names the model has"
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
        return f"{fitting}; {fits} would be, {how} at their start{peft}"
    parts = [fitting]
    if missing:
        parts.append(f"{len(missing)} tensor(s) the model has are not in the weights ({_names(missing)})")
    if unexpected:
        named = [f"{name} in {tensors[name][0]}" for name in unexpected]
        parts.append(f"{len(unexpected)} tensor(s) in the weights are not the model's ({_names(named)})")
    return "; ".join(parts)


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
