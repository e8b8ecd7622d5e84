"""The target model's weight files: checked before any model loads, and fingerprinted.

A model directory without weights, or with weight files that cannot load, is something no
retry can fix: ``check_weights`` finds it by reading what the loaders themselves check first
(a safetensors file's header and that its tensors cover the file exactly, every shard a
``*.index.json`` lists, a torch zip's central directory), so the run ends with exit 2 before
a model load rather than with exit 1 after one.

The fingerprint (part of the resume identity) reads at most about 1 MiB of each file, so it
stays cheap for any model size:

* ``*.safetensors``: name, size, the SHA-256 of the JSON header (every tensor's name, dtype,
  shape and offsets) and of ``SAMPLES`` blocks of ``SAMPLE_BYTES`` spread evenly over the
  tensor data. Headers alone would not do: two fine-tunes of one model, saved alike, have
  identical headers. A change confined to bytes no block covers (one tensor edited in
  place) goes unseen;
* ``*.bin`` / ``*.pt`` / ``*.pth`` saved by ``torch.save`` (a zip): name, size and every
  member's name, size and CRC-32 from the zip's central directory (at the file's end): the
  whole content, as the writer checksummed it; a legacy pickle: name, size and the sampled
  blocks;
* ``*.index.json``: name and the SHA-256 of the whole (small) file.
"""

from __future__ import annotations

import hashlib
import json
import math
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

from job.errors import ConfigError

SAFETENSORS = ".safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth")
INDEX_SUFFIX = ".index.json"
# safetensors itself refuses headers over 100 MB.
MAX_HEADER_BYTES = 100_000_000
SAMPLES = 16
SAMPLE_BYTES = 64 * 1024
_DTYPE_BYTES = {
    "BOOL": 1, "U8": 1, "I8": 1, "F8_E5M2": 1, "F8_E4M3": 1, "F8_E8M0": 1, "U16": 2, "I16": 2, "F16": 2,
    "BF16": 2, "U32": 4, "I32": 4, "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8,
}  # fmt: skip
_SUB_BYTE_DTYPES = {"F4": 0.5, "F6_E2M3": 0.75, "F6_E3M2": 0.75}
_REDOWNLOAD = "copy or download the model's weights again"
_SHOWN = 3  # problems named in one message


@dataclass(frozen=True)
class WeightFile:
    name: str
    size: int
    digest: str  # what of the file's content the fingerprint takes (see the module docstring)


def weight_files(directory: Path) -> list[Path]:
    """The weight files (and their index files) at the top of a model directory, sorted: what
    transformers' and vLLM's default loaders look at."""
    return sorted(
        p
        for p in directory.iterdir()
        # A link to nothing (a hub cache's blob missing) is a weight file that cannot be read.
        if (p.is_file() or p.is_symlink()) and p.name.endswith((SAFETENSORS, *PICKLE_SUFFIXES, INDEX_SUFFIX))
    )


def check_weights(directory: Path) -> list[WeightFile]:
    """Every weight file of ``directory``, each with its fingerprint digest; ConfigError (exit 2,
    naming model.path) when there are none or some of those the loaders would read cannot load
    (``_loaded_files``)."""
    paths = weight_files(directory)
    if not any(p.name.endswith((SAFETENSORS, *PICKLE_SUFFIXES)) for p in paths):
        raise ConfigError(
            f"model.path {directory} holds no weights (no *.safetensors, *.bin, *.pt or *.pth files beside "
            "config.json): point model.path at a complete model directory, or download the weights into it"
        )
    files, indexes, problems = _loaded_files(directory, paths)
    loaded = {p.name for p in files} | {p.name for p in indexes}
    found = []
    for path in paths:
        try:
            found.append(WeightFile(path.name, path.stat().st_size, _digest(path)))
        except _Unusable as exc:
            if path.name in loaded:
                problems.append(f"{path.name}: {exc}")
            else:  # not read by the loaders: it still takes part in the fingerprint
                found.append(WeightFile(path.name, path.stat().st_size, f"unusable: {exc}"))
        except OSError as exc:
            problems.append(f"{path.name}: cannot be read ({exc.strerror})")
    if problems:
        more = f"; and {len(problems) - _SHOWN} more" if len(problems) > _SHOWN else ""
        raise ConfigError(
            f"model.path {directory}: {len(problems)} weight file(s) cannot load: "
            f"{'; '.join(problems[:_SHOWN])}{more}; {_REDOWNLOAD}"
        )
    return found


def _loaded_files(directory: Path, paths: list[Path]) -> tuple[list[Path], list[Path], list[str]]:
    """Of a directory's weight files (``paths``), those the loaders read and the indexes that list
    them, with a problem for each index that is unreadable or lists a shard the directory lacks.

    The loaders read safetensors where there are any, else the pickles; where that format has an
    index, only the shards it lists (a repository may ship both formats' indexes, and a download
    of one format leaves the other's index behind)."""
    safetensors = [p for p in paths if p.name.endswith(SAFETENSORS)]
    loaded_suffixes = (SAFETENSORS,) if safetensors else PICKLE_SUFFIXES
    indexes = [p for p in paths if p.name.endswith(tuple(s + INDEX_SUFFIX for s in loaded_suffixes))]
    listed, problems = _listed_shards(directory, indexes)
    weights = safetensors or [p for p in paths if p.name.endswith(PICKLE_SUFFIXES)]
    return [p for p in weights if not indexes or p.name in listed], indexes, problems


def weights_load_problem(exc: BaseException) -> str | None:
    """What is wrong with the weights when loading them raised ``exc`` for a reason no retry can
    fix (files that check_weights passed but changed since, or tensors of other shapes than
    config.json makes); None for anything else."""
    text = " ".join(str(exc).split()).rstrip(".")
    if type(exc).__name__ == "SafetensorError":
        return f"safetensors: {text}"
    if isinstance(exc, RuntimeError) and "size mismatch" in text:
        return f"tensors of other shapes than config.json gives: {text[:300]}"
    if (
        isinstance(exc, OSError)
        and exc.errno is None
        and ("no file named" in text or "Unable to load weights" in text)
    ):
        return text[:300]
    return None


def weights_fingerprint(files: list[WeightFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.size}\0{f.digest}\n".encode())
    return "sha256:" + digest.hexdigest()


class _Unusable(Exception):
    """What makes one weight file unloadable (the message says what was found)."""


def _digest(path: Path) -> str:
    name = path.name
    if name.endswith(INDEX_SUFFIX):
        return hashlib.sha256(path.read_bytes()).hexdigest()
    if name.endswith(SAFETENSORS):
        return _safetensors_header_digest(path)
    return _pickle_digest(path)


def safetensors_header(path: Path) -> dict[str, Any]:
    """A safetensors file's header (tensor name -> dtype, shape, offsets; ``__metadata__``), as
    read when check_weights passed the file."""
    with path.open("rb") as f:
        return json.loads(_read_header(f, path.stat().st_size))


def checkpoint_tensors(directory: Path) -> dict[str, tuple[str, tuple[int, ...]]] | str:
    """Every tensor of the weight files the loaders read (as check_weights finds them, which
    passed), by name, with its file's name and its shape; or why they cannot be listed without
    reading the weights (a pickle of before torch 1.6, or of something else than tensors)."""
    files, _, _ = _loaded_files(directory, weight_files(directory))
    found: dict[str, tuple[str, tuple[int, ...]]] = {}
    for path in files:
        if path.name.endswith(SAFETENSORS):
            header = safetensors_header(path)
            found.update(
                (name, (path.name, tuple(int(n) for n in info["shape"])))
                for name, info in header.items()
                if name != "__metadata__"
            )
            continue
        import torch

        try:  # a torch zip, memory-mapped: its storages are not read
            state = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
        except Exception as exc:
            return f"{path.name} cannot be listed without reading it ({type(exc).__name__}: {str(exc)[:200]})"
        if not isinstance(state, dict) or not all(isinstance(t, torch.Tensor) for t in state.values()):
            return f"{path.name} holds no plain state dict of tensors"
        found.update((name, (path.name, tuple(tensor.shape))) for name, tensor in state.items())
    return found


def _read_header(f: BinaryIO, size: int) -> bytes:
    prefix = f.read(8)
    if len(prefix) < 8:
        raise _Unusable(f"{size} bytes, too short for a safetensors file (truncated?)")
    length = int.from_bytes(prefix, "little")
    if length > min(size - 8, MAX_HEADER_BYTES):
        raise _Unusable(
            f"its header claims {length} bytes but the file has {size}: truncated, or not safetensors"
        )
    return f.read(length)


def _safetensors_header_digest(path: Path) -> str:
    """The header's SHA-256, after checking what safetensors checks when it opens the file:
    a JSON header whose tensors lie back to back and end exactly at the end of the file."""
    size = path.stat().st_size
    with path.open("rb") as f:
        header = _read_header(f, size)
        data = _sampled_digest(f, 8 + len(header), size)
    try:
        tensors = json.loads(header)
        end = _tensor_data_end(tensors)
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        raise _Unusable(f"its safetensors header is damaged ({type(exc).__name__}: {exc})") from None
    described = 8 + len(header) + end
    if described != size:
        why = "truncated (an interrupted download or copy?)" if described > size else "bytes past the tensors"
        raise _Unusable(f"{size} bytes, but its header describes {described}: {why}")
    return hashlib.sha256(header).hexdigest() + ":" + data


def _sampled_digest(f: BinaryIO, start: int, end: int) -> str:
    """SHA-256 of ``SAMPLES`` blocks spread evenly over bytes ``start:end`` of ``f`` (all of
    them when that is less)."""
    digest = hashlib.sha256()
    span = end - start
    if span <= SAMPLES * SAMPLE_BYTES:
        f.seek(start)
        digest.update(f.read(span))
        return digest.hexdigest()
    for i in range(SAMPLES):
        f.seek(start + (span - SAMPLE_BYTES) * i // (SAMPLES - 1))
        digest.update(f.read(SAMPLE_BYTES))
    return digest.hexdigest()


def _tensor_data_end(tensors: dict[str, object]) -> int:
    """Where the tensors' data ends, each tensor checked to start where the one before ended
    and to be as long as its dtype and shape make it."""
    spans = []
    for name, info in tensors.items():
        if name == "__metadata__":
            continue
        assert isinstance(info, dict), f"{name!r} is not an object"
        start, end = (int(x) for x in info["data_offsets"])
        dtype, shape = info["dtype"], [int(n) for n in info["shape"]]
        width = _DTYPE_BYTES.get(dtype) or _SUB_BYTE_DTYPES.get(dtype)
        if width is None:
            raise ValueError(f"tensor {name!r} has unknown dtype {dtype!r}")
        if end - start != math.ceil(math.prod(shape) * width):
            raise ValueError(f"tensor {name!r} ({dtype} {shape}) spans {end - start} bytes")
        spans.append((start, end, name))
    position = 0
    for start, end, name in sorted(spans):
        if start != position:
            raise ValueError(
                f"tensor {name!r} starts at byte {start}, the tensor before it ends at {position}"
            )
        position = end
    return position


def _pickle_digest(path: Path) -> str:
    with path.open("rb") as f:
        magic = f.read(4)
        if magic == b"PK\x03\x04":  # a zip: torch.save's format since torch 1.6
            try:
                with zipfile.ZipFile(f) as archive:
                    members = [(i.filename, i.file_size, i.CRC) for i in archive.infolist()]
            except (zipfile.BadZipFile, OSError, ValueError) as exc:
                raise _Unusable(f"a damaged torch zip, truncated? ({exc})") from None
            return hashlib.sha256(json.dumps(members).encode()).hexdigest()
        if magic[:1] != b"\x80":  # every pickle of protocol 2 or later starts with PROTO
            raise _Unusable("neither a torch zip nor a pickle")
        return _sampled_digest(f, 0, path.stat().st_size)


def _listed_shards(directory: Path, indexes: list[Path]) -> tuple[set[str], list[str]]:
    """The shards the ``indexes`` list, and a problem for each index that is unreadable or lists a
    shard the directory lacks."""
    listed: set[str] = set()
    problems = []
    for index in indexes:
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            problems.append(f"{index.name}: not a readable weight index ({type(exc).__name__}: {exc})")
            continue
        listed.update(names)
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            problems.append(
                f"{index.name} lists {len(names)} shard(s), {len(missing)} missing "
                f"({', '.join(missing[:_SHOWN])}{', ...' if len(missing) > _SHOWN else ''})"
            )
    return listed, problems
