"""``python tests/speculators_cpu.py COMMAND ...``: ``python -m job.speculators COMMAND ...`` on a
machine without a GPU, for tests and the documented CPU demonstration.

speculators 0.9's trainer is CUDA-only in two places, and only those are replaced here (the
installed package is not edited):

* ``Trainer`` moves the model and every batch to ``get_local_rank()`` (an int: CUDA device 0);
  here that is the CPU device;
* its step timer calls ``torch.accelerator.synchronize()`` on every logged step, which
  initialises CUDA; with no accelerator there is nothing to wait for, so it returns at once.

Everything else (data, backend, model, loss, optimizer) is speculators' own; pass
``--draft-attn-impl sdpa --loss-implementation eager`` (flex attention and the fused loss
need a GPU). With ``SPECULATORS_METRICS_JSONL=FILE`` every metrics record speculators logs
(``speculators.metrics``: training steps, validation) is also appended to FILE as a JSON line.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

import job.speculators  # noqa: F401 - registers the eagle3-extract backend before speculators' imports


class _JsonLines(logging.Handler):
    def __init__(self, path: str) -> None:
        super().__init__()
        self.path = path

    def emit(self, record: logging.LogRecord) -> None:
        if isinstance(record.msg, dict) and not getattr(record, "hparams", False):
            with open(self.path, "a") as out:
                out.write(json.dumps(record.msg, default=str) + "\n")


def _on_cpu() -> None:
    import speculators.train.cli as train_cli
    import speculators.train.trainer as trainer

    trainer.get_local_rank = lambda: torch.device("cpu")  # type: ignore[assignment,return-value]
    if not torch.accelerator.is_available():
        torch.accelerator.synchronize = lambda device=None: None  # type: ignore[assignment]

    path = os.environ.get("SPECULATORS_METRICS_JSONL")
    if path:
        configure = train_cli.setup_metric_logger

        def setup_metric_logger(*args: object, **kwargs: object) -> None:
            configure(*args, **kwargs)  # speculators' logging setup replaces the logger's handlers
            logging.getLogger("speculators.metrics").addHandler(_JsonLines(path))

        train_cli.setup_metric_logger = setup_metric_logger


if __name__ == "__main__":
    _on_cpu()
    from job.speculators.__main__ import main

    sys.argv[0] = "speculators_cpu"
    main(prog_name="python tests/speculators_cpu.py")
