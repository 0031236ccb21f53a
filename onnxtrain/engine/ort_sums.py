"""Sums over a tensor's leading axes rewritten for onnxruntime as products with a row of ones; large sums of
squares (clipping's norm) in two levels (:func:`two_level_sum_squares`, at the end).

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
row of ones made at run time from the batch, measured 18 µs alone there but added six small nodes per sum,
which took back in a step what it saved.)

Where fewer than :data:`MIN_ROWS` leading values are static (a Linear layer's bias gradient over a dynamic
batch, ``(N, C)``), nothing is left for a constant row of ones, and onnxruntime's ReduceSum over the batch
is at its slowest: 149 µs alone for the MLP's ``(256, 512)``, 42 µs at ``(64, 512)``. The row of ones is
then made at run time from the rows' count (opset 15 on, where Shape takes a range):

    rows = Reshape(x, [-1, C])                       left out for an (N, C) x
    sum  = MatMul(ConstantOfShape(Shape(rows, 0:1), 1), rows)          (C)

14 and 8 µs alone for those two.

Rewritten where the axes are constant and exactly the leading ones, the trailing dims are known and hold
at least :data:`MIN_COLUMNS` values, the static leading dims at least :data:`MIN_ROWS` (or, from opset 15,
some leading dim is dynamic), and the element type is float or double (opset 13 or later, where the axes
are an input). Axes constants nothing else
reads go with their sums.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import NameGen, model_opset, symbolic_shape, value_types, with_nodes_replaced
from onnxtrain.ir.graphs import (
    DEFAULT_DOMAINS,
    constant_arrays,
    drop_unread,
    drop_value_info,
    fed_initializers,
)

MIN_ROWS = 8  # static leading values: fewer leave most of the sum to the ReduceSum
MIN_COLUMNS = 64  # fewer trailing values make a poor product (a bias of a 10-class head stays a ReduceSum)
_FLOATS = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
_MIN_OPSET = 13
_RUNTIME_ONES_OPSET = 15  # Shape's start and end


def leading_sums(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each ReduceSum over leading axes as a product with ones (a copy), or ``model``."""
    g = model.graph
    if model_opset(model) < _MIN_OPSET or not any(_is_sum(n) for n in g.node):
        return model
    axes = constant_arrays(g, {n.input[1] for n in g.node if _is_sum(n)}, fed_initializers(model))
    types = typed()
    runtime_ones = model_opset(model) >= _RUNTIME_ONES_OPSET
    plans = {k: p for k, n in enumerate(g.node)
             if _is_sum(n) and (p := _plan(n, axes, types, runtime_ones)) is not None}
    if not plans:
        return model

    def replace(k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        new, consts = _as_product(n, *plans[k], names)
        out.graph.initializer.extend(consts)
        return new

    out = with_nodes_replaced(model, plans, replace)
    drop_unread(out.graph, {g.node[k].input[1] for k in plans})  # the axes only the sums read
    # a declared shape of a value whose rows are counted at run time goes: onnxruntime would fold the count
    # from it, and it may be stale (the plan trusts only inferred types)
    drop_value_info(out.graph, {g.node[k].input[0] for k, p in plans.items() if _rows_at_run_time(p[1])})
    return out


def _is_sum(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ReduceSum" and node.domain in DEFAULT_DOMAINS and len(node.input) == 2
            and bool(node.input[1]))


def _plan(node: onnx.NodeProto, axes: dict[str, np.ndarray], types: dict, runtime_ones: bool) -> tuple | None:
    """(element type, leading dims, trailing dims, keepdims) when ``node`` can be rewritten; with
    ``runtime_ones``, also where too few leading values are static but some are dynamic."""
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
    if _rows_at_run_time(leading) and (not runtime_ones or all(isinstance(d, int) for d in leading)):
        return None
    keep = next((x.i for x in node.attribute if x.name == "keepdims"), 1)
    return tp.tensor_type.elem_type, leading, [int(d) for d in trailing], bool(keep)


def _rows_at_run_time(leading: list) -> bool:
    """Whether a sum over ``leading`` dims takes its row of ones made at run time (too few static rows)."""
    return _static_rows(leading) < MIN_ROWS


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
    shape = [1] * len(leading) + trailing if keep else trailing
    if _rows_at_run_time(leading):  # every row's one made at run time: (R,) @ (R, C) is already (C)
        matrix = x if len(leading) == 1 and len(trailing) == 1 else make(
            "Reshape", [x, const("rows", np.array([-1, columns], np.int64))])
        count = make("Shape", [matrix], start=0, end=1)
        one = numpy_helper.from_array(np.ones(1, _FLOATS[elem]), "value")
        ones = make("ConstantOfShape", [count], value=one)
        summed = make("MatMul", [ones, matrix], out if shape == [columns] else None)
        if shape != [columns]:
            make("Reshape", [summed, const("shape", np.array(shape, np.int64))], out)
        return nodes, consts
    ones = const("ones", np.ones((1, rows), _FLOATS[elem]))
    everything = all(isinstance(d, int) for d in leading)
    # x is already (R, C) or (M, P, C) with one leading dim per role and one trailing dim
    fits = len(trailing) == 1 and len(leading) == (1 if everything else 2)
    want = [rows, columns] if everything else [-1, rows, columns]
    matrix = x if fits else make("Reshape", [x, const("rows", np.array(want, np.int64))])
    summed = make("MatMul", [ones, matrix])  # (1, C) or (M, 1, C)
    if not everything:
        flat = len(trailing) == 1 and not keep
        summed = make("ReduceSum", [summed, const("axes", np.array([0, 1], np.int64))],
                      out if flat else None, keepdims=0)
        if flat:
            return nodes, consts
    make("Reshape", [summed, const("shape", np.array(shape, np.int64))], out)
    return nodes, consts


# A float32 gradient's sum of squares (gradient-norm clipping's global norm) over at least this many values
# runs as row sums, then their sum: onnxruntime 1.32's ReduceSumSquare over all of a 1024² tensor is 2.3e-5
# off the float64 sum (1.8e-4 at 2048²), the two-level form 1e-8 (2e-7), in about twice its time.
SQUARES_FROM = 1 << 16
MIN_ROW_LENGTH = 64  # a split into rows this long or longer (a divisor of the size near its square root)


def two_level_sum_squares(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each float32 ``ReduceSumSquare`` over all of a large static tensor (keepdims 0) as a
    sum of row sums of squares (a copy), or ``model``. Applied by the plan after its split into pieces
    (:mod:`onnxtrain.engine.ort_chunks`), whose analysis takes such a sum as one reduction."""
    g = model.graph
    if not any(_is_total_squares(n) for n in g.node):
        return model
    types = value_types(model)
    plans = {k: rows for k, n in enumerate(g.node) if _is_total_squares(n)
             and (rows := _square_rows(symbolic_shape(types, n.input[0]), types.get(n.input[0]))) is not None}
    if not plans:
        return model
    opset = model_opset(model)

    def replace(k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        base, y = n.name or "ReduceSumSquare", n.output[0]
        shape = numpy_helper.from_array(np.array(plans[k], np.int64), names(f"{y}/rows"))
        out.graph.initializer.append(shape)
        rows, squares = names(f"{y}/Reshape"), names(f"{y}/ReduceSumSquare")
        if opset >= 18:  # axes as an input
            axis = numpy_helper.from_array(np.array([1], np.int64), names(f"{y}/axis"))
            out.graph.initializer.append(axis)
            per_row = helper.make_node("ReduceSumSquare", [rows, axis.name], [squares], keepdims=0,
                                       name=names(f"{base}/rows"))
        else:
            per_row = helper.make_node("ReduceSumSquare", [rows], [squares], axes=[1], keepdims=0,
                                       name=names(f"{base}/rows"))
        return [helper.make_node("Reshape", [n.input[0], shape.name], [rows], name=names(f"{base}/Reshape")),
                per_row, helper.make_node("ReduceSum", [squares], [y], keepdims=0, name=names(f"{base}/sum"))]

    return with_nodes_replaced(model, plans, replace)


def _is_total_squares(node: onnx.NodeProto) -> bool:
    """A ReduceSumSquare over every axis to one value (keepdims 0, no axes)."""
    if node.op_type != "ReduceSumSquare" or node.domain not in DEFAULT_DOMAINS:
        return False
    attrs = {a.name: a for a in node.attribute}
    return ("axes" not in attrs and (len(node.input) < 2 or not node.input[1])
            and "keepdims" in attrs and attrs["keepdims"].i == 0)


def _square_rows(shape: list | None, tp: onnx.TypeProto | None) -> list[int] | None:
    """[rows, row length] splitting a float32 tensor of static ``shape`` for the two-level sum, or None."""
    if shape is None or tp is None or tp.tensor_type.elem_type != TensorProto.FLOAT:
        return None
    if not all(isinstance(d, int) for d in shape):
        return None
    n = int(np.prod(shape, dtype=np.int64))
    if n < SQUARES_FROM:
        return None
    length = int(np.sqrt(n))
    while length >= MIN_ROW_LENGTH and n % length:
        length -= 1
    return [n // length, length] if length >= MIN_ROW_LENGTH else None
