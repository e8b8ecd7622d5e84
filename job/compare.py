"""``python -m job compare A B``: do two outputs hold the same data?

Matches samples by id, requires equal input ids and loss masks, and reports
the relative error ||a - b|| / ||b|| per sample and layer (B is the
reference, e.g. the HF backend's output). Exits non-zero above the tolerance.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import torch

from job.shards import iter_output


@dataclass
class Comparison:
    samples: int = 0
    worst: float = 0.0
    worst_sample: str = ""
    worst_layer: int = -1
    per_layer: dict[int, float] = field(default_factory=dict)
    mismatched: list[str] = field(default_factory=list)  # ids/masks/shapes differ
    missing: list[str] = field(default_factory=list)  # in the reference, not in the candidate
    extra: list[str] = field(default_factory=list)

    def ok(self, tolerance: float) -> bool:
        return not (self.mismatched or self.missing or self.extra) and self.worst <= tolerance

    def summary(self, tolerance: float) -> str:
        layers = ", ".join(f"{k}: {v:.2e}" for k, v in sorted(self.per_layer.items()))
        return (
            f"{'OK' if self.ok(tolerance) else 'FAIL'}: {self.samples} samples compared; "
            f"worst relative error {self.worst:.3e} (sample {self.worst_sample}, layer {self.worst_layer}; "
            f"tolerance {tolerance:g}); "
            f"worst per layer {{{layers}}}; mismatched {len(self.mismatched)}, missing {len(self.missing)}, "
            f"extra {len(self.extra)}"
        )


def compare_outputs(candidate: str | Path, reference: str | Path) -> Comparison:
    ref = {s.sample_id: s for s in iter_output(reference, setting="compare --reference")}
    result = Comparison()
    seen = set()
    for sample in iter_output(candidate, setting="compare PATH"):
        seen.add(sample.sample_id)
        other = ref.get(sample.sample_id)
        if other is None:
            result.extra.append(sample.sample_id)
            continue
        if (
            not torch.equal(sample.input_ids, other.input_ids)
            or not torch.equal(sample.loss_mask, other.loss_mask)
            or sample.hidden_states.shape != other.hidden_states.shape
            or sample.layer_ids != other.layer_ids
        ):
            result.mismatched.append(sample.sample_id)
            continue
        a, b = sample.hidden_states.float(), other.hidden_states.float()
        for j, layer in enumerate(sample.layer_ids):
            err = ((a[:, j] - b[:, j]).norm() / b[:, j].norm().clamp_min(1e-30)).item()
            result.per_layer[layer] = max(result.per_layer.get(layer, 0.0), err)
            if err > result.worst:
                result.worst, result.worst_sample, result.worst_layer = err, sample.sample_id, layer
        result.samples += 1
    result.missing = sorted(set(ref) - seen)
    return result
