"""Gradients of If, Loop, Scan and SequenceMap. Each recomputes the forward body inside the backward one
and runs the body's own backward pass there (built by the gradient builder on the body as a graph of its
own), so nothing but the per-iteration state of a Loop or Scan needs keeping.

* If: a second If on the same condition; each branch outputs a gradient for every outer value that either
  forward branch reads and that wants one (zeros for those it does not read).
* Loop: the forward Loop also stacks each iteration's loop-carried inputs (and its iteration number); a
  backward Loop runs as many iterations, last first, and carries the gradients of the loop-carried values
  and, summed over the iterations, those of the outer values the body reads. A carried sequence that each
  iteration only appends to (a TorchScript list) is differentiated through the appended tensors, each
  taking its element of the sequence's gradient.
* Scan (opset 9 and later): the same, the forward Scan stacking its states; the backward Loop also reads
  each iteration's elements of the scanned inputs and of the incoming output gradients along their axes
  and directions, and stacks the gradients of the scanned elements, which are then put back in the scan
  input's order and axis.
* SequenceMap: a backward SequenceMap over the same inputs and the outputs' gradients, whose body redoes
  one element's forward and backward; a tensor input's gradient, and an outer value's, sum over the
  elements.

A value a body outputs twice (two outputs, or two loop-carried values) takes the sum of both gradients.
Bodies read the incoming gradients through copies, and every name a body's gradient defines (in its own
nested bodies too) gets a prefix unique in the model."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.autodiff.rules.body_draws import find_draws, read_draws
from onnxtrain.autodiff.rules.sequence import zeros_like_elements
from onnxtrain.ir.bag_loops import BagLoop, match_bag_loop
from onnxtrain.ir.builder import FLOAT_TYPES, elem_type, model_opset
from onnxtrain.ir.graphs import captured_names, node_reads, rename_values, subgraphs, walk_graphs

_NO_LOSS = "onnxtrain_body_no_loss"  # a constant stand-in for the loss of a body's gradient model


@gradient("If", uses=("x0",), stop=(0,))
def if_grad(g: GradCtx) -> None:
    wanted = g.body_wrt
    if not wanted:
        return
    _refuse_outer_optionals(g, wanted, "If")
    label = g.node.name or "If"
    branches = {}
    dy_local = [_for_body(g, g.dy(i)) for i in range(g.n_outputs)]
    recomputed, binds = _if_draws(g, label)
    # branches whose outputs differ in rank or size (torch's export of x.squeeze(d) with d's size unknown:
    # Squeeze or Identity) meet one incoming gradient, typed for the branch the graph's consumers fit; in
    # the other branch, dead at run time, it would contradict the declared gradient shapes (the checker
    # refuses the model): the gradient outputs then declare their element types only
    loose = _branch_shapes_differ(g.node)
    for key in ("then_branch", "else_branch"):
        branch = recomputed[key]
        reads = set(captured_names(branch))
        dys: dict[str, str] = {}
        for o, d in zip(branch.output, dy_local):  # a value the branch outputs twice: the sum of both
            if d is not None:
                dys[o.name] = g.emit("Add", dys[o.name], d) if o.name in dys else d
        wrt = [c for c in wanted if c in reads]
        nodes, inits, grads = _differentiate(g, branch, wrt, dys, binds[key], f"{label}_Grad_{key}")
        outputs = []
        for c in wanted:
            if c not in grads:  # the branch does not read c: its gradient is zero here
                grads[c] = _zeros_like(g, c, nodes, f"{label}_Grad_{key}")
            tp = g._bw.types.get(c)
            outputs.append(_value_info(grads[c], _elem_only(tp) if loose else tp))
        branches[key] = helper.make_graph(nodes, f"{key}_grad", [], outputs, initializer=inits)
    outs = [g.w.names(f"{c}_grad_{label}") for c in wanted]
    g.w.nodes.append(helper.make_node("If", [g.x(0)], outs, name=g.w.names(f"{label}_Grad"), **branches))
    g.body_dxs.update(zip(wanted, outs))


def _branch_shapes_differ(node: onnx.NodeProto) -> bool:
    """Whether an If's two branches declare an output with different ranks or different fixed sizes."""
    then, other = (next(a.g for a in node.attribute if a.name == k) for k in ("then_branch", "else_branch"))
    for a, b in zip(then.output, other.output):
        if not (a.type.tensor_type.HasField("shape") and b.type.tensor_type.HasField("shape")):
            continue
        da, db = a.type.tensor_type.shape.dim, b.type.tensor_type.shape.dim
        fixed = [(x.dim_value, y.dim_value) for x, y in zip(da, db)
                 if x.HasField("dim_value") and y.HasField("dim_value")]
        if len(da) != len(db) or any(x != y for x, y in fixed):
            return True
    return False


def _elem_only(tp: onnx.TypeProto | None) -> onnx.TypeProto | None:
    """A tensor type without its shape (other types as they are)."""
    if tp is None or not tp.HasField("tensor_type"):
        return tp
    return helper.make_tensor_type_proto(tp.tensor_type.elem_type, None)


def _if_draws(g: GradCtx, label: str) -> tuple[dict[str, onnx.GraphProto], dict[str, dict[str, str]]]:
    """The branches to recompute, each reading what its random nodes drew from outputs the forward If
    now gives (the other branch gives an empty value there), and the bindings of those reads."""
    bw = g._bw
    graphs = {a.name: a.g for a in g.node.attribute if a.name in ("then_branch", "else_branch")}
    draws = {key: find_draws(g, graphs[key], f"If {label!r}") for key in graphs}
    if not any(draws.values()):  # (the common case: the branches themselves, nothing to bind)
        return graphs, {key: {} for key in graphs}
    copies = {key: onnx.GraphProto() for key in graphs}
    for key, copy in copies.items():
        copy.CopyFrom(graphs[key])
    binds: dict[str, dict[str, str]] = {key: {} for key in graphs}
    for key, other in (("then_branch", "else_branch"), ("else_branch", "then_branch")):
        names = read_draws(copies[key], draws[key], bw.names(f"{label}_{key}_draws") + "/")
        for d, name in zip(draws[key], names):
            empty = bw.names(f"{label}_no_draw")
            dtype = helper.tensor_dtype_to_np_dtype(d.type.tensor_type.elem_type)
            graphs[other].node.append(helper.make_node("Constant", [], [empty],
                                                       value=numpy_helper.from_array(np.zeros(0, dtype))))
            graphs[key].output.append(helper.make_value_info(d.value, d.type))
            graphs[other].output.append(helper.make_value_info(empty, d.type))
            g.node.output.append(bw.names(f"{label}_drawn"))
            binds[key][name] = g.node.output[-1]
    return copies, binds


def _refuse_outer_optionals(g: GradCtx, wanted: list[str], what: str) -> None:
    """RuleError naming the optional values of ``wanted`` (outer values a body reads that want gradients):
    their zeros and sums, which a body that leaves one unread or a loop needs, are not built."""
    opts = [c for c in wanted if (tp := g._bw.types.get(c)) is not None and tp.HasField("optional_type")]
    if opts:
        raise RuleError(f"the {what}'s body reads outer optional value(s) {opts}, whose gradients through it "
                        "are not supported; take the element out (OptionalGetElement) before the "
                        f"{what}, or keep what the optional holds fixed")


@gradient("Loop", uses=("x*", "y0"), stop=(0, 1))  # y0: a max-pooling bag loop's pooled bags
def loop_grad(g: GradCtx) -> None:
    node = g.node
    bag = match_bag_loop(node, g.constant_value)
    if bag is not None and not bag.checks and set(g.body_wrt) <= {bag.table}:
        if g.body_wrt and g.dy(0) is not None:
            g.body_dxs[bag.table] = _bag_table_grad(g, bag)
        return
    body = next(a for a in node.attribute if a.name == "body").g
    n = len(node.input) - 2
    formal = [v.name for v in body.input]
    appends = _appended_sequences(g, body, n)  # carried j → the tensor each iteration appends to it
    tensors = [j for j in range(n) if j not in appends]
    types = {j: _carried_type(g, body, 2 + j, node.input[2 + j]) for j in tensors}
    floats = [j for j in tensors if types[j].tensor_type.elem_type in FLOAT_TYPES]
    if not g.body_wrt and not any(g.needs_dx(2 + j) for j in floats):
        return
    label = node.name or "Loop"
    draws = find_draws(g, body, f"Loop {label!r}")
    forward = onnx.GraphProto()
    forward.CopyFrom(body)
    for j, v in appends.items():  # differentiate the appended tensor, not the sequence
        del forward.node[[k for k, nd in enumerate(forward.node) if body.output[1 + j].name in nd.output][0]]
        forward.output[1 + j].CopyFrom(helper.make_empty_tensor_value_info(v))
    drawn = read_draws(forward, draws, g._bw.names(f"{label}_draws") + "/")
    kept = [(formal[2 + j], types[j]) for j in tensors] + [(d.value, d.type) for d in draws]
    stashed = _stash(g, body, kept, label, iterations=True)
    back = _ReverseLoop(g, label, g.emit("Size", stashed[-1]))
    back.bind(formal[0], back.as_vector(back.idx) if _iteration_is_vector(body) else back.idx)
    back.bind(formal[1], back.true)
    for name, st in zip([formal[2 + j] for j in tensors] + drawn, stashed):
        back.bind(name, back.gather(st, back.idx, 0))
    for j in floats:
        back.carry(
            formal[2 + j], forward.output[1 + j].name, types[j], g.dy(j) or g.zeros_like(node.input[2 + j])
        )
    for j, v in appends.items():
        if g.dy(j) is not None:  # the element this iteration appended, after the initial sequence's
            at = back.add(g.emit("SequenceLength", node.input[2 + j]), back.idx)
            back.incoming(v, back.element(_for_body(g, g.dy(j)), at))
    for q, o in enumerate(forward.output[1 + n :]):
        if g.dy(n + q) is not None:
            back.incoming(o.name, back.gather(_for_body(g, g.dy(n + q)), back.idx, 0))
    dxs, _ = back.emit(forward, [])
    for j, d in zip(floats, dxs):
        g.set_dx(2 + j, d)
    for j in appends:  # a list that starts with values: theirs are the first elements of the gradient's
        if g.needs_dx(2 + j) and g.dy(j) is not None:
            g.set_dx(2 + j, _leading_elements(g, g.dy(j), g.emit("SequenceLength", node.input[2 + j]),
                                              node.input[2 + j]))


def _leading_elements(g: GradCtx, seq: str, count: str, like: str) -> str:
    """The first ``count`` elements of sequence ``seq`` as a sequence (a Loop taking them one by one: the
    elements may differ in shape); ``like``: a sequence of the same element type."""
    names = g._bw.names
    tp = g._bw.types.get(like)
    et = (tp.sequence_type.elem_type.tensor_type.elem_type
          if tp is not None and tp.HasField("sequence_type") else g.dtype)
    i, cond, acc = names("start_i"), names("start_cond"), names("start_acc")
    item, cond_out, acc_out = names("start_item"), names("start_cond_out"), names("start_acc_out")
    body = helper.make_graph(
        [helper.make_node("SequenceAt", [seq, i], [item]),
         helper.make_node("SequenceInsert", [acc, item], [acc_out]),
         helper.make_node("Identity", [cond], [cond_out])],
        names("start_elements"),
        [helper.make_tensor_value_info(i, TensorProto.INT64, []),
         helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info(acc, et, None)],
        [helper.make_tensor_value_info(cond_out, TensorProto.BOOL, []),
         helper.make_tensor_sequence_value_info(acc_out, et, None)])
    empty = g.emit("SequenceEmpty", dtype=et)
    return g.emit("Loop", count, "", empty, body=body)


def _bag_table_grad(g: GradCtx, bag: BagLoop) -> str:
    """The table's gradient of a bag-pooling Loop (onnxtrain.ir.bag_loops), with no loop: each id position
    of a bag takes its share of the bag's output gradient (all of it for a sum, divided by the bag's size
    for a mean, for a max where its row attains the bag's maximum, split evenly among the ties as
    ReduceMax's rule splits it), and one ScatterND adds them into the table's rows. The bags are the loop's
    K iterations (the rows of its output's gradient), with any bounds, as the loop's Slice reads them:
    overlapping, out of order, with gaps or empty."""
    i64 = TensorProto.INT64
    dy = g.dy(0)
    ids = g.emit("Cast", bag.ids, to=i64)
    k = g.emit("Slice", g.emit("Shape", dy), g.ints([0]), g.ints([1]))  # [K]
    # max: the bags last first, so each table row sums its shares in the backward loop's order (same bits)
    owner, pos, counts = _bag_pairs(g, bag, ids, k, last_first=bag.reduce == "max")
    read = g.emit("Gather", ids, pos, axis=0)  # the table row each pair reads
    if bag.reduce == "max":
        rows = _max_shares(g, bag, dy, read, owner)
    elif bag.reduce == "mean":
        rows = g.emit("Gather", _per_mean(g, dy, k, counts, g.elem_type(bag.table)), owner, axis=0)
    else:
        rows = g.emit("Gather", dy, owner, axis=0)
    at = g.emit("Unsqueeze", read, g.ints([1]))
    return g.emit("ScatterND", g.zeros_like(bag.table), at, rows, reduction="add")


def _bag_pairs(g: GradCtx, bag: BagLoop, ids: str, k: str, last_first: bool) -> tuple[str, str, str]:
    """The P = Σ counts (id position, bag) pairs of the loop's K bags: each pair's bag and id position, and
    the bags' sizes. ``last_first``: the pairs of bag K - 1 come first, else those of bag 0.

    The pairs are laid out bag after bag: pair q belongs to the bag in slot ``slot[q]``, the slot whose
    first pair ``first[slot]`` (an exclusive cumulative sum of the slots' counts) is the last at or before
    q (empty bags start where the next one does, and are passed over), and reads id position
    ``s[bag] + q - first[slot]``."""
    i64 = TensorProto.INT64

    def i(v: int) -> str:
        return g.const(v, i64)

    n = g.emit("Shape", ids)  # [N]

    def bounds(v: str) -> str:  # the first K, as Slice reads them on the ids: from the end, clamped
        b = g.emit("Slice", g.emit("Cast", v, to=i64), g.ints([0]), k)
        b = g.emit("Where", g.emit("Less", b, i(0)), g.emit("Add", b, n), b)
        return g.emit("Max", g.emit("Min", b, n), i(0))

    s, e = bounds(bag.starts), bounds(bag.ends)
    counts = g.emit("Max", g.emit("Sub", e, s), i(0))  # a bag ending before it starts is empty
    order = None
    laid = counts
    if last_first:  # slot j holds bag K - 1 - j
        last = g.emit("Sub", g.emit("Squeeze", k, g.ints([0])), g.int64(1))
        order = g.emit("Range", last, g.int64(-1), g.int64(-1))
        laid = g.emit("Gather", counts, order, axis=0)
    first = g.emit("Sub", g.emit("CumSum", laid, i(0)), laid)
    pairs = g.emit("ReduceSum", laid, keepdims=1)  # [P]
    q = g.emit("Range", i(0), g.emit("Squeeze", pairs, g.ints([0])), i(1))
    zeros = g.emit("ConstantOfShape", g.emit("Add", pairs, g.ints([1])),
                   value=numpy_helper.from_array(np.zeros(1, np.int64)))
    ones = g.emit("Expand", g.ints([1]), k)
    marks = g.emit("ScatterElements", zeros, first, ones, axis=0, reduction="add")  # slots starting at q
    slot = g.emit("Sub", g.emit("CumSum", g.emit("Slice", marks, g.ints([0]), pairs), i(0)), i(1))
    owner = slot if order is None else g.emit("Gather", order, slot, axis=0)
    pos = g.emit("Sub", g.emit("Add", g.emit("Gather", s, owner, axis=0), q),
                 g.emit("Gather", first, slot, axis=0))
    return owner, pos, counts


def _per_mean(g: GradCtx, dy: str, k: str, counts: str, et: int) -> str:
    """A mean's output gradient divided by each bag's size (an empty bag's row is never read)."""
    ones_tail = g.emit("ConstantOfShape", g.emit("Sub", g.emit("Shape", g.emit("Shape", dy)), g.ints([1])),
                       value=numpy_helper.from_array(np.ones(1, np.int64)))
    size = g.emit("Reshape", g.emit("Cast", counts, to=et),
                  g.emit("Concat", k, ones_tail, axis=0))
    return g.emit("Div", dy, size)


def _max_shares(g: GradCtx, bag: BagLoop, dy: str, read: str, owner: str) -> str:
    """Each pair's share of a max-pooled bag's output gradient, elementwise (``read``: the table row of each
    pair, ``owner``: its bag): its bag's gradient where its row equals the bag's maximum, divided by the
    number of the bag's rows that do (ReduceMax's rule in the loop's body, onnxtrain.autodiff.rules.reduce),
    else zero."""
    pooled = g.y(0)
    rows = g.emit("Gather", bag.table, read, axis=0)
    hit = g.emit("Cast", g.emit("Equal", rows, g.emit("Gather", pooled, owner, axis=0)),
                 to=g.elem_type(bag.table))
    ties = g.emit("ScatterND", g.zeros_like(pooled), g.emit("Unsqueeze", owner, g.ints([1])), hit,
                  reduction="add")  # per bag and element: how many rows attain the maximum
    return g.emit("Mul", hit, g.emit("Gather", g.emit("Div", dy, ties), owner, axis=0))


def _appended_sequences(g: GradCtx, body: onnx.GraphProto, n: int) -> dict[int, str]:
    """Loop-carried sequences that each iteration appends one tensor to and does nothing else with (a
    TorchScript list's ``append``): carried index → the appended tensor. Any other carried sequence is a
    RuleError, as is one whose start wants a gradient."""
    out = {}
    for j in range(n):
        tp = body.input[2 + j].type
        if tp.WhichOneof("value") is None:
            tp = g._bw.types.get(g.node.input[2 + j], tp)
        if tp.WhichOneof("value") in (None, "tensor_type"):
            continue
        seq_in, seq_out = body.input[2 + j].name, body.output[1 + j].name
        made = [nd for nd in body.node if seq_out in nd.output]
        readers = [nd for nd in body.node if seq_in in node_reads(nd) or seq_out in node_reads(nd)]
        ins = list(made[0].input) if made else []
        if (
            len(made) != 1
            or made[0].op_type != "SequenceInsert"
            or readers != made
            or not (len(ins) == 2 or len(ins) == 3 and not ins[2])
            or ins[0] != seq_in
            or [o.name for o in body.output].count(seq_out) != 1
        ):
            raise RuleError(
                f"loop-carried sequence {seq_in!r} has no gradient: only a sequence each iteration "
                "appends one tensor to (SequenceInsert at the end) and does nothing else with has one"
            )
        out[j] = ins[1]
    return out


@gradient("Scan", since=9, uses=("x*",))
def scan_grad(g: GradCtx) -> None:
    node = g.node
    body = next(a for a in node.attribute if a.name == "body").g
    m = g.attr("num_scan_inputs")
    n = len(node.input) - m
    k = len(body.output) - n
    formal = [v.name for v in body.input]
    in_axes = list(g.attr("scan_input_axes") or [0] * m)
    in_dirs = list(g.attr("scan_input_directions") or [0] * m)
    out_axes = list(g.attr("scan_output_axes") or [0] * k)
    out_dirs = list(g.attr("scan_output_directions") or [0] * k)
    state_types = [_carried_type(g, body, j, node.input[j]) for j in range(n)]
    floats = [j for j in range(n) if state_types[j].tensor_type.elem_type in FLOAT_TYPES]
    sliced = [q for q in range(m) if g.needs_dx(n + q)]
    if not g.body_wrt and not sliced and not any(g.needs_dx(j) for j in floats):
        return
    ranks = [g.rank(node.input[n + q]) for q in range(m)]
    out_ranks = [g.rank(o, output=True) for o in range(n, n + k)]
    if None in ranks or None in out_ranks:  # those the body declares, one axis more
        ranks = [r if r is not None else _declared_rank(body.input[n + q]) for q, r in enumerate(ranks)]
        out_ranks = [r if r is not None else _declared_rank(body.output[n + o])
                     for o, r in enumerate(out_ranks)]
    if None in ranks or None in out_ranks:
        raise RuleError("the ranks of the scan inputs and outputs must be known (from the graph's shapes or "
                        "the shapes the body declares for its scanned inputs and scan outputs)")
    label = node.name or "Scan"
    draws = find_draws(g, body, f"Scan {label!r}")
    forward = onnx.GraphProto()
    forward.CopyFrom(body)
    drawn = read_draws(forward, draws, g._bw.names(f"{label}_draws") + "/")
    kept = [(formal[j], state_types[j]) for j in range(n)] + [(d.value, d.type) for d in draws]
    stashed = _stash(g, body, kept, label, iterations=False)
    for attr_name in ("scan_output_axes", "scan_output_directions"):
        a = next((a for a in node.attribute if a.name == attr_name), None)
        if a is not None:
            a.ints.extend([0] * len(kept))
    axis0 = in_axes[0] % ranks[0]
    total = g.shape_entry(g.emit("Shape", node.input[n]), axis0)
    back = _ReverseLoop(g, label, total)
    for name, st in zip(formal[:n] + drawn, stashed):
        back.bind(name, back.gather(st, back.idx, 0))
    for q in range(m):
        pos = back.idx if not in_dirs[q] else back.mirror
        back.bind(formal[n + q], back.gather(node.input[n + q], pos, in_axes[q] % ranks[q]))
    for j in floats:
        back.carry(formal[j], forward.output[j].name, state_types[j], g.dy(j) or g.zeros_like(node.input[j]))
    for o in range(k):
        if g.dy(n + o) is not None:
            pos = back.idx if not out_dirs[o] else back.mirror
            dy = _for_body(g, g.dy(n + o))
            back.incoming(forward.output[n + o].name, back.gather(dy, pos, out_axes[o] % out_ranks[o]))
    # a body may leave its formal inputs untyped (ONNX's LinearAttention body): the state's type, and the
    # scan input's without its scan axis; a declared type stays
    typed = {formal[j]: state_types[j] for j in range(n)}
    for q in range(m):
        tp = g._bw.types.get(node.input[n + q])
        declared = body.input[n + q].type
        if declared.HasField("tensor_type") and declared.tensor_type.HasField("shape"):
            continue
        if tp is not None and tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
            typed[formal[n + q]] = _without_axis(tp, in_axes[q] % ranks[q])
    dxs, stacks = back.emit(forward, [formal[n + q] for q in sliced], typed)
    for j, d in zip(floats, dxs):
        g.set_dx(j, d)
    for q, stack in zip(sliced, stacks):
        # stacked in the backward loop's order (forward step T - 1 - t at t): the scan input's element
        # order is the reverse of that for a forward scan; then the stacking axis moves to the scan axis
        if not in_dirs[q]:
            stack = g.emit("Slice", stack, g.ints([-1]), g.ints([-(2**62)]), g.ints([0]), g.ints([-1]))
        axis = in_axes[q] % ranks[q]
        if axis:
            perm = list(range(1, ranks[q]))
            perm.insert(axis, 0)
            stack = g.emit("Transpose", stack, perm=perm)
        g.set_dx(n + q, stack)


@gradient("SequenceMap", uses=("x*",))
def sequence_map_grad(g: GradCtx) -> None:
    """A backward SequenceMap over the same inputs and the outputs' gradients: its body recomputes the
    forward body on one element and runs the body's backward pass. A sequence input's gradient is the
    sequence it outputs; a tensor input's, and an outer value's, the sum over the elements."""
    node, bw = g.node, g._bw
    body = next(a for a in node.attribute if a.name == "body").g
    find_draws(g, body, f"SequenceMap {node.name!r}", stacked=False)
    formal = [v.name for v in body.input]
    is_seq = [_is_sequence(g, name) for name in node.input]
    wanted_in = [j for j in range(len(node.input)) if g.needs_dx(j)]
    wanted = g.body_wrt
    if not wanted_in and not wanted:
        return
    label = node.name or "SequenceMap"
    pre = bw.names(f"{label}_Grad_body") + "/"
    bind = {f: f"{pre}x{j}" for j, f in enumerate(formal)}
    dys, grads_in, head = {}, [], []
    for k, o in enumerate(body.output):
        if g.dy(k) is not None:
            grads_in.append((k, g.dy(k)))
            if o.name in dys:  # a value the body outputs twice: the sum of both gradients
                head.append(helper.make_node("Add", [dys[o.name], f"{pre}dy{k}"], [f"{pre}dy{k}_sum"]))
                dys[o.name] = f"{pre}dy{k}_sum"
            else:
                dys[o.name] = f"{pre}dy{k}"
    bw.names.taken.update(bind.values())
    bw.names.taken.update(f"{pre}dy{k}" for k, _ in grads_in)
    bw.names.taken.update(dys.values())
    wrt = [formal[j] for j in wanted_in] + wanted
    elem_types = {}  # a body's element inputs: the element type of the sequence mapped over
    for f, name, seq in zip(formal, node.input, is_seq):
        tp = bw.types.get(name)
        if tp is not None:
            elem_types[f] = tp.sequence_type.elem_type if seq else tp
    nodes, inits, grads = _differentiate(g, body, wrt, dys, bind, f"{label}_Grad", elem_types)
    outs = [f"{pre}d{i}_out" for i in range(len(wrt))]
    tail = [helper.make_node("Identity", [grads[w]], [o]) for w, o in zip(wrt, outs)]
    # element types only (the elements' shapes may differ): onnxruntime (1.32) cannot initialize, its graph
    # optimizations off, a SequenceMap whose body leaves its types out ("Invalid tensor data type 0")
    def typed(name: str, tp: onnx.TypeProto | None) -> onnx.ValueInfoProto:
        et = tp.tensor_type.elem_type if tp is not None and tp.HasField("tensor_type") else 0
        return helper.make_tensor_value_info(name, et or g.dtype, None)

    out_elems = [bw.types.get(o) for o in node.output]
    inputs = [typed(bind[f], elem_types.get(f)) for f in formal]
    inputs += [typed(f"{pre}dy{k}", tp.sequence_type.elem_type if (tp := out_elems[k]) is not None
                     and tp.HasField("sequence_type") else None) for k, _ in grads_in]
    out_types = [elem_types.get(w) for w in wrt[: len(wanted_in)]] + [bw.types.get(c) for c in wanted]
    back = helper.make_graph(
        head + nodes + tail,
        f"{label}_grad_body",
        inputs,
        [typed(o, tp) for o, tp in zip(outs, out_types)],
        initializer=inits,
    )
    # the gradients of the outputs are sequences like the inputs: mapped over together
    results = g.emit("SequenceMap", *node.input, *(d for _, d in grads_in), body=back, outputs=len(outs))
    results = results if isinstance(results, list) else [results]
    for i, j in enumerate(wanted_in):  # per element; a tensor input's gradient sums them
        g.set_dx(j, results[i] if is_seq[j] else _sum_elements(g, results[i], node.input[j]))
    for c, r in zip(wanted, results[len(wanted_in) :]):
        g.body_dxs[c] = _sum_elements(g, r, c)


def _for_body(g: GradCtx, dy: str | None) -> str | None:
    """An incoming gradient ``dy`` as a body may read it: a copy. The builder gives the gradient of an x
    its final name (``<x>_grad``) by renaming the node that makes it and its readers in the graph, not in
    the bodies reading it; a body reading ``dy`` itself, when ``dy`` is also some x's whole gradient (``y =
    a + x`` after the If), read a value then no longer made before it (or at all)."""
    return None if dy is None else g.emit("Identity", dy)


def _sum_elements(g: GradCtx, seq: str, like: str) -> str:
    """The sum of a sequence's tensors (all of ``like``'s shape), zeros for an empty sequence (a zero
    element goes in first: neither engine concatenates an empty sequence)."""
    padded = g.emit("SequenceInsert", seq, g.zeros_like(like), g.int64(0))
    return g.reduce("ReduceSum", g.emit("ConcatFromSequence", padded, axis=0, new_axis=1), [0], keepdims=0)


def _is_sequence(g: GradCtx, name: str) -> bool:
    tp = g._bw.types.get(name)
    return tp is not None and tp.HasField("sequence_type")


class _ReverseLoop:
    """A backward Loop over the forward iterations, last first: its iteration t redoes forward iteration
    idx = T - 1 - t (``mirror`` is t itself), recomputing the body from the values bound to its formal
    inputs, and runs the body's backward pass."""

    def __init__(self, g: GradCtx, label: str, total: str):
        self.g, self.total = g, total
        bw = g._bw
        self.pre = pre = bw.names(f"{label}_Grad_body") + "/"
        self.label = label
        self.t, self.cond = pre + "t", pre + "cond"
        self.idx, self.mirror, self.true = pre + "idx", self.t, pre + "true"
        self.head = [
            helper.make_node(
                "Constant", [], [pre + "one"], value=numpy_helper.from_array(np.array(1, np.int64))
            ),
            helper.make_node("Constant", [], [self.true], value=numpy_helper.from_array(np.array(True))),
            helper.make_node("Sub", [total, pre + "one"], [pre + "last"]),
            helper.make_node("Sub", [pre + "last", self.t], [self.idx]),
        ]
        self.binding: dict[str, str] = {}
        self.carried: list[tuple[str, str, onnx.TypeProto, str]] = []  # formal input, output, type, start
        self.dys: dict[str, str] = {}

    def gather(self, source: str, position: str, axis: int) -> str:
        """``source``'s element ``position`` along ``axis``, inside the backward body."""
        out = f"{self.pre}g{len(self.head)}"
        self.head.append(helper.make_node("Gather", [source, position], [out], axis=axis))
        return out

    def as_vector(self, value: str) -> str:
        """A scalar ``value`` as a 1-element vector, inside the backward body."""
        axes, out = f"{self.pre}axes{len(self.head)}", f"{self.pre}u{len(self.head)}"
        self.head.append(helper.make_node("Constant", [], [axes],
                                          value=numpy_helper.from_array(np.array([0], np.int64))))
        self.head.append(helper.make_node("Unsqueeze", [value, axes], [out]))
        return out

    def add(self, a: str, b: str) -> str:
        """``a + b``, inside the backward body."""
        out = f"{self.pre}a{len(self.head)}"
        self.head.append(helper.make_node("Add", [a, b], [out]))
        return out

    def element(self, sequence: str, position: str) -> str:
        """Element ``position`` of ``sequence``, inside the backward body."""
        out = f"{self.pre}e{len(self.head)}"
        self.head.append(helper.make_node("SequenceAt", [sequence, position], [out]))
        return out

    def bind(self, formal: str, value: str) -> None:
        self.binding[formal] = value

    def carry(self, formal: str, output: str, tp: onnx.TypeProto, start: str) -> None:
        """A gradient carried from iteration to iteration: that of body output ``output`` coming in, that of
        formal input ``formal`` going out; ``start``: its value before the last forward iteration."""
        self.carried.append((formal, output, tp, start))

    def incoming(self, output: str, grad: str) -> None:
        """The gradient of a per-iteration body output, as computed in the backward body (summed with one
        given before for the same value)."""
        self.dys[output] = self.add(self.dys[output], grad) if output in self.dys else grad

    def emit(
        self,
        forward: onnx.GraphProto,
        stacked: list[str],
        formal_types: dict[str, onnx.TypeProto] | None = None,
    ) -> tuple[list[str], list[str]]:
        """Emit the backward Loop; returns the gradients of the carried values' starts, and the gradients of
        the formal inputs ``stacked`` stacked over the backward iterations. The gradients of the outer values
        the body reads (``g.body_wrt``) are summed over the iterations and handed to the builder.
        ``formal_types``: the formal inputs' types where the body leaves them out."""
        g, pre, bw = self.g, self.pre, self.g._bw
        wanted = g.body_wrt
        seqs = [c for c in wanted if (tp := bw.types.get(c)) is not None and tp.HasField("sequence_type")]
        if seqs:  # the summed gradient would be a sequence: neither zeros of its shape nor Add exist for one
            raise RuleError(f"the loop body reads outer sequence(s) {seqs}, whose gradients through the "
                            "loop are not supported; export with static shapes (torch then writes no loop "
                            "here) or index the sequence outside the loop")
        _refuse_outer_optionals(g, wanted, "loop")
        acc = {formal: f"{pre}d{i}" for i, (formal, *_) in enumerate(self.carried)}
        acc_c = {c: f"{pre}dc{i}" for i, c in enumerate(wanted)}
        dys: dict[str, str] = {}
        for formal, output, _, _ in self.carried:  # one value carried as two: the sum of both gradients
            dys[output] = self.add(dys[output], acc[formal]) if output in dys else acc[formal]
        for output, grad in self.dys.items():  # also carried (a carried value appended to a list): summed
            dys[output] = self.add(dys[output], grad) if output in dys else grad
        bw.names.taken.update(self.binding.values())
        wrt = [*acc, *(f for f in stacked if f not in acc), *wanted]
        nodes, inits, grads = _differentiate(
            g, forward, wrt, dys, self.binding, f"{self.label}_Grad", formal_types
        )
        outputs = [helper.make_tensor_value_info(pre + "cond_out", TensorProto.BOOL, [])]
        tail = [helper.make_node("Identity", [self.cond], [pre + "cond_out"])]
        outputs += [_value_info(grads[formal], tp) for formal, _, tp, _ in self.carried]
        for i, c in enumerate(wanted):
            if not _scatter_into(nodes, grads[c], acc_c[c], f"{pre}dc{i}_out"):
                tail.append(helper.make_node("Add", [acc_c[c], grads[c]], [f"{pre}dc{i}_out"]))
            outputs.append(_value_info(f"{pre}dc{i}_out", bw.types.get(c)))
        # typed as the formal input (an element): a Loop of no iteration stacks nothing into an empty tensor
        # of the declared element shape and type (else float32 [0], in which a Scan's gradient cannot move
        # the stacking axis to the scan axis)
        declared = {v.name: v.type for v in forward.input if v.type.tensor_type.elem_type}
        declared.update(formal_types or {})
        for i, f in enumerate(stacked):  # a fresh name: the same gradient may also be a carried output
            tail.append(helper.make_node("Identity", [grads[f]], [f"{pre}ds{i}_out"]))
            outputs.append(_value_info(f"{pre}ds{i}_out", declared.get(f)))
        inputs = [
            helper.make_tensor_value_info(self.t, TensorProto.INT64, []),
            helper.make_tensor_value_info(self.cond, TensorProto.BOOL, []),
        ]
        inputs += [_value_info(acc[formal], tp) for formal, _, tp, _ in self.carried]
        inputs += [_value_info(acc_c[c], bw.types.get(c)) for c in wanted]
        from onnxtrain.autodiff.builder import _live_nodes

        nodes = _live_nodes(nodes, [o.name for o in outputs] + [n for node in tail for n in node.input])
        read = {i for node in self.head + nodes + tail for i in node_reads(node)}  # nested bodies too
        head = [h for h in self.head if h.output[0] != self.true or self.true in read]  # a Scan's: unread
        body = helper.make_graph(
            head + nodes + tail, f"{self.label}_grad_body", inputs, outputs, initializer=inits
        )
        starts = [start for *_, start in self.carried] + [g.zeros_like(c) for c in wanted]
        n_out = len(starts) + len(stacked)
        outs = g.emit("Loop", self.total, "", *starts, body=body, outputs=n_out)
        outs = outs if isinstance(outs, list) else [outs]
        n = len(self.carried)
        g.body_dxs.update(zip(wanted, outs[n : n + len(wanted)]))
        return outs[:n], outs[n + len(wanted) :]


def _scatter_into(nodes: list[onnx.NodeProto], grad: str, acc: str, out: str) -> bool:
    """When ``grad`` is a scatter-add into zeros read nowhere else (a Gather's gradient: the few rows of an
    embedding table one iteration read), scatter into the accumulator ``acc`` instead, naming the result
    ``out``: an iteration then adds its rows, not a whole table of zeros and rows (an nn.EmbeddingBag
    recommender's training step at 256 bags: 27.5 -> 25.6 ms, medians of five interleaved runs). Returns
    whether it did."""
    made = {o: node for node in nodes for o in node.output}
    scatter = made.get(grad)
    if scatter is None or scatter.op_type != "ScatterND" or _reduction(scatter) != "add":
        return False
    zeros = made.get(scatter.input[0])
    if zeros is None or zeros.op_type != "ConstantOfShape" or not _is_zero_fill(zeros):
        return False
    if [n for n in nodes if grad in n.input or scatter.input[0] in n.input] != [scatter]:
        return False
    scatter.input[0] = acc
    scatter.output[0] = out
    return True


def _reduction(node: onnx.NodeProto) -> str:
    return next((a.s.decode() for a in node.attribute if a.name == "reduction"), "none")


def _is_zero_fill(node: onnx.NodeProto) -> bool:
    value = next((a.t for a in node.attribute if a.name == "value"), None)
    return value is None or not numpy_helper.to_array(value).any()


def _stash(
    g: GradCtx, body: onnx.GraphProto, values: list[tuple[str, onnx.TypeProto]], label: str, iterations: bool
) -> list[str]:
    """Make the forward Loop or Scan also output, stacked over its iterations, each formal input of
    ``values`` (name, type) and, with ``iterations``, the iteration number; returns the new outputs' names."""
    bw = g._bw
    pre = bw.names(f"{label}_stash") + "/"
    wanted = [(f"v{j}", name, tp) for j, (name, tp) in enumerate(values)]
    if iterations:
        wanted.append(("iteration", body.input[0].name, _iteration_type(body)))
    stashed = []
    for tag, src, tp in wanted:
        body.node.append(helper.make_node("Identity", [src], [pre + tag]))
        body.output.append(helper.make_value_info(pre + tag, tp))
        g.node.output.append(bw.names(f"{label}_stash_{tag}"))
        stashed.append(g.node.output[-1])
    bw.names.taken.update(o.name for o in body.output)
    return stashed


def _iteration_type(body: onnx.GraphProto) -> onnx.TypeProto:
    """The type of a Loop body's iteration number: a scalar, or a 1-element vector where the body declares
    one (torch's TorchScript exporter does; onnxruntime then gives it that shape)."""
    if _iteration_is_vector(body):
        return helper.make_tensor_type_proto(TensorProto.INT64, [1])
    return helper.make_tensor_type_proto(TensorProto.INT64, [])


def _iteration_is_vector(body: onnx.GraphProto) -> bool:
    tp = body.input[0].type
    return (tp.HasField("tensor_type") and tp.tensor_type.HasField("shape")
            and len(tp.tensor_type.shape.dim) == 1)


def _declared_rank(v: onnx.ValueInfoProto) -> int | None:
    """The rank of a Scan's scan input or output whose body value ``v`` declares a shape: one more."""
    tp = v.type
    if tp.HasField("tensor_type") and tp.tensor_type.HasField("shape"):
        return len(tp.tensor_type.shape.dim) + 1
    return None


def _carried_type(g: GradCtx, body: onnx.GraphProto, i: int, start: str) -> onnx.TypeProto:
    """The tensor type of body input ``i``, a value carried across iterations: as the body declares it,
    else as the graph knows its start value ``start``."""
    tp = body.input[i].type
    if tp.WhichOneof("value") is None or (tp.HasField("tensor_type") and not tp.tensor_type.elem_type):
        tp = g._bw.types.get(start)
        if tp is None:
            raise RuleError(f"the type of the carried value {body.input[i].name!r} is unknown")
    if not tp.HasField("tensor_type"):
        raise RuleError(f"carried sequences or optionals ({body.input[i].name!r}) have no gradient yet")
    return tp


def _differentiate(
    g: GradCtx,
    graph: onnx.GraphProto,
    wrt: list[str],
    dys: dict[str, str],
    bind: dict[str, str],
    label: str,
    formal_types: dict[str, onnx.TypeProto] | None = None,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], dict[str, str]]:
    """Recompute body ``graph`` and run its backward pass: the nodes and initializers that compute the
    gradients of ``wrt`` (its formal inputs or outer values it reads), given the incoming gradients
    ``dys`` (body output → the value holding its gradient); returns them and each gradient's name.
    ``bind`` names the values that stand for the body's formal inputs (``formal_types``: their types, for
    a body that does not declare them); every other name the nodes define gets a prefix unique in the
    model."""
    from onnxtrain.autodiff.builder import _live_nodes, build_gradient_model

    bw = g._bw
    outer = captured_names(graph)
    typed = formal_types or {}
    formal = [_value_info(v.name, typed[v.name]) if v.name in typed else v for v in graph.input]
    inputs = [*formal, *(_value_info(c, bw.types.get(c)) for c in outer)]
    stand_in = helper.make_node(
        "Constant", [], [_NO_LOSS], value=numpy_helper.from_array(np.zeros((), np.float32))
    )
    model = helper.make_model(
        helper.make_graph(
            [*graph.node, stand_in],
            "body",
            inputs,
            [*graph.output, helper.make_tensor_value_info(_NO_LOSS, TensorProto.FLOAT, [])],
            initializer=list(graph.initializer),
        ),
        opset_imports=list(bw.model.opset_import),
        ir_version=bw.model.ir_version,
    )
    ys = list(dys)
    gm = build_gradient_model(model, _NO_LOSS, wrt, outputs=[], other_ys=ys).graph
    own = {v.name for v in inputs}
    placeholders = [v.name for v in gm.input if v.name not in own]  # the incoming gradients, in ys order
    prefix = bw.names(label) + "/"
    defined = {o for node in gm.node for o in node.output if o} | {t.name for t in gm.initializer}
    # and the names the bodies of its nodes define: a body's backward Loop names its own body's values as
    # this model's does (``Loop_Grad_body/one``...), which nested in it would define them twice
    defined |= _defined_in_bodies(gm.node)
    rename = {name: prefix + name for name in defined if name not in outer}
    rename.update(bind)
    rename.update(zip(placeholders, (dys[y] for y in ys)))
    bw.names.taken.update(rename.values())
    nodes = _live_nodes(list(gm.node), [f"{w}_grad" for w in wrt])
    read = {name for node in nodes for name in node_reads(node)}
    inits = [_renamed_tensor(t, rename) for t in gm.initializer if t.name in read]
    return [_renamed(node, rename) for node in nodes], inits, {w: rename[f"{w}_grad"] for w in wrt}


def _zeros_like(g: GradCtx, name: str, nodes: list[onnx.NodeProto], label: str) -> str:
    """Zeros shaped like the outer value ``name``, made by nodes appended to ``nodes``: for a sequence, a
    sequence of zero tensors shaped like its elements (a SequenceMap)."""
    bw = g._bw
    shape, out = bw.names(f"{label}/{name}_shape"), bw.names(f"{label}/{name}_zero_grad")
    if _is_sequence(g, name):
        if model_opset(bw.model) < 17:
            raise RuleError(f"the zero gradient of sequence {name!r} in a branch that does not read it needs "
                            "SequenceMap (opset 17); convert the model to opset 17 or later")
        body = zeros_like_elements(g, name, f"{label}/{name}_zeros")
        nodes.append(helper.make_node("SequenceMap", [name], [out], body=body))
        return out
    et = elem_type(bw.types, name) or g.dtype
    zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(et)))
    nodes += [
        helper.make_node("Shape", [name], [shape]),
        helper.make_node("ConstantOfShape", [shape], [out], value=zero),
    ]
    return out


def _without_axis(tp: onnx.TypeProto, axis: int) -> onnx.TypeProto:
    """Tensor type ``tp`` with dimension ``axis`` removed (one element of a scan input)."""
    out = onnx.TypeProto()
    out.CopyFrom(tp)
    del out.tensor_type.shape.dim[axis]
    return out


def _value_info(name: str, tp: onnx.TypeProto | None) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, tp) if tp is not None else helper.make_empty_tensor_value_info(name)


def _defined_in_bodies(nodes: list[onnx.NodeProto]) -> set[str]:
    """The names that the bodies of ``nodes`` (nested ones too) define: inputs, initializers, node outputs."""
    out: set[str] = set()
    for node in nodes:
        for body in subgraphs(node):
            for graph in walk_graphs(body):
                out.update(v.name for v in graph.input)
                out.update(t.name for t in graph.initializer)
                out.update(o for n in graph.node for o in n.output if o)
    return out


def _renamed(node: onnx.NodeProto, rename: dict[str, str]) -> onnx.NodeProto:
    """A copy of ``node`` with its value names (in nested bodies too, their inputs, initializers and value
    infos included) renamed."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    rename_values(out, rename)
    return out


def _renamed_tensor(t: onnx.TensorProto, rename: dict[str, str]) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(t)
    out.name = rename.get(t.name, t.name)
    return out
