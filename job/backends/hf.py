"""The reference backend: HF transformers, one sample per forward, exact.

Layer outputs are taken with forward hooks on the decoder layers themselves
(id 0: the first layer's input), not from ``output_hidden_states``: for many
architectures transformers puts the *normed* final state in its last slot.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from job.architecture import decoder_layers
from job.backend_io import AbandonGenerations, Backend, BackendInput, Completion, GenerationInput, HiddenChunk
from job.errors import ConfigError
from job.hidden_dtype import HiddenDtype, hidden_dtype
from job.model import ModelInfo
from job.weights import weights_load_problem


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
        try:
            loaded = AutoModelForCausalLM.from_pretrained(model.path, dtype=hidden_dtype(model.dtype).torch)
        except Exception as exc:
            if (problem := weights_load_problem(exc)) is None:
                raise
            raise ConfigError(
                f"model.path {model.path}: the weights do not load ({problem}); copy or download the "
                "model's weights again, or point model.path at the model they belong to"
            ) from exc
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
    def extract(
        self, inputs: Iterator[BackendInput | GenerationInput | AbandonGenerations | None]
    ) -> Iterator[HiddenChunk | Completion]:
        decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        for item in inputs:
            if item is None or isinstance(item, AbandonGenerations):  # nothing in flight here
                continue
            if isinstance(item, GenerationInput):
                yield self._generate(item)
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
                destination=item.destination,
            )

    def _generate(self, item: GenerationInput) -> Completion:
        """transformers' generate, one request at a time; sampling seeded from the request's own
        seed, so it is reproducible whatever ran before."""
        from transformers import GenerationConfig

        ids = torch.as_tensor(item.prompt_ids, dtype=torch.long, device=self.device)[None]
        # Exactly these parameters: not the model's generation_config.json (repetition penalties
        # and the like), which the job resolved into the request already (job.generate.sampling).
        sampled = item.temperature > 0
        config = GenerationConfig(
            max_new_tokens=item.max_new_tokens,
            do_sample=sampled,
            eos_token_id=list(item.stop_token_ids),
            pad_token_id=item.stop_token_ids[0],
            **(
                {"temperature": item.temperature, "top_p": item.top_p, "top_k": item.top_k} if sampled else {}
            ),
        )
        if sampled:
            torch.manual_seed(item.seed)
        # transformers fills what `config` leaves unset from the model's own generation config;
        # a blank one leaves transformers' global defaults (no penalties, no length rules).
        self.model.generation_config = GenerationConfig()
        output = self.model.generate(ids, attention_mask=torch.ones_like(ids), generation_config=config)
        tokens = output[0, ids.shape[1] :].tolist()
        stopped = bool(tokens) and tokens[-1] in item.stop_token_ids
        return Completion(item.request_id, tokens, "stop" if stopped else "length")
