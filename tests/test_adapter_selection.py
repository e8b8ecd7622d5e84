"""Adapter-set selection from config/adapters.yaml (no vLLM needed)."""

from __future__ import annotations

import pytest

from adapters import UnsupportedVllmVersion, load_adapter_sets, select_adapter_set
from adapters.registry import CONCERNS
from job.errors import EXIT_CONFIG, ConfigError


@pytest.mark.parametrize(
    ("version", "expected"),
    [
        ("0.16.0", "vllm-0.16"),
        ("0.16.0+cpu", "vllm-0.16"),
        ("0.16.1", "vllm-0.16"),
        ("0.26.0", "vllm-0.26"),
        ("0.26.0+cu130", "vllm-0.26"),
        ("0.33.0", "vllm-0.33"),
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
    for name in ("vllm-0.16: <0.17,>=0.16.0", "vllm-0.26", "vllm-0.33"):
        assert name in message
    assert "allow_nearest_adapter" in message
    assert info.value.exit_code == EXIT_CONFIG


def test_nearest_set_on_request() -> None:
    assert select_adapter_set("0.99.0", allow_nearest=True).name == "vllm-0.33"
    assert select_adapter_set("0.9.0", allow_nearest=True).name == "vllm-0.16"
    assert select_adapter_set("0.27.1", allow_nearest=True).name == "vllm-0.26"


def test_a_setting_forces_a_set() -> None:
    assert select_adapter_set("0.99.0", forced="vllm-0.26").name == "vllm-0.26"
    with pytest.raises(ConfigError, match="unknown adapter set 'nope'"):
        select_adapter_set("0.16.0", forced="nope")


def test_every_concern_of_every_set_resolves_to_code() -> None:
    # Importing the adapter modules needs no vLLM: they import it lazily.
    for adapter_set in load_adapter_sets():
        for concern in CONCERNS:
            assert callable(adapter_set.get(concern)), (adapter_set.name, concern)


def test_a_broken_adapters_file_is_a_config_error(tmp_path) -> None:
    broken = tmp_path / "adapters.yaml"
    broken.write_text("adapter_sets:\n  x:\n    versions: '>=1'\n    request: a:b\n")
    with pytest.raises(ConfigError, match="missing"):
        load_adapter_sets(broken)
