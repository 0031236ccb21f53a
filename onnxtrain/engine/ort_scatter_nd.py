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
run the pieces are Slices of constant bounds; else :data:`RUNTIME_PIECES` pieces of run-time bounds (the
ones past the last tuple empty), behind an ``If`` on ``Size(updates)`` that keeps the plain ScatterND for
the small scatters. A graph onnxruntime runs on one intra-op thread keeps its ScatterNDs: they are serial
there.

Each piece copies the data (onnxruntime's ScatterND does not write into its input), so data larger than
:data:`CHAIN_DATA_ELEMENTS`, or more pieces than laid out, take one ScatterElements over the flat data
instead, whose cost grows with the updates only:

    pos = Reshape(start · 1 + Range(0, R, 1), [-1])     R the elements of one data row
    out = Reshape(ScatterElements(Reshape(data, [-1]), pos, Reshape(updates, [-1]), axis=0), Shape(data))

where a tuple's ``start`` is ``Σ i_m · stride_m`` (each negative ``i_m`` first taken from the end of its
axis), or ``Size(data)`` for a tuple holding an index out of range, which no element reaches, so that
ScatterElements refuses it as ScatterND did (one index out of range could otherwise land on another row).
ScatterElements over one axis of a 1-D tensor walks its updates in order on one thread: the same bits.

Cost, minimum of 400 runs at 2 threads: the transformer's 2048 × 128 embedding gradient into 1000 rows
0.19 ms in two pieces (0.26 behind the run-time If, four pieces) against 0.10 for the racy ScatterND; the
flat ScatterElements 1.06 ms (about 4 % of the transformer's 28 ms step), 1.5 ms for 2048 × 128 into a
1000 × 8 × 128 tensor (0.3 racy).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

SERIAL_ELEMENTS = 200_000  # update elements below which onnxruntime's ScatterND runs on one thread (210,000)
PIECE_ELEMENTS = 1 << 17  # update elements of one piece at most (unless one tuple holds more)
_MAX_CHAIN = 32  # pieces of constant bounds laid out as nodes at most; more take the flat ScatterElements
RUNTIME_PIECES = 4  # pieces laid out for a scatter of run-time sizes; more take the flat ScatterElements
CHAIN_DATA_ELEMENTS = 1 << 19  # data elements at most for pieces (each copies the data); more: flat
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
            elif plan.large:  # sizes known, too many pieces: the flat ScatterElements
                nodes.extend(_flat_scatter(n, n.output[0], names, plan.k))
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
        small_data = data is not None and all(isinstance(d, int) for d in data) and \
            math.prod(data) <= CHAIN_DATA_ELEMENTS
        if small_data and -(-tuples // per) <= _MAX_CHAIN:
            return _Plan(k, (tuples, row), True, et)
        return _Plan(k, None, True, et)
    return _Plan(k, None, False, et)


def _dims(tp: onnx.TypeProto | None) -> list[int | None] | None:
    """The dims of a tensor type (None for an unknown one), or None without a known rank."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]


def _writers(n: onnx.NodeProto, result: str, names: NameGen, nodes: list[onnx.NodeProto]
             ) -> tuple[Callable[..., str], Callable[[str, np.ndarray], str]]:
    """Makers of the nodes (appended to ``nodes``) that compute ``n`` into ``result``: ``make(op, inputs,
    what, **attrs)`` and ``const(what, array)``, each returning its output's name."""
    base = n.name or "ScatterND"

    def make(op: str, ins: list[str], what: str, **attrs: object) -> str:
        value = names(f"{result}/{what}")
        nodes.append(helper.make_node(op, ins, [value], name=names(f"{base}/{what}"), **attrs))
        return value

    def const(what: str, value: np.ndarray) -> str:
        return make("Constant", [], what, value=numpy_helper.from_array(value))

    return make, const


def _piece_inputs(n: onnx.NodeProto, k: int, result: str, names: NameGen,
                  nodes: list[onnx.NodeProto]) -> tuple[str, str, Callable[..., str]]:
    """Nodes (appended to ``nodes``) making ``n``'s indices [tuples, k] and updates [tuples, *rows]; returns
    their names and the node maker used."""
    data, indices, updates = n.input
    make, const = _writers(n, result, names, nodes)
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
    nodes: list[onnx.NodeProto] = []
    idx, upd, make = _piece_inputs(n, k, n.output[0], names, nodes)
    per = max(1, PIECE_ELEMENTS // max(row, 1))
    bounds = [(make("Constant", [], f"piece_{p}_start", value=_int64s(start)),
               make("Constant", [], f"piece_{p}_end", value=_int64s(min(start + per, tuples))))
              for p, start in enumerate(range(0, tuples, per))]
    return nodes + _pieces(n, idx, upd, bounds, n.output[0], names)


def _pieces(n: onnx.NodeProto, idx: str, upd: str, bounds: list[tuple[str, str]], result: str,
            names: NameGen) -> list[onnx.NodeProto]:
    """ScatterNDs of ``n``'s reduction over the slices [start, end) of ``idx`` and ``upd``, in turn, into
    ``result``."""
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []
    acc = n.input[0]
    for p, (start, end) in enumerate(bounds):
        piece = []
        for x, what in ((idx, "tuples"), (upd, "rows")):
            piece.append(names(f"{result}/piece_{p}_{what}"))
            nodes.append(helper.make_node("Slice", [x, start, end], [piece[-1]],
                                          name=names(f"{base}/piece_{p}_{what}")))
        out = result if p == len(bounds) - 1 else names(f"{result}/after_piece_{p}")
        nodes.append(_scatter(n, [acc, *piece], out, names(f"{base}/piece_{p}")))
        acc = out
    return nodes


def _runtime_pieces(n: onnx.NodeProto, result: str, k: int, elem_type: int,
                    names: NameGen) -> list[onnx.NodeProto]:
    """ScatterND ``n`` whose sizes are known at run time only, into ``result``: :data:`RUNTIME_PIECES`
    pieces of run-time bounds when its tuples fit in them (those past the last tuple empty), else the
    ScatterElements over the flat data (:func:`_flat_scatter`)."""
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []
    idx, upd, make = _piece_inputs(n, k, result, names, nodes)
    row = make("ReduceProd", [make("Concat", [make("Shape", [n.input[0]], "row_dims_of_data", start=k),
                                              make("Constant", [], "one_dim", value=_int64s(1))],
                                   "row_dims_or_1", axis=0)], "row_size", keepdims=1)
    piece = make("Constant", [], "piece", value=_int64s(PIECE_ELEMENTS))
    per = make("Max", [make("Div", [piece, row], "fit"), make("Constant", [], "one", value=_int64s(1))],
               "per_piece")
    count = make("Shape", [idx], "tuple_count", end=1)
    room = make("Mul", [per, make("Constant", [], "pieces", value=_int64s(RUNTIME_PIECES))], "room")
    small = make("LessOrEqual", [make("Size", [n.input[0]], "data_size"),
                                 make("Constant", [], "data_limit", value=_int64s(CHAIN_DATA_ELEMENTS))],
                 "small_data")
    fits = make("Squeeze", [make("And", [make("LessOrEqual", [count, room], "tuples_fit"), small],
                                 "fits_1d")], "fits")
    chained, flat = names(f"{result}/chained"), names(f"{result}/flat_result")
    bound_nodes: list[onnx.NodeProto] = []
    bounds = []
    for p in range(RUNTIME_PIECES):
        ends = names(f"{result}/piece_{p}_end")
        bound_nodes.append(helper.make_node("Mul", [per, make("Constant", [], f"piece_{p}_number",
                                                              value=_int64s(p + 1))], [ends],
                                            name=names(f"{base}/piece_{p}_end")))
        bounds.append((bounds[-1][1] if bounds else make("Constant", [], "first_start", value=_int64s(0)),
                       ends))
    then_branch = helper.make_graph(bound_nodes + _pieces(n, idx, upd, bounds, chained, names),
                                    names(f"{base}_pieces"), [], [_branch_output(chained, elem_type)])
    else_branch = helper.make_graph(_flat_scatter(n, flat, names, k), names(f"{base}_flat"), [],
                                    [_branch_output(flat, elem_type)])
    nodes.append(helper.make_node("If", [fits], [result], name=names(f"{base}/fits_pieces"),
                                  then_branch=then_branch, else_branch=else_branch))
    return nodes


def _flat_scatter(n: onnx.NodeProto, result: str, names: NameGen, k: int = 1) -> list[onnx.NodeProto]:
    """Nodes computing ScatterND ``n`` (``k`` indices per tuple) as a ScatterElements over the flat data,
    into ``result``."""
    data, indices, updates = n.input
    base = n.name or "ScatterND"
    nodes: list[onnx.NodeProto] = []
    make, const = _writers(n, result, names, nodes)
    flat_shape = const("flat_shape", np.array([-1], np.int64))
    row = make("ReduceProd", [make("Shape", [data], "row_dims", start=k)], "row_size", keepdims=0)
    offsets = make("Range", [const("zero", np.array(0, np.int64)), row, const("one", np.array(1, np.int64))],
                   "row_offsets")
    if k == 1:
        starts = make("Mul", [make("Reshape", [indices, const("column", np.array([-1, 1], np.int64))],
                                   "rows"), row], "row_starts")
    else:
        starts = _tuple_starts(make, const, data, indices, k)
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


def _tuple_starts(make: Callable[..., str], const: Callable[[str, np.ndarray], str], data: str, indices: str,
                  k: int) -> str:
    """[tuples, 1]: the flat position of each tuple's first element, Σ index_j · stride_j over its ``k``
    indices (each negative one counted from the end of its axis); Size(data) for a tuple with an index
    out of range, which no element of that row can reach, so that ScatterElements refuses it."""
    one = const("one_dim", np.array([1], np.int64))
    # stride_j = Π data.shape[j+1:]: the product of the dims after j (and 1, for the last axis's)
    after = [make("Concat", [make("Shape", [data], f"after_{j}", start=j + 1), one], f"after_{j}_or_1",
                  axis=0) for j in range(k)]
    strides = make("Concat", [make("ReduceProd", [a], f"stride_{j}", keepdims=1)
                              for j, a in enumerate(after)], "strides", axis=0)
    dims = make("Shape", [data], "tuple_dims", end=k)
    tuples = make("Reshape", [indices, const("tuple_shape", np.array([-1, k], np.int64))], "tuples")
    zero = const("zero_index", np.array(0, np.int64))
    negative = make("Less", [tuples, zero], "negative")
    wrapped = make("Where", [negative, make("Add", [tuples, dims], "from_end"), tuples], "wrapped")
    outside = make("Or", [make("Less", [wrapped, zero], "below"),
                          make("GreaterOrEqual", [wrapped, dims], "above")], "outside")
    # each term ≥ 0 in range; one out of range is Size(data) itself, and all of them sum to that or more
    terms = make("Where", [outside, make("Size", [data], "data_size"),
                           make("Mul", [wrapped, strides], "scaled")], "terms")
    return make("ReduceSum", [terms, one], "row_starts", keepdims=1)


def _branch_output(name: str, elem_type: int) -> onnx.ValueInfoProto:
    """An If branch's output ``name``: a tensor of ``elem_type`` of any shape, or untyped when that is 0
    (the data's type unknown)."""
    return (helper.make_tensor_value_info(name, elem_type, None) if elem_type
            else onnx.ValueInfoProto(name=name))


def _guarded(n: onnx.NodeProto, plan: _Plan, names: NameGen) -> list[onnx.NodeProto]:
    """``If(Size(updates) >= SERIAL_ELEMENTS)``: the pieces of run-time bounds, else ScatterND ``n``."""
    base = n.name or "ScatterND"
    size = names(f"{n.output[0]}/updates_size")
    limit = names(f"{n.output[0]}/serial_limit")
    large = names(f"{n.output[0]}/splits")
    pieces_out, nd_out = names(f"{n.output[0]}/pieces_result"), names(f"{n.output[0]}/nd_result")
    then_branch = helper.make_graph(_runtime_pieces(n, pieces_out, plan.k, plan.elem_type, names),
                                    names(f"{base}_pieces"), [], [_branch_output(pieces_out, plan.elem_type)])
    kept = onnx.NodeProto()
    kept.CopyFrom(n)
    del kept.output[:]
    kept.output.append(nd_out)
    else_branch = helper.make_graph([kept], names(f"{base}_nd"), [], [_branch_output(nd_out, plan.elem_type)])
    return [
        helper.make_node("Size", [n.input[2]], [size], name=names(f"{base}/updates_size")),
        helper.make_node("Constant", [], [limit], name=names(f"{base}/serial_limit"),
                         value=numpy_helper.from_array(np.array(SERIAL_ELEMENTS, np.int64))),
        helper.make_node("GreaterOrEqual", [size, limit], [large], name=names(f"{base}/splits")),
        helper.make_node("If", [large], [n.output[0]], name=names(f"{base}/serial"),
                         then_branch=then_branch, else_branch=else_branch),
    ]
