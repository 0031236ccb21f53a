"""Shapes of Slice outputs where ONNX shape inference gives up.

ONNX's inference of a ``Slice`` whose starts or ends are computed at run time leaves every output dim
unknown, also on the axes it does not slice; those keep the input's dims, and a sliced axis whose start, end
and step can be read before a run (constants, or known dims read through ``Shape``) has its exact length. An
exporter's causal mask is such a slice (the (1, 1, T, T) buffer cut to the sequence length on axes 2 and
3, the length read from the input's shape): with its first two dims unknown, the masked scores' batch dim
became a fresh unknown too, and the autodiff had to sum gradients back to the scores' shape with run-time
shape arithmetic (a dozen nodes and a copy of the gradient per attention); so did a position embedding
gathered at a slice of positions. :func:`refined_slices` gives the dims learnt as value infos for another
round of inference. The values are read from constants through Unsqueeze, Squeeze, Concat, Reshape, Cast
and Identity, and from ``Shape`` or a ``Gather`` of it where the dims it reads are known; the sliced axes
from the ``axes`` input (attributes before opset 10), or from the length of ``starts`` when it is absent.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper

from onnxtrain.ir.graphs import constant_arrays

_FRESH = "unk__"  # the prefix of the dim names ONNX shape inference makes up for unknown dims
_MAX_VALUES = 64  # constant tensors read to find the axes: small integer vectors


def refined_slices(model: onnx.ModelProto, types: dict[str, onnx.TypeProto],
                   opset: int) -> list[onnx.ValueInfoProto]:
    """Value infos of the Slice outputs in ``model``'s graph with the dims ``types`` does not know but can be
    learnt before a run (the module docstring); dims still unknown are left unnamed."""
    g = model.graph
    slices = [n for n in g.node if n.op_type == "Slice" and n.domain in ("", "ai.onnx")]
    if not slices:
        return []
    made_by = {o: n for n in g.node for o in n.output}
    consts = constant_arrays(g, {i for n in g.node for i in n.input})
    value = _evaluator(made_by, consts, types, opset)
    out = []
    for n in slices:
        src, dst = _dims(types, n.input[0]), _dims(types, n.output[0])
        if src is None or dst is None or len(src) != len(dst):
            continue
        sliced = _sliced_axes(n, types, value, opset, len(src))
        if sliced is None:
            continue
        learnt: dict[int, int | str] = {}
        for k, (a, b) in enumerate(zip(src, dst)):
            if not _unknown(b) or _unknown(a):
                continue
            if k not in sliced:
                learnt[k] = a  # type: ignore[assignment]
            elif sliced[k] is not None and isinstance(a, int) and sliced[k][2] != 0:  # type: ignore[index]
                learnt[k] = len(range(*slice(*sliced[k]).indices(a)))  # type: ignore[misc]
        if learnt:
            # dims still unknown go without a name: the names inference made up in this round mean nothing
            # in the next, which makes up its own (one of them could be given to another dim there)
            dims = [learnt[k] if k in learnt else None if _unknown(d) else d for k, d in enumerate(dst)]
            elem = types[n.output[0]].tensor_type.elem_type
            out.append(helper.make_tensor_value_info(n.output[0], elem, dims))
    return out


def _unknown(d: int | str | None) -> bool:
    """A dim inference did not know: none, or one of the fresh names it makes up ("unk__3")."""
    return d is None or isinstance(d, str) and d.startswith(_FRESH)


def _dims(types: dict, name: str) -> list[int | str | None] | None:
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
            for d in tp.tensor_type.shape.dim]


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
            count = _dims(types, node.input[1])
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


def _evaluator(made_by: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray], types: dict,
               opset: int) -> Callable[[str], np.ndarray | None]:
    """A function giving the value of a small integer tensor made of constants by Unsqueeze, Squeeze,
    Concat, Reshape, Cast or Identity, or of the known dims of a shape (``Shape``, a ``Gather`` from it),
    else None."""
    seen: dict[str, np.ndarray | None] = {}

    def value(name: str) -> np.ndarray | None:
        if name in seen:
            return seen[name]
        seen[name] = None  # a cycle (not in a valid graph) stops here
        found = consts.get(name)
        if found is None and name in made_by:
            node = made_by[name]
            shape = made_by.get(node.input[0]) if node.op_type == "Gather" and node.input else node
            if shape is not None and shape.op_type == "Shape" and shape.domain in ("", "ai.onnx"):
                found = _shape_value(node, shape, types, value)
            else:
                found = _apply(node, value, opset)
        if found is not None and (found.size > _MAX_VALUES or found.dtype.kind not in "iu"):
            found = None
        seen[name] = found
        return found

    return value


def _shape_value(node: onnx.NodeProto, shape: onnx.NodeProto, types: dict,
                 value: Callable[[str], np.ndarray | None]) -> np.ndarray | None:
    """``Shape(x)`` (``node`` is ``shape``) or ``Gather(Shape(x), i)``, where the dims it gives are known."""
    dims = _dims(types, shape.input[0])
    if dims is None:
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in shape.attribute}
    dims = dims[slice(attrs.get("start", 0), attrs.get("end"))]
    if node is not shape:
        at = value(node.input[1])
        if at is None or any(not -len(dims) <= int(i) < len(dims) for i in at.reshape(-1)):
            return None
        picked = [dims[int(i)] for i in at.reshape(-1)]
        if not all(isinstance(d, int) for d in picked):
            return None
        return np.array(picked, np.int64).reshape(at.shape)
    return np.array(dims, np.int64) if all(isinstance(d, int) for d in dims) else None


def _apply(node: onnx.NodeProto, value: Callable[[str], np.ndarray | None], opset: int) -> np.ndarray | None:
    if node.op_type not in ("Unsqueeze", "Squeeze", "Concat", "Reshape", "Cast", "Identity") or \
            node.domain not in ("", "ai.onnx"):
        return None
    args = [value(i) if i else None for i in node.input]
    every = node.op_type in ("Concat", "Reshape")  # ops that need all their inputs' values
    if not args or args[0] is None or (every and any(a is None for a in args)):
        return None
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    x = args[0]
    assert x is not None
    if node.op_type in ("Unsqueeze", "Squeeze"):
        axes = attrs.get("axes") if opset < 13 else (args[1].tolist() if len(args) > 1 and args[1] is not None
                                                     else None)
        if node.op_type == "Squeeze":
            return np.squeeze(x, axis=tuple(axes)) if axes is not None else np.squeeze(x)
        if axes is None:
            return None
        for a in sorted(int(v) % (x.ndim + len(axes)) for v in axes):
            x = np.expand_dims(x, a)
        return x
    if node.op_type == "Concat":
        return np.concatenate(args, axis=attrs.get("axis", 0))  # type: ignore[arg-type]
    if node.op_type == "Reshape":
        shape = [int(d) if d != 0 else x.shape[k] for k, d in enumerate(args[1].tolist())]  # type: ignore[union-attr]
        return x.reshape(shape)
    if node.op_type == "Cast":
        target = helper.tensor_dtype_to_np_dtype(attrs["to"])
        return x.astype(target) if np.dtype(target).kind in "iu" else None
    return x
