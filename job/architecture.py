"""The architecture transformers builds from a model directory's ``config.json``, on the meta device
(no memory, no weights: a few seconds for a DeepSeek-V3-sized config): every tensor a checkpoint of
that model fills, by name and shape, and what transformers' loader makes of a checkpoint's names.

The weights' checks before any model loads (``job.weight_names``, ``job.weight_shapes``) compare
the safetensors headers with it.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch


@dataclass(frozen=True)
class Loading:
    """What transformers' loader makes of a checkpoint's tensor names."""

    names: dict[str, str]  # checkpoint name -> the model's name it loads into
    # checkpoint names whose tensors a conversion reshapes on the way (fused, split, transposed):
    # their shapes are not the model's
    converted: frozenset[str]


@dataclass(frozen=True)
class Architecture:
    name: str  # the model class transformers built
    shapes: dict[str, tuple[int, ...]]  # its state dict: parameters and persistent buffers
    # A name whose tensor the model shares with other names (tie_word_embeddings: lm_head.weight
    # is embed_tokens.weight), with those names: a checkpoint holds one of them.
    tied: dict[str, frozenset[str]]
    owners: frozenset[str]  # modules that hold parameters of their own
    buffers: frozenset[str]  # every buffer, those no checkpoint holds (rotary caches) included
    layers: str | None  # the decoder layer list's path (model.layers), where there is one
    # transformers' own allowances: names a checkpoint may lack and names it may hold that the
    # model ignores (regular expressions), and its loader's renaming of a checkpoint's names
    # (each name -> the model's name it loads into).
    ignored_missing: tuple[str, ...]
    ignored_unexpected: tuple[str, ...]
    loading: Callable[[Iterable[str]], Loading]


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layer list")
    return layers


def _loading(model: torch.nn.Module) -> Callable[[Iterable[str]], Loading]:
    """How transformers' loader renames a checkpoint's tensor names to the model's: transformers 5
    with its weight conversions (renamings, and converters such as per-expert tensors into the
    fused ones of an architecture that fuses its experts), called as its loader calls them;
    transformers 4 with the regular expressions of vision-language models' older layouts."""
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import (
            WeightConverter,
            WeightRenaming,
            dot_natural_key,
            rename_source_key,
        )
    except ImportError:  # transformers 4
        mapping = list((getattr(model, "_checkpoint_conversion_mapping", None) or {}).items())

        def first_match(name: str) -> str:
            for pattern, replacement in mapping:
                renamed, count = re.subn(pattern, replacement, name)
                if count:
                    return renamed
            return name

        return lambda names: Loading({name: first_match(name) for name in names}, frozenset())
    transforms = get_model_conversion_mapping(model)
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]

    def load(names: Iterable[str]) -> Loading:
        loaded, converted = {}, set()
        for name in sorted(names, key=dot_natural_key):  # its loader's order: renamings hold state
            loaded[name], converter = rename_source_key(name, renamings, converters)
            if converter is not None:
                converted.add(name)
        return Loading(loaded, frozenset(converted))

    return load


def build_architecture(directory: Path, trust_remote_code: bool) -> Architecture | str:
    """The architecture of the directory's config.json, or why transformers cannot build it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # parameters left uninitialized: on the meta device, initializing them is only Python time
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # transformers 5
        from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=trust_remote_code)
        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=trust_remote_code)
            model.tie_weights()  # what no_init_weights leaves out (tie_word_embeddings)
    except Exception as exc:  # an architecture transformers does not know, or remote code not allowed
        return f"transformers cannot build the architecture ({type(exc).__name__}: {str(exc)[:200]})"
    try:
        layers: torch.nn.Module | None = decoder_layers(model)
    except TypeError:  # the shapes can still be compared
        layers = None
    # One walk over the modules (at a trillion parameters, each walk takes seconds): what the
    # state dict holds (parameters, persistent buffers), and which names share a parameter.
    shapes: dict[str, tuple[int, ...]] = {}
    names_of: dict[int, list[str]] = {}
    owners, buffers, layers_path = set(), set(), None
    for path, module in model.named_modules():
        prefix = f"{path}." if path else ""
        if module is layers:
            layers_path = path
        for name, parameter in module._parameters.items():
            if parameter is not None:
                shapes[prefix + name] = tuple(parameter.shape)
                names_of.setdefault(id(parameter), []).append(prefix + name)
                owners.add(path)
        for name, buffer in module._buffers.items():
            buffers.add(prefix + name)
            if buffer is not None and name not in module._non_persistent_buffers_set:
                shapes[prefix + name] = tuple(buffer.shape)
    return Architecture(
        name=type(model).__name__,
        shapes=shapes,
        tied={
            name: frozenset(names) - {name} for names in names_of.values() if len(names) > 1 for name in names
        },
        owners=frozenset(owners),
        buffers=frozenset(buffers),
        layers=layers_path,
        ignored_missing=tuple(getattr(model, "_keys_to_ignore_on_load_missing", None) or ()),
        ignored_unexpected=tuple(getattr(model, "_keys_to_ignore_on_load_unexpected", None) or ()),
        loading=_loading(model),
    )
