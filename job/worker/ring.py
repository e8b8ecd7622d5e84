"""Shared-memory ring between the TP rank-0 worker (writer) and the driver (reader).

One slot holds one scheduler step: hidden states ``[tokens, L, H]`` in the
stored dtype (plus FP8 scales), the step's input ids and positions (to verify
alignment), a per-token finite flag, and a JSON header naming the requests in
batch order. Large tensors never travel through RPC or pickling: the worker
copies device -> (pinned) shared memory, the driver writes from that memory
straight into shard files, then releases the slot.

Control words (int64, separate cache lines): ``published`` = steps the worker
has made visible (slot = step % slots); ``released`` = steps the driver is
done with. The worker only reuses a slot once ``released`` has passed it.
"""

from __future__ import annotations

import contextlib
import errno
import json
import mmap
import os
import shutil
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import Any

import torch

from job.errors import ConfigError
from job.hidden_dtype import SCALE_BYTES, HiddenDtype, hidden_dtype

_CONTROL_BYTES = 4096
_PUBLISHED, _RELEASED, _ERROR = 0, 64, 128
# A step header names its requests in batch order: JSON [request id, tokens] pairs.
_HEADER_BYTES_PER_REQUEST = 64


def _align(n: int, to: int = 4096) -> int:
    return (n + to - 1) // to * to


# Generation requests' ids begin with this (sample ids cannot: it is a control character). A step
# is captured and published only when it schedules an extraction request: the driver counts the
# steps it expects the same way.
GENERATION_PREFIX = "\x1fgen:"
# A generation request id is the prefix, the sample id, "#" and the turn number.
GENERATION_ID_EXTRA_BYTES = len(GENERATION_PREFIX) + 8


def captured_step(scheduled: dict[str, int]) -> bool:
    """Whether the worker ships a step that scheduled ``scheduled`` (request id -> tokens)."""
    return any(
        count and not request_id.startswith(GENERATION_PREFIX) for request_id, count in scheduled.items()
    )


def header_bytes(max_requests: int, max_request_id_bytes: int) -> int:
    """Room for one step's header: every request's id (JSON-escaped, up to 6 bytes a byte) and count."""
    return 4096 + max_requests * (_HEADER_BYTES_PER_REQUEST + 6 * max_request_id_bytes)


@dataclass(frozen=True)
class RingSpec:
    path: str
    slots: int
    max_tokens: int
    num_layers: int
    hidden_size: int
    dtype_name: str  # a HiddenDtype's name: how rows are stored
    header_bytes: int

    @property
    def dtype(self) -> HiddenDtype:
        return hidden_dtype(self.dtype_name)

    @property
    def fields(self) -> dict[str, tuple[int, int]]:
        """name -> (offset within a slot, size in bytes)."""
        t, layers, dtype = self.max_tokens, self.num_layers, self.dtype
        sizes = [
            ("header", self.header_bytes),
            ("rows", t * layers * self.hidden_size * dtype.itemsize),
            ("scales", t * layers * SCALE_BYTES if dtype.scaled else 0),
            ("input_ids", t * 4),
            ("positions", t * 4),
            ("finite", t),
        ]
        # Every field starts on a page: the driver writes rows from the slot straight into shard
        # files with O_DIRECT, which needs block-aligned memory (a header of any size included).
        out, pos = {}, 0
        for name, size in sizes:
            out[name] = (pos, size)
            pos = _align(pos + size)
        return out

    @property
    def slot_bytes(self) -> int:
        offset, size = self.fields["finite"]
        return _align(offset + size)

    @property
    def total_bytes(self) -> int:
        return _CONTROL_BYTES + self.slots * self.slot_bytes

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _reserve(fd: int, spec: RingSpec) -> None:
    """Allocate the whole ring now: shared memory that runs out under a page fault is a SIGBUS in
    the middle of a step; this way it is an error at start-up (a deployment setting: exit 2)."""
    try:
        os.posix_fallocate(fd, 0, spec.total_bytes)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return
        os.unlink(spec.path)
        directory = os.path.dirname(spec.path)
        free = shutil.disk_usage(directory).free
        raise ConfigError(
            f"the capture ring needs {spec.total_bytes:,} bytes in {directory}, which has {free:,} free: "
            "give the container more shared memory (docker --shm-size, a memory-backed emptyDir at "
            "/dev/shm) or lower backend.vllm.max_num_batched_tokens / backend.vllm.capture_slots"
        ) from None


@dataclass
class SlotViews:
    rows: torch.Tensor  # [max_tokens, L, H] in the stored dtype
    scales: torch.Tensor | None  # [max_tokens, L] float32
    input_ids: torch.Tensor  # [max_tokens] int32
    positions: torch.Tensor  # [max_tokens] int32
    finite: torch.Tensor  # [max_tokens] uint8
    header: memoryview


class Ring:
    """Either side's view of the ring file (created by the driver)."""

    def __init__(self, spec: RingSpec, create: bool) -> None:
        self.spec = spec
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
        fd = os.open(spec.path, flags, 0o600)
        try:
            if create:
                os.ftruncate(fd, spec.total_bytes)
                _reserve(fd, spec)
            self._mmap = mmap.mmap(fd, spec.total_bytes, mmap.MAP_SHARED)
        finally:
            os.close(fd)
        self.buffer = torch.frombuffer(self._mmap, dtype=torch.uint8)
        self._control = memoryview(self._mmap)[:_CONTROL_BYTES]
        self.slots = [self._views(i) for i in range(spec.slots)]

    @classmethod
    def create(cls, directory: str | None, **spec_fields: Any) -> Ring:
        base = directory or ("/dev/shm" if os.path.isdir("/dev/shm") else tempfile.gettempdir())
        path = os.path.join(base, f"eagle3-capture-{os.getpid()}-{os.urandom(4).hex()}")
        return cls(RingSpec(path=path, **spec_fields), create=True)

    def _views(self, index: int) -> SlotViews:
        spec = self.spec
        base = _CONTROL_BYTES + index * spec.slot_bytes

        def field(name: str) -> torch.Tensor:
            offset, size = spec.fields[name]
            return self.buffer[base + offset : base + offset + size]

        scales = field("scales")
        header_offset, header_size = spec.fields["header"]
        return SlotViews(
            rows=field("rows")
            .view(spec.dtype.torch)
            .view(spec.max_tokens, spec.num_layers, spec.hidden_size),
            scales=scales.view(torch.float32).view(spec.max_tokens, spec.num_layers)
            if scales.numel()
            else None,
            input_ids=field("input_ids").view(torch.int32),
            positions=field("positions").view(torch.int32),
            finite=field("finite"),
            header=memoryview(self._mmap)[base + header_offset : base + header_offset + header_size],
        )

    # control words ---------------------------------------------------------
    def _get(self, offset: int) -> int:
        return struct.unpack_from("<q", self._control, offset)[0]

    def _set(self, offset: int, value: int) -> None:
        struct.pack_into("<q", self._control, offset, value)

    @property
    def published(self) -> int:
        return self._get(_PUBLISHED)

    @property
    def released(self) -> int:
        return self._get(_RELEASED)

    def set_released(self, value: int) -> None:
        self._set(_RELEASED, value)

    @property
    def worker_error(self) -> str | None:
        length = self._get(_ERROR)
        if not length:
            return None
        return bytes(self._control[_ERROR + 8 : _ERROR + 8 + length]).decode(errors="replace")

    def report_error(self, message: str) -> None:
        data = message.encode()[: _CONTROL_BYTES - _ERROR - 8]
        self._control[_ERROR + 8 : _ERROR + 8 + len(data)] = data
        self._set(_ERROR, len(data))

    # worker side -----------------------------------------------------------
    def wait_free(self, step: int, timeout_s: float) -> SlotViews:
        """The slot for ``step`` once the driver has released the step that used it."""
        deadline = time.monotonic() + timeout_s
        while step - self.released >= self.spec.slots:
            if time.monotonic() > deadline:
                raise TimeoutError(f"capture ring: slot for step {step} not released in {timeout_s:.0f} s")
            time.sleep(0.0005)
        return self.slots[step % self.spec.slots]

    def publish(self, step: int, header: dict[str, Any]) -> None:
        data = json.dumps(header).encode()
        slot = self.slots[step % self.spec.slots]
        if len(data) + 8 > len(slot.header):
            raise ValueError(f"capture ring: step header of {len(data)} bytes does not fit")
        struct.pack_into("<q", slot.header, 0, len(data))
        slot.header[8 : 8 + len(data)] = data
        self._set(_PUBLISHED, step + 1)

    # driver side -----------------------------------------------------------
    @property
    def slot_count(self) -> int:
        return self.spec.slots

    def slot(self, step: int) -> SlotViews:
        """The slot that holds (or will hold) ``step``."""
        return self.slots[step % self.spec.slots]

    def read_header(self, step: int) -> dict[str, Any]:
        slot = self.slot(step)
        (length,) = struct.unpack_from("<q", slot.header, 0)
        return json.loads(bytes(slot.header[8 : 8 + length]))

    def close(self, unlink: bool) -> None:
        self.slots = []
        self._control.release()
        del self.buffer
        # A view may still be alive somewhere; the mapping then goes with the process.
        with contextlib.suppress(BufferError):
            self._mmap.close()
        if unlink:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.spec.path)
