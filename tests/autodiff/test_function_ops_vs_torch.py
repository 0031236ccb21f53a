"""The opset-23 ops torch's exporter writes, run and differentiated as their ONNX bodies, against torch's own
functions and autograd in float32 with the ops' default precision settings: RMSNormalization against
``F.rms_norm``, Attention against ``F.scaled_dot_product_attention`` (causal, grouped heads, additive and
boolean masks, a given scale, 3-D inputs), RotaryEmbedding against the rotation written out in torch, Swish
and SwiGLU against ``F.silu``, and LinearAttention (opset 27) against its recurrence written out in torch."""

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


def _check(op: str, opset: int, inputs: dict[str, np.ndarray | None], wrt: list[str], reference: Callable,
           out_shape: tuple[int, ...] | list[tuple[int, ...]], rtol: float = 2e-5,
           **attrs) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ``op`` node, loss Σ yᵢ·rᵢ over its outputs with fixed random rᵢ: the loss and the gradients of
    ``wrt`` equal torch's (``reference`` maps torch tensors in the inputs' order, None for an input left
    out, to y or a tuple of the outputs) to ``rtol`` of their norms. ``out_shape``: y's shape, or a list of
    the outputs' shapes."""
    shapes = list(out_shape) if isinstance(out_shape, list) else [out_shape]
    rng = np.random.default_rng(7)
    rs = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    ys = [f"y{i}" for i in range(len(shapes))]
    nodes = [helper.make_node(op, [n if v is not None else "" for n, v in inputs.items()], ys, name=op,
                              **attrs)]
    for y in ys:
        nodes += [helper.make_node("Mul", [y, f"r_{y}"], [f"{y}r"]),
                  helper.make_node("ReduceSum", [f"{y}r"], [f"{y}_sum"], keepdims=0)]
    nodes.append(helper.make_node("Sum", [f"{y}_sum" for y in ys], ["loss"]))
    given = {n: v for n, v in inputs.items() if v is not None}
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in given.items()]
    graph = helper.make_graph(nodes, op, g_in, [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              [onnx.numpy_helper.from_array(r, f"r_{y}") for y, r in zip(ys, rs)])
    model = build_gradient_model(make_model(graph, opset), "loss", wrt)
    onnx.checker.check_model(model, full_check=True)
    assert op not in {n.op_type for n in model.graph.node}  # differentiated as its body
    got = dict(zip([o.name for o in model.graph.output], run_engine(model, given)))
    ts = {n: torch.tensor(v, requires_grad=n in wrt) if v is not None else None for n, v in inputs.items()}
    out = reference(*ts.values())
    out = out if isinstance(out, tuple) else (out,)
    loss = sum((y * torch.from_numpy(r)).sum() for y, r in zip(out, rs))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=rtol, atol=1e-5)
    for n in wrt:
        want = ts[n].grad.numpy()
        err = np.linalg.norm(got[f"{n}_grad"] - want) / max(np.linalg.norm(want), 1e-12)
        assert err < rtol, (n, err)
    return model, got


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


def _linear_attention(rule: str, hq: int, hkv: int, scale: float):
    """LinearAttention's recurrence, one token at a time, as its ONNX schema states it: the state S (batch,
    kv heads, d_k, d_v) decays by exp(decay) per key row and takes β·k ⊗ (v − decayed Sᵀk) (delta rules) or
    k ⊗ v; query head h reads kv head h // (hq / hkv)."""

    def heads(t, n):
        return t.reshape(t.shape[0], t.shape[1], n, -1).transpose(1, 2)  # (batch, heads, time, width)

    def reference(q, k, v, past, decay, beta):
        q, k, v = heads(q, hq), heads(k, hkv), heads(v, hkv)
        s = past if past is not None else q.new_zeros(q.shape[0], hkv, k.shape[-1], v.shape[-1])
        outs = []
        for t in range(q.shape[2]):
            kt, vt = k[:, :, t], v[:, :, t]
            if decay is not None:
                s = s * torch.exp(heads(decay, hkv)[:, :, t]).unsqueeze(-1)
            if beta is None:
                s = s + kt.unsqueeze(-1) * vt.unsqueeze(-2)
            else:
                bt = heads(beta, beta.shape[-1])[:, :, t]  # (batch, kv heads or 1, 1)
                read = (s * kt.unsqueeze(-1)).sum(-2)  # Sᵀk
                s = s + kt.unsqueeze(-1) * (bt * (vt - read)).unsqueeze(-2)
            shared = s.repeat_interleave(hq // hkv, dim=1)
            outs.append(scale * (q[:, :, t].unsqueeze(-1) * shared).sum(-2))
        y = torch.stack(outs, 2)  # (batch, q heads, time, d_v)
        return y.transpose(1, 2).reshape(q.shape[0], q.shape[2], -1), s

    return reference


LINEAR_ATTENTION = {  # case → update rule, q heads, kv heads, decay width per kv head (0: none), β width
    "linear": ("linear", 2, 2, 0, 0),
    "gated_per_key": ("gated", 2, 2, 4, 0),
    "delta": ("delta", 2, 2, 0, 2),
    "gated_delta_gqa": ("gated_delta", 4, 2, 1, 2),
    "gated_delta_shared_beta": ("gated_delta", 2, 2, 1, 1),
}


@pytest.mark.parametrize("case", list(LINEAR_ATTENTION))
def test_linear_attention(case: str) -> None:
    """The output and the final state over 5 tokens from a given past state (d_k = d_v = 4); gradients of
    every input."""
    rule, hq, hkv, decay_width, beta_width = LINEAR_ATTENTION[case]
    b, t, d = 2, 5, 4
    k = _rand(b, t, hkv, d, seed=2)
    k /= np.linalg.norm(k, axis=-1, keepdims=True)  # the delta rules expect unit keys
    inputs = {
        "q": _rand(b, t, hq * d, seed=1), "k": k.reshape(b, t, hkv * d), "v": _rand(b, t, hkv * d, seed=3),
        "past": _rand(b, hkv, d, d, seed=4, low=-0.5, high=0.5),
        "decay": _rand(b, t, hkv * decay_width, seed=5, low=-0.6, high=-0.05) if decay_width else None,
        "beta": _rand(b, t, beta_width, seed=6, low=0.2, high=0.9) if beta_width else None,
    }
    wrt = [n for n, v in inputs.items() if v is not None]
    model, got = _check("LinearAttention", 27, inputs, wrt, _linear_attention(rule, hq, hkv, d**-0.5),
                        [(b, t, hq * d), (b, hkv, d, d)], q_num_heads=hq, kv_num_heads=hkv, update_rule=rule)
    # the gradient graph (the body's Scan and its backward Loop) runs on onnxruntime as on the engine
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    given = {n: v for n, v in inputs.items() if v is not None}
    for o, v in zip(sess.get_outputs(), sess.run(None, given)):
        np.testing.assert_allclose(v, got[o.name], rtol=1e-5, atol=1e-6, err_msg=o.name)
