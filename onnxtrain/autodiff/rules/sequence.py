"""Gradient rules of the sequence ops (same names as engine/kernels/sequence.py). A sequence's gradient is
a sequence of its elements' gradients.

``SequenceConstruct`` and ``ConcatFromSequence`` have rules: with a loop that appends to a sequence
(``SequenceInsert`` at the end, handled by the Loop rule), they cover TorchScript's list-and-stack
patterns (``outs.append(h)`` ... ``torch.stack(outs)`` or ``torch.cat(outs)``). Lengths, presence flags
and empty sequences never carry a gradient; the other sequence ops have no rule yet, so a loss reached
through one is a clear error."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient, no_gradient

no_gradient("SequenceEmpty", "SequenceLength", "OptionalHasElement")


@gradient("SequenceConstruct")
def sequence_construct_grad(g: GradCtx) -> None:
    dseq = g.dy(0)
    for i in range(g.n_inputs):
        if g.needs_dx(i):
            g.set_dx(i, g.emit("SequenceAt", dseq, g.const(np.array(i, np.int64), TensorProto.INT64)))


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
            helper.make_node(
                "Gather", [shape, g.const(np.array([axis], np.int64), TensorProto.INT64)], [one]
            ),
        ],
        "element_size",
        [helper.make_empty_tensor_value_info(e)],
        [helper.make_tensor_value_info(one, TensorProto.INT64, [1])],
    )
    sizes = g.emit("ConcatFromSequence", g.emit("SequenceMap", g.x(0), body=body), axis=0)
    g.set_dx(0, g.emit("SplitToSequence", dy, sizes, axis=axis))
