"""The reference backend: HF transformers, one sample per forward, exact.

Layer outputs are taken with forward hooks on the decoder layers themselves
(id 0: the first layer's input), not from ``output_hidden_states``: for many
architectures transformers puts the *normed* final state in its last slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from job.backends import Backend, BackendInput, HiddenChunk
from job.hidden_dtype import HiddenDtype, hidden_dtype
from job.model import ModelInfo


def decoder_layers(model: torch.nn.Module) -> torch.nn.ModuleList:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    layers = getattr(decoder, "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: cannot find the decoder layer list")
    return layers


class HFBackend(Backend):
    name = "hf"

    def __init__(self, model: torch.nn.Module, layer_ids: list[int], dtype: HiddenDtype) -> None:
        self.layer_ids = layer_ids
        self.dtype = dtype
        self.model = model.eval()
        self.device = next(model.parameters()).device
        self._captured: dict[int, torch.Tensor] = {}
        layers = decoder_layers(self.model)
        for k in layer_ids:
            if k == 0:
                layers[0].register_forward_pre_hook(self._capture_input, with_kwargs=True)
            else:
                layers[k - 1].register_forward_hook(self._capture_output(k))

    @classmethod
    def load(cls, model: ModelInfo, layer_ids: list[int], device: str, dtype: HiddenDtype) -> HFBackend:
        from transformers import AutoModelForCausalLM

        target = torch.device(
            ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
        )
        loaded = AutoModelForCausalLM.from_pretrained(model.path, dtype=hidden_dtype(model.dtype).torch)
        return cls(loaded.to(target), layer_ids, dtype)

    def _capture_input(self, _module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        self._captured[0] = args[0] if args else kwargs["hidden_states"]

    def _capture_output(self, k: int) -> Any:
        def hook(_module: Any, _args: Any, output: Any) -> None:
            self._captured[k] = output[0] if isinstance(output, tuple) else output

        return hook

    @property
    def info(self) -> dict[str, Any]:
        import transformers

        return {"backend": "hf", "transformers_version": transformers.__version__, "device": str(self.device)}

    @torch.inference_mode()
    def extract(self, inputs: Iterator[BackendInput | None]) -> Iterator[HiddenChunk]:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        for item in inputs:
            if item is None:  # nothing pending here: just ask again
                continue
            ids = torch.as_tensor(item.input_ids, dtype=torch.long, device=self.device)[None]
            self._captured.clear()
            decoder(input_ids=ids, use_cache=False)
            states = torch.stack([self._captured[k][0] for k in self.layer_ids], dim=1)
            nonfinite = not bool(torch.isfinite(states).all())
            rows, scales = self.dtype.encode(states)
            yield HiddenChunk(
                item.sample_id,
                0,
                rows.cpu().contiguous(),
                None if scales is None else scales.cpu().contiguous(),
                last=True,
                nonfinite=nonfinite,
            )
