"""Everything a run derives from its settings before any model runs (``plan`` uses it too)."""

from __future__ import annotations

import hashlib
import importlib.util
import json
import secrets
import time
from dataclasses import dataclass, replace
from typing import Any

from job.architecture import build_architecture
from job.data.encode import EncoderSpec, SampleEncoder, read_chat_template
from job.data.source import InputFile, SkippedInput, data_fingerprint, scan_input
from job.errors import ConfigError
from job.generate.sampling import Sampling, resolve_sampling
from job.generate.stage import Regenerator
from job.hidden_dtype import HiddenDtype, stored_dtype
from job.manifest import Identity
from job.model import LAYER_CONVENTION, ModelInfo, resolve_model
from job.settings import BackendSettings, JobSettings, VllmSettings
from job.weight_names import NameCheck, check_tensor_names
from job.weight_shapes import ShapeCheck, check_tensor_shapes
from job.weights import check_weights, checkpoint_tensors, weights_fingerprint

# Everything that decides input_ids and loss masks. Current transformers saves a model's
# chat template to chat_template.jinja (or .json), not inside tokenizer_config.json.
_TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
# Per token besides its hidden states: the input id (int32) and the loss-mask flag (uint8).
_IDS_AND_MASK_BYTES = 4 + 1


# vLLM load formats that read the model directory's safetensors or pickles as transformers does.
_FILE_LOAD_FORMATS = (None, "auto", "safetensors", "pt", "fastsafetensors")


def new_run_id() -> str:
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime()) + "-" + secrets.token_hex(3)


def tokenizer_fingerprint(model: ModelInfo, chat_template: str | None) -> str:
    digest = hashlib.sha256()
    for name in _TOKENIZER_FILES:
        path = model.path / name
        if path.is_file():
            digest.update(name.encode() + b"\0" + path.read_bytes())
    digest.update(b"template\0" + (chat_template or "").encode())
    return "sha256:" + digest.hexdigest()


@dataclass(frozen=True)
class CheckedWeights:
    """The weights' fingerprint (in the resume identity) and what their name and shape checks found
    (None: not checked; run_started logs them)."""

    fingerprint: str
    names: NameCheck | None = None
    shapes: ShapeCheck | None = None


def check_model_weights(settings: JobSettings, model: ModelInfo) -> CheckedWeights:
    """The weights' fingerprint, after checking that they can load and that their tensors' names
    and shapes fit config.json (ConfigError, exit 2, if not). vLLM's dummy weights
    (backend.vllm.engine_args load_format, benchmarks) read no file; other load formats than the
    file ones are fingerprinted from what the directory holds, unchecked."""
    vllm = settings.backend.name == "vllm"
    engine_args = settings.backend.vllm.engine_args if vllm else {}
    load_format = engine_args.get("load_format")
    if load_format == "dummy":
        return CheckedWeights("dummy (backend.vllm.engine_args load_format)")
    try:
        files = check_weights(model.path)
    except ConfigError:
        if load_format in _FILE_LOAD_FORMATS:
            raise
        return CheckedWeights(f"unchecked (load_format {load_format})")
    fingerprint = weights_fingerprint(files)
    if load_format not in _FILE_LOAD_FORMATS:
        return CheckedWeights(fingerprint)
    if engine_args.get("hf_overrides"):  # vLLM builds the model from another config than config.json
        why = "config.json overridden (backend.vllm.engine_args hf_overrides)"
        return CheckedWeights(fingerprint, NameCheck(skipped=why), ShapeCheck(skipped=why))
    tensors = checkpoint_tensors(model.path)
    if isinstance(tensors, str):
        return CheckedWeights(fingerprint, NameCheck(skipped=tensors), ShapeCheck(skipped=tensors))
    started = time.monotonic()
    architecture = build_architecture(model.path, settings.model.trust_remote_code)
    names = check_tensor_names(model.path, model.config, architecture, tensors)
    names = replace(names, seconds=round(time.monotonic() - started, 2))
    started = time.monotonic()
    shapes = check_tensor_shapes(model.path, model.config, architecture, tensors)
    return CheckedWeights(fingerprint, names, replace(shapes, seconds=round(time.monotonic() - started, 2)))


@dataclass(frozen=True)
class RunSetup:
    settings: JobSettings
    model: ModelInfo
    layer_ids: list[int]
    dtype: HiddenDtype  # how hidden states are stored
    encoder: EncoderSpec
    identity: Identity
    files: list[InputFile]
    skipped: list[SkippedInput]  # in the data directory, not read (logged by the run)
    sampling: Sampling | None  # generate.mode other than keep: how turns are sampled
    weights: CheckedWeights  # the weights' fingerprint and checks

    def with_weights(self, weights: CheckedWeights) -> RunSetup:
        """This set-up with ``weights`` checked and fingerprinted (the preflight checks them in a
        stage of its own, after prepare_run)."""
        identity = self.identity.model_copy(update={"weights_fingerprint": weights.fingerprint})
        return replace(self, weights=weights, identity=identity)

    @property
    def generates(self) -> bool:
        """Whether the backend generates turns before extracting (generate.mode other than keep)."""
        return self.sampling is not None

    @property
    def bytes_per_token(self) -> int:
        return self.dtype.token_bytes(len(self.layer_ids), self.model.hidden_size) + _IDS_AND_MASK_BYTES

    def regenerator(self, max_active: int) -> Regenerator | None:
        """generate.mode other than keep: the stage that has the backend generate the turns first,
        with ``max_active`` conversations under way at once."""
        if self.sampling is None:
            return None
        generate, data = self.settings.generate, self.settings.data
        return Regenerator(
            SampleEncoder(self.encoder),
            self.sampling,
            generate.mode,
            data.max_length,
            data.reasoning_in_loss,
            generate.on_length,
            max_active=max_active,
        )

    def shard_metadata(self, backend_info: dict[str, object], run_id: str) -> dict[str, str]:
        """What every shard of this run records about its origin (format.py lists the keys)."""
        model = self.model
        metadata = {
            "layer_ids": json.dumps(self.layer_ids),
            "layer_convention": LAYER_CONVENTION,
            "final_layer_prenorm": "true",
            "model_path": str(model.path),
            "model_name": model.name,
            "model_config_hash": model.config_hash,
            "model_dtype": model.dtype,
            "dtype": self.dtype.name,
            "storage": self.dtype.encoding,
            "hidden_size": str(model.hidden_size),
            "num_model_layers": str(model.num_layers),
            "backend": str(backend_info.get("backend", "")),
            "backend_info": json.dumps(backend_info),
            "data_fingerprint": self.identity.data_fingerprint,
            "work_index": str(self.identity.work_index),
            "work_count": str(self.identity.work_count),
            "run_id": run_id,
        }
        if self.identity.generation is not None:  # the turns were regenerated, like this
            metadata["generation"] = json.dumps(self.identity.generation)
        return metadata


def _vllm_installed() -> bool:
    try:
        return importlib.util.find_spec("vllm") is not None
    except ImportError:  # an import hook that refuses vLLM (ModuleNotFoundError): as good as absent
        return False


def ignored_backend_settings(settings: JobSettings) -> list[str]:
    """The settings given another value than their default that the backend in use ignores: the
    vLLM backend's (``backend.vllm.*``) with the hf backend, the hf backend's device with vLLM."""
    backend = settings.backend
    if backend.name == "hf":
        defaults = VllmSettings()
        return [
            f"backend.vllm.{key}"
            for key in VllmSettings.model_fields
            if getattr(backend.vllm, key) != getattr(defaults, key)
        ]
    return ["backend.device"] if backend.device != BackendSettings().device else []


def warn_ignored_settings(log: Any, settings: JobSettings) -> None:
    """The settings_ignored warning, where ``log`` writes it: the run's after run_started, so that
    its shipped log file holds it too; plan's."""
    if ignored := ignored_backend_settings(settings):
        log.warning(
            "settings_ignored",
            settings=ignored,
            why=f"backend.name is {settings.backend.name}: these settings apply to the other backend only",
        )


def check_backend(settings: JobSettings, model: ModelInfo) -> None:
    """Mistakes no retry can fix, found before any sample is read: exit 2 with the setting named."""
    backend = settings.backend
    if backend.name == "vllm" and not _vllm_installed():
        raise ConfigError(
            "backend.name is vllm, but vLLM is not installed in this environment; use the container "
            "image (it brings vLLM), install vLLM, or set backend.name=hf"
        )
    if backend.name == "hf" and backend.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise ConfigError(
                f"backend.device is {backend.device}, but torch sees no CUDA device here; "
                "use backend.device=cpu (or auto)"
            )
    max_length, context = settings.data.max_length, model.max_positions
    # vLLM samples one token after each prompt (its runner asserts on a sequence longer than
    # max_model_len), and max_model_len cannot exceed the model's positions.
    sampled = 1 if backend.name == "vllm" else 0
    if context is not None and max_length + sampled > context:
        why = "; vLLM needs one more for the token it samples after each prompt" if sampled else ""
        raise ConfigError(
            f"data.max_length {max_length} does not fit the {context} positions {model.name} was built "
            f"for (max_position_embeddings){why}; set data.max_length to {context - sampled} or less"
        )
    limit = backend.vllm.max_model_len
    if backend.name == "vllm" and limit is not None and limit <= max_length:
        raise ConfigError(
            f"backend.vllm.max_model_len {limit} is not above data.max_length {max_length}: a sample that "
            "long and the token vLLM samples after it could never run; set it to at least "
            f"{max_length + 1} (or leave it unset) or lower data.max_length"
        )


def prepare_run(settings: JobSettings, check_weights: bool = True) -> RunSetup:
    """``check_weights`` False: the weights are neither checked nor fingerprinted (the preflight,
    whose engine loads none)."""
    model = resolve_model(settings.model)
    check_backend(settings, model)
    layer_ids = model.resolve_layer_ids(settings.layers.ids)
    listing = scan_input(settings.data.path)
    template = read_chat_template(settings.data.chat_template)
    dtype = stored_dtype(settings.model.dtype, settings.output.hidden_dtype)
    encoder = EncoderSpec(
        tokenizer_path=str(model.path),
        chat_template=template,
        data_format=settings.data.format,
        max_length=settings.data.max_length,
        too_long=settings.data.too_long,
        vocab_size=model.vocab_size,
        reasoning_in_loss=settings.data.reasoning_in_loss,
        trust_remote_code=settings.model.trust_remote_code,
        generate_mode=settings.generate.mode,
    )
    sampling = None
    if settings.generate.mode != "keep":
        eos = SampleEncoder(encoder).tokenizer.eos_token_id
        sampling = resolve_sampling(settings.generate, model.path, eos)
    weights = check_model_weights(settings, model) if check_weights else CheckedWeights("unchecked")
    identity = Identity(
        model_config_hash=model.config_hash,
        weights_fingerprint=weights.fingerprint,
        layer_ids=layer_ids,
        storage=dtype.name,
        data_fingerprint=data_fingerprint(listing.files),
        data_format=settings.data.format,
        max_length=settings.data.max_length,
        too_long=settings.data.too_long,
        reasoning_in_loss=settings.data.reasoning_in_loss,
        generation=None
        if sampling is None
        else {"mode": settings.generate.mode, "on_length": settings.generate.on_length, **sampling.record()},
        tokenizer_fingerprint=tokenizer_fingerprint(model, template),
        work_index=settings.work.index,
        work_count=settings.work.count,
    )
    return RunSetup(
        settings,
        model,
        layer_ids,
        dtype,
        encoder,
        identity,
        listing.files,
        listing.skipped,
        sampling,
        weights,
    )
