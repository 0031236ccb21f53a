"""Dropout outputs rebuilt from their masks (recompute), computed as onnxruntime's Dropout kernel does.

The recompute passes (onnxtrain/graph_transforms/recompute.py) rebuild a training-mode Dropout's output in the
backward pass from its input and its saved mask, as ONNX defines it and the numpy engine's kernel computes it:
``(X · scale) · mask`` with ``scale = 1 / (1 − ratio)`` in X's type (float32 for half types). onnxruntime's
kernel (1.32) divides instead, ``X / (1 − ratio)`` with ``1 − ratio`` taken in float32, which rounds a fifth
of the kept values one ulp apart at ratio 0.1 (float32). On the onnxruntime backend the forward Dropout is
onnxruntime's and the rebuild was ours, so a recomputed Dropout changed the gradients by an ulp per element:
a 2-layer attention stack trained 20 SGD steps with ``attn_dropout_recompute`` ended 3e-5 off the same
session without it. Each rebuild here divides by onnxruntime's ``1 − ratio`` instead of multiplying by the
scale, so the rebuild gives the forward Dropout's values on that backend too.

A rebuild is found by its shape: ``Mul(Mul(x, s), Cast(mask))`` where ``mask`` is the mask output of a Dropout
with a constant ratio and ``s`` the constant scale of that ratio (or ``Where(training_mode, s, 1)``).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen, with_nodes_replaced
from onnxtrain.ir.graphs import constant_arrays


def _ratio(node: onnx.NodeProto, consts: dict[str, np.ndarray]) -> float | None:
    """The Dropout's constant ratio (0.5 when absent); None when it is fed."""
    if len(node.input) < 2 or not node.input[1]:
        return 0.5
    value = consts.get(node.input[1])
    return None if value is None or value.size != 1 else float(value.reshape(-1)[0])


def dropout_rebuilds(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each Dropout rebuild's scaling a division by onnxruntime's ``1 − ratio`` (a copy), or
    ``model`` itself when it has none."""
    g = model.graph
    if not any(n.op_type == "Dropout" and len(n.output) > 1 and n.output[1] for n in g.node):
        return model
    # the main graph's initializers (those also declared inputs may be fed: not constants) and Constants
    consts = constant_arrays(g, {i for n in g.node for i in n.input}, {i.name for i in g.input})
    producer = {o: n for n in g.node for o in n.output if o}
    ratios: dict[str, float] = {}  # mask output → ratio
    for n in g.node:
        if n.op_type == "Dropout" and len(n.output) > 1 and n.output[1] and n.domain in ("", "ai.onnx"):
            r = _ratio(n, consts)
            if r is not None and 0.0 < r < 1.0:
                ratios[n.output[1]] = r
    found: dict[int, tuple[int, float]] = {}  # index of the scaling Mul → (index of its scale operand, ratio)
    index = {id(n): k for k, n in enumerate(g.node)}
    for n in g.node:
        if n.op_type != "Mul" or len(n.input) != 2:
            continue
        cast = producer.get(n.input[1])
        if cast is None or cast.op_type != "Cast" or cast.input[0] not in ratios:
            continue
        scaled = producer.get(n.input[0])
        if scaled is None or scaled.op_type != "Mul" or len(scaled.input) != 2:
            continue
        r = ratios[cast.input[0]]
        slot = _scale_slot(scaled, producer, consts, r)
        if slot is not None:
            found[index[id(scaled)]] = (slot, r)
    if not found:
        return model

    def divided(k: int, n: onnx.NodeProto, names: NameGen, _: onnx.ModelProto) -> list[onnx.NodeProto]:
        slot, r = found[k]
        scale = n.input[slot]
        dtype = consts[scale].dtype if scale in consts else consts[producer[scale].input[1]].dtype
        # onnxruntime: 1 − ratio in float32, the division in X's type (float32 for half types: the rebuild's)
        keep = np.asarray(np.float32(1.0) - np.float32(r)).astype(dtype)
        keep_name = names(f"{scale}_keep")
        nodes = [helper.make_node("Constant", [], [keep_name], name=names(f"{n.name or 'Mul'}_keep"),
                                  value=numpy_helper.from_array(keep, keep_name))]
        if scale not in consts:  # Where(training_mode, scale, 1): the training flag picks 1 − ratio or 1
            where = producer[scale]
            picked = names(f"{scale}_keep_picked")
            nodes.append(helper.make_node("Where", [where.input[0], keep_name, where.input[2]], [picked],
                                          name=names(f"{where.name or 'Where'}_keep")))
            keep_name = picked
        x = n.input[1 - slot]
        nodes.append(helper.make_node("Div", [x, keep_name], list(n.output), name=n.name))
        return nodes

    return with_nodes_replaced(model, found, divided)


def _scale_slot(mul: onnx.NodeProto, producer: dict[str, onnx.NodeProto], consts: dict[str, np.ndarray],
                ratio: float) -> int | None:
    """Which input of ``mul`` is the rebuild's scale for ``ratio`` (a constant 1 / (1 − ratio), or a Where of
    the training flag between it and 1), if one is."""
    for slot in (1, 0):
        v = mul.input[slot]
        if v in consts:
            if _is_scale(consts[v], ratio):
                return slot
            continue
        w = producer.get(v)
        if (w is not None and w.op_type == "Where" and len(w.input) == 3 and w.input[1] in consts
                and w.input[2] in consts and _is_scale(consts[w.input[1]], ratio)
                and consts[w.input[2]].size == 1 and float(consts[w.input[2]].reshape(-1)[0]) == 1.0):
            return slot
    return None


def _is_scale(value: np.ndarray, ratio: float) -> bool:
    """``value`` is one float, 1 / (1 − ratio) rounded to its type."""
    if value.size != 1 or value.dtype.kind != "f":
        return False
    return bool(value.reshape(-1)[0] == np.asarray(1.0 / (1.0 - ratio), dtype=value.dtype))
