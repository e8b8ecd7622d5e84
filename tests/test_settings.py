"""Settings: source precedence, work-index defaults, config errors, ``python -m job config``.

Everything runs ``python -m job`` in a subprocess: precedence depends on the real
argv / environment / file handling, which an in-process call would bypass.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml

from job.settings import config_dir


def effective(run_job: Callable[..., Any], *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """The settings ``python -m job config`` prints, parsed."""
    result = run_job("config", *args, env=env)
    assert result.rc == 0, result.describe()
    return yaml.safe_load(result.stdout)


def assert_config_error(result: Any, *needles: str) -> str:
    """Exit 2 and exactly one readable line on stderr that mentions every needle."""
    assert result.rc == 2, result.describe()
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, f"expected one line on stderr:\n{result.stderr}"
    line = lines[0]
    assert line.startswith("error: "), line
    assert "Traceback" not in result.stderr
    for needle in needles:
        assert needle in line, f"{needle!r} not in {line!r}"
    return line


@pytest.fixture
def yaml_config(tmp_path: Path) -> Path:
    path = tmp_path / "job.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "output": {"uri": "/from/yaml", "shard_bytes": "1MiB"},
                "data": {"max_length": 100},
                "backend": {"vllm": {"max_num_seqs": 7, "max_num_batched_tokens": 4096}},
            }
        )
    )
    return path


# --- precedence -------------------------------------------------------------------------


def test_defaults_come_from_default_yaml(run_job: Callable[..., Any]) -> None:
    defaults = yaml.safe_load((config_dir() / "default.yaml").read_text())
    got = effective(run_job)
    assert got["output"]["uri"] == defaults["output"]["uri"] == "./out"
    assert got["output"]["shard_bytes"] == 2 * 1024**3  # "2GiB" in the file, bytes once parsed
    assert got["model"]["path"] == defaults["model"]["path"]
    assert got["data"]["max_length"] == defaults["data"]["max_length"]
    assert got["work"] == {"index": 0, "count": 1}


@pytest.mark.parametrize(
    ("use_yaml", "use_env", "use_cli", "expected"),
    [
        (False, False, False, "./out"),
        (True, False, False, "/from/yaml"),
        (True, True, False, "/from/env"),
        (True, True, True, "/from/cli"),
        (False, True, True, "/from/cli"),
        (False, True, False, "/from/env"),
    ],
)
def test_precedence_cli_over_env_over_yaml_over_default(
    run_job: Callable[..., Any],
    yaml_config: Path,
    use_yaml: bool,
    use_env: bool,
    use_cli: bool,
    expected: str,
) -> None:
    args = [f"--config={yaml_config}"] if use_yaml else []
    if use_cli:
        args.append("--output.uri=/from/cli")
    env = {"JOB_OUTPUT__URI": "/from/env"} if use_env else None
    assert effective(run_job, *args, env=env)["output"]["uri"] == expected


def test_sources_merge_per_key_not_per_section(run_job: Callable[..., Any], yaml_config: Path) -> None:
    # A stronger source overriding one key of a section must keep the weaker sources'
    # other keys of that section (and the defaults of keys nobody set).
    got = effective(
        run_job,
        f"--config={yaml_config}",
        "--backend.vllm.max_num_seqs=9",
        env={"JOB_BACKEND__VLLM__MAX_NUM_BATCHED_TOKENS": "2048", "JOB_DATA__TOO_LONG": "skip"},
    )
    vllm = got["backend"]["vllm"]
    assert vllm["max_num_seqs"] == 9  # CLI over YAML's 7
    assert vllm["max_num_batched_tokens"] == 2048  # env over YAML's 4096
    assert vllm["gpu_memory_utilization"] == 0.85  # default.yaml
    assert (got["output"]["uri"], got["output"]["shard_bytes"]) == ("/from/yaml", 1024**2)  # YAML
    assert got["output"]["hidden_dtype"] == "model"  # default.yaml
    assert got["data"]["max_length"] == 100  # YAML
    assert got["data"]["too_long"] == "skip"  # env
    assert got["data"]["format"] == "auto"  # default


def test_layer_ids_from_env_and_cli(run_job: Callable[..., Any]) -> None:
    assert effective(run_job, env={"JOB_LAYERS__IDS": "[0, 3]"})["layers"]["ids"] == [0, 3]
    assert effective(run_job, "--layers.ids=[1,8]", env={"JOB_LAYERS__IDS": "[0, 3]"})["layers"]["ids"] == [
        1,
        8,
    ]


def test_work_defaults_from_job_completion_env(run_job: Callable[..., Any]) -> None:
    completion = {"JOB_COMPLETION_INDEX": "2", "JOB_COMPLETION_COUNT": "4"}
    assert effective(run_job, env=completion)["work"] == {"index": 2, "count": 4}
    # They are only defaults: any real source of work.index wins.
    assert effective(run_job, env={**completion, "JOB_WORK__INDEX": "1"})["work"] == {"index": 1, "count": 4}
    assert effective(run_job, "--work.index=3", env=completion)["work"] == {"index": 3, "count": 4}
    assert effective(run_job, "--work.count=8", env=completion)["work"] == {"index": 2, "count": 8}


def test_work_count_from_yaml_index_from_kubernetes(run_job: Callable[..., Any], tmp_path: Path) -> None:
    # The usual Indexed Job setup: the count in the config file, the index from the pod.
    path = tmp_path / "job.yaml"
    path.write_text("work:\n  count: 4\n")
    got = effective(run_job, f"--config={path}", env={"JOB_COMPLETION_INDEX": "3"})
    assert got["work"] == {"index": 3, "count": 4}


def test_config_output_round_trips_as_a_config_file(run_job: Callable[..., Any], tmp_path: Path) -> None:
    first = run_job("config", "--output.uri=/x/y", "--layers.ids=[0,4,8]", "--data.too_long=skip")
    assert first.rc == 0, first.describe()
    saved = tmp_path / "effective.yaml"
    saved.write_text(first.stdout)
    second = run_job("config", f"--config={saved}")
    assert second.rc == 0, second.describe()
    assert second.stdout == first.stdout


# --- secrets in `config` ----------------------------------------------------------------


def test_config_redacts_secrets(run_job: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "secret.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "backend": {
                    "vllm": {
                        "engine_args": {
                            "hf_token": "hf_yaml_Secret1",
                            "seed": 3,
                            "skip_tokenizer_init": False,
                            "hf_overrides": {"authToken": "camel-Secret2", "apiKey": "camel-Secret3"},
                        }
                    }
                }
            }
        )
    )
    result = run_job(
        "config",
        f"--config={path}",
        "--output.uri=s3://AKIAUSER:cli-Pass-Word9@bucket/run1",
        env={"JOB_DATA__PATH": "s3://envuser:env-Pass-Word8@bucket/data/"},
    )
    assert result.rc == 0, result.describe()
    for secret in (
        "hf_yaml_Secret1",
        "camel-Secret2",
        "camel-Secret3",
        "cli-Pass-Word9",
        "AKIAUSER",
        "env-Pass-Word8",
        "envuser",
    ):
        assert secret not in result.stdout
        assert secret not in result.stderr
    got = yaml.safe_load(result.stdout)
    assert got["backend"]["vllm"]["engine_args"] == {
        "hf_token": "***",
        "seed": 3,
        "skip_tokenizer_init": False,  # "tokenizer" is not "token"
        "hf_overrides": {"authToken": "***", "apiKey": "***"},
    }
    assert got["output"]["uri"] == "s3://***@bucket/run1"
    assert got["data"]["path"] == "s3://***@bucket/data/"


def test_error_lines_do_not_echo_secrets(run_job: Callable[..., Any]) -> None:
    # A value in the wrong setting is echoed back in the error line; stderr does not go
    # through the log scrubber, so the CLI must scrub it itself.
    result = run_job(
        "config",
        "--output.shard_bytes=s3://AKIAUSER:pass-Word7@bucket/some-secret-value-123",
        env={"AWS_SECRET_ACCESS_KEY": "some-secret-value-123"},
    )
    line = assert_config_error(result, "output.shard_bytes")
    for secret in ("some-secret-value-123", "pass-Word7", "AKIAUSER"):
        assert secret not in result.stderr + result.stdout
    assert "s3://***@bucket/***" in line


# --- errors: exit 2, one line naming the key --------------------------------------------


def test_unknown_key_in_yaml(run_job: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("output:\n  uri: /x\n  shard_size: 1GiB\n")
    line = assert_config_error(run_job("config", f"--config={path}"), "output.shard_size", "unknown")
    assert "shard_bytes" in line  # says what is allowed instead
    assert_config_error(run_job("run", f"--config={tmp_path / 'missing.yaml'}"), "--config", "missing.yaml")


def test_config_naming_a_directory_or_a_link_loop(run_job: Callable[..., Any], tmp_path: Path) -> None:
    (tmp_path / "run.yaml").write_text("data:\n  max_length: 100\n")
    line = assert_config_error(run_job("run", f"--config={tmp_path}"), f"--config {tmp_path}: is a directory")
    assert "name a YAML settings file in it (it holds run.yaml)" in line
    loop = tmp_path / "loop.yaml"
    loop.symlink_to(loop)
    assert_config_error(run_job("config", f"--config={loop}"), f"--config {loop}: is a symbolic link loop")


@pytest.mark.parametrize(
    ("text", "needle"),
    [("output: [\n", "line 2"), ("- 1\n- 2\n", "must be a mapping"), ("just a string\n", "got a str")],
)
def test_malformed_yaml(run_job: Callable[..., Any], tmp_path: Path, text: str, needle: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    assert_config_error(run_job("config", f"--config={path}"), "--config", "broken.yaml", needle)


def test_empty_yaml_is_no_settings(run_job: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text("# nothing here\n")
    assert effective(run_job, f"--config={path}") == effective(run_job)


def test_unknown_top_level_key_in_yaml(run_job: Callable[..., Any], tmp_path: Path) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text("outputs:\n  uri: /x\n")
    assert_config_error(run_job("run", f"--config={path}"), "outputs", "unknown")


def test_unknown_key_in_env(run_job: Callable[..., Any]) -> None:
    assert_config_error(run_job("config", env={"JOB_OUTPUT__BOGUS": "1"}), "output.bogus", "unknown")


def test_env_key_with_single_underscore_is_an_error(run_job: Callable[..., Any]) -> None:
    # JOB_OUTPUT_URI (one underscore) is a typo of JOB_OUTPUT__URI; silently writing to
    # ./out instead of the intended bucket would be the worst outcome.
    assert_config_error(run_job("config", env={"JOB_OUTPUT_URI": "/x"}), "JOB_OUTPUT_URI", "JOB_OUTPUT__URI")
    # Unrelated JOB_* variables (CI systems set JOB_NAME, Kubernetes JOB_COMPLETION_INDEX)
    # are not settings and must not break the job.
    assert effective(run_job, env={"JOB_NAME": "nightly", "JOB_WORK_DIR": "/tmp"})["output"]["uri"] == "./out"


def test_unknown_key_on_cli(run_job: Callable[..., Any]) -> None:
    assert_config_error(run_job("run", "--output.bogus=1"), "--output.bogus", "unknown")
    assert_config_error(run_job("config", "--outputs.uri=/x"), "--outputs.uri", "unknown")


@pytest.mark.parametrize("size", ["lots", "12QB", "-1MiB"])
def test_bad_size_string(run_job: Callable[..., Any], size: str) -> None:
    assert_config_error(run_job("run", f"--output.shard_bytes={size}"), "output.shard_bytes")


def test_size_strings_parse(run_job: Callable[..., Any]) -> None:
    assert effective(run_job, "--output.shard_bytes=256KiB")["output"]["shard_bytes"] == 256 * 1024
    assert effective(run_job, env={"JOB_OUTPUT__SHARD_BYTES": "3GB"})["output"]["shard_bytes"] == 3 * 10**9
    assert_config_error(run_job("config", "--output.shard_bytes=100"), "output.shard_bytes", "4KiB")


def test_layer_id_outside_model_range(
    run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path
) -> None:
    # builtin:tiny-llama has N=8 decoder layers: valid ids are 0..8 inclusive, so 9 (N+1)
    # and -1 are out, while 0 and 8 are fine and not reported.
    result = run_job("run", "--layers.ids=[0,-1,8,9]", f"--output.uri={tmp_path / 'out'}")
    assert_config_error(result, "layers.ids", "[-1, 9]", "[0, 8]")
    assert not (tmp_path / "out").exists()  # nothing written for a run that cannot start


def test_layer_ids_must_be_unique_and_non_empty(run_job: Callable[..., Any]) -> None:
    assert_config_error(run_job("config", "--layers.ids=[2,2]"), "layers.ids", "unique")
    assert_config_error(run_job("config", "--layers.ids=[]"), "layers.ids")


def test_missing_model_path(run_job: Callable[..., Any], tmp_path: Path) -> None:
    missing = tmp_path / "no-such-model"
    result = run_job("run", f"--model.path={missing}", f"--output.uri={tmp_path / 'out'}")
    assert_config_error(result, "model.path", str(missing))


def test_missing_data_path(run_job: Callable[..., Any], tiny_llama_dir: Path, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-data.jsonl"
    result = run_job("run", f"--data.path={missing}", f"--output.uri={tmp_path / 'out'}")
    assert_config_error(result, "data.path", str(missing))


def test_work_index_not_below_count(run_job: Callable[..., Any]) -> None:
    assert_config_error(run_job("run", "--work.index=3", "--work.count=3"), "work.index", "work.count")
    line = assert_config_error(
        run_job("run", env={"JOB_COMPLETION_INDEX": "4", "JOB_COMPLETION_COUNT": "4"}),
        "work.index 4 must be below work.count 4",
    )
    assert "got {}" not in line
    assert_config_error(run_job("run", env={"JOB_COMPLETION_INDEX": "two"}), "JOB_COMPLETION_INDEX")


# --- command line shapes ----------------------------------------------------------------


def test_first_cli_value_with_a_space_is_not_dropped(run_job: Callable[..., Any]) -> None:
    # argparse classifies "--key=a b" as a positional; right after the command it used to
    # become the (ignored) inspect PATH, and the setting silently kept its default.
    got = effective(run_job, "--output.uri=/mnt/my data/out", '--backend.vllm.engine_args={"seed": 1}')
    assert got["output"]["uri"] == "/mnt/my data/out"
    assert got["backend"]["vllm"]["engine_args"] == {"seed": 1}
    got = effective(run_job, '--backend.vllm.engine_args={"seed": 2, "dir": "/a b"}', "--output.uri=/o")
    assert got["backend"]["vllm"]["engine_args"] == {"seed": 2, "dir": "/a b"}
    assert got["output"]["uri"] == "/o"


def test_space_separated_values_and_last_flag_wins(run_job: Callable[..., Any]) -> None:
    got = effective(run_job, "--output.uri", "/spaced", "--data.max_length", "77")
    assert got["output"]["uri"] == "/spaced" and got["data"]["max_length"] == 77
    assert effective(run_job, "--output.uri=/first", "--output.uri=/second")["output"]["uri"] == "/second"


def test_stray_positional_argument_is_an_error(run_job: Callable[..., Any]) -> None:
    assert_config_error(run_job("run", "/some/data.jsonl"), "unexpected argument", "/some/data.jsonl")
