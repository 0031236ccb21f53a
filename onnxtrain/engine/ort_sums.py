"""Sums over a tensor's leading axes rewritten for onnxruntime as products with a row of ones.

A bias's gradient is a ``ReduceSum`` of the output gradient over its leading axes (the autodiff's sum back
to the bias's shape). onnxruntime's ReduceSum takes 42 µs alone on the GPT decoder's (16, 64, 512) bias
gradient (119 µs in its training step). Its static leading dims (here the sequence, P = 64) go into one
MLAS product with a constant row of ones, and the dynamic ones (the batch) into a ReduceSum of what is
left, P times smaller:

    part = MatMul(ones[1, P], Reshape(x, [-1, P, C]))          (M, 1, C)   C: the trailing dims' product
    sum  = ReduceSum(part, [0, 1])                             (C), reshaped to the trailing dims

28 µs alone, and closer to the float64 sum (largest error 1.3e-5 against 9.5e-5 there); with every leading
dim static, one product ``ones[1, R] @ Reshape(x, [R, C])``. Reshapes are left out where the shapes
already fit: the GPT's bias gradients take two nodes in place of one. (One product over all rows, its
row of ones made at run time from the batch, measured 18 µs alone but added six small nodes per sum,
which took back in a step what it saved.)

Rewritten where the axes are constant and exactly the leading ones, the trailing dims are known and hold
at least :data:`MIN_COLUMNS` values, the static leading dims at least :data:`MIN_ROWS`, and the element
type is float or double (opset 13 or later, where the axes are an input). Axes constants nothing else
reads go with their sums.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import NameGen, model_opset, symbolic_shape, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, constant_arrays, drop_unread, fed_initializers

MIN_ROWS = 8  # static leading values: fewer leave most of the sum to the ReduceSum
MIN_COLUMNS = 64  # fewer trailing values make a poor product (a bias of a 10-class head stays a ReduceSum)
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
_MIN_OPSET = 13


def leading_sums(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each ReduceSum over leading axes as a product with ones (a copy), or ``model``."""
    g = model.graph
    if model_opset(model) < _MIN_OPSET or not any(_is_sum(n) for n in g.node):
        return model
    axes = constant_arrays(g, {n.input[1] for n in g.node if _is_sum(n)}, fed_initializers(model))
    types = typed()
    plans = {k: p for k, n in enumerate(g.node) if _is_sum(n) and (p := _plan(n, axes, types)) is not None}
    if not plans:
        return model

    def replace(k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        new, consts = _as_product(n, *plans[k], names)
        out.graph.initializer.extend(consts)
        return new

    out = with_nodes_replaced(model, plans, replace)
    drop_unread(out.graph, {g.node[k].input[1] for k in plans})  # the axes only the sums read
    return out


def _is_sum(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ReduceSum" and node.domain in DEFAULT_DOMAINS and len(node.input) == 2
            and bool(node.input[1]))


def _plan(node: onnx.NodeProto, axes: dict[str, np.ndarray], types: dict) -> tuple | None:
    """(element type, leading dims, trailing dims, keepdims) when ``node`` can be rewritten."""
    a = axes.get(node.input[1])
    shape = symbolic_shape(types, node.input[0])
    tp = types.get(node.input[0])
    if a is None or a.size == 0 or shape is None or tp is None or tp.tensor_type.elem_type not in _FLOATS:
        return None
    rank = len(shape)
    lead = sorted({int(v) % rank for v in a.reshape(-1)}) if rank else []
    if not lead or lead != list(range(len(lead))) or len(lead) == rank:
        return None
    leading, trailing = shape[:len(lead)], shape[len(lead):]
    if not all(isinstance(d, int) for d in trailing) or int(np.prod(trailing)) < MIN_COLUMNS:
        return None
    if _static_rows(leading) < MIN_ROWS:
        return None
    keep = next((x.i for x in node.attribute if x.name == "keepdims"), 1)
    return tp.tensor_type.elem_type, leading, [int(d) for d in trailing], bool(keep)


def _static_rows(leading: list) -> int:
    """The product of the innermost leading dims that are all known."""
    rows = 1
    for d in reversed(leading):
        if not isinstance(d, int):
            break
        rows *= d
    return rows


def _as_product(node: onnx.NodeProto, elem: int, leading: list, trailing: list[int], keep: bool,
                names: NameGen) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto]]:
    """The nodes (and constants) computing ``node``'s sum through ``ones @ x`` (module docstring)."""
    x, out = node.input[0], node.output[0]
    base = node.name or "ReduceSum"
    nodes: list[onnx.NodeProto] = []
    consts: list[onnx.TensorProto] = []

    def make(op: str, ins: list[str], result: str | None = None, **kw: object) -> str:
        result = result or names(f"{out}/{op}")
        nodes.append(helper.make_node(op, ins, [result], name=names(f"{base}/{op}"), **kw))
        return result

    def const(what: str, value: np.ndarray) -> str:
        consts.append(numpy_helper.from_array(value, names(f"{out}/{what}")))
        return consts[-1].name

    rows, columns = _static_rows(leading), int(np.prod(trailing))
    ones = const("ones", np.ones((1, rows), _FLOATS[elem]))
    everything = all(isinstance(d, int) for d in leading)
    # x is already (R, C) or (M, P, C) with one leading dim per role and one trailing dim
    fits = len(trailing) == 1 and len(leading) == (1 if everything else 2)
    want = [rows, columns] if everything else [-1, rows, columns]
    matrix = x if fits else make("Reshape", [x, const("rows", np.array(want, np.int64))])
    summed = make("MatMul", [ones, matrix])  # (1, C) or (M, 1, C)
    shape = [1] * len(leading) + trailing if keep else trailing
    if not everything:
        flat = len(trailing) == 1 and not keep
        summed = make("ReduceSum", [summed, const("axes", np.array([0, 1], np.int64))],
                      out if flat else None, keepdims=0)
        if flat:
            return nodes, consts
    make("Reshape", [summed, const("shape", np.array(shape, np.int64))], out)
    return nodes, consts
