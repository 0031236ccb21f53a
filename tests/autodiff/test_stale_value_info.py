"""A model's declared types of intermediate values (``value_info``) may be stale: recorded at another batch
size, or simply wrong. Gradients are built on the dims the graph's inputs give (a mean's count, a
broadcast's axes): a declared static dim where inference computes a symbol takes the symbol, and one that
contradicts the computed dim is replaced with a warning. Before, the declared dims were trusted: the mean's
gradient was scaled by 1/35 for a declared [5, 7] (true [4, 2]), and by 1/8 at batch 3 for [4, 2] recorded
at batch 4 (onnxruntime-training's builder gives the exact gradient, or refuses the run). Checked against
float64 formulas on the GradientGraphBuilder, the legacy session and the on-device Module."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

_RNG = np.random.default_rng(0)
_X = _RNG.standard_normal((4, 3)).astype(np.float32)
_W = _RNG.standard_normal((3, 2)).astype(np.float32)
_B = _RNG.standard_normal(2).astype(np.float32)


def _model(batch: int | str, declared: dict[str, list[int | str]]) -> onnx.ModelProto:
    """loss = mean((x @ W + B)²), ``declared`` the value infos."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["y", "B"], ["z"]),
         helper.make_node("Mul", ["z", "z"], ["sq"]),
         helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [batch, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(_W, "W"), numpy_helper.from_array(_B, "B")],
        value_info=[helper.make_tensor_value_info(k, TensorProto.FLOAT, v) for k, v in declared.items()])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _exact(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    x, w, b = x.astype(np.float64), _W.astype(np.float64), _B.astype(np.float64)
    dz = 2.0 * (x @ w + b) / (x.shape[0] * 2)
    return x.T @ dz, dz.sum(0)


_CASES = {  # name: (input batch dim, declared value infos, batch run, warns)
    "contradicted dims": (4, {"sq": [5, 7]}, 4, True),
    "recorded at batch 4, run at 3": ("N", {"sq": [4, 2], "z": [4, 2]}, 3, False),
    "a stale broadcast": ("N", {"z": [1, 2]}, 3, False),
}


def _build_warned(model: onnx.ModelProto) -> tuple[bytes, list[str]]:
    """GradientGraphBuilder's graph of d loss / d W, B (serialized) and its stale-declaration warnings."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        builder = onnxtrain.GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W", "B"}, "loss")
        builder.build()
    return builder.get_model(), [str(w.message) for w in seen if "do not compute" in str(w.message)]


def _built(case: str) -> tuple[onnx.ModelProto, np.ndarray]:
    batch, declared, run, warns = _CASES[case]
    built, said = _build_warned(_model(batch, declared))
    assert bool(said) == warns, said
    return onnx.load_from_string(built), _X[:run]


@pytest.mark.parametrize("case", list(_CASES))
def test_gradient_graph_builder_uses_the_computed_dims(case) -> None:
    model, x = _built(case)
    onnx.checker.check_model(model, full_check=True)
    dw, db = onnxtrain.InferenceSession(model.SerializeToString()).run(["W_grad", "B_grad"], {"x": x})
    want_w, want_b = _exact(x)
    np.testing.assert_allclose(dw, want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, want_b, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", list(_CASES))
def test_the_legacy_session_steps_with_the_computed_dims(case) -> None:
    batch, declared, run, _ = _CASES[case]
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        sess = onnxtrain.TrainingSession(_model(batch, declared).SerializeToString(), p)
    x = _X[:run]
    sess.run(None, {"x": x, "Learning_Rate": np.array([0.1], np.float32)})
    want_w, want_b = _exact(x)
    state = sess.get_state()
    np.testing.assert_allclose(state["W"], _W - 0.1 * want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["B"], _B - 0.1 * want_b, rtol=1e-5, atol=1e-6)


def test_the_on_device_module_trains_with_the_computed_dims(tmp_path) -> None:
    from onnxtrain.training import api, artifacts

    batch, declared, run, _ = _CASES["recorded at batch 4, run at 3"]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifacts.generate_artifacts(_model(batch, declared), requires_grad=["W", "B"], loss=None,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state)
    opt = api.Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    x = _X[:run]
    module(x)
    opt.step()
    want_w, want_b = _exact(x)
    np.testing.assert_allclose(state.parameters["W"].data, _W - 0.1 * want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.parameters["B"].data, _B - 0.1 * want_b, rtol=1e-5, atol=1e-6)


def test_declarations_inference_cannot_check_are_kept() -> None:
    """A declared static dim where inference knows nothing (a Reshape to a shape fed at run time) stays: it
    is the only source of that dim."""
    from onnxtrain.ir.builder import value_types

    g = helper.make_graph([helper.make_node("Reshape", ["x", "s"], ["r"]),
                           helper.make_node("Relu", ["r"], ["y"])],
                          "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [6]),
                                helper.make_tensor_value_info("s", TensorProto.INT64, [2])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
                          value_info=[helper.make_tensor_value_info("r", TensorProto.FLOAT, [2, 3])])
    types = value_types(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    assert [d.dim_value for d in types["y"].tensor_type.shape.dim] == [2, 3]


def test_a_conv_transpose_declaration_inference_gets_wrong_is_kept_without_a_warning() -> None:
    """ONNX's inference gives a ConvTranspose with ``output_shape`` shorter than its input a wrong rank: the
    model's correct declaration of its output was reported as an exporter's mistake. It is kept, no warning;
    the gradient matches central differences of onnxruntime's forward."""
    import onnxruntime as ort

    rng = np.random.default_rng(0)
    w = rng.standard_normal((2, 3, 3)).astype(np.float32)
    gain = rng.standard_normal((1, 3, 3)).astype(np.float32)
    x = rng.standard_normal((1, 2, 4)).astype(np.float32)

    def model(weight: np.ndarray) -> bytes:
        g = helper.make_graph(
            [helper.make_node("ConvTranspose", ["X", "W"], ["Y"], kernel_shape=[3], output_shape=[3]),
             helper.make_node("Mul", ["Y", "G"], ["YG"]),
             helper.make_node("ReduceSum", ["YG"], ["loss"], keepdims=0)], "g",
            [helper.make_tensor_value_info("X", TensorProto.FLOAT, [1, 2, 4])],
            [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
            [numpy_helper.from_array(weight, "W"), numpy_helper.from_array(gain, "G")],
            value_info=[helper.make_tensor_value_info("Y", TensorProto.FLOAT, [1, 3, 3])])
        return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        builder = onnxtrain.GradientGraphBuilder(model(w), {"loss"}, {"W"}, "loss")
        builder.build()
    assert not [str(m.message) for m in seen if "do not compute" in str(m.message)]
    grad = onnxtrain.InferenceSession(builder.get_model()).run(["W_grad"], {"X": x})[0]
    fd = np.zeros(w.shape)
    for i in np.ndindex(w.shape):
        for sign in (1, -1):
            moved = w.copy()
            moved[i] += sign * 1e-2
            run = ort.InferenceSession(model(moved), providers=["CPUExecutionProvider"]).run(None, {"X": x})
            fd[i] += sign * float(run[0]) / 2e-2
    np.testing.assert_allclose(grad, fd, rtol=1e-3, atol=1e-3)


def _tanh_model(dtype: int, declared: int, loss_declared: int | None = None) -> onnx.ModelProto:
    """loss = mean(tanh(x @ W + B)) in ``dtype``, the value_info of z and t of element type ``declared``, the
    loss output declared of element type ``loss_declared`` (default ``dtype``)."""
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"]), helper.make_node("Add", ["y", "B"], ["z"]),
         helper.make_node("Tanh", ["z"], ["t"]), helper.make_node("ReduceMean", ["t"], ["loss"], keepdims=0)],
        "g", [helper.make_tensor_value_info("x", dtype, [4, 3])],
        [helper.make_tensor_value_info("loss", loss_declared or dtype, [])],
        [numpy_helper.from_array(_W.astype(helper.tensor_dtype_to_np_dtype(dtype)), "W"),
         numpy_helper.from_array(_B.astype(helper.tensor_dtype_to_np_dtype(dtype)), "B")],
        value_info=[helper.make_tensor_value_info(n, declared, [4, 2]) for n in ("z", "t")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize(("dtype", "declared"), [(TensorProto.FLOAT, TensorProto.FLOAT16),
                                                 (TensorProto.FLOAT, TensorProto.DOUBLE),
                                                 (TensorProto.DOUBLE, TensorProto.FLOAT)])
def test_a_declared_element_type_the_nodes_do_not_compute_is_replaced(dtype, declared) -> None:
    """value_info declaring float16 (or float64) values of a float32 graph: the gradient's constants were
    made of the declared type, and the built graph was refused naming the builder's own nodes
    ('Tanh_Grad/Sub': a float16 constant beside float32 values). The computed type is taken, with a warning
    naming the values, as for declared dims; the gradient matches torch's (float64)."""
    import torch

    built, said = _build_warned(_tanh_model(dtype, declared))
    assert said and "z (" in said[0] and "t (" in said[0], said
    np_type = helper.tensor_dtype_to_np_dtype(dtype)
    sess = onnxtrain.InferenceSession(built)
    dw, db = sess.run(["W_grad", "B_grad"], {"x": _X.astype(np_type)})
    assert dw.dtype == db.dtype == np_type
    w = torch.tensor(_W, dtype=torch.float64, requires_grad=True)
    b = torch.tensor(_B, dtype=torch.float64, requires_grad=True)
    torch.tanh(torch.tensor(_X, dtype=torch.float64) @ w + b).mean().backward()
    np.testing.assert_allclose(dw, w.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(db, b.grad.numpy(), rtol=1e-5, atol=1e-6)


def test_a_loss_output_declared_of_another_element_type_is_written_with_the_computed_one() -> None:
    """A float32 loss declared float16: the builder warned it used the computed type but wrote the declared
    one into the gradient graph, which was then refused ('loss' is tensor(float) by ReduceMean-13, but the
    graph declares it tensor(float16)). The graph declares float32 now; the loss is onnxruntime's."""
    import onnxruntime as ort

    model = _tanh_model(TensorProto.FLOAT, TensorProto.FLOAT, loss_declared=TensorProto.FLOAT16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        builder = onnxtrain.GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W", "B"}, "loss")
        builder.build()
    built = onnx.load_from_string(builder.get_model())
    assert built.graph.output[0].type.tensor_type.elem_type == TensorProto.FLOAT
    loss, _ = onnxtrain.InferenceSession(built.SerializeToString()).run(["loss", "W_grad"], {"x": _X})
    plain = _tanh_model(TensorProto.FLOAT, TensorProto.FLOAT)
    want = ort.InferenceSession(plain.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": _X})[0]
    assert loss.dtype == np.float32
    np.testing.assert_allclose(loss, want, rtol=1e-6)


@pytest.mark.parametrize("case", ["contradicted dims", "contradicted rank", "contradicted element type"])
def test_artifacts_of_a_model_with_contradicted_declarations_train_with_the_computed_types(tmp_path,
                                                                                          case) -> None:
    """The training model was built on the computed types (with the warning), but the eval model kept the
    model's contradicted value_info and generate_artifacts failed on it ("the generated eval model fails
    onnx.checker"). Both models carry the computed types now; a step matches the float64 formulas."""
    from onnxtrain.training import api, artifacts

    declared = {"contradicted dims": {"sq": ([5, 7], TensorProto.FLOAT)},
                "contradicted rank": {"z": ([1, 4, 2], TensorProto.FLOAT)},
                "contradicted element type": {"z": ([4, 2], TensorProto.FLOAT16)}}[case]
    model = _model(4, {})
    model.graph.value_info.extend(helper.make_tensor_value_info(n, t, d) for n, (d, t) in declared.items())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        artifacts.generate_artifacts(model, requires_grad=["W", "B"], loss=None,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    for name in ("training_model.onnx", "eval_model.onnx"):
        onnx.checker.check_model(onnx.load(str(tmp_path / name)), full_check=True)
    state = api.CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = api.Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = api.Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    module(_X)
    opt.step()
    want_w, want_b = _exact(_X)
    np.testing.assert_allclose(state.parameters["W"].data, _W - 0.1 * want_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.parameters["B"].data, _B - 0.1 * want_b, rtol=1e-5, atol=1e-6)
