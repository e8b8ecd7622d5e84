"""``python -m job run``: the preflight in a process of its own, then the run of this work index.

This module alone knows that order. The preflight (``job.preflight``) reuses the pipeline below it
with a reduced engine; the pipeline (``job.pipeline.runner``) knows no preflight.
"""

from __future__ import annotations

from typing import Any

from job.pipeline.runner import run_index
from job.pipeline.setup import prepare_run
from job.preflight import preflight_in_subprocess
from job.settings import JobSettings


def run(settings: JobSettings) -> dict[str, Any]:
    """Check the settings, model, weights and data listing (exit 2 on a mistake); with the vLLM
    backend run the preflight (``preflight.before_run``) in a child process, which has ended, its
    engine and memory with it, before the run starts its own (it takes the weights as checked
    here, without checking them again); then run the index; its totals."""
    setup = prepare_run(settings)
    if settings.backend.name == "vllm" and settings.preflight.before_run:
        # Before the output is opened: a failing preflight leaves it untouched.
        preflight_in_subprocess(settings, setup.weights)
    return run_index(setup)
