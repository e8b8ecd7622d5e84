"""The pinned shard format (format_version 1), and what fixes one shard's layout: its plan
(number and members) and the run's context (``ShardContext.layout``).

A shard is a safetensors file holding many samples, token-major:

==================  ========  =========  ==========================================
tensor              dtype     shape      meaning
==================  ========  =========  ==========================================
hidden_states       model     [T, L, H]  layers in ``layer_ids`` order
sample_offsets      int64     [S+1]      sample i owns token rows [o[i], o[i+1])
input_ids           int32     [T]        the prompt tokens
loss_mask           uint8     [T]        1 = assistant token (a training target)
==================  ========  =========  ==========================================

Byte order in the file: the JSON header is padded with spaces (as safetensors
allows) to a multiple of 4 KiB, and hidden_states comes first, so its rows
sit at block-aligned offsets whenever a row is a multiple of 4 KiB (e.g. 4
layers x 4096 x bf16 = 32 KiB): they can then be written with direct I/O.
The smaller tensors follow in decreasing item size, each naturally aligned.

With ``output.hidden_dtype: fp8_e4m3`` (metadata ``storage: fp8_e4m3``) hidden_states
is F8_E4M3 and ``hidden_states_scale`` (float32 [T, L]) holds per-token, per-layer
scales: value = fp8 * scale.

``__metadata__`` (all strings, JSON where structured): format_version,
sample_ids, layer_ids, layer_convention, final_layer_prenorm, model_path,
model_name, model_config_hash, model_dtype, dtype, storage, hidden_size,
num_model_layers, backend, backend_info, data_fingerprint, work_index,
work_count, run_id, num_truncated; and where the turns were regenerated
(generate.mode), generation: the mode and sampling they were generated with (the
text is in the shard's sidecar, job.layout).
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING

from job.hidden_dtype import SCALE_BYTES, HiddenDtype
from job.layout import shard_name

if TYPE_CHECKING:
    from job.data.encode import EncodedSample

FORMAT_VERSION = "1"
DATA_ALIGNMENT = 4096  # the tensor data (hidden_states first) starts on a block boundary
# The safetensors header limit (100 MB): a longer length prefix is not a shard.
_MAX_HEADER_BYTES = 100_000_000


def read_metadata(stream: IO[bytes], where: str) -> dict[str, str]:
    """The ``__metadata__`` of a shard from the start of its bytes (a remote shard's header is
    all that needs reading). ValueError if the bytes are not a safetensors file."""
    prefix = stream.read(8)
    if len(prefix) != 8 or not 0 < (length := struct.unpack("<Q", prefix)[0]) <= _MAX_HEADER_BYTES:
        raise ValueError(f"{where}: not a safetensors file (no header)")
    try:
        header = json.loads(stream.read(length))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{where}: not a safetensors file (header: {exc})") from None
    return header.get("__metadata__") or {}


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: str  # safetensors dtype string
    shape: tuple[int, ...]
    itemsize: int

    @property
    def nbytes(self) -> int:
        n = self.itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class ShardLayout:
    """Byte layout of one shard file: header, then tensors at fixed offsets."""

    header: bytes  # the 8-byte length prefix plus the padded JSON header
    offsets: dict[str, int]  # absolute file offset of each tensor
    specs: dict[str, TensorSpec]
    total_bytes: int

    @classmethod
    def build(
        cls,
        num_samples: int,
        num_tokens: int,
        num_layers: int,
        hidden_size: int,
        dtype: HiddenDtype,
        metadata: dict[str, str],
    ) -> ShardLayout:
        if (num_layers * hidden_size * dtype.itemsize) % 8:
            raise ValueError(
                f"{num_layers} layers x hidden size {hidden_size}: rows are not 8-byte multiples"
            )
        specs = [
            TensorSpec(
                "hidden_states", dtype.safetensors, (num_tokens, num_layers, hidden_size), dtype.itemsize
            ),
            TensorSpec("sample_offsets", "I64", (num_samples + 1,), 8),
        ]
        if dtype.scaled:
            specs.append(TensorSpec("hidden_states_scale", "F32", (num_tokens, num_layers), SCALE_BYTES))
        specs += [
            TensorSpec("input_ids", "I32", (num_tokens,), 4),
            TensorSpec("loss_mask", "U8", (num_tokens,), 1),
        ]
        entries: dict[str, object] = {"__metadata__": metadata}
        relative: dict[str, int] = {}
        pos = 0
        for spec in specs:
            entries[spec.name] = {
                "dtype": spec.dtype,
                "shape": list(spec.shape),
                "data_offsets": [pos, pos + spec.nbytes],
            }
            relative[spec.name] = pos
            pos += spec.nbytes
        body = json.dumps(entries, separators=(",", ":")).encode()
        body += b" " * (-(8 + len(body)) % DATA_ALIGNMENT)
        header = struct.pack("<Q", len(body)) + body
        base = len(header)
        return cls(
            header=header,
            offsets={k: base + v for k, v in relative.items()},
            specs={s.name: s for s in specs},
            total_bytes=base + pos,
        )


@dataclass
class ShardPlan:
    """A shard's number and members, fixed before the backend sees them (job.pipeline.feed)."""

    number: int
    samples: list[EncodedSample]

    @property
    def name(self) -> str:
        return shard_name(self.number)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.samples)


@dataclass
class ShardContext:
    """Per-run values recorded in every shard's metadata."""

    num_layers: int  # stored layers (L)
    hidden_size: int
    dtype: HiddenDtype
    metadata: dict[str, str]

    @property
    def row_bytes(self) -> int:
        return self.num_layers * self.hidden_size * self.dtype.itemsize

    def layout(self, plan: ShardPlan) -> ShardLayout:
        """The byte layout of ``plan``'s shard file (``total_bytes`` is its exact size)."""
        metadata = dict(self.metadata)
        metadata.update(
            format_version=FORMAT_VERSION,
            sample_ids=json.dumps([s.sample_id for s in plan.samples], ensure_ascii=False),
            num_truncated=str(sum(s.truncated for s in plan.samples)),
        )
        return ShardLayout.build(
            len(plan.samples), plan.num_tokens, self.num_layers, self.hidden_size, self.dtype, metadata
        )
