"""FP8 (e4m3) hidden-state storage: what is written, how exactly it decodes, what it saves.

Two real runs of the builtin tiny model on the bundled examples, identical except for
``output.hidden_dtype``; the model-dtype run is the reference for the FP8 one.

Error bound. e4m3 keeps 3 mantissa bits, so round-to-nearest changes every element
in the normal range by at most 2^-4 = 6.25% of itself. With scale = amax / 448 per
token and layer, only elements below 2^-6 * scale fall in the subnormal range; each
errs by at most 2^-10 * scale, which over H elements adds at most
sqrt(H) * 2^-10 / 448 of the row's norm (2e-4 at H = 8192). Rounding the decoded
value to bfloat16 adds at most 2^-8 (1 + 2^-4). So ||decoded - original|| / ||original||
<= 0.067 for every token and layer, whatever the data: MAX_REL_ERROR = 0.07 is a
guarantee, not a fit.
Mantissas spread over [1, 2) give a typical error of about 2.6%; the measured mean
is held below MEAN_REL_ERROR so that a scale or rounding mistake cannot hide under
the worst-case bound.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from job.cli import main
from job.errors import ConfigError
from job.hidden_dtype import FP8 as FP8_DTYPE
from job.pipeline.setup import prepare_run
from job.settings import load_settings
from job.shards import Shard, iter_output, read_manifest

FP8 = FP8_DTYPE.name  # "fp8_e4m3", as settings, shards and manifests spell it

MAX_REL_ERROR = 0.07
MEAN_REL_ERROR = 0.035
RUN_ARGS = ("--work.index=0", "--work.count=1", "--data.max_length=256", "--data.tokenizer_workers=0")


def run_job(out: Path, *args: str) -> Path:
    rc = main(["run", f"--output.uri={out}", "--log.format=json", *RUN_ARGS, *args])
    assert rc == 0, f"python -m job run {' '.join(args)} exited {rc}"
    return out


@pytest.fixture(scope="module")
def outputs(inprocess_env: None, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    base = tmp_path_factory.mktemp("fp8")
    return {
        "model": run_job(base / "model"),
        FP8: run_job(base / "fp8", f"--output.hidden_dtype={FP8}"),
    }


def shard_paths(out: Path) -> list[Path]:
    index = out / "index-00000"
    manifest = read_manifest(index)
    assert manifest is not None and manifest.complete
    return [index / entry.name for entry in manifest.shards]


def test_fp8_round_trip_error_is_bounded(outputs: dict[str, Path]) -> None:
    reference = list(iter_output(outputs["model"], require_complete=True))
    decoded = list(iter_output(outputs[FP8], require_complete=True))
    assert [s.sample_id for s in decoded] == [s.sample_id for s in reference]
    assert len(reference) > 20
    errors = []
    for ref, dec in zip(reference, decoded, strict=True):
        assert torch.equal(dec.input_ids, ref.input_ids) and torch.equal(dec.loss_mask, ref.loss_mask)
        assert dec.hidden_states.dtype == ref.hidden_states.dtype == torch.bfloat16  # decoded transparently
        orig, back = ref.hidden_states.float(), dec.hidden_states.float()
        errors.append((back - orig).norm(dim=-1) / orig.norm(dim=-1))  # per token and layer
    rel = torch.cat(errors)
    assert rel.isfinite().all()
    assert rel.max() <= MAX_REL_ERROR, f"worst token/layer relative error {rel.max():.4f}"
    assert rel.mean() <= MEAN_REL_ERROR, f"mean relative error {rel.mean():.4f}"


def test_fp8_shards_hold_e4m3_with_a_scale_per_token_and_layer(outputs: dict[str, Path]) -> None:
    manifest = read_manifest(outputs[FP8] / "index-00000")
    assert manifest is not None and manifest.identity.storage == FP8  # a resume must keep the storage
    for path in shard_paths(outputs[FP8]):
        shard = Shard(path)
        assert shard.metadata["storage"] == FP8 and shard.metadata["dtype"] == FP8
        assert shard.metadata["model_dtype"] == "bfloat16"
        with safe_open(str(path), framework="pt") as f:
            rows = f.get_tensor("hidden_states")
            scales = f.get_tensor("hidden_states_scale")
        assert rows.dtype == torch.float8_e4m3fn
        assert scales.dtype == torch.float32 and scales.shape == rows.shape[:2]  # [T, L]
        # scale = amax / 448: each token's row of each layer spans the full e4m3 range
        assert torch.equal(rows.float().abs().amax(dim=-1), torch.full(scales.shape, 448.0))
        # the reader's decoding is exactly fp8 * scale, rounded once to the model dtype
        expected = (rows.float() * scales.unsqueeze(-1)).to(torch.bfloat16)
        assert torch.equal(shard.hidden_rows(0, shard.num_tokens), expected)


def test_fp8_halves_bytes_per_token(outputs: dict[str, Path]) -> None:
    def per_token(out: Path) -> tuple[float, int, int]:
        paths = shard_paths(out)
        tokens = sum(Shard(p).num_tokens for p in paths)
        body = 0
        for p in paths:
            with p.open("rb") as f:  # file size less the safetensors header (8-byte length + JSON)
                body += p.stat().st_size - 8 - int.from_bytes(f.read(8), "little")
        first = Shard(paths[0])
        return body / tokens, len(first.layer_ids), int(first.metadata["hidden_size"])

    model_bpt, layers, hidden = per_token(outputs["model"])
    fp8_bpt, _, _ = per_token(outputs[FP8])
    ids_and_mask = 4 + 1
    # sample_offsets (8 bytes a sample) is the only other payload; it is below 1 byte a token here
    model_row = 2 * layers * hidden + ids_and_mask
    fp8_row = layers * hidden + 4 * layers + ids_and_mask
    assert model_row <= model_bpt < model_row + 1
    assert fp8_row <= fp8_bpt < fp8_row + 1
    # 1 byte instead of 2 an element; the scales (4 bytes a layer) cost 4/H more
    assert fp8_bpt / model_bpt < 0.5 + 4 / hidden + 0.01

    settings = load_settings(None, [f"--output.hidden_dtype={FP8}", *RUN_ARGS])
    assert prepare_run(settings).bytes_per_token == fp8_row


def test_per_layer_scales_keep_small_layers_precise() -> None:
    """Why a scale per token *and layer*: the residual stream grows with depth.

    speculators' FP8 backend (hs_connectors.fp8_utils) shares one scale across all
    layers of a token; a layer 10^5 times smaller than the largest then falls into
    e4m3's subnormals. Our per-layer scales keep every layer within the bound, and
    an all-zero row (scale clamped, not zero) decodes to zeros, not NaN.
    """
    torch.manual_seed(0)
    states = torch.randn(64, 4, 1024)
    states[:, 0] *= 1e-5
    states[:, 2] *= 1e3
    states[:5, 1] = 0.0
    rows, scales = FP8_DTYPE.encode(states)
    assert rows.dtype == torch.float8_e4m3fn and scales is not None and scales.shape == (64, 4)
    decoded = rows.float() * scales.unsqueeze(-1)
    assert torch.equal(decoded[:5, 1], torch.zeros(5, 1024))
    norms = states.norm(dim=-1)
    rel = (decoded - states).norm(dim=-1)[norms > 0] / norms[norms > 0]
    assert rel.max() <= MAX_REL_ERROR

    shared = states.abs().amax(dim=(1, 2), keepdim=True) / 448  # one scale per token, as speculators does
    shared_rel = ((states / shared).to(torch.float8_e4m3fn).float() * shared - states).norm(dim=-1) / norms
    assert shared_rel[:, 0].min() > 0.5  # the small layer is lost without its own scale


def test_hidden_dtype_setting_is_validated() -> None:
    with pytest.raises(ConfigError, match=r"output\.hidden_dtype"):
        load_settings(None, ["--output.hidden_dtype=fp4"])
    assert load_settings(None, [f"--output.hidden_dtype={FP8}"]).output.hidden_dtype == FP8
    assert load_settings(None, []).output.hidden_dtype == "model"
