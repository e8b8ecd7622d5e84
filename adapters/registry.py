"""Pick an adapter set for a vLLM version from ``config/adapters.yaml``.

Like SQLAlchemy's dialects: behaviour is chosen once, at start-up, from the
server (here: library) version, and the rest of the code calls the chosen
pieces without ever comparing versions itself.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from job.errors import ConfigError
from job.settings import config_dir

CONCERNS = ("request", "block_hasher", "scheduler", "kv_cache", "execution", "capture")


class UnsupportedVllmVersion(ConfigError):
    """No adapter set covers the installed vLLM."""


@dataclass(frozen=True)
class AdapterSet:
    name: str
    versions: SpecifierSet
    targets: dict[str, str]  # concern -> "module:attribute"
    _loaded: dict[str, Any] = field(default_factory=dict, compare=False, repr=False)

    def get(self, concern: str) -> Any:
        """The code for ``concern``, imported on first use."""
        if concern not in self._loaded:
            module_name, _, attr = self.targets[concern].partition(":")
            self._loaded[concern] = getattr(importlib.import_module(module_name), attr)
        return self._loaded[concern]

    def __getattr__(self, concern: str) -> Any:
        if concern in CONCERNS:
            return self.get(concern)
        raise AttributeError(concern)

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
        missing = [c for c in CONCERNS if c not in entry]
        unknown = [k for k in entry if k not in (*CONCERNS, "versions")]
        if missing or unknown:
            raise ConfigError(f"{path}: adapter set {name!r}: missing {missing}, unknown {unknown}")
        try:
            versions = SpecifierSet(entry["versions"])
        except InvalidSpecifier as exc:
            raise ConfigError(
                f"{path}: adapter set {name!r}: bad versions {entry['versions']!r}: {exc}"
            ) from None
        sets.append(AdapterSet(name, versions, {c: entry[c] for c in CONCERNS}))
    return sets


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
    by_name = {s.name: s for s in sets}
    if forced is not None:
        if forced not in by_name:
            raise ConfigError(
                f"backend.vllm.adapter_set: unknown adapter set {forced!r}; choose one of {sorted(by_name)}"
            )
        return by_name[forced]
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
