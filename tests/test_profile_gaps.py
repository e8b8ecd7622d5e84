"""`.ci/profile_gaps.py` on traces in the torch profiler's Chrome-trace format: GPU busy time,
idle gaps, per-step annotations and what grew from plain to null."""

from __future__ import annotations

import gzip
import importlib.util
import json
from pathlib import Path
from types import ModuleType
from typing import Any

SCRIPT = Path(__file__).resolve().parent.parent / ".ci" / "profile_gaps.py"


def _module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("profile_gaps", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _event(cat: str, name: str, ts: float, dur: float, **args: Any) -> dict[str, Any]:
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 7, "args": args}


def _write_trace(directory: Path, events: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True)
    with gzip.open(directory / "rank0.1.pt.trace.json.gz", "wt") as handle:
        json.dump({"traceEvents": [{"ph": "M", "name": "process_name"}, *events]}, handle)


def test_busy_time_gaps_steps_and_growth(tmp_path: Path) -> None:
    steps = [
        _event("user_annotation", "execute_context_2(300)_generation_0(0)", 0, 50),
        _event("user_annotation", "execute_context_1(200)_generation_0(0)", 1000, 40),
    ]
    _write_trace(
        tmp_path / "plain",
        [*steps, _event("kernel", "gemm", 10, 900, stream=7), _event("kernel", "gemm", 1010, 900, stream=7)],
    )
    _write_trace(
        tmp_path / "null",
        [
            *steps,
            _event("cuda_runtime", "cudaGraphLaunch", 5, 3, correlation=1),  # inside step 1
            _event("cuda_runtime", "cudaLaunchKernel", 1002, 3, correlation=2),  # inside step 2
            _event("kernel", "gemm", 10, 900, stream=7, correlation=1),
            _event("kernel", "gemm", 1010, 900, stream=7, correlation=2),
            # overlaps the first gemm: not extra busy time; launched in step 1
            _event("kernel", "copy", 500, 600, stream=21, correlation=1),
            _event("gpu_memcpy", "Memcpy DtoH (Device -> Pinned)", 1100, 100, stream=21, bytes=4096),
            _event("user_annotation", "eagle3_capture: gather", 60, 50),
        ],
    )
    gaps = _module()
    plain, null = gaps.summarize(tmp_path / "plain"), gaps.summarize(tmp_path / "null")

    assert (plain["steps"], plain["tokens"], plain["step_period_ms"]) == (2, 500, [1.0])
    assert plain["window_ms"] == 1.9 and plain["gpu_busy_ms"] == 1.8  # 0..1910 us, 100 us idle
    assert plain["gpu_gaps_over_0.5ms"]["count"] == 0  # the 100 us gap is below the threshold
    assert null["gpu_busy_ms"] == 1.9  # the copy and memcpy fill 910..1010, the rest overlaps
    assert null["step_gpu_ms"] == [1.1, 0.9]  # step 1's gemm and copy (10..1100), step 2's gemm
    assert plain["step_gpu_ms"] == [None, None]  # no runtime calls recorded: nothing to attribute
    assert null["memcpy_bytes"] == {"Memcpy DtoH (Device -> Pinned)": 4096}
    growth = gaps.growth(plain["kernels"], null["kernels"])
    assert growth[0] == {"name": "copy", "null_ms": 0.6, "plain_ms": 0.0, "extra_ms": 0.6}
    assert {row["name"]: row["extra_ms"] for row in growth}["gemm"] == 0.0
    assert null["annotations"] == [{"name": "eagle3_capture: gather", "ms": 0.05, "calls": 1}]


def test_growth_counts_what_plain_ran_below_its_largest_kernels(tmp_path: Path) -> None:
    step = _event("user_annotation", "execute_context_1(100)_generation_0(0)", 0, 10)
    large = [_event("kernel", f"k{i}", 10 + 2000 * i, 1000 + i) for i in range(30)]
    _write_trace(tmp_path / "plain", [step, *large, _event("kernel", "small", 70000, 100)])
    _write_trace(tmp_path / "null", [step, *large, _event("kernel", "small", 70000, 400)])
    gaps = _module()
    plain, null = gaps.summarize(tmp_path / "plain"), gaps.summarize(tmp_path / "null")
    top = gaps.growth(plain["kernels"], null["kernels"])[0]
    # plain ran "small" as its 31st kernel by time: it grew by 0.3 ms, not by all of its 0.4
    assert top == {"name": "small", "null_ms": 0.4, "plain_ms": 0.1, "extra_ms": 0.3}
