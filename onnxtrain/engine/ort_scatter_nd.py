"""Combining row scatters (``ScatterND`` with a reduction and one index per tuple, the gradient of a Gather
such as an embedding's) rewritten for onnxruntime as a ``ScatterElements`` over the flattened data.

onnxruntime's CPU ScatterND hands its index tuples out to the intra-op threads in blocks and combines each
update into its data row with a plain read-modify-write, no lock: when two threads hold tuples naming one
row (repeated tokens), one of the two updates can be lost, and which one depends on the timing. Measured
with onnxruntime 1.32 on 2 threads: an embedding gradient of 2048 token rows of 128 into a 1000 × 128
table came out different from the serial sum in 167 of 300 runs, off by up to 4.2 where the gradient's
values reach 9.6; the 2-layer transformer encoder trained on the onnxruntime backend gave other losses
and weights from one run to the next (from the fourth step on).

onnxruntime splits such a loop only when Eigen's cost model, which counts one cycle per element to
combine, gives it two threads or more (210,000 elements and up): a scatter of fewer than
:data:`SERIAL_ELEMENTS` update elements (known before the run) stays as it is, and one whose count is
known only at run time takes an ``If`` on it (``Size(updates)``) between the ScatterND and its rewrite:

    R    = ReduceProd(Shape(data, start=1))                  elements of one data row
    pos  = Reshape(Reshape(indices, [-1, 1]) · R + Range(0, R, 1), [-1])
    out  = Reshape(ScatterElements(Reshape(data, [-1]), pos, Reshape(updates, [-1]), axis=0), Shape(data))

A negative index ``i`` (≥ −rows) gives ``i·R + j`` ≥ −rows·R, the same element counted from the end of the
flat data, and an index out of range stays out of range there, so ScatterElements refuses what ScatterND
refused. ScatterElements over one axis of a 1-D tensor walks its updates in order on one thread, so each
element combines its updates in index order: the values of a serial ScatterND, and of the numpy engine's
kernel, bit for bit. It is slower (about 1 ms against 0.09 ms for the 2048 × 128 gradient above, under
1.5 % of the transformer's step), which is why the small scatters keep their ScatterND. Scatters of
tuples of more than one index (a GatherND's gradient) are left as they are: a flat position made from
several indices would let one out of range land on another row without an error.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

SERIAL_ELEMENTS = 1 << 15  # update elements below which onnxruntime combines a ScatterND on one thread
_MIN_OPSET = 16  # ScatterND's reduction (and Shape's start, from 15)


def _combines(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ScatterND" and node.domain in DEFAULT_DOMAINS
            and any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute))


def serial_scatter_nds(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each combining ScatterND of one index per tuple that onnxruntime could split over
    threads computed as the ScatterElements of the module docstring (a copy), or ``model`` itself.
    ``typed()``: the model's value types (names the rewrites before this one made may be missing)."""
    opset = next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if opset < _MIN_OPSET or not any(_combines(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    types = typed()
    plans: dict[int, dict[int, int | None]] = {}  # graph → node → element type of an If's result
    graphs = list(walk_graphs(model.graph))
    for k, g in enumerate(graphs):
        made_by_cast = {n.output[0]: a.i for n in g.node if n.op_type == "Cast"
                        for a in n.attribute if a.name == "to"}
        for j, n in enumerate(g.node):
            if not _combines(n):
                continue
            plan = _plan(n, types, made_by_cast)
            if plan is not False:
                plans.setdefault(k, {})[j] = plan
    if not plans:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    out_graphs = list(walk_graphs(out.graph))
    # innermost bodies first: rebuilding a graph's node list copies the bodies its nodes hold
    for k in sorted(plans, reverse=True):
        g = out_graphs[k]
        nodes: list[onnx.NodeProto] = []
        for j, n in enumerate(g.node):
            if j not in plans[k]:
                nodes.append(n)
            elif plans[k][j] is None:  # too large: the rewrite at every run
                nodes.extend(_flat_scatter(n, n.output[0], names))
            else:
                nodes.extend(_guarded(n, plans[k][j], names))
        del g.node[:]
        g.node.extend(nodes)
    return out


def _plan(n: onnx.NodeProto, types: dict, made_by_cast: dict[str, int]) -> int | None | bool:
    """False: leave ``n``; None: rewrite it; an element type: rewrite it behind an If on the updates' size
    (the type of the If's result; 0 when unknown)."""
    indices = _dims(types.get(n.input[1]))
    if indices is None or not indices or indices[-1] != 1:
        return False
    updates = _dims(types.get(n.input[2]))
    if updates is not None and all(isinstance(d, int) for d in updates):
        return None if math.prod(updates) >= SERIAL_ELEMENTS else False
    data_type = types.get(n.input[0]) or types.get(n.output[0])
    et = data_type.tensor_type.elem_type if data_type is not None and data_type.HasField("tensor_type") else 0
    return et or made_by_cast.get(n.input[0], 0)


def _dims(tp: onnx.TypeProto | None) -> list[int | None] | None:
    """The dims of a tensor type (None for an unknown one), or None without a known rank."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]


def _flat_scatter(n: onnx.NodeProto, result: str, names: NameGen) -> list[onnx.NodeProto]:
    """Nodes computing ScatterND ``n`` (one index per tuple) as a ScatterElements over the flat data, into
    ``result``."""
    data, indices, updates = n.input
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []

    def make(op: str, ins: list[str], what: str, **attrs: object) -> str:
        value = names(f"{result}/{what}")
        nodes.append(helper.make_node(op, ins, [value], name=names(f"{base}/{what}"), **attrs))
        return value

    def const(what: str, value: np.ndarray) -> str:
        return make("Constant", [], what, value=numpy_helper.from_array(value))

    flat_shape = const("flat_shape", np.array([-1], np.int64))
    row = make("ReduceProd", [make("Shape", [data], "row_dims", start=1)], "row_size", keepdims=0)
    offsets = make("Range", [const("zero", np.array(0, np.int64)), row, const("one", np.array(1, np.int64))],
                   "row_offsets")
    rows = make("Reshape", [indices, const("column", np.array([-1, 1], np.int64))], "rows")
    starts = make("Mul", [rows, row], "row_starts")
    positions = make("Reshape", [make("Add", [starts, offsets], "positions_2d"), flat_shape], "positions")
    scatter = helper.make_node(
        "ScatterElements",
        [make("Reshape", [data, flat_shape], "flat_data"), positions,
         make("Reshape", [updates, flat_shape], "flat_updates")],
        [names(f"{result}/flat")], name=names(base), axis=0)
    scatter.attribute.extend(a for a in n.attribute if a.name == "reduction")
    nodes.append(scatter)
    shape = make("Shape", [data], "shape")
    nodes.append(helper.make_node("Reshape", [scatter.output[0], shape], [result],
                                  name=names(f"{base}/back")))
    return nodes


def _guarded(n: onnx.NodeProto, elem_type: int, names: NameGen) -> list[onnx.NodeProto]:
    """``If(Size(updates) >= SERIAL_ELEMENTS)``: the flat ScatterElements, else ScatterND ``n`` as it is."""
    base = n.name or "ScatterND"
    size = names(f"{n.output[0]}/updates_size")
    limit = names(f"{n.output[0]}/serial_limit")
    large = names(f"{n.output[0]}/splits")
    flat_out, nd_out = names(f"{n.output[0]}/flat_result"), names(f"{n.output[0]}/nd_result")

    def result(name: str) -> onnx.ValueInfoProto:
        return (helper.make_tensor_value_info(name, elem_type, None) if elem_type
                else onnx.ValueInfoProto(name=name))

    then_branch = helper.make_graph(_flat_scatter(n, flat_out, names), names(f"{base}_flat"), [],
                                    [result(flat_out)])
    kept = onnx.NodeProto()
    kept.CopyFrom(n)
    del kept.output[:]
    kept.output.append(nd_out)
    else_branch = helper.make_graph([kept], names(f"{base}_nd"), [], [result(nd_out)])
    return [
        helper.make_node("Size", [n.input[2]], [size], name=names(f"{base}/updates_size")),
        helper.make_node("Constant", [], [limit], name=names(f"{base}/serial_limit"),
                         value=numpy_helper.from_array(np.array(SERIAL_ELEMENTS, np.int64))),
        helper.make_node("GreaterOrEqual", [size, limit], [large], name=names(f"{base}/splits")),
        helper.make_node("If", [large], [n.output[0]], name=names(f"{base}/serial"),
                         then_branch=then_branch, else_branch=else_branch),
    ]

