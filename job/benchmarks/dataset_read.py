"""``python -m job.benchmarks.dataset_read``: reading an output back with ``OutputDataset``, against the
ceilings under it, on this machine.

* local: ``OutputDataset`` (one process, checksums on) reading every sample of an output with
  cold caches, against ``dd`` reading the same shard files sequentially (``bs=8M``); before each
  run the files' pages are dropped from the page cache (``POSIX_FADV_DONTNEED``, these files only);
* S3 (``--s3-uri``, endpoint and credentials from boto3's chain): ``OutputDataset`` against raw
  boto3 ranged GETs of every byte of the same shards, 8 MiB each, at the same concurrency;
* memory: the peak resident memory of a process reading the whole output (anonymous memory, and
  the high-water mark of everything resident, which includes a local output's mapped file pages),
  against the one before its first sample (imports, connections, the reader: the fixed part) and
  the prefetch cap;
* follow: a follower (``follow=True``, its default poll) and a writer that commits shards of the
  output as the job does (the shard file first, then the manifest that lists it, replaced
  atomically locally, a PUT on S3): seconds from each manifest write to the shard's first sample.

The output is written by the job itself (``python -m job run``'s pipeline,
``job.benchmarks.throughput``'s rows from memory: no model runs; Llama-3.1-8B's shape, 4 layers,
bfloat16, 32 KiB a token). Rows are printed as JSON lines and a markdown report is written to ``--report``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
from pydantic import ByteSize, TypeAdapter

_BYTES = TypeAdapter(ByteSize)
PART = 8 * 2**20


def make_output(work: Path, size: int) -> Path:
    """An output of about ``size`` bytes of shards, written by the job's pipeline (reused)."""
    out = work / "out"
    manifest = out / "index-00000" / "manifest.json"
    if manifest.is_file() and json.loads(manifest.read_text()).get("complete"):
        return out
    from job.benchmarks.throughput import _RowsFromMemory
    from job.logs import configure_logging
    from job.pipeline.runner import run_job
    from job.plan import LLAMA_3_1_8B
    from job.settings import load_settings

    shutil.rmtree(out, ignore_errors=True)
    model = work / "model"
    model.mkdir(parents=True, exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_3_1_8B))
    rng = np.random.default_rng(0)
    tokens, token_bytes = 0, 4 * LLAMA_3_1_8B["hidden_size"] * 2
    with (work / "prompts.jsonl").open("w") as f:
        i = 0
        while tokens * token_bytes < size:
            n = int(np.clip(rng.lognormal(np.log(900), 0.8), 64, 8192))
            ids = rng.integers(100, 120000, n).tolist()
            f.write(json.dumps({"id": f"p-{i:05d}", "input_ids": ids}) + "\n")
            tokens, i = tokens + n, i + 1
    settings = load_settings(
        cli_args=[
            f"--model.path={model}",
            f"--data.path={work / 'prompts.jsonl'}",
            "--data.format=tokenized",
            "--data.tokenizer_workers=0",
            "--data.max_length=8192",
            "--backend.name=hf",
            f"--output.uri={out}",
            "--output.shard_bytes=256MiB",
            "--log.level=warning",
            "--log.format=json",
        ]
    )
    configure_logging(settings.log)
    # rows from memory: no model is loaded, so there are no weights to check
    run_job(settings, _RowsFromMemory(4, LLAMA_3_1_8B["hidden_size"], 8192, 8192), check_weights=False)
    return out


def shard_files(out: Path) -> list[Path]:
    manifest = json.loads((out / "index-00000" / "manifest.json").read_text())
    return [out / "index-00000" / entry["name"] for entry in manifest["shards"]]


def evict(paths: list[Path]) -> None:
    """Drop these files' pages from the page cache (nothing else)."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_dataset(uri: str, threads: int, prefetch: int) -> tuple[float, int]:
    """Seconds to read every sample, and samples read."""
    from job.shards import OutputDataset

    start, count = time.perf_counter(), 0
    for _ in OutputDataset(uri, read_threads=threads, prefetch_bytes=prefetch):
        count += 1
    return time.perf_counter() - start, count


def dd(paths: list[Path]) -> float:
    start = time.perf_counter()
    for path in paths:
        subprocess.run(["dd", f"if={path}", "of=/dev/null", "bs=8M"], check=True, capture_output=True)
    return time.perf_counter() - start


def raw_boto3(uri: str, sizes: dict[str, int], threads: int) -> float:
    """Seconds for boto3 to GET every byte of ``sizes``' objects in 8 MiB ranges, ``threads`` at once."""
    import boto3
    from botocore.config import Config

    bucket, _, _ = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3", config=Config(max_pool_connections=threads + 2))

    def get(key: str, start: int, stop: int) -> None:
        buffer = memoryview(bytearray(stop - start))
        body = client.get_object(Bucket=bucket, Key=key, Range=f"bytes={start}-{stop - 1}")["Body"]
        done = 0
        while done < len(buffer):
            done += body.readinto(buffer[done:])

    ranges = [(key, a, min(a + PART, size)) for key, size in sizes.items() for a in range(0, size, PART)]
    began = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(lambda r: get(*r), ranges))
    return time.perf_counter() - began


def upload(out: Path, uri: str) -> dict[str, int]:
    """The output under ``uri`` (uploaded unless there); shard keys and sizes."""
    import boto3

    from job.benchmarks.s3_ceiling import ensure_bucket

    bucket, _, prefix = uri.removeprefix("s3://").partition("/")
    client = boto3.client("s3")
    ensure_bucket(client, bucket)
    existing = {
        obj["Key"]: obj["Size"]
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix + "/")
        for obj in page.get("Contents", [])
    }
    for path in sorted(p for p in out.rglob("*") if p.is_file()):
        key = f"{prefix}/{path.relative_to(out)}"
        if existing.get(key) != path.stat().st_size:
            client.upload_file(str(path), bucket, key)
    return {f"{prefix}/index-00000/{p.name}": p.stat().st_size for p in shard_files(out)}


# -- memory: a child process reads the output and samples its own memory ----------------------


def _status() -> dict[str, int]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            fields[key] = int(value.split()[0]) * 1024
    return fields


def child_memory(uri: str, threads: int, prefetch: int) -> dict[str, Any]:
    from job.shards import OutputDataset

    dataset = OutputDataset(uri, read_threads=threads, prefetch_bytes=prefetch)
    iterator = iter(dataset)
    first = next(iterator)  # imports, connections, the reader and its first shard: the fixed part
    fixed = _status()
    peak_anon, stop = fixed["RssAnon"], threading.Event()

    def sample() -> None:
        nonlocal peak_anon
        while not stop.wait(0.01):
            peak_anon = max(peak_anon, _status()["RssAnon"])

    watcher = threading.Thread(target=sample, daemon=True)
    watcher.start()
    largest = first["hidden_states"].nbytes
    for item in iterator:
        largest = max(largest, item["hidden_states"].nbytes)
    stop.set()
    watcher.join()
    return {
        "fixed_anon_bytes": fixed["RssAnon"],
        "peak_anon_bytes": peak_anon,
        "peak_rss_bytes": _status()["VmHWM"],
        "largest_sample_bytes": largest,
    }


def memory(uri: str, threads: int, prefetch: int) -> dict[str, Any]:
    proc = subprocess.run(
        [sys.executable, "-m", "job.benchmarks.dataset_read", "--child-memory", uri,
         "--threads", str(threads), "--prefetch", str(prefetch)],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return json.loads(proc.stdout.splitlines()[-1])


# -- follow latency ---------------------------------------------------------------------------


FOLLOWER = r"""
import json, sys, time
from job.shards import OutputDataset
dataset = OutputDataset(sys.argv[1], follow=True)
print(json.dumps({"ready": True}), flush=True)  # imported: what is timed from now on is reading
for sample in dataset:
    print(json.dumps({"id": sample["sample_id"], "t": time.time()}), flush=True)
"""


def follow_latency(out: Path, target: str, shards: int, pause: float) -> list[float]:
    """Commit ``shards`` shards of ``out`` to ``target`` one by one, as the job does; seconds from
    each manifest write to the first sample of that shard in a follower."""
    manifest = json.loads((out / "index-00000" / "manifest.json").read_text())
    entries = manifest["shards"][:shards]
    first_ids = {entry["sample_ids"][0]: k for k, entry in enumerate(entries)}
    remote = target.startswith("s3://")
    if remote:
        import boto3

        client = boto3.client("s3")
        bucket, _, prefix = target.removeprefix("s3://").partition("/")

        def put(name: str, data: bytes | Path) -> None:
            body = data.read_bytes() if isinstance(data, Path) else data
            client.put_object(Bucket=bucket, Key=f"{prefix}/{name}", Body=body)
    else:
        root = Path(target)
        shutil.rmtree(root, ignore_errors=True)
        (root / "index-00000").mkdir(parents=True)

        def put(name: str, data: bytes | Path) -> None:
            tmp = root / f"{name}.partial"
            if isinstance(data, Path):
                shutil.copyfile(data, tmp)
            else:
                tmp.write_bytes(data)
            os.replace(tmp, root / name)

    extraction = (out / "extraction.json").read_bytes()
    put("extraction.json", json.dumps({**json.loads(extraction), "work_count": 1}).encode())
    listed = {**manifest, "shards": [], "complete": False}
    put("index-00000/manifest.json", json.dumps(listed).encode())
    follower = subprocess.Popen([sys.executable, "-c", FOLLOWER, target], stdout=subprocess.PIPE, text=True)
    assert follower.stdout is not None
    firsts: dict[int, float] = {}
    ready = threading.Event()

    def collect() -> None:
        for line in follower.stdout:  # type: ignore[union-attr]
            row = json.loads(line)
            ready.set()
            if row.get("id") in first_ids:
                firsts[first_ids[row["id"]]] = row["t"]

    collector = threading.Thread(target=collect, daemon=True)
    collector.start()
    ready.wait(120)
    time.sleep(2)  # a poll or two of nothing new first
    committed = []
    for k, entry in enumerate(entries):
        put(f"index-00000/{entry['name']}", out / "index-00000" / entry["name"])
        listed["shards"].append(entry)
        listed["complete"] = k == len(entries) - 1
        put("index-00000/manifest.json", json.dumps(listed).encode())
        committed.append(time.time())
        time.sleep(pause)
    follower.wait(timeout=120)
    collector.join()
    return [round(firsts[k] - committed[k], 3) for k in range(len(entries))]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m job.benchmarks.dataset_read", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--work-dir", default="/tmp/eagle3-bench-read")
    ap.add_argument("--size", default="2GiB", help="bytes of shards in the output")
    ap.add_argument("--s3-uri", default="", help="s3://bucket/prefix for the S3 rows (skipped without)")
    ap.add_argument("--threads", type=int, default=8, help="concurrent ranged GETs, ours and boto3's")
    ap.add_argument("--prefetch", default="256MiB", help="OutputDataset prefetch_bytes")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--report", default="", help="markdown report to write")
    ap.add_argument("--child-memory", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    prefetch = int(_BYTES.validate_python(args.prefetch))
    if args.child_memory:
        print(json.dumps(child_memory(args.child_memory, args.threads, prefetch)))
        return 0
    work = Path(args.work_dir)
    work.mkdir(parents=True, exist_ok=True)
    out = make_output(work, int(_BYTES.validate_python(args.size)))
    paths = shard_files(out)
    total = sum(p.stat().st_size for p in paths)
    rows: list[dict[str, Any]] = []

    def emit(**row: Any) -> None:
        row["load_1m"] = round(os.getloadavg()[0], 2)  # this host is shared: how busy it was
        print(json.dumps(row), flush=True)
        rows.append(row)

    for round_ in range(args.rounds):
        evict(paths)
        seconds = dd(paths)
        emit(group="local", reader="dd bs=8M", round=round_, gb_per_s=round(total / seconds / 1e9, 3))
        evict(paths)
        seconds, samples = read_dataset(str(out), args.threads, prefetch)
        emit(group="local", reader="OutputDataset", round=round_, gb_per_s=round(total / seconds / 1e9, 3),
             samples=samples)  # fmt: skip
    seconds, samples = read_dataset(str(out), args.threads, prefetch)
    emit(group="local", reader="OutputDataset, page cache warm", gb_per_s=round(total / seconds / 1e9, 3))
    evict(paths)
    emit(group="memory", target="local", prefetch_bytes=prefetch, **memory(str(out), args.threads, prefetch))
    emit(group="follow", target="local", seconds=follow_latency(out, str(work / "follow"), 8, 1.0))
    if args.s3_uri:
        uri = args.s3_uri.rstrip("/")
        sizes = upload(out, uri)
        for round_ in range(args.rounds):
            seconds = raw_boto3(uri, sizes, args.threads)
            emit(group="s3", reader=f"boto3 ranged GETs, {args.threads} at once", round=round_,
                 gb_per_s=round(total / seconds / 1e9, 3))  # fmt: skip
            seconds, samples = read_dataset(uri, args.threads, prefetch)
            emit(group="s3", reader=f"OutputDataset, read_threads {args.threads}", round=round_,
                 gb_per_s=round(total / seconds / 1e9, 3), samples=samples)  # fmt: skip
        emit(group="memory", target="s3", prefetch_bytes=prefetch, **memory(uri, args.threads, prefetch))
        emit(group="follow", target="s3", seconds=follow_latency(out, uri + "-follow", 8, 1.0))
    if args.report:
        write_report(Path(args.report), rows, total, argv)
    return 0


def write_report(path: Path, rows: list[dict[str, Any]], total: int, argv: list[str]) -> None:
    lines = [
        "# Reading an output back: OutputDataset (figures from `python -m job.benchmarks.dataset_read`)",
        "",
        f"Command: `python -m job.benchmarks.dataset_read {' '.join(argv)}`; output: "
        f"{total / 2**30:.2f} GiB of shards written by the job's pipeline (rows from memory, "
        "Llama-3.1-8B shape, 4 layers, bfloat16).",
        "",
        "| group | what | round | figures |",
        "| --- | --- | --- | --- |",
    ]
    for row in rows:
        figures = {k: v for k, v in row.items() if k not in ("group", "reader", "target", "round")}
        what = row.get("reader") or row.get("target", "")
        lines.append(f"| {row['group']} | {what} | {row.get('round', '')} | {json.dumps(figures)} |")
    path.write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
