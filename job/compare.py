"""``python -m job compare A B``: do two outputs hold the same data?

Matches samples by id, requires equal input ids and loss masks, and reports
the relative error ||a - b|| / ||b|| per sample and layer (B is the
reference, e.g. the HF backend's output). Exits non-zero above the tolerance.
A sample that cannot be compared (other input ids, loss mask or layers) is
counted as mismatched with what differs, and the settings the two outputs were
written with that explain it (``layers.ids``, ``data.max_length``, the model or
tokenizer, ...) are named from their manifests.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from job.manifest import IDENTITY_SETTINGS
from job.shards import iter_output
from job.shards.reader import Sample
from job.storage import open_shard_source

# Identity fields that say which slice of an output an index holds, not how it was made.
_SLICE_FIELDS = ("work_index", "work_count")


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
    # What made samples mismatch (e.g. "layer ids [2, 4] vs the reference's [1, 4]"), with counts.
    mismatch_reasons: Counter[str] = field(default_factory=Counter)
    # The settings the two outputs were written with that differ, named as settings.
    setting_differences: list[str] = field(default_factory=list)

    def ok(self, tolerance: float) -> bool:
        return not (self.mismatched or self.missing or self.extra) and self.worst <= tolerance

    def summary(self, tolerance: float) -> str:
        layers = ", ".join(f"{k}: {v:.2e}" for k, v in sorted(self.per_layer.items()))
        text = (
            f"{'OK' if self.ok(tolerance) else 'FAIL'}: {self.samples} samples compared; "
            f"worst relative error {self.worst:.3e} (sample {self.worst_sample}, layer {self.worst_layer}; "
            f"tolerance {tolerance:g}); "
            f"worst per layer {{{layers}}}; mismatched {len(self.mismatched)}{self._why_mismatched()}, "
            f"missing {len(self.missing)}, extra {len(self.extra)}"
        )
        if self.setting_differences:
            text += (
                "; the outputs were written with different settings: "
                + "; ".join(self.setting_differences)
                + " (compare outputs written with the same ones)"
            )
        return text

    def _why_mismatched(self) -> str:
        if not self.mismatch_reasons:
            return ""
        shown = self.mismatch_reasons.most_common(3)
        more = len(self.mismatch_reasons) - len(shown)
        reasons = "; ".join(f"{count} with {reason}" for reason, count in shown)
        return f" ({reasons}{f'; and {more} other differences' if more else ''})"


def compare_outputs(candidate: str | Path, reference: str | Path) -> Comparison:
    result = Comparison()
    result.setting_differences = _setting_differences(
        _settings_of(candidate, "compare PATH"), _settings_of(reference, "compare --reference")
    )
    ref = {s.sample_id: s for s in iter_output(reference, setting="compare --reference")}
    seen = set()
    for sample in iter_output(candidate, setting="compare PATH"):
        seen.add(sample.sample_id)
        other = ref.get(sample.sample_id)
        if other is None:
            result.extra.append(sample.sample_id)
            continue
        reason = _mismatch(sample, other)
        if reason is not None:
            result.mismatched.append(sample.sample_id)
            result.mismatch_reasons[reason] += 1
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


def _mismatch(sample: Sample, reference: Sample) -> str | None:
    """What keeps two samples of one id from being compared, or None."""
    if sample.layer_ids != reference.layer_ids:
        return f"other layer ids ({sample.layer_ids} vs the reference's {reference.layer_ids})"
    if len(sample.input_ids) != len(reference.input_ids):
        return "another number of tokens (one output truncated them, or tokenized them differently)"
    if not torch.equal(sample.input_ids, reference.input_ids):
        return "other input ids of the same length (another tokenizer or chat template?)"
    if not torch.equal(sample.loss_mask, reference.loss_mask):
        return "other loss masks (another chat template or data.reasoning_in_loss?)"
    if sample.hidden_states.shape != reference.hidden_states.shape:
        return (
            f"another hidden size ({sample.hidden_states.shape[-1]} vs the reference's "
            f"{reference.hidden_states.shape[-1]}: another model)"
        )
    return None


def _settings_of(output: str | Path, setting: str) -> dict[str, Any] | None:
    """What the first index with a manifest was written with (its identity), or None."""
    for index in open_shard_source(str(output), setting).indexes():
        if index.manifest is not None:
            return index.manifest.identity.model_dump()
    return None


def _setting_differences(candidate: dict[str, Any] | None, reference: dict[str, Any] | None) -> list[str]:
    if candidate is None or reference is None:
        return []
    return [
        f"{IDENTITY_SETTINGS.get(key, key)}: {value!r} vs the reference's {reference.get(key)!r}"
        for key, value in candidate.items()
        if key not in _SLICE_FIELDS and value != reference.get(key)
    ]
