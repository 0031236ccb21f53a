"""Combining ScatterNDs (a reduction: the gradient of a Gather such as an embedding's, or of a GatherND such
as torch's ``x[i, j]``) rewritten for onnxruntime as a ``ScatterElements`` over the flattened data.

onnxruntime's CPU ScatterND hands its index tuples out to the intra-op threads in blocks and combines each
update into its data row with a plain read-modify-write, no lock: when two threads hold tuples naming one
row (repeated tokens), one of the two updates can be lost, and which one depends on the timing. Measured
with onnxruntime 1.32 on 2 threads: an embedding gradient of 2048 token rows of 128 into a 1000 × 128
table came out different from the serial sum in 167 of 300 runs, off by up to 4.2 where the gradient's
values reach 9.6; the 2-layer transformer encoder trained on the onnxruntime backend gave other losses
and weights from one run to the next (from the fourth step on). Tuples of two indices race alike (4096
tuples of 600 distinct values into a 30 × 20 × 64 table: 84 to 181 of 300 runs wrong, by up to 5.0).

onnxruntime splits such a loop only when Eigen's cost model, which counts one cycle per element to
combine, gives it two threads or more (210,000 elements and up): a scatter of fewer than
:data:`SERIAL_ELEMENTS` update elements (known before the run) stays as it is, and one whose count is
known only at run time takes an ``If`` on it (``Size(updates)``) between the ScatterND and its rewrite.
A graph onnxruntime runs on one intra-op thread keeps its ScatterNDs: they are serial there. For tuples
of one index:

    R    = ReduceProd(Shape(data, start=1))                  elements of one data row
    pos  = Reshape(Reshape(indices, [-1, 1]) · R + Range(0, R, 1), [-1])
    out  = Reshape(ScatterElements(Reshape(data, [-1]), pos, Reshape(updates, [-1]), axis=0), Shape(data))

A negative index ``i`` (≥ −rows) gives ``i·R + j`` ≥ −rows·R, the same element counted from the end of the
flat data, and an index out of range stays out of range there, so ScatterElements refuses what ScatterND
refused. Tuples of ``k`` > 1 indices start at ``Σ i_m · stride_m`` (``stride_m`` the product of data's
dims after axis ``m``, ``R`` that after axis ``k − 1``), each negative ``i_m`` first taken from the end
of its axis; there one index out of range could land on another row, so a tuple holding one starts at
``Size(data)`` instead (a ``Where``), out of the flat data's range, and ScatterElements refuses it.

ScatterElements over one axis of a 1-D tensor walks its updates in order on one thread, so each element
combines its updates in index order: the values of a serial ScatterND, and of the numpy engine's kernel,
bit for bit. It is slower (about 1 ms against 0.09 ms for the 2048 × 128 gradient above), which is why
the small scatters keep their ScatterND.
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


def serial_scatter_nds(model: onnx.ModelProto, typed: Callable[[], dict],
                       threads: int | None = None) -> onnx.ModelProto:
    """``model`` with each combining ScatterND that onnxruntime could split over threads computed as the
    ScatterElements of the module docstring (a copy), or ``model`` itself. ``typed()``: the model's value
    types (names the rewrites before this one made may be missing). ``threads``: onnxruntime's intra-op
    threads (None: its default); on one, its ScatterND runs serially and stays."""
    opset = next((int(o.version) for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    if (threads == 1 or opset < _MIN_OPSET
            or not any(_combines(n) for g in walk_graphs(model.graph) for n in g.node)):
        return model
    types = typed()
    plans: dict[int, dict[int, tuple[int, int | None]]] = {}  # graph → node → (k, an If's element type)
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
            if j not in plans[k]:
                nodes.append(n)
            elif plans[k][j][1] is None:  # too large: the rewrite at every run
                nodes.extend(_flat_scatter(n, n.output[0], names, plans[k][j][0]))
            else:
                nodes.extend(_guarded(n, plans[k][j][1], names, plans[k][j][0]))
        del g.node[:]
        g.node.extend(nodes)
    return out


def _plan(n: onnx.NodeProto, types: dict, made_by_cast: dict[str, int]) -> tuple[int, int | None] | None:
    """None: leave ``n``; else its tuples' length ``k`` and None (rewrite it) or an element type (rewrite it
    behind an If on the updates' size; the type of the If's result, 0 when unknown)."""
    indices = _dims(types.get(n.input[1]))
    k = indices[-1] if indices else None
    if not isinstance(k, int) or k < 1:
        return None
    data = _dims(types.get(n.input[0]))
    if data is not None and len(data) < k:
        return None  # onnxruntime's own error
    updates = _dims(types.get(n.input[2]))
    if updates is not None and all(isinstance(d, int) for d in updates):
        return (k, None) if math.prod(updates) >= SERIAL_ELEMENTS else None
    data_type = types.get(n.input[0]) or types.get(n.output[0])
    et = data_type.tensor_type.elem_type if data_type is not None and data_type.HasField("tensor_type") else 0
    return k, et or made_by_cast.get(n.input[0], 0)


def _dims(tp: onnx.TypeProto | None) -> list[int | None] | None:
    """The dims of a tensor type (None for an unknown one), or None without a known rank."""
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [d.dim_value if d.HasField("dim_value") else None for d in tp.tensor_type.shape.dim]


def _flat_scatter(n: onnx.NodeProto, result: str, names: NameGen, k: int = 1) -> list[onnx.NodeProto]:
    """Nodes computing ScatterND ``n`` (``k`` indices per tuple) as a ScatterElements over the flat data,
    into ``result``."""
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


def _guarded(n: onnx.NodeProto, elem_type: int, names: NameGen, k: int = 1) -> list[onnx.NodeProto]:
    """``If(Size(updates) >= SERIAL_ELEMENTS)``: the flat ScatterElements, else ScatterND ``n`` as it is."""
    base = n.name or "ScatterND"
    size = names(f"{n.output[0]}/updates_size")
    limit = names(f"{n.output[0]}/serial_limit")
    large = names(f"{n.output[0]}/splits")
    flat_out, nd_out = names(f"{n.output[0]}/flat_result"), names(f"{n.output[0]}/nd_result")

    def result(name: str) -> onnx.ValueInfoProto:
        return (helper.make_tensor_value_info(name, elem_type, None) if elem_type
                else onnx.ValueInfoProto(name=name))

    then_branch = helper.make_graph(_flat_scatter(n, flat_out, names, k), names(f"{base}_flat"), [],
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

