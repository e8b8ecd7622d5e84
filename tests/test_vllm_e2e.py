"""End to end with a real vLLM forward (the CPU build in CI): `python -m job run`
with backend.name=vllm must produce, sample for sample, the HF reference
backend's hidden states (bf16 tolerance), with batches of several requests,
prefills chunked over several steps and the last steps shrunk
(backend.vllm.final_step_tokens, left at its default): compiled (vLLM's default compilation, capture
through the model's EAGLE-3 aux outputs and taps; on CPU, Dynamo + Inductor) and
eager (forward hooks). A forward that fails inside vLLM's worker, or a worker that is killed,
ends the run with the worker's error or death, and the rerun completes.

The tests marked ``vllm_line`` go through what differs between vLLM lines (adapters/, the line's
model runner, scheduler and executor) and run on every line with a CPU build (.ci/run); the
others test the job's own code on an output or a process, the same whatever the line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import run_vllm_job, vllm_job_env, with_sitecustomize

from job.errors import EXIT_FAILURE, EXIT_TERMINATED
from job.shards import OutputDataset, iter_output

if os.environ.get("REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

pytestmark = pytest.mark.vllm

MAX_REL_ERROR = 2e-2  # per sample and layer, ||a - b|| / ||b||, bf16
TOKEN_BUDGET = 128  # max_num_batched_tokens: most samples need several steps
FINAL_STEP_TOKENS = TOKEN_BUDGET // 4  # backend.vllm.final_step_tokens' default
# The two outputs of the module's fixture run with the preflight (the default); the other tests
# here are about the run's own engine start-up and failures, and skip it.
NO_PREFLIGHT = ("--preflight.before_run=false",)
COMMON = ("--data.max_length=512", "--output.shard_bytes=1MiB")
VLLM = (
    "--backend.name=vllm",
    f"--backend.vllm.max_num_batched_tokens={TOKEN_BUDGET}",
    "--backend.vllm.max_num_seqs=4",
)


@pytest.fixture(scope="module")
def hf_reference(tmp_path_factory: pytest.TempPathFactory, job_cache_dir: Path) -> Path:
    """The HF backend's output of the data both capture modes' runs read: one reference for both."""
    out = tmp_path_factory.mktemp("e2e-hf") / "hf"
    run_vllm_job([*COMMON, f"--output.uri={out}", "--backend.name=hf"], job_cache_dir)
    return out


@pytest.fixture(scope="module", params=["compiled", "eager"])
def outputs(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    job_cache_dir: Path,
    hf_reference: Path,
) -> tuple[Path, Path, list[dict]]:
    out = tmp_path_factory.mktemp(f"e2e-{request.param}") / "vllm"
    events = run_vllm_job(
        [*COMMON, f"--output.uri={out}", *VLLM, f"--backend.vllm.enforce_eager={request.param == 'eager'}"],
        job_cache_dir,
    )
    installed = next(e for e in events if e["event"] == "capture_installed")
    assert installed["mode"] == ("hooks" if request.param == "eager" else "compiled")
    return out, hf_reference, events


@pytest.mark.vllm_line  # capture through this line's model runner, compiled and with hooks
def test_vllm_matches_the_hf_reference(outputs: tuple[Path, Path, list[dict]]) -> None:
    vllm_dir, hf_dir, events = outputs
    reference = {s.sample_id: s for s in iter_output(hf_dir, require_complete=True)}
    worst = (0.0, "", -1)
    seen = 0
    for sample in iter_output(vllm_dir, require_complete=True):
        ref = reference[sample.sample_id]
        assert torch.equal(sample.input_ids, ref.input_ids)
        assert torch.equal(sample.loss_mask, ref.loss_mask)
        assert sample.hidden_states.shape == ref.hidden_states.shape
        a, b = sample.hidden_states.float(), ref.hidden_states.float()
        for j, layer in enumerate(sample.layer_ids):
            err = ((a[:, j] - b[:, j]).norm() / b[:, j].norm()).item()
            worst = max(worst, (err, sample.sample_id, layer))
        seen += 1
    assert seen == len(reference) > 30
    sources = next(e for e in events if e["event"] == "capture_installed")["layer_sources"]
    print(
        f"vLLM vs HF ({sources}): worst relative error {worst[0]:.3e} "
        f"(sample {worst[1]}, layer {worst[2]}), {seen} samples"
    )
    assert worst[0] <= MAX_REL_ERROR, worst


@pytest.mark.vllm_line  # the worker's model, as this line's vLLM loads it, sized by the preflight
@pytest.mark.parametrize("outputs", ["eager"], indirect=True)  # no new engine
def test_the_preflight_passed_first_and_estimated_the_weights_the_run_built(
    outputs: tuple[Path, Path, list[dict]],
) -> None:
    """The fixture's run did the preflight first (in its own process, its engine gone before the
    run's started), and its memory estimate at full depth, from the reduced model's layers as
    vLLM built them, is what the run built."""
    _, _, events = outputs
    names = [e["event"] for e in events]
    assert names.index("preflight_passed") < names.index("run_started") < names.index("adapter_selected")
    passed = events[names.index("preflight_passed")]
    # The weights run had checked before it (names and shapes against config.json), not again.
    assert any(
        line.startswith("weights: the files load; the 75 tensors' names fit config.json")
        and line.endswith("(checked by run, before its preflight)")
        for line in passed["proven"]
    ), passed["proven"]
    built = next(e for e in events if e["event"] == "capture_installed")
    assert passed["memory"]["weight_bytes"] == built["weight_bytes"]
    assert passed["memory"]["reduced_weight_bytes"] < built["weight_bytes"]
    print(f"\npreflight {passed['seconds']}; weights at full depth {built['weight_bytes']} bytes")


# vLLM's worker start-up (when it imports the job's worker extension, how it names the process)
@pytest.mark.vllm_line
@pytest.mark.parametrize("outputs", ["eager"], indirect=True)  # no new engine
def test_vllms_worker_process_logs_json_to_stdout_and_to_the_shipped_log_file(
    outputs: tuple[Path, Path, list[dict]],
) -> None:
    """vLLM's worker process (its model load, compilation, KV cache: where start-up time goes)
    logs through the job's chain: JSON events tagged ``component: vllm_worker`` on stdout, the
    run's also in the log file shipped with the output."""
    vllm_dir, _, events = outputs
    names = [e["event"] for e in events]
    run_started = events[names.index("run_started")]
    loads = [
        i
        for i, e in enumerate(events)
        if e.get("component") == "vllm_worker" and e["event"].startswith("Starting to load model")
    ]
    # the preflight's engine, then the run's, each logged its worker's model load
    assert len(loads) == 2
    assert loads[0] < names.index("preflight_passed") < names.index("run_started") < loads[1]
    load = events[loads[1]]
    assert (
        load["logger"].startswith("vllm.") and load["level"] == "info" and load["process"] == "VllmWorker-0"
    )
    shipped = vllm_dir / "index-00000" / "logs" / f"{run_started['run_id']}.jsonl"
    logged = [json.loads(line) for line in shipped.read_text().splitlines()]
    worker = [e for e in logged if e.get("component") == "vllm_worker"]
    assert load in worker
    assert {e["event"] for e in worker} <= {e["event"] for e in events}
    print(f"\n{len(worker)} worker records in the shipped log, e.g. {worker[0]['event'][:80]!r}")


@pytest.mark.parametrize("outputs", ["eager"], indirect=True)  # no new engine
def test_output_dataset_reads_the_vllm_output_as_iter_output_does(
    outputs: tuple[Path, Path, list[dict]],
) -> None:
    """The trainer's reader over an output vLLM wrote (tests/test_dataset*.py read the HF
    backend's): every sample once, bit for bit ``iter_output``'s, all stored layers and two of
    them picked in reverse order."""
    vllm_dir, _, _ = outputs
    reference = {s.sample_id: s for s in iter_output(vllm_dir, require_complete=True)}
    stored = next(iter(reference.values())).layer_ids
    picked = [stored[-1], stored[0]]
    for layers in (None, picked):
        seen = []
        for item in OutputDataset(str(vllm_dir), shuffle_seed=3, layers=layers):
            ref = reference[item["sample_id"]]
            assert torch.equal(item["input_ids"], ref.input_ids)
            assert torch.equal(item["loss_mask"], ref.loss_mask)
            want = ref.hidden_states
            if layers is not None:
                want = want[:, [stored.index(n) for n in layers]]
            assert item["hidden_states"].dtype == want.dtype and torch.equal(item["hidden_states"], want)
            seen.append(item["sample_id"])
        assert sorted(seen) == sorted(reference) and len(seen) > 30, layers
    print(f"\nOutputDataset: {len(reference)} samples of vLLM's output, as iter_output's (layers {picked})")


@pytest.mark.vllm_line  # this line's scheduler, KV cache and two-phase steps, through adapters/
def test_batches_held_several_requests_long_prefills_were_chunked_steps_overlapped_and_the_last_shrank(
    outputs: tuple[Path, Path, list[dict]],
) -> None:
    _, _, events = outputs
    import vllm

    from adapters import select_adapter_set

    selected = next(e for e in events if e["event"] == "adapter_selected")
    assert selected["adapter_set"] == select_adapter_set(vllm.__version__).name
    stats = next(e for e in events if e["event"] == "vllm_extract_finished")
    assert stats["max_requests_per_step"] >= 2
    assert stats["chunked_requests"] >= 5
    assert stats["max_steps_in_flight"] == 2  # step k+1 was scheduled and submitted while step k ran
    # The last steps kept to final_step_tokens' default; the samples matched the reference all the same.
    ready = next(e for e in events if e["event"] == "vllm_ready")
    assert ready["final_step_tokens"] == FINAL_STEP_TOKENS
    assert stats["final_steps"] >= 1 and 0 < stats["largest_final_step"] <= FINAL_STEP_TOKENS
    longest = max(s.input_ids.shape[0] for s in iter_output(outputs[0]))
    assert longest > TOKEN_BUDGET


# The rerun is also the module's one run without the preflight: one engine start-up for both.
@pytest.mark.parametrize("outputs", ["eager"], indirect=True)
def test_sigterm_in_the_engines_start_up_exits_at_once_and_the_rerun_skipping_the_preflight_matches(
    outputs: tuple[Path, Path, list[dict]], tmp_path: Path, job_cache_dir: Path
) -> None:
    """vLLM's start-up (model load, compilation, KV cache) can block for minutes and never looks
    at the job's stop flag: SIGTERM then ends the process at once, engine workers included, and
    the output is left as a kill -9 would leave it: the rerun writes every sample once. That rerun
    skips the preflight, which changed nothing: every sample's ids, mask and hidden states are bit
    for bit those of the fixture's run with it (the shard files differ only in the run id they
    record)."""
    with_preflight, _, _ = outputs
    out = tmp_path / "out"
    args = [*COMMON, f"--output.uri={out}", *VLLM, "--backend.vllm.enforce_eager=true", *NO_PREFLIGHT]
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", "run", "--log.format=json", *args],
        env=vllm_job_env(job_cache_dir, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    events = []
    for line in proc.stdout:  # until the engine has begun to start
        if line.startswith("{"):
            events.append(json.loads(line))
            if events[-1]["event"] == "adapter_selected":
                break
    proc.send_signal(signal.SIGTERM)
    signalled = time.monotonic()
    rc = proc.wait(timeout=60)
    seconds_to_exit = time.monotonic() - signalled
    deadline = time.monotonic() + 5  # the job SIGKILLs its children as it exits: let them go
    while (left := _alive_in_session(proc.pid)) and time.monotonic() < deadline:
        time.sleep(0.2)
    for process in left:  # they would keep stdout open
        process.kill()
    events += [json.loads(line) for line in proc.stdout if line.startswith("{")]

    assert rc == EXIT_TERMINATED, events[-3:]
    assert seconds_to_exit < 10
    (stopped,) = [e for e in events if e["event"] == "run_stopped"]
    assert stopped["phase"] == "engine_startup" and stopped["signal"] == "SIGTERM"
    assert not left, f"child processes outlived the job: {left}"
    run_vllm_job(args, job_cache_dir)
    written = sorted(s.sample_id for s in iter_output(out))
    assert written == sorted(s.sample_id for s in iter_output(with_preflight))
    print(f"\nSIGTERM during the engine's start-up: exit {rc} after {seconds_to_exit:.2f} s")

    got = {s.sample_id: s for s in iter_output(with_preflight, require_complete=True)}
    want = {s.sample_id: s for s in iter_output(out, require_complete=True)}
    assert got.keys() == want.keys() and len(got) > 30
    for sample_id, ref in want.items():
        sample = got[sample_id]
        assert torch.equal(sample.input_ids, ref.input_ids) and torch.equal(sample.loss_mask, ref.loss_mask)
        assert torch.equal(sample.hidden_states, ref.hidden_states), sample_id
    print(f"{len(got)} samples identical with and without the preflight")


# A failure inside vLLM's worker process, whatever the host's CPU: vLLM's model runner raises
# on its first step, as a failing kernel would. (Reporting AMX tiles once did this, but an AMX
# host then runs vLLM 0.26's AMX attention without error, and one with AVX-512 but no AMX dies
# by SIGILL.) The runner's module is patched as it is imported, in the worker only: the driver
# never imports it.
FAIL_THE_FIRST_STEP = """
import importlib.abc
import importlib.util
import sys

RUNNER = "vllm.v1.worker.gpu_model_runner"


def failing_step(self, *args, **kwargs):
    raise RuntimeError("injected by the test: the worker's forward failed")


class FailTheFirstStep(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != RUNNER:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            module.GPUModelRunner.execute_model = failing_step

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, FailTheFirstStep())
"""


# The reruns after a failed forward and after a killed worker are the job's own resume, the same
# whatever the line: their tests run in stage 1 only, on the failed runs of these module fixtures.


@dataclass(frozen=True)
class FailedRun:
    """A run made to fail, once it had exited."""

    returncode: int
    stderr: str
    args: list[str]  # a rerun's too
    out: Path
    committed: list[str]  # the sample ids its output held


@pytest.fixture(scope="module")
def failed_forward(tmp_path_factory: pytest.TempPathFactory, job_cache_dir: Path) -> FailedRun:
    """A run whose worker's first forward fails."""
    scratch = tmp_path_factory.mktemp("e2e-failed-forward")
    out = scratch / "out"
    args = [
        "--data.max_length=256",
        f"--output.uri={out}",
        "--backend.name=vllm",
        f"--backend.vllm.max_num_batched_tokens={TOKEN_BUDGET}",
        "--backend.vllm.max_num_seqs=4",
        *NO_PREFLIGHT,  # it would find the failing forward first (exit 2): this is about the run's own
    ]
    pythonpath = with_sitecustomize(scratch / "fail-the-first-step", FAIL_THE_FIRST_STEP)
    proc = subprocess.run(
        [sys.executable, "-m", "job", "run", *args],
        env=vllm_job_env(job_cache_dir, PYTHONPATH=pythonpath),
        capture_output=True,
        text=True,
        timeout=900,
    )
    return FailedRun(proc.returncode, proc.stderr, args, out, [s.sample_id for s in iter_output(out)])


# The failed step's answer differs by line (adapters/execution.py): None on 0.16, an output lacking the
# step's requests on 0.26.
@pytest.mark.vllm_line
def test_a_forward_failing_in_the_worker_ends_the_run_with_the_workers_error(
    failed_forward: FailedRun,
) -> None:
    """The worker's own error is the run's error line (vLLM 0.26 answers a failed step's
    sample_tokens with an output lacking the step's requests, which once surfaced as a KeyError
    naming a sample), the exit code says a retry may succeed, and nothing was written."""
    assert failed_forward.returncode == EXIT_FAILURE, failed_forward.stderr[-3000:]
    # vLLM's resource tracker may report the dead worker's semaphores after it: not the last line.
    (error_line,) = [line for line in failed_forward.stderr.splitlines() if line.startswith("error: ")]
    assert error_line.startswith(
        "error: unexpected failure (RuntimeError: Worker failed with error "
        "'injected by the test: the worker's forward failed'"
    ), error_line
    assert "a rerun resumes" in error_line
    assert failed_forward.committed == []


def test_the_rerun_after_a_failed_forward_writes_every_sample(
    failed_forward: FailedRun, job_cache_dir: Path
) -> None:
    assert failed_forward.returncode == EXIT_FAILURE, failed_forward.stderr[-3000:]
    events = run_vllm_job(failed_forward.args, job_cache_dir)
    finished = next(e for e in events if e["event"] == "run_finished")
    written = len(list(iter_output(failed_forward.out)))
    assert finished["status"] == "complete" and finished["written"] == written > 30


KILLED_WORKER_IDS = [f"long-{n:04d}" for n in range(600)]  # the killed worker's run's data


@pytest.fixture(scope="module")
def killed_worker(
    tmp_path_factory: pytest.TempPathFactory, write_jsonl: Any, job_cache_dir: Path
) -> FailedRun:
    """A run whose vLLM worker is SIGKILLed once the first shard is committed, with hundreds of
    samples still to go."""
    import psutil

    scratch = tmp_path_factory.mktemp("e2e-killed-worker")
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "while", "wizards"]
    records = [
        {
            "id": sample_id,
            "conversations": [
                {"from": "human", "value": " ".join(words[(n + i) % len(words)] for i in range(60))},
                {"from": "gpt", "value": " ".join(words[(n * 7 + i) % len(words)] for i in range(120))},
            ],
        }
        for n, sample_id in enumerate(KILLED_WORKER_IDS)
    ]
    data = write_jsonl(scratch / "data.jsonl", records)
    out = scratch / "out"
    args = [
        f"--data.path={data}",
        "--data.max_length=256",
        "--output.shard_bytes=256KiB",
        f"--output.uri={out}",
        "--backend.name=vllm",
        f"--backend.vllm.max_num_batched_tokens={TOKEN_BUDGET}",
        "--backend.vllm.max_num_seqs=4",
        *NO_PREFLIGHT,
    ]
    proc = subprocess.Popen(
        [sys.executable, "-m", "job", "run", "--log.format=json", *args],
        env=vllm_job_env(job_cache_dir, PYTHONUNBUFFERED="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    for line in proc.stdout:
        if line.startswith("{") and json.loads(line)["event"] == "shard_committed":
            break
    (worker,) = [
        p for p in psutil.Process(proc.pid).children(recursive=True) if p.name().startswith("VLLM::Worker")
    ]
    worker.kill()
    _rest, stderr = proc.communicate(timeout=120)
    return FailedRun(proc.returncode, stderr, args, out, [s.sample_id for s in iter_output(out)])


# vLLM's executor watches its workers and marks itself failed (its worker monitor, per line).
@pytest.mark.vllm_line
def test_a_worker_killed_mid_run_ends_the_run_naming_its_death(killed_worker: FailedRun) -> None:
    """A vLLM worker process that the kernel kills (the OOM killer at TP=8, say) ends the run with
    an error line naming the dead worker and its signal, exit 1 (a retry may succeed), and nothing
    half written listed."""
    assert killed_worker.returncode == EXIT_FAILURE, killed_worker.stderr[-3000:]
    (error_line,) = [line for line in killed_worker.stderr.splitlines() if line.startswith("error: ")]
    assert error_line.startswith(
        "error: unexpected failure (RuntimeError: a vLLM worker process died, and vLLM shut its "
        "executor down (VllmWorker-0 killed by SIGKILL))"
    ), error_line
    assert "a rerun resumes" in error_line
    committed = killed_worker.committed
    assert 0 < len(set(committed)) < len(KILLED_WORKER_IDS)
    print(f"\nworker killed with {len(committed)} of {len(KILLED_WORKER_IDS)} samples committed: exit 1")


def test_the_rerun_after_a_killed_worker_writes_every_sample_exactly_once(
    killed_worker: FailedRun, job_cache_dir: Path
) -> None:
    committed = killed_worker.committed
    assert killed_worker.returncode == EXIT_FAILURE, killed_worker.stderr[-3000:]
    assert 0 < len(committed) < len(KILLED_WORKER_IDS)
    run_vllm_job(killed_worker.args, job_cache_dir)
    written = [s.sample_id for s in iter_output(killed_worker.out)]
    assert sorted(written) == sorted(KILLED_WORKER_IDS)


def _alive_in_session(session: int) -> list[Any]:
    import psutil

    alive = []
    for process in psutil.process_iter():
        try:
            if os.getsid(process.pid) == session and process.status() != psutil.STATUS_ZOMBIE:
                alive.append(process)
        except (OSError, psutil.Error):
            continue
    return alive
