"""Where output goes and where readers find it: a local directory or an object store.

A URI with a scheme (``s3://bucket/prefix``) names an object store; anything else is a
local path (``file://`` allowed). An object store is one module, ``job/storage/<scheme>.py``,
whose ``connect(uri, setting, **tuning)`` returns its ``ObjectTransport`` and the key prefix;
everything else (staging, commit, manifest, read side) is shared by all object stores.
"""

from __future__ import annotations

import importlib
import re
from typing import TYPE_CHECKING

from job.errors import ConfigError
from job.storage.base import IndexStore, ShardSource
from job.storage.transport import ObjectTransport

if TYPE_CHECKING:
    from job.settings import OutputSettings  # the write side only: readers never load settings

_SCHEME = re.compile(r"^([a-z][a-z0-9+.-]*)://")


def uri_scheme(uri: str) -> str | None:
    """The object-store scheme of ``uri`` (``s3``), or None for a local path or file:// URI."""
    match = _SCHEME.match(uri)
    return None if match is None or match.group(1) == "file" else match.group(1)


def connect_transport(uri: str, setting: str, **tuning: int) -> tuple[ObjectTransport, str]:
    """The transport for an object-store URI and the key prefix within its bucket."""
    scheme = uri_scheme(uri)
    try:
        module = importlib.import_module(f"job.storage.{scheme}")
        connect = module.connect
    except (ImportError, AttributeError):
        raise ConfigError(
            f"{setting}: {uri!r}: no object store for scheme {scheme}:// (s3:// is supported)"
        ) from None
    return connect(uri, setting, **tuning)


def open_index_store(output: OutputSettings, index: int) -> IndexStore:
    if uri_scheme(output.uri) is None:
        from job.storage.local import LocalIndexStore

        return LocalIndexStore.open(output.uri, index)
    from job.storage.objects import ObjectIndexStore

    transport, root = connect_transport(
        output.uri,
        "output.uri",
        upload_threads=int(output.upload_threads),
        part_size=int(output.part_size),
        sign_payload=output.sign_payload,
    )
    try:
        return ObjectIndexStore.open(transport, root, output, index)
    except BaseException:
        transport.close()
        raise


def open_shard_source(uri: str, setting: str, verify: bool = False) -> ShardSource:
    """Committed shards of an output (or one index) for readers. Object-store shards are always
    verified: each is downloaded anyway."""
    if uri_scheme(uri) is None:
        from job.storage.local import LocalShardSource, local_root

        return LocalShardSource(local_root(uri), verify, setting)
    from job.storage.objects import ObjectShardSource

    transport, prefix = connect_transport(uri, setting)
    return ObjectShardSource(transport, prefix, setting)
