"""Shapes of Slice outputs where ONNX shape inference gives up.

ONNX's inference of a ``Slice`` whose starts or ends are computed at run time leaves every output dim
unknown, also on the axes it does not slice; those keep the input's dims, and a sliced axis whose start, end
and step can be read before a run (constants, or known dims read through ``Shape``) has its exact length. An
exporter's causal mask is such a slice (the (1, 1, T, T) buffer cut to the sequence length on axes 2 and
3, the length read from the input's shape): with its first two dims unknown, the masked scores' batch dim
became a fresh unknown too, and the autodiff had to sum gradients back to the scores' shape with run-time
shape arithmetic (a dozen nodes and a copy of the gradient per attention); so did a position embedding
gathered at a slice of positions. :func:`refined_slices` gives the dims learnt as value infos for another
round of inference. The bounds are read by :class:`~onnxtrain.ir.shape_values.ShapeValues`; the sliced axes
from the ``axes`` input (attributes before opset 10), or from the length of ``starts`` when it is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.ir.shape_values import ShapeValues, unknown
from onnxtrain.ir.types import symbolic_shape


def refined_slices(model: onnx.ModelProto, types: dict[str, onnx.TypeProto], opset: int,
                   values: ShapeValues) -> list[onnx.ValueInfoProto]:
    """Value infos of the Slice outputs in ``model``'s graph with the dims ``types`` does not know but can be
    learnt before a run (the module docstring); dims still unknown are left unnamed."""
    g = model.graph
    slices = [n for n in g.node if n.op_type == "Slice" and n.domain in DEFAULT_DOMAINS]
    if not slices:
        return []
    value = values.value
    out = []
    for n in slices:
        src, dst = symbolic_shape(types, n.input[0]), symbolic_shape(types, n.output[0])
        if src is None or dst is None or len(src) != len(dst):
            continue
        sliced = _sliced_axes(n, types, value, opset, len(src))
        if sliced is None:
            continue
        learnt: dict[int, int | str] = {}
        for k, (a, b) in enumerate(zip(src, dst)):
            if not unknown(b) or unknown(a):
                continue
            if k not in sliced:
                learnt[k] = a  # type: ignore[assignment]
            elif sliced[k] is not None and isinstance(a, int) and sliced[k][2] != 0:  # type: ignore[index]
                learnt[k] = len(range(*slice(*sliced[k]).indices(a)))  # type: ignore[misc]
        if learnt:
            # dims still unknown go without a name: the names inference made up in this round mean nothing
            # in the next, which makes up its own (one of them could be given to another dim there)
            dims = [learnt[k] if k in learnt else None if unknown(d) else d for k, d in enumerate(dst)]
            elem = types[n.output[0]].tensor_type.elem_type
            out.append(helper.make_tensor_value_info(n.output[0], elem, dims))
    return out


def _sliced_axes(node: onnx.NodeProto, types: dict, value: Callable[[str], np.ndarray | None], opset: int,
                 rank: int) -> dict[int, tuple[int, int, int] | None] | None:
    """The axes ``node`` slices, each with its (start, end, step) where they are known before a run; None
    when the axes themselves are not."""
    if opset < 10:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        starts, ends = attrs.get("starts", []), attrs.get("ends", [])
        axes = attrs.get("axes", list(range(len(starts))))
        steps: list | None = [1] * len(axes)
    else:
        def read(k: int) -> list[int] | None:  # the values of input k, when known
            v = value(node.input[k]) if len(node.input) > k and node.input[k] else None
            return None if v is None else v.reshape(-1).tolist()

        starts, ends = read(1), read(2)
        if len(node.input) > 3 and node.input[3]:
            axes = read(3)
            if axes is None:
                return None
        else:
            count = symbolic_shape(types, node.input[1])
            if count is None or len(count) != 1 or not isinstance(count[0], int):
                return None
            axes = list(range(count[0]))
        steps = read(4) if len(node.input) > 4 and node.input[4] else [1] * len(axes)
    if any(not -rank <= int(a) < rank for a in axes):
        return None
    known = (starts is not None and ends is not None and steps is not None
             and len(starts) == len(ends) == len(steps) == len(axes))
    return {int(a) % rank: (int(starts[j]), int(ends[j]), int(steps[j])) if known else None  # type: ignore[index]
            for j, a in enumerate(axes)}
