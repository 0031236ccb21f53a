"""Gradient rules of the sequence ops (same names as engine/kernels/sequence.py). A sequence's gradient is
a sequence of its elements' gradients.

Building and reading sequences have rules (``SequenceConstruct``, ``SequenceInsert``, ``SequenceAt``,
``SplitToSequence``, ``ConcatFromSequence``); with the Loop rule's handling of a sequence appended to at
each iteration they cover TorchScript's list patterns (``outs.append(h)`` ... ``torch.stack(outs)``,
``x.unbind(0)``, ``outs[i]``). ``SequenceErase`` puts zeros back; an optional's gradient is an optional
(``Optional`` and ``OptionalGetElement`` swap). Lengths, presence flags and empty sequences never carry a
gradient."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient, no_gradient
from onnxtrain.autodiff.rules.shape import zeros

I64 = TensorProto.INT64

no_gradient("SequenceEmpty", "SequenceLength", "OptionalHasElement")


@gradient("SequenceConstruct")
def sequence_construct_grad(g: GradCtx) -> None:
    dseq = g.dy(0)
    for i in range(g.n_inputs):
        if g.needs_dx(i):
            g.set_dx(i, g.emit("SequenceAt", dseq, g.const(np.array(i, np.int64), I64)))


@gradient("ConcatFromSequence", uses=("x0",))
def concat_from_sequence_grad(g: GradCtx) -> None:
    dy, axis = g.dy(0), g.attr("axis")
    if g.attr("new_axis"):  # a stack: one element per index along the new axis
        g.set_dx(0, g.emit("SplitToSequence", dy, axis=axis, keepdims=0))
        return
    # a concatenation: split dY by the elements' sizes along the axis, read with a SequenceMap
    names = g._bw.names
    e, shape, one = (
        names(f"{g.node.name or 'ConcatFromSequence'}_Grad/{s}") for s in ("element", "shape", "size")
    )
    body = helper.make_graph(
        [
            helper.make_node("Shape", [e], [shape]),
            helper.make_node("Gather", [shape, g.const(np.array([axis], np.int64), I64)], [one]),
        ],
        "element_size",
        [helper.make_empty_tensor_value_info(e)],
        [helper.make_tensor_value_info(one, I64, [1])],
    )
    sizes = g.emit("ConcatFromSequence", g.emit("SequenceMap", g.x(0), body=body), axis=0)
    g.set_dx(0, g.emit("SplitToSequence", dy, sizes, axis=axis))


@gradient("SequenceInsert", uses=("x2",))
def sequence_insert_grad(g: GradCtx) -> None:
    dseq = g.dy(0)
    # the inserted tensor's gradient is the element at its position; the rest is the sequence's
    pos = g.x(2) if g.has_x(2) else g.const(np.array(-1, np.int64), I64)
    if not g.has_x(2):  # appended: the last element
        g.set_dx(1, g.emit("SequenceAt", dseq, pos))
        g.set_dx(0, g.emit("SequenceErase", dseq, pos))
        return
    at = _position(g, dseq, pos, after_insert=True)
    g.set_dx(1, g.emit("SequenceAt", dseq, at))
    g.set_dx(0, g.emit("SequenceErase", dseq, at))


@gradient("SequenceAt", uses=("x0", "x1"))
def sequence_at_grad(g: GradCtx) -> None:
    # zeros for every element, then dY in place of the one read
    seq, dy = g.x(0), g.dy(0)
    body = zeros_like_elements(g, seq, f"{g.node.name or 'SequenceAt'}_Grad")
    zeros = g.emit("SequenceMap", seq, body=body)
    at = _position(g, seq, g.x(1), after_insert=False)
    g.set_dx(0, g.emit("SequenceInsert", g.emit("SequenceErase", zeros, at), dy, at))


@gradient("SplitToSequence", stop=(1,))
def split_to_sequence_grad(g: GradCtx) -> None:
    """The pieces' gradients put back together. An axis of length 0 splits into no piece, and neither
    engine concatenates an empty sequence: when x's rank is known, a first element of zeros (an empty piece,
    or a stacked slice taken off again) keeps the sequence from being empty."""
    dseq, axis = g.dy(0), g.attr("axis") or 0
    split = g.constant_value(1)
    no_split = not g.has_x(1) or (split is not None and np.size(split) == 0)  # (an empty split is none)
    stack = no_split and g.attr("keepdims") == 0  # size-1 pieces with the axis squeezed: a stack
    rank = g.rank(0)
    if rank is None:
        g.set_dx(0, g.emit("ConcatFromSequence", dseq, axis=axis, new_axis=int(stack)))
        return
    axis %= rank
    shape = g.shape(0)
    head = g.emit("Slice", shape, g.ints([0]), g.ints([axis]))
    tail = g.emit("Slice", shape, g.ints([axis + 1]), g.ints([rank]))
    first = zeros(g, g.emit("Concat", head, tail, axis=0) if stack else
                  g.emit("Concat", head, g.ints([0]), tail, axis=0), elem=_element_type(g, dseq))
    padded = g.emit("SequenceInsert", dseq, first, g.int64(0))
    if not stack:
        g.set_dx(0, g.emit("ConcatFromSequence", padded, axis=axis))
        return
    stacked = g.emit("ConcatFromSequence", padded, axis=axis, new_axis=1)
    big = np.iinfo(np.int64).max
    g.set_dx(0, g.emit("Slice", stacked, g.ints([1]), g.ints([big]), g.ints([axis])))


def zeros_like_elements(g: GradCtx, seq: str, label: str) -> onnx.GraphProto:
    """A SequenceMap body giving zeros shaped like each element of sequence ``seq``, its values named under
    ``label``. Typed: onnxruntime (1.32) cannot initialize a SequenceMap whose body output has no type when
    it runs the graph unoptimized ("Invalid tensor data type 0")."""
    names = g._bw.names
    e, shape, zero = (names(f"{label}/{s}") for s in ("element", "shape", "zeros"))
    et = _element_type(g, seq)
    return helper.make_graph(
        [
            helper.make_node("Shape", [e], [shape]),
            helper.make_node("ConstantOfShape", [shape], [zero], value=helper.make_tensor("v", et, [1], [0])),
        ],
        "zeros_like_element",
        [helper.make_tensor_value_info(e, et, None)],
        [helper.make_tensor_value_info(zero, et, None)],
    )


def _element_type(g: GradCtx, seq: str) -> int:
    """The element type of sequence ``seq``: as typed, else as the nodes making it say (shape inference
    types no sequence split by an empty tensor), else the node's float type."""
    for _ in range(64):  # (a chain of inserts and erases)
        tp = g._bw.types.get(seq)
        if tp is not None and tp.HasField("sequence_type"):
            elem = tp.sequence_type.elem_type
            if elem.HasField("tensor_type") and elem.tensor_type.elem_type:
                return elem.tensor_type.elem_type
        made = g.producer(seq)
        if made is None:
            break
        if made.op_type in ("SplitToSequence", "SequenceConstruct") and made.input and made.input[0]:
            return g.elem_type(made.input[0]) or g.dtype
        if made.op_type == "SequenceInsert" and len(made.input) > 1 and g.elem_type(made.input[1]):
            return g.elem_type(made.input[1])
        if made.op_type == "SequenceEmpty":
            return next((a.i for a in made.attribute if a.name == "dtype"), TensorProto.FLOAT)
        if made.op_type not in ("SequenceInsert", "SequenceErase"):
            break
        seq = made.input[0]
    return g.dtype


def _position(g: GradCtx, seq: str, pos: str, after_insert: bool) -> str:
    """``pos`` as a non-negative index into ``seq`` (for an insert, into the sequence after it, whose
    length is one more: a negative position counts from the end of the sequence it was inserted into)."""
    length = g.emit("SequenceLength", seq)
    if after_insert:
        length = g.emit("Sub", length, g.const(np.array(1, np.int64), I64))
    p = g.emit("Cast", pos, to=I64)
    wrapped = g.emit("Add", p, length)
    return g.emit("Where", g.emit("Less", p, g.const(np.array(0, np.int64), I64)), wrapped, p)


@gradient("SequenceErase", uses=("x0", "x1"))
def sequence_erase_grad(g: GradCtx) -> None:
    # the sequence's gradient with zeros put back where the erased element was
    seq = g.x(0)
    pos = g.x(1) if g.has_x(1) else g.const(np.array(-1, np.int64), I64)
    at = _position(g, seq, pos, after_insert=False)
    erased = g.emit("SequenceAt", seq, at)
    filler = zeros(g, g.emit("Shape", erased), elem=_element_type(g, seq))
    g.set_dx(0, g.emit("SequenceInsert", g.dy(0), filler, at))


@gradient("Optional")
def optional_grad(g: GradCtx) -> None:
    if g.needs_dx(0):
        g.set_dx(0, g.emit("OptionalGetElement", g.dy(0)))


@gradient("OptionalGetElement")
def optional_get_element_grad(g: GradCtx) -> None:
    g.set_dx(0, g.emit("Optional", g.dy(0)))
