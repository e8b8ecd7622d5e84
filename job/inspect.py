"""``python -m job inspect PATH``: summarize a shard file or an output directory."""

from __future__ import annotations

from pathlib import Path

from job.checksum import crc64nvme_file
from job.errors import ConfigError
from job.shards import Shard, read_manifest


def inspect_path(path: str, verify: bool = False) -> str:
    p = Path(path)
    if p.is_file():
        return _inspect_shard(p)
    if p.is_dir():
        return _inspect_output(p, verify)
    raise ConfigError(f"inspect: {path} does not exist")


def _inspect_shard(path: Path) -> str:
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
    for sample in list(shard)[:5]:
        lines.append(
            f"  {sample.sample_id}: {sample.input_ids.shape[0]} tokens, "
            f"{int(sample.loss_mask.sum())} assistant, hidden {tuple(sample.hidden_states.shape)}"
        )
    if len(shard) > 5:
        lines.append(f"  ... {len(shard) - 5} more")
    return "\n".join(lines)


def _inspect_output(root: Path, verify: bool) -> str:
    index_dirs = sorted(d for d in root.glob("index-*") if d.is_dir())
    if not index_dirs and (root / "manifest.json").is_file():
        index_dirs = [root]
    if not index_dirs:
        raise ConfigError(f"inspect: {root} holds no index-* directories")
    lines = []
    for d in index_dirs:
        manifest = read_manifest(d)
        if manifest is None:
            lines.append(f"{d.name}: no manifest (nothing committed)")
            continue
        tokens = sum(s.num_tokens for s in manifest.shards)
        nbytes = sum(s.bytes for s in manifest.shards)
        c = manifest.counts
        lines.append(
            f"{d.name}: {'complete' if manifest.complete else 'INCOMPLETE'}, {len(manifest.shards)} shards, "
            f"{c.written} samples ({c.truncated} truncated), {c.rejected} rejected, {tokens} tokens, "
            f"{nbytes / 1024**2:.1f} MiB, layers {manifest.identity.layer_ids}, backend "
            f"{manifest.backend.get('backend')}"
        )
        for entry in manifest.shards:
            status = ""
            if verify:
                ok = crc64nvme_file(d / entry.name) == entry.checksum.value
                status = "  checksum ok" if ok else "  CHECKSUM MISMATCH"
            lines.append(
                f"  {entry.name}: {entry.num_samples} samples, {entry.num_tokens} tokens, "
                f"{entry.bytes} bytes, {entry.checksum.algorithm} {entry.checksum.value}{status}"
            )
    return "\n".join(lines)


def _one_line(exc: Exception) -> str:
    return " ".join(f"{type(exc).__name__}: {exc}".split())
