"""Resume: what an index already holds, and a clean slate for everything else.

The manifest is the only record of what exists. A listed shard is checked against it
(output.verify_on_resume), in a complete index too, and its samples are skipped by this run;
anything unlisted (an interrupted run's leftovers) is discarded where the store allows it
(local) or left alone and never read (object stores), and new shards take numbers above every
name present.

An index, and the output, are pinned to one extraction (model, weights, layers, data, settings)
only once they hold something committed: a manifest that lists no shard and is not complete
(its run failed before committing any, on data without records say) is started over with this
run's settings, and ``extraction.json`` is written when the first shard is listed
(``pin_output``), not when a run starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from job.errors import ConfigError, DamagedShard
from job.layout import EXTRACTION, MANIFEST, REJECTED, is_log, shard_number
from job.manifest import Identity, Manifest
from job.model import LAYER_CONVENTION
from job.pipeline.setup import RunSetup
from job.settings import OutputSettings
from job.storage.base import IndexStore


@dataclass
class Resumed:
    manifest: Manifest
    version: str | None  # the manifest's version in the store (compare-and-swap)
    next_shard_number: int
    written_before: int  # samples committed by earlier runs


def resume(setup: RunSetup, store: IndexStore, log: Any) -> Resumed:
    data, version = store.read_manifest()
    manifest = None if data is None else Manifest.from_bytes(data, store.location)
    earlier_runs: list[str] = []
    if manifest is not None and starts_over(manifest):
        log.info("index_started_over", location=store.location, earlier_runs=manifest.run_ids)
        earlier_runs, manifest = manifest.run_ids, None
    check_output_settings(setup.identity, manifest, store.read_output_claim(), store.location)
    if manifest is None:
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
            run_ids=earlier_runs,
        )
    if _check_committed(manifest, store, setup.settings.output, log) and manifest.complete:
        manifest.complete = False  # a shard was dropped: its samples are to be extracted again
        log.warning("complete_index_reopened", location=store.location, shards=len(manifest.shards))
    names = store.list_names() if not manifest.complete else []
    keep = manifest.listed_names() | {MANIFEST, REJECTED}
    for name in names:
        if name not in keep and not is_log(name):
            store.discard(name)
    next_number = max((n for name in names if (n := shard_number(name)) is not None), default=-1) + 1
    return Resumed(manifest, version, next_number, manifest.counts.written)


def starts_over(manifest: Manifest) -> bool:
    """Whether a run starts the index over, with its own settings: its manifest lists no shard and
    is not complete (the module docstring)."""
    return not manifest.shards and not manifest.complete


def check_output_settings(
    identity: Identity, manifest: Manifest | None, claim: bytes | None, location: str
) -> None:
    """ConfigError (exit 2) unless a run with ``identity`` may go on with the index at ``location``:
    its ``manifest`` (None: none, or one a run starts over) and the output's ``EXTRACTION``
    (``claim``; None while there is none) hold this extraction. ``run`` checks this as it resumes,
    the preflight before any engine starts."""
    if manifest is not None:
        manifest.check_resumable(identity, location)
    _check_extraction(identity, claim, location)


def pin_output(identity: Identity, store: IndexStore) -> None:
    """Write the output's ``EXTRACTION`` (create-only) unless one exists, and check that it is this
    run's: called before the index's manifest first lists a shard or is complete."""
    _check_extraction(identity, store.claim_output(_extraction_bytes(identity)), store.location)


def _extraction_bytes(identity: Identity) -> bytes:
    return json.dumps(
        identity.model_dump(mode="json", exclude={"work_index"}), indent=1, sort_keys=True
    ).encode()


def _check_extraction(identity: Identity, found: bytes | None, location: str) -> None:
    """Every index of one output holds one extraction: the same model, layers, data, settings and
    work.count. The first index to commit a shard writes what that is (``EXTRACTION``); an index
    run with anything else, a different work.count above all, would split the samples differently
    and write some twice. ``found``: the file's content, None while there is none."""
    if found is None:
        return
    where = f"{EXTRACTION} beside {location}"
    try:
        theirs = Identity.model_validate({**json.loads(found), "work_index": identity.work_index})
    except ValueError as exc:
        raise ConfigError(f"{where} is not one this job understands ({exc}); use a new output.uri") from None
    if changed := theirs.changes(identity):
        raise ConfigError(
            f"the other indexes of this output were extracted with different settings or data ({where}): "
            f"{'; '.join(changed)}. Every index of one output.uri needs the same ones; use a new output.uri"
        )


def _check_committed(manifest: Manifest, store: IndexStore, output: OutputSettings, log: Any) -> bool:
    """Every committed shard must still be what its manifest says (output.verify_on_resume); a
    damaged one stops the run, or with output.on_damaged_shard=reextract is dropped from the
    manifest (its samples are extracted again; local files are deleted with the leftovers). A
    shard's sidecar of regenerated conversations is checked with it: either damaged drops both.
    Returns whether a shard was dropped."""
    damaged = []
    for entry in manifest.shards:
        try:
            for stored in (entry, entry.regenerated):
                if stored is not None:
                    store.check_committed(stored, checksum=output.verify_on_resume == "checksum")
        except DamagedShard as exc:
            damaged.append((entry, str(exc)))
    if not damaged:
        return False
    if output.on_damaged_shard == "stop":
        raise ConfigError(
            f"{len(damaged)} committed shard(s) of {store.location} no longer match the manifest: "
            f"{damaged[0][1]}; set output.on_damaged_shard=reextract to extract their samples again"
        )
    for entry, problem in damaged:
        manifest.drop_shard(entry)
        log.warning("damaged_shard_dropped", shard=entry.name, samples=entry.num_samples, problem=problem)
    return True
