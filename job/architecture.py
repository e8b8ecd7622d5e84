"""The architecture transformers builds from a model directory's ``config.json``, on the meta device
(no memory, no weights: a few seconds for a DeepSeek-V3-sized config): every tensor a checkpoint of
that model fills, by name and shape, and what transformers' loader makes of a checkpoint's names.

The weights' checks before any model loads (``job.weight_names``, ``job.weight_shapes``) compare
the safetensors headers with it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import torch


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
    # model ignores (regular expressions), and the renames its loader applies to a checkpoint's
    # names before matching them (vision-language models' older layouts), in order.
    ignored_missing: tuple[str, ...]
    ignored_unexpected: tuple[str, ...]
    renames: tuple[tuple[str, str], ...]

    def loaded_name(self, name: str) -> str:
        """A checkpoint tensor's name as transformers' loader matches it to the model."""
        for pattern, replacement in self.renames:
            renamed, count = re.subn(pattern, replacement, name)
            if count:
                return renamed
        return name


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layer list")
    return layers


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
        renames=tuple((getattr(model, "_checkpoint_conversion_mapping", None) or {}).items()),
    )
