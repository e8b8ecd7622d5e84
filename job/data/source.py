"""List input files and read them as a stream of raw records with stable ids.

A record's id is its ``id`` field when it has one, else ``<file>:<n>`` where
``<file>`` is the path relative to ``data.path`` and ``n`` is the 1-based line
number (JSONL) or the 0-based row number (Parquet). Both are stable across runs.
"""

from __future__ import annotations

import hashlib
import io
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from job.errors import ConfigError
from job.settings import config_dir
from job.storage import connect_transport, uri_scheme
from job.storage.transport import ObjectInfo

BUILTIN_EXAMPLES = "builtin:examples"
DATA_SUFFIXES = (".jsonl", ".parquet")
# A sample id names the sample everywhere (shard headers, manifests, vLLM request ids, the
# capture ring's step headers, sized for it): longer ids are rejected.
MAX_SAMPLE_ID_BYTES = 1024


@dataclass(frozen=True)
class InputFile:
    name: str  # relative to data.path (the file name when data.path is a file)
    size: int
    open: Callable[[], IO[bytes]]
    location: str  # for messages


@dataclass(frozen=True, slots=True)
class Record:
    sample_id: str
    value: dict[str, Any] | None  # None when the record could not be parsed
    error: str | None
    bytes_done: int  # input bytes consumed so far, for progress


def list_input_files(path: str) -> list[InputFile]:
    """The data files under ``path`` in a stable (sorted) order."""
    if uri_scheme(path) is not None:
        return _list_objects(path)
    root = config_dir() / "examples" if path == BUILTIN_EXAMPLES else Path(path).expanduser()
    if root.is_file():
        if root.suffix not in DATA_SUFFIXES:
            raise ConfigError(f"data.path: {root} is not a .jsonl or .parquet file")
        candidates = [(root.name, root)]
    elif root.is_dir():
        candidates = sorted(
            (p.relative_to(root).as_posix(), p)
            for p in root.rglob("*")
            if p.is_file() and p.suffix in DATA_SUFFIXES
        )
        if not candidates:
            raise ConfigError(f"data.path: no .jsonl or .parquet files under {root}")
    else:
        raise ConfigError(f"data.path: {path} does not exist")
    files = []
    for name, p in candidates:
        try:
            size = p.stat().st_size
        except OSError as exc:
            raise ConfigError(f"data.path: cannot read {p}: {exc.strerror}") from None
        files.append(InputFile(name, size, (lambda p=p: p.open("rb")), str(p)))
    return files


def _list_objects(uri: str) -> list[InputFile]:
    """The data objects at ``uri`` (one object, or every one under the prefix), sorted."""
    transport, prefix = connect_transport(uri, "data.path")
    found: list[tuple[str, ObjectInfo]] = []
    if prefix.endswith(DATA_SUFFIXES) and (info := transport.head(prefix)) is not None:
        found.append((prefix.rsplit("/", 1)[-1], info))
    if not found:
        base = f"{prefix}/" if prefix else ""
        found = [(i.key[len(base) :], i) for i in transport.list(base) if i.key.endswith(DATA_SUFFIXES)]
    if not found:
        raise ConfigError(f"data.path: no .jsonl or .parquet objects at {uri}")
    return [
        InputFile(name, info.size, (lambda info=info: transport.open_reader(info)), transport.url(info.key))
        for name, info in sorted(found, key=lambda item: item[0])
    ]


def data_fingerprint(files: list[InputFile]) -> str:
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.size}\n".encode())
    return "sha256:" + digest.hexdigest()


def read_records(files: list[InputFile]) -> Iterator[Record]:
    done = 0
    for f in files:
        try:
            stream = f.open()
        except OSError as exc:
            raise ConfigError(f"data: cannot open {f.location}: {exc}") from None
        with stream:
            reader = _read_parquet if f.name.endswith(".parquet") else _read_jsonl
            try:
                for record, consumed in reader(f, stream):
                    yield Record(record.sample_id, record.value, record.error, done + consumed)
            except OSError as exc:
                raise ConfigError(f"data: cannot read {f.location}: {exc}") from None
        done += f.size


def _record_id(value: Any, fallback: str) -> str:
    if isinstance(value, dict):
        rid = value.get("id")
        if isinstance(rid, str) and rid:
            return rid
        if isinstance(rid, int) and not isinstance(rid, bool):
            return str(rid)
    return fallback


def _read_jsonl(f: InputFile, stream: IO[bytes]) -> Iterator[tuple[Record, int]]:
    consumed = 0
    for lineno, raw in enumerate(stream, start=1):
        consumed += len(raw)
        if not raw.strip():
            continue  # blank lines are not samples
        fallback = f"{f.name}:{lineno}"
        try:
            value = json.loads(raw)
        except UnicodeDecodeError:
            yield Record(fallback, None, "line is not valid UTF-8", 0), consumed
            continue
        except json.JSONDecodeError as exc:
            yield Record(fallback, None, f"malformed JSON: {exc.msg} at column {exc.colno}", 0), consumed
            continue
        if not isinstance(value, dict):
            yield Record(fallback, None, f"expected a JSON object, got {type(value).__name__}", 0), consumed
            continue
        yield Record(_record_id(value, fallback), value, None, 0), consumed


def _read_parquet(f: InputFile, stream: IO[bytes]) -> Iterator[tuple[Record, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = stream if stream.seekable() else io.BytesIO(stream.read())
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, ValueError) as exc:
        raise ConfigError(f"data: {f.location} is not a readable Parquet file: {exc}") from None
    rows_total = max(parquet.metadata.num_rows, 1)
    row = 0
    for batch in parquet.iter_batches(batch_size=512):
        for value in batch.to_pylist():
            row += 1
            consumed = f.size * row // rows_total
            yield Record(_record_id(value, f"{f.name}:{row - 1}"), value, None, 0), consumed
