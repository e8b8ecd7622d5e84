"""``python -m job.benchmarks.speculators_export``: what a reference export saves, and what it costs
speculators' data loader.

One output (``--output``; default: the builtin tiny model run on the bundled examples into
``--work-dir``) is exported twice, ``--hidden-states copy`` and ``--hidden-states reference``;
the bytes each writes are counted (every file under DST). Then speculators 0.9's own
training loaders (``create_train_val_loaders``: ``ArrowDataset``, the multipack sampler,
``CollateFn`` with ``shift_batch``) read every row of each export: the ``file`` backend its
``hs_{row}.safetensors`` files, ``eagle3-extract`` our shards. Configurations alternate over
``--rounds``; in each, a first pass over the data (it includes starting the workers) is followed
by ``--passes`` timed ones (their median is the figure), all from the page cache (just
written). A JSON row per configuration and round goes to ``--out``/speculators.jsonl; a
markdown table is printed last.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

DOCS = Path(__file__).resolve().parents[2] / "docs" / "benchmarks"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m job.benchmarks.speculators_export", description=__doc__)
    parser.add_argument("--output", help="an existing output (default: run the tiny model into --work-dir)")
    parser.add_argument("--work-dir", help="where the output and exports go (default: a temp dir)")
    parser.add_argument("--workers", default="0,2", help="DataLoader workers to measure, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--passes", type=int, default=3, help="timed passes per round, after the first")
    parser.add_argument("--total-seq-len", type=int, default=2048, help="tokens per packed batch")
    parser.add_argument("--out", default=str(DOCS), help="directory for speculators.jsonl")
    args = parser.parse_args(argv)

    importlib.import_module("job.speculators")  # registers eagle3-extract before speculators' imports
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-speculators-"))
    work.mkdir(parents=True, exist_ok=True)
    output = Path(args.output) if args.output else _tiny_output(work / "out")
    rows = _export_bytes(output, work)
    for _ in range(args.rounds):
        for workers in map(int, args.workers.split(",")):
            for mode in ("copy", "reference"):
                rows.append(_read(work / mode, mode, workers, args.total_seq_len, args.passes))
                print(json.dumps(rows[-1]), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    with (out / "speculators.jsonl").open("a") as f:
        for row in rows:
            f.write(json.dumps({"date": stamp, "output": str(output), **row}) + "\n")
    print(_table(rows))
    return 0


def _tiny_output(out: Path) -> Path:
    from job.cli import main as job_main

    if not out.exists():
        rc = job_main(["run", f"--output.uri={out}", "--data.tokenizer_workers=0", "--log.level=warning"])
        if rc:
            raise SystemExit(f"python -m job run exited {rc}")
    return out


def _tree_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _export_bytes(output: Path, work: Path) -> list[dict[str, Any]]:
    from job.export import export

    shards = sum(f.stat().st_size for f in output.rglob("shard-*.safetensors"))
    rows = []
    for mode in ("copy", "reference"):
        dest = work / mode
        shutil.rmtree(dest, ignore_errors=True)
        started = time.perf_counter()
        summary = export("speculators", str(output), str(dest), hidden_states=mode)
        seconds = round(time.perf_counter() - started, 2)
        written = _tree_bytes(dest)
        rows.append(
            {
                "config": f"export_{mode}",
                "bytes_written": written,
                "shard_bytes": shards,
                "fraction_of_shards": round(written / shards, 5),
                "rows": summary.rows,
                "tokens": summary.tokens,
                "bytes_per_token": round(written / summary.tokens, 1),
                "export_s": seconds,
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def _read(dest: Path, mode: str, workers: int, total_seq_len: int, timed: int) -> dict[str, Any]:
    import torch
    from hs_connectors import HiddenStatesBackend
    from speculators.models.eagle3.data import shift_batch
    from speculators.train.dataloader import create_train_val_loaders

    meta = json.loads((dest / "eagle3_extract.json").read_text())
    transfer = None
    if mode == "reference":
        backend = HiddenStatesBackend.registry["eagle3-extract"]
        transfer = backend.from_train_args(argparse.Namespace(), str(dest))
    loaders = create_train_val_loaders(
        data_path=str(dest),
        total_seq_len=total_seq_len,
        hidden_states_dtype=getattr(torch, meta["hidden_states"]["dtype"]),
        transfer=transfer,
        vllm_endpoint="http://127.0.0.1:9/v1",  # never contacted: on_missing="raise"
        on_missing="raise",
        verifier_name_or_path=meta["model"]["path"],
        request_timeout=1.0,
        max_retries=0,
        generation_validation_retries=0,
        max_consecutive_generation_failures=1,
        hidden_size=meta["model"]["hidden_size"],
        num_target_layers=len(meta["layers"]["speculators"]["target_layer_ids"]),
        num_workers=workers,
        prefetch_factor=4,
        preprocess=shift_batch,
        train_data_ratio=0.9,
    )
    passes = []
    for _ in range(1 + timed):
        started = time.perf_counter()
        for loader in loaders:
            for batch in loader:
                if batch["error_records"]:
                    raise RuntimeError(f"{dest}: speculators dropped {batch['error_records']} rows")
        passes.append(time.perf_counter() - started)
    samples = meta["rows"]
    hidden_bytes = meta["tokens"] * len(meta["layers"]["exported"]) * meta["model"]["hidden_size"]
    hidden_bytes *= torch.empty(0, dtype=getattr(torch, meta["hidden_states"]["dtype"])).element_size()
    return {
        "config": f"loader_{mode}",
        "backend": "eagle3-extract" if mode == "reference" else "file",
        "workers": workers,
        "samples": samples,
        "first_pass_samples_per_s": round(samples / passes[0], 1),
        "samples_per_s": round(samples / statistics.median(passes[1:]), 1),
        "hidden_mb_per_s": round(hidden_bytes / statistics.median(passes[1:]) / 1e6, 1),
        "cpus": os.cpu_count(),
        "load_1min": round(os.getloadavg()[0], 1),
    }


def _table(rows: list[dict[str, Any]]) -> str:
    lines = ["| export | bytes written | of the shards' bytes | bytes per token |", "|---|--:|--:|--:|"]
    for row in rows:
        if row["config"].startswith("export_"):
            lines.append(
                f"| {row['config'].removeprefix('export_')} | {row['bytes_written']:,} | "
                f"{100 * row['fraction_of_shards']:.2f}% | {row['bytes_per_token']} |"
            )
    lines += ["", "| loader | workers | samples/s (median of rounds) | each round |", "|---|--:|--:|---|"]
    reads = [r for r in rows if r["config"].startswith("loader_")]
    for key in sorted({(r["backend"], r["workers"]) for r in reads}, key=lambda k: (k[1], k[0])):
        figures = [r["samples_per_s"] for r in reads if (r["backend"], r["workers"]) == key]
        every = ", ".join(map(str, figures))
        lines.append(f"| {key[0]} | {key[1]} | {statistics.median(figures)} | {every} |")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
