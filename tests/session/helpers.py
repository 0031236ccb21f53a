"""Small hand-built models with their loss in the graph, and float64 numpy optimizer references."""

from __future__ import annotations

import threading
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import TrainingParameters
from onnxtrain.ir.builder import make_model


def mlp_model(
    din: int = 8, dh: int = 16, dout: int = 4, seed: int = 0, loss: str = "sce", act: str = "Relu"
) -> onnx.ModelProto:
    """x[N,din] → Gemm → act → Gemm → logits; loss = SoftmaxCrossEntropyLoss(logits, y) (or MSE)."""
    rng = np.random.default_rng(seed)
    inits = [
        numpy_helper.from_array((rng.standard_normal((dh, din)) * 0.3).astype(np.float32), "W1"),
        numpy_helper.from_array((rng.standard_normal(dh) * 0.1).astype(np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((dout, dh)) * 0.3).astype(np.float32), "W2"),
        numpy_helper.from_array((rng.standard_normal(dout) * 0.1).astype(np.float32), "b2"),
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
        helper.make_node(act, ["h"], ["hr"]),
        helper.make_node("Gemm", ["hr", "W2", "b2"], ["logits"], transB=1),
    ]
    if loss == "sce":
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"]))
        y = helper.make_tensor_value_info("y", T.INT64, ["N"])
    else:
        nodes += [
            helper.make_node("Sub", ["logits", "y"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["d2"]),
            helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
        ]
        y = helper.make_tensor_value_info("y", T.FLOAT, ["N", dout])
    g = helper.make_graph(
        nodes,
        "mlp",
        [helper.make_tensor_value_info("x", T.FLOAT, ["N", din]), y],
        [
            helper.make_tensor_value_info("loss", T.FLOAT, []),
            helper.make_tensor_value_info("logits", T.FLOAT, ["N", dout]),
        ],
        inits,
    )
    return make_model(g, 17)


def params(opt: str = "SGDOptimizer", **kw) -> TrainingParameters:
    """TrainingParameters with loss ``loss``, optimizer ``opt`` and the given properties."""
    from onnxtrain import TrainingParameters

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    for k, v in kw.items():
        setattr(p, k, v)
    return p


def backend_options(backend: str, level: int | None = None):
    """SessionOptions of sessions on ``backend`` ("numpy" or "onnxruntime": config entry onnxtrain.backend;
    skips the calling test without onnxruntime), with graph optimization ``level`` if given."""
    import pytest

    from onnxtrain import SessionOptions

    so = SessionOptions()
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    if level is not None:
        so.graph_optimization_level = level
    return so


def sgd_matches_torch(model: bytes, w0: np.ndarray, feeds: list, torch_loss, lr: float) -> None:
    """Legacy SGD steps on both backends against torch's SGD: the model's one weight ``W`` (initial value
    ``w0``) and loss ``loss``; ``feeds`` the batches (``x`` each); ``torch_loss(x, w)`` the float64 loss."""
    import torch

    from onnxtrain import TrainingSession

    sessions = {b: TrainingSession(model, params("SGDOptimizer"), backend_options(b))
                for b in ("onnxruntime", "numpy")}
    wt = torch.tensor(w0.astype(np.float64), requires_grad=True)
    opt = torch.optim.SGD([wt], lr=lr)
    for x in feeds:
        losses = {b: s.run(["loss"], {"x": x, "Learning_Rate": np.array([lr], np.float32)})[0]
                  for b, s in sessions.items()}
        opt.zero_grad()
        ref = torch_loss(torch.tensor(x, dtype=torch.float64), wt)
        ref.backward()
        opt.step()
        for b, s in sessions.items():
            np.testing.assert_allclose(losses[b], ref.item(), rtol=1e-5, err_msg=b)
            np.testing.assert_allclose(s.get_state()["W"], wt.detach().numpy(), rtol=1e-5, atol=1e-6,
                                       err_msg=b)


def batches(n: int, size: int, din: int = 8, dout: int = 4, seed: int = 1, loss: str = "sce"):
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        x = rng.standard_normal((size, din)).astype(np.float32)
        y = (
            rng.integers(0, dout, size)
            if loss == "sce"
            else rng.standard_normal((size, dout)).astype(np.float32)
        )
        out.append((x, y))
    return out


def weights_of(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t).copy() for t in model.graph.initializer}


def adam_ref(w, g, m1, m2, t, lr, alpha=0.9, beta=0.999, lam=0.0, eps=1e-8, bias=True, mode=0, f32=True):
    """Spec §7.3 in float64; returns (w, m1, m2). α and β as onnxruntime's float32 attributes hold them
    (``f32``; a float64 model's update takes them as given)."""
    alpha, beta = (float(np.float32(alpha)), float(np.float32(beta))) if f32 else (alpha, beta)
    m1 = alpha * m1 + (1 - alpha) * g
    m2 = beta * m2 + (1 - beta) * g * g
    c1, c2 = (1 - alpha**t, 1 - beta**t) if bias and t > 0 else (1.0, 1.0)  # onnxruntime: 1 for t ≤ 0
    if mode == 0:
        w = w - lr * ((m1 / c1) / (np.sqrt(m2 / c2) + eps) + lam * w)
    else:
        u = lr * np.sqrt(c2) / c1 * m1 / (np.sqrt(m2) + eps)
        w = w - u - lr * lam * (w - u)
    return w, m1, m2


def lamb_ref(
    w, g, m1, m2, t, lr, alpha=0.9, beta=0.999, lam=0.0, eps=1e-6, bias=False, rmin=-np.inf, rmax=np.inf,
    f32=True,
):
    """Spec §7.4 in float64 for one weight; returns (w, m1, m2) (α and β: as :func:`adam_ref`)."""
    alpha, beta = (float(np.float32(alpha)), float(np.float32(beta))) if f32 else (alpha, beta)
    m1n = alpha * m1 + (1 - alpha) * g
    m2n = beta * m2 + (1 - beta) * g * g
    c1, c2 = (1 - alpha**t, 1 - beta**t) if bias and t > 0 else (1.0, 1.0)
    d = lam * w + (m1n / c1) / (np.sqrt(m2n / c2) + eps)
    bad = ~np.isfinite(d)
    d = np.where(bad, 0, d)
    m1n, m2n = np.where(bad, m1, m1n), np.where(bad, m2, m2n)
    wn, dn = np.linalg.norm(w), np.linalg.norm(d)
    eta = lr * max(rmin, min(rmax, wn / dn)) if wn > 0 and dn > 0 else lr  # the kernel's order
    cand = w - eta * d
    return np.where(np.isfinite(cand), cand, w), m1n, m2n


def in_threads(n: int, work: Callable[[int], None], timeout: float = 300) -> list[str]:
    """Run ``work(i)`` on ``n`` threads started together (each joined within ``timeout`` seconds); the errors
    they raised, as text."""
    errors: list[str] = []
    start = threading.Barrier(n)

    def run(i: int) -> None:
        try:
            start.wait()
            work(i)
        except Exception as e:  # noqa: BLE001 - collected for the assertion
            errors.append(repr(e))

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    return errors
