"""float64 activations and pools that onnxruntime 1.32's CPU provider has no double kernel for (LeakyRelu,
Elu, Selu, Celu, Softplus, Softsign, HardSigmoid, HardSwish, Mish, ThresholdedRelu, tanh-Gelu, PRelu, Mean,
GlobalAveragePool, GlobalMaxPool): a float64 model holding one did not load on the onnxruntime backend
("Could not find an implementation"), where the numpy engine runs and trains it. The backend now hands them
over as standard ops that have float64 kernels (onnxtrain/engine/ort_float64.py). Oracles: torch in float64
(values and autograd) and the numpy engine.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession, SessionOptions, TrainingSession
from onnxtrain.engine.backends import CONFIG_KEY
from tests.session.helpers import params

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")
F = torch.nn.functional

# op, attributes, torch's function of x (float64)
UNARY = {
    "LeakyRelu": ({"alpha": 0.2}, lambda x: F.leaky_relu(x, float(np.float32(0.2)))),
    "LeakyRelu-default": ({}, lambda x: F.leaky_relu(x, float(np.float32(0.01)))),
    "LeakyRelu-steep": ({"alpha": 3.0}, lambda x: torch.where(x < 0, 3.0 * x, x)),
    "Elu": ({"alpha": 0.5}, lambda x: F.elu(x, 0.5)),
    "Selu": ({}, lambda x: float(np.float32(1.0507009873554804934193349852946)) * F.elu(
        x, float(np.float32(1.6732632423543772848170429916717)))),
    "Celu": ({"alpha": 2.0}, lambda x: F.celu(x, 2.0)),
    "Softplus": ({}, F.softplus),
    "Softsign": ({}, F.softsign),
    "HardSigmoid": ({"alpha": 0.25, "beta": 0.4},
                    lambda x: torch.clamp(x * 0.25 + float(np.float32(0.4)), 0, 1)),
    "HardSwish": ({}, lambda x: x * torch.clamp(x * float(np.float32(1 / 6)) + 0.5, 0, 1)),
    "Mish": ({}, F.mish),
    "ThresholdedRelu": ({"alpha": 0.3}, lambda x: torch.where(x > float(np.float32(0.3)), x, 0.0)),
    # ONNX's function body's constants are float32 values (torch's are exact)
    "Gelu": ({"approximate": "tanh"}, lambda x: 0.5 * x * (1 + torch.tanh(
        math.sqrt(float(np.float32(2 / math.pi))) * (x + float(np.float32(0.044715)) * x ** 3)))),
}


def options(backend: str) -> SessionOptions:
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    return so


def _unary_model(op: str, attrs: dict, opset: int) -> bytes:
    g = helper.make_graph([helper.make_node(op, ["x"], ["y"], name="act", **attrs)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 5])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["N", 5])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
    return model.SerializeToString()


def _x(n: int = 6) -> np.ndarray:
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 5)) * 4
    x[0, :4] = [0.0, -0.0, 1e-20, -1e-20]
    return x


@pytest.mark.parametrize("case", sorted(UNARY))
def test_float64_activation_runs_on_the_backend_as_torch(case: str) -> None:
    attrs, fn = UNARY[case]
    op = case.split("-")[0]
    model = _unary_model(op, attrs, 20)
    x = _x()
    want = fn(torch.from_numpy(x)).numpy()
    for backend in ("onnxruntime", "numpy"):
        got = InferenceSession(model, options(backend)).run(None, {"x": x})[0]
        assert got.dtype == np.float64
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-15, err_msg=backend)
    empty = InferenceSession(model, options("onnxruntime")).run(None, {"x": np.zeros((0, 5))})[0]
    assert empty.shape == (0, 5)


def test_float64_prelu_mean_and_global_pools_run_on_the_backend_as_torch() -> None:
    rng = np.random.default_rng(1)
    slope = rng.uniform(0.1, 0.5, (3, 1, 1))
    nodes = [helper.make_node("PRelu", ["x", "slope"], ["p"]),
             helper.make_node("Mean", ["x", "p", "x2"], ["m"]),
             helper.make_node("GlobalAveragePool", ["m"], ["avg"]),
             helper.make_node("GlobalMaxPool", ["m"], ["mx"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, ["N", 3, 4, 5])
                                       for n in ("x", "x2")],
                          [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in ("avg", "mx")],
                          [numpy_helper.from_array(slope, "slope")])
    for opset in (13, 18):
        model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)
        x, x2 = rng.standard_normal((2, 3, 4, 5)), rng.standard_normal((2, 3, 4, 5))
        tx = torch.from_numpy(x)
        m = (tx + F.prelu(tx, torch.from_numpy(slope.reshape(3))) + torch.from_numpy(x2)) / 3
        want = [m.mean((2, 3), keepdim=True).numpy(), m.amax((2, 3), keepdim=True).numpy()]
        for backend in ("onnxruntime", "numpy"):
            got = InferenceSession(model.SerializeToString(), options(backend)).run(None, {"x": x, "x2": x2})
            for a, b in zip(got, want):
                np.testing.assert_allclose(a, b, rtol=1e-12, atol=1e-15, err_msg=f"{backend} opset {opset}")


def test_a_float64_model_with_such_activations_trains_on_the_backend_as_torch() -> None:
    rng = np.random.default_rng(2)
    w1, w2 = rng.standard_normal((4, 6)) * 0.5, rng.standard_normal((6, 3)) * 0.5
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("LeakyRelu", ["h"], ["a"], alpha=0.1),
             helper.make_node("Elu", ["a"], ["e"]),
             helper.make_node("MatMul", ["e", "W2"], ["o"]),
             helper.make_node("Softplus", ["o"], ["s"]),
             helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
                          [numpy_helper.from_array(w1, "W1"), numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    sess = TrainingSession(model.SerializeToString(), params("SGDOptimizer"), options("onnxruntime"))
    t1, t2 = torch.tensor(w1, requires_grad=True), torch.tensor(w2, requires_grad=True)
    opt = torch.optim.SGD([t1, t2], lr=float(np.float32(0.05)))  # (the fed learning rate is float32)
    for n in (5, 3):
        x = rng.standard_normal((n, 4))
        loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([0.05], np.float32)})[0]
        opt.zero_grad()
        ref = F.softplus(F.elu(F.leaky_relu(torch.from_numpy(x) @ t1, float(np.float32(0.1)))) @ t2).sum()
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-10)
        state = sess.get_state()
        np.testing.assert_allclose(state["W1"], t1.detach().numpy(), rtol=1e-9, atol=1e-12)
        np.testing.assert_allclose(state["W2"], t2.detach().numpy(), rtol=1e-9, atol=1e-12)
