"""Storage dtypes for hidden states: the model dtype, or FP8 (e4m3) with one
float32 scale per token and layer (value = fp8 * scale)."""

from __future__ import annotations

import torch

FP8 = "fp8_e4m3"
_FP8_MAX = 448.0  # largest finite float8_e4m3fn


def to_storage(states: torch.Tensor, storage: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``states`` [n, L, H] -> (rows to store, per-row scales or None)."""
    if storage != FP8:
        return states, None
    amax = states.abs().amax(dim=-1).float().clamp(min=1e-12)
    scales = amax / _FP8_MAX
    rows = (states.float() / scales.unsqueeze(-1)).to(torch.float8_e4m3fn)
    return rows, scales
