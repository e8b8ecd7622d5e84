"""Extraction backends behind one interface (``job.backend_io.Backend``).

The HF transformers backend (``hf.py``) is the correctness oracle; the vLLM backend
(``vllm.py``, its engine built by ``vllm_engine.py``) is the production path. ``create_backend``
picks one for a run from what it needs: the settings, the model, the layer ids and how hidden
states are stored.
"""

from __future__ import annotations

import numpy as np
import torch

from job.backend_io import Backend, BackendInput, Completion, GenerationInput, HiddenChunk
from job.hidden_dtype import HiddenDtype
from job.model import ModelInfo
from job.settings import JobSettings


def create_backend(
    settings: JobSettings, model: ModelInfo, layer_ids: list[int], dtype: HiddenDtype, generating: bool
) -> Backend:
    """The backend ``backend.name`` names, for this model, these layer ids and this stored dtype;
    ``generating``: it also generates turns (generate.mode other than keep)."""
    backend = settings.backend
    if backend.name == "hf":
        from job.backends.hf import HFBackend

        return HFBackend.load(model, layer_ids, backend.device, dtype)
    from job.backends.vllm import VllmBackend
    from job.backends.vllm_engine import EngineSpec

    return VllmBackend(EngineSpec.of(settings, generating=generating), model, layer_ids, dtype)


def generate_all(backend: Backend, requests: list[GenerationInput]) -> dict[str, Completion]:
    """Convenience for tests and comparisons: every request's completion, by request id."""
    done = {}
    for item in backend.extract(iter(requests)):
        assert isinstance(item, Completion)
        done[item.request_id] = item
    return done


def extract_all(backend: Backend, sequences: list[np.ndarray]) -> list[torch.Tensor]:
    """Convenience for tests and comparisons: full ``[T, L, H]`` per sequence."""
    out: list[list[HiddenChunk]] = [[] for _ in sequences]
    inputs = (BackendInput(str(i), np.asarray(s, np.int32)) for i, s in enumerate(sequences))
    for chunk in backend.extract(inputs):
        assert isinstance(chunk, HiddenChunk)
        out[int(chunk.sample_id)].append(
            HiddenChunk(
                chunk.sample_id, chunk.start, chunk.rows.clone(), chunk.scales, chunk.last, chunk.nonfinite
            )
        )
        if chunk.release is not None:
            chunk.release()
    return [torch.cat([c.rows for c in sorted(chunks, key=lambda c: c.start)]) for chunks in out]
