"""How hidden states are stored: the model dtype, or FP8 (e4m3) with one float32
scale per token and layer (value = fp8 * scale). One type for every place that
sizes, writes, moves or reads the rows: shard layout, capture ring, backends, reader.

speculators' FP8 backend (hs_connectors.fp8_utils, 0.9) shares one scale across a
token's layers. We scale each layer on its own: the residual stream grows with depth,
and under a shared scale a layer about 10^4 times smaller than the token's largest
drops into e4m3's subnormals (6% error at 10^4, 66% at 10^5, against 2.8% with
per-layer scales). It costs 4 bytes per extra layer and token (12 of ~16 KiB for
4 layers of H=4096). Rounding alone bounds the error at 2^-4 per element.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

MODEL_DTYPES = ("bfloat16", "float16", "float32")
# ``output.hidden_dtype``: the model's own dtype, or FP8 with scales.
HiddenEncoding = Literal["model", "fp8_e4m3"]
_FP8_MAX = 448.0  # largest finite float8_e4m3fn
SCALE_BYTES = 4  # one float32 scale per token and layer


@dataclass(frozen=True)
class HiddenDtype:
    name: str  # recorded in shards and manifests ("dtype", identity "storage")
    safetensors: str  # the dtype string in a safetensors header
    itemsize: int
    scaled: bool  # FP8: every [token, layer] row carries a float32 scale

    @property
    def torch(self) -> torch.dtype:
        return _TORCH[self.name]

    @property
    def encoding(self) -> HiddenEncoding:
        """``model`` or ``fp8_e4m3``: the shard metadata's ``storage`` value."""
        return "fp8_e4m3" if self.scaled else "model"

    def token_bytes(self, num_layers: int, hidden_size: int) -> int:
        """Stored bytes of one token's hidden states (rows plus scales)."""
        return num_layers * (hidden_size * self.itemsize + (SCALE_BYTES if self.scaled else 0))

    def encode(self, states: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``states`` [n, L, H] in the model dtype -> (rows to store, per-row scales or None)."""
        if not self.scaled:
            return states, None
        amax = states.abs().amax(dim=-1).float().clamp(min=1e-12)
        scales = amax / _FP8_MAX
        rows = (states.float() / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
        return rows, scales


_TORCH = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
    "fp8_e4m3": torch.float8_e4m3fn,
}
HIDDEN_DTYPES = {
    "bfloat16": HiddenDtype("bfloat16", "BF16", 2, scaled=False),
    "float16": HiddenDtype("float16", "F16", 2, scaled=False),
    "float32": HiddenDtype("float32", "F32", 4, scaled=False),
    "fp8_e4m3": HiddenDtype("fp8_e4m3", "F8_E4M3", 1, scaled=True),
}
FP8 = HIDDEN_DTYPES["fp8_e4m3"]


def hidden_dtype(name: str) -> HiddenDtype:
    return HIDDEN_DTYPES[name]


def stored_dtype(model_dtype: str, encoding: HiddenEncoding) -> HiddenDtype:
    """What a run stores: ``output.hidden_dtype: model`` keeps the model's dtype."""
    return FP8 if encoding == "fp8_e4m3" else HIDDEN_DTYPES[model_dtype]
