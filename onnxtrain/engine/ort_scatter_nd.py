"""Combining ScatterNDs (a reduction: the gradient of a Gather such as an embedding's, or of a GatherND such
as torch's ``x[i, j]``) run by onnxruntime as a chain of ScatterNDs over pieces of the index tuples, each
too small for onnxruntime to split over threads.

onnxruntime's CPU ScatterND hands its index tuples out to the intra-op threads in blocks and combines each
update into its data row with a plain read-modify-write, no lock: when two threads hold tuples naming one
row (repeated tokens), one of the two updates can be lost, and which one depends on the timing. Measured
with onnxruntime 1.32 on 2 threads: an embedding gradient of 2048 token rows of 128 into a 1000 × 128
table came out different from the serial sum in 167 of 300 runs, off by up to 4.2 where the gradient's
values reach 9.6; the 2-layer transformer encoder trained on the onnxruntime backend gave other losses
and weights from one run to the next (from the fourth step on). Tuples of two indices race alike (4096
tuples of 600 distinct values into a 30 × 20 × 64 table: 84 to 181 of 300 runs wrong, by up to 5.0).

onnxruntime splits the loop over tuples only when Eigen's cost model, which counts one cycle per element
to combine, gives it two threads or more: ``(elements − 100000) / 100000 + 0.9 ≥ 2``, 210,000 update
elements and up, whatever the pool's size (a scatter of 180,000 never lost an update at 2 or 8 threads).
So a scatter of fewer than :data:`SERIAL_ELEMENTS` update elements stays as it is, and a larger one
becomes ScatterNDs of :data:`PIECE_ELEMENTS` elements or fewer (at least one tuple each), each combining
into the previous one's output:

    out_0 = data;  out_p = ScatterND(out_{p-1}, indices[p·t : (p+1)·t], updates[p·t : (p+1)·t])

(``t`` tuples a piece, indices as [tuples, k] and updates as [tuples, *data.shape[k:]]). Each piece runs on
one thread in tuple order and the pieces run in order, so every element combines its updates in index
order: a serial ScatterND's values, and the numpy engine's kernel's, bit for bit; negative indices and
tuples out of range are ScatterND's own business still (its errors). When the sizes are known before the
run the pieces are Slices of constant bounds; else a Loop over the pieces, behind an ``If`` on
``Size(updates)`` that keeps the plain ScatterND for the small scatters. A graph onnxruntime runs on one
intra-op thread keeps its ScatterNDs: they are serial there.

The pieces cost next to nothing (the 2048 × 128 gradient above: 0.245 ms in two pieces against 0.243 for
the racy ScatterND, minimum of 400 runs); the single ScatterElements over the flattened data this module
made before took 1.06 ms.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

SERIAL_ELEMENTS = 200_000  # update elements below which onnxruntime's ScatterND runs on one thread (210,000)
PIECE_ELEMENTS = 1 << 17  # update elements of one piece at most (unless one tuple holds more)
_MAX_CHAIN = 32  # pieces laid out as nodes at most; more take a Loop
_MIN_OPSET = 16  # ScatterND's reduction (and Shape's start, from 15)


def _combines(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ScatterND" and node.domain in DEFAULT_DOMAINS
            and any(a.name == "reduction" and a.s not in (b"", b"none") for a in node.attribute))


def serial_scatter_nds(model: onnx.ModelProto, typed: Callable[[], dict],
                       threads: int | None = None) -> onnx.ModelProto:
    """``model`` with each combining ScatterND that onnxruntime could split over threads computed in pieces
    as the module docstring says (a copy), or ``model`` itself. ``typed()``: the model's value types (names
    the rewrites before this one made may be missing). ``threads``: onnxruntime's intra-op threads (None:
    its default); on one, its ScatterNDs run serially and stay."""
    opset = next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if (threads == 1 or opset < _MIN_OPSET
            or not any(_combines(n) for g in walk_graphs(model.graph) for n in g.node)):
        return model
    types = typed()
    plans: dict[int, dict[int, _Plan]] = {}  # graph → node → its plan
    graphs = list(walk_graphs(model.graph))
    for k, g in enumerate(graphs):
        made_by_cast = {n.output[0]: a.i for n in g.node if n.op_type == "Cast"
                        for a in n.attribute if a.name == "to"}
        for j, n in enumerate(g.node):
            if not _combines(n):
                continue
            plan = _plan(n, types, made_by_cast)
            if plan is not None:
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
            plan = plans[k].get(j)
            if plan is None:
                nodes.append(n)
            elif plan.sizes is not None:  # sizes known and large: the pieces as nodes
                nodes.extend(_chain(n, plan.k, *plan.sizes, names))
            elif plan.large:  # too large, some size unknown: the Loop at every run
                nodes.extend(_looped(n, n.output[0], plan.k, plan.elem_type, names))
            else:
                nodes.extend(_guarded(n, plan, names))
        del g.node[:]
        g.node.extend(nodes)
    return out


class _Plan:
    """How a ScatterND is rewritten: its tuples' length ``k``; ``sizes`` (tuples, elements per tuple) when
    known and worth a chain of pieces; ``large``: too large for one thread whatever the run; ``elem_type``:
    its data's element type (0 when unknown)."""

    def __init__(self, k: int, sizes: tuple[int, int] | None, large: bool, elem_type: int) -> None:
        self.k, self.sizes, self.large, self.elem_type = k, sizes, large, elem_type


def _plan(n: onnx.NodeProto, types: dict, made_by_cast: dict[str, int]) -> _Plan | None:
    """None: leave ``n`` (small enough for one thread, or its tuples' length unknown)."""
    indices = _dims(types.get(n.input[1]))
    k = indices[-1] if indices else None
    if not isinstance(k, int) or k < 1:
        return None
    data = _dims(types.get(n.input[0]))
    if data is not None and len(data) < k:
        return None  # onnxruntime's own error
    data_type = types.get(n.input[0]) or types.get(n.output[0])
    et = data_type.tensor_type.elem_type if data_type is not None and data_type.HasField("tensor_type") else 0
    et = et or made_by_cast.get(n.input[0], 0)
    updates = _dims(types.get(n.input[2]))
    if updates is not None and all(isinstance(d, int) for d in updates):
        if math.prod(updates) < SERIAL_ELEMENTS:
            return None
        lead = len(indices) - 1
        tuples, row = math.prod(updates[:lead]), math.prod(updates[lead:])
        per = max(1, PIECE_ELEMENTS // max(row, 1))
        if -(-tuples // per) <= _MAX_CHAIN:
            return _Plan(k, (tuples, row), True, et)
        return _Plan(k, None, True, et)
    return _Plan(k, None, False, et)


def _dims(tp: onnx.TypeProto | None) -> list[int | None] | None:
    """The dims of a tensor type (None for an unknown one), or None without a known rank."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]


def _piece_inputs(n: onnx.NodeProto, k: int, result: str, names: NameGen,
                  nodes: list[onnx.NodeProto]) -> tuple[str, str, Callable[..., str]]:
    """Nodes (appended to ``nodes``) making ``n``'s indices [tuples, k] and updates [tuples, *rows]; returns
    their names and the node maker used."""
    data, indices, updates = n.input
    base = n.name or "ScatterND"

    def make(op: str, ins: list[str], what: str, **attrs: object) -> str:
        value = names(f"{result}/{what}")
        nodes.append(helper.make_node(op, ins, [value], name=names(f"{base}/{what}"), **attrs))
        return value

    def const(what: str, value: np.ndarray) -> str:
        return make("Constant", [], what, value=numpy_helper.from_array(value))

    tuples = make("Reshape", [indices, const("tuple_shape", np.array([-1, k], np.int64))], "tuples")
    rows_shape = make("Concat", [const("any", np.array([-1], np.int64)),
                                 make("Shape", [data], "row_dims", start=k)], "rows_shape", axis=0)
    rows = make("Reshape", [updates, rows_shape], "rows")
    return tuples, rows, make


def _int64s(v: int) -> onnx.TensorProto:
    return numpy_helper.from_array(np.array([v], np.int64))


def _scatter(n: onnx.NodeProto, ins: list[str], out: str, name: str) -> onnx.NodeProto:
    node = helper.make_node("ScatterND", ins, [out], name=name)
    node.attribute.extend(a for a in n.attribute if a.name == "reduction")
    return node


def _chain(n: onnx.NodeProto, k: int, tuples: int, row: int, names: NameGen) -> list[onnx.NodeProto]:
    """ScatterND ``n`` as ScatterNDs of pieces of constant bounds (``tuples`` of ``row`` elements)."""
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []
    idx, upd, make = _piece_inputs(n, k, n.output[0], names, nodes)
    per = max(1, PIECE_ELEMENTS // max(row, 1))
    acc = n.input[0]
    starts = list(range(0, tuples, per))
    for p, start in enumerate(starts):
        bounds = [make("Constant", [], f"piece_{p}_{w}", value=_int64s(v))
                  for w, v in (("start", start), ("end", min(start + per, tuples)))]
        piece = [make("Slice", [x, *bounds], f"piece_{p}_{what}")
                 for x, what in ((idx, "tuples"), (upd, "rows"))]
        out = n.output[0] if p == len(starts) - 1 else names(f"{n.output[0]}/after_piece_{p}")
        nodes.append(_scatter(n, [acc, *piece], out, names(f"{base}/piece_{p}")))
        acc = out
    return nodes


def _looped(n: onnx.NodeProto, result: str, k: int, elem_type: int, names: NameGen) -> list[onnx.NodeProto]:
    """ScatterND ``n`` as a Loop over pieces of its tuples, into ``result``."""
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []
    idx, upd, make = _piece_inputs(n, k, result, names, nodes)

    def const(what: str, value: np.ndarray) -> str:
        return make("Constant", [], what, value=numpy_helper.from_array(value))

    one = const("one", np.array(1, np.int64))
    row = make("ReduceProd", [make("Concat", [make("Shape", [n.input[0]], "row_dims_of_data", start=k),
                                              const("one_dim", np.array([1], np.int64))], "row_dims_or_1",
                                 axis=0)], "row_size", keepdims=0)
    per = make("Max", [make("Div", [const("piece", np.array(PIECE_ELEMENTS, np.int64)), row], "fit"), one],
               "per_piece")
    count = make("Squeeze", [make("Shape", [idx], "tuple_count", end=1)], "tuples_count")
    trips = make("Div", [make("Add", [count, make("Sub", [per, one], "per_less_one")], "rounded_up"), per],
                 "pieces")
    # the body: piece i of the tuples and rows, combined into the data carried from piece to piece
    i, cond_in, acc_in = names(f"{base}/piece"), names(f"{base}/go"), names(f"{base}/acc")
    acc_out, cond_out = names(f"{base}/acc_next"), names(f"{base}/go_next")
    body_nodes: list[onnx.NodeProto] = []

    def body(op: str, ins: list[str], what: str, **attrs: object) -> str:
        value = names(f"{result}/{what}")
        body_nodes.append(helper.make_node(op, ins, [value], name=names(f"{base}/{what}"), **attrs))
        return value

    axis = body("Constant", [], "axis_0", value=numpy_helper.from_array(np.array([0], np.int64)))
    start = body("Unsqueeze", [body("Mul", [i, per], "start_scalar"), axis], "start")
    end = body("Add", [start, per], "end")
    piece = [body("Slice", [x, start, end], f"piece_{what}") for x, what in ((idx, "tuples"), (upd, "rows"))]
    body_nodes.append(_scatter(n, [acc_in, *piece], acc_out, names(f"{base}/piece_scatter")))
    body_nodes.append(helper.make_node("Identity", [cond_in], [cond_out], name=names(f"{base}/go_on")))

    def typed(name: str) -> onnx.ValueInfoProto:
        return (helper.make_tensor_value_info(name, elem_type, None) if elem_type
                else onnx.ValueInfoProto(name=name))

    graph = helper.make_graph(
        body_nodes, names(f"{base}_pieces"),
        [helper.make_tensor_value_info(i, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond_in, TensorProto.BOOL, []), typed(acc_in)],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []), typed(acc_out)])
    nodes.append(helper.make_node("Loop", [trips, "", n.input[0]], [result], name=names(f"{base}/pieces"),
                                  body=graph))
    return nodes


def _guarded(n: onnx.NodeProto, plan: _Plan, names: NameGen) -> list[onnx.NodeProto]:
    """``If(Size(updates) >= SERIAL_ELEMENTS)``: the Loop over pieces, else ScatterND ``n`` as it is."""
    base = n.name or "ScatterND"
    size = names(f"{n.output[0]}/updates_size")
    limit = names(f"{n.output[0]}/serial_limit")
    large = names(f"{n.output[0]}/splits")
    pieces_out, nd_out = names(f"{n.output[0]}/pieces_result"), names(f"{n.output[0]}/nd_result")

    def result(name: str) -> onnx.ValueInfoProto:
        return (helper.make_tensor_value_info(name, plan.elem_type, None) if plan.elem_type
                else onnx.ValueInfoProto(name=name))

    then_branch = helper.make_graph(_looped(n, pieces_out, plan.k, plan.elem_type, names),
                                    names(f"{base}_pieces"), [], [result(pieces_out)])
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
