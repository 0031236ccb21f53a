"""Bernoulli rewritten for onnxruntime, whose kernel draws 1 with probability 1 − p.

onnxruntime's CPU ``Bernoulli`` (1.19 to 1.32 at least) inverts ONNX's definition: fed p = [0, 0.1, 0.5,
0.9, 1] it gives ones at rates [1, 0.90, 0.50, 0.10, 0] where ONNX, ``onnx.reference``, torch and the numpy
engine give [0, 0.10, 0.50, 0.90, 1]. Each Bernoulli of a graph handed to onnxruntime (bodies included)
reads ``1 − p`` instead, so its draws have ONNX's distribution.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs


def _bernoullis(graph: onnx.GraphProto) -> list[int]:
    return [k for k, n in enumerate(graph.node) if n.op_type == "Bernoulli" and n.domain in DEFAULT_DOMAINS]


def bernoulli_complements(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each Bernoulli reading ``1 − p`` (a copy), or ``model`` itself when it has none."""
    if not any(_bernoullis(g) for g in walk_graphs(model.graph)):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    for g in walk_graphs(out.graph):
        found = _bernoullis(g)
        if not found:
            continue
        nodes: list[onnx.NodeProto] = []
        for k, n in enumerate(g.node):
            if k in found:
                p = n.input[0]
                one, typed, q = names(f"{p}_one"), names(f"{p}_one_typed"), names(f"{p}_complement")
                value = helper.make_tensor(one, TensorProto.FLOAT, [], [1.0])
                nodes += [helper.make_node("Constant", [], [one], value=value),
                          helper.make_node("CastLike", [one, p], [typed]),
                          helper.make_node("Sub", [typed, p], [q])]
                n.input[0] = q
            nodes.append(n)
        del g.node[:]
        g.node.extend(nodes)
    return out


__all__ = ["bernoulli_complements"]
