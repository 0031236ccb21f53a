"""Ops the onnxruntime backend could not load, where the numpy engine runs them, that a sweep of one-node
float16 models found: float16 `MeanVarianceNormalization` at opsets 13 and 18 (onnxruntime's function body
mixes types) and `GlobalLpPool` from opset 22 (no kernel of that version, float32 too). The backend now hands
them over as standard ops (onnxtrain/engine/ort_half_ops.py). Oracles: torch in float64, within float16
rounding (float32: 1e-6), on both backends.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession, SessionOptions, TrainingSession
from onnxtrain.engine.backends import CONFIG_KEY
from onnxtrain.engine.interface import InvalidNodeError
from tests.session.helpers import params

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
F = torch.nn.functional


def options(backend: str) -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    return so


def _model(op: str, attrs: dict, opset: int, elem: int, shape: list) -> bytes:
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="n", **attrs)], "g",
                          [helper.make_tensor_value_info("x", elem, shape)],
                          [helper.make_tensor_value_info("y", elem, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return model.SerializeToString()


def _within_half_rounding(got: np.ndarray, want: np.ndarray, msg: str) -> None:
    """``got`` (float16) within one float16 step of ``want`` (a wider exact value) everywhere."""
    assert got.dtype == np.float16, msg
    step = np.spacing(np.abs(want).astype(np.float16)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    assert (err <= step).all(), f"{msg}: off by {(err / step).max():.2f} float16 steps"


def _x16(shape: tuple, seed: int = 0) -> np.ndarray:
    x = (np.random.default_rng(seed).standard_normal(shape) * 3).astype(np.float16)
    x.flat[:4] = [0.0, -0.0, 6e-5, -6e-5]
    return x


def test_float16_celu_is_refused_by_name_on_both_backends() -> None:
    # invalid ONNX (Celu's T is float32): the numpy engine refuses it as onnxruntime does, so the backend's
    # rewrites must not make it run there alone
    model = _model("Celu", {"alpha": 1.5}, 17, TensorProto.FLOAT16, ["N", 3, 5])
    for b in ("onnxruntime", "numpy"):
        with pytest.raises(InvalidNodeError, match="Celu"):
            InferenceSession(model, options(b))


@pytest.mark.parametrize("opset", [13, 18])
def test_float16_mean_variance_normalization_runs_on_the_backend_as_torch(opset: int) -> None:
    model = _model("MeanVarianceNormalization", {}, opset, TensorProto.FLOAT16, ["N", 3, 4, 4])
    x = _x16((2, 3, 4, 4), 1)
    t = torch.from_numpy(x.astype(np.float64))
    d = t - t.mean((0, 2, 3), keepdim=True)
    want = (d / (d.pow(2).mean((0, 2, 3), keepdim=True).sqrt() + 1e-9)).numpy()
    for b in ("onnxruntime", "numpy"):
        _within_half_rounding(InferenceSession(model, options(b)).run(None, {"x": x})[0], want, b)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16])
def test_global_lp_pool_of_opset_22_runs_on_the_backend_as_torch(p: int, elem: int) -> None:
    model = _model("GlobalLpPool", {"p": p}, 22, elem, ["N", 3, 4, 5])
    x = _x16((2, 3, 4, 5), 2).astype(np.float32 if elem == TensorProto.FLOAT else np.float16)
    want = torch.from_numpy(x.astype(np.float64)).abs().pow(p).sum((2, 3), keepdim=True).pow(1 / p).numpy()
    for b in ("onnxruntime", "numpy"):
        got = InferenceSession(model, options(b)).run(None, {"x": x})[0]
        if elem == TensorProto.FLOAT16:
            _within_half_rounding(got, want, b)
        else:
            np.testing.assert_allclose(got, want, rtol=1e-6, err_msg=b)


@pytest.mark.parametrize("p", [2, 3])
@pytest.mark.parametrize("opset", [11, 13, 17, 21])
def test_float64_global_lp_pool_runs_on_the_backend_as_torch(p: int, opset: int) -> None:
    # onnxruntime has no float64 GlobalLpPool kernel at any opset
    model = _model("GlobalLpPool", {"p": p}, opset, TensorProto.DOUBLE, ["N", 3, 4, 5])
    x = np.random.default_rng(5).standard_normal((2, 3, 4, 5))
    want = torch.from_numpy(x).abs().pow(p).sum((2, 3), keepdim=True).pow(1 / p).numpy()
    for b in ("onnxruntime", "numpy"):
        got = InferenceSession(model, options(b)).run(None, {"x": x})[0]
        np.testing.assert_allclose(got, want, rtol=1e-13, err_msg=b)


def test_a_global_lp_pool_of_opset_22_trains_on_the_backend_as_torch() -> None:
    rng = np.random.default_rng(4)
    w = rng.uniform(0.5, 1.5, (3, 1, 1)).astype(np.float32)
    nodes = [helper.make_node("Mul", ["x", "W"], ["h"]),
             helper.make_node("GlobalLpPool", ["h"], ["p"], p=3),
             helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 4, 5])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    sessions = {b: TrainingSession(model.SerializeToString(), params("SGDOptimizer"), options(b))
                for b in ("onnxruntime", "numpy")}
    tw = torch.tensor(w.astype(np.float64), requires_grad=True)
    lr = float(np.float32(0.05))
    for n in (4, 2):
        x = rng.standard_normal((n, 3, 4, 5)).astype(np.float32)
        losses = {b: s.run(["loss"], {"x": x, "Learning_Rate": np.array([lr], np.float32)})[0]
                  for b, s in sessions.items()}
        tw.grad = None
        ref = (torch.from_numpy(x.astype(np.float64)) * tw).abs().pow(3).sum((2, 3)).pow(1 / 3).sum()
        ref.backward()
        with torch.no_grad():
            tw -= lr * tw.grad
        for b, s in sessions.items():
            np.testing.assert_allclose(losses[b], ref.item(), rtol=1e-5, err_msg=b)
            np.testing.assert_allclose(s.get_state()["W"], tw.detach().numpy(), rtol=1e-5, err_msg=b)
