"""The preflight on a real vLLM (the CPU build in CI). Its engine reads no weights (vLLM's dummy
load format), but the preflight checks the weight files as ``run`` does before any model loads
(job.weights, job.weight_names): a model directory whose weight file cannot be read, or whose
tensor names do not fit its config.json, fails the preflight with ``run``'s own error, before any
engine starts.

The four failures that once each cost a full model load on an 8-GPU node are injected, one at a
time, into the installed adapter set inside the job's own processes (a sitecustomize that patches
the adapter's module as it is imported, in the driver and in vLLM's workers alike): requests built
without the engine's block hasher, the Scheduler called the pre-0.11.1 way, a single-phase step
(execute_model without sample_tokens), and a capture hook that expects a decoder layer to return
one tensor. Each fails in the preflight with exit 2 and an error naming that concern. A compiled
capture's tap that expects one tensor fails in vLLM's compilation instead (Dynamo traces it, no hook
call raises): a run without the preflight names it as well, with exit 2.

Tests run as root here, which reads any file whatever its mode: the unreadable weight file is a
symlink to nothing, which no one can read.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from conftest import vllm_job_env, with_sitecustomize
from safetensors.torch import load_file, save_file

from job.backends.vllm_engine import REQUESTS, SCHEDULER, STEP
from job.errors import EXIT_CONFIG
from job.worker.capture import CAPTURE_HOOK, CAPTURE_TAP

if os.environ.get("REQUIRE_VLLM") != "1":
    pytest.importorskip("vllm", reason="vLLM is not installed in this environment")

pytestmark = pytest.mark.vllm

# Eager mode (no compilation: the cheapest engine start on a CPU), a few short samples.
ARGS = (
    "--backend.name=vllm",
    "--backend.vllm.enforce_eager=true",
    "--backend.vllm.max_num_batched_tokens=64",
    "--backend.vllm.max_num_seqs=4",
    "--model.dtype=float32",
    "--data.max_length=128",
    "--data.tokenizer_workers=0",
    "--preflight.samples=3",
    "--log.format=json",
)

# Patches ``MODULE`` right after it is imported, with ``patch(module)``.
PATCH_ON_IMPORT = """
import importlib.abc
import importlib.util
import sys

MODULE = {module!r}


def patch(module):
{body}


class PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, PatchOnImport())
"""

INJECTIONS = {
    "requests without a block hasher": (
        "adapters.requests",
        """
    build = module.build_request

    def without_hasher(facts, request_id, prompt_token_ids, sampling_params, block_hasher):
        return build(facts, request_id, prompt_token_ids, sampling_params, None)

    module.build_request = without_hasher
""",
        REQUESTS,
    ),
    "the Scheduler called the pre-0.16 way": (
        "adapters.scheduling",
        """
    def before_block_size(facts, vllm_config, kv_cache_config, block_size, hash_block_size):
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.structured_output import StructuredOutputManager

        # vLLM before 0.11.1 took no block_size
        return Scheduler(
            vllm_config=vllm_config,
            kv_cache_config=kv_cache_config,
            structured_output_manager=StructuredOutputManager(vllm_config),
            log_stats=False,
        )

    module.build_scheduler = before_block_size
""",
        SCHEDULER,
    ),
    "a single-phase step": (
        "adapters.execution",
        """
    def single_phase(executor, scheduler, scheduler_output):
        return module.StepResult(executor.execute_model(scheduler_output, non_block=True), None)

    module.submit_step = single_phase
""",
        STEP,
    ),
    "a capture hook expecting the wrong decoder-layer outputs": (
        "job.worker.capture",
        """
    def output_hook(self, j):
        def hook(_module, _args, output):  # as if the layer returned one tensor, not (hidden, residual)
            if self.active:
                self.current.states[: self.num_tokens, j].copy_(output[: self.num_tokens])

        return hook

    module.StepCapture._output_hook = output_hook
""",
        CAPTURE_HOOK,
    ),
}


# A compiled capture's tap (job.worker.capture._output_tap) as if the layer returned one tensor.
TAP_EXPECTING_ONE_TENSOR = """
    def output_tap(buffer):
        def hook(_module, _args, output):
            buffer[: output.shape[0]].copy_(output)

        return hook

    module._output_tap = output_tap
"""


@pytest.fixture(scope="module")
def unreadable_model(tmp_path_factory: pytest.TempPathFactory, builtin_model: Any) -> Path:
    """builtin:tiny-llama with its weight file replaced by a symlink to nothing."""
    model = tmp_path_factory.mktemp("unreadable") / "tiny-llama"
    shutil.copytree(builtin_model("tiny-llama"), model)
    weights = list(model.glob("*.safetensors"))
    assert weights
    for path in weights:
        path.unlink()
        path.symlink_to(model / "never-written" / path.name)
    return model


def _job(
    command: str, args: list[str], cache: Path, common: tuple[str, ...] = ARGS, **env: str
) -> tuple[int, list[dict[str, Any]], str]:
    proc = subprocess.run(
        [sys.executable, "-m", "job", command, *common, *args],
        env=vllm_job_env(cache, **env),
        capture_output=True,
        text=True,
        timeout=900,
    )
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    return proc.returncode, events, errors[-1] if errors else ""


@pytest.mark.parametrize("injection", list(INJECTIONS))
def test_each_known_failure_fails_the_preflight_with_exit_2_naming_it(
    injection: str, tiny_llama_dir: Path, tmp_path: Path
) -> None:
    module, body, concern = INJECTIONS[injection]
    pythonpath = with_sitecustomize(tmp_path / "inject", PATCH_ON_IMPORT.format(module=module, body=body))
    out = tmp_path / "out"
    rc, events, error = _job(
        "preflight",
        [f"--model.path={tiny_llama_dir}", f"--output.uri={out}"],
        tmp_path / "cache",
        PYTHONPATH=pythonpath,
    )
    assert rc == EXIT_CONFIG, (error, events[-3:])
    assert error.startswith(f"error: backend.vllm.adapter_set: {concern} failed with adapter set"), error
    assert "does not fit the installed vLLM" in error
    names = [e["event"] for e in events]
    assert "preflight_engine" in names and "preflight_passed" not in names
    assert not out.exists()
    print(f"\n{injection}: {error}")


@pytest.fixture(scope="module")
def misnamed_model(tmp_path_factory: pytest.TempPathFactory, builtin_model: Any) -> Path:
    """builtin:tiny-llama with every tensor name prefixed as a PEFT save prefixes them."""
    model = tmp_path_factory.mktemp("misnamed") / "tiny-llama"
    shutil.copytree(builtin_model("tiny-llama"), model)
    tensors = load_file(model / "model.safetensors")
    save_file({f"base_model.model.{k}": v for k, v in tensors.items()}, model / "model.safetensors")
    return model


@pytest.mark.parametrize(
    ("weights", "error"),
    [
        (
            "unreadable",
            "1 weight file(s) cannot load: model.safetensors: cannot be read (No such file or directory); "
            "copy or download the model's weights again",
        ),
        (
            "misnamed",
            "the weights' tensor names do not fit its config.json (LlamaForCausalLM): 0 of its 75 tensor "
            "names are names the model has; 75 would be, without the prefix 'base_model.model.' at their "
            "start",
        ),
    ],
)
def test_weights_run_would_refuse_fail_the_preflight_before_its_engine(
    weights: str, error: str, unreadable_model: Path, misnamed_model: Path, tmp_path: Path
) -> None:
    """The preflight's own engine would pass them (dummy weights); the real load would not (vLLM
    refuses both inside its worker, after the engine's start-up: exit 1). The preflight refuses
    them with run's error, exit 2, before any engine starts; run refuses them before its
    preflight."""
    model = unreadable_model if weights == "unreadable" else misnamed_model
    out = tmp_path / "out"
    args = [f"--model.path={model}", f"--output.uri={out}"]
    rc, events, preflight_error = _job("preflight", args, tmp_path / "cache")
    assert rc == EXIT_CONFIG, (preflight_error, events[-3:])
    assert preflight_error.startswith(f"error: model.path {model}: {error}"), preflight_error
    assert "preflight_engine" not in [e["event"] for e in events]
    rc, events, run_error = _job("run", args, tmp_path / "cache")
    assert rc == EXIT_CONFIG and run_error == preflight_error, (run_error, events[-3:])
    assert not [e for e in events if e["event"].startswith("preflight")]
    assert not out.exists()


def test_a_compiled_tap_failing_in_vllms_compilation_exits_2_without_the_preflight(
    tiny_llama_dir: Path, tmp_path: Path
) -> None:
    """The run's own engine start-up, without the preflight: the tap fails while the worker's warm-up
    compiles the model (vLLM reports "Worker failed with error ..."); the tap reported it through
    the ring first, and the run ends with exit 2 naming it, nothing written."""
    import vllm

    from adapters import select_adapter_set

    if select_adapter_set(vllm.__version__).facts.eagle_model_mixin:
        pytest.skip(f"vLLM {vllm.__version__} gives every layer id of the tiny Llama as aux output: no tap")
    pythonpath = with_sitecustomize(
        tmp_path / "inject",
        PATCH_ON_IMPORT.format(module="job.worker.capture", body=TAP_EXPECTING_ONE_TENSOR),
    )
    compiled = tuple(a for a in ARGS if not a.startswith("--backend.vllm.enforce_eager="))
    out = tmp_path / "out"
    rc, events, error = _job(
        "run",
        [f"--model.path={tiny_llama_dir}", f"--output.uri={out}", "--preflight.before_run=false"],
        tmp_path / "cache",
        common=(*compiled, "--backend.vllm.enforce_eager=false"),
        PYTHONPATH=pythonpath,
    )
    assert rc == EXIT_CONFIG, (error, events[-3:])
    assert error.startswith(f"error: backend.vllm.adapter_set: {CAPTURE_TAP} failed with adapter set"), error
    assert "(layer id 8 on LlamaDecoderLayer: " in error and "does not fit the installed vLLM" in error
    installed = next(e for e in events if e["event"] == "capture_installed")
    assert installed["mode"] == "compiled" and installed["layer_sources"]["8"] == "tap"
    assert not [e for e in events if e["event"].startswith("preflight")]
    assert not [e for e in events if e["event"] == "shard_committed"]
    print(f"\ncompiled tap, no preflight: {error}")
