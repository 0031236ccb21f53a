"""The opset-23 ops torch's exporter writes, run and differentiated as their ONNX bodies, against torch's own
functions and autograd in float32 with the ops' default precision settings: RMSNormalization against
``F.rms_norm``, Attention against ``F.scaled_dot_product_attention`` (causal, grouped heads, additive and
boolean masks, a given scale, 3-D inputs), RotaryEmbedding against the rotation written out in torch, Swish
and SwiGLU against ``F.silu``."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _check(op: str, opset: int, inputs: dict[str, np.ndarray], wrt: list[str], reference: Callable,
           out_shape: tuple[int, ...], rtol: float = 2e-5, **attrs) -> None:
    """One ``op`` node, loss Σ y·r with a fixed random r: the loss and the gradients of ``wrt`` equal
    torch's (``reference`` maps torch tensors in the inputs' order to y) to ``rtol`` of their norms."""
    r = np.random.default_rng(7).standard_normal(out_shape).astype(np.float32)
    names = list(inputs)
    nodes = [helper.make_node(op, names, ["y"], name=op, **attrs),
             helper.make_node("Mul", ["y", "r"], ["yr"]),
             helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in inputs.items()]
    graph = helper.make_graph(nodes, op, g_in, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(r, "r")])
    model = build_gradient_model(make_model(graph, opset), "loss", wrt)
    onnx.checker.check_model(model, full_check=True)
    assert op not in {n.op_type for n in model.graph.node}  # differentiated as its body
    got = dict(zip([o.name for o in model.graph.output], run_engine(model, inputs)))
    ts = {n: torch.tensor(v, requires_grad=n in wrt) for n, v in inputs.items()}
    loss = (reference(*ts.values()) * torch.from_numpy(r)).sum()
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=rtol, atol=1e-5)
    for n in wrt:
        want = ts[n].grad.numpy()
        err = np.linalg.norm(got[f"{n}_grad"] - want) / max(np.linalg.norm(want), 1e-12)
        assert err < rtol, (n, err)


def _rand(*shape: int, seed: int = 0, low: float = -1.0, high: float = 1.0) -> np.ndarray:
    return np.random.default_rng(seed).uniform(low, high, shape).astype(np.float32)


@pytest.mark.parametrize("axis,eps", [(-1, 1e-5), (1, 1e-3)])
def test_rms_norm(axis: int, eps: float) -> None:
    x = _rand(2, 3, 8, seed=1, low=-2, high=2)
    normalized = x.shape[axis:]
    scale = _rand(*normalized, seed=2, low=0.5, high=1.5)
    _check("RMSNormalization", 23, {"x": x, "scale": scale}, ["x", "scale"],
           lambda x, s: F.rms_norm(x, normalized, s, eps), x.shape, axis=axis, epsilon=eps)


ATTENTION = {  # case → (Q, K, V shapes, mask or None, attributes, the torch call's keywords)
    "plain": ((2, 2, 3, 4), (2, 2, 5, 4), None, {}, {}),
    "causal": ((2, 2, 5, 4), (2, 2, 5, 4), None, {"is_causal": 1}, {"is_causal": True}),
    "gqa_causal": ((1, 4, 5, 4), (1, 2, 5, 4), None, {"is_causal": 1},
                   {"is_causal": True, "enable_gqa": True}),
    "scale": ((2, 2, 3, 8), (2, 2, 3, 8), None, {"scale": 0.2}, {"scale": 0.2}),
    "float_mask": ((2, 2, 3, 4), (2, 2, 4, 4), "float", {}, {}),
    "bool_mask": ((2, 2, 3, 4), (2, 2, 4, 4), "bool", {}, {}),
}


@pytest.mark.parametrize("case", list(ATTENTION))
def test_attention(case: str) -> None:
    qs, ks, mask, attrs, kw = ATTENTION[case]
    inputs = {"q": _rand(*qs, seed=1), "k": _rand(*ks, seed=2), "v": _rand(*ks, seed=3)}
    if mask == "float":
        inputs["mask"] = _rand(qs[-2], ks[-2], seed=4, low=-2, high=0)
    elif mask == "bool":
        m = np.random.default_rng(4).uniform(0, 1, (qs[0], 1, qs[-2], ks[-2])) < 0.6
        m[..., 0] = True  # every query keeps a key
        inputs["mask"] = m

    def reference(q, k, v, *m):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=m[0] if m else None, **kw)

    _check("Attention", 23, inputs, ["q", "k", "v"], reference, qs, **attrs)


def test_attention_3d_inputs() -> None:
    """(batch, sequence, heads × head size) inputs with q_num_heads and kv_num_heads."""
    q, k, v = _rand(2, 3, 8, seed=1), _rand(2, 4, 4, seed=2), _rand(2, 4, 4, seed=3)

    def reference(q, k, v):
        def heads(t, n):
            return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(1, 2)
        y = F.scaled_dot_product_attention(heads(q, 4), heads(k, 2), heads(v, 2), enable_gqa=True)
        return y.transpose(1, 2).reshape(2, 3, 8)

    _check("Attention", 23, {"q": q, "k": k, "v": v}, ["q", "k", "v"], reference, (2, 3, 8),
           q_num_heads=4, kv_num_heads=2)


@pytest.mark.parametrize("interleaved", [0, 1])
def test_rotary_embedding(interleaved: int) -> None:
    """x (batch, heads, sequence, 8) rotated by the caches' angles at the given positions."""
    x = _rand(2, 2, 3, 8, seed=1, low=-2, high=2)
    angles = np.random.default_rng(2).uniform(0, 2 * np.pi, (6, 4))
    cos, sin = np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
    pos = np.array([[0, 1, 2], [3, 5, 4]], np.int64)

    def reference(x, cos, sin, pos):
        c, s = cos[pos][:, None], sin[pos][:, None]  # (batch, 1, sequence, 4)
        if interleaved:
            a, b = x[..., 0::2], x[..., 1::2]
            return torch.stack([a * c - b * s, b * c + a * s], dim=-1).flatten(-2)
        a, b = x[..., :4], x[..., 4:]
        return torch.cat([a * c - b * s, b * c + a * s], dim=-1)

    _check("RotaryEmbedding", 23, {"x": x, "cos": cos, "sin": sin, "pos": pos}, ["x", "cos", "sin"],
           reference, x.shape, interleaved=interleaved)


def test_swish_and_swiglu() -> None:
    a, b = _rand(3, 5, seed=1, low=-3, high=3), _rand(3, 5, seed=2)
    _check("Swish", 24, {"a": a}, ["a"], lambda a: a * torch.sigmoid(1.5 * a), a.shape, alpha=1.5)
    _check("Swish", 24, {"a": a}, ["a"], F.silu, a.shape)
    _check("SwiGLU", 28, {"a": a, "b": b}, ["a", "b"], lambda a, b: F.silu(a) * b, a.shape)
