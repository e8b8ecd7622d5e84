"""``python -m job.benchmarks.s3_ceiling``: the raw upload ceiling of an S3 endpoint, with boto3 alone.

K files of S random bytes are written to a local directory (put it on tmpfs, so the disk is
not what is measured), then uploaded at once by one s3transfer ``TransferManager`` per
configuration (thread count x part size), the way the job uploads shards: multipart above the
part size, each object carrying its full-object CRC64NVME. Every object is then checked (size
and the CRC64NVME S3 reports with ``ChecksumMode=ENABLED``) and deleted.

Each configuration is one JSON row (``config: s3_raw``) printed and appended to
``--out``/results.jsonl; a markdown table is printed last. Beside GB/s a row carries the CPU
seconds per GB this process and the server (``--server-pids``) spent: on a machine with few
cores those, not the wall clock, say what a larger machine can reach.

The endpoint and credentials come from boto3's default chain (``AWS_ENDPOINT_URL_S3``,
``AWS_ACCESS_KEY_ID`` ...), as for the job.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import boto3
import numpy as np
from botocore.config import Config
from botocore.exceptions import ClientError
from pydantic import ByteSize, TypeAdapter
from s3transfer.manager import TransferConfig, TransferManager

from job.checksum import crc64nvme_file

_BYTES = TypeAdapter(ByteSize)
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def _sizes(text: str) -> list[int]:
    return [int(_BYTES.validate_python(x)) for x in text.split(",") if x]


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m job.benchmarks.s3_ceiling", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--bucket", default="eagle3-bench", help="created if missing")
    ap.add_argument("--prefix", default="bench-s3-raw")
    ap.add_argument("--files", type=int, default=4, help="files uploaded at once (K)")
    ap.add_argument("--file-size", default="2GiB", help="bytes per file (S)")
    ap.add_argument("--threads", type=_ints, default=[1, 8, 32, 64], help="comma list")
    ap.add_argument("--part-sizes", type=_sizes, default=_sizes("64MiB,128MiB"), help="comma list")
    ap.add_argument(
        "--payload-signing",
        default="off",
        help="comma list of on/off: SigV4 SHA-256 of each part's body (botocore's default over http://); "
        "off sends UNSIGNED-PAYLOAD, the part's CRC64NVME header still guards it",
    )
    ap.add_argument("--src-dir", default="/dev/shm/eagle3-bench-s3", help="where the K files are written")
    ap.add_argument("--server-pids", default="", help="file or comma list of the server's PIDs (CPU use)")
    ap.add_argument("--out", default="", help="results.jsonl goes here (none: print only)")
    ap.add_argument("--tag", default="", help="free text stored in every row (e.g. the server set-up)")
    args = ap.parse_args(argv)
    signing = [{"on": True, "off": False}[x] for x in args.payload_signing.split(",")]

    files = _make_files(Path(args.src_dir), args.files, int(_BYTES.validate_python(args.file_size)))
    checksums = [crc64nvme_file(f) for f in files]
    pids = server_pids(args.server_pids)
    admin = boto3.client("s3")
    ensure_bucket(admin, args.bucket)
    run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    rows = []
    try:
        for signed in signing:
            for part_size in args.part_sizes:
                for threads in args.threads:
                    row = _measure(admin, args, files, checksums, pids, threads, part_size, signed)
                    row.update(run_id=run_id, tag=args.tag, **cpu_layout(pids))
                    print(json.dumps(row), flush=True)
                    rows.append(row)
                    if args.out:
                        Path(args.out).mkdir(parents=True, exist_ok=True)
                        with (Path(args.out) / "results.jsonl").open("a") as f:
                            f.write(json.dumps(row) + "\n")
    finally:
        for f in files:
            f.unlink(missing_ok=True)
    print(_table(rows), flush=True)
    return 0 if rows and all(r["verified"] for r in rows) else 1


def _make_files(directory: Path, count: int, size: int) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    block = 64 * 1024**2
    files = []
    for i in range(count):
        path = directory / f"file-{i:03d}.bin"
        with path.open("wb") as f:
            for start in range(0, size, block):
                f.write(rng.bytes(min(block, size - start)))
        files.append(path)
    return files


def server_pids(spec: str) -> list[int]:
    if not spec:
        return []
    text = Path(spec).read_text() if Path(spec).is_file() else spec
    return [int(x) for x in text.replace(",", " ").split()]


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes so far (utime and stime of /proc/PID/stat)."""
    total = 0
    for pid in pids:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])
    return total / _CLOCK_TICKS


def cpu_layout(pids: list[int]) -> dict[str, int | None]:
    """How many cores the client (this process) and the server may run on: fewer than the
    machine's when a run pins them apart (.ci/gpu-s3.sh's CLIENT_CPUS)."""
    return {
        "client_cpus": len(os.sched_getaffinity(0)),
        "server_cpus": len(os.sched_getaffinity(pids[0])) if pids else None,
    }


def own_cpu_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def ensure_bucket(client: Any, bucket: str) -> None:
    try:
        client.head_bucket(Bucket=bucket)
    except ClientError:
        client.create_bucket(Bucket=bucket)


def _measure(
    admin: Any,
    args: argparse.Namespace,
    files: list[Path],
    checksums: list[str],
    pids: list[int],
    threads: int,
    part_size: int,
    signed: bool,
) -> dict[str, Any]:
    config = Config(
        max_pool_connections=threads + 4,
        retries={"mode": "standard", "max_attempts": 10},
        s3={"payload_signing_enabled": signed},
    )
    client = boto3.session.Session().client("s3", config=config)
    transfer = TransferConfig(
        multipart_threshold=part_size, multipart_chunksize=part_size, max_request_concurrency=threads
    )
    name = f"t{threads}-p{part_size >> 20}-{'signed' if signed else 'unsigned'}"
    keys = [f"{args.prefix}/{name}/{f.name}" for f in files]
    total = sum(f.stat().st_size for f in files)
    server_before, client_before = cpu_seconds(pids), own_cpu_seconds()
    with TransferManager(client, transfer) as manager:
        start = time.perf_counter()
        futures = [
            manager.upload(str(f), args.bucket, key, extra_args={"ChecksumCRC64NVME": crc})
            for f, key, crc in zip(files, keys, checksums, strict=True)
        ]
        for future in futures:
            future.result()
        seconds = time.perf_counter() - start
    server_cpu, client_cpu = cpu_seconds(pids) - server_before, own_cpu_seconds() - client_before
    verified = _verify(admin, args.bucket, keys, files, checksums)
    with ThreadPoolExecutor(8) as pool:  # frees the server's space before the next configuration
        list(pool.map(lambda key: admin.delete_object(Bucket=args.bucket, Key=key), keys))
    gb = total / 1e9
    return {
        "config": "s3_raw",
        "threads": threads,
        "part_size_mib": part_size >> 20,
        "payload_signing": signed,
        "files": len(files),
        "file_bytes": files[0].stat().st_size,
        "bytes": total,
        "seconds": round(seconds, 3),
        "gb_per_s": round(gb / seconds, 3),
        "client_cpu_s_per_gb": round(client_cpu / gb, 2),
        "server_cpu_s_per_gb": round(server_cpu / gb, 2) if pids else None,
        "cpus": os.cpu_count(),
        "verified": verified,
    }


def _verify(admin: Any, bucket: str, keys: list[str], files: list[Path], checksums: list[str]) -> bool:
    ok = True
    for key, path, crc in zip(keys, files, checksums, strict=True):
        head = admin.head_object(Bucket=bucket, Key=key, ChecksumMode="ENABLED")
        size, stored = int(head["ContentLength"]), head.get("ChecksumCRC64NVME")
        if size != path.stat().st_size or stored != crc:
            print(f"MISMATCH {key}: {size} bytes, CRC64NVME {stored}; local {path.stat().st_size}, {crc}")
            ok = False
    return ok


def _table(rows: list[dict[str, Any]]) -> str:
    lines = [
        "| threads | part MiB | signed | GB | s | GB/s | client CPU s/GB | server CPU s/GB | verified |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        server = r["server_cpu_s_per_gb"]
        lines.append(
            f"| {r['threads']} | {r['part_size_mib']} | {'yes' if r['payload_signing'] else 'no'} "
            f"| {r['bytes'] / 1e9:.2f} | {r['seconds']} | {r['gb_per_s']} | {r['client_cpu_s_per_gb']} "
            f"| {'' if server is None else server} | {r['verified']} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
