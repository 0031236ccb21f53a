"""Inputs that share a symbolic dim name but are fed different sizes of it (one of them 1, broadcast).

ONNX takes one name for one size, and so does ``build_gradient_model`` by default (as onnxruntime-training's
builder did): the dims are listed in the graph's metadata and onnxtrain's sessions refuse feeds that break
them. With ``feeds_checked=False`` two inputs declared ``[N, 3]`` may be fed ``[4, 3]`` and ``[1, 3]``, and
the gradient of the second is summed back to ``[1, 3]`` at run time. Oracles: torch autograd on the same
broadcast, float64 finite differences, onnxruntime running the gradient graph.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain import InferenceSession
from onnxtrain.autodiff.builder import build_gradient_model
from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.engine.feed_sizes import FeedSizeMismatch, same_size_dims

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

F64 = TensorProto.DOUBLE


def _vi(name: str, dims: list, elem: int = F64) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _model(nodes: list, inputs: list, opset: int = 17) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, [_vi("loss", [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _unshared(gm: onnx.ModelProto) -> onnx.ModelProto:
    """``gm`` with each input's symbolic dims renamed after the input and the outputs' dims left open:
    onnxruntime plans its buffers by dim names (it takes one name for one size), so only so does it run a
    graph fed different sizes of a name; the graph's nodes are unchanged."""
    m = onnx.ModelProto()
    m.CopyFrom(gm)
    for v in m.graph.input:
        for d in v.type.tensor_type.shape.dim:
            if d.dim_param:
                d.dim_param = f"{v.name}_{d.dim_param}"
    for v in m.graph.output:
        v.type.tensor_type.ClearField("shape")
    del m.graph.value_info[:]
    return m


def _run_both(gm: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> list[dict[str, np.ndarray]]:
    """The gradient graph's outputs by name, from onnxruntime (onnx.reference for an op onnxruntime has no
    float64 kernel for) and from onnxtrain's engine."""
    names = [o.name for o in gm.graph.output]
    try:
        other = ort.InferenceSession(_unshared(gm).SerializeToString(), providers=["CPUExecutionProvider"])
    except ort.capi.onnxruntime_pybind11_state.NotImplemented:
        from onnx.reference import ReferenceEvaluator

        other = ReferenceEvaluator(gm)
    got = []
    for sess in (other, InferenceSession(gm.SerializeToString())):
        got.append(dict(zip(names, sess.run(names, feeds))))
    return got


def _torch_grads(fn, feeds: dict[str, np.ndarray], wrt: list[str]) -> dict[str, np.ndarray]:
    ts = {k: torch.tensor(v, requires_grad=k in wrt) for k, v in feeds.items()}
    fn(ts).backward()
    return {k: ts[k].grad.numpy() for k in wrt}


_BINARY = {
    "Add": lambda a, b: a + b,
    "Sub": lambda a, b: a - b,
    "Mul": lambda a, b: a * b,
    "Div": lambda a, b: a / b,
    "Pow": lambda a, b: a ** b,
    "Max": torch.maximum,
    "Min": torch.minimum,
    "Sum": lambda a, b: a + b,
    "Mean": lambda a, b: (a + b) / 2,
    "PRelu": lambda a, b: torch.where(a >= 0, a, a * b),
}


@pytest.mark.parametrize("op", sorted(_BINARY))
@pytest.mark.parametrize("rows", [(4, 1), (1, 4), (4, 4), (1, 1)])
def test_binary_op_inputs_sharing_a_dim_name(op, rows):
    """loss = Σ op(a, b)² with a, b both declared [N, 3]; every pair of row counts that broadcasts (PRelu's
    slope broadcasts to X, not X to it)."""
    if op == "PRelu" and rows[1] > rows[0]:
        pytest.skip("PRelu's slope cannot be larger than X")
    # (float32 for Mean: onnxruntime has no float64 Mean, and onnx.reference's Mean does not broadcast)
    elem, dtype, tol = (TensorProto.FLOAT, np.float32, 1e-5) if op == "Mean" else (F64, np.float64, 1e-10)
    nodes = [helper.make_node(op, ["a", "b"], ["c"]), helper.make_node("Mul", ["c", "c"], ["c2"]),
             helper.make_node("ReduceSum", ["c2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [_vi("a", ["N", 3], elem), _vi("b", ["N", 3], elem)],
                          [_vi("loss", [], elem)])
    gm = build_gradient_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "loss",
                              ["a", "b"], feeds_checked=False)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.uniform(0.5, 2.0, (rows[0], 3)).astype(dtype),
             "b": rng.uniform(-1.5, 1.5, (rows[1], 3)).astype(dtype)}
    want = _torch_grads(lambda t: (_BINARY[op](t["a"].double(), t["b"].double()) ** 2).sum(), feeds,
                        ["a", "b"])
    for got in _run_both(gm, feeds):
        for k in ("a", "b"):
            assert got[f"{k}_grad"].shape == feeds[k].shape, (op, rows, k)
            np.testing.assert_allclose(got[f"{k}_grad"], want[k], rtol=tol, atol=tol)


def test_where_with_three_inputs_sharing_a_dim_name():
    nodes = [helper.make_node("Where", ["c", "a", "b"], ["y"]), helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    m = _model(nodes, [_vi("c", ["N", 3], TensorProto.BOOL), _vi("a", ["N", 3]), _vi("b", ["N", 3])])
    gm = build_gradient_model(m, "loss", ["a", "b"], feeds_checked=False)
    rng = np.random.default_rng(1)
    feeds = {"c": rng.random((4, 3)) < 0.5, "a": rng.standard_normal((1, 3)),
             "b": rng.standard_normal((4, 3))}
    want = _torch_grads(lambda t: (torch.where(t["c"], t["a"], t["b"]) ** 2).sum(), feeds, ["a", "b"])
    for got in _run_both(gm, feeds):
        np.testing.assert_allclose(got["a_grad"], want["a"], rtol=1e-12)
        np.testing.assert_allclose(got["b_grad"], want["b"], rtol=1e-12)


@pytest.mark.parametrize("batches", [(4, 1), (1, 4), (3, 3)])
def test_matmul_batch_axes_sharing_a_dim_name(batches):
    nodes = [helper.make_node("MatMul", ["a", "b"], ["c"]), helper.make_node("Mul", ["c", "c"], ["c2"]),
             helper.make_node("ReduceSum", ["c2"], ["loss"], keepdims=0)]
    m = _model(nodes, [_vi("a", ["B", 2, 3]), _vi("b", ["B", 3, 5])])
    gm = build_gradient_model(m, "loss", ["a", "b"], feeds_checked=False)
    rng = np.random.default_rng(2)
    feeds = {"a": rng.standard_normal((batches[0], 2, 3)), "b": rng.standard_normal((batches[1], 3, 5))}
    want = _torch_grads(lambda t: ((t["a"] @ t["b"]) ** 2).sum(), feeds, ["a", "b"])
    for got in _run_both(gm, feeds):
        for k in ("a", "b"):
            np.testing.assert_allclose(got[f"{k}_grad"], want[k], rtol=1e-10)


def test_expand_to_the_shape_of_another_input_of_that_dim_name():
    """x [N, 3] expanded to Shape(y), y [N, 3]: x fed one row, y four."""
    nodes = [helper.make_node("Shape", ["y"], ["s"]), helper.make_node("Expand", ["x", "s"], ["e"]),
             helper.make_node("Mul", ["e", "y"], ["p"]), helper.make_node("Mul", ["p", "p"], ["p2"]),
             helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0)]
    m = _model(nodes, [_vi("x", ["N", 3]), _vi("y", ["N", 3])])
    gm = build_gradient_model(m, "loss", ["x"], feeds_checked=False)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((1, 3)), "y": rng.standard_normal((4, 3))}
    want = _torch_grads(lambda t: ((t["x"].expand(4, 3) * t["y"]) ** 2).sum(), feeds, ["x"])
    for got in _run_both(gm, feeds):
        np.testing.assert_allclose(got["x_grad"], want["x"], rtol=1e-12)


def _chain_model() -> onnx.ModelProto:
    """A deeper chain over x, y both declared [N, 3]: Tanh of their product, then a sum with y."""
    nodes = [helper.make_node("Mul", ["x", "y"], ["p"]), helper.make_node("Tanh", ["p"], ["t"]),
             helper.make_node("Add", ["t", "y"], ["u"]), helper.make_node("Mul", ["u", "u"], ["u2"]),
             helper.make_node("ReduceSum", ["u2"], ["loss"], keepdims=0)]
    return _model(nodes, [_vi("x", ["N", 3]), _vi("y", ["N", 3])])


@pytest.mark.parametrize("y_rows", [1, 4])
def test_run_time_sums_against_finite_differences(y_rows):
    """feeds_checked=False: y fed one row (a broadcast) or as many as x, on both runtimes."""
    m = _chain_model()
    gm = build_gradient_model(m, "loss", ["x", "y"], feeds_checked=False)
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((4, 3)), "y": rng.standard_normal((y_rows, 3))}
    ref = InferenceSession(m.SerializeToString())

    def loss(f: dict[str, np.ndarray]) -> float:
        return float(ref.run(["loss"], f)[0])

    for got in _run_both(gm, feeds):
        for k in ("x", "y"):
            fd = np.zeros_like(feeds[k])
            for i in np.ndindex(fd.shape):
                lo, hi = ({**feeds, k: feeds[k].copy()} for _ in range(2))
                lo[k][i] -= 1e-6
                hi[k][i] += 1e-6
                fd[i] = (loss(hi) - loss(lo)) / 2e-6
            assert got[f"{k}_grad"].shape == feeds[k].shape
            np.testing.assert_allclose(got[f"{k}_grad"], fd, rtol=1e-6, atol=1e-8)


def test_gradient_graph_builder_takes_a_shared_name_for_one_size():
    """onnxruntime's legacy API (and build_gradient_model's default): N is one size, as ONNX means it and
    onnxruntime-training's builder took it: no run-time sums, the dims listed in the graph's metadata, and
    onnxtrain's InferenceSession refuses feeds that give x and y different sizes of it (naming them); fed
    one size, the gradients are torch's."""
    b = GradientGraphBuilder(_chain_model().SerializeToString(), {"loss"}, ["x", "y"], "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    assert _nonzero_count(gm) == 0
    assert same_size_dims(gm) == {"N": [("x", 0), ("y", 0)]}
    rng = np.random.default_rng(5)
    x, y = rng.standard_normal((4, 3)), rng.standard_normal((4, 3))
    sess = InferenceSession(gm.SerializeToString())
    with pytest.raises(FeedSizeMismatch, match="'x' and 'y' share dimension 'N'"):
        sess.run(None, {"x": x, "y": y[:1]})
    want = _torch_grads(lambda t: ((torch.tanh(t["x"] * t["y"]) + t["y"]) ** 2).sum(), {"x": x, "y": y},
                        ["x", "y"])
    for got in _run_both(gm, {"x": x, "y": y}):
        for k in ("x", "y"):
            np.testing.assert_allclose(got[f"{k}_grad"], want[k], rtol=1e-10)


def _nonzero_count(gm: onnx.ModelProto) -> int:
    return sum(n.op_type == "NonZero" for n in gm.graph.node)


def test_one_input_own_dims_prove_equal_sizes():
    """Values that all come from one input's N need no run-time sums: x + relu(x)·w, w a weight."""
    w = onnx.numpy_helper.from_array(np.ones(3), "w")
    nodes = [helper.make_node("Relu", ["x"], ["r"]), helper.make_node("Mul", ["r", "w"], ["rw"]),
             helper.make_node("Add", ["x", "rw"], ["s"]), helper.make_node("Mul", ["s", "s"], ["s2"]),
             helper.make_node("ReduceSum", ["s2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [_vi("x", ["N", 3]), _vi("labels", ["N"], TensorProto.INT64)],
                          [_vi("loss", [])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    # (run-time sums asked for: labels' N reaches none of these values)
    assert _nonzero_count(build_gradient_model(m, "loss", ["x", "w"], feeds_checked=False)) == 0


# ---- a training step: x [N, 3] fed 4 rows, u [N, 3] fed 1 (broadcast) -------------------------------------

_W = np.array([0.5, -1.25, 2.0], np.float32)


def _centered_model(u_dims: tuple = ("N", 3)) -> onnx.ModelProto:
    """loss = Σ (x + (y − mean₀ y) + tanh y)², y = u·W, x declared [N, 3] and u ``u_dims``: u's rows meet
    x's only at the Add, and the batch mean makes the step wrong when u's gradient is not summed back to its
    one row there."""
    nodes = [helper.make_node("Mul", ["u", "W"], ["y"]),
             helper.make_node("ReduceMean", ["y"], ["m"], axes=[0], keepdims=1),
             helper.make_node("Sub", ["y", "m"], ["c"]), helper.make_node("Tanh", ["y"], ["t"]),
             helper.make_node("Add", ["c", "t"], ["ct"]), helper.make_node("Add", ["x", "ct"], ["z"]),
             helper.make_node("Mul", ["z", "z"], ["z2"]),
             helper.make_node("ReduceSum", ["z2"], ["loss"], keepdims=0)]
    f32 = TensorProto.FLOAT
    g = helper.make_graph(nodes, "g", [_vi("x", ["N", 3], f32), _vi("u", list(u_dims), f32)],
                          [_vi("loss", [], f32)], [onnx.numpy_helper.from_array(_W, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _step_feeds(u_rows: int = 1) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(5)
    return {"x": rng.standard_normal((4, 3)).astype(np.float32),
            "u": rng.standard_normal((u_rows, 3)).astype(np.float32)}


def _torch_w_grad(feeds: dict[str, np.ndarray]) -> np.ndarray:
    w = torch.tensor(_W, dtype=torch.float64, requires_grad=True)
    x, u = (torch.tensor(feeds[k], dtype=torch.float64) for k in ("x", "u"))
    y = u * w
    z = x + (y - y.mean(0, keepdim=True)) + torch.tanh(y)
    (z * z).sum().backward()
    return w.grad.numpy()


def _legacy_step(model: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> np.ndarray:
    from onnxtrain import TrainingParameters, TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(model.SerializeToString(), p)
    sess.run(["loss"], {**feeds, "Learning_Rate": np.array([0.1], np.float32)})
    return sess.get_state()["W"]


@pytest.mark.parametrize("u_dims", [("M", 3), (1, 3), (None, 3)])
def test_legacy_training_session_step_with_a_broadcast_input(u_dims):
    """u declared apart from x (another name, a 1, no name) and fed one row: the step sums its gradient."""
    feeds = _step_feeds()
    got = _legacy_step(_centered_model(u_dims), feeds)
    np.testing.assert_allclose(got, _W - 0.1 * _torch_w_grad(feeds), rtol=1e-5)


def test_legacy_training_session_refuses_a_broadcast_of_a_shared_dim():
    """x and u both declared [N, 3]: the session's graph takes N for one size (no run-time sums, as for a
    batch of inputs and labels); one row of u against four of x is refused, naming both and N, and equal
    sizes train as torch does."""
    from onnxtrain.engine.feed_sizes import FeedSizeMismatch

    with pytest.raises(FeedSizeMismatch, match=r"inputs 'x' and 'u' share dimension 'N'.* sizes 4 and 1"):
        _legacy_step(_centered_model(), _step_feeds())
    feeds = _step_feeds(4)
    np.testing.assert_allclose(_legacy_step(_centered_model(), feeds), _W - 0.1 * _torch_w_grad(feeds),
                               rtol=1e-5)


def _module(model: onnx.ModelProto, folder):
    from onnxtrain.training import api, artifacts

    artifacts.generate_artifacts(model, requires_grad=["W"], loss=None, artifact_directory=folder)
    state = api.CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    return api.Module(str(folder / "training_model.onnx"), state), state


def test_module_training_step_with_a_broadcast_input(tmp_path):
    """u declared [M, 3], fed one row against x's four: the gradient is summed back."""
    module, state = _module(_centered_model(("M", 3)), tmp_path)
    feeds = _step_feeds()
    module(feeds["x"], feeds["u"])
    np.testing.assert_allclose(state.parameters["W"].grad, _torch_w_grad(feeds), rtol=1e-5)


def test_module_refuses_a_broadcast_of_a_shared_dim(tmp_path):
    """x and u both [N, 3]: the artifacts take N for one size (listed in the training model's metadata);
    the Module refuses one row of u against four of x, naming both and N, and trains on equal sizes."""
    from onnxtrain.engine.feed_sizes import same_size_dims

    module, state = _module(_centered_model(), tmp_path)
    assert same_size_dims(onnx.load(str(tmp_path / "training_model.onnx"))) == {"N": [("u", 0), ("x", 0)]}
    feeds = _step_feeds()
    with pytest.raises(ValueError, match=r"inputs 'u' and 'x' share dimension 'N'.* sizes 1 and 4"):
        module(feeds["x"], feeds["u"])
    feeds = _step_feeds(4)
    module(feeds["x"], feeds["u"])
    np.testing.assert_allclose(state.parameters["W"].grad, _torch_w_grad(feeds), rtol=1e-5)
