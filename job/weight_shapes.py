"""The weights' tensor shapes against the model's ``config.json``, before any model loads.

Weights whose tensors do not fit ``config.json`` (another size of the same architecture, a
config edited by hand) are something no retry can fix. transformers says so when it loads them
("size mismatch"), but vLLM's worker fails with "WorkerProc initialization failed", the cause only
in the worker's stderr, after a full start-up. This check builds the architecture transformers
knows for ``config.json`` on the meta device (no memory, no weights: a few seconds for a
DeepSeek-V3-sized config) and compares its tensors' shapes with the safetensors headers, tensor
by tensor, for every name the two have in common.

A false alarm would block a valid run, so the check compares only what means the same on both
sides and says why it skipped otherwise: quantized checkpoints (``quantization_config``: packed
and scaled tensors have other shapes than the architecture's), architectures transformers cannot
build without remote code, ``config.json`` overridden for vLLM (``hf_overrides``), pickled weights
(their shapes are inside the pickle), and names only one side has (fused, renamed or extra tensors,
e.g. DeepSeek-V3's multi-token-prediction layer).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.errors import ConfigError
from job.weights import INDEX_SUFFIX, SAFETENSORS, safetensors_header

_SHOWN = 3  # mismatches named in one message
# compression_config: what compressed-tensors checkpoints called it before quantization_config.
_QUANTIZATION_KEYS = ("quantization_config", "compression_config")


@dataclass(frozen=True)
class ShapeCheck:
    """What the check compared (``compared`` tensors of the checkpoint's ``tensors``), or why it
    compared nothing (``skipped``)."""

    compared: int = 0
    tensors: int = 0
    skipped: str | None = None
    seconds: float = 0.0


def check_tensor_shapes(directory: Path, config: dict[str, Any]) -> ShapeCheck:
    """ConfigError (exit 2, naming model.path, the tensors and both shapes) when a safetensors
    tensor has another shape than the architecture built from ``config`` gives the same name."""
    text = config.get("text_config") or config
    quantized = [key for key in _QUANTIZATION_KEYS if key in config or key in text]
    if quantized:
        return ShapeCheck(skipped=f"a quantized checkpoint ({quantized[0]})")
    files = _loaded_safetensors(directory)
    if not files:
        return ShapeCheck(skipped="no safetensors files (pickled weights keep their shapes inside)")
    expected = architecture_shapes(directory)
    if isinstance(expected, str):
        return ShapeCheck(skipped=expected)
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        for name, info in safetensors_header(path).items():
            if name != "__metadata__":
                found[name] = (path.name, tuple(int(n) for n in info["shape"]))
    common = found.keys() & expected.keys()
    if not common:
        return ShapeCheck(tensors=len(found), skipped="no tensor name in common with the architecture")
    mismatched = sorted(name for name in common if found[name][1] != expected[name])
    if mismatched:
        shown = "; ".join(
            f"{name} in {found[name][0]} has shape {list(found[name][1])}, config.json makes it "
            f"{list(expected[name])}"
            for name in mismatched[:_SHOWN]
        )
        more = f"; and {len(mismatched) - _SHOWN} more" if len(mismatched) > _SHOWN else ""
        raise ConfigError(
            f"model.path {directory}: {len(mismatched)} of {len(common)} weight tensors do not fit its "
            f"config.json ({config.get('architectures', ['?'])[0]}): {shown}{more}; the weights belong to "
            "another model: copy or download the model's weights again, or point model.path at the "
            "model they belong to"
        )
    return ShapeCheck(compared=len(common), tensors=len(found))


def _loaded_safetensors(directory: Path) -> list[Path]:
    """The safetensors files the loaders read: those the index lists, or all of them."""
    listed = {
        name
        for index in directory.glob("*" + SAFETENSORS + INDEX_SUFFIX)
        for name in json.loads(index.read_text())["weight_map"].values()
    }
    return [directory / name for name in sorted(listed)] or sorted(directory.glob("*" + SAFETENSORS))


def architecture_shapes(directory: Path) -> dict[str, tuple[int, ...]] | str:
    """Every tensor of the architecture transformers builds from the directory's config.json, by
    name, with its shape; or why it cannot build one."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    try:  # parameters left uninitialized: on the meta device, initializing them is only Python time
        from transformers.modeling_utils import no_init_weights
    except ImportError:  # transformers 5
        from transformers.initialization import no_init_weights

    try:
        config = AutoConfig.from_pretrained(directory, trust_remote_code=False)
        with torch.device("meta"), no_init_weights():
            model = AutoModelForCausalLM.from_config(config, trust_remote_code=False)
    except Exception as exc:  # an architecture transformers does not know without remote code
        return f"transformers cannot build the architecture ({type(exc).__name__}: {str(exc)[:200]})"
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}
