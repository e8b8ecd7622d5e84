"""The preflight's output check: create-only writes at the real ``output.uri``, of every kind the
run makes there, leaving nothing behind; and, read only, what an earlier run left there.

Object store: a create-only put, the same put again (which the store must refuse: resume and
the shard keys rely on ``If-None-Match``), a multipart upload with its full-object CRC64NVME
checked by the store, then both objects deleted and the prefix listed empty. Local: the index
directory created where missing, a create-only file written with direct I/O where the file
system has it (otherwise the run writes through the page cache), free space for one shard, then
everything it created removed.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import secrets
import shutil
import tempfile
from pathlib import Path

from job.checksum import ALGORITHM, crc64nvme_file
from job.errors import ConfigError
from job.layout import EXTRACTION, MANIFEST, index_dir_name
from job.manifest import Checksum
from job.settings import MIN_PART_SIZE, OutputSettings
from job.storage import connect_transport, uri_scheme
from job.storage.transport import PreconditionFailed

_BLOCK = 4096  # O_DIRECT wants block-aligned memory, offsets and lengths


def probe_output(output: OutputSettings, index: int) -> list[str]:
    """What the probe proved about the output (one line each); ConfigError/StorageError if not."""
    if uri_scheme(output.uri) is None:
        from job.storage.local import local_root

        return _probe_local(local_root(output.uri) / index_dir_name(index), int(output.shard_bytes))
    return _probe_object_store(output, index)


def read_output_records(output: OutputSettings, index: int) -> tuple[bytes | None, bytes | None, str]:
    """Index ``index``'s manifest and the output's ``EXTRACTION`` as they are (None: absent), and
    where the index is (as ``run``'s store names it), read without writing anything."""
    if uri_scheme(output.uri) is None:
        from job.storage.local import local_root

        directory = local_root(output.uri) / index_dir_name(index)
        return (
            _read_if_present(directory / MANIFEST),
            _read_if_present(directory.parent / EXTRACTION),
            str(directory),
        )
    transport, root = connect_transport(output.uri, "output.uri")
    prefix = f"{root}/" if root else ""
    try:
        manifest = transport.get(f"{prefix}{index_dir_name(index)}/{MANIFEST}")
        claim = transport.get(prefix + EXTRACTION)
        location = transport.url(prefix + index_dir_name(index))
    finally:
        transport.close()
    return None if manifest is None else manifest[0], None if claim is None else claim[0], location


def _read_if_present(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ConfigError(f"output.uri: cannot read {path}: {exc.strerror}") from None


def _probe_local(directory: Path, shard_bytes: int) -> list[str]:
    created = [p for p in (directory, *directory.parents) if not p.exists()]
    probe = directory / f".preflight-{secrets.token_hex(4)}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        os.close(fd)
        direct = _write_direct(probe)
        free = shutil.disk_usage(directory).free
    except OSError as exc:
        raise ConfigError(f"output.uri: cannot write to {directory}: {exc.strerror or exc}") from None
    finally:
        with contextlib.suppress(OSError):  # absent, or never creatable
            probe.unlink()
        for path in created:  # deepest first; only what the probe made
            with contextlib.suppress(OSError):
                path.rmdir()
    if free < shard_bytes:
        raise ConfigError(
            f"output.uri: {directory.parent} has {free:,} bytes free, less than one shard "
            f"(output.shard_bytes {shard_bytes:,}): free space or lower output.shard_bytes"
        )
    return [
        f"output {directory}: create-only write, "
        + ("direct I/O" if direct else "no direct I/O on this file system (page cache)")
        + f", {free / 1024**3:.1f} GiB free; nothing left behind"
    ]


def _write_direct(path: Path) -> bool:
    """One aligned block through O_DIRECT; False where the file system refuses it (the shard
    writer then falls back the same way)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_DIRECT)
    except OSError:
        return False
    try:
        with mmap.mmap(-1, _BLOCK) as block:  # page-aligned
            block.write(b"\0" * _BLOCK)
            os.write(fd, block)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def _probe_object_store(output: OutputSettings, index: int) -> list[str]:
    # A multipart upload at S3's smallest part size, whatever output.part_size is: the probe
    # proves the kind of request, not the run's part size.
    transport, root = connect_transport(output.uri, "output.uri", upload_threads=2, part_size=MIN_PART_SIZE)
    prefix = f"{root}/" if root else ""
    prefix += f"{index_dir_name(index)}/.preflight-{secrets.token_hex(4)}/"
    small, large = prefix + "put", prefix + "multipart"
    where = transport.url(prefix)
    try:
        transport.put(small, b"preflight\n", "text/plain", create_only=True)
        try:
            transport.put(small, b"again\n", "text/plain", create_only=True)
        except PreconditionFailed:
            pass
        else:
            raise ConfigError(
                f"output.uri: {where}: the object store overwrote an object on a create-only put "
                "(If-None-Match: *); the job needs conditional writes (S3 has them since 2024-08)"
            )
        with tempfile.TemporaryDirectory(prefix="eagle3-preflight-") as scratch:
            part = Path(scratch) / "multipart"
            with part.open("wb") as f:  # two parts
                f.write(os.urandom(1024) * (MIN_PART_SIZE // 1024 + 1))
            transport.upload_new(part, large, Checksum(algorithm=ALGORITHM, value=crc64nvme_file(part)))
    finally:
        for key in (small, large):
            with contextlib.suppress(Exception):
                transport.delete(key)
        with contextlib.suppress(Exception):
            transport.abort_uploads(prefix)
        try:
            left = transport.list(prefix)
        except Exception:
            left = []  # the error that got here is the one to report
        transport.close()
    if left:
        raise ConfigError(
            f"output.uri: {where}: the probe's objects could not be deleted ({len(left)} left); "
            "the job needs s3:DeleteObject under output.uri"
        )
    return [
        f"output {where}: create-only put, a second create-only put refused, multipart upload "
        "with CRC64NVME verified by the store, delete; nothing left behind"
    ]
