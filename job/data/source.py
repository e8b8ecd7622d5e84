"""List input files and read them as a stream of raw records with stable ids.

A record's id is its ``id`` field when it has one, else ``<file>:<n>`` where
``<file>`` is the path relative to ``data.path`` and ``n`` is the 1-based line
number (JSONL) or the 0-based row number (Parquet). Both are stable across runs.

Files: ``.jsonl``, ``.jsonl.gz``, ``.jsonl.zst`` and ``.parquet``, suffixes in any
case. In a directory, everything else is skipped and named (``SkippedInput``,
logged as ``input_files_skipped``): other suffixes, hidden files and directories,
links to directories, and this job's own output directories (a directory holding
``manifest.json`` or ``.lock``), which would otherwise be read back as input.

What one record can do is bounded, so no record crashes the run or sets its memory:

* a JSONL line over ``max_record_bytes`` is rejected without being held (it is
  read through in 1 MiB pieces);
* JSON is parsed by orjson (no RecursionError), integers of any size kept exact
  (job.data.exact_json): invalid UTF-8, lone surrogates (``"\\udc80"``) and
  NaN/Infinity are malformed JSON, a rejection naming the line; nesting deeper than
  ``MAX_DEPTH`` (64) levels is rejected too;
* an ``id`` must be a non-empty string or an integer, at most ``MAX_ID_BYTES`` of
  UTF-8; anything else rejects the record under its ``<file>:<n>`` id;
* ``\\n``, ``\\r\\n`` and a lone ``\\r`` all end a line (JSON strings cannot hold a
  raw CR, so splitting on it never cuts a record), and a UTF-8 byte order mark
  at the start of a file is skipped;
* a ``.jsonl`` file that is a JSON document rather than JSON Lines (its first line
  opens an array, or is a lone ``{``), or UTF-16/UTF-32 text (a byte order mark, or NUL
  bytes in its first line), is a file-level error naming the file: read line by line it
  would yield nothing but rejections;
* a line that ends inside a JSON string, completed into one JSON object by the lines
  after it (a raw line break in a string), is one rejection naming those lines under the
  record's id, not one malformed record per line;
* a compressed file that ends inside its compressed data (gzip member, zstd frame) is a
  file-level error naming the file; concatenated gzip members and zstd frames are read
  one after another.

A file is read as it was fingerprinted at start (``data_fingerprint``), never further: a local
file only up to the size it had then (what is appended later is in no output, and a
``input_file_grew`` warning says so), its bytes checked against the fingerprint's CRC64NVME as
they are read (a file changed in place is an error naming it, exit 2); an S3 object only in
the version (ETag) listed, a replaced one an error naming it.

Parquet rows are read in batches of about ``PARQUET_BATCH_BYTES`` (from the row
groups' sizes) rather than a fixed row count, so large rows do not pile up. A map column
(Spark's ``list<map<string,string>>`` messages) is read as objects, as a struct column is.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import os
import re
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from awscrt.checksums import crc64nvme

from job.checksum import encode as encode_crc
from job.data import exact_json
from job.errors import ConfigError
from job.settings import config_dir, path_problem
from job.storage import connect_transport, uri_scheme
from job.storage.transport import ObjectChanged, ObjectInfo

BUILTIN_EXAMPLES = "builtin:examples"
# Lower case; names are matched case-insensitively.
DATA_SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".parquet")
DEFAULT_MAX_RECORD_BYTES = 64 * 1024**2
MAX_ID_BYTES = 512
# Deeper records are rejected: the tokenizer processes, the templates' tojson and repr all
# recurse, and Python's recursion limit (1000) is below orjson's (1024).
MAX_DEPTH = 64
PARQUET_BATCH_BYTES = 64 * 1024**2
READ_CHUNK = 1024**2
# Compressed bytes fed to zstd at once: a zstd block expands at most ~32768-fold, so one
# piece decompresses to at most 32 MiB whatever the file holds.
_ZSTD_PIECE = 1024
_CRC_BUFFER = 8 * 1024**2
_LINE_END = re.compile(rb"\r\n|\r|\n")
_BOM = b"\xef\xbb\xbf"
# Names of what a job run writes into an index directory (job.storage): a directory
# holding one of them is an output, never input.
_OUTPUT_MARKERS = ("manifest.json", ".lock")
_SKIP_LOG_LIMIT = 100  # names listed in one log event; the count is always complete


@dataclass(frozen=True)
class InputFile:
    name: str  # relative to data.path (the file name when data.path is a file)
    size: int
    open: Callable[[], IO[bytes]]
    location: str  # for messages
    # What the data fingerprint takes from the content: the CRC64NVME of a local file's
    # bytes, the ETag of an S3 object; None: name and size only.
    content_id: str | None = None


@dataclass(frozen=True)
class SkippedInput:
    name: str  # relative to data.path; a directory's name ends with "/"
    reason: str


@dataclass(frozen=True)
class InputListing:
    files: list[InputFile]
    skipped: list[SkippedInput] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Record:
    sample_id: str
    value: dict[str, Any] | None  # None when the record could not be parsed
    error: str | None
    bytes_done: int  # input bytes consumed so far, for progress
    size: int = 0  # bytes of the raw record (JSONL line; Parquet: an estimate)
    # The id is the record's place (``<file>:<n>``), not an ``id`` field: another record's explicit
    # id equal to it is reported as that collision.
    generated_id: bool = True


def is_data_file(name: str) -> bool:
    return name.lower().endswith(DATA_SUFFIXES)


def list_input_files(path: str) -> list[InputFile]:
    """The data files under ``path`` in a stable (sorted) order; the files skipped
    in a directory are logged (``input_files_skipped``)."""
    listing = scan_input(path)
    if listing.skipped:
        log_skipped(listing.skipped)
    return listing.files


def log_skipped(skipped: list[SkippedInput]) -> None:
    from job.logs import get_logger

    get_logger().warning(
        "input_files_skipped",
        count=len(skipped),
        skipped=[{"name": s.name, "reason": s.reason} for s in skipped[:_SKIP_LOG_LIMIT]],
        listed=min(len(skipped), _SKIP_LOG_LIMIT),
    )


def scan_input(path: str) -> InputListing:
    """The data files under ``path`` and, for a directory, what was skipped and why."""
    if not path.strip():
        raise ConfigError(
            "data.path is empty (an unset variable in --data.path=$VAR?); set it to a JSONL or "
            "Parquet file, a directory of them, or an s3:// URI"
        )
    if uri_scheme(path) is not None:
        return _list_objects(path)
    root = config_dir() / "examples" if path == BUILTIN_EXAMPLES else Path(path).expanduser()
    skipped: list[SkippedInput] = []
    if root.is_file():
        if not is_data_file(root.name):
            raise ConfigError(f"data.path: {_printable(str(root))} is not a {_SUFFIX_LIST} file")
        candidates = [(root.name, root)]
    elif root.is_dir():
        candidates = _walk(root, skipped)
        if not candidates:
            raise ConfigError(
                f"data.path: no {_SUFFIX_LIST} files under {_printable(str(root))}{_skipped_summary(skipped)}"
            )
    else:
        raise ConfigError(f"data.path: {_printable(path)} {path_problem(root)}")
    files = []
    for name, p in candidates:
        if not _encodable(name):
            raise ConfigError(
                f"data.path: the file name {_printable(name)} is not valid UTF-8; rename it "
                "(sample ids are made from file names)"
            )
        try:
            size = p.stat().st_size
            crc = _file_crc(p, size)
        except OSError as exc:
            raise ConfigError(f"data.path: cannot read {_printable(str(p))}: {exc.strerror}") from None
        opener = lambda p=p, size=size, crc=crc: _FingerprintedFile(p, size, crc)  # noqa: E731
        files.append(InputFile(name, size, opener, str(p), "crc64nvme:" + crc))
    return InputListing(files, skipped)


_SUFFIX_LIST = "/".join(DATA_SUFFIXES)


def _walk(root: Path, skipped: list[SkippedInput]) -> list[tuple[str, Path]]:
    found = []
    for directory, dirnames, filenames in os.walk(root):
        base = Path(directory)
        rel = base.relative_to(root).as_posix()
        prefix = "" if rel == "." else rel + "/"
        if base != root and any(m in filenames for m in _OUTPUT_MARKERS):
            skipped.append(
                SkippedInput(
                    _printable(prefix),
                    "an output directory of this job (it holds manifest.json or .lock): not read as input",
                )
            )
            dirnames.clear()
            continue
        for name in sorted(dirnames):
            if name.startswith("."):
                hidden = _printable(prefix + name + "/")
                skipped.append(SkippedInput(hidden, "hidden directory: not searched"))
            elif (base / name).is_symlink():
                skipped.append(
                    SkippedInput(_printable(prefix + name + "/"), "link to a directory: not followed")
                )
        dirnames[:] = sorted(n for n in dirnames if not n.startswith(".") and not (base / n).is_symlink())
        for name in filenames:
            reason = _skip_reason(name, base / name)
            if reason is None:
                found.append((prefix + name, base / name))
            else:
                skipped.append(SkippedInput(_printable(prefix + name), reason))
    skipped.sort(key=lambda s: s.name)
    return sorted(found)


def _skip_reason(name: str, path: Path) -> str | None:
    lower = name.lower()
    if name.startswith("."):
        return "hidden file"
    if not is_data_file(name):
        if lower.endswith(".json"):
            return (
                "a .json file is not read: name a JSON Lines file .jsonl; convert a JSON array "
                "with jq -c '.[]' FILE.json > FILE.jsonl"
            )
        if lower.endswith((".gz", ".zst", ".bz2", ".xz", ".zip", ".tar")):
            return "compressed file not read: only .jsonl.gz and .jsonl.zst are"
        return f"not a data file ({_SUFFIX_LIST})"
    if not path.is_file():
        return f"not read: it {path_problem(path)}"
    return None


def _skipped_summary(skipped: list[SkippedInput]) -> str:
    if not skipped:
        return ""
    shown = "; ".join(f"{s.name}: {s.reason}" for s in skipped[:5])
    more = f"; and {len(skipped) - 5} more" if len(skipped) > 5 else ""
    return f" (skipped {shown}{more})"


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _printable(text: str) -> str:
    """``text`` with anything UTF-8 cannot hold (surrogates from undecodable file names) escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _file_crc(path: Path, size: int) -> str:
    """CRC64NVME of a file's first ``size`` bytes (what it held when its size was taken), read
    through one reused buffer: no mapping, so the pages read do not count in this process's RSS
    (its peak is what a pod is sized by)."""
    crc = 0
    buffer = bytearray(_CRC_BUFFER)
    view = memoryview(buffer)
    with path.open("rb", buffering=0) as f:
        left = size
        while left and (n := f.readinto(view[: min(left, _CRC_BUFFER)])):
            crc = crc64nvme(view[:n], crc)
            left -= n
        # One byte more, not fingerprinted: a file whose reads fail although its size says
        # there is nothing to read (/proc's report 0) fails here, before the output is touched.
        f.readinto(view[:1])
    return encode_crc(crc)


class _FingerprintedFile(io.RawIOBase):
    """A local data file as fingerprinted at start: its first ``size`` bytes, no more. Read from
    its start to its end in order (JSONL, compressed or not), its bytes must have the
    fingerprint's CRC64NVME; a reader that seeks (Parquet) is held to the size alone."""

    def __init__(self, path: Path, size: int, crc: str) -> None:
        self._path, self._size, self._crc = path, size, crc
        self._file = path.open("rb", buffering=0)
        self._pos = 0
        self._running: int | None = 0  # CRC64NVME of bytes [0, _pos); None once read out of order
        self._ended = False

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: self._size}[whence]
        target = min(max(0, base + offset), self._size)
        if target != self._pos:
            self._running = None
            self._pos = self._file.seek(target)
        return self._pos

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self._size - self._pos)
        n = self._file.readinto(view[:wanted]) or 0
        if wanted and not n:
            raise ConfigError(
                f"data.path: {_printable(str(self._path))} shrank while this run read it: it ended at byte "
                f"{self._pos} of the {self._size} it had when the run started. Let whatever writes it "
                "finish, then run again on a new output.uri"
            )
        if self._running is not None:
            self._running = crc64nvme(view[:n], self._running)
        self._pos += n
        if self._pos == self._size and not self._ended:
            self._ended = True
            self._check_end()
        return n

    def _check_end(self) -> None:
        where = _printable(str(self._path))
        if self._running is not None and (now := encode_crc(self._running)) != self._crc:
            raise ConfigError(
                f"data.path: {where} changed while this run read it: its first {self._size} bytes have "
                f"CRC64NVME {now}, {self._crc} when the run started, so samples from both versions may "
                "be in the output. Let whatever writes it finish, then run again on a new output.uri"
            )
        grown = os.fstat(self._file.fileno()).st_size
        if grown > self._size:
            from job.logs import get_logger

            get_logger().warning(
                "input_file_grew",
                file=where,
                read_bytes=self._size,
                size_now=grown,
                note="only the bytes it held when the run started were read (its fingerprint); what was "
                "added is in no output, and a run on this output.uri with the grown file is refused",
            )

    def close(self) -> None:
        self._file.close()
        super().close()


def _list_objects(uri: str) -> InputListing:
    """The data objects at ``uri`` (one object, or every one under the prefix), sorted; their
    ETags make the content part of the data fingerprint."""
    transport, prefix = connect_transport(uri, "data.path")
    found: list[tuple[str, ObjectInfo]] = []
    skipped: list[SkippedInput] = []
    if is_data_file(prefix) and (info := transport.head(prefix)) is not None:
        found.append((prefix.rsplit("/", 1)[-1], info))
    if not found:
        base = f"{prefix}/" if prefix else ""
        for info in transport.list(base):
            name = info.key[len(base) :]
            if is_data_file(name):
                found.append((name, info))
            else:
                skipped.append(SkippedInput(_printable(name), f"not a {_SUFFIX_LIST} object: not read"))
    if not found:
        raise ConfigError(f"data.path: no {_SUFFIX_LIST} objects at {uri}{_skipped_summary(skipped)}")
    files = [
        InputFile(
            name,
            info.size,
            (lambda info=info: transport.open_reader(info)),
            transport.url(info.key),
            f"etag:{info.version}",
        )
        for name, info in sorted(found, key=lambda item: item[0])
    ]
    return InputListing(files, skipped)


def data_fingerprint(files: list[InputFile]) -> str:
    """Names, sizes and content ids: a same-size edit of a local file changes it."""
    digest = hashlib.sha256()
    for f in files:
        digest.update(f"{f.name}\0{f.size}\0{f.content_id or ''}\n".encode())
    return "sha256:" + digest.hexdigest()


def read_records(
    files: list[InputFile], max_record_bytes: int = DEFAULT_MAX_RECORD_BYTES
) -> Iterator[Record]:
    done = 0
    for f in files:
        try:
            raw = f.open()
        except OSError as exc:
            raise ConfigError(f"data: cannot open {f.location}: {exc}") from None
        with raw:
            try:
                if f.name.lower().endswith(".parquet"):
                    records = _read_parquet(f, raw)
                else:
                    records = _read_jsonl(f, raw, max_record_bytes)
                for record, consumed in records:
                    yield Record(
                        record.sample_id,
                        record.value,
                        record.error,
                        done + consumed,
                        record.size,
                        record.generated_id,
                    )
            except ObjectChanged:
                raise ConfigError(
                    f"data.path: {f.location} was replaced while this run read it (another version than "
                    "the one listed at start), so samples from both versions may be in the output. Let "
                    "whatever writes it finish, then run again on a new output.uri"
                ) from None
            except EOFError:
                raise ConfigError(
                    f"data: cannot decompress {f.location}: it ends inside its compressed data, so it "
                    "is truncated (an interrupted copy or download?); copy or write it again"
                ) from None
            except _DECOMPRESSION_ERRORS as exc:
                raise ConfigError(f"data: cannot decompress {f.location}: {exc}") from None
            except OSError as exc:
                raise ConfigError(f"data: cannot read {f.location}: {exc}") from None
        done += f.size


def _zstd_error() -> type[Exception]:
    import zstandard

    return zstandard.ZstdError


# EOFError (input ending inside a gzip member or zstd frame) is caught before these.
_DECOMPRESSION_ERRORS: tuple[type[BaseException], ...] = (gzip.BadGzipFile, zlib.error, _zstd_error())


def _decoded(f: InputFile, raw: IO[bytes]) -> IO[bytes]:
    lower = f.name.lower()
    if lower.endswith(".gz"):
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if lower.endswith(".zst"):
        return io.BufferedReader(_ZstdFrames(raw), READ_CHUNK)
    return raw


class _ZstdFrames(io.RawIOBase):
    """The zstd frames of ``raw`` decompressed one after another (``zstd`` and many writers
    concatenate frames); input that ends inside a frame raises EOFError, as gzip does.
    zstandard's own stream_reader ends quietly there, which would lose the rest unsaid."""

    def __init__(self, raw: IO[bytes]) -> None:
        import zstandard

        self._raw = raw
        self._dctx = zstandard.ZstdDecompressor()
        self._frame = self._dctx.decompressobj()
        self._in_frame = False  # the current frame has had input but has not ended
        self._out = memoryview(b"")  # decompressed, not yet returned

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:
        while not self._out:
            if not self._decompress_more():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress_more(self) -> bool:
        """Decompress the next piece of input; False at the end of the input."""
        piece = b""
        if self._frame.eof:  # the frame ended: what follows it starts the next one
            piece = self._frame.unused_data
            self._frame = self._dctx.decompressobj()
        piece = piece or self._raw.read(_ZSTD_PIECE)
        if not piece:
            if self._in_frame:
                raise EOFError("zstd input ended inside a frame")
            return False
        self._out = memoryview(self._frame.decompress(piece))
        self._in_frame = not self._frame.eof
        return True


def _record(value: dict[str, Any], fallback: str, size: int) -> Record:
    """The record under its ``id`` or, when it has none, under ``fallback`` (its place); rejected
    under ``fallback`` when its ``id`` field cannot be an id."""
    rid = value.get("id")
    if rid is None or rid == "":
        return Record(fallback, value, None, 0, size)
    error = _id_error(rid)
    if error is not None:
        return Record(fallback, None, error, 0, size)
    return Record(str(rid), value, None, 0, size, generated_id=False)


def _id_error(rid: Any) -> str | None:
    """Why an ``id`` field cannot name a sample, or None."""
    if isinstance(rid, bool) or not isinstance(rid, str | int):
        return f"'id' must be a string or an integer, got {type(rid).__name__}"
    rid = str(rid)
    try:
        encoded = rid.encode("utf-8")
    except UnicodeEncodeError:
        return f"'id' {_printable(rid)[:80]!r} is not valid Unicode (it holds a lone surrogate)"
    if len(encoded) > MAX_ID_BYTES:
        return f"'id' is {len(encoded)} bytes long; at most {MAX_ID_BYTES} are allowed"
    return None


def _lines(stream: IO[bytes], limit: int) -> Iterator[tuple[bytes | None, int]]:
    """``(line, length)`` for each line, its end not included in ``line`` but in
    ``length``; ``line`` is None for a line over ``limit`` bytes, which is not held."""
    pending = bytearray()
    dropped = -1  # bytes of an over-long line read so far; -1: none
    while True:
        chunk = stream.read(READ_CHUNK)
        if not chunk:
            break
        while chunk.endswith(b"\r"):  # a CR at the edge: is it half of a CRLF?
            more = stream.read(1)
            if not more:
                break
            chunk += more
        start = 0
        for end in _LINE_END.finditer(chunk):
            piece = chunk[start : end.start()]
            length = end.end() - start  # this chunk's part of the line, its end included
            if dropped >= 0:
                yield None, dropped + length
                dropped = -1
            elif pending:
                whole = len(pending) + length
                yield (None if len(pending) + len(piece) > limit else bytes(pending) + piece), whole
                pending.clear()
            else:
                yield (None if len(piece) > limit else piece), length
            start = end.end()
        rest = chunk[start:]
        if dropped >= 0:
            dropped += len(rest)
        elif len(pending) + len(rest) > limit:
            dropped = len(pending) + len(rest)
            pending.clear()
        else:
            pending += rest
    if dropped >= 0:
        yield None, dropped
    elif pending:
        yield bytes(pending), len(pending)


def _not_json_lines(line: bytes, location: str) -> ConfigError | None:
    """A file-level error when the first non-blank line shows a JSON document, not JSON Lines."""
    head = line.strip()
    if head.startswith(b"["):
        what = "a JSON array"
    elif head == b"{":
        what = "pretty-printed JSON (an object spread over several lines)"
    else:
        return None
    return ConfigError(
        f"data: {location} is {what}, not JSON Lines (one JSON object per line); convert it, "
        "e.g. jq -c '.[]' FILE > FILE.jsonl for an array, jq -c . FILE > FILE.jsonl for objects"
    )


# Longest first: UTF-32-LE's mark begins with UTF-16-LE's.
_WIDE_BOMS = (
    (b"\xff\xfe\x00\x00", "UTF-32-LE"),
    (b"\x00\x00\xfe\xff", "UTF-32-BE"),
    (b"\xff\xfe", "UTF-16-LE"),
    (b"\xfe\xff", "UTF-16-BE"),
)


def _not_utf8(line: bytes, location: str) -> ConfigError | None:
    """A file-level error when the first non-blank line is UTF-16 or UTF-32 text (a byte order
    mark, or NUL bytes, which JSON text never holds): read as UTF-8, every line would be rejected."""
    bom = next(((mark, name) for mark, name in _WIDE_BOMS if line.startswith(mark)), None)
    if bom is not None:
        mark, encoding = bom
        how, source = f"byte order mark {mark.hex(' ').upper()}", encoding[:6]  # iconv reads the mark
    elif b"\x00" in line[:64]:
        head = line[:64]
        width = "32" if head.count(0) * 4 >= len(head) * 3 else "16"
        order = "BE" if head[0] == 0 else "LE"  # ASCII's zero byte first or last
        encoding, how = f"UTF-{width}-{order}", "no byte order mark; NUL bytes between its characters"
        source = f"UTF-{width}{order}"
    else:
        return None
    return ConfigError(
        f"data: {location} is {encoding} text ({how}), not UTF-8: JSON Lines must be UTF-8, and read "
        f"as UTF-8 every line of it would be rejected; convert it, e.g. iconv -f {source} -t UTF-8 "
        "FILE > FILE.utf8.jsonl"
    )


_NumberedLine = tuple[int, tuple[bytes | None, int]]


class _Lookahead:
    """Numbered lines that can be given back (a record found not to continue on them)."""

    def __init__(self, lines: Iterator[_NumberedLine]) -> None:
        self._lines = lines
        self._returned: list[_NumberedLine] = []  # given back, last first

    def __iter__(self) -> Iterator[_NumberedLine]:
        return self

    def __next__(self) -> _NumberedLine:
        return self._returned.pop() if self._returned else next(self._lines)

    def give_back(self, lines: list[_NumberedLine]) -> None:
        self._returned.extend(reversed(lines))


# A JSON string's body: anything but a quote or backslash, or an escape. Possessive (Python 3.11):
# greedy repeats would keep a backtracking point per step, gigabytes for a 40 MB line.
_STRING_REST = re.compile(rb'(?:[^"\\]++|\\.)*+"', re.DOTALL)
_OUTSIDE_STRINGS = re.compile(rb'(?:[^"]++|"(?:[^"\\]++|\\.)*+")*+', re.DOTALL)


def _ends_in_string(piece: bytes, inside: bool) -> bool:
    """Whether JSON text ``piece`` ends inside a string, ``inside`` saying whether it starts in one."""
    start = 0
    if inside:
        closed = _STRING_REST.match(piece)
        if closed is None:
            return True
        start = closed.end()
    outside = _OUTSIDE_STRINGS.match(piece, start)
    return outside is not None and outside.end() < len(piece)


def _record_over_lines(
    first: bytes, lines: _Lookahead, limit: int
) -> tuple[dict[str, Any], list[_NumberedLine]] | None:
    """When ``first`` ends inside a JSON string and the lines after it complete one JSON object
    (a writer that left line breaks in strings unescaped): that object and the lines it took.
    Otherwise None, and every line looked at is given back."""
    if not _ends_in_string(first, False):
        return None
    taken: list[_NumberedLine] = []
    parts, size, inside = [first], len(first), True
    while inside:
        item = next(lines, None)
        if item is None:
            break
        taken.append(item)
        piece = item[1][0]
        if piece is None or size + len(piece) > limit or _json_object(piece) is not None:
            break  # too long to hold, or a record of its own
        parts.append(piece)
        size += len(piece) + 2
        inside = _ends_in_string(piece, inside)
    value = None if inside else _json_object(b"\\n".join(parts))  # each break escaped
    if value is None:
        lines.give_back(taken)
        return None
    return value, taken


def _json_object(text: bytes) -> dict[str, Any] | None:
    try:
        value = exact_json.loads(text)
    except exact_json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def _read_jsonl(f: InputFile, raw: IO[bytes], limit: int) -> Iterator[tuple[Record, int]]:
    stream = _decoded(f, raw)
    compressed = stream is not raw
    consumed = 0
    first = True
    lines = _Lookahead(enumerate(_lines(stream, limit), start=1))
    for lineno, (line, length) in lines:
        consumed += length
        # Progress counts file bytes: for compressed files, what was read of the file.
        position = raw.tell() if compressed else consumed
        fallback = f"{f.name}:{lineno}"
        if line is None:
            reason = (
                f"record is {length:,} bytes, over data.max_record_bytes ({limit:,}); not read. Raise "
                "data.max_record_bytes (memory grows with it) or split the record"
            )
            yield Record(fallback, None, reason, 0, length), position
            first = False
            continue
        if lineno == 1 and line.startswith(_BOM):
            line = line[len(_BOM) :]
        if not line.strip():
            continue  # blank lines are not samples
        if first:
            first = False
            error = _not_utf8(line, f.location) or _not_json_lines(line, f.location)
            if error is not None:
                raise error
        try:
            value = exact_json.loads(line)
        except exact_json.JSONDecodeError as exc:
            spread = _record_over_lines(line, lines, limit)
            if spread is None:
                yield Record(fallback, None, f"malformed JSON: {exc}", 0, length), position
                continue
            value, taken = spread
            length += sum(n for _, (_, n) in taken)
            consumed += sum(n for _, (_, n) in taken)
            position = raw.tell() if compressed else consumed
            reason = (
                f"a line break inside a JSON string: this record runs over lines {lineno}-{taken[-1][0]} "
                f"of {_printable(f.name)}, where JSON Lines needs one line per record; write line breaks "
                "in strings as \\n (a JSON library's writer does, e.g. json.dumps or jq -c)"
            )
            record = _record(value, fallback, length)
            yield Record(record.sample_id, None, reason, 0, length, record.generated_id), position
            continue
        if not isinstance(value, dict):
            reason = f"expected a JSON object, got {_json_type(value)}"
            yield Record(fallback, None, reason, 0, length), position
            continue
        if _nested_deeper(value, MAX_DEPTH):
            reason = f"JSON nested deeper than {MAX_DEPTH} levels"
            yield Record(fallback, None, reason, 0, length), position
            continue
        yield _record(value, fallback, length), position


def _nested_deeper(value: Any, limit: int) -> bool:
    """Whether ``value`` nests containers deeper than ``limit`` (checked without recursion)."""
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if depth > limit:
            return True
        children = item.values() if isinstance(item, dict) else item
        stack.extend((child, depth + 1) for child in children if isinstance(child, dict | list))
    return False


def _json_type(value: Any) -> str:
    return {list: "an array", str: "a string", int: "a number", float: "a number", bool: "a boolean"}.get(
        type(value), "null"
    )


def _read_parquet(f: InputFile, stream: IO[bytes]) -> Iterator[tuple[Record, int]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        source = stream if stream.seekable() else io.BytesIO(stream.read())
        parquet = pq.ParquetFile(source)
    except (pa.ArrowException, ValueError) as exc:
        raise ConfigError(f"data: {f.location} is not a readable Parquet file: {exc}") from None
    metadata = parquet.metadata
    rows_total = max(metadata.num_rows, 1)
    data_bytes = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    row_bytes = max(1, data_bytes // rows_total)
    batch_rows = max(1, min(512, PARQUET_BATCH_BYTES // row_bytes))
    row = 0
    try:
        for batch in parquet.iter_batches(batch_size=batch_rows):
            for value, error in _batch_rows(batch):
                row += 1
                consumed = f.size * row // rows_total
                fallback = f"{f.name}:{row - 1}"
                if error is not None:
                    yield Record(fallback, None, error, 0, row_bytes), consumed
                    continue
                yield _record(value, fallback, row_bytes), consumed
    except (pa.ArrowException, ValueError) as exc:
        raise ConfigError(f"data: cannot read {f.location} (Parquet) after row {row}: {exc}") from None


def _batch_rows(batch: Any) -> Iterator[tuple[dict[str, Any], None] | tuple[None, str]]:
    """The rows of a record batch as dicts; a row that does not convert to Python (invalid UTF-8
    in a string column, a key twice in one map) becomes an error for that row only. A map column
    (Spark writes ``list<map<string,string>>`` messages) gives dicts, as a struct column does:
    pyarrow's default gives a map as a list of key/value pairs."""
    try:
        rows = batch.to_pylist(maps_as_pydicts="strict")
    except (UnicodeDecodeError, ValueError, KeyError):
        rows = None
    if rows is not None:
        for value in rows:
            yield _without_nulls(value), None
        return
    for i in range(batch.num_rows):
        try:
            yield _without_nulls(batch.slice(i, 1).to_pylist(maps_as_pydicts="strict")[0]), None
        except (UnicodeDecodeError, ValueError) as exc:
            yield None, f"row cannot be read: {exc}"
        except KeyError as exc:  # pyarrow's message: "... duplicate keys are present (duplicate key was 'k')"
            yield None, f"row cannot be read: a map holds a key twice, so it is no object ({exc.args[0]})"


def _without_nulls(value: Any) -> Any:
    """``value`` without the null fields of its objects, at any depth. A struct column gives every
    row every field any row has, null where a row had none: a tool's ``properties`` or a call's
    ``arguments`` would reach the prompt with the other rows' keys as nulls. Parquet cannot tell
    such a null from one that was written, so a null field counts as absent. Lists keep their nulls."""
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    # An Arrow list holds one type: a list whose first non-null item is a scalar holds no objects.
    if isinstance(value, list) and isinstance(next((v for v in value if v is not None), None), dict | list):
        return [_without_nulls(v) for v in value]
    return value
