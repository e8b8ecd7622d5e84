"""``python -m job.benchmarks.real_activations``: the backends and FP8 storage on a real model's activations.

SmolLM2-135M-Instruct (``builtin:smollm2-135m-instruct``, layer ids 2, 15, 27, 30) answers
``--prompts`` one-turn prompts of varied kinds through its own ChatML template: a ``python -m
job run`` with ``generate.mode: last_turn`` on the first ``--vllm`` interpreter. Those samples'
token ids and loss masks become pre-tokenized input (``data.format: tokenized``), so every
backend below sees exactly the same tokens:

* the HF backend at float32 (the reference) and at bfloat16 (how far a correct bf16 forward
  drifts from it), on this interpreter;
* each ``--vllm`` interpreter (a venv's python with a vLLM CPU build) at bfloat16, its hidden
  states stored in the model dtype and as FP8 (``output.hidden_dtype: fp8_e4m3``).

Every run is a ``python -m job`` subprocess with this checkout first on ``PYTHONPATH``; every
comparison is ``python -m job compare CANDIDATE --reference REF`` (the worst relative error per
sample and layer, ||a - b|| / ||b||).

Then what FP8's per-token scales see (read back from the outputs here): per layer, the crest
factor (a token's absmax over its RMS), which channels hold the absmax and how often, the share
of elements that fall below e4m3's normal range once scaled (448 * |x| / absmax < 2^-6), and
FP8's per-token relative error on the tokens of largest crest factor against the rest, over the
whole row and over the row without its absmax channel. The same for the builtin tiny random
Llama (layer ids 2, 4, 5, 8) on the same conversations as SmolLM2 wrote them (text through the
tiny model's template, HF at bfloat16): what real activations change.

Rows go to ``--out``/results.jsonl (``config: "real_activations"``); markdown tables are printed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs" / "benchmarks"
REAL_MODEL = "builtin:smollm2-135m-instruct"
TINY_MODEL = "builtin:tiny-llama"
_FP8_MAX = 448.0
_FP8_MIN_NORMAL = 2.0**-6  # e4m3's smallest normal; below it, subnormals of fewer bits

# One-turn prompts of varied kinds (facts, arithmetic, code, translation, unicode, lists, JSON,
# prose, poetry): the model writes the answers.
PROMPTS = (
    "What is the capital of France?",
    "Write a Python function that returns the n-th Fibonacci number.",
    "What is 17 * 23? Show your steps.",
    "Translate 'Where is the train station?' into French and Spanish.",
    "Write a haiku about autumn leaves.",
    "Qu'est-ce que « la joie de vivre » veut dire ? Réponds en une phrase.",
    "Return a JSON object with the keys name, age and city for a fictional person.",
    "Explain recursion to a ten-year-old.",
    "What is the difference between TCP and UDP?",
    "List five tips for better sleep.",
    "Write a SQL query that returns the ten customers with the highest total order amount from "
    "tables customers(id, name) and orders(customer_id, amount).",
    "Summarize in one sentence: Photosynthesis is the process by which green plants use sunlight, "
    "water and carbon dioxide to make glucose and oxygen. It takes place mainly in the leaves, "
    "inside chloroplasts, and it is the source of almost all the oxygen in the atmosphere.",
    "Is 221 a prime number? Explain.",
    "Fix the bug in this function: def add(a, b): return a - b",
    "Write a short email to my manager asking for Friday off.",
    "Sort these numbers in ascending order: 42, 7, 19, 3, 88, 21.",
    "Who wrote Pride and Prejudice, and when was it published?",
    "What causes the seasons on Earth?",
    "Give me three names for a coffee shop run by cats.",
    "Convert 72 degrees Fahrenheit to Celsius.",
    "Explain what a hash table is in two sentences.",
    "What are the pros and cons of electric cars?",
    "Tell me a joke about computers.",
    "Write a short poem about the sea.",
)


@dataclass
class Run:
    name: str
    out: Path
    seconds: float  # wall seconds of the process
    loads: tuple[float, float]  # the machine's load average when it started and ended
    finished: dict[str, Any]  # its run_finished event
    backend: dict[str, Any]  # the manifest's backend info


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.work = Path(args.work_dir)
        self.env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("JOB_") or k == "JOB_CACHE_DIR"},
            "PYTHONPATH": os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p),
            "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        }
        self.started = time.perf_counter()

    def log(self, text: str) -> None:
        load = os.getloadavg()[0]
        print(
            f"[{time.perf_counter() - self.started:7.1f}s load {load:4.1f}] {text}",
            file=sys.stderr,
            flush=True,
        )

    def job(self, name: str, python: str, settings: list[str]) -> Run:
        """``python -m job run SETTINGS --output.uri=WORK/NAME``; it must exit 0. With ``--reuse``,
        an earlier run's complete output (and what it recorded) stands for it."""
        out, record = self.work / name, self.work / f"{name}.run.json"
        if self.args.reuse and record.is_file():
            kept = json.loads(record.read_text())
            self.log(f"{name}: reused ({kept['finished']['tokens']} tokens, {kept['seconds']:.0f} s)")
            return Run(
                name, out, kept["seconds"], tuple(kept["loads"]), kept["finished"], _manifest(out)["backend"]
            )
        self.log(f"{name}: {Path(python).parent.parent.name} python -m job run")
        started, load = time.perf_counter(), os.getloadavg()[0]
        proc = subprocess.run(
            [
                python,
                "-m",
                "job",
                "run",
                "--log.format=json",
                "--data.tokenizer_workers=0",
                f"--output.uri={out}",
                *settings,
            ],
            env=self.env,
            capture_output=True,
            text=True,
        )
        seconds = time.perf_counter() - started
        (self.work / f"{name}.log").write_text(proc.stdout + proc.stderr)
        if proc.returncode != 0:
            raise SystemExit(f"{name}: python -m job run exited {proc.returncode}:\n{proc.stderr[-3000:]}")
        events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
        finished = next(e for e in events if e.get("event") == "run_finished")
        loads = (round(load, 1), round(os.getloadavg()[0], 1))
        record.write_text(json.dumps({"seconds": seconds, "loads": loads, "finished": finished}))
        self.log(f"{name}: {finished['tokens']} tokens, {seconds:.0f} s")
        return Run(name, out, seconds, loads, finished, _manifest(out)["backend"])

    def vllm_settings(self) -> list[str]:
        return [
            "--backend.name=vllm",
            "--model.dtype=bfloat16",
            f"--backend.vllm.enforce_eager={not self.args.compiled}",
            f"--backend.vllm.max_num_batched_tokens={self.args.max_num_batched_tokens}",
            "--backend.vllm.max_num_seqs=16",
            '--backend.vllm.engine_args={"block_size": 16}',
            "--preflight.before_run=false",  # the run's engine start-up only, once
        ]

    def compare(self, candidate: Run, reference: Run) -> dict[str, Any]:
        """``python -m job compare``'s figures (any tolerance: exit 0 or 1 both report)."""
        proc = subprocess.run(
            [sys.executable, "-m", "job", "compare", str(candidate.out), "--reference", str(reference.out)],
            env=self.env,
            capture_output=True,
            text=True,
        )
        if proc.returncode not in (0, 1):
            raise SystemExit(
                f"compare {candidate.name} {reference.name}: exit {proc.returncode}: {proc.stderr}"
            )
        return {**parse_comparison(proc.stdout), "summary": proc.stdout.strip()}


def parse_comparison(summary: str) -> dict[str, Any]:
    """The figures of one ``python -m job compare`` summary line."""
    per_layer = re.search(r"worst per layer \{([^}]*)\}", summary)
    counts = re.search(r"mismatched (\d+).*missing (\d+), extra (\d+)", summary)
    samples = re.search(r"(\d+) samples compared", summary)
    worst = re.search(r"worst relative error ([0-9.e+-]+)", summary)
    if not (per_layer and counts and samples and worst):
        raise SystemExit(f"cannot read python -m job compare's summary: {summary!r}")
    return {
        "samples": int(samples.group(1)),
        "worst": float(worst.group(1)),
        "per_layer": {
            int(k): float(v) for k, v in (item.split(": ") for item in per_layer.group(1).split(", ") if item)
        },
        "mismatched": int(counts.group(1)),
        "missing": int(counts.group(2)),
        "extra": int(counts.group(3)),
    }


def write_prompts(path: Path, count: int) -> None:
    if not 1 <= count <= len(PROMPTS):
        raise SystemExit(f"--prompts: 1 to {len(PROMPTS)}")
    with path.open("w") as f:
        for i, prompt in enumerate(PROMPTS[:count]):
            f.write(
                json.dumps({"id": f"p-{i:02d}", "messages": [{"role": "user", "content": prompt}]}) + "\n"
            )


def write_inputs(generated: Path, tokenized: Path, conversations: Path) -> int:
    """The generated samples as pre-tokenized records (ids, loss masks) and as conversations
    (their text, from the regeneration sidecars); returns the samples."""
    from job.shards import iter_output

    count = 0
    with tokenized.open("w") as f:
        for s in iter_output(generated, require_complete=True):
            record = {"id": s.sample_id, "input_ids": s.input_ids.tolist(), "loss_mask": s.loss_mask.tolist()}
            f.write(json.dumps(record) + "\n")
            count += 1
    with conversations.open("w") as f:
        for sidecar in sorted(generated.glob("index-*/shard-*.regenerated.jsonl")):
            for line in sidecar.read_text().splitlines():
                turn = json.loads(line)
                f.write(json.dumps({"id": turn["sample_id"], "messages": turn["messages"]}) + "\n")
    return count


def token_errors(candidate: Path, reference: Path) -> dict[str, dict[int, float]]:
    """Per layer: the worst per-sample relative error without each sample's first token, and the
    median, 99th percentile and largest per-token relative error ||a - b|| / ||b||. A real
    model's first token carries a massive activation (its norm 10-100 times the others'), and a
    per-sample norm is then mostly that token's."""
    from job.shards import iter_output

    ref = {s.sample_id: s.hidden_states.float() for s in iter_output(reference, require_complete=True)}
    without_first: list[torch.Tensor] = []
    per_token: list[torch.Tensor] = []
    layer_ids: list[int] = []
    for s in iter_output(candidate, require_complete=True):
        a, b = s.hidden_states.float(), ref[s.sample_id]
        without_first.append((a[1:] - b[1:]).norm(dim=(0, 2)) / b[1:].norm(dim=(0, 2)))
        per_token.append((a - b).norm(dim=-1) / b.norm(dim=-1))
        layer_ids = s.layer_ids
    worst = torch.stack(without_first).amax(dim=0)
    tokens = torch.cat(per_token)
    figures = {
        "without_first_token": worst,
        "token_median": tokens.median(dim=0).values,
        "token_p99": torch.quantile(tokens, 0.99, dim=0),
        "token_max": tokens.amax(dim=0),
    }
    return {
        name: {k: float(f"{v:.3g}") for k, v in zip(layer_ids, values.tolist(), strict=True)}
        for name, values in figures.items()
    }


# Where one FP8 scale is shared, as ``scale(states)`` [T, L, H] -> a broadcastable absmax:
# the job's (a token's row in one layer), speculators 0.9's (a token, all its layers) and one
# per sample and layer (every token of a sequence).
SCALE_SCHEMES = {
    "token_layer": lambda states: states.abs().amax(dim=-1, keepdim=True),
    "token": lambda states: states.abs().amax(dim=(1, 2), keepdim=True),
    "sample_layer": lambda states: states.abs().amax(dim=(0, 2), keepdim=True),
}


def _fp8_round_trip(states: torch.Tensor, absmax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``states`` stored as e4m3 with scales ``absmax / 448`` and read back (float32), and which
    elements fell below e4m3's normal range once scaled."""
    scales = absmax.clamp(min=1e-12) / _FP8_MAX
    scaled = states / scales
    below = (scaled != 0) & (scaled.abs() < _FP8_MIN_NORMAL)
    return scaled.to(torch.float8_e4m3fn).float() * scales, below


def outlier_stats(base: Path, fp8: Path, high_crest_share: float) -> dict[int, dict[str, Any]]:
    """Per layer of ``base``'s states: crest factors (a token's absmax over its RMS, at most
    sqrt(H)), the channels that hold the absmax, FP8's per-token relative error as stored in
    ``fp8`` (the same backend's run) on the tokens of largest crest factor (the top
    ``high_crest_share``) against the rest, over the row and without its absmax channel; and
    per scale scheme of ``SCALE_SCHEMES``, the mean per-token error and the share of elements
    below e4m3's normal range."""
    from job.hidden_dtype import FP8
    from job.shards import iter_output

    stored = {s.sample_id: s.hidden_states for s in iter_output(fp8, require_complete=True)}
    rows: list[torch.Tensor] = []  # [T, L, H] per sample
    decoded: list[torch.Tensor] = []
    first: list[torch.Tensor] = []  # is the token its sample's first
    schemes: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {k: [] for k in SCALE_SCHEMES}
    layer_ids: list[int] = []
    for s in iter_output(base, require_complete=True):
        states = s.hidden_states.float()
        rows.append(states)
        decoded.append(stored[s.sample_id].float())
        first.append(torch.arange(len(s.input_ids)) == 0)
        layer_ids = s.layer_ids
        for name, absmax in SCALE_SCHEMES.items():
            back, below = _fp8_round_trip(states, absmax(states))
            schemes[name].append(
                ((back - states).norm(dim=-1) / states.norm(dim=-1), below.float().mean(dim=-1))
            )
    x, y, is_first = torch.cat(rows), torch.cat(decoded), torch.cat(first)
    # Are the stored rows the job's encoding of exactly these states (the forward deterministic)?
    fp8_rows, fp8_scales = FP8.encode(x.to(torch.bfloat16))
    same = (fp8_rows.float() * fp8_scales.unsqueeze(-1)).to(torch.bfloat16).float() == y
    by_scheme = {k: (torch.cat([e for e, _ in v]), torch.cat([b for _, b in v])) for k, v in schemes.items()}
    stats: dict[int, dict[str, Any]] = {}
    for j, layer in enumerate(layer_ids):
        states, error = x[:, j], y[:, j] - x[:, j]
        absmax, channel = states.abs().max(dim=-1)
        crest = absmax / states.pow(2).mean(dim=-1).sqrt()
        relative = error.norm(dim=-1) / states.norm(dim=-1)
        others = torch.ones_like(states, dtype=torch.bool).scatter_(1, channel.unsqueeze(1), False)
        rest = (error * others).norm(dim=-1) / (states * others).norm(dim=-1)
        high = crest >= torch.quantile(crest, 1 - high_crest_share)
        channels, counts = channel.unique(return_counts=True)
        top = counts.argsort(descending=True)[:3]
        stats[layer] = {
            "tokens": len(crest),
            "hidden_size": states.shape[-1],
            "crest_median": round(crest.median().item(), 2),
            "crest_p99": round(torch.quantile(crest, 0.99).item(), 2),
            "crest_max": round(crest.max().item(), 2),
            "crest_first_token_median": round(crest[is_first].median().item(), 2),
            "absmax_median": _figure(absmax.median()),
            "absmax_max": _figure(absmax.max()),
            "absmax_channels": [
                {"channel": int(channels[i]), "share": round(counts[i].item() / len(crest), 3)} for i in top
            ],
            "high_crest_first_token_share": round(is_first[high].float().mean().item(), 3),
            "fp8_equals_encoding_share": round(same[:, j].all(dim=-1).float().mean().item(), 4),
            "fp8_error_high_crest": _figure(relative[high].mean()),
            "fp8_error_other": _figure(relative[~high].mean()),
            "fp8_error_high_crest_without_absmax": _figure(rest[high].mean()),
            "fp8_error_other_without_absmax": _figure(rest[~high].mean()),
            "scale_schemes": {
                name: {
                    "error_mean": _figure(err[:, j].mean()),
                    "below_normal_share": _figure(below[:, j].mean()),
                }
                for name, (err, below) in by_scheme.items()
            },
        }
    return stats


def _figure(value: torch.Tensor) -> float:
    """Three significant digits."""
    return float(f"{value.item():.3g}")


def machine() -> dict[str, Any]:
    name = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        found = re.search(r"model name\s*:\s*(.+)", cpuinfo.read_text())
        name = found.group(1).strip() if found else name
    return {"cpu": name, "cores": os.cpu_count()}


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    bench = Bench(args)
    if not args.reuse:
        shutil.rmtree(bench.work, ignore_errors=True)
    bench.work.mkdir(parents=True, exist_ok=True)
    prompts = bench.work / "prompts.jsonl"
    write_prompts(prompts, args.prompts)
    generated = bench.job(
        "generated",
        args.vllm[0],
        [
            f"--model.path={REAL_MODEL}",
            f"--data.path={prompts}",
            "--data.format=openai",
            "--generate.mode=last_turn",
            f"--generate.max_new_tokens={args.max_new_tokens}",
            f"--generate.temperature={args.temperature}",
            "--generate.seed=0",
            *bench.vllm_settings(),
        ],
    )
    tokenized, conversations = bench.work / "tokenized.jsonl", bench.work / "conversations.jsonl"
    samples = write_inputs(generated.out, tokenized, conversations)
    real = [f"--model.path={REAL_MODEL}", f"--data.path={tokenized}", "--data.format=tokenized"]
    hf32 = bench.job("hf-float32", sys.executable, [*real, "--backend.name=hf", "--model.dtype=float32"])
    candidates = [
        bench.job("hf-bfloat16", sys.executable, [*real, "--backend.name=hf", "--model.dtype=bfloat16"])
    ]
    pairs: list[tuple[Run, Run]] = []  # (model-dtype storage, FP8 storage) of one backend
    for i, python in enumerate(args.vllm):
        bf16 = bench.job(f"vllm{i}-bfloat16", python, [*real, *bench.vllm_settings()])
        fp8 = bench.job(
            f"vllm{i}-bfloat16-fp8", python, [*real, *bench.vllm_settings(), "--output.hidden_dtype=fp8_e4m3"]
        )
        candidates += [bf16, fp8]
        pairs.append((bf16, fp8))
    tiny = [f"--model.path={TINY_MODEL}", f"--data.path={conversations}", "--data.format=openai"]
    tiny_bf16 = bench.job("tiny-hf-bfloat16", sys.executable, [*tiny, "--backend.name=hf"])
    tiny_fp8 = bench.job(
        "tiny-hf-bfloat16-fp8", sys.executable, [*tiny, "--backend.name=hf", "--output.hidden_dtype=fp8_e4m3"]
    )
    runs = [generated, hf32, *candidates, tiny_bf16, tiny_fp8]
    loads = [load for run in runs for load in run.loads]

    common = {
        "config": "real_activations",
        **machine(),
        "prompts": args.prompts,
        "samples": samples,
        "tokens": hf32.finished["tokens"],
        "max_new_tokens": args.max_new_tokens,
        "temperature": args.temperature,
        "compiled": args.compiled,
        "load_average": [round(min(loads), 1), round(max(loads), 1)],
        "label": args.label,
    }
    rows: list[dict[str, Any]] = []

    def compared(candidate: Run, reference: Run, model: str) -> None:
        figures = bench.compare(candidate, reference)
        bench.log(figures["summary"])
        rows.append(
            {
                **common,
                "table": "compare",
                "model": model,
                "candidate": candidate.name,
                "reference": reference.name,
                "backend": candidate.backend.get("backend"),
                "vllm": candidate.backend.get("vllm_version"),
                "capture": candidate.backend.get("capture"),
                "storage": _manifest(candidate.out)["identity"]["storage"],
                **{k: v for k, v in figures.items() if k != "summary"},
                **token_errors(candidate.out, reference.out),
                "run_seconds": round(candidate.seconds, 1),
            }
        )

    for candidate in candidates:
        compared(candidate, hf32, REAL_MODEL)
    for bf16, fp8 in pairs:
        compared(fp8, bf16, REAL_MODEL)
    for bf16, _ in pairs[1:]:  # one vLLM line against the other
        compared(bf16, pairs[0][0], REAL_MODEL)
    compared(tiny_fp8, tiny_bf16, TINY_MODEL)
    for model, (base, fp8) in ((REAL_MODEL, pairs[0]), (TINY_MODEL, (tiny_bf16, tiny_fp8))):
        for layer, figures in outlier_stats(base.out, fp8.out, args.high_crest_share).items():
            rows.append(
                {
                    **common,
                    "table": "outliers",
                    "model": model,
                    "states": base.name,
                    "layer": layer,
                    "high_crest_share": args.high_crest_share,
                    **figures,
                }
            )
    return rows


def _manifest(out: Path) -> dict[str, Any]:
    manifest: dict[str, Any] = json.loads((out / "index-00000" / "manifest.json").read_text())
    if not manifest["complete"]:
        raise SystemExit(f"{out}: the run did not complete (run without --reuse)")
    return manifest


def _e(value: float) -> str:
    """docs/gpu.md's way: 6.76e-3."""
    mantissa, exponent = f"{value:.2e}".split("e")
    return f"{mantissa}e{int(exponent)}"


def print_tables(rows: list[dict[str, Any]]) -> None:
    compared = [r for r in rows if r["table"] == "compare"]
    layers = ", ".join(str(k) for k in sorted(compared[0]["per_layer"]))
    print(f"| model | candidate | reference | vLLM, capture | samples | worst (layers {layers}) |")
    print("|---|---|---|---|---|---|")
    for r in compared:
        per_layer = ", ".join(_e(v) for _, v in sorted(r["per_layer"].items()))
        engine = f"{r['vllm']}, {r['capture']}" if r["vllm"] else ""
        mismatched = r["mismatched"] + r["missing"] + r["extra"]
        print(
            f"| {r['model'].removeprefix('builtin:')} | {r['candidate']} | {r['reference']} | {engine} "
            f"| {r['samples']}{f' ({mismatched} not comparable)' if mismatched else ''} "
            f"| {_e(r['worst'])} ({per_layer}) |"
        )
    print()
    print(
        f"| model | candidate | reference | worst without the first token (layers {layers}) "
        "| per token: median | p99 | max |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in compared:
        cells = " | ".join(
            ", ".join(_e(v) for _, v in sorted(r[name].items()))
            for name in ("without_first_token", "token_median", "token_p99", "token_max")
        )
        print(f"| {r['model'].removeprefix('builtin:')} | {r['candidate']} | {r['reference']} | {cells} |")
    outliers = [r for r in rows if r["table"] == "outliers"]
    print()
    print(
        "| model | layer | crest median / p99 / max (bound √H) | first token's crest | absmax median / max "
        "| absmax channels (share of tokens) |"
    )
    print("|---|---|---|---|---|---|")
    for r in outliers:
        channels = ", ".join(f"{c['channel']} ({c['share']:.1%})" for c in r["absmax_channels"])
        print(
            f"| {r['model'].removeprefix('builtin:')} | {r['layer']} "
            f"| {r['crest_median']} / {r['crest_p99']} / {r['crest_max']} ({r['hidden_size'] ** 0.5:.1f}) "
            f"| {r['crest_first_token_median']} | {r['absmax_median']:g} / {r['absmax_max']:g} | {channels} |"
        )
    print()
    print(
        "| model | layer | FP8 per-token error: top crest / rest | without the absmax channel "
        "| mean error (share below e4m3's normal range): one scale per token & layer (the job) / "
        "per token / per sample & layer "
        "| stored = encoding |"
    )
    print("|---|---|---|---|---|---|")
    for r in outliers:
        schemes = " / ".join(
            f"{_e(v['error_mean'])} ({v['below_normal_share']:.2%})" for v in r["scale_schemes"].values()
        )
        print(
            f"| {r['model'].removeprefix('builtin:')} | {r['layer']} "
            f"| {_e(r['fp8_error_high_crest'])} / {_e(r['fp8_error_other'])} "
            f"| {_e(r['fp8_error_high_crest_without_absmax'])} / {_e(r['fp8_error_other_without_absmax'])} "
            f"| {schemes} | {r['fp8_equals_encoding_share']:.0%} |"
        )


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m job.benchmarks.real_activations", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument(
        "--vllm",
        action="append",
        required=True,
        help="the python of a venv with a vLLM CPU build (repeat for each; the first also generates)",
    )
    ap.add_argument("--prompts", type=int, default=16, help=f"how many of the {len(PROMPTS)} prompts")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512, help="vLLM: several steps, chunked")
    ap.add_argument("--compiled", action="store_true", help="vLLM's compilation (default: eager, hooks)")
    ap.add_argument(
        "--high-crest-share", type=float, default=0.05, help="the tokens of largest crest factor, per layer"
    )
    ap.add_argument("--work-dir", default="/tmp/eagle3-real-activations")
    ap.add_argument(
        "--reuse", action="store_true", help="keep --work-dir's completed runs; run only what is missing"
    )
    ap.add_argument("--out", default=str(DOCS), help="results.jsonl goes here ('': print only)")
    ap.add_argument("--label", default="", help="recorded in every row (e.g. the commit measured)")
    args = ap.parse_args(argv)
    rows = run(args)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    for row in rows:
        row["run_id"] = stamp
    if args.out:
        with (Path(args.out) / "results.jsonl").open("a") as f:
            f.writelines(json.dumps(row) + "\n" for row in rows)
    print_tables(rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
