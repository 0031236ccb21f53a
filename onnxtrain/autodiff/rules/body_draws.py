"""Random draws in control-flow bodies. The gradients of If, Loop and Scan recompute the forward body inside
the backward one, where a Dropout in training mode or a random op would draw anew: the gradient would
follow other masks (other noise) than the forward pass used. So the forward body also outputs what each
such node drew (a Dropout's mask, a random op's values), stacked over the iterations of a Loop or Scan, and
the recomputed body reads those instead of drawing: a Dropout becomes ``Where(mask, x·scale, 0)``, whose
gradient is the Dropout's, a random op an Identity of its values."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, RANDOM_OPS, constant_arrays, subgraphs, walk_graphs


@dataclass
class Draw:
    """A node of a body that draws: its index in the body, the body value holding what it drew (a
    Dropout's mask, a random op's output), and that value's type."""

    index: int
    value: str
    type: onnx.TypeProto


def _constant(g: GradCtx, body: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when ``body`` or the graphs around it hold it as a constant."""
    found = constant_arrays(body, {name})
    return found[name] if name in found else g.constant_value(name)


def _draws_at_all(g: GradCtx, body: onnx.GraphProto, node: onnx.NodeProto) -> bool:
    if node.op_type != "Dropout":
        return True
    if len(node.input) < 3 or not node.input[2]:
        return False  # inference form
    training = _constant(g, body, node.input[2])
    ratio = _constant(g, body, node.input[1]) if len(node.input) > 1 and node.input[1] else None
    return not (training is not None and not training.reshape(-1)[0]) and not (
        ratio is not None and float(ratio.reshape(-1)[0]) == 0.0)


def find_draws(g: GradCtx, body: onnx.GraphProto, where: str, stacked: bool = True) -> list[Draw]:
    """The nodes of ``body`` that draw, each Dropout given a mask output if it has none (in place, before
    the caller copies the body for its recomputation). A drawing node in a body nested in ``body`` is a
    RuleError naming it (its recomputation would draw anew), as one in a body that cannot stack its draws
    (``stacked`` False: SequenceMap's)."""
    for node in body.node:
        for inner in subgraphs(node):
            for sub in walk_graphs(inner):
                for n in sub.node:
                    if n.op_type in RANDOM_OPS and n.domain in DEFAULT_DOMAINS and _draws_at_all(g, sub, n):
                        raise RuleError(f"{n.op_type} node {n.name!r} draws in a body nested in {where}'s: "
                                        "its gradient would follow other draws than the forward pass; move "
                                        "the random op out of the inner body")
    out = []
    for k, node in enumerate(body.node):
        if node.op_type not in RANDOM_OPS or node.domain not in DEFAULT_DOMAINS:
            continue
        if not _draws_at_all(g, body, node):
            continue
        if not stacked:
            raise RuleError(f"{node.op_type} node {node.name!r} draws in {where}'s body, whose gradient "
                            "cannot keep its draws: its gradient would follow other draws than the forward "
                            "pass")
        if node.op_type == "Dropout":
            while len(node.output) < 2:
                node.output.append("")
            if not node.output[1]:
                node.output[1] = g._bw.names(f"{node.output[0]}_drawn_mask")
            out.append(Draw(k, node.output[1], helper.make_tensor_type_proto(TensorProto.BOOL, None)))
        else:
            elem = _drawn_type(g, body, node)
            out.append(Draw(k, node.output[0], helper.make_tensor_type_proto(elem, None)))
    return out


def _drawn_type(g: GradCtx, body: onnx.GraphProto, node: onnx.NodeProto) -> int:
    """The element type of a random op's output: its ``dtype``, else its input's (the ``*Like`` ops and
    Bernoulli), else float32."""
    for a in node.attribute:
        if a.name == "dtype":
            return int(a.i)
    if node.input and node.input[0]:
        declared = {v.name: v.type.tensor_type.elem_type for v in (*body.input, *body.value_info)}
        elem = declared.get(node.input[0]) or (g.elem_type(node.input[0]) if node.input[0] in g._bw.types
                                               else 0)
        if elem:
            return int(elem)
        raise RuleError(f"the type of {node.op_type} node {node.name!r}'s output in a body is unknown")
    return TensorProto.FLOAT


def read_draws(forward: onnx.GraphProto, draws: list[Draw], prefix: str) -> list[str]:
    """Make ``forward`` (the copy of the body the backward pass recomputes) read each draw from a new formal
    input instead of drawing (in place); returns those inputs' names, for the caller to bind."""
    names = []
    replaced: dict[int, list[onnx.NodeProto]] = {}
    for i, d in enumerate(draws):
        name = f"{prefix}drawn{i}"
        names.append(name)
        forward.input.append(helper.make_value_info(name, d.type))
        node = forward.node[d.index]
        if node.op_type == "Dropout":
            replaced[d.index] = _dropout_from_mask(node, name, prefix + f"d{i}_")
        else:
            replaced[d.index] = [helper.make_node("Identity", [name], [node.output[0]])]
    nodes = [n for k, old in enumerate(forward.node) for n in replaced.get(k, [old])]
    del forward.node[:]
    forward.node.extend(nodes)
    return names


def _dropout_from_mask(node: onnx.NodeProto, mask: str, pre: str) -> list[onnx.NodeProto]:
    """Dropout(x, ratio, training) → (y, mask) with its mask given: y = Where(mask, x·(1 / (1 − ratio)), 0),
    the scale 1 where training is false (its mask is all true there)."""
    x, y = node.input[0], node.output[0]
    ratio = node.input[1] if len(node.input) > 1 and node.input[1] else ""
    # the scale in float64, rounded once to x's type, as the kernel computes it
    one = numpy_helper.from_array(np.array(1.0, np.float64))
    nodes = [helper.make_node("Constant", [], [pre + "one"], value=one)]
    if ratio:
        nodes += [helper.make_node("Cast", [ratio], [pre + "ratio"], to=TensorProto.DOUBLE),
                  helper.make_node("Sub", [pre + "one", pre + "ratio"], [pre + "keep"]),
                  helper.make_node("Reciprocal", [pre + "keep"], [pre + "scale64"])]
    else:  # ratio 0.5 by default
        two = numpy_helper.from_array(np.array(2.0, np.float64))
        nodes.append(helper.make_node("Constant", [], [pre + "scale64"], value=two))
    nodes += [helper.make_node("Where", [node.input[2], pre + "scale64", pre + "one"], [pre + "scale_t"]),
              helper.make_node("CastLike", [pre + "scale_t", x], [pre + "scale"]),
              helper.make_node("Mul", [x, pre + "scale"], [pre + "scaled"]),
              helper.make_node("CastLike", [pre + "one", x], [pre + "one_x"]),
              helper.make_node("Sub", [pre + "one_x", pre + "one_x"], [pre + "zero"]),
              helper.make_node("Where", [mask, pre + "scaled", pre + "zero"], [y])]
    if len(node.output) > 1 and node.output[1]:
        nodes.append(helper.make_node("Identity", [mask], [node.output[1]]))
    return nodes
