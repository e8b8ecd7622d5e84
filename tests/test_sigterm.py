"""SIGTERM as Kubernetes sends it, on CPU: ``python -m job run`` is signalled
mid-run (and during start-up), must exit with EXIT_TERMINATED leaving a
consistent manifest and its log, and a rerun must complete every sample
exactly once.

Where the machine allows it, the job runs as PID 1 of its own PID namespace,
as in a container: the kernel then drops any signal the job has no handler for.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from job.checksum import crc64nvme_file
from job.errors import EXIT_OK, EXIT_TERMINATED
from job.manifest import Manifest
from job.shards import Shard

ROOT = Path(__file__).resolve().parent.parent
GOOD_SAMPLES = 400  # 15-20 s of extraction on one CPU core with the tiny model
BAD_RECORDS = {  # record id -> line; each is rejected, not written
    "bad-empty": json.dumps({"id": "bad-empty", "messages": []}),
    "bad-no-assistant": json.dumps(
        {"id": "bad-no-assistant", "messages": [{"role": "user", "content": "hi"}]}
    ),
}
MALFORMED_LINE = '{"id": "bad-json", "messages": ['  # its id is the file:line fallback
WORDS = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "drafts", "verify"]


@cache
def _pid1_prefix() -> tuple[str, ...]:
    """A command prefix that makes the job PID 1 of a new PID namespace, or () if not allowed here."""
    if shutil.which("unshare") is None or not Path(f"/proc/self/task/{os.getpid()}/children").exists():
        return ()  # no way to start it, or to find its pid outside the namespace
    for prefix in (
        ("unshare", "--pid", "--fork", "--kill-child"),
        ("unshare", "--user", "--map-root-user", "--pid", "--fork", "--kill-child"),
    ):
        if subprocess.run([*prefix, "true"], capture_output=True).returncode == 0:
            return prefix
    return ()


class JobProcess:
    """``python -m job run ...`` in the background, its stdout parsed as JSON events."""

    def __init__(self, args: list[str], env: dict[str, str], stderr_path: Path) -> None:
        self.events: list[dict[str, Any]] = []
        self._changed = threading.Condition()
        self._stderr_path = stderr_path
        self._stderr = stderr_path.open("ab")
        self.proc = subprocess.Popen(
            [*_pid1_prefix(), sys.executable, "-m", "job", "run", *args],
            cwd=ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        self.pid = self._job_pid()

    def _job_pid(self) -> int:
        """The job's own pid: unshare's child when it runs in a PID namespace."""
        if not _pid1_prefix():
            return self.proc.pid
        children = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            pids = children.read_text().split() if children.exists() else []
            if pids:
                return int(pids[0])
            time.sleep(0.01)
        raise AssertionError("unshare started no child")

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                event = json.loads(raw)
            except ValueError:
                continue  # a library's plain print; not an event
            with self._changed:
                self.events.append(event)
                self._changed.notify_all()
        with self._changed:
            self._changed.notify_all()

    def named(self, name: str) -> list[dict[str, Any]]:
        with self._changed:
            return [e for e in self.events if e.get("event") == name]

    def wait_for(self, name: str, count: int, timeout: float) -> None:
        with self._changed:
            ok = self._changed.wait_for(
                lambda: (
                    len([e for e in self.events if e.get("event") == name]) >= count
                    or self.proc.poll() is not None
                ),
                timeout,
            )
        assert ok and len(self.named(name)) >= count, f"no {count} {name!r} events; exit {self.proc.poll()}"

    def signal(self, signum: int) -> float:
        os.kill(self.pid, signum)
        return time.monotonic()

    def wait(self, timeout: float) -> int:
        try:
            rc = self.proc.wait(timeout)
        finally:
            self._reader.join(10)
            self._stderr.close()
        return rc

    def stderr_tail(self) -> str:
        return self._stderr_path.read_text(errors="replace")[-3000:]


@pytest.fixture
def start(tmp_path: Path) -> Iterator[Callable[[list[str], dict[str, str]], JobProcess]]:
    """Starts jobs; any still running when the test ends (it failed) is killed."""
    started: list[JobProcess] = []

    def start_job(args: list[str], env: dict[str, str]) -> JobProcess:
        started.append(JobProcess(args, env, tmp_path / f"stderr-{len(started)}.log"))
        return started[-1]

    yield start_job
    for job in started:
        if job.proc.poll() is None:
            job.proc.kill()  # unshare --kill-child takes the job with it
            job.wait(timeout=30)


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("JOB_")}
    return {
        **clean,
        "JOB_CACHE_DIR": str(tmp_path_factory.mktemp("cache")),  # the tiny model, built once here
        "OMP_NUM_THREADS": "1",  # the CI's cores are shared
        "PYTHONUNBUFFERED": "1",
    }


@pytest.fixture(scope="module")
def dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, set[str], set[str]]:
    """A JSONL file, its good sample ids and the ids of its rejected records."""
    rng = random.Random(0)
    lines = [
        json.dumps(
            {
                "id": f"s{i:04d}",
                "messages": [
                    {"role": "user", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 40)))},
                    {"role": "assistant", "content": " ".join(rng.choices(WORDS, k=rng.randint(10, 40)))},
                ],
            }
        )
        for i in range(GOOD_SAMPLES)
    ]
    # Rejections early, in the middle and at the end: some are met before the signal.
    lines.insert(3, BAD_RECORDS["bad-empty"])
    lines.insert(len(lines) // 2, BAD_RECORDS["bad-no-assistant"])
    lines.append(MALFORMED_LINE)
    path = tmp_path_factory.mktemp("data") / "chat.jsonl"
    path.write_text("\n".join(lines) + "\n")
    bad = set(BAD_RECORDS) | {f"{path.name}:{len(lines)}"}
    return path, {f"s{i:04d}" for i in range(GOOD_SAMPLES)}, bad


def _run_args(data: Path, out: Path) -> list[str]:
    return [
        "--model.path=builtin:tiny-llama",
        "--backend.name=hf",
        "--backend.device=cpu",
        f"--data.path={data}",
        f"--output.uri={out}",
        "--output.shard_bytes=256KiB",  # a few samples per shard: many commits
        "--log.format=json",
    ]


def _check_consistent(index_dir: Path) -> Manifest:
    """The manifest lists exactly the shards present, intact, each sample once."""
    manifest = Manifest.model_validate_json((index_dir / "manifest.json").read_bytes())
    listed = [s.name for s in manifest.shards]
    on_disk = sorted(p.name for p in index_dir.glob("shard-*"))
    assert on_disk == sorted(listed), "shard files not listed in the manifest (or listed but missing)"
    seen: list[str] = []
    for entry in manifest.shards:
        path = index_dir / entry.name
        assert path.stat().st_size == entry.bytes
        assert crc64nvme_file(path) == entry.checksum.value, f"{entry.name}: checksum mismatch"
        assert Shard(path).sample_ids == entry.sample_ids
        seen += entry.sample_ids
    assert len(seen) == len(set(seen)), "a sample is listed twice"
    assert manifest.counts.written == len(seen)
    return manifest


def _log_events(index_dir: Path, run_id: str) -> list[str]:
    path = index_dir / "logs" / f"{run_id}.jsonl"
    assert path.is_file(), f"no log file for run {run_id}"
    return [json.loads(line)["event"] for line in path.read_text().splitlines()]


def test_sigterm_mid_run_stops_consistently_and_a_rerun_completes_exactly_once(
    start: Callable[[list[str], dict[str, str]], JobProcess],
    env: dict[str, str],
    dataset: tuple[Path, set[str], set[str]],
    tmp_path: Path,
) -> None:
    data, good, bad = dataset
    out = tmp_path / "out"
    index_dir = out / "index-00000"

    first = start(_run_args(data, out), env)
    first.wait_for("shard_committed", count=3, timeout=300)
    before = len(first.named("shard_committed"))
    signalled = first.signal(signal.SIGTERM)
    rc = first.wait(timeout=120)
    seconds_to_exit = time.monotonic() - signalled

    assert rc == EXIT_TERMINATED, f"exit {rc}, PID 1: {bool(_pid1_prefix())}\n{first.stderr_tail()}"
    stopped = manifest = _check_consistent(index_dir)
    assert not manifest.complete
    assert 0 < manifest.counts.written < len(good)
    assert [e["exit_code"] for e in first.named("job_error")] == [EXIT_TERMINATED]
    (run_id,) = manifest.run_ids
    events = _log_events(index_dir, run_id)
    assert events[0] == "run_started" and "run_stopped" in events and "run_finished" not in events
    (stop_event,) = first.named("run_stopped")
    assert stop_event["signal"] == "SIGTERM"
    assert stop_event["committed_shards"] == len(manifest.shards) >= before
    assert not (index_dir / "rejected.jsonl").exists()  # published only by a complete run
    print(
        f"\nSIGTERM (PID 1: {bool(_pid1_prefix())}): exit {rc} after {seconds_to_exit:.2f} s; "
        f"shards committed when signalled {before}, at exit {len(manifest.shards)} "
        f"({manifest.counts.written} of {len(good)} samples)"
    )

    second = start(_run_args(data, out), env)
    assert second.wait(timeout=600) == EXIT_OK, second.stderr_tail()
    manifest = _check_consistent(index_dir)
    assert manifest.complete
    assert manifest.run_ids[0] == run_id and len(manifest.run_ids) == 2
    # The first run's shards are kept as they were, not redone.
    assert manifest.shards[: len(stopped.shards)] == stopped.shards
    written = [sid for shard in manifest.shards for sid in shard.sample_ids]
    assert sorted(written) == sorted(good), "every good sample exactly once"
    rejected_lines = (index_dir / "rejected.jsonl").read_text().splitlines()
    rejected = [json.loads(line)["sample_id"] for line in rejected_lines]
    assert sorted(rejected) == sorted(bad)
    records = len(good) + len(bad)
    assert manifest.counts.written + manifest.counts.rejected == records
    assert _log_events(index_dir, manifest.run_ids[1])[-1] == "run_finished"
    print(f"rerun: {len(manifest.shards) - len(stopped.shards)} more shards, {len(manifest.shards)} in all")


def test_a_stop_is_logged_at_once_with_what_is_left_to_finish(
    start: Callable[[list[str], dict[str, str]], JobProcess],
    env: dict[str, str],
    dataset: tuple[Path, set[str], set[str]],
    tmp_path: Path,
) -> None:
    """One shard holds every sample (64 MiB): the run finishes it before it stops, which takes
    seconds here and minutes with a real model on a CPU. ``stop_requested`` comes at once, before
    that shard is committed, naming it and the samples it still lacks."""
    data, good, _ = dataset
    out = tmp_path / "out"
    args = [*_run_args(data, out), "--output.shard_bytes=64MiB", "--log.progress_interval_s=0.2"]
    job = start(args, env)
    deadline = time.monotonic() + 300
    # Extraction well under way: the writer's threads, a few samples behind what it took, have
    # finished some samples of the shard.
    while not any(e["samples"] >= 50 for e in job.named("progress")):
        assert job.proc.poll() is None and time.monotonic() < deadline, job.stderr_tail()
        time.sleep(0.05)
    job.signal(signal.SIGTERM)
    assert job.wait(timeout=300) == EXIT_TERMINATED, job.stderr_tail()
    names = [e.get("event") for e in job.events]
    (requested,) = job.named("stop_requested")
    assert requested["signal"] == "SIGTERM" and requested["shards_being_committed"] == []
    (filling,) = requested["shards_being_filled"]
    assert filling["shard"] == "shard-00000.safetensors" and filling["samples"] == len(good)
    assert 0 < filling["samples_left"] < len(good)
    assert names.index("stop_requested") < names.index("shard_committed") < names.index("run_stopped")
    assert _check_consistent(out / "index-00000").counts.written == len(good)


def test_sigterm_during_startup_exits_at_once_without_touching_the_output(
    start: Callable[[list[str], dict[str, str]], JobProcess],
    env: dict[str, str],
    dataset: tuple[Path, set[str], set[str]],
    tmp_path: Path,
) -> None:
    """Start-up (settings, model download/build) writes no output: the job exits at once.

    Signalled while it builds the tiny model in a fresh cache, standing in for
    a model download; as PID 1 without a handler the signal would be ignored.
    """
    data, _, _ = dataset
    cache_dir = tmp_path / "fresh-cache"
    out = tmp_path / "out"
    job = start(_run_args(data, out), {**env, "JOB_CACHE_DIR": str(cache_dir)})
    deadline = time.monotonic() + 120
    while not any(cache_dir.glob(".tiny-llama-*")):  # the model's build directory
        assert time.monotonic() < deadline and job.proc.poll() is None, "the model build never started"
        time.sleep(0.01)
    signalled = job.signal(signal.SIGTERM)
    rc = job.wait(timeout=60)
    seconds_to_exit = time.monotonic() - signalled

    assert rc == EXIT_TERMINATED, f"exit {rc}, PID 1: {bool(_pid1_prefix())}\n{job.stderr_tail()}"
    assert seconds_to_exit < 10
    assert not out.exists()
    assert not any(cache_dir.glob("tiny-llama-*")), "the model build was finished after the signal"
    (stopped,) = job.named("run_stopped")
    assert stopped["phase"] == "startup" and stopped["signal"] == "SIGTERM"
    print(f"\nstart-up SIGTERM (PID 1: {bool(_pid1_prefix())}): exit {rc} after {seconds_to_exit:.2f} s")
