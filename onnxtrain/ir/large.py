"""Models past protobuf's 2 GiB: how large a model's tensors are, copies of a model without their bytes,
onnx.checker's full check of such a model, and saves that put its tensors in an external-data file.

protobuf cannot serialize a message over 2 GiB (``EncodeError``; with protobuf 7 even ``ByteSize()`` raises),
so a model whose initializers pass :data:`LARGE_MODEL_BYTES` is never serialized whole: it is saved with
its tensors in ``<file>.data`` (:func:`stage_model_sized`), checked as a skeleton whose large initializers
are declared graph inputs of their type and shape (:func:`check_model_full`), and handed to onnxruntime
as a skeleton whose large initializers are external, their values given in memory
(:func:`external_skeleton`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Collection, Sequence
from typing import Any

import numpy as np
import onnx
from google.protobuf.message import Message
from onnx import TensorProto, helper

LARGE_MODEL_BYTES = 1800 * 2**20  # tensors beyond this leave the proto (protobuf's limit is 2 GiB)
MOVED_TENSOR_BYTES = 1 << 20  # in a large model's skeletons, the initializers of at least this many bytes
IN_MEMORY = "onnxtrain-in-memory"  # the location skeletons give tensors whose values come from elsewhere


def tensor_nbytes(t: TensorProto) -> int:
    """The bytes of ``t``'s values as its type and dims say (0 for strings and for external tensors), read
    without copying them out of the proto."""
    if t.data_type == TensorProto.STRING or t.data_location == TensorProto.EXTERNAL:
        return 0
    try:
        bits = {TensorProto.INT4: 4, TensorProto.UINT4: 4}.get(t.data_type) or \
            8 * helper.tensor_dtype_to_np_dtype(t.data_type).itemsize
    except (KeyError, TypeError, ValueError):
        bits = 32
    return (math.prod(t.dims) * bits + 7) // 8


def tensor_bytes(model: onnx.ModelProto) -> int:
    """The bytes of the values of ``model``'s main-graph initializers held in the proto."""
    return sum(tensor_nbytes(t) for t in model.graph.initializer)


def is_large(model: onnx.ModelProto, more: int = 0) -> bool:
    """Whether ``model``'s tensors, with ``more`` bytes of others, pass :data:`LARGE_MODEL_BYTES`."""
    return tensor_bytes(model) + more > LARGE_MODEL_BYTES


def _repeated(fd: Any) -> bool:
    """Whether field ``fd`` is repeated (protobuf from 6.31 says so itself; older ones by its label, which
    7 no longer has)."""
    known = getattr(fd, "is_repeated", None)
    return bool(known) if known is not None else fd.label == fd.LABEL_REPEATED


def copy_fields(src: Message, dst: Message, skip: Collection[str]) -> None:
    """Copy the fields set in message ``src`` into ``dst`` (of the same type), but those named in ``skip``
    (one message's copy, not a serialization)."""
    for fd, value in src.ListFields():
        if fd.name in skip:
            continue
        if _repeated(fd):
            getattr(dst, fd.name).extend(value)
        elif fd.type == fd.TYPE_MESSAGE:
            getattr(dst, fd.name).CopyFrom(value)
        else:
            setattr(dst, fd.name, value)


def skeleton(model: onnx.ModelProto, emptied: Callable[[TensorProto], TensorProto | None]
             ) -> onnx.ModelProto:
    """A copy of ``model`` whose main-graph initializers ``emptied`` maps to a replacement (a tensor without
    values) take it; ``emptied`` returns None for those copied as they are. The large tensors' bytes are
    never copied."""
    out = onnx.ModelProto()
    copy_fields(model, out, {"graph"})
    copy_fields(model.graph, out.graph, {"initializer"})
    for t in model.graph.initializer:
        out.graph.initializer.append(emptied(t) or t)
    return out


def external_tensor(t: TensorProto, location: str, offset: int, length: int) -> TensorProto:
    """A tensor of ``t``'s name, type and dims without values: they are ``length`` bytes at ``offset`` in
    external file ``location``."""
    e = TensorProto(name=t.name, data_type=t.data_type, dims=t.dims)
    if t.HasField("doc_string"):
        e.doc_string = t.doc_string
    e.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", str(offset)), ("length", str(length))):
        entry = e.external_data.add()
        entry.key, entry.value = key, value
    return e


def external_skeleton(model: onnx.ModelProto) -> tuple[onnx.ModelProto, list[TensorProto]]:
    """A copy of ``model`` whose main-graph initializers of :data:`MOVED_TENSOR_BYTES` or more are external
    tensors with no file (location :data:`IN_MEMORY`), for a runtime that takes their values in memory
    (onnxruntime's ``SessionOptions.add_external_initializers``); and those tensors of ``model``."""
    moved: list[TensorProto] = []

    def emptied(t: TensorProto) -> TensorProto | None:
        n = tensor_nbytes(t)
        if n < MOVED_TENSOR_BYTES:
            return None
        moved.append(t)
        return external_tensor(t, IN_MEMORY, 0, n)

    return skeleton(model, emptied), moved


def check_model_full(model: onnx.ModelProto) -> None:
    """onnx.checker's full check of ``model``; past :data:`LARGE_MODEL_BYTES` (the checker takes larger
    models only from a file) that of a skeleton whose large initializers are graph inputs of their type and
    shape instead (their values are not checked)."""
    if not is_large(model):
        onnx.checker.check_model(model, full_check=True)
        return
    declared: list[onnx.ValueInfoProto] = []
    inputs = {v.name for v in model.graph.input}

    def emptied(t: TensorProto) -> TensorProto | None:
        if tensor_nbytes(t) < MOVED_TENSOR_BYTES:
            return None
        if t.name not in inputs:
            declared.append(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
        return TensorProto()  # a placeholder dropped below

    sk = skeleton(model, emptied)
    kept = [t for t in sk.graph.initializer if t.name]
    del sk.graph.initializer[:]
    sk.graph.initializer.extend(kept)
    sk.graph.input.extend(declared)
    onnx.checker.check_model(sk, full_check=True)


def check_model_arrays(model: onnx.ModelProto, arrays: Sequence[tuple[str, np.ndarray]]) -> None:
    """onnx.checker's full check of ``model`` holding ``arrays`` (name, value) as initializers too, made
    without serializing the large ones: those of :data:`MOVED_TENSOR_BYTES` or more are checked as graph
    inputs of their type and shape (their values are not checked), the others as initializers."""
    from onnxtrain.ir.stream import array_tensor, elem_type  # (stream imports this module)

    m = onnx.ModelProto()
    m.CopyFrom(model)
    for name, a in arrays:
        if a.nbytes < MOVED_TENSOR_BYTES or a.dtype.kind in "OSU":
            m.graph.initializer.append(array_tensor(name, a))
        else:
            m.graph.input.append(helper.make_tensor_value_info(name, elem_type(a), a.shape))
    check_model_full(m)


__all__ = ["IN_MEMORY", "LARGE_MODEL_BYTES", "MOVED_TENSOR_BYTES", "check_model_arrays", "check_model_full",
           "copy_fields", "external_skeleton", "external_tensor", "is_large", "skeleton", "tensor_bytes",
           "tensor_nbytes"]
