"""Resume: what an index already holds, and a clean slate for everything else.

The manifest is the only record of what exists. A listed shard's samples are skipped by
this run; anything unlisted (an interrupted run's leftovers) is discarded where the store
allows it (local) or left alone and never read (object stores), and new shards take
numbers above every name present.
"""

from __future__ import annotations

from dataclasses import dataclass

from job.layout import MANIFEST, REJECTED, is_log, shard_number
from job.manifest import Manifest
from job.model import LAYER_CONVENTION
from job.pipeline.setup import RunSetup
from job.storage.base import IndexStore


@dataclass
class Resumed:
    manifest: Manifest
    version: str | None  # the manifest's version in the store (compare-and-swap)
    next_shard_number: int
    written_before: int  # samples committed by earlier runs


def resume(setup: RunSetup, store: IndexStore) -> Resumed:
    data, version = store.read_manifest()
    if data is not None:
        manifest = Manifest.from_bytes(data, store.location)
        manifest.check_resumable(setup.identity, store.location)
    else:
        model = setup.model
        manifest = Manifest(
            identity=setup.identity,
            model_name=model.name,
            model_path=str(model.path),
            hidden_size=model.hidden_size,
            dtype=model.dtype,
            layer_convention=LAYER_CONVENTION,
            final_layer_prenorm=True,
            backend={},
        )
    names = store.list_names() if not manifest.complete else []
    keep = {s.name for s in manifest.shards} | {MANIFEST, REJECTED}
    for name in names:
        if name not in keep and not is_log(name):
            store.discard(name)
    next_number = max((n for name in names if (n := shard_number(name)) is not None), default=-1) + 1
    return Resumed(manifest, version, next_number, manifest.counts.written)
