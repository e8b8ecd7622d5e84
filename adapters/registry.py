"""Pick an adapter set for a vLLM version from ``config/adapters.yaml``.

Like SQLAlchemy's dialects: behaviour is chosen once, at start-up, from the library
version, as typed facts (``VllmFacts``); every concern below is one typed method whose
code asks those facts, and nothing outside ``adapters/`` compares versions or names.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version
from pydantic import ValidationError

from adapters import engine, execution, hashing, kv_cache, requests, runners, scheduling
from adapters.facts import VllmFacts
from job.errors import ConfigError
from job.settings import config_dir


class UnsupportedVllmVersion(ConfigError):
    """No adapter set covers the installed vLLM."""


@dataclass(frozen=True)
class AdapterSet:
    name: str
    versions: SpecifierSet
    facts: VllmFacts

    def engine_config(
        self, engine_kwargs: dict[str, Any], capture: dict[str, Any], generating: bool = False
    ) -> Any:
        """The VllmConfig for these EngineArgs, with what capture needs pinned and ``capture`` (its
        mode and layers) in the compile-cache key; ``generating``: the run samples seeded turns."""
        return engine.build_engine_config(engine_kwargs, capture, generating, self.facts.model_runner_v1)

    def start_executor(self, vllm_config: Any) -> Any:
        return engine.start_executor(vllm_config)

    def set_up_kv_cache(self, executor: Any, vllm_config: Any) -> kv_cache.KvCacheSetup:
        """Profile memory, plan and allocate the KV cache (and warm up, where vLLM does it here)."""
        return kv_cache.set_up_kv_cache(self.facts, executor, vllm_config)

    def scheduler(self, vllm_config: Any, kv_cache_config: Any, block_size: int, hash_block_size: int) -> Any:
        return scheduling.build_scheduler(
            self.facts, vllm_config, kv_cache_config, block_size, hash_block_size
        )

    def block_hasher(self, vllm_config: Any, hash_block_size: int) -> Callable[[Any], list[Any]]:
        return hashing.build_block_hasher(self.facts, vllm_config, hash_block_size)

    def request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: Any,
        block_hasher: Callable[..., Any] | None,
    ) -> Any:
        return requests.build_request(self.facts, request_id, prompt_token_ids, sampling_params, block_hasher)

    def submit_step(self, executor: Any, scheduler: Any, scheduler_output: Any) -> execution.StepResult:
        """Queue one scheduled step on the executor; ``result()`` waits for its model output."""
        return execution.submit_step(executor, scheduler, scheduler_output)

    def step_token_order(self, model_runner: Any, scheduler_output: Any) -> list[tuple[str, int]]:
        """Inside a worker: (request id, tokens) in the order the step's tokens were laid out."""
        return runners.step_token_order(self.facts, model_runner, scheduler_output)

    def step_inputs(self, model_runner: Any) -> tuple[Any, Any]:
        """Inside a worker, after a forward: the step's input ids and positions (device tensors)."""
        return runners.step_inputs(self.facts, model_runner)

    def lowest_version(self) -> Version:
        bounds = [Version(s.version) for s in self.versions if s.operator in (">=", "==", "~=", ">")]
        return min(bounds) if bounds else Version("0")


def load_adapter_sets(path: Path | None = None) -> list[AdapterSet]:
    path = path or config_dir() / "adapters.yaml"
    try:
        raw = yaml.safe_load(path.read_text())["adapter_sets"]
    except (OSError, KeyError, TypeError, yaml.YAMLError) as exc:
        raise ConfigError(f"{path}: cannot read adapter sets ({exc})") from None
    sets = []
    for name, entry in raw.items():
        facts = dict(entry)
        try:
            versions = SpecifierSet(facts.pop("versions"))
        except (KeyError, InvalidSpecifier) as exc:
            raise ConfigError(f"{path}: adapter set {name!r}: missing or bad versions ({exc})") from None
        try:
            sets.append(AdapterSet(name, versions, VllmFacts(**facts)))
        except ValidationError as exc:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
            raise ConfigError(f"{path}: adapter set {name!r}: {problems}") from None
    return sets


def adapter_set_named(name: str, sets: list[AdapterSet] | None = None) -> AdapterSet:
    """The set called ``name`` (forced by a setting; a worker process finds the driver's choice
    this way)."""
    by_name = {s.name: s for s in (sets if sets is not None else load_adapter_sets())}
    if name not in by_name:
        raise ConfigError(
            f"backend.vllm.adapter_set: unknown adapter set {name!r}; choose one of {sorted(by_name)}"
        )
    return by_name[name]


def parse_vllm_version(raw: str) -> Version:
    """vLLM's version with any local label (``+cpu``, ``+cu128``) dropped."""
    try:
        return Version(Version(raw).public)
    except InvalidVersion:
        raise UnsupportedVllmVersion(f"cannot parse the installed vLLM version {raw!r}") from None


def select_adapter_set(
    vllm_version: str,
    forced: str | None = None,
    allow_nearest: bool = False,
    sets: list[AdapterSet] | None = None,
) -> AdapterSet:
    sets = sets if sets is not None else load_adapter_sets()
    if forced is not None:
        return adapter_set_named(forced, sets)
    version = parse_vllm_version(vllm_version)
    for adapter_set in sets:
        if adapter_set.versions.contains(version, prereleases=True):
            return adapter_set
    supported = "; ".join(f"{s.name}: {s.versions}" for s in sets)
    if allow_nearest:
        return min(sets, key=lambda s: _distance(s.lowest_version(), version))
    raise UnsupportedVllmVersion(
        f"vLLM {vllm_version} is not supported (supported: {supported}). Install a supported vLLM, "
        "add an adapter set to config/adapters.yaml, or set backend.vllm.allow_nearest_adapter: true "
        "to try the nearest set at your own risk"
    )


def _distance(a: Version, b: Version) -> tuple[int, int, int]:
    def parts(v: Version) -> tuple[int, int, int]:
        r = (*v.release, 0, 0, 0)
        return r[0], r[1], r[2]

    pa, pb = parts(a), parts(b)
    return abs(pa[0] - pb[0]), abs(pa[1] - pb[1]), abs(pa[2] - pb[2])
