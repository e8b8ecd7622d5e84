"""``python -m job export s3://bucket/prefix DST``: an output on S3 as an export source.

Manifests are read whole; a shard's metadata comes from a ranged read of its header;
a shard itself is streamed to a temporary file, checked against the manifest's
CRC64NVME on the way, read, and removed, so local disk holds one shard at a time.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from awscrt.checksums import crc64nvme

from job.checksum import encode
from job.errors import ConfigError, JobError
from job.export import ShardSource, SourceIndex
from job.manifest import Manifest, ShardEntry
from job.shards import Shard
from job.storage.base import MANIFEST
from job.storage.s3 import _get_whole, _opener, _s3_errors, make_client, parse_s3_uri

SETTING = "export SRC"
_CHUNK = 8 * 1024 * 1024


class S3ShardSource(ShardSource):
    def __init__(self, uri: str) -> None:
        self.bucket, prefix = parse_s3_uri(uri, SETTING)
        self.location = uri.rstrip("/")
        self._client = make_client()
        base = f"{prefix.rstrip('/')}/" if prefix else ""
        with _s3_errors(SETTING, self.bucket, f"listing {self.location}"):
            # every object's ETag and size: shards are read pinned to the listed version
            self._objects = {
                obj["Key"]: (obj["ETag"], int(obj["Size"]))
                for page in self._client.get_paginator("list_objects_v2").paginate(
                    Bucket=self.bucket, Prefix=base
                )
                for obj in page.get("Contents", [])
            }
        keys = [key[len(base) :] for key in self._objects]
        if not keys:
            raise ConfigError(
                f"{SETTING} {uri}: no objects there (give an output prefix or one index-* prefix)"
            )
        names = sorted({key.split("/", 1)[0] for key in keys if key.startswith("index-") and "/" in key})
        self.single_index = not names and MANIFEST in keys
        if not names and not self.single_index:
            raise ConfigError(f"{SETTING} {uri}: neither index-*/ prefixes nor a {MANIFEST} there")
        single = base.rstrip("/").rsplit("/", 1)[-1] or self.bucket
        self._bases = {single: base} if self.single_index else {name: f"{base}{name}/" for name in names}

    def _url(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def _shard_key(self, index: str, entry: ShardEntry) -> str:
        return self._bases[index] + entry.name

    def indexes(self) -> list[SourceIndex]:
        found = []
        for name, base in self._bases.items():
            key = base + MANIFEST
            if key not in self._objects:
                found.append(SourceIndex(name, None, None))
                continue
            with _s3_errors(SETTING, self.bucket, f"reading {self._url(key)}"):
                data, _etag = _get_whole(self._client, Bucket=self.bucket, Key=key)
            found.append(
                SourceIndex(name, Manifest.from_bytes(data, self._url(key)), hashlib.sha256(data).hexdigest())
            )
        return found

    def _open(self, index: str, entry: ShardEntry) -> IO[bytes]:
        key = self._shard_key(index, entry)
        if key not in self._objects:
            raise JobError(f"{self._url(key)}: listed in {index}/{MANIFEST} but missing")
        etag, size = self._objects[key]
        return _opener(self._client, self.bucket, key, etag, size, SETTING)()

    def shard_metadata(self, index: str, entry: ShardEntry) -> dict[str, str]:
        with self._open(index, entry) as reader:
            length = reader.read(8)
            header = reader.read(struct.unpack("<Q", length)[0]) if len(length) == 8 else b""
        if not header:
            raise JobError(f"{self._url(self._shard_key(index, entry))}: not a safetensors file (no header)")
        return json.loads(header).get("__metadata__") or {}

    @contextmanager
    def open_shard(self, index: str, entry: ShardEntry) -> Iterator[Shard]:
        directory = Path(tempfile.mkdtemp(prefix="eagle3-export-"))
        try:
            path = directory / entry.name
            crc = 0
            with self._open(index, entry) as reader, path.open("wb") as out:
                buffer = bytearray(_CHUNK)
                view = memoryview(buffer)
                while n := reader.readinto(buffer):
                    out.write(view[:n])
                    crc = crc64nvme(view[:n], crc)
            if encode(crc) != entry.checksum.value:
                raise JobError(
                    f"{self._url(self._shard_key(index, entry))}: checksum {encode(crc)} differs from the "
                    f"manifest's {entry.checksum.value}; the shard is damaged: re-run that index"
                )
            yield Shard(path)
        finally:
            shutil.rmtree(directory, ignore_errors=True)
