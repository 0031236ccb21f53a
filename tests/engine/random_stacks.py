"""Seeded random transformer stacks for the recompute, accumulation and export checks (an extension of
tests/engine/random_models.py, whose single-block models give the recompute passes little to select).

``make_stack(seed)`` builds 2-3 layers, pre-LN (GPT) or post-LN (BERT), each an attention block (q, k, v
projections, a causal mask or none, Softmax, a seeded training-mode Dropout of the probabilities feeding
their MatMul with v) and an MLP block whose GELU is the ``Gelu`` op (opset 20), its erf form or its tanh form,
with a seeded Dropout after it or none, then a pooled head and a loss (cross-entropy or MSE) of the mean over
the batch. Float32 or float16 weights; a batch size of 1 to 4 (the same every step). The result is a
:class:`tests.engine.random_models.Case` whose body is the model with its loss, for ``run_legacy``.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper

from tests.engine.random_models import STEPS, Case, _Builder, _feed, _loss_nodes


def _gelu(b: _Builder, x: str, kind: str) -> str:
    if kind == "Gelu":
        return b.op("Gelu", [x])
    if kind == "erf":  # x · ½ · (1 + erf(x / √2))
        e = b.op("Erf", [b.op("Div", [x, b.const(np.sqrt(2.0))])])
        return b.op("Mul", [b.op("Mul", [x, b.op("Add", [e, b.const(1.0)])]), b.const(0.5)])
    # tanh form: ½ · x · (1 + tanh(√(2/π) · (x + 0.044715 · x³)))
    cube = b.op("Pow", [x, b.const(3.0)])
    inner = b.op("Add", [x, b.op("Mul", [cube, b.const(0.044715)])])
    inner = b.op("Mul", [inner, b.const(np.sqrt(2 / np.pi))])
    t = b.op("Add", [b.op("Tanh", [inner]), b.const(1.0)])
    return b.op("Mul", [b.op("Mul", [b.const(0.5), x]), t])


def _dropout(b: _Builder, x: str, ratio: float) -> str:
    seed = int(b.rng.integers(1, 1000))
    return b.op("Dropout", [x, b.const(ratio), b.const(True, np.bool_)], 2, seed=seed)[0]


def _linear(b: _Builder, x: str, din: int, dout: int, bias: bool = True) -> str:
    y = b.op("MatMul", [x, b.weight((din, dout), 1 / np.sqrt(din))])
    return b.op("Add", [y, b.weight((dout,), 0.1)]) if bias else y


def make_stack(seed: int, dtype: Any = None, layers: int | None = None) -> Case:
    """The random transformer stack of ``seed`` and 20 steps of its data."""
    rng = np.random.default_rng(10_000 + seed)
    dtype = np.dtype(dtype or (np.float16 if rng.random() < 0.2 else np.float32))
    b = _Builder(rng, dtype)
    layers = layers or int(rng.integers(2, 4))
    vocab, t = int(rng.integers(4, 9)), int(rng.integers(3, 6))
    heads = int(rng.choice([1, 2]))
    dh = int(rng.integers(3, 5))
    dm = heads * dh
    hidden = int(rng.integers(4, 10))
    post_ln = bool(rng.random() < 0.5)
    gelu = str(rng.choice(["Gelu", "erf", "tanh"]))
    opset = 20 if gelu == "Gelu" else int(rng.choice([17, 18, 20]))
    p_attn = float(rng.choice([0.0, 0.1, 0.25]))
    p_mlp = float(rng.choice([0.0, 0.1]))
    causal = bool(rng.random() < 0.5)
    b.notes += [f"layers={layers}", "post-ln" if post_ln else "pre-ln", f"gelu={gelu}", f"attn-drop={p_attn}",
                f"mlp-drop={p_mlp}", "causal" if causal else "full", f"heads={heads}", f"opset={opset}"]

    def ln(x: str) -> str:
        ins = [x, b.scale_weight(dm), b.weight((dm,), 0.1)]
        return b.op("LayerNormalization", ins, axis=-1, epsilon=1e-5)

    def heads_of(v: str, perm: list[int]) -> str:
        r = b.op("Reshape", [v, b.held(np.array([0, t, heads, dh], np.int64))])
        return b.op("Transpose", [r], perm=perm)

    def attention(x: str) -> str:
        q = heads_of(_linear(b, x, dm, dm), [0, 2, 1, 3])
        k = heads_of(_linear(b, x, dm, dm, bias=False), [0, 2, 3, 1])
        v = heads_of(_linear(b, x, dm, dm), [0, 2, 1, 3])
        s = b.op("Mul", [b.op("MatMul", [q, k]), b.const(1.0 / np.sqrt(dh))])
        if causal:
            s = b.op("Where", [b.held(np.triu(np.ones((t, t), bool), 1)), b.const(-1e4), s])
        probs = b.op("Softmax", [s], axis=-1)
        if p_attn > 0:
            probs = _dropout(b, probs, p_attn)
        a = b.op("Transpose", [b.op("MatMul", [probs, v])], perm=[0, 2, 1, 3])
        return _linear(b, b.op("Reshape", [a, b.held(np.array([0, t, dm], np.int64))]), dm, dm)

    def mlp(x: str) -> str:
        h = _linear(b, _gelu(b, _linear(b, x, dm, hidden), gelu), hidden, dm)
        return _dropout(b, h, p_mlp) if p_mlp > 0 else h

    x = b.op("Gather", [b.weight((vocab, dm), 0.5), "ids"])
    x = b.op("Add", [x, b.weight((t, dm), 0.2)])
    for _ in range(layers):
        if post_ln:
            x = ln(b.op("Add", [x, attention(x)]))
            x = ln(b.op("Add", [x, mlp(x)]))
        else:
            x = b.op("Add", [x, attention(ln(x))])
            x = b.op("Add", [x, mlp(ln(x))])
    if not post_ln:
        x = ln(x)
    pooled = b.op("ReduceMean", [x, b.held(np.array([1], np.int64))], keepdims=0) if opset >= 18 else \
        b.op("ReduceMean", [x], axes=[1], keepdims=0)
    k = int(rng.integers(2, 5))
    b.nodes.append(helper.make_node("Identity", [_linear(b, pooled, dm, k)], ["logits"], name="logits_out"))
    loss = str(rng.choice(["ce", "mse"]))
    y_info, loss_value = _loss_nodes(b, loss, "logits", k, None)
    b.nodes.append(helper.make_node("Identity", [loss_value], ["loss"], name="loss_out"))
    inputs = [helper.make_tensor_value_info("ids", T.INT64, ["N", t])]
    outputs = [helper.make_tensor_value_info("loss", b.elem, []),
               helper.make_tensor_value_info("logits", b.elem, ["N", k])]
    model = helper.make_model(helper.make_graph(b.nodes, "stack", inputs + y_info, outputs, b.inits),
                              opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    n = int(rng.integers(1, 5))
    b.notes.append(f"batch={n}")
    spec = {"ids": ("ids", (t,), vocab)}
    feeds = [_feed(rng, spec, n, loss, k, None, dtype) for _ in range(STEPS)]
    return Case(seed, "stack", loss, dtype, model, model, feeds, None, b.notes, set())
