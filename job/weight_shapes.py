"""The weights' tensor shapes against the model's ``config.json``, before any model loads.

Weights whose tensors do not fit ``config.json`` (another size of the same architecture, a
config edited by hand) are something no retry can fix. transformers says so when it loads them
("size mismatch"), but vLLM's worker fails with "WorkerProc initialization failed", the cause only
in the worker's stderr, after a full start-up. This check compares the shapes of the architecture
transformers builds from ``config.json`` on the meta device (``job.architecture``) with the
safetensors headers, tensor by tensor, for every name the two have in common (``job.weight_names``
checks the names first).

A false alarm would block a valid run, so the check compares only what means the same on both
sides and says why it skipped otherwise: quantized checkpoints (``quantization_config``: packed
and scaled tensors have other shapes than the architecture's), architectures transformers cannot
build without remote code, ``config.json`` overridden for vLLM (``hf_overrides``), weights that
cannot be listed without reading them (pickles of before torch 1.6), tensors transformers' loader
reshapes as it loads them (transformers 5 fuses per-expert tensors), and names only one side has
(multi-token-prediction layers).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from job.architecture import Architecture
from job.errors import ConfigError
from job.weight_names import quantized

_SHOWN = 3  # mismatches named in one message


@dataclass(frozen=True)
class ShapeCheck:
    """What the check compared (``compared`` tensors of the checkpoint's ``tensors``), or why it
    compared nothing (``skipped``)."""

    compared: int = 0
    tensors: int = 0
    skipped: str | None = None
    seconds: float = 0.0


def check_tensor_shapes(
    directory: Path,
    config: dict[str, Any],
    architecture: Architecture | str,
    tensors: dict[str, tuple[str, tuple[int, ...]]],
) -> ShapeCheck:
    """ConfigError (exit 2, naming model.path, the tensors and both shapes) when a checkpoint
    tensor (``tensors``: name -> file, shape) has another shape than ``architecture``, built from
    ``config``, gives the same name; ``architecture`` is why there is none where transformers could
    not build it."""
    if (key := quantized(config)) is not None:
        return ShapeCheck(skipped=f"a quantized checkpoint ({key})")
    if isinstance(architecture, str):
        return ShapeCheck(skipped=architecture)
    expected = architecture.shapes
    loading = architecture.loading(tensors)
    # the model's name -> (file, shape), where the loader keeps the tensor as it is
    found = {loading.names[name]: at for name, at in tensors.items() if name not in loading.converted}
    common = found.keys() & expected.keys()
    if not common:
        return ShapeCheck(tensors=len(tensors), skipped="no tensor name in common with the architecture")
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
    return ShapeCheck(compared=len(common), tensors=len(tensors))
