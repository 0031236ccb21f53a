"""Shapes of Reshape outputs whose target shape is computed, where ONNX shape inference gives up.

torch's export of ``nn.MultiheadAttention`` splits its projection with ``unflatten(-1, (3, E))``: a Reshape to
``Concat(Slice(Shape(x), 0, end), [3, E])``, the end computed through a ``Mod``, which ONNX's data
propagation does not follow. The output's rank was unknown, and so was everything after it: the q, k and v
taken from it, and the gradients the autodiff wrote for them (zero pads found at run time). Read entry by
entry (:class:`~onnxtrain.ir.shape_values.ShapeValues`), the target is ``[L, "batch", 3, E]``: each entry an
int, a dim's name or unknown, a 0 the input's dim there (without ``allowzero``), and a −1 the input's size
over the others' when it can be told (the same dims and names cancelled). :func:`refined_reshapes` gives
them as value infos for another round of inference.
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.ir.shape_values import Dim, ShapeValues, unknown
from onnxtrain.ir.types import symbolic_shape


def refined_reshapes(model: onnx.ModelProto, types: dict[str, onnx.TypeProto],
                     values: ShapeValues) -> list[onnx.ValueInfoProto]:
    """Value infos of the Reshape outputs in ``model``'s graph with dims ``types`` does not know but their
    computed target shape tells; dims still unknown are left unnamed."""
    out = []
    for n in model.graph.node:
        if n.op_type != "Reshape" or n.domain not in DEFAULT_DOMAINS or len(n.input) < 2:
            continue
        have = symbolic_shape(types, n.output[0])
        if have is not None and not any(unknown(d) for d in have):
            continue
        target = values.dims(n.input[1])
        tp = types.get(n.output[0]) or types.get(n.input[0])
        if target is None or target[0] or tp is None or not tp.HasField("tensor_type"):
            continue
        allow_zero = any(a.name == "allowzero" and a.i for a in n.attribute)
        dims = _reshaped(symbolic_shape(types, n.input[0]), target[1], allow_zero)
        if dims is None or (have is not None and len(have) != len(dims)):
            continue
        if have is not None:  # what inference knew stays
            dims = [h if not unknown(h) else d for h, d in zip(have, dims)]
        if have is None or any(unknown(h) and not unknown(d) for h, d in zip(have, dims)):
            dims = [None if unknown(d) else d for d in dims]
            out.append(helper.make_tensor_value_info(n.output[0], tp.tensor_type.elem_type, dims))
    return out


def _reshaped(src: list[Dim] | None, target: list[Dim], allow_zero: bool) -> list[Dim] | None:
    """The output dims of a Reshape of ``src`` (None: rank unknown) to ``target`` (entries read before a
    run), or None when the target is not a valid shape."""
    dims: list[Dim] = []
    for k, t in enumerate(target):
        if t == 0 and not allow_zero:
            dims.append(src[k] if src is not None and k < len(src) else None)
        elif isinstance(t, int) and t < -1:
            return None
        else:
            dims.append(t)
    if dims.count(-1) > 1:
        return None
    if -1 in dims:
        dims[dims.index(-1)] = _rest(src, [d for d in dims if d != -1])
    return dims


def _rest(src: list[Dim] | None, others: list[Dim]) -> Dim:
    """The dim a −1 stands for: ``src``'s size over the product of ``others``, when the dims and names on
    both sides tell it (names cancelled one for one, the rest of ``src`` a whole multiple), else None."""
    if src is None or any(unknown(d) for d in (*src, *others)):
        return None
    names = [d for d in src if isinstance(d, str)]
    size, part = 1, 1
    for d in src:
        if isinstance(d, int):
            size *= d
    for d in others:
        if isinstance(d, str):
            if d not in names:
                return None
            names.remove(d)
        else:
            part *= d  # type: ignore[operator]
    if part == 0 or size % part:
        return None
    if not names:
        return size // part
    return names[0] if len(names) == 1 and size == part else None
