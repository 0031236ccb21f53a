"""A model whose own weights are float16 trains on the onnxruntime backend when its gradient graph holds a
combining scatter (cross-entropy's one-hot, a Gather's gradient): onnxruntime's CPU provider has no float16
kernel for ScatterElements / ScatterND with a reduction, so the step failed to load; they run in float32.
Oracle: the numpy engine (float16 throughout) and a float64 numpy SGD step of the same model."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper as h
from onnx import numpy_helper as nh

from onnxtrain import SessionOptions, TrainingParameters, TrainingSession

RNG = np.random.default_rng(0)
LR = np.array([0.1], np.float32)


def _classifier() -> tuple[bytes, dict[str, np.ndarray]]:
    w = nh.from_array((RNG.standard_normal((4, 8)) * 0.3).astype(np.float16), "W")
    g = h.make_graph([h.make_node("Gemm", ["x", "W"], ["logits"], transB=1),
                      h.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])], "m",
                     [h.make_tensor_value_info("x", T.FLOAT16, ["N", 8]),
                      h.make_tensor_value_info("y", T.INT64, ["N"])],
                     [h.make_tensor_value_info("loss", T.FLOAT16, [])], [w])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    return model.SerializeToString(), {"x": RNG.standard_normal((16, 8)).astype(np.float16),
                                       "y": RNG.integers(0, 4, 16)}


def _embedding() -> tuple[bytes, dict[str, np.ndarray]]:
    e = nh.from_array((RNG.standard_normal((10, 4)) * 0.3).astype(np.float16), "E")
    g = h.make_graph([h.make_node("Gather", ["E", "ids"], ["e"]), h.make_node("Sub", ["e", "t"], ["d"]),
                      h.make_node("Mul", ["d", "d"], ["d2"]),
                      h.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)], "emb",
                     [h.make_tensor_value_info("ids", T.INT64, ["N"]),
                      h.make_tensor_value_info("t", T.FLOAT16, ["N", 4])],
                     [h.make_tensor_value_info("loss", T.FLOAT16, [])], [e])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 17)], ir_version=9)
    ids = np.array([1, 3, 3, 7, 1, 3, 0, 9])  # repeated tokens: several updates of one row
    return model.SerializeToString(), {"ids": ids, "t": RNG.standard_normal((8, 4)).astype(np.float16)}


def _train(model: bytes, feeds: dict, backend: str, steps: int = 3) -> tuple[list[float], np.ndarray]:
    """SGD steps of ``model`` on ``backend``: the losses and the weight."""
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(model, p, so)
    losses = [float(sess.run(["loss"], {**feeds, "Learning_Rate": LR})[0]) for _ in range(steps)]
    return losses, next(iter(sess.get_state().values()))


def test_two_unnamed_float16_scatters_in_one_graph() -> None:
    """Two unnamed combining scatters keep names of their own once rewritten (onnxruntime refuses a graph
    naming two nodes alike). Oracle: the numpy engine."""
    from onnxtrain import InferenceSession

    nodes = [h.make_node("ScatterElements", ["d", "i", "u"], ["a"], reduction="add"),
             h.make_node("ScatterElements", ["a", "i", "u"], ["y"], reduction="add")]
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("d", T.FLOAT16, [4]),
                                  h.make_tensor_value_info("i", T.INT64, [2]),
                                  h.make_tensor_value_info("u", T.FLOAT16, [2])],
                     [h.make_tensor_value_info("y", T.FLOAT16, [4])])
    model = h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString()
    feeds = {"d": np.array([1, 2, 3, 4], np.float16), "i": np.array([2, 0]),
             "u": np.array([8, 0.75], np.float16)}
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = InferenceSession(model, so).run(None, feeds)[0]
    np.testing.assert_array_equal(got, InferenceSession(model).run(None, feeds)[0])
    np.testing.assert_array_equal(got, np.array([2.5, 2, 19, 4], np.float16))


@pytest.mark.parametrize("make", [_classifier, _embedding], ids=["cross-entropy", "embedding"])
def test_float16_model_with_combining_scatters_trains_on_the_onnxruntime_backend(make) -> None:
    model, feeds = make()
    ref_losses, ref_w = _train(model, feeds, "numpy")
    losses, w = _train(model, feeds, "onnxruntime")
    assert w.dtype == np.float16
    np.testing.assert_allclose(losses, ref_losses, rtol=2e-3)  # float16 sums in another order
    np.testing.assert_allclose(w.astype(np.float32), ref_w.astype(np.float32), rtol=5e-3, atol=2e-3)
    # the first step against float64: SGD on the loss's own gradient
    m = onnx.load_from_string(model)
    w0 = nh.to_array(m.graph.initializer[0]).astype(np.float64)
    if make is _classifier:
        x, y = feeds["x"].astype(np.float64), feeds["y"]
        z = x @ w0.T
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        p[np.arange(len(y)), y] -= 1
        w1 = w0 - 0.1 * (p / len(y)).T @ x
    else:
        d = w0[feeds["ids"]] - feeds["t"].astype(np.float64)
        grad = np.zeros_like(w0)
        np.add.at(grad, feeds["ids"], 2 * d / d.size)
        w1 = w0 - 0.1 * grad
    _, one = _train(model, feeds, "onnxruntime", steps=1)
    np.testing.assert_allclose(one.astype(np.float64), w1, rtol=5e-3, atol=2e-3)


# ---- bfloat16 data, and combining scatters inside If / Loop / Scan bodies -------------------------------

def _half(elem: int):
    return nh.helper.tensor_dtype_to_np_dtype(elem)


def _scatter_node(op: str, reduction: str, ins: list[str], out: str) -> onnx.NodeProto:
    return h.make_node(op, ins, [out], reduction=reduction)


def _scatter_model(op: str, reduction: str, elem: int, where: str) -> bytes:
    """data [4, 3] combined with updates at indices ``i`` by ``op``: at the top level, in an If's then-branch
    (else: the data), in a Loop body run twice on the carried data, or in a Scan body over two steps."""
    updates = [2, 3]
    index = [2, 3] if op == "ScatterElements" else [2, 1]
    ins = [h.make_tensor_value_info("d", elem, [4, 3]), h.make_tensor_value_info("i", T.INT64, index),
           h.make_tensor_value_info("u", elem, updates)]
    if where == "top":
        nodes = [_scatter_node(op, reduction, ["d", "i", "u"], "y")]
    elif where == "if":
        # (a value of the branch's own as the data: onnxruntime has no bfloat16 Neg)
        then = h.make_graph([h.make_node("Identity", ["d"], ["n"]),
                             _scatter_node(op, reduction, ["n", "i", "u"], "s")],
                            "then", [], [h.make_tensor_value_info("s", elem, None)])
        other = h.make_graph([h.make_node("Identity", ["d"], ["z"])], "else", [],
                             [h.make_tensor_value_info("z", elem, None)])
        nodes = [h.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)]
        ins.append(h.make_tensor_value_info("c", T.BOOL, []))
    elif where == "loop":
        body = h.make_graph([h.make_node("Identity", ["cond"], ["cond_out"]),
                             _scatter_node(op, reduction, ["acc", "i", "u"], "acc_out")], "body",
                            [h.make_tensor_value_info("it", T.INT64, []),
                             h.make_tensor_value_info("cond", T.BOOL, []),
                             h.make_tensor_value_info("acc", elem, None)],
                            [h.make_tensor_value_info("cond_out", T.BOOL, []),
                             h.make_tensor_value_info("acc_out", elem, None)])
        trips = nh.from_array(np.array(2, np.int64), "trips")
        nodes = [h.make_node("Constant", [], ["n"], value=trips),
                 h.make_node("Loop", ["n", "", "d"], ["y"], body=body)]
    else:  # scan: the state is the data, the scanned input two copies of the updates
        body = h.make_graph([_scatter_node(op, reduction, ["acc", "i", "step"], "acc_out"),
                             h.make_node("Identity", ["step"], ["echo"])], "body",
                            [h.make_tensor_value_info("acc", elem, [4, 3]),
                             h.make_tensor_value_info("step", elem, updates)],
                            [h.make_tensor_value_info("acc_out", elem, [4, 3]),
                             h.make_tensor_value_info("echo", elem, updates)])
        nodes = [h.make_node("Concat", ["u", "u"], ["uu"], axis=0),
                 h.make_node("Reshape", ["uu", "two"], ["steps"]),
                 h.make_node("Scan", ["d", "steps"], ["y", "echoes"], num_scan_inputs=1, body=body)]
        shape = nh.from_array(np.array([2, *updates], np.int64), "two")
        g = h.make_graph(nodes, "scan", ins, [h.make_tensor_value_info("y", elem, [4, 3])], [shape])
        return h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString()
    g = h.make_graph(nodes, where, ins, [h.make_tensor_value_info("y", elem, [4, 3])])
    return h.make_model(g, opset_imports=[h.make_opsetid("", 18)], ir_version=9).SerializeToString()


def _reference(op: str, reduction: str, where: str, f: dict) -> np.ndarray:
    """The float64 result rounded once to the data's type after each scatter (one update per element: a
    float16 or bfloat16 op rounds its exact result once)."""
    dtype = f["d"].dtype
    ufunc = {"add": np.add, "mul": np.multiply, "min": np.minimum, "max": np.maximum}[reduction]
    rows = f["i"] if op == "ScatterElements" else f["i"][:, 0]

    def once(data: np.ndarray) -> np.ndarray:
        out = data.astype(np.float64)
        u = f["u"].astype(np.float64)
        if op == "ScatterElements":
            for r in range(rows.shape[0]):
                for c in range(rows.shape[1]):
                    out[rows[r, c], c] = ufunc(out[rows[r, c], c], u[r, c])
        else:
            for r, row in enumerate(rows):
                out[row] = ufunc(out[row], u[r])
        return out.astype(dtype)

    return once(f["d"]) if where in ("top", "if") else once(once(f["d"]))


@pytest.mark.parametrize("where", ["top", "if", "loop", "scan"])
@pytest.mark.parametrize("reduction", ["add", "mul", "min", "max"])
@pytest.mark.parametrize("op", ["ScatterElements", "ScatterND"])
@pytest.mark.parametrize("elem", [T.FLOAT16, T.BFLOAT16], ids=["float16", "bfloat16"])
def test_combining_half_scatters_anywhere_run_as_numpy(elem, op, reduction, where) -> None:
    """bfloat16 data (onnxruntime 1.32 had no kernel for any reduction: the graph failed at its first run),
    and float16 data inside a body (the rewrite passed bodies over: failed there too): the numpy engine's
    values and float64's rounded to the data's type, bit for bit (each element is updated once a scatter)."""
    from onnxtrain import InferenceSession

    dtype = _half(elem)
    rng = np.random.default_rng(7)
    i = np.array([[3, 0, 1], [1, 2, 3]]) if op == "ScatterElements" else np.array([[3], [0]])
    f = {"d": (rng.standard_normal((4, 3)) * 3).astype(dtype), "i": i,
         "u": (rng.standard_normal((2, 3)) * 3).astype(dtype)}
    if where == "if":
        f["c"] = np.array(True)
    model = _scatter_model(op, reduction, elem, where)
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = InferenceSession(model, so).run(None, f)[0]
    want = _reference(op, reduction, where, f)
    assert got.dtype == dtype
    np.testing.assert_array_equal(got.astype(np.float32), want.astype(np.float32))
    numpy_engine = InferenceSession(model).run(None, f)[0]
    np.testing.assert_array_equal(got.astype(np.float32), numpy_engine.astype(np.float32))
