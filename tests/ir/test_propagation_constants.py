"""Shape inference without data propagation (``ir.builder._propagates``: a graph with a 1-D value of 65,536
elements or more and no Shape or Size node) still knows the dims of a Reshape, Expand, ConstantOfShape or
Resize whose target is computed from constants alone (a Concat of Constants, a Mul of them): those values are
folded into Constants before inference. Oracle: the shapes onnx.reference computes when it runs the graph;
and the training graphs built over such a model are the ones built with data propagation, their results
those of torch (float64)."""

from __future__ import annotations

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper
from onnx.reference import ReferenceEvaluator

import onnxtrain
from onnxtrain.ir import builder

BIG = builder._DATA_PROP_MAX  # a 1-D value this long turns data propagation off


def _const(name: str, value: list[int] | int) -> onnx.NodeProto:
    return helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(value, np.int64),
                                                                                     f"{name}_value"))


def _shapes_model() -> onnx.ModelProto:
    """A large 1-D input beside small values shaped by targets computed from constants: a Reshape that is a
    graph output, an Expand, a ConstantOfShape and a Resize, each target a Concat or a Mul of Constants (or
    an Unsqueeze of scalar Constants, concatenated)."""
    nodes = [
        _const("a", [4]), _const("b", [6]), helper.make_node("Concat", ["a", "b"], ["cat"], axis=0),
        _const("m1", [2, 3]), _const("m2", [2, 2]), helper.make_node("Mul", ["m1", "m2"], ["prod"]),
        _const("s0", 4), _const("s1", 6), _const("axis0", [0]),
        helper.make_node("Unsqueeze", ["s0", "axis0"], ["u0"]),
        helper.make_node("Unsqueeze", ["s1", "axis0"], ["u1"]),
        helper.make_node("Concat", ["u0", "u1"], ["ucat"], axis=0),
        _const("one", [1]), helper.make_node("Concat", ["one", "prod"], ["sizes"], axis=0),
        helper.make_node("Reshape", ["x", "cat"], ["reshaped"]),
        helper.make_node("Expand", ["row", "prod"], ["expanded"]),
        helper.make_node("ConstantOfShape", ["ucat"], ["zeros"]),
        helper.make_node("Resize", ["img", "", "", "sizes"], ["resized"], mode="nearest"),
        helper.make_node("Add", ["expanded", "zeros"], ["summed"]),
        helper.make_node("Relu", ["big"], ["big_out"]),
    ]
    f = T.FLOAT
    g = helper.make_graph(
        nodes, "constant_shapes",
        [helper.make_tensor_value_info("x", f, [24]), helper.make_tensor_value_info("row", f, [1, 6]),
         helper.make_tensor_value_info("img", f, [1, 2, 3]), helper.make_tensor_value_info("big", f, [BIG])],
        [helper.make_tensor_value_info(n, f, None) for n in ("reshaped", "expanded", "summed", "resized",
                                                             "big_out")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def _dims(tp: onnx.TypeProto) -> list:
    return [d.dim_value if d.HasField("dim_value") else d.dim_param for d in tp.tensor_type.shape.dim]


def test_dims_of_constant_targets_are_known_without_data_propagation() -> None:
    model = _shapes_model()
    assert not builder._propagates(builder._skeleton(model))  # the premise: inferred without propagation
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal(24).astype(np.float32), "row": np.ones((1, 6), np.float32),
             "img": np.ones((1, 2, 3), np.float32), "big": np.ones(BIG, np.float32)}
    names = ["reshaped", "expanded", "zeros", "summed", "resized"]
    ran = dict(zip(names, ReferenceEvaluator(model).run(names, feeds)))
    types = builder.value_types(model)
    for name in names:
        assert _dims(types[name]) == list(ran[name].shape), name


def test_other_integer_values_stay_unknown_and_the_model_is_untouched() -> None:
    """A target computed from a graph input is not folded (nothing to read), and the caller's model keeps
    its nodes."""
    model = _shapes_model()
    model.graph.input.append(helper.make_tensor_value_info("fed", T.INT64, [2]))
    model.graph.node.append(helper.make_node("Reshape", ["x", "fed"], ["fed_reshaped"]))
    model.graph.output.append(helper.make_tensor_value_info("fed_reshaped", T.FLOAT, None))
    before = model.SerializeToString(deterministic=True)
    types = builder.value_types(model)
    assert len(_dims(types["fed_reshaped"])) == 2
    assert not any(isinstance(d, int) and d for d in _dims(types["fed_reshaped"]))
    assert model.SerializeToString(deterministic=True) == before


# ---- training over such a model -------------------------------------------------------------------------

def _training_model() -> tuple[onnx.ModelProto, np.ndarray, np.ndarray]:
    """x [2, BIG] + b (a trained 1-D weight of BIG values) → Reshape to Concat([512], [256]) → times w
    [1, 256] expanded to Mul([2, 128], [256, 2]) → + ConstantOfShape(the Concat) of 0.5 → mean of squares; a
    Reshape of b to a constant [256, 256] is a graph output."""
    rng = np.random.default_rng(3)
    b = (rng.standard_normal(BIG) * 0.1).astype(np.float32)
    w = (rng.standard_normal((1, 256)) * 0.5 + 1).astype(np.float32)
    half = numpy_helper.from_array(np.array([0.5], np.float32), "half")
    nodes = [
        _const("a", [512]), _const("c", [256]), helper.make_node("Concat", ["a", "c"], ["cat"], axis=0),
        _const("m1", [2, 128]), _const("m2", [256, 2]), helper.make_node("Mul", ["m1", "m2"], ["prod"]),
        _const("square", [256, 256]),
        helper.make_node("Add", ["x", "b"], ["h"]),
        helper.make_node("Reshape", ["h", "cat"], ["r"]),
        helper.make_node("Expand", ["w", "prod"], ["e"]),
        helper.make_node("ConstantOfShape", ["cat"], ["halves"], value=half),
        helper.make_node("Mul", ["r", "e"], ["re"]),
        helper.make_node("Add", ["re", "halves"], ["p"]),
        helper.make_node("Reshape", ["b", "square"], ["b_square"]),
        helper.make_node("Mul", ["p", "p"], ["pp"]),
        helper.make_node("ReduceMean", ["pp"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes, "constant_shapes_training", [helper.make_tensor_value_info("x", T.FLOAT, [2, BIG])],
        [helper.make_tensor_value_info("loss", T.FLOAT, []),
         helper.make_tensor_value_info("p", T.FLOAT, None),
         helper.make_tensor_value_info("b_square", T.FLOAT, None)],
        [numpy_helper.from_array(b, "b"), numpy_helper.from_array(w, "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), b, w


def _torch_reference(x: np.ndarray, b: np.ndarray, w: np.ndarray) -> tuple[float, np.ndarray, np.ndarray,
                                                                               np.ndarray]:
    """(loss, p, dloss/db, dloss/dw) in float64."""
    torch = pytest.importorskip("torch")
    bt = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    wt = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    p = (torch.tensor(x, dtype=torch.float64) + bt).reshape(512, 256) * wt.expand(512, 256) + 0.5
    loss = (p * p).mean()
    loss.backward()
    return loss.item(), p.detach().numpy(), bt.grad.numpy(), wt.grad.numpy()


def _ops(model: onnx.ModelProto) -> collections.Counter:
    return collections.Counter(n.op_type for n in model.graph.node)


def _with_propagation(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builder, "_propagates", lambda model: True)


def _session(model: onnx.ModelProto, backend: str) -> onnxtrain.TrainingSession:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return onnxtrain.TrainingSession(model.SerializeToString(), p, so)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_training_session_over_constant_targets(monkeypatch, backend: str) -> None:
    model, b, w = _training_model()
    assert not builder._propagates(builder._skeleton(model))
    x = np.random.default_rng(4).standard_normal((2, BIG)).astype(np.float32)
    loss, p, gb, gw = _torch_reference(x, b, w)
    sess = _session(model, backend)
    lr = 0.1
    got = sess.run(["loss", "p", "b_square"], {"x": x, "Learning_Rate": np.array([lr], np.float32)})
    np.testing.assert_allclose(got[0], loss, rtol=1e-5)
    np.testing.assert_allclose(got[1], p, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got[2], b.reshape(256, 256))  # the weights before the step
    state = sess.get_state()
    np.testing.assert_allclose(state["b"], b - lr * gb, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state["w"], w - lr * gw, rtol=1e-6, atol=1e-7)
    graph = sess._graphs.full
    # the graph the autodiff writes knows the Expand's dims: the one it writes when propagation runs (no
    # axes of the broadcast gradient computed at run time)
    with monkeypatch.context() as m:
        _with_propagation(m)
        want = _session(model, backend)._graphs.full
    assert _ops(graph) == _ops(want)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_generated_artifacts_over_constant_targets(monkeypatch, tmp_path, backend: str) -> None:
    from onnxtrain.training import api, artifacts, onnxblock

    model, b, w = _training_model()
    x = np.random.default_rng(5).standard_normal((2, BIG)).astype(np.float32)
    loss, p, gb, gw = _torch_reference(x, b, w)
    for d in ("a", "p"):
        (tmp_path / d).mkdir()
    artifacts.generate_artifacts(model, requires_grad=["b", "w"], loss=None, optimizer=onnxblock.optim.SGD(),
                                 artifact_directory=str(tmp_path / "a"))
    with monkeypatch.context() as m:
        _with_propagation(m)
        artifacts.generate_artifacts(model, requires_grad=["b", "w"], loss=None,
                                     optimizer=onnxblock.optim.SGD(), artifact_directory=str(tmp_path / "p"))
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        got, want = (onnx.load(str(tmp_path / d / name)) for d in ("a", "p"))
        assert _ops(got) == _ops(want), name
        assert list(got.graph.output) == list(want.graph.output), name  # the declared types too
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "a" / "checkpoint"))
    module = api.Module(str(tmp_path / "a" / "training_model.onnx"), state,
                        str(tmp_path / "a" / "eval_model.onnx"), session_options=so)
    opt = api.Optimizer(str(tmp_path / "a" / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    out = module(x)
    np.testing.assert_allclose(out[0], loss, rtol=1e-5)
    np.testing.assert_allclose(out[1], p, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.parameters["b"].grad, gb, rtol=1e-5, atol=1e-9)
    np.testing.assert_allclose(state.parameters["w"].grad, gw, rtol=1e-5, atol=1e-7)
    opt.step()
    np.testing.assert_allclose(state.parameters["b"].data, b - np.float32(0.1) * gb, rtol=1e-6, atol=1e-7)
    np.testing.assert_allclose(state.parameters["w"].data, w - np.float32(0.1) * gw, rtol=1e-6, atol=1e-7)
    module.eval()
    ev = module(x)
    assert [np.shape(v) for v in ev] == [(), (512, 256), (256, 256)]
