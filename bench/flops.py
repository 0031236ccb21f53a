"""FLOPs of one training step of an exported model, counted from its forward graph at a batch size.

Only MatMul, Gemm and Conv are counted (2 FLOPs per multiply-add; everything else is a rounding error on
these models). Forward: each product once. Backward: one product of the same size per operand that needs
a gradient — the weight operand always, the activation operand only when it depends on a trained
parameter: a model's first layer needs no input gradient (the MLP's is 30 % of a 2× forward backward, so
its step is 20 % below 3× forward), attention's batched products need both, the GPT's vocabulary head
its weight's and its input's. Shapes come from running the forward graph once with onnxtrain's engine.
tests/bench/test_flop_counts.py checks every bench model against torch's ``FlopCounterMode`` over the
torch module's forward and backward (they agree exactly), and the MLP against a hand count.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx

from onnxtrain.engine.plan import Plan, Step

COUNTED = ("MatMul", "Gemm", "Conv")


def _forward_flops(node: onnx.NodeProto, ins: list[Any], outs: list[Any]) -> int:
    y = np.shape(outs[0])
    if node.op_type == "Conv":
        return 2 * math.prod(y) * math.prod(np.shape(ins[1])[1:])
    a = np.shape(ins[0])
    if node.op_type == "Gemm":
        trans_a = any(at.name == "transA" and at.i for at in node.attribute)
        return 2 * math.prod(y) * (a[0] if trans_a else a[1])
    return 2 * math.prod(y) * a[-1]


def step_flops(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, int]:
    """``{"forward": F, "backward": B, "step": F + B}`` for ``model`` run on ``feeds``."""
    plan = Plan(model, fuse=False)  # the graph's own MatMul/Gemm/Conv nodes
    params = {
        t.name
        for t in model.graph.initializer
        if t.data_type in (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE)
    }
    needs_grad = set(params)
    for node in model.graph.node:
        if any(i in needs_grad for i in node.input) and node.op_type not in ("Shape", "Size"):
            needs_grad.update(o for o in node.output if o)
    seen: list[tuple[onnx.NodeProto, list[Any], list[Any]]] = []

    def recording(st: Step):
        def fn(inputs, attrs):
            res = st.fn(inputs, attrs)
            if st.node.op_type in COUNTED:
                seen.append((st.node, list(inputs), list(res)))
            return res

        return fn

    plan.steps = [Step(recording(st), st.inputs, st.outputs, st.attrs, st.free, st.node) for st in plan.steps]
    plan.run(feeds)
    fwd = bwd = 0
    for node, ins, outs in seen:
        f = _forward_flops(node, ins, outs)
        fwd += f
        bwd += f * sum(n in needs_grad for n in node.input[:2])
    return {"forward": fwd, "backward": bwd, "step": fwd + bwd}
