"""Gradient of If: another If on the same condition, whose branches are the gradients of the forward
branches. Each backward branch recomputes its forward branch, then runs that branch's backward pass, and
outputs a gradient for every outer value that either branch reads and that wants one (zeros for the values
the branch does not read). Loop and Scan have no rule yet."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.ir.builder import elem_type
from onnxtrain.ir.graphs import captured_names, node_reads, subgraphs

_NO_LOSS = "onnxtrain_branch_no_loss"  # a constant stand-in for the loss of a branch's gradient model


@gradient("If", uses=("x0",), stop=(0,))
def if_grad(g: GradCtx) -> None:
    wanted = g.body_wrt
    if not wanted:
        return
    dys = [g.dy(i) for i in range(g.n_outputs)]
    branches = {
        key: _branch_gradient(g, g.attr(key), dys, wanted, key) for key in ("then_branch", "else_branch")
    }
    outs = [g.w.names(f"{c}_grad_{g.node.name or 'If'}") for c in wanted]
    g.w.nodes.append(
        helper.make_node("If", [g.x(0)], outs, name=g.w.names(f"{g.node.name or 'If'}_Grad"), **branches)
    )
    g.body_dxs.update(zip(wanted, outs))


def _branch_gradient(
    g: GradCtx, branch: onnx.GraphProto, dys: list[str | None], wanted: list[str], key: str
) -> onnx.GraphProto:
    """The backward branch of ``branch``: the gradients of ``wanted`` (outer values), given the incoming
    gradients ``dys`` of the If's outputs (outer values too)."""
    from onnxtrain.autodiff.builder import _live_nodes, build_gradient_model

    bw = g._bw
    reads = captured_names(branch)
    types = bw.types
    inputs = [
        helper.make_value_info(c, types[c]) if c in types else helper.make_empty_tensor_value_info(c)
        for c in reads
    ]
    stand_in = helper.make_node(
        "Constant", [], [_NO_LOSS], value=numpy_helper.from_array(np.zeros((), np.float32))
    )
    model = helper.make_model(
        helper.make_graph(
            [*branch.node, stand_in],
            "branch",
            inputs,
            [*branch.output, helper.make_tensor_value_info(_NO_LOSS, onnx.TensorProto.FLOAT, [])],
            initializer=list(branch.initializer),
        ),
        opset_imports=list(bw.model.opset_import),
        ir_version=bw.model.ir_version,
    )
    wrt = [c for c in wanted if c in reads]
    ys = [o.name for o, d in zip(branch.output, dys) if d is not None]
    if len(set(ys)) != len(ys):
        raise RuleError(f"{key} outputs one value twice")
    grad_model = build_gradient_model(model, _NO_LOSS, wrt, outputs=[], other_ys=ys)
    gm = grad_model.graph
    # the backward branch: outer values stay as they are; the incoming gradients are the If's; every
    # name the branch defines gets a prefix unique in the whole model
    prefix = bw.names(f"{g.node.name or 'If'}_Grad_{key}") + "/"
    outer = set(reads)
    # the gradient model's inputs after the branch's own: the incoming gradients of ``ys``, in order
    incoming = dict(zip([v.name for v in gm.input if v.name not in outer], [d for d in dys if d is not None]))
    defined = {o for n in gm.node for o in n.output if o} | {t.name for t in gm.initializer}
    rename = {n: prefix + n for n in defined if n not in outer}
    rename.update(incoming)
    bw.names.taken.update(rename.values())
    grads = {c: f"{c}_grad" for c in wrt}
    nodes = _live_nodes(list(gm.node), [grads[c] for c in wrt])
    zeros: list[onnx.NodeProto] = []
    outputs: list[onnx.ValueInfoProto] = []
    for c in wanted:
        if c in grads:
            name = rename[grads[c]]
        else:  # the branch does not read c: its gradient is zero here
            name = bw.names(f"{prefix}{c}_zero_grad")
            shape = bw.names(f"{prefix}{c}_shape")
            et = elem_type(types, c) or g.dtype
            zero = numpy_helper.from_array(np.zeros(1, helper.tensor_dtype_to_np_dtype(et)))
            zeros += [
                helper.make_node("Shape", [c], [shape]),
                helper.make_node("ConstantOfShape", [shape], [name], value=zero),
            ]
        tp = types.get(c)
        outputs.append(
            helper.make_value_info(name, tp) if tp is not None else helper.make_empty_tensor_value_info(name)
        )
    body_nodes = [_renamed(n, rename) for n in nodes] + zeros
    read = {n for node in nodes for n in node_reads(node)}
    inits = [_renamed_tensor(t, rename) for t in gm.initializer if t.name in read]
    return helper.make_graph(body_nodes, f"{key}_grad", [], outputs, initializer=inits)


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
