"""Where output goes: a local directory or S3, behind one IndexStore interface."""

from __future__ import annotations

from job.settings import OutputSettings
from job.storage.base import IndexStore


def open_index_store(output: OutputSettings, index: int) -> IndexStore:
    uri = output.uri
    if uri.startswith("s3://"):
        from job.storage.s3 import S3IndexStore

        return S3IndexStore.open(output, index)
    from job.storage.local import LocalIndexStore

    return LocalIndexStore.open(uri, index)
