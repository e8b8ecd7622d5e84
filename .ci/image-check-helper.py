"""What .ci/image-check.sh needs a Python for, run inside the image under test (its Python has
PyYAML and boto3): reading the Kubernetes Job, the S3 side of the checks, and the package list.

  job-spec JOB_YAML DIR          the Job's ConfigMap (DIR/config.yaml), container args (DIR/args, one a
                                 line) and literal env values (DIR/env, NAME=VALUE lines for --env-file)
  create-bucket BUCKET
  supersede BUCKET KEY           wait for the manifest KEY, then rewrite it as another pod would
  download BUCKET PREFIX DIR     every object under PREFIX/ into DIR
  check-index DIR SAMPLES        DIR's manifest is complete and lists SAMPLES distinct samples
  packages                       name==version of every installed distribution (lower case), sorted

S3 is reached through boto3's standard environment (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...).
"""

from __future__ import annotations

import importlib.metadata
import json
import sys
import time
from pathlib import Path
from typing import Any

import yaml

SUPERSEDE_TIMEOUT_S = 300


def s3_client() -> Any:
    import boto3

    return boto3.client("s3")


def job_spec(job_yaml: str, out: str) -> None:
    docs = {d["kind"]: d for d in yaml.safe_load_all(Path(job_yaml).read_text()) if d}
    (container,) = docs["Job"]["spec"]["template"]["spec"]["containers"]
    target = Path(out)
    (target / "config.yaml").write_text(docs["ConfigMap"]["data"]["config.yaml"])
    (target / "args").write_text("".join(f"{arg}\n" for arg in container["args"]))
    literal = [f"{e['name']}={e['value']}\n" for e in container["env"] if "value" in e]
    (target / "env").write_text("".join(literal))


def supersede(bucket: str, key: str) -> None:
    """What a second pod of the same index does to the first: its own write of the manifest."""
    s3 = s3_client()
    deadline = time.monotonic() + SUPERSEDE_TIMEOUT_S
    while True:
        try:
            manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
            break
        except s3.exceptions.NoSuchKey:
            if time.monotonic() > deadline:
                raise SystemExit(f"no s3://{bucket}/{key} after {SUPERSEDE_TIMEOUT_S} s") from None
            time.sleep(0.1)
    manifest["run_ids"].append("another-pod")
    s3.put_object(Bucket=bucket, Key=key, Body=json.dumps(manifest).encode())
    print(f"rewrote s3://{bucket}/{key} ({len(manifest['shards'])} shards listed)")


def download(bucket: str, prefix: str, out: str) -> None:
    s3 = s3_client()
    count = 0
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=f"{prefix}/"):
        for obj in page.get("Contents", []):
            path = Path(out) / obj["Key"][len(prefix) + 1 :]
            path.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(path))
            count += 1
    print(f"downloaded {count} objects of s3://{bucket}/{prefix}/")


def check_index(index_dir: str, samples: str) -> None:
    manifest = json.loads((Path(index_dir) / "manifest.json").read_text())
    ids = [sample_id for shard in manifest["shards"] for sample_id in shard["sample_ids"]]
    problems = []
    if not manifest["complete"]:
        problems.append("the manifest is not complete")
    if len(ids) != len(set(ids)):
        problems.append(f"{len(ids) - len(set(ids))} samples are listed twice")
    if len(set(ids)) != int(samples):
        problems.append(f"{len(set(ids))} samples listed, {samples} expected")
    if problems:
        raise SystemExit(f"{index_dir}: " + "; ".join(problems))
    print(f"{index_dir}: complete, {len(ids)} samples, each once, in {len(manifest['shards'])} shards")


def packages() -> None:
    """Where a name is installed twice (the stand-in's Ubuntu pip below PyPI's), the one first on
    sys.path: the one Python imports."""
    found: dict[str, str] = {}
    for dist in importlib.metadata.distributions():
        found.setdefault(dist.metadata["Name"].lower(), dist.version)
    print("\n".join(f"{name}=={version}" for name, version in sorted(found.items())))


COMMANDS = {
    "job-spec": job_spec,
    "create-bucket": lambda bucket: s3_client().create_bucket(Bucket=bucket),
    "supersede": supersede,
    "download": download,
    "check-index": check_index,
    "packages": packages,
}

if __name__ == "__main__":
    COMMANDS[sys.argv[1]](*sys.argv[2:])
