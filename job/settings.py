"""The job's one settings model.

Sources, strongest first: CLI flags (``--output.uri=...``) > environment
(``JOB_`` prefix, ``__`` for nesting: ``JOB_OUTPUT__URI``) > the YAML file given
by ``--config`` > ``config/default.yaml``. Unknown keys are errors everywhere.
"""

from __future__ import annotations

import errno
import itertools
import os
import re
from collections.abc import Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    NonNegativeInt,
    PositiveInt,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_settings import (
    BaseSettings,
    CliSettingsSource,
    PydanticBaseSettingsSource,
    SettingsConfigDict,
    YamlConfigSettingsSource,
)

from job.errors import ConfigError


def config_dir() -> Path:
    """The directory holding default.yaml, adapters.yaml and the examples.

    A wheel carries it as ``job/_config``; a source checkout has it at ``config/``.
    """
    packaged = Path(__file__).parent / "_config"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "config"


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)


class ModelSettings(Section):
    path: str = Field(
        "builtin:tiny-llama",
        description="Local model directory, hub id, a builtin tiny random model (builtin:tiny-llama, "
        "tiny-chatml, tiny-deepseek-v3, tiny-qwen3) or builtin:smollm2-135m-instruct, a real pretrained "
        "model built from a PyPI wheel (job.pretrained)",
    )
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    revision: str | None = None
    trust_remote_code: bool = False


class LayerSettings(Section):
    ids: list[int] | None = Field(
        None,
        description="Layer ids (0 = embeddings, N = last layer before the final norm); "
        "omitted: EAGLE-3 default [2, N//2, N-3, N]",
    )

    @field_validator("ids")
    @classmethod
    def _unique(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None:
            if not ids:
                raise ValueError("give at least one layer id, or omit layers.ids for the default")
            if len(set(ids)) != len(ids):
                raise ValueError("layer ids must be unique")
        return ids


class DataSettings(Section):
    path: str = Field("builtin:examples", description="JSONL/Parquet file or directory")
    format: Literal["auto", "sharegpt", "openai", "tokenized"] = "auto"
    max_length: PositiveInt = 2048
    too_long: Literal["truncate", "skip"] = "truncate"
    chat_template: str | None = Field(
        None, description="Path to a Jinja chat template replacing the tokenizer's own"
    )
    tokenizer_workers: NonNegativeInt = Field(
        1, description="Tokenizer processes; 0 tokenizes in a background thread"
    )
    prefetch_samples: PositiveInt = Field(
        2048, description="How many tokenized samples may wait ahead of the backend"
    )
    max_rejected_fraction: float = Field(
        0.5,
        ge=0,
        le=1,
        description="An index that rejects more than this fraction of its samples (or writes none) ends "
        "with exit 2 and a summary of the reasons instead of completing; 1 accepts any",
    )
    max_record_bytes: ByteSize = Field(
        ByteSize(64 * 1024**2),
        description="Longest JSONL record read; longer ones are rejected unread (a record's memory "
        "peak grows with its size, see docs/data.md)",
    )
    reasoning_in_loss: bool = Field(
        True,
        description="Whether the <think>...</think> reasoning the chat template renders in assistant "
        "turns counts in the loss mask",
    )

    @field_validator("path")
    @classmethod
    def _path_given(cls, value: str) -> str:
        # Here, not only when the files are listed: that comes after the model is resolved, which
        # may mean downloading it from the hub first.
        return _non_empty(value, "a JSONL/Parquet file or directory, or s3://bucket/prefix")


# EngineArgs that the job sets from its own settings: engine_args may not override them unseen.
SHADOWED_ENGINE_ARGS = {
    "model": "model.path",
    "tokenizer": "model.path",
    "dtype": "model.dtype",
    "revision": "model.revision",
    "trust_remote_code": "model.trust_remote_code",
    "tensor_parallel_size": "backend.tensor_parallel_size",
    "max_num_batched_tokens": "backend.vllm.max_num_batched_tokens",
    "max_num_seqs": "backend.vllm.max_num_seqs",
    "gpu_memory_utilization": "backend.vllm.gpu_memory_utilization",
    "max_model_len": "backend.vllm.max_model_len",
    "attention_backend": "backend.vllm.attention_backend",
    "enforce_eager": "backend.vllm.enforce_eager",
}


class VllmSettings(Section):
    max_num_batched_tokens: PositiveInt = 16384
    max_num_seqs: PositiveInt = 128
    gpu_memory_utilization: float = Field(0.85, gt=0, le=1)
    enforce_eager: bool = Field(
        False,
        description="false: vLLM's default compilation and CUDA graphs, capture through the model's "
        "EAGLE-3 aux outputs (and compiled taps); true: eager mode, capture with forward hooks",
    )
    attention_backend: str | None = None
    max_model_len: PositiveInt | None = Field(
        None, description="Defaults to data.max_length + 1 (the token vLLM samples after each prompt)"
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict, description="Extra vllm EngineArgs, passed through"
    )
    adapter_set: str | None = Field(None, description="Force an adapter set by name")
    allow_nearest_adapter: bool = Field(
        False, description="Run an unsupported vLLM version with the nearest adapter set"
    )
    capture_slots: int = Field(
        4, ge=2, description="Host buffers (one step each) between the TP rank-0 worker and the writer"
    )
    final_step_tokens: PositiveInt | None = Field(
        None,
        description="Once every sample is in vLLM's hands and at most one full step's tokens are left "
        "to schedule, at most this many tokens per step, so what is left to write after the GPU is "
        "done shrinks to one such step. Default: a quarter of max_num_batched_tokens (measured on "
        "H200, docs/benchmarks.md); max_num_batched_tokens turns the cap off, and so does a step of "
        "whole prompts (no chunked prefill)",
    )

    @property
    def final_step_budget(self) -> int:
        """The tokens per step once the last full step's worth is left (final_step_tokens resolved)."""
        return self.final_step_tokens or max(1, self.max_num_batched_tokens // 4)

    @field_validator("engine_args")
    @classmethod
    def _no_shadowed_settings(cls, value: dict[str, Any]) -> dict[str, Any]:
        shadowed = {k: SHADOWED_ENGINE_ARGS[k] for k in value if k in SHADOWED_ENGINE_ARGS}
        if shadowed:
            settings = ", ".join(f"{k} -> {v}" for k, v in shadowed.items())
            raise ValueError(
                f"these engine arguments have settings of their own; set those instead: {settings}"
            )
        return value

    @model_validator(mode="after")
    def _final_steps_fit_the_budget(self) -> VllmSettings:
        if self.final_step_tokens is not None and self.final_step_tokens > self.max_num_batched_tokens:
            raise ValueError(
                f"backend.vllm.final_step_tokens is {self.final_step_tokens}, more than "
                f"backend.vllm.max_num_batched_tokens ({self.max_num_batched_tokens}); set it lower"
            )
        return self


class BackendSettings(Section):
    name: Literal["hf", "vllm"] = "hf"
    tensor_parallel_size: PositiveInt = 1
    device: str = Field("auto", description="hf backend: cpu, cuda, cuda:N or auto")
    vllm: VllmSettings = Field(default_factory=VllmSettings)

    @model_validator(mode="after")
    def _hf_runs_one_device(self) -> BackendSettings:
        if self.name == "hf" and self.tensor_parallel_size != 1:
            raise ValueError(
                f"backend.tensor_parallel_size is {self.tensor_parallel_size}, but the hf backend runs the "
                "model on one device; use backend.name=vllm for tensor parallelism"
            )
        return self


MIN_PART_SIZE = 5 * 1024**2  # S3's smallest multipart part (the last part may be smaller)
MAX_PART_SIZE = 5 * 1024**3


class OutputSettings(Section):
    uri: str = Field("./out", description="Local path, file:// or s3://bucket/prefix URI")
    parallel_uploads: PositiveInt = Field(
        3, description="Object-store output: finished shards uploading at once (within max_staged_bytes)"
    )
    verify_on_resume: Literal["checksum", "size"] = Field(
        "checksum",
        description="What resume checks of every committed shard: checksum (local: read it once; object "
        "stores: the stored full-object checksum, one HEAD each) or size only",
    )
    on_damaged_shard: Literal["stop", "reextract"] = Field(
        "stop",
        description="A committed shard that fails that check on resume: stop (exit 2, naming it) or "
        "drop it from the manifest and extract its samples again",
    )
    shard_bytes: ByteSize = Field(ByteSize(2 * 1024**3), description="Target shard size")
    writer_threads: PositiveInt = Field(
        8,
        description="Threads writing hidden-state rows into shards (4 fell behind a Kimi-width model's "
        "2 GB/s on an H200 host: docs/benchmarks.md, 2026-12-01 late)",
    )
    staging_dir: str | None = Field(
        None,
        description="s3:// output: local directory where shards are built before upload "
        "(a pod-local emptyDir in Kubernetes); default: a new temporary directory",
    )
    max_staged_bytes: ByteSize = Field(
        ByteSize(8 * 1024**3),
        description="s3:// output: most bytes of shards on local disk at once (being filled or "
        "waiting for upload); when reached, extraction waits for uploads. Must hold the largest "
        "shard; 3x shard_bytes or more keeps extraction and uploads overlapping",
    )
    upload_threads: PositiveInt = Field(
        8,
        description="s3:// output: part uploads in flight at once, shared by the parallel_uploads shards "
        "uploading together",
    )
    part_size: ByteSize = Field(
        ByteSize(64 * 1024**2),
        description="s3:// output: multipart part size (and the size above which uploads are multipart). "
        "Keep 64MiB or more in production; values down to S3's 5MiB minimum exist so tests can "
        "exercise multipart uploads with small shards",
    )
    sign_payload: bool = Field(
        True,
        description="s3:// output to an http:// endpoint: SigV4-sign the bytes of every uploaded part "
        "with SHA-256 (botocore's default there; over https botocore leaves bodies that carry a checksum "
        "unsigned anyway). false sends UNSIGNED-PAYLOAD: the CRC64NVME of every part and of the whole "
        "shard still catch corruption, not deliberate tampering on the wire, so use it only for an "
        "endpoint on a trusted network (in-cluster, localhost); it saves a SHA-256 pass over every "
        "byte in the job and in the server",
    )
    hidden_dtype: Literal["model", "fp8_e4m3"] = Field(
        "model",
        description="How hidden states are stored: model = the model dtype; fp8_e4m3 = FP8 with a "
        "float32 scale per token and layer: about half the bytes, relative error per token and layer "
        "at most 6.7% (typically 2.6%); the reader and the export decode it to the model dtype",
    )

    @field_validator("uri")
    @classmethod
    def _uri_given(cls, value: str) -> str:
        return _non_empty(value, "a local path, file:// or s3://bucket/prefix")

    @field_validator("shard_bytes")
    @classmethod
    def _min_shard(cls, value: ByteSize) -> ByteSize:
        if value < 4096:
            raise ValueError(f"{int(value)} bytes is too small for a shard; use at least 4KiB")
        return value

    @field_validator("part_size")
    @classmethod
    def _part_size(cls, value: ByteSize) -> ByteSize:
        if not MIN_PART_SIZE <= value <= MAX_PART_SIZE:
            raise ValueError("S3 multipart parts must be between 5MiB and 5GiB; use 64MiB or more")
        return value

    @model_validator(mode="after")
    def _staging_holds_a_shard(self) -> OutputSettings:
        if self.uri.startswith("s3://") and self.max_staged_bytes < self.shard_bytes:
            raise ValueError(
                f"output.max_staged_bytes ({self.max_staged_bytes.human_readable()}) is smaller than "
                f"output.shard_bytes ({self.shard_bytes.human_readable()}): staging must hold at least one "
                "shard; raise max_staged_bytes (3x shard_bytes or more) or lower shard_bytes"
            )
        return self


def _non_empty(value: str, what: str) -> str:
    if not value.strip():
        raise ValueError(f"empty; give {what} (is an environment variable that should set it unset?)")
    return value


def _env_int(name: str, default: int) -> int:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise ConfigError(f"environment {name}={raw!r} is not an integer") from None


class WorkSettings(Section):
    index: NonNegativeInt = Field(
        default_factory=lambda: _env_int("JOB_COMPLETION_INDEX", 0),
        description="This worker's slice; defaults to $JOB_COMPLETION_INDEX",
    )
    count: PositiveInt = Field(
        default_factory=lambda: _env_int("JOB_COMPLETION_COUNT", 1),
        description="Number of slices; defaults to $JOB_COMPLETION_COUNT",
    )

    @model_validator(mode="after")
    def _index_in_range(self) -> WorkSettings:
        if self.index >= self.count:
            raise ValueError(f"work.index {self.index} must be below work.count {self.count}")
        return self


class GenerateSettings(Section):
    """Regenerating assistant turns with the target model before extraction (job.generate)."""

    mode: Literal["keep", "last_turn", "all_turns"] = Field(
        "keep",
        description="keep: the data's own turns; last_turn: the final assistant turn generated again "
        "(or one written after a final user turn); all_turns: every assistant turn, each from the "
        "regenerated history",
    )
    temperature: float | None = Field(
        None, ge=0, description="Sampling temperature (0: greedy); unset: generation_config.json, else 1"
    )
    top_p: float | None = Field(None, gt=0, le=1, description="Unset: generation_config.json, else 1")
    top_k: int | None = Field(None, ge=0, description="0: none; unset: generation_config.json, else none")
    max_new_tokens: PositiveInt | None = Field(
        None, description="Longest generated turn; unset: generation_config.json, else 2048"
    )
    seed: int = Field(0, description="A request's seed derives from it, the sample id and the turn")
    on_length: Literal["keep", "reject"] = Field(
        "keep",
        description="A turn cut by max_new_tokens (or data.max_length): keep it (counted as cut) or "
        "reject the sample (listed in rejected.jsonl)",
    )


class PreflightSettings(Section):
    """``python -m job preflight``, and what ``run`` does first with the vLLM backend."""

    before_run: bool = Field(
        True,
        description="run with backend.name=vllm: the preflight first (dummy weights at reduced depth, "
        "about one engine start-up), so a setting that cannot work fails with exit 2 before the model "
        "loads; false: straight to the model",
    )
    samples: PositiveInt = Field(
        8, description="How many of this index's first samples the preflight sends through the pipeline"
    )
    max_cudagraph_capture_size: PositiveInt | None = Field(
        8,
        description="compiled mode on a GPU: the largest batch size whose CUDA graph the preflight's "
        "engine captures (vLLM's compilation_config.max_cudagraph_capture_size; 8: sizes 1, 2, 4, 8, "
        "which prove the graphs' capture with the hidden-state outputs, where the run captures vLLM's "
        "whole list, up to twice max_num_seqs); null: the run's list. Where backend.vllm.engine_args "
        "sets the compilation_config's sizes, those stand",
    )


class LogSettings(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["auto", "json", "console"] = "auto"
    progress_interval_s: float = Field(10.0, gt=0)


@dataclass(frozen=True)
class _Sources:
    config_file: Path | None
    cli_args: Sequence[str]


_NO_SOURCES = _Sources(None, ())
_SOURCES: ContextVar[_Sources] = ContextVar("_SOURCES", default=_NO_SOURCES)


class JobSettings(BaseSettings):
    model_config = SettingsConfigDict(
        env_prefix="JOB_",
        env_nested_delimiter="__",
        extra="forbid",
        validate_default=True,
        nested_model_default_partial_update=True,
    )

    model: ModelSettings = Field(default_factory=ModelSettings)
    layers: LayerSettings = Field(default_factory=LayerSettings)
    data: DataSettings = Field(default_factory=DataSettings)
    backend: BackendSettings = Field(default_factory=BackendSettings)
    output: OutputSettings = Field(default_factory=OutputSettings)
    work: WorkSettings = Field(default_factory=WorkSettings)
    generate: GenerateSettings = Field(default_factory=GenerateSettings)
    preflight: PreflightSettings = Field(default_factory=PreflightSettings)
    log: LogSettings = Field(default_factory=LogSettings)

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        sources = _SOURCES.get()
        chain: list[PydanticBaseSettingsSource] = [init_settings]
        if sources.cli_args:
            chain.append(
                CliSettingsSource(
                    settings_cls,
                    cli_parse_args=list(sources.cli_args),
                    cli_prog_name="python -m job",
                    cli_exit_on_error=False,
                    cli_implicit_flags=False,
                )
            )
        chain.append(env_settings)
        if sources.config_file is not None:
            chain.append(YamlConfigSettingsSource(settings_cls, yaml_file=sources.config_file))
        chain.append(YamlConfigSettingsSource(settings_cls, yaml_file=config_dir() / "default.yaml"))
        return tuple(chain)


def load_settings(config_file: str | Path | None = None, cli_args: Sequence[str] = ()) -> JobSettings:
    """Build the effective settings or raise ConfigError with one readable line."""
    path = Path(config_file) if config_file else None
    if path is not None:
        _check_config_file(path)
        _check_yaml_mapping(path)
    _check_env_typos(os.environ)
    token = _SOURCES.set(_Sources(path, tuple(cli_args)))
    try:
        return JobSettings()
    except ValidationError as exc:
        raise ConfigError(describe_validation_error(exc)) from None
    except ConfigError:
        raise
    except Exception as exc:  # YAML syntax, CLI parsing: both raise plain errors
        message = _one_line(str(exc))
        if "unrecognized arguments:" in message:
            flags = message.split("unrecognized arguments:", 1)[1].strip()
            message = f"unknown setting(s) {flags} (`python -m job config` lists every key)"
        raise ConfigError(f"settings: {message}") from None
    finally:
        _SOURCES.reset(token)


def _check_config_file(path: Path) -> None:
    """``--config`` names a readable file; otherwise say what it names instead."""
    if path.is_file():
        return
    if path.is_dir():
        found = sorted(p.name for p in path.glob("*.y*ml") if p.is_file())[:5]
        hint = f" (it holds {', '.join(found)})" if found else ""
        raise ConfigError(f"--config {path}: is a directory; name a YAML settings file in it{hint}")
    raise ConfigError(f"--config {path}: {path_problem(path)}")


def path_problem(path: Path) -> str:
    """What is wrong with a path that is neither a file nor a directory, for a message."""
    try:
        path.stat()
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            return (
                "is a symbolic link loop (a link that leads back to itself: too many levels of symbolic "
                "links); point the link at a real file"
            )
        if exc.errno == errno.ENOENT and path.is_symlink():
            target = os.readlink(path).encode("utf-8", "backslashreplace").decode()
            return f"is a broken symbolic link (to {target}, which does not exist)"
        if exc.errno == errno.ENOENT:
            return "does not exist"
        return f"cannot be read: {exc.strerror}"
    return "is not a regular file or directory (a device, socket or pipe)"


def _check_yaml_mapping(path: Path) -> None:
    # pydantic-settings turns a top-level list or scalar into "cannot convert dictionary
    # update sequence element #0 to a sequence", which names neither file nor problem.
    import yaml

    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {_one_line(str(exc))}") from None
    if data is not None and not isinstance(data, dict):
        raise ConfigError(
            f"--config {path}: the top level must be a mapping of sections (model:, data:, ...), "
            f"got a {type(data).__name__}"
        )


def _check_env_typos(environ: Mapping[str, str]) -> None:
    """Reject ``JOB_OUTPUT_URI``-style names (one underscore where nesting needs two).

    pydantic-settings ignores them, so the run would silently use another value (e.g.
    write to ./out instead of the intended bucket). Only names that spell an existing
    ``section_key`` are errors: other JOB_* variables (Kubernetes' JOB_COMPLETION_INDEX,
    a CI system's JOB_NAME) are none of the job's business.
    """
    prefix = "JOB_"
    sections = [name for name, field in JobSettings.model_fields.items() if _is_section(field.annotation)]
    for name in environ:
        upper = name.upper()
        if not upper.startswith(prefix):
            continue
        if "__" in upper:
            # pydantic-settings ignores a nested name whose section does not exist
            # (JOB_OUTPUTS__URI): the run would quietly keep the default.
            section = upper[len(prefix) :].split("__", 1)[0].lower()
            if section not in sections:
                raise ConfigError(
                    f"environment {name}: no settings section {section!r}; the sections are "
                    f"{', '.join(sections)} (e.g. {prefix}OUTPUT__URI for output.uri)"
                )
            continue
        rest = upper[len(prefix) :].lower()
        for section, field in JobSettings.model_fields.items():
            annotation = field.annotation
            if not _is_section(annotation):
                continue
            assert annotation is not None
            if rest.startswith(section + "_") and rest[len(section) + 1 :] in annotation.model_fields:
                key = rest[len(section) + 1 :]
                raise ConfigError(
                    f"environment {name}: not a setting; nested keys need a double underscore: "
                    f"{prefix}{section.upper()}__{key.upper()} (setting {section}.{key})"
                )


def _is_section(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def describe_validation_error(exc: ValidationError) -> str:
    parts = []
    for error in exc.errors():
        key = ".".join(str(p) for p in error["loc"]) or "settings"
        if error["type"] == "extra_forbidden":
            parent = ".".join(str(p) for p in error["loc"][:-1])
            allowed = ", ".join(_allowed_keys(parent))
            parts.append(f"{key}: unknown setting (allowed under {parent or 'top level'}: {allowed})")
        else:
            msg = error["msg"].removeprefix("Value error, ")
            got = error.get("input")
            # A section-level check (work.index < work.count) gets the whole section, or
            # nothing at all when the values came from defaults ($JOB_COMPLETION_*):
            # the message itself names the values then.
            detail = "" if isinstance(got, dict) else f" (got {got!r})"
            parts.append(f"{key}: {msg}{detail}" if error["loc"] else f"{msg}{detail}")
    return "invalid settings: " + "; ".join(parts)


def _allowed_keys(dotted: str) -> list[str]:
    model: type[BaseModel] = JobSettings
    for name in filter(None, dotted.split(".")):
        field = model.model_fields.get(name)
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def _one_line(text: str) -> str:
    return " ".join(text.split())


# Keys whose values are never shown, by their words: hf_token, authToken, apiKey, accessKeyId...
_SECRET_WORDS = {
    "token", "secret", "password", "passwd", "passphrase", "credential", "credentials",
    "auth", "authorization", "bearer", "cookie", "apikey",
}  # fmt: skip
_SECRET_WORD_PAIRS = {("api", "key"), ("access", "key"), ("secret", "key"), ("private", "key")}


def _secret_key(key: str) -> bool:
    words = re.split(r"[^a-z0-9]+", re.sub(r"([a-z0-9])([A-Z])", r"\1_\2", key).lower())
    return bool(_SECRET_WORDS.intersection(words)) or any(
        pair in _SECRET_WORD_PAIRS for pair in itertools.pairwise(words)
    )


_URI_USERINFO = re.compile(r"(?P<scheme>[a-z][a-z0-9+.-]*://)[^/@\s]+@", re.I)
REDACTED = "***"


def redact(value: Any, key: str = "") -> Any:
    """Copy of a settings dump with anything secret-looking replaced."""
    if key and _secret_key(key) and value not in (None, "", {}, []):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return _URI_USERINFO.sub(rf"\g<scheme>{REDACTED}@", value)
    return value


def settings_dump(settings: JobSettings) -> dict[str, Any]:
    return redact(settings.model_dump(mode="json"))
