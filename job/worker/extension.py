"""The worker extension vLLM mixes into its Worker class (``worker_extension_cls``).

Its methods run inside every TP worker process via ``collective_rpc``. Names
carry an ``hs_`` prefix: vLLM refuses extensions that shadow Worker attributes.
"""

from __future__ import annotations

from typing import Any

from job.logs import configure_worker_logging

# vLLM imports this module in each worker process as the worker starts, before its model loads.
configure_worker_logging()


class HiddenStateCaptureExtension:
    def hs_install(
        self, ring_spec: dict[str, Any], layer_ids: list[int], adapter_set: str, mode: str
    ) -> dict[str, Any]:
        """Install capture (``mode``: compiled | hooks) on TP rank 0: the residual stream is
        replicated after every layer's all-reduce, so one rank has all of it. In compiled mode
        every rank's model returns the same aux layers (their graphs, collectives included, must
        agree); only rank 0 ships them. ``adapter_set`` is the driver's choice, by name. Runs
        before the first forward, so the compiled graph includes all of it."""
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank

        from adapters import adapter_set_named
        from job.worker.capture import COMPILED, StepCapture, configure_aux, plan_compiled
        from job.worker.ring import RingSpec

        tp_rank = get_tensor_model_parallel_rank()
        info: dict[str, Any] = {"tp_rank": tp_rank, "capturing": False}
        if get_pp_group().world_size != 1:
            raise RuntimeError("hidden-state capture supports pipeline_parallel_size 1 only")
        adapters = adapter_set_named(adapter_set)
        if tp_rank != 0:
            if mode == COMPILED:
                aux_ids, _taps = plan_compiled(self.model_runner.get_model(), layer_ids, adapters)
                configure_aux(self, aux_ids)
            return info
        capture = StepCapture.install(self, RingSpec(**ring_spec), layer_ids, adapters, mode)
        self._hs_capture = capture
        info.update(capturing=True, **capture.describe())
        return info

    def hs_arm(self) -> None:
        """Start capturing. Before this, vLLM's own warm-up steps (Model Runner
        V2 runs real steps with dummy requests) pass through untouched."""
        capture = getattr(self, "_hs_capture", None)
        if capture is not None:
            capture.armed = True

    def hs_close(self) -> None:
        capture = getattr(self, "_hs_capture", None)
        if capture is not None:
            capture.close()
            self._hs_capture = None
