"""CRC64NVME, the full-object checksum S3 computes, so local and S3 shards
carry the same value (base64 of the 8-byte big-endian CRC, as S3 reports it)."""

from __future__ import annotations

import base64
from pathlib import Path

from awscrt.checksums import crc64nvme

ALGORITHM = "crc64nvme"
_CHUNK = 8 * 1024 * 1024


def crc64nvme_file(path: Path) -> str:
    crc = 0
    with path.open("rb", buffering=0) as f:
        buf = bytearray(_CHUNK)
        view = memoryview(buf)
        while n := f.readinto(buf):
            crc = crc64nvme(view[:n], crc)
    return encode(crc)


def crc64nvme_bytes(data: bytes) -> str:
    return encode(crc64nvme(data))


def encode(crc: int) -> str:
    return base64.b64encode(crc.to_bytes(8, "big")).decode()
