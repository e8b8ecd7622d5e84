"""Adapter-set selection from config/adapters.yaml (no vLLM needed)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from adapters import UnsupportedVllmVersion, VllmFacts, load_adapter_sets, select_adapter_set
from job.errors import EXIT_CONFIG, ConfigError
from job.settings import config_dir


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.16.0", "vllm-0.16"),
        ("0.16.0+cpu", "vllm-0.16"),
        ("0.16.1", "vllm-0.16"),
        ("0.26.0", "vllm-0.26"),
        ("0.26.0+cu130", "vllm-0.26"),
        ("0.33.0", "vllm-0.33"),
        ("0.34.0", "vllm-0.34"),
        ("0.34.1+cu130", "vllm-0.34"),
    ],
)
def test_supported_versions_pick_their_set(version: str, expected: str) -> None:
    assert select_adapter_set(version).name == expected


@pytest.mark.parametrize("version", ["0.9.0", "0.99.0", "0.20.0"])
def test_unsupported_versions_stop_with_the_supported_ranges(version: str) -> None:
    with pytest.raises(UnsupportedVllmVersion) as info:
        select_adapter_set(version)
    message = str(info.value)
    assert f"vLLM {version} is not supported" in message
    for name in ("vllm-0.16: <0.17,>=0.16.0", "vllm-0.26", "vllm-0.33", "vllm-0.34"):
        assert name in message
    assert "allow_nearest_adapter" in message
    assert info.value.exit_code == EXIT_CONFIG


def test_nearest_set_on_request() -> None:
    assert select_adapter_set("0.99.0", allow_nearest=True).name == "vllm-0.34"
    assert select_adapter_set("0.33.5", allow_nearest=True).name == "vllm-0.33"
    assert select_adapter_set("0.9.0", allow_nearest=True).name == "vllm-0.16"
    assert select_adapter_set("0.27.1", allow_nearest=True).name == "vllm-0.26"


def test_a_setting_forces_a_set() -> None:
    assert select_adapter_set("0.99.0", forced="vllm-0.26").name == "vllm-0.26"
    with pytest.raises(ConfigError, match="unknown adapter set 'nope'"):
        select_adapter_set("0.16.0", forced="nope")


def test_every_set_states_every_fact() -> None:
    for adapter_set in load_adapter_sets():
        assert isinstance(adapter_set.facts, VllmFacts)
        assert set(adapter_set.facts.model_dump()) == set(VllmFacts.model_fields)


def test_a_new_version_with_unchanged_internals_is_one_entry(tmp_path: Path) -> None:
    """vLLM 0.27 behaving like 0.26: one YAML entry, no code."""
    raw = yaml.safe_load((config_dir() / "adapters.yaml").read_text())
    raw["adapter_sets"]["vllm-0.27"] = {**raw["adapter_sets"]["vllm-0.26"], "versions": ">=0.27.0,<0.28"}
    path = tmp_path / "adapters.yaml"
    path.write_text(yaml.safe_dump(raw))
    new = select_adapter_set("0.27.1", sets=load_adapter_sets(path))
    assert new.name == "vllm-0.27"
    assert new.facts == select_adapter_set("0.26.0").facts


@pytest.mark.parametrize(
    ("entry", "problem"),
    [
        ("    request_eos_token_id: true\n", "versions"),
        ("    versions: '>=1'\n    request_eos_token_id: true\n", "kv_cache_setup: Field required"),
        ("    versions: '>=1'\n    kv_cache_setup: guess\n", "kv_cache_setup: Input should be"),
        ("    versions: '>=1'\n    eos: true\n", "eos: Extra inputs are not permitted"),
    ],
)
def test_a_broken_adapters_file_is_a_config_error(tmp_path: Path, entry: str, problem: str) -> None:
    broken = tmp_path / "adapters.yaml"
    broken.write_text("adapter_sets:\n  x:\n" + entry)
    with pytest.raises(ConfigError, match=f"adapter set 'x'.*{problem}"):
        load_adapter_sets(broken)
