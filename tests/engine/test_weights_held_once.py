"""An inference session holds its weights once: on the numpy engine the plan holds the arrays and the
session's model only their names, types and dims; on the onnxruntime backend the plan converts a weight only
when it is read. Values are checked against plain onnxruntime (the oracle) on the same model."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.capi import _pybind_state as C
from onnxtrain.engine.interface import KEPT_VALUES, EngineError, heavy, without_values
from onnxtrain.ir.graphs import walk_graphs


def _model() -> onnx.ModelProto:
    """y = relu(x · W1 + b) · W2, and h = x · W1 (an output whose path does not read W2); W1 and W2 big,
    b and the Reshape's shape small."""
    rng = np.random.default_rng(0)
    inits = {"W1": rng.standard_normal((64, 128)).astype(np.float32),
             "W2": rng.standard_normal((128, 40)).astype(np.float32),
             "b": rng.standard_normal(128).astype(np.float32), "shape": np.array([-1, 40], np.int64)}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Add", ["h", "b"], ["a"]),
             helper.make_node("Relu", ["a"], ["r"]), helper.make_node("MatMul", ["r", "W2"], ["m"]),
             helper.make_node("Reshape", ["m", "shape"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 40]),
                           helper.make_tensor_value_info("h", TensorProto.FLOAT, ["n", 128])],
                          [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="test")
    m.ir_version = 9
    return m


def _oracle(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def test_the_numpy_sessions_model_holds_no_second_copy_of_the_weights() -> None:
    model = _model()
    kept = model.SerializeToString()
    x = np.random.default_rng(1).standard_normal((5, 64)).astype(np.float32)
    want = _oracle(model, {"x": x})
    sess = onnxtrain.InferenceSession(model)
    got = sess.run(None, {"x": x})
    for a, b in zip(got, want):  # (float32 GEMMs of two BLASes: within 1e-7 of the largest output, ~1 eps)
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7 * max(100.0, float(np.abs(b).max())))
    inits = {t.name: t for t in sess._model.graph.initializer}
    assert not inits["W1"].raw_data and not inits["W2"].raw_data  # names, types and dims only
    assert list(inits["W1"].dims) == [64, 128] and inits["W1"].data_type == TensorProto.FLOAT
    b = numpy_helper.to_array(model.graph.initializer[2])
    np.testing.assert_array_equal(numpy_helper.to_array(inits["b"]), b)  # small ones keep their values
    assert model.SerializeToString() == kept  # the caller's model is not changed
    # a run of only the path to h builds another plan from the emptied model: it shares the session's arrays
    ro = onnxtrain.RunOptions()
    ro.only_execute_path_to_fetches = True
    np.testing.assert_allclose(sess.run(["h"], {"x": x}, ro)[0], want[1], rtol=1e-5, atol=1e-5)
    plans = [p for _, p in sess._path_plans.values() if p is not None]
    assert all(p.initializers["W1"] is sess._plan.initializers["W1"] for p in plans)


def test_a_dump_of_the_model_holds_the_weights(tmp_path) -> None:
    so = onnxtrain.SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "dump.onnx")
    model = _model()
    onnxtrain.InferenceSession(model.SerializeToString(), so)
    dump = onnx.load(str(tmp_path / "dump.onnx"))
    dumped = {t.name: numpy_helper.to_array(t) for t in dump.graph.initializer}
    for t in model.graph.initializer:
        np.testing.assert_array_equal(dumped[t.name], numpy_helper.to_array(t))


def test_without_values_copies_everything_but_the_big_tensors_values() -> None:
    """The emptied copy equals the model with those tensors' data cleared, and nothing else changed; a model
    with no big tensor is returned as it is."""
    model = _model()
    model.metadata_props.add(key="k", value="v")
    hollow = without_values(model)
    want = onnx.ModelProto()
    want.CopyFrom(model)
    for t in want.graph.initializer:
        if t.name in ("W1", "W2"):
            t.ClearField("raw_data")
    assert hollow == want
    assert [heavy(t) for t in model.graph.initializer] == [True, True, False, False]
    small = helper.make_model(helper.make_graph([], "g", [], [], [numpy_helper.from_array(
        np.zeros(KEPT_VALUES, np.float32), "z")]))
    assert without_values(small) is small
    with pytest.raises(ValueError):  # reading an emptied tensor's values fails loudly
        numpy_helper.to_array(hollow.graph.initializer[0])


def _two_input_model() -> onnx.ModelProto:
    """``_model``'s graph and a second input ``z`` with an output of its own (``zz = z · W2ᵀ``): a run of the
    path to ``y`` or ``h`` does not read ``z``."""
    model = _model()
    g = model.graph
    g.input.append(helper.make_tensor_value_info("z", TensorProto.FLOAT, ["m", 40]))
    g.node.append(helper.make_node("Gemm", ["z", "W2"], ["zz"], transB=1))
    g.output.append(helper.make_tensor_value_info("zz", TensorProto.FLOAT, ["m", 128]))
    return model


def test_the_backend_leaves_the_weights_to_onnxruntime() -> None:
    """On the onnxruntime backend the session and its plan keep the weights' names, types and dims (small
    tensors' values too), and onnxruntime's wrapper drops its serialized model: onnxruntime's copy is the only
    one. A path-only run feeds the inputs off the path empty to onnxruntime's own path-only run."""
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    model = _two_input_model()
    sess = onnxtrain.InferenceSession(model.SerializeToString(), so)
    rng = np.random.default_rng(4)
    x = rng.standard_normal((2, 64)).astype(np.float32)
    z = rng.standard_normal((3, 40)).astype(np.float32)
    want = _oracle(model, {"x": x, "z": z})
    for a, b in zip(sess.run(None, {"x": x, "z": z}), want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    arrays = sess._plan.initializers
    assert sorted(arrays) == ["W1", "W2", "b", "shape"]
    np.testing.assert_array_equal(arrays["b"], numpy_helper.to_array(model.graph.initializer[2]))
    with pytest.raises(EngineError, match="'W2': its values are held by onnxruntime only"):
        arrays["W2"]
    for m in (sess._model, sess._plan.model, sess._plan.onnxruntime_model):
        kept = {t.name: t for t in m.graph.initializer}
        assert not kept["W1"].raw_data and list(kept["W1"].dims) == [64, 128]
    assert sess._plan._session._model_bytes is None
    ro = onnxtrain.RunOptions()
    ro.only_execute_path_to_fetches = True
    y, h = sess.run(["y", "h"], {"x": x}, ro)  # no z: onnxruntime runs the path only
    np.testing.assert_allclose(y, want[0], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(h, want[1], rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(sess.run(["zz"], {"z": z}, ro)[0], want[2], rtol=1e-5, atol=1e-5)
    assert all(p in (None, sess._plan) for _, p in sess._path_plans.values())  # no second session
    with pytest.raises(C.InvalidArgument, match="z"):
        sess.run(["zz"], {"x": x}, ro)  # the path's own inputs stay required


_RSS_SCRIPT = """
import sys
import numpy as np
path, kind = sys.argv[1], sys.argv[2]
x = np.ones((2, 1024), np.float32)
if kind == "onnxruntime":
    import onnxruntime as ort
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
else:
    import onnxtrain
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.InferenceSession(path, so)
sess.run(None, {"x": x})
rss = [line for line in open("/proc/self/status") if line.startswith("VmRSS")][0].split()[1]
print(int(rss) // 1024)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_backend_session_holds_about_what_onnxruntime_holds(tmp_path) -> None:
    """RSS after a run of a model of 64 MiB of weights: the backend's session (loaded from bytes, parsed and
    rewritten by onnxtrain) within half the weights of plain onnxruntime's session of the same file: one
    more copy of the weights anywhere would add all of them (it held three more: 868 against 328 MiB with 192
    MiB of weights)."""
    rng = np.random.default_rng(5)
    inits, nodes, prev = [], [], "x"
    for i in range(16):
        inits.append(numpy_helper.from_array(rng.standard_normal((1024, 1024), np.float32) * 0.03, f"W{i}"))
        nodes += [helper.make_node("MatMul", [prev, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Relu", [f"m{i}"], [f"r{i}"])]
        prev = f"r{i}"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 1024])],
                          [helper.make_tensor_value_info(prev, TensorProto.FLOAT, ["n", 1024])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    path = str(tmp_path / "big.onnx")
    onnx.save(model, path)
    del model, inits, g
    rss = {}
    for kind in ("onnxruntime", "backend"):
        done = subprocess.run([sys.executable, "-c", _RSS_SCRIPT, path, kind], capture_output=True, text=True,
                              timeout=300, check=True)
        rss[kind] = int(done.stdout.split()[-1])
    assert rss["backend"] - rss["onnxruntime"] < 32, rss  # (12 MiB seen: onnx's and onnxtrain's imports)


def test_the_backends_rewritten_graph_keeps_no_copy_of_the_weights() -> None:
    """A graph onnxtrain rewrites for onnxruntime (here a ``Where(mask, x, 0)``) is a copy of the model: once
    onnxruntime has loaded it, it keeps its weights' names, types and dims only."""
    w = np.random.default_rng(2).standard_normal((64, 128)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Greater", ["m", "zero"], ["c"]),
             helper.make_node("Where", ["c", "m", "zero"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["n", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["n", 128])],
                          [numpy_helper.from_array(w, "W"),
                           numpy_helper.from_array(np.array(0, np.float32), "zero")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 9
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.InferenceSession(model.SerializeToString(), so)
    x = np.random.default_rng(3).standard_normal((3, 64)).astype(np.float32)
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], _oracle(model, {"x": x})[0], rtol=1e-6)
    rewritten = sess._plan.onnxruntime_model
    assert rewritten is not sess._plan.model and "Mul" in [n.op_type for g in walk_graphs(rewritten.graph)
                                                           for n in g.node]
    kept = {t.name: t for t in rewritten.graph.initializer}
    assert not kept["W"].raw_data and list(kept["W"].dims) == [64, 128]
