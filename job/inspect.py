"""``python -m job inspect PATH [--verify]``: summarize a shard file or an output (local or on an
object store). ``--verify`` checks every listed shard's (and sidecar's) size and CRC64NVME against
its manifest (a single shard file: against the manifest beside it); any problem makes the command
exit 1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from job.errors import ConfigError, DamagedShard
from job.layout import MANIFEST
from job.manifest import Manifest, StoredFile
from job.shards import Shard
from job.storage import open_shard_source, uri_scheme
from job.storage.base import ShardSource
from job.storage.local import check_local_file

SETTING = "inspect PATH"


@dataclass(frozen=True)
class Report:
    text: str
    ok: bool  # False: a listed shard is missing or damaged


def inspect_path(path: str, verify: bool = False) -> Report:
    local = Path(path.removeprefix("file://")).expanduser() if uri_scheme(path) is None else None
    if local is not None and local.is_file():
        return _inspect_shard(local, verify)
    return _inspect_output(open_shard_source(path, SETTING), verify)


def _inspect_shard(path: Path, verify: bool) -> Report:
    try:
        shard = Shard(path)
    except Exception as exc:  # not safetensors, or not ours: say so instead of a traceback
        raise ConfigError(f"inspect: {path} is not a shard file ({_one_line(exc)})") from None
    meta = shard.metadata
    lines = [
        f"shard            {path}",
        f"samples          {len(shard)}",
        f"tokens           {shard.num_tokens}",
        f"layer ids        {shard.layer_ids} ({meta['layer_convention']})",
        f"final pre-norm   {meta['final_layer_prenorm']}",
        f"hidden           {meta['hidden_size']} x {meta['dtype']} (model dtype {meta['model_dtype']})",
        f"model            {meta['model_name']} ({meta['model_config_hash'][:19]}...)",
        f"backend          {meta['backend_info']}",
        f"work             index {meta['work_index']} of {meta['work_count']}, run {meta['run_id']}",
    ]
    ok = True
    if verify:
        status, ok = _verify_against_manifest(path)
        lines.append(f"verify           {status}")
    for sample in list(shard)[:5]:
        lines.append(
            f"  {sample.sample_id}: {sample.input_ids.shape[0]} tokens, "
            f"{int(sample.loss_mask.sum())} assistant, hidden {tuple(sample.hidden_states.shape)}"
        )
    if len(shard) > 5:
        lines.append(f"  ... {len(shard) - 5} more")
    return Report("\n".join(lines), ok)


def _verify_against_manifest(path: Path) -> tuple[str, bool]:
    manifest_path = path.parent / MANIFEST
    if not manifest_path.is_file():
        return f"FAILED: no {MANIFEST} beside the shard to check it against", False
    manifest = Manifest.from_bytes(manifest_path.read_bytes(), str(manifest_path))
    entry = next((e for e in manifest.shards if e.name == path.name), None)
    if entry is None:
        return f"FAILED: {manifest_path} does not list {path.name} (an interrupted run's leftover)", False
    try:
        check_local_file(path, entry, checksum=True)
    except DamagedShard as exc:
        return f"DAMAGED: {exc}", False
    return f"checksum ok ({entry.checksum.algorithm} {entry.checksum.value})", True


def _inspect_output(source: ShardSource, verify: bool) -> Report:
    lines = []
    ok = True
    for index in source.indexes():
        manifest = index.manifest
        if manifest is None:
            lines.append(f"{index.name}: no manifest (nothing committed)")
            continue
        tokens = sum(s.num_tokens for s in manifest.shards)
        nbytes = sum(s.bytes for s in manifest.shards)
        c = manifest.counts
        lines.append(
            f"{index.name}: {'complete' if manifest.complete else 'INCOMPLETE'}, "
            f"{len(manifest.shards)} shards, "
            f"{c.written} samples ({c.truncated} truncated), {c.rejected} rejected, {tokens} tokens, "
            f"{nbytes / 1024**2:.1f} MiB, layers {manifest.identity.layer_ids}, backend "
            f"{manifest.backend.get('backend')}"
        )
        if manifest.generation is not None:
            g, how = manifest.generation, manifest.identity.generation or {}
            lines.append(
                f"  regenerated ({', '.join(f'{k} {v}' for k, v in how.items())}): {g.conversations} "
                f"conversations, {g.turns} turns, {g.generated_tokens} tokens generated, "
                f"{g.cut_by_length} turns cut by length, {g.turns_not_generated} not generated (no room left "
                "within data.max_length)"
            )
        for entry in manifest.shards:
            status, fine = _check(source, index.name, entry, verify)
            ok = ok and fine
            lines.append(
                f"  {entry.name}: {entry.num_samples} samples, {entry.num_tokens} tokens, "
                f"{entry.bytes} bytes, {entry.checksum.algorithm} {entry.checksum.value}{status}"
            )
            if entry.regenerated is not None:
                sidecar = entry.regenerated
                status, fine = _check(source, index.name, sidecar, verify)
                ok = ok and fine
                lines.append(
                    f"    {sidecar.name}: {sidecar.counts.turns} turns, {sidecar.counts.generated_tokens} "
                    f"tokens generated, {sidecar.bytes} bytes, {sidecar.checksum.algorithm} "
                    f"{sidecar.checksum.value}{status}"
                )
    return Report("\n".join(lines), ok)


def _check(source: ShardSource, index: str, entry: StoredFile, verify: bool) -> tuple[str, bool]:
    """The status to print after a listed file, and whether it is fine."""
    try:
        source.check(index, entry, checksum=verify)
    except DamagedShard as exc:
        return f"  DAMAGED: {exc}", False
    return ("  checksum ok" if verify else ""), True


def _one_line(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
