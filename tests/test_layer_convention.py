"""The layer-id convention of the HF reference backend, proven against transformers.

id 0 = embedding output; id k (0 < k < N) = output of decoder layer k, which is HF's
``hidden_states[k]``; id N = the last decoder layer's output BEFORE the final norm.
HF puts the post-norm state in ``hidden_states[N]`` (== ``last_hidden_state``), so
applying the model's final norm to our id N must reproduce it, and our id N must differ
from it.

Everything runs in float32: our states and HF's come from the same weights through the
same ops, so in float32 they are bit-identical and the test can use exact equality
(bfloat16 rounding would force tolerances that could hide an off-by-one-layer bug
between two adjacent, similar layers).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from job.backends import extract_all
from job.backends.hf import HFBackend
from job.hidden_dtype import hidden_dtype
from job.model import ModelInfo, resolve_model
from job.settings import ModelSettings

SEQUENCES = [
    np.array([1], np.int32),  # a single token
    np.arange(5, 42, dtype=np.int32),
    np.array([1, 900, 17, 17, 17, 4, 1000, 250, 3, 77, 12, 512], np.int32),
]


@pytest.fixture(scope="module", params=["builtin:tiny-llama", "builtin:tiny-deepseek-v3"])
def case(request: pytest.FixtureRequest) -> dict[str, Any]:
    from transformers import AutoModelForCausalLM

    info: ModelInfo = resolve_model(ModelSettings(path=request.param, dtype="float32"))
    n = info.num_layers
    layer_ids = [0, 1, n // 2, n]
    backend = HFBackend.load(info, layer_ids, "cpu", hidden_dtype("float32"))
    ours = extract_all(backend, list(SEQUENCES))
    backend.close()
    # An independent copy of the model, without our hooks, as the reference.
    reference = AutoModelForCausalLM.from_pretrained(info.path, dtype=torch.float32).eval()
    return {"info": info, "layer_ids": layer_ids, "ours": ours, "ref": reference}


def hf_forward(model: Any, seq: np.ndarray) -> Any:
    with torch.inference_mode():
        return model.model(
            input_ids=torch.as_tensor(seq, dtype=torch.long)[None], output_hidden_states=True, use_cache=False
        )


def test_shapes_and_dtype(case: dict[str, Any]) -> None:
    info: ModelInfo = case["info"]
    assert info.num_layers == 8
    for seq, states in zip(SEQUENCES, case["ours"], strict=True):
        assert states.shape == (len(seq), len(case["layer_ids"]), info.hidden_size)
        assert states.dtype == torch.float32


def test_id_0_is_the_embedding_output(case: dict[str, Any]) -> None:
    model = case["ref"]
    for seq, states in zip(SEQUENCES, case["ours"], strict=True):
        with torch.inference_mode():
            embedded = model.get_input_embeddings()(torch.as_tensor(seq, dtype=torch.long)[None])[0]
        assert torch.equal(states[:, 0], embedded)
        assert torch.equal(states[:, 0], hf_forward(model, seq).hidden_states[0][0])


def test_intermediate_ids_are_hf_hidden_states(case: dict[str, Any]) -> None:
    ids = case["layer_ids"]
    for seq, states in zip(SEQUENCES, case["ours"], strict=True):
        hidden = hf_forward(case["ref"], seq).hidden_states
        assert len(hidden) == case["info"].num_layers + 1
        for j, k in enumerate(ids):
            if 0 < k < case["info"].num_layers:
                assert torch.equal(states[:, j], hidden[k][0]), f"layer id {k}"
                # and not its neighbour: an off-by-one would match hidden[k +- 1]
                assert not torch.equal(states[:, j], hidden[k + 1][0])
                assert not torch.equal(states[:, j], hidden[k - 1][0])


def test_id_n_is_the_pre_norm_final_state(case: dict[str, Any]) -> None:
    n = case["info"].num_layers
    j = case["layer_ids"].index(n)
    model = case["ref"]
    for seq, states in zip(SEQUENCES, case["ours"], strict=True):
        out = hf_forward(model, seq)
        post_norm = out.last_hidden_state[0]
        # transformers' last hidden_states slot is the post-norm state...
        assert torch.equal(out.hidden_states[n][0], post_norm)
        ours_n = states[:, j]
        # ...our id N is the state before it: the final norm maps one onto the other,
        with torch.inference_mode():
            assert torch.equal(model.model.norm(ours_n), post_norm)
        # ...and they really differ (the norm is not the identity on these states).
        assert not torch.allclose(ours_n, out.hidden_states[n][0], atol=1e-3)
