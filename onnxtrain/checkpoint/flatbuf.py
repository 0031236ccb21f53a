"""A minimal FlatBuffers encoder and bounds-checked decoder (tables, strings, vectors, scalars).

Only what the checkpoint format needs, with no dependency on the ``flatbuffers`` package.
The encoder lays objects out front to back: the root offset and file identifier, then each
table (its vtable just before it) followed by the objects it points to. Every scalar is
aligned to its size from the start of the buffer, vectors of 8-byte scalars are 8-aligned
and byte vectors (tensor data) 16-aligned, so C++ readers that verify alignment accept it.
The decoder checks every offset against the buffer and raises :class:`FlatBufferError`.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

__all__ = [
    "MAX_SIZE", "Bytes", "FlatBufferError", "Scalar", "Scalars", "Str", "Table", "TableView", "Tables",
    "encode", "root_table",
]

MAX_SIZE = 2**31 - 1  # FlatBuffers offsets are 32 bit; C++ readers cap buffers below 2 GiB


class FlatBufferError(ValueError):
    """The bytes are not a well-formed FlatBuffer of the expected kind."""


# ---------------------------------------------------------------- values to encode

class Scalar:
    """An inline scalar field: ``fmt`` is a struct code (b B h H i I q Q f d ?)."""

    __slots__ = ("fmt", "value", "default")

    def __init__(self, fmt: str, value: Any, default: Any = 0) -> None:
        self.fmt, self.value, self.default = fmt, value, default


class Str:
    """A UTF-8 string (bytes are written as given)."""

    __slots__ = ("value",)

    def __init__(self, value: str | bytes) -> None:
        self.value = value.encode("utf-8") if isinstance(value, str) else bytes(value)


class Bytes:
    """A ``[ubyte]`` vector, its first byte aligned to ``align`` (a multiple of 4)."""

    __slots__ = ("data", "align")

    def __init__(self, data: Any, align: int = 16) -> None:
        self.data, self.align = memoryview(data).cast("B"), align


class Scalars:
    """A vector of scalars of one struct code (e.g. ``"q"`` for ``[int64]``)."""

    __slots__ = ("fmt", "values")

    def __init__(self, fmt: str, values: Sequence[Any]) -> None:
        self.fmt, self.values = fmt, list(values)


class Table:
    """A table: ``fields[i]`` is the value of field id ``i``, or None when absent."""

    __slots__ = ("fields",)

    def __init__(self, *fields: Field | None) -> None:
        self.fields = fields


class Tables:
    """A vector of tables."""

    __slots__ = ("items",)

    def __init__(self, items: Sequence[Table]) -> None:
        self.items = list(items)


Field = Scalar | Str | Bytes | Scalars | Table | Tables


def _is_default(f: Scalar) -> bool:
    """Whether ``f`` holds its default, so may be left out: -0.0 is not the default 0.0 (its sign would be
    lost), though the two compare equal."""
    if f.value != f.default:
        return False
    return not isinstance(f.value, float) or math.copysign(1.0, f.value) == math.copysign(1.0, f.default)


# ---------------------------------------------------------------- encoder

class _Writer:
    def __init__(self) -> None:
        self.buf = bytearray()

    def pad(self, align: int, extra: int = 0) -> None:
        """Zero-pad so that ``len(buf) + extra`` is a multiple of ``align``."""
        self.buf.extend(bytes(-(len(self.buf) + extra) % align))

    def table(self, t: Table) -> int:
        present = [(i, f) for i, f in enumerate(t.fields)
                   if f is not None and not (isinstance(f, Scalar) and _is_default(f))]
        n_slots = present[-1][0] + 1 if present else 0
        self.pad(2)
        vt_pos = len(self.buf)
        self.buf.extend(bytes(4 + 2 * n_slots))
        self.pad(4)
        pos = len(self.buf)
        self.buf.extend(bytes(4))
        sized = [(struct.calcsize("<" + f.fmt) if isinstance(f, Scalar) else 4, i, f) for i, f in present]
        sized.sort(key=lambda e: -e[0])  # biggest first: least padding
        where: dict[int, int] = {}
        for size, i, _ in sized:
            self.pad(size)
            where[i] = len(self.buf)
            self.buf.extend(bytes(size))
        struct.pack_into("<HH", self.buf, vt_pos, 4 + 2 * n_slots, len(self.buf) - pos)
        for i, p in where.items():
            struct.pack_into("<H", self.buf, vt_pos + 4 + 2 * i, p - pos)
        struct.pack_into("<i", self.buf, pos, pos - vt_pos)
        for i, f in present:
            if isinstance(f, Scalar):
                struct.pack_into("<" + f.fmt, self.buf, where[i], f.value)
        for i, f in present:
            if not isinstance(f, Scalar):
                self.patch(where[i], self.child(f))
        return pos

    def patch(self, at: int, target: int) -> None:
        struct.pack_into("<I", self.buf, at, target - at)

    def child(self, f: Field) -> int:
        if isinstance(f, Table):
            return self.table(f)
        if isinstance(f, Str):
            self.pad(4)
            pos = len(self.buf)
            self.buf.extend(struct.pack("<I", len(f.value)) + f.value + b"\0")
            return pos
        if isinstance(f, Bytes):
            self.pad(f.align, extra=4)
            pos = len(self.buf)
            self.buf.extend(struct.pack("<I", len(f.data)))
            self.buf.extend(f.data)
            return pos
        if isinstance(f, Scalars):
            size = struct.calcsize("<" + f.fmt)
            self.pad(max(size, 4), extra=4)
            pos = len(self.buf)
            self.buf.extend(struct.pack(f"<I{len(f.values)}{f.fmt}", len(f.values), *f.values))
            return pos
        if isinstance(f, Tables):
            self.pad(4)
            pos = len(self.buf)
            self.buf.extend(struct.pack("<I", len(f.items)) + bytes(4 * len(f.items)))
            for k, item in enumerate(f.items):
                self.patch(pos + 4 + 4 * k, self.table(item))
            return pos
        raise TypeError(f"cannot encode {type(f).__name__} as a FlatBuffers field")


def encode(root: Table, identifier: bytes) -> bytearray:
    """Serialize ``root`` as a FlatBuffer carrying the 4-byte file ``identifier``."""
    if len(identifier) != 4:
        raise ValueError("a FlatBuffers file identifier has exactly 4 bytes")
    w = _Writer()
    w.buf.extend(bytes(4) + identifier)
    w.patch(0, w.table(root))
    w.pad(8)
    if len(w.buf) > MAX_SIZE:
        raise ValueError(f"FlatBuffer of {len(w.buf)} bytes exceeds the 2 GiB limit of 32-bit offsets")
    return w.buf


# ---------------------------------------------------------------- decoder

class TableView:
    """Read access to one table of a buffer; every accessor checks bounds."""

    __slots__ = ("buf", "pos", "vt", "vt_len", "size")

    def __init__(self, buf: memoryview, pos: int) -> None:
        self.buf, self.pos = buf, pos
        _need(buf, pos, 4, "table")
        if pos % 4:  # as FlatBuffers' verifier: every value at a multiple of its size
            raise FlatBufferError(f"the table at byte {pos} is not 4-byte aligned")
        self.vt = pos - _unpack("<i", buf, pos)
        _need(buf, self.vt, 4, "vtable")
        if self.vt % 2:
            raise FlatBufferError(f"the vtable at byte {self.vt} is not 2-byte aligned")
        self.vt_len, self.size = _unpack("<H", buf, self.vt), _unpack("<H", buf, self.vt + 2)
        if self.vt_len < 4 or self.vt_len % 2:
            raise FlatBufferError(f"bad vtable size {self.vt_len} at byte {self.vt}")
        _need(buf, self.vt, self.vt_len, "vtable")
        _need(buf, pos, self.size, "table")

    def _field(self, slot: int, size: int) -> int:
        """Absolute position of field ``slot`` (``size`` bytes inline), 0 when absent."""
        at = 4 + 2 * slot
        if at >= self.vt_len:
            return 0
        off = _unpack("<H", self.buf, self.vt + at)
        if off == 0:
            return 0
        if off + size > self.size:
            raise FlatBufferError(f"field {slot} of the table at byte {self.pos} lies outside it")
        if (self.pos + off) % size:
            raise FlatBufferError(f"field {slot} of the table at byte {self.pos} is not {size}-byte aligned")
        return self.pos + off

    def has(self, slot: int) -> bool:
        at = 4 + 2 * slot
        return at < self.vt_len and _unpack("<H", self.buf, self.vt + at) != 0

    def scalar(self, slot: int, fmt: str, default: Any = 0) -> Any:
        p = self._field(slot, struct.calcsize("<" + fmt))
        return _unpack("<" + fmt, self.buf, p) if p else default

    def _target(self, slot: int) -> int | None:
        p = self._field(slot, 4)
        return None if not p else p + _unpack("<I", self.buf, p)

    def _vector(self, slot: int, item: int) -> tuple[int, int] | None:
        """(position of the first element, length) of a vector field."""
        p = self._target(slot)
        if p is None:
            return None
        _need(self.buf, p, 4, "vector")
        if p % 4:
            raise FlatBufferError(f"the vector at byte {p} is not 4-byte aligned")
        n = _unpack("<I", self.buf, p)
        _need(self.buf, p + 4, n * item, "vector")
        return p + 4, n

    def string(self, slot: int) -> str | None:
        v = self._vector(slot, 1)
        if v is None:
            return None
        _need(self.buf, v[0] + v[1], 1, "string terminator")
        if self.buf[v[0] + v[1]] != 0:  # as FlatBuffers' verifier: a string ends with a NUL byte
            raise FlatBufferError(f"string field {slot} at byte {v[0]} is not NUL-terminated")
        try:
            return bytes(self.buf[v[0]:v[0] + v[1]]).decode("utf-8")
        except UnicodeDecodeError as e:
            raise FlatBufferError(f"string field {slot} is not UTF-8: {e}") from None

    def table(self, slot: int) -> TableView | None:
        p = self._target(slot)
        return None if p is None else TableView(self.buf, p)

    def tables(self, slot: int) -> list[TableView] | None:
        v = self._vector(slot, 4)
        if v is None:
            return None
        start, n = v
        return [TableView(self.buf, start + 4 * k + _unpack("<I", self.buf, start + 4 * k)) for k in range(n)]

    def bytes(self, slot: int) -> memoryview | None:
        v = self._vector(slot, 1)
        return None if v is None else self.buf[v[0]:v[0] + v[1]]

    def span(self, slot: int) -> tuple[int, int] | None:
        """(position in the buffer, length) of the bytes of vector field ``slot``; None when absent."""
        return self._vector(slot, 1)

    def scalars(self, slot: int, dtype: str) -> np.ndarray | None:
        """A vector of scalars as a read-only numpy array (``dtype`` like ``"<i8"``)."""
        dt = np.dtype(dtype)
        v = self._vector(slot, dt.itemsize)
        return None if v is None else np.frombuffer(self.buf, dt, v[1], v[0])


def root_table(data: bytes | bytearray | memoryview, identifier: bytes) -> TableView:
    """The root table of ``data`` after checking its file identifier."""
    buf = memoryview(data).cast("B")
    if len(buf) < 12:
        raise FlatBufferError(f"{len(buf)} bytes are too short for a FlatBuffer")
    if bytes(buf[4:8]) != identifier:
        raise FlatBufferError(f"file identifier is {bytes(buf[4:8])!r}, expected {identifier!r}")
    return TableView(buf, _unpack("<I", buf, 0))


def _need(buf: memoryview, pos: int, size: int, what: str) -> None:
    if pos < 0 or size < 0 or pos + size > len(buf):
        raise FlatBufferError(f"{what} at byte {pos} (+{size}) runs outside the {len(buf)}-byte buffer")


def _unpack(fmt: str, buf: memoryview, pos: int) -> Any:
    _need(buf, pos, struct.calcsize(fmt), "value")
    return struct.unpack_from(fmt, buf, pos)[0]
