"""A model written to a file one initializer at a time.

``ModelProto.SerializeToString()`` holds the whole serialization in memory beside the proto, and a model
built from arrays holds a proto copy of every weight besides: a save then peaks at two or three copies of
the weights over the state. :func:`write_model` writes the same bytes (the graph's length is known in
advance from each initializer's size) serializing one initializer at a time, and takes extra initializers
as numpy arrays whose bytes go to the file as they are.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import IO

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import TensorProto, numpy_helper

from onnxtrain.ir.large import copy_fields
from onnxtrain.ir.types import onnx_elem_type

_GRAPH = 7  # ModelProto.graph
_INITIALIZER = 5  # GraphProto.initializer
_RAW_DATA = 9  # TensorProto.raw_data
_PACKED = {TensorProto.INT4, TensorProto.UINT4, TensorProto.FLOAT4E2M1, TensorProto.STRING}
for _name in ("INT2", "UINT2", "FLOAT6E2M3", "FLOAT6E3M2"):  # (types of newer onnx releases)
    if hasattr(TensorProto, _name):
        _PACKED.add(getattr(TensorProto, _name))

Arrays = Sequence[tuple[str, np.ndarray]]  # initializers given as (name, values)


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _field_head(number: int, length: int) -> bytes:
    """The tag and length of a length-delimited field ``number`` (a message, bytes or a string)."""
    return _varint(number << 3 | 2) + _varint(length)


def elem_type(a: np.ndarray) -> int:
    """The ONNX element type of ``a``'s values (in either byte order)."""
    return onnx_elem_type(a.dtype.newbyteorder("=") if a.dtype.kind in "fiuc" else a.dtype)


def _direct(a: np.ndarray) -> bool:
    """Whether ``a``'s bytes (little-endian) are its TensorProto's ``raw_data`` (not strings nor a type
    packed several values to a byte)."""
    return a.dtype.kind not in "OSU" and elem_type(a) not in _PACKED


def array_nbytes(a: np.ndarray) -> int:
    """The bytes of ``a``'s values in a TensorProto's ``raw_data`` (0 for strings)."""
    if a.dtype.kind in "OSU":
        return 0
    return a.nbytes if _direct(a) else len(numpy_helper.from_array(a).raw_data)


def array_raw(a: np.ndarray) -> memoryview | bytes:
    """``a``'s values as a TensorProto's ``raw_data`` holds them (a view of ``a`` where those are its
    bytes)."""
    if not _direct(a):
        return numpy_helper.from_array(a).raw_data
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("<"))
    return memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))


def array_tensor(name: str, a: np.ndarray) -> TensorProto:
    """``a`` as a TensorProto named ``name`` (as ``numpy_helper.from_array``, which refuses big-endian
    arrays)."""
    if a.dtype.byteorder == ">":
        a = a.astype(a.dtype.newbyteorder("="))
    return numpy_helper.from_array(a, name)


class _ArrayTensor:
    """An initializer given as an array: a TensorProto of its name, type and dims, then its raw bytes."""

    def __init__(self, name: str, a: np.ndarray) -> None:
        self.name, self.array = name, a
        self.direct = _direct(a)
        if self.direct:
            head = TensorProto(name=name, data_type=elem_type(a), dims=a.shape).SerializeToString()
            self.head = head + _field_head(_RAW_DATA, a.nbytes)
            self.size = len(self.head) + a.nbytes
        else:  # strings and packed types: onnx's own conversion (made again when written)
            self.size = array_tensor(name, a).ByteSize()

    def write(self, f: IO[bytes]) -> None:
        f.write(_field_head(_INITIALIZER, self.size))
        if not self.direct:
            f.write(array_tensor(self.name, self.array).SerializeToString())
            return
        f.write(self.head)
        f.write(array_raw(self.array))


def _around(msg: Message, number: int) -> tuple[bytes, bytes]:
    """``msg``'s serialized fields numbered below ``number``, and those above it."""
    fields = msg.DESCRIPTOR.fields
    before, after = type(msg)(), type(msg)()
    copy_fields(msg, before, {f.name for f in fields if f.number >= number})
    copy_fields(msg, after, {f.name for f in fields if f.number <= number})
    return before.SerializeToString(), after.SerializeToString()


def write_model(f: IO[bytes], model: onnx.ModelProto, arrays: Arrays = ()) -> None:
    """Write ``model``, with ``arrays`` as main-graph initializers after its own, to ``f``: the bytes
    ``SerializeToString`` gives for the model holding them (unknown fields aside), holding at most one
    initializer's serialization at a time."""
    if not model.HasField("graph") and not arrays:
        f.write(model.SerializeToString())
        return
    head, tail = _around(model, _GRAPH)
    before, after = _around(model.graph, _INITIALIZER)
    given = [_ArrayTensor(name, a) for name, a in arrays]
    own = [t.ByteSize() for t in model.graph.initializer]
    sizes = own + [t.size for t in given]
    f.write(head)
    framed = sum(len(_field_head(_INITIALIZER, n)) + n for n in sizes)
    f.write(_field_head(_GRAPH, len(before) + len(after) + framed))
    f.write(before)
    for t, n in zip(model.graph.initializer, own):
        f.write(_field_head(_INITIALIZER, n))
        f.write(t.SerializeToString())
    for a in given:
        a.write(f)
    f.write(after)
    f.write(tail)


def total_nbytes(arrays: Iterable[tuple[str, np.ndarray]]) -> int:
    """The bytes of ``arrays``' values (as :func:`array_nbytes`)."""
    return sum(array_nbytes(a) for _, a in arrays)


__all__ = ["Arrays", "array_nbytes", "array_raw", "array_tensor", "elem_type", "total_nbytes", "write_model"]
