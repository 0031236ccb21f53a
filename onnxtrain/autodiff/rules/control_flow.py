"""Gradients of If and Loop. Both recompute the forward body inside the backward one and run the body's
own backward pass there (built by the gradient builder on the body as a graph of its own), so nothing
but a Loop's per-iteration inputs needs keeping.

* If: a second If on the same condition; each branch outputs a gradient for every outer value that either
  forward branch reads and that wants one (zeros for those it does not read).
* Loop: the forward Loop also stacks each iteration's loop-carried inputs (and its iteration number); a
  backward Loop runs as many iterations, last first, and carries the gradients of the loop-carried values
  and, summed over the iterations, those of the outer values the body reads.

Scan and SequenceMap have no rule yet."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.ir.builder import FLOAT_TYPES, elem_type
from onnxtrain.ir.graphs import captured_names, node_reads, subgraphs

_NO_LOSS = "onnxtrain_body_no_loss"  # a constant stand-in for the loss of a body's gradient model


@gradient("If", uses=("x0",), stop=(0,))
def if_grad(g: GradCtx) -> None:
    wanted = g.body_wrt
    if not wanted:
        return
    label = g.node.name or "If"
    branches = {}
    for key in ("then_branch", "else_branch"):
        branch = g.attr(key)
        reads = set(captured_names(branch))
        dys = {
            o.name: d for o, d in zip(branch.output, (g.dy(i) for i in range(g.n_outputs))) if d is not None
        }
        wrt = [c for c in wanted if c in reads]
        nodes, inits, grads = _differentiate(g, branch, wrt, dys, {}, f"{label}_Grad_{key}")
        outputs = []
        for c in wanted:
            if c not in grads:  # the branch does not read c: its gradient is zero here
                grads[c] = _zeros_like(g, c, nodes, f"{label}_Grad_{key}")
            outputs.append(_value_info(grads[c], g._bw.types.get(c)))
        branches[key] = helper.make_graph(nodes, f"{key}_grad", [], outputs, initializer=inits)
    outs = [g.w.names(f"{c}_grad_{label}") for c in wanted]
    g.w.nodes.append(helper.make_node("If", [g.x(0)], outs, name=g.w.names(f"{label}_Grad"), **branches))
    g.body_dxs.update(zip(wanted, outs))


@gradient("Loop", uses=("x*",), stop=(0, 1))
def loop_grad(g: GradCtx) -> None:
    node, bw = g.node, g._bw
    attr = next(a for a in node.attribute if a.name == "body")
    body = attr.g
    n = len(node.input) - 2
    formal = [v.name for v in body.input]
    carried_types = [_carried_type(g, body, j) for j in range(n)]
    if any(not tp.HasField("tensor_type") for tp in carried_types):
        raise RuleError("loop-carried sequences or optionals have no gradient yet")
    floats = [j for j in range(n) if carried_types[j].tensor_type.elem_type in FLOAT_TYPES]
    wanted = g.body_wrt
    if not wanted and not any(g.needs_dx(2 + j) for j in floats):
        return
    forward = onnx.GraphProto()
    forward.CopyFrom(body)
    label = node.name or "Loop"
    stashed = _stash_iterations(g, body, carried_types, label)
    # the backward loop's body: its iteration t redoes forward iteration idx = T - 1 - t
    pre = bw.names(f"{label}_Grad_body") + "/"
    t, cond = pre + "t", pre + "cond"
    total = g.emit("Size", stashed[-1])
    head = [
        helper.make_node("Constant", [], [pre + "one"], value=numpy_helper.from_array(np.array(1, np.int64))),
        helper.make_node("Constant", [], [pre + "true"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Sub", [total, pre + "one"], [pre + "last"]),
        helper.make_node("Sub", [pre + "last", t], [pre + "idx"]),
    ]
    bind = {formal[0]: pre + "idx", formal[1]: pre + "true"}
    for j in range(n):
        bind[formal[2 + j]] = pre + f"v{j}"
        head.append(helper.make_node("Gather", [stashed[j], pre + "idx"], [pre + f"v{j}"], axis=0))
    acc_v = {j: pre + f"dv{j}" for j in floats}
    acc_c = {c: pre + f"dc{m}" for m, c in enumerate(wanted)}
    dys = {forward.output[1 + j].name: acc_v[j] for j in floats}
    for q, o in enumerate(forward.output[1 + n :]):
        d = g.dy(n + q)
        if d is not None:
            head.append(helper.make_node("Gather", [d, pre + "idx"], [pre + f"ds{q}"], axis=0))
            dys[o.name] = pre + f"ds{q}"
    if len(dys) != len(floats) + sum(g.dy(n + q) is not None for q in range(len(forward.output) - 1 - n)):
        raise RuleError("the body outputs one value twice")
    bw.names.taken.update(bind.values())
    wrt = [formal[2 + j] for j in floats] + wanted
    nodes, inits, grads = _differentiate(g, forward, wrt, dys, bind, f"{label}_Grad")
    outputs = [helper.make_tensor_value_info(pre + "cond_out", TensorProto.BOOL, [])]
    tail = [helper.make_node("Identity", [cond], [pre + "cond_out"])]
    for j in floats:
        outputs.append(_value_info(grads[formal[2 + j]], carried_types[j]))
    for m, c in enumerate(wanted):
        tail.append(helper.make_node("Add", [acc_c[c], grads[c]], [pre + f"dc{m}_out"]))
        outputs.append(_value_info(pre + f"dc{m}_out", bw.types.get(c)))
    inputs = [
        helper.make_tensor_value_info(t, TensorProto.INT64, []),
        helper.make_tensor_value_info(cond, TensorProto.BOOL, []),
    ]
    inputs += [_value_info(acc_v[j], carried_types[j]) for j in floats]
    inputs += [_value_info(acc_c[c], bw.types.get(c)) for c in wanted]
    back = helper.make_graph(head + nodes + tail, f"{label}_grad_body", inputs, outputs, initializer=inits)
    starts = [g.dy(j) or g.zeros_like(node.input[2 + j]) for j in floats]
    starts += [g.zeros_like(c) for c in wanted]
    outs = g.emit("Loop", total, "", *starts, body=back, outputs=len(starts))
    outs = outs if isinstance(outs, list) else [outs]
    for j, d in zip(floats, outs):
        g.set_dx(2 + j, d)
    g.body_dxs.update(zip(wanted, outs[len(floats) :]))


def _stash_iterations(
    g: GradCtx, body: onnx.GraphProto, carried_types: list[onnx.TypeProto], label: str
) -> list[str]:
    """Make the forward Loop also output, stacked over its iterations, each iteration's loop-carried
    inputs and then its iteration number; returns the names of those new outputs of the node."""
    bw, formal = g._bw, [v.name for v in body.input]
    pre = bw.names(f"{label}_stash") + "/"
    stashed = []
    int_scalar = helper.make_tensor_type_proto(TensorProto.INT64, [])
    for j, src in [*enumerate(formal[2:]), (None, formal[0])]:
        tag = f"v{j}" if j is not None else "iteration"
        body.node.append(helper.make_node("Identity", [src], [pre + tag]))
        body.output.append(
            helper.make_value_info(pre + tag, carried_types[j] if j is not None else int_scalar)
        )
        g.node.output.append(bw.names(f"{label}_stash_{tag}"))
        stashed.append(g.node.output[-1])
    bw.names.taken.update(o.name for o in body.output)
    return stashed


def _carried_type(g: GradCtx, body: onnx.GraphProto, j: int) -> onnx.TypeProto:
    """The type of loop-carried value ``j``: as the body declares it, else as the graph knows its start."""
    tp = body.input[2 + j].type
    if tp.WhichOneof("value") is not None and (not tp.HasField("tensor_type") or tp.tensor_type.elem_type):
        return tp
    known = g._bw.types.get(g.node.input[2 + j])
    if known is None:
        raise RuleError(f"the type of loop-carried value {j} ({body.input[2 + j].name!r}) is unknown")
    return known


def _differentiate(
    g: GradCtx,
    graph: onnx.GraphProto,
    wrt: list[str],
    dys: dict[str, str],
    bind: dict[str, str],
    label: str,
) -> tuple[list[onnx.NodeProto], list[onnx.TensorProto], dict[str, str]]:
    """Recompute body ``graph`` and run its backward pass: the nodes and initializers that compute the
    gradients of ``wrt`` (its formal inputs or outer values it reads), given the incoming gradients
    ``dys`` (body output → the value holding its gradient); returns them and each gradient's name.
    ``bind`` names the values that stand for the body's formal inputs; every other name the nodes define
    gets a prefix unique in the model."""
    from onnxtrain.autodiff.builder import _live_nodes, build_gradient_model

    bw = g._bw
    outer = captured_names(graph)
    inputs = [*graph.input, *(_value_info(c, bw.types.get(c)) for c in outer)]
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
    rename = {name: prefix + name for name in defined if name not in outer}
    rename.update(bind)
    rename.update(zip(placeholders, (dys[y] for y in ys)))
    bw.names.taken.update(rename.values())
    nodes = _live_nodes(list(gm.node), [f"{w}_grad" for w in wrt])
    read = {name for node in nodes for name in node_reads(node)}
    inits = [_renamed_tensor(t, rename) for t in gm.initializer if t.name in read]
    return [_renamed(node, rename) for node in nodes], inits, {w: rename[f"{w}_grad"] for w in wrt}


def _zeros_like(g: GradCtx, name: str, nodes: list[onnx.NodeProto], label: str) -> str:
    """Zeros shaped like the outer value ``name``, made by nodes appended to ``nodes``."""
    bw = g._bw
    shape, out = bw.names(f"{label}/{name}_shape"), bw.names(f"{label}/{name}_zero_grad")
    et = elem_type(bw.types, name) or g.dtype
    zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(et)))
    nodes += [
        helper.make_node("Shape", [name], [shape]),
        helper.make_node("ConstantOfShape", [shape], [out], value=zero),
    ]
    return out


def _value_info(name: str, tp: onnx.TypeProto | None) -> onnx.ValueInfoProto:
    return helper.make_value_info(name, tp) if tp is not None else helper.make_empty_tensor_value_info(name)


def _renamed(node: onnx.NodeProto, rename: dict[str, str]) -> onnx.NodeProto:
    """A copy of ``node`` with its value names (in nested bodies too) renamed."""
    out = onnx.NodeProto()
    out.CopyFrom(node)
    _rename_in(out, rename)
    return out


def _rename_in(node: onnx.NodeProto, rename: dict[str, str]) -> None:
    node.input[:] = [rename.get(n, n) for n in node.input]
    node.output[:] = [rename.get(n, n) for n in node.output]
    for sub in subgraphs(node):
        for n in sub.node:
            _rename_in(n, rename)
        for v in sub.output:
            v.name = rename.get(v.name, v.name)


def _renamed_tensor(t: onnx.TensorProto, rename: dict[str, str]) -> onnx.TensorProto:
    out = onnx.TensorProto()
    out.CopyFrom(t)
    out.name = rename.get(t.name, t.name)
    return out
