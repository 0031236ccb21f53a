"""Shapes of Slice outputs on the axes they do not slice, where ONNX shape inference gives up.

ONNX's inference of a ``Slice`` whose starts or ends are computed at run time leaves every output dim
unknown, also on the axes it does not slice; those keep the input's dims. An exporter's causal mask is
such a slice (the (1, 1, T, T) buffer cut to the sequence length on axes 2 and 3): with its first two dims
unknown, the masked scores' batch dim became a fresh unknown too, and the autodiff had to sum gradients
back to the scores' shape with run-time shape arithmetic (a dozen nodes and a copy of the gradient per
attention). :func:`refined_slices` gives the known dims as value infos for a second round of inference.
The sliced axes come from the ``axes`` input (or attribute, before opset 10) when it is a constant or built
from constants by a few shape ops, or from the length of ``starts`` when ``axes`` is absent.
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
    """Value infos of the Slice outputs in ``model``'s graph whose dims on unsliced axes ``types`` does
    not know but the Slice's input does (the sliced axes unknown, as inference had them)."""
    g = model.graph
    slices = [n for n in g.node if n.op_type == "Slice" and n.domain in ("", "ai.onnx")]
    if not slices:
        return []
    made_by = {o: n for n in g.node for o in n.output}
    consts = constant_arrays(g, {i for n in g.node for i in n.input})
    value = _evaluator(made_by, consts, opset)
    out = []
    for n in slices:
        src, dst = _dims(types, n.input[0]), _dims(types, n.output[0])
        if src is None or dst is None or len(src) != len(dst):
            continue
        sliced = _sliced_axes(n, types, value, opset, len(src))
        if sliced is None:
            continue
        learnt = [k for k, (a, b) in enumerate(zip(src, dst))
                  if k not in sliced and _unknown(b) and not _unknown(a)]
        if learnt:
            # dims still unknown go without a name: the names inference made up in this round mean nothing
            # in the next, which makes up its own (one of them could be given to another dim there)
            dims = [src[k] if k in learnt else None if _unknown(d) else d for k, d in enumerate(dst)]
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
                 rank: int) -> set[int] | None:
    """The axes ``node`` slices, or None when they cannot be known before a run."""
    if opset < 10:
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        axes = attrs.get("axes", list(range(len(attrs.get("starts", [])))))
    elif len(node.input) > 3 and node.input[3]:
        found = value(node.input[3])
        if found is None:
            return None
        axes = found.reshape(-1).tolist()
    else:
        starts = _dims(types, node.input[1])
        if starts is None or len(starts) != 1 or not isinstance(starts[0], int):
            return None
        axes = list(range(starts[0]))
    if any(not -rank <= int(a) < rank for a in axes):
        return None
    return {int(a) % rank for a in axes}


def _evaluator(made_by: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray],
               opset: int) -> Callable[[str], np.ndarray | None]:
    """A function giving the value of a small integer tensor made of constants by Unsqueeze, Squeeze,
    Concat, Reshape, Cast or Identity, else None."""
    seen: dict[str, np.ndarray | None] = {}

    def value(name: str) -> np.ndarray | None:
        if name in seen:
            return seen[name]
        seen[name] = None  # a cycle (not in a valid graph) stops here
        found = consts.get(name)
        if found is None and name in made_by:
            found = _apply(made_by[name], value, opset)
        if found is not None and (found.size > _MAX_VALUES or found.dtype.kind not in "iu"):
            found = None
        seen[name] = found
        return found

    return value


def _apply(node: onnx.NodeProto, value: Callable[[str], np.ndarray | None], opset: int) -> np.ndarray | None:
    if node.op_type not in ("Unsqueeze", "Squeeze", "Concat", "Reshape", "Cast", "Identity") or \
            node.domain not in ("", "ai.onnx"):
        return None
    args = [value(i) if i else None for i in node.input]
    if args[:1] == [None] or (node.op_type in ("Concat", "Reshape") and any(a is None for a in args)):
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
