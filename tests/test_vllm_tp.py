"""Tensor parallelism on the CPU: two TP ranks (vLLM's multiprocessing executor, gloo),
capture on rank 0 only, hidden states equal to the HF reference within bf16 tolerance.

The production target is TP=8 on GPUs; the CPU build runs the same driver, worker
extension and rank-0-only capture with two ranks, which is what can be checked here.
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


def _run(args: list[str], cache: Path) -> list[dict]:
    # One core per rank: vLLM's automatic binding wants a NUMA node per CPU worker.
    return run_vllm_job(["--data.max_length=256", *args], cache, VLLM_CPU_OMP_THREADS_BIND="0|1")


def test_two_tensor_parallel_ranks_capture_once_and_match_the_reference(
    tmp_path: Path, job_cache_dir: Path
) -> None:
    events = _run(
        [
            f"--output.uri={tmp_path / 'tp2'}",
            "--backend.name=vllm",
            "--backend.tensor_parallel_size=2",
            "--backend.vllm.max_num_batched_tokens=128",
            "--backend.vllm.max_num_seqs=4",
        ],
        job_cache_dir,
    )
    installed = next(e for e in events if e["event"] == "capture_installed")
    assert installed["tp_ranks"] == 2  # both workers ran hs_install ...
    assert installed["capturing_ranks"] == [0]  # ... and only rank 0 captures
    # The preflight ran first at the same TP, gloo between its two ranks, and was gone before the
    # run's engine started.
    names = [e["event"] for e in events]
    preflight = next(e for e in events if e["event"] == "preflight.capture_installed")
    assert preflight["tp_ranks"] == 2 and preflight["capturing_ranks"] == [0]
    assert names.index("preflight_passed") < names.index("adapter_selected")
    passed = events[names.index("preflight_passed")]
    assert any("TP=2" in line for line in passed["proven"]), passed["proven"]
    print(f"TP=2 preflight: {passed['seconds']}")
    _run([f"--output.uri={tmp_path / 'hf'}", "--backend.name=hf"], job_cache_dir)
    result = compare_outputs(tmp_path / "tp2", tmp_path / "hf")
    print(f"TP=2 vs HF: {result.summary(2e-2)}")
    assert result.ok(2e-2), result.summary(2e-2)
