"""``python -m job export --format speculators s3://...``: an output on S3 exported
directly equals the export of the same output downloaded first, and a damaged
or missing shard on S3 stops the export with a message naming it. A reference export of it
(``--hidden-states reference``) gives speculators' ``ArrowDataset`` the full export's items,
its hidden states read from S3 by the ``eagle3-extract`` backend with ranged GETs."""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.register_assert_rewrite("s3_fixtures")

from conftest import mount_namespace  # noqa: E402
from s3_fixtures import job_args, job_env, run_job  # noqa: E402

from job.cli import main  # noqa: E402
from job.errors import EXIT_CONFIG  # noqa: E402
from job.export import METADATA  # noqa: E402
from job.shards import read_manifest  # noqa: E402

pytest_plugins = ["s3_fixtures"]
pytestmark = pytest.mark.s3

PREFIX = "export-src"


def export(src: str | Path, dest: Path) -> int:
    return main(["export", "--format", "speculators", str(src), str(dest)])


@pytest.fixture(scope="module")
def on_s3(
    s3_endpoint: str, s3: Any, bucket: str, job_cache: str, tmp_path_factory: pytest.TempPathFactory
) -> Path:
    """One finished run on S3, and a local copy of every object it wrote."""
    args = job_args(output__uri=f"s3://{bucket}/{PREFIX}", data__path=f"s3://{bucket}/data/")
    job = run_job(args, job_env(s3_endpoint, job_cache))
    assert job.proc.returncode == 0, job.tail()
    local = tmp_path_factory.mktemp("downloaded") / PREFIX
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=PREFIX + "/"):
        for obj in page["Contents"]:
            target = local / obj["Key"][len(PREFIX) + 1 :]
            target.parent.mkdir(parents=True, exist_ok=True)
            s3.download_file(bucket, obj["Key"], str(target))
    return local


@pytest.fixture
def s3_env(monkeypatch: pytest.MonkeyPatch, s3_endpoint: str, job_cache: str) -> None:
    for key, value in job_env(s3_endpoint, job_cache).items():
        if key.startswith("AWS_"):
            monkeypatch.setenv(key, value)


def test_export_from_s3_equals_the_export_of_a_local_copy(
    on_s3: Path, s3_env: None, bucket: str, tmp_path: Path
) -> None:
    from datasets import load_from_disk

    assert export(f"s3://{bucket}/{PREFIX}", tmp_path / "from-s3") == 0
    assert export(on_s3, tmp_path / "from-local") == 0
    remote, local = tmp_path / "from-s3", tmp_path / "from-local"
    manifest = read_manifest(on_s3 / "index-00000")
    assert manifest is not None and len(manifest.shards) > 1
    a, b = load_from_disk(str(remote)), load_from_disk(str(local))
    assert len(a) == len(b) == manifest.counts.written
    assert a["sample_id"] == b["sample_id"]
    files = sorted(p.name for p in (local / "hidden_states").iterdir())
    assert files == sorted(p.name for p in (remote / "hidden_states").iterdir())
    for name in files:
        assert (remote / "hidden_states" / name).read_bytes() == (local / "hidden_states" / name).read_bytes()
    meta_remote, meta_local = (json.loads((d / METADATA).read_text()) for d in (remote, local))
    assert meta_remote["source"]["location"] == f"s3://{bucket}/{PREFIX}"
    assert meta_remote["source"]["indexes"] == meta_local["source"]["indexes"]
    assert meta_remote["layers"] == meta_local["layers"] and meta_remote["rows"] == meta_local["rows"]


def test_reference_export_trains_from_the_shards_on_s3(
    on_s3: Path, s3_env: None, bucket: str, tmp_path: Path
) -> None:
    import torch

    data_mod = pytest.importorskip("speculators.train.data", reason="pip install --no-deps speculators")
    transfer_mod = pytest.importorskip("hs_connectors.transfer")
    importlib.import_module("job.speculators")  # registers the eagle3-extract backend

    full, ref = tmp_path / "full", tmp_path / "reference"
    assert main(["export", "--format", "speculators", str(on_s3), str(full)]) == 0
    src = f"s3://{bucket}/{PREFIX}"
    assert main(["export", "--format", "speculators", "--hidden-states", "reference", src, str(ref)]) == 0
    assert not (ref / "hidden_states").exists()
    assert json.loads((ref / METADATA).read_text())["source"]["location"] == src

    backend = transfer_mod.HiddenStatesBackend.registry["eagle3-extract"]
    parser = argparse.ArgumentParser()
    backend.add_train_args(parser)
    transfer = backend.from_train_args(parser.parse_args([]), str(ref))  # the shards where SRC was
    ours = data_mod.ArrowDataset(max_len=4096, datapath=str(ref), transfer=transfer, on_missing="raise")
    theirs = data_mod.ArrowDataset(max_len=4096, datapath=str(full), on_missing="raise")
    assert len(ours) == len(theirs) == read_manifest(on_s3 / "index-00000").counts.written  # type: ignore[union-attr]
    for i in range(len(theirs)):
        a, b = ours[i], theirs[i]
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), (i, key)


def test_compare_reads_an_output_on_s3(
    on_s3: Path, s3_env: None, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """compare takes s3:// outputs as inspect and export do (it once turned the URI into the path
    s3:/bucket/...), and a wrong path is named as the argument it came from."""
    assert main(["compare", f"s3://{bucket}/{PREFIX}", "--reference", str(on_s3)]) == 0
    written = read_manifest(on_s3 / "index-00000")
    assert written is not None
    out = capsys.readouterr().out
    assert f"OK: {written.counts.written} samples compared; worst relative error 0.000e+00" in out
    assert "mismatched 0, missing 0, extra 0" in out
    missing = tmp_path / "no-such-output"
    assert main(["compare", f"s3://{bucket}/{PREFIX}", "--reference", str(missing)]) == EXIT_CONFIG
    assert capsys.readouterr().err.strip() == f"error: compare --reference {missing}: does not exist"


def test_a_damaged_or_missing_shard_on_s3_stops_the_export(
    on_s3: Path, s3_env: None, s3: Any, bucket: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    prefix = "export-damaged"
    for path in on_s3.rglob("*"):
        if path.is_file():
            s3.upload_file(str(path), bucket, f"{prefix}/{path.relative_to(on_s3)}")
    entry = read_manifest(on_s3 / "index-00000").shards[0]  # type: ignore[union-attr]
    key = f"{prefix}/index-00000/{entry.name}"
    data = bytearray((on_s3 / "index-00000" / entry.name).read_bytes())
    data[-1] ^= 1
    s3.put_object(Bucket=bucket, Key=key, Body=bytes(data))
    assert export(f"s3://{bucket}/{prefix}", tmp_path / "damaged") == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"s3://{bucket}/{key}: checksum" in err and "on_damaged_shard=reextract" in err
    assert not (tmp_path / "damaged").exists()  # the unfinished export was removed

    s3.delete_object(Bucket=bucket, Key=key)
    assert export(f"s3://{bucket}/{prefix}", tmp_path / "missing") == EXIT_CONFIG
    err = capsys.readouterr().err
    assert f"s3://{bucket}/{key}: listed in index-00000/manifest.json but missing" in err
    assert "on_damaged_shard=reextract" in err and "export again" in err
    assert not (tmp_path / "missing").exists()  # found before anything was written

    assert export(f"s3://{bucket}/nothing-here", tmp_path / "empty") == EXIT_CONFIG
    assert "no objects there" in capsys.readouterr().err


# Inside a mount namespace: TMPDIR a tmpfs smaller than a shard, an export from S3, then the tmpfs
# grown (room made) and the same export again. Each step's stdout, stderr and exit code are files.
SMALL_TMPDIR_EXPORT = """
mount -t tmpfs -o size="$TMP_BYTES" tmpfs "$TMPDIR" || exit 99
step() {
    name=$1; shift
    "$PYTHON" -m job "$@" >"$LOGS/$name.out" 2>"$LOGS/$name.err"; echo $? >"$LOGS/$name.rc"
}
step full export --format speculators "$SRC" "$DEST"
ls -A "$TMPDIR" >"$LOGS/tmp-after-full.ls"
test -e "$DEST"; echo $? >"$LOGS/dest-after-full.rc"
mount -o remount,size=256m "$TMPDIR" || exit 98
step rerun export --format speculators "$SRC" "$DEST"
"""


def test_a_full_temporary_directory_stops_an_export_from_s3(
    on_s3: Path, s3_endpoint: str, job_cache: str, bucket: str, tmp_path: Path
) -> None:
    """Each shard is fetched into TMPDIR before it is read: there, a full disk is named as such
    (not as DST's), and nothing is left in DST."""
    prefix = mount_namespace()
    if not prefix:
        pytest.skip("no mount namespace (unshare --mount) for a private tmpfs here")
    shards = read_manifest(on_s3 / "index-00000").shards  # type: ignore[union-attr]
    small, logs, dest = tmp_path / "tmp", tmp_path / "logs", tmp_path / "spec"
    small.mkdir()
    logs.mkdir()
    env = {
        **job_env(s3_endpoint, job_cache),
        "TMPDIR": str(small),
        "TMP_BYTES": str(min(s.bytes for s in shards) // 2),
        "LOGS": str(logs),
        "SRC": f"s3://{bucket}/{PREFIX}",
        "DEST": str(dest),
        "PYTHON": sys.executable,
    }
    proc = subprocess.run(
        [*prefix, "sh", "-c", SMALL_TMPDIR_EXPORT], env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr
    rc, err = int((logs / "full.rc").read_text()), (logs / "full.err").read_text()
    assert rc == 1 and "Traceback" not in err and len(err.strip().splitlines()) == 1, err
    assert err.startswith(f"error: no space left in {small} for s3://{bucket}/{PREFIX}/index-00000/shard-")
    assert "point TMPDIR at a disk with room, and run the same command again" in err
    assert (logs / "dest-after-full.rc").read_text().strip() == "1"  # the unfinished export was removed
    assert (logs / "tmp-after-full.ls").read_text() == ""  # and the shard's fetched part
    rc, out = int((logs / "rerun.rc").read_text()), (logs / "rerun.out").read_text()
    assert rc == 0, (logs / "rerun.err").read_text()
    written = read_manifest(on_s3 / "index-00000").counts.written  # type: ignore[union-attr]
    assert json.loads((dest / METADATA).read_text())["rows"] == written
    assert out.startswith(f"exported         {written} samples")
