"""onnxruntime backend: outputs written into donated inputs (onnxtrain/engine/ort_inplace.py)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.engine.backends import make_plan
from onnxtrain.engine.ort_inplace import safe_updates

pytest.importorskip("onnxruntime")
F = TensorProto.FLOAT


def graph(nodes, inputs, outputs, shape=(4, 3)) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, list(shape)) for n in inputs],
                          [helper.make_tensor_value_info(n, F, list(shape)) for n in outputs])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def momentum() -> onnx.ModelProto:
    """m' = m·0.9 + g; w' = w − m'; also y = w·2, which reads the old w after nothing in particular."""
    c = helper.make_node("Constant", [], ["k"], value=helper.make_tensor("k", F, [], [0.9]))
    nodes = [c, helper.make_node("Mul", ["m", "k"], ["mk"]), helper.make_node("Add", ["mk", "g"], ["m_new"]),
             helper.make_node("Sub", ["w", "m_new"], ["w_new"]), helper.make_node("Add", ["w", "w"], ["y"])]
    return graph(nodes, ["w", "m", "g"], ["w_new", "m_new", "y"])


def test_pairs_whose_old_value_is_read_elsewhere_are_refused() -> None:
    m = momentum()
    # m is only read on the way to m'; w is read by y = w + w, which may run after w' is written
    assert safe_updates(m, {"m_new": "m", "w_new": "w"}) == {"m_new": "m"}
    # g's only reader makes m', so m' may take g's array, y may not; an input serves one output at most
    assert safe_updates(m, {"y": "g", "m_new": "g"}) == {"m_new": "g"}
    assert safe_updates(m, {"m_new": "g", "w_new": "g"}) == {"m_new": "g"}
    assert safe_updates(m, {"nope": "m", "m_new": "nope"}) == {}


def test_views_of_the_input_count_as_readers() -> None:
    c = helper.make_node("Constant", [], ["s"], value=helper.make_tensor("s", TensorProto.INT64, [1], [-1]))
    nodes = [c, helper.make_node("Reshape", ["x", "s"], ["flat"]),
             helper.make_node("Neg", ["flat"], ["nf"]), helper.make_node("Add", ["x", "x"], ["x_new"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, [4, 3])],
                          [helper.make_tensor_value_info("x_new", F, [4, 3]),
                           helper.make_tensor_value_info("nf", F, [12])])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    assert safe_updates(m, {"x_new": "x"}) == {}  # Neg reads x through the Reshape's possible view
    # a graph output that may be a view of x keeps x alive after the run
    nodes = [helper.make_node("Identity", ["x"], ["same"]), helper.make_node("Add", ["x", "x"], ["x_new"])]
    esc = graph(nodes, ["x"], ["x_new", "same"])
    assert safe_updates(esc, {"x_new": "x"}) == {}


def test_ops_that_onnxruntime_may_remove_count_as_views() -> None:
    """t = f(x); x' = t·2; late = −t. When f is x·2, t is a new tensor and x's only reader is on the way to
    x'. When f is x·1 or a Cast to the same type, onnxruntime may remove it: late then reads x itself, and
    may run after x' is written."""
    one = helper.make_node("Constant", [], ["one"], value=helper.make_tensor("one", F, [], [1.0]))
    two = helper.make_node("Constant", [], ["two"], value=helper.make_tensor("two", F, [], [2.0]))
    for first, safe in ((helper.make_node("Mul", ["x", "two"], ["t"]), True),
                        (helper.make_node("Mul", ["x", "one"], ["t"]), False),
                        (helper.make_node("Cast", ["x"], ["t"], to=F), False)):
        nodes = [one, two, first, helper.make_node("Neg", ["t"], ["late"]),
                 helper.make_node("Mul", ["t", "two"], ["x_new"])]
        got = safe_updates(graph(nodes, ["x"], ["x_new", "late"]), {"x_new": "x"})
        assert got == ({"x_new": "x"} if safe else {}), first


def test_donated_inputs_receive_their_updates_with_the_right_values() -> None:
    m = momentum()
    plan = make_plan(m, "onnxruntime", updates={"m_new": "m", "w_new": "w"})
    rng = np.random.default_rng(0)
    w, mo, g = (rng.standard_normal((4, 3)).astype(np.float32) for _ in range(3))
    want_m, want_w = mo * np.float32(0.9) + g, w - (mo * np.float32(0.9) + g)
    held = mo.copy()
    out = plan.run({"w": w, "m": mo, "g": g}, ["w_new", "m_new", "y"], donate=["w", "m"])
    assert out[1] is mo  # written into the donated moment
    np.testing.assert_allclose(out[1], want_m, rtol=1e-6)
    np.testing.assert_allclose(out[0], want_w, rtol=1e-6)
    assert out[0] is not w and not np.shares_memory(out[0], w)  # refused pair: a fresh output
    # not donated, or a view, or fed under two names: never written
    for feeds, donate in [({"w": w, "m": held, "g": g}, []),
                          ({"w": w, "m": np.ascontiguousarray(held[None])[0], "g": g}, ["m"]),
                          ({"w": w, "m": held, "g": held}, ["m"])]:
        before = feeds["m"].copy()
        got = plan.run(feeds, ["m_new"], donate=donate)[0]
        assert got is not feeds["m"]
        np.testing.assert_array_equal(feeds["m"], before)


def test_optimizer_updates_parameters_in_their_arrays(tmp_path, monkeypatch) -> None:
    """The on-device AdamW graph: every weight and moment update is written into its array, so
    Parameter.data keeps aliasing the live weights with no copy, and the values are the numpy engine's."""
    import onnxtrain.training.api.optimizer as optimizer_module
    from onnxtrain import SessionOptions
    from tests.engine.graphs import on_device_mlp
    from tests.session.helpers import batches

    copied = []  # each weight update that came back in a new array and had to be copied into the old one
    into = optimizer_module._into

    def recording(current: np.ndarray, value: np.ndarray) -> np.ndarray:
        copied.append(value is not current)
        return into(current, value)

    monkeypatch.setattr(optimizer_module, "_into", recording)

    # the model as it is, not the flat variant (tests/training/test_flat_update.py)
    plain, so = SessionOptions(), SessionOptions()
    for o in (plain, so):
        o.add_session_config_entry("onnxtrain.flat_update", "0")
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    open_ = on_device_mlp(tmp_path)
    runs = []
    for options in (plain, so):
        state, module, opt = open_(options)
        arrays = {n: p.data for n, p in state.parameters}
        for x, y in batches(4, 16):
            module(np.asarray(x, np.float32), np.asarray(y) % 4)
            opt.step()
            module.lazy_reset_grad()
        assert all(p.data is arrays[n] for n, p in state.parameters)  # aliasing kept
        runs.append({n: p.data.copy() for n, p in state.parameters})
    assert set(opt._plan._inplace.values()) == set(opt._params) | set(opt._moments)
    assert len(copied) == 2 * 4 * 3 and not any(copied[-12:])  # onnxruntime's run: no copies
    for n in runs[0]:
        np.testing.assert_allclose(runs[1][n], runs[0][n], rtol=1e-5, atol=1e-6)


def test_an_order_through_a_shape_alone_does_not_count() -> None:
    """loss = ReduceSum(Gemm(Transpose(X), W, b, transA=1)) trained with SGD on the onnxruntime backend: the
    forward Gemm was an ancestor of W's update only through Shape(y) (ReduceSum's gradient), which
    onnxruntime folds when shapes are static; it then ran the update first and the Gemm read the new W (each
    step's loss was the next step's). The losses and weights are those of float64 steps by hand."""
    w0, b0 = np.array([[0.45], [-0.53]], np.float32), np.array([-0.17], np.float32)
    nodes = [helper.make_node("Transpose", ["X"], ["t"], perm=[1, 0]),
             helper.make_node("Gemm", ["t", "W", "b"], ["y"], transA=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 2])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [onnx.numpy_helper.from_array(w0, "W"), onnx.numpy_helper.from_array(b0, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.random.default_rng(1).standard_normal([2, 2]).astype(np.float32)
    losses, state = _sgd_run(model, {"X": x})
    w, b = w0.astype(np.float64), b0.astype(np.float64)
    for got in losses:
        np.testing.assert_allclose(got, np.sum(x @ w + b), rtol=1e-5)
        w, b = w - 0.1 * x.T.sum(axis=1, keepdims=True), b - 0.1 * 2
    np.testing.assert_allclose(state["W"], w, rtol=1e-5)
    np.testing.assert_allclose(state["b"], b, rtol=1e-5)


def _sgd_run(model: onnx.ModelProto, feeds: dict[str, np.ndarray], steps: int = 3):
    """Losses and final weights of ``steps`` legacy SGD steps (lr 0.1) on the onnxruntime backend."""
    from onnxtrain import TrainingSession
    from tests.session.helpers import backend_options, params

    sess = TrainingSession(model.SerializeToString(), params(), backend_options("onnxruntime"))
    losses = [float(sess.run(["loss"], {**feeds, "Learning_Rate": np.array([0.1], np.float32)})[0])
              for _ in range(steps)]
    return losses, sess.get_state()


def _torch_sgd(fn, weights: dict[str, np.ndarray], steps: int = 3):
    """The same steps in float64 with torch autograd: losses and final weights."""
    torch = pytest.importorskip("torch")
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in weights.items()}
    losses = []
    for _ in range(steps):
        loss = fn(torch, w)
        losses.append(float(loss))
        grads = torch.autograd.grad(loss, list(w.values()))
        with torch.no_grad():
            w = {k: (v - 0.1 * gr).requires_grad_(True) for (k, v), gr in zip(w.items(), grads)}
    return losses, {k: v.detach().numpy() for k, v in w.items()}


@pytest.mark.parametrize("scale", ["Mul", "Div", "Mul by Cast(1)"])
def test_a_weight_scaled_into_a_product_is_not_updated_under_its_reader(scale: str) -> None:
    """out = Tanh(x·W1)·(W2 ∘ c) with a constant c: onnxruntime's MatMulScaleFusion rewrote the backward
    product over (W2 ∘ c) into a FusedMatMul reading W2 itself, which then ran after W2's update was written
    in place (W1 off by 1e-3 after 3 steps); with c a Cast of 1, NoopElimination removed the Mul and its
    readers read W2 (4e-3). Losses and weights are torch's float64 steps."""
    rng = np.random.default_rng(0)
    w1, w2 = (rng.standard_normal(s).astype(np.float32) for s in ((4, 5), (5, 3)))
    w1 *= 0.5
    x, y = (rng.standard_normal(s).astype(np.float32) for s in ((2, 3, 4), (2, 3, 3)))
    f = TensorProto.FLOAT
    c = {"Mul": 0.5, "Div": 2.0, "Mul by Cast(1)": 1.0}[scale]
    op = "Div" if scale == "Div" else "Mul"
    nodes = [helper.make_node("Constant", [], ["c64"], value=onnx.numpy_helper.from_array(np.array(c))),
             helper.make_node("Cast", ["c64"], ["c"], to=f),
             helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("Tanh", ["a"], ["h"]),
             helper.make_node(op, ["W2", "c"], ["W2s"]), helper.make_node("MatMul", ["h", "W2s"], ["out"]),
             helper.make_node("Sub", ["out", "y"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 3, 4]),
                                       helper.make_tensor_value_info("y", f, [2, 3, 3])],
                          [helper.make_tensor_value_info("loss", f, [])],
                          [onnx.numpy_helper.from_array(w1, "W1"), onnx.numpy_helper.from_array(w2, "W2")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    losses, state = _sgd_run(model, {"x": x, "y": y})
    tx, ty = (np.asarray(v, np.float64) for v in (x, y))

    def fn(torch, w):
        w2s = w["W2"] / c if op == "Div" else w["W2"] * c
        return ((torch.tanh(torch.tensor(tx) @ w["W1"]) @ w2s - torch.tensor(ty)) ** 2).mean()

    want_losses, want = _torch_sgd(fn, {"W1": w1, "W2": w2})
    np.testing.assert_allclose(losses, want_losses, rtol=2e-6)
    for k in want:
        np.testing.assert_allclose(state[k], want[k], rtol=0, atol=2e-6)


def test_an_order_through_castlike_alone_does_not_count() -> None:
    """loss = Σ Gemm(Xᵀ, W, b)·CastLike(2, y): W's update depended on the forward Gemm only through the
    CastLike's type input, which onnxruntime folds; the Gemm then read the updated W (each loss was the
    next step's). Torch's float64 steps."""
    rng = np.random.default_rng(1)
    w0, b0 = rng.standard_normal((2, 1)).astype(np.float32), np.array([-0.17], np.float32)
    x = rng.standard_normal((2, 2)).astype(np.float32)
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Transpose", ["X"], ["t"], perm=[1, 0]),
             helper.make_node("Gemm", ["t", "W", "b"], ["y"], transA=1),
             helper.make_node("Constant", [], ["two"], value=onnx.numpy_helper.from_array(np.array(2.0))),
             helper.make_node("CastLike", ["two", "y"], ["k"]), helper.make_node("Mul", ["y", "k"], ["yk"]),
             helper.make_node("ReduceSum", ["yk"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", f, [2, 2])],
                          [helper.make_tensor_value_info("loss", f, [])],
                          [onnx.numpy_helper.from_array(w0, "W"), onnx.numpy_helper.from_array(b0, "b")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    losses, state = _sgd_run(model, {"X": x})
    tx = np.asarray(x, np.float64)
    want_losses, want = _torch_sgd(lambda torch, w: ((torch.tensor(tx) @ w["W"] + w["b"]) * 2).sum(),
                                   {"W": w0, "b": b0})
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    for k in want:
        np.testing.assert_allclose(state[k], want[k], rtol=1e-5)
