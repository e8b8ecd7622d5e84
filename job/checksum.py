"""CRC64NVME, the full-object checksum S3 computes, so local and S3 shards
carry the same value (base64 of the 8-byte big-endian CRC, as S3 reports it)."""

from __future__ import annotations

import base64
import mmap
import os
from pathlib import Path

from awscrt.checksums import crc64nvme

ALGORITHM = "crc64nvme"
_CHUNK = 8 * 1024 * 1024


def crc64nvme_file(path: Path) -> str:
    """Checksum of a file through a read-only mapping: a shard just written is in
    the page cache, and the CRC (tens of GB/s) is faster than copying it out."""
    crc = 0
    with path.open("rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size == 0:
            return encode(crc64nvme(b""))
        with mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as mapping:
            view = memoryview(mapping)
            try:
                for start in range(0, size, _CHUNK):
                    crc = crc64nvme(view[start : start + _CHUNK], crc)
            finally:
                view.release()
    return encode(crc)


def crc64nvme_bytes(data: bytes) -> str:
    return encode(crc64nvme(data))


def encode(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(8, "big")).decode()
