"""Compare the torch-profiler traces that ``python -m job bench --profile-dir DIR`` writes
(DIR/plain, DIR/null): where the job's null pass spends the time that plain prefill does not.

usage: python .ci/profile_gaps.py DIR [--out FILE.json]

Per trace: the profiled window (first to last vLLM step annotation), the GPU's busy time in it
(union of kernels, copies and memsets over all streams), its idle gaps, the step annotations' CPU
time and the GPU time of the work each step launched, the time per kernel, CUDA runtime call,
CPU op and range; then the names whose total time grew most from plain to null. Plain and null run
the same prompts, so totals compare.
"""

from __future__ import annotations

import argparse
import collections
import gzip
import itertools
import json
import re
from pathlib import Path
from typing import Any

GPU_CATEGORIES = {"kernel", "gpu_memcpy", "gpu_memset"}
RUNTIME_CATEGORIES = {"cuda_runtime", "cuda_driver"}
STEP = re.compile(r"execute_context_(\d+)\((\d+)\)_generation_(\d+)\((\d+)\)")
GAP_US = 500.0


def load_events(directory: Path) -> list[dict[str, Any]]:
    traces = sorted(directory.glob("*.pt.trace.json*"))
    if not traces:
        raise SystemExit(f"{directory}: no *.pt.trace.json(.gz) (was the bench run with --profile-dir?)")
    opener = gzip.open if traces[-1].suffix == ".gz" else open
    with opener(traces[-1], "rt") as handle:
        return [e for e in json.load(handle)["traceEvents"] if e.get("ph") == "X"]


def union_us(intervals: list[tuple[float, float]]) -> tuple[float, list[float]]:
    """Busy time of the merged intervals and the gaps between them."""
    busy, gaps, end = 0.0, [], None
    for start, stop in sorted(intervals):
        if end is None or start > end:
            if end is not None:
                gaps.append(start - end)
            busy += stop - start
            end = stop
        elif stop > end:
            busy += stop - end
            end = stop
    return busy, gaps


def totals(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Time and calls per event name, largest first (all names: ``growth`` needs plain's whole list)."""
    by_name: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        entry = by_name[e["name"][:120]]
        entry[0] += e["dur"]
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda item: -item[1][0])
    return [{"name": n, "ms": round(t / 1e3, 2), "calls": c} for n, (t, c) in ranked]


def step_gpu_ms(steps: list[dict[str, Any]], events: list[dict[str, Any]]) -> list[float | None]:
    """Per step: the GPU busy time of the work its annotation launched, found through the CUDA
    runtime calls made inside the annotation on its thread and their correlation ids (a CUDA
    graph launch is one call, many kernels). None where a step launched nothing."""
    by_correlation: dict[Any, list[dict[str, Any]]] = collections.defaultdict(list)
    for e in events:
        if e.get("cat") in GPU_CATEGORIES and "correlation" in (e.get("args") or {}):
            by_correlation[e["args"]["correlation"]].append(e)
    calls = [e for e in events if e.get("cat") in RUNTIME_CATEGORIES]
    result: list[float | None] = []
    for step in steps:
        end = step["ts"] + step["dur"]
        launched = [
            g
            for c in calls
            if c.get("tid") == step.get("tid") and step["ts"] <= c["ts"] <= end
            for g in by_correlation.get((c.get("args") or {}).get("correlation"), [])
        ]
        busy, _ = union_us([(g["ts"], g["ts"] + g["dur"]) for g in launched])
        result.append(round(busy / 1e3, 1) if launched else None)
    return result


def summarize(directory: Path) -> dict[str, Any]:
    events = load_events(directory)
    annotations = [(e, STEP.match(e["name"])) for e in events if e.get("cat") == "user_annotation"]
    matched = sorted(((e, m) for e, m in annotations if m), key=lambda pair: pair[0]["ts"])
    steps = [e for e, _ in matched]
    tokens = [int(m.group(2)) + int(m.group(4)) for _, m in matched]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    window = (steps[0]["ts"], max(e["ts"] + e["dur"] for e in steps + gpu)) if steps else (0.0, 0.0)
    in_window = [e for e in gpu if window[0] <= e["ts"] <= window[1]]
    busy, gaps = union_us([(e["ts"], e["ts"] + e["dur"]) for e in in_window])
    streams: dict[Any, float] = collections.Counter()
    for e in in_window:
        streams[(e.get("args") or {}).get("stream", e.get("tid"))] += e["dur"]
    copies = collections.Counter()
    for e in in_window:
        if e.get("cat") == "gpu_memcpy":
            copies[e["name"]] += (e.get("args") or {}).get("bytes", 0)
    big_gaps = sorted((g for g in gaps if g >= GAP_US), reverse=True)
    periods = [b["ts"] - a["ts"] for a, b in itertools.pairwise(steps)]
    return {
        "directory": str(directory),
        "steps": len(steps),
        "tokens": sum(tokens),
        "window_ms": round((window[1] - window[0]) / 1e3, 1),
        "gpu_busy_ms": round(busy / 1e3, 1),
        "gpu_busy_fraction": round(busy / max(window[1] - window[0], 1.0), 4),
        "gpu_gaps_over_0.5ms": {
            "count": len(big_gaps),
            "total_ms": round(sum(big_gaps) / 1e3, 1),
            "largest_ms": [round(g / 1e3, 2) for g in big_gaps[:12]],
        },
        "stream_busy_ms": {str(k): round(v / 1e3, 1) for k, v in streams.most_common(6)},
        "memcpy_bytes": dict(copies),
        "step_cpu_ms": [round(e["dur"] / 1e3, 1) for e in steps],
        "step_period_ms": [round(p / 1e3, 1) for p in periods],
        "step_tokens": tokens,
        "step_gpu_ms": step_gpu_ms(steps, events),
        "kernels": totals([e for e in in_window if e.get("cat") == "kernel"]),
        "runtime": totals([e for e in events if e.get("cat") in RUNTIME_CATEGORIES]),
        "cpu_ops": totals([e for e in events if e.get("cat") == "cpu_op"]),
        "annotations": totals([e for e, m in annotations if not m]),
    }


def growth(plain: list[dict[str, Any]], null: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The 12 names whose time grew most from plain to null (0 for a name plain never ran)."""
    before = {row["name"]: row["ms"] for row in plain}
    rows = [{"name": r["name"], "null_ms": r["ms"], "plain_ms": before.get(r["name"], 0.0)} for r in null]
    for row in rows:
        row["extra_ms"] = round(row["null_ms"] - row["plain_ms"], 2)
    return sorted(rows, key=lambda r: -r["extra_ms"])[:12]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("profile_dir", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    plain, null = (summarize(args.profile_dir / name) for name in ("plain", "null"))
    report = {
        "plain": plain,
        "null": null,
        "kernel_growth": growth(plain["kernels"], null["kernels"]),
        "runtime_growth": growth(plain["runtime"], null["runtime"]),
        "cpu_op_growth": growth(plain["cpu_ops"], null["cpu_ops"]),
        "annotation_growth": growth(plain["annotations"], null["annotations"]),
    }
    for name, part in (("plain", plain), ("null", null)):
        print(
            f"{name}: {part['steps']} steps, {part['tokens']} tokens, window {part['window_ms']} ms, "
            f"GPU busy {part['gpu_busy_ms']} ms ({part['gpu_busy_fraction']:.1%}), "
            f"gaps>0.5ms {part['gpu_gaps_over_0.5ms']}"
        )
        print(f"  step period ms: {part['step_period_ms']}")
        print(f"  step cpu ms:    {part['step_cpu_ms']}")
        print(f"  step tokens:    {part['step_tokens']}")
        print(f"  step GPU ms:    {part['step_gpu_ms']}")
        print(f"  streams: {part['stream_busy_ms']}  memcpy bytes: {part['memcpy_bytes']}")
    for key in ("kernel_growth", "runtime_growth", "cpu_op_growth", "annotation_growth"):
        print(key)
        for row in report[key]:
            print(
                f"  {row['extra_ms']:>9.2f} ms (plain {row['plain_ms']}, null {row['null_ms']}) {row['name']}"
            )
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
