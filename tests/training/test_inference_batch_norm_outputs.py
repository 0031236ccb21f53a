"""onnxruntime-training's generator leaves the running-statistics outputs on the inference-mode
BatchNormalizations of the eval model of a model exported in training mode; ONNX's checker and onnxruntime
refuse such a node ("should be 1 when Training_mode = False"). ``convert_artifacts`` and
``Module.export_model_for_inferencing`` write them without those outputs (they wrote models no runtime
loaded); the values are onnxruntime's for the stripped model and the BatchNorm formula's."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.graphs import inference_batch_norms
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from onnxtrain.training.ort_artifacts import convert

F = TensorProto.FLOAT
RNG = np.random.default_rng(0)
SCALE, BIAS = RNG.uniform(0.5, 2, 3).astype(np.float32), RNG.standard_normal(3).astype(np.float32)
MEAN, VAR = RNG.standard_normal(3).astype(np.float32), RNG.uniform(0.5, 2, 3).astype(np.float32)


def _with_statistics_outputs(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with two unread running-statistics outputs on each inference BatchNormalization, as
    onnxruntime-training's eval models have them."""
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if n.op_type == "BatchNormalization" and len(n.output) == 1:
            n.output.extend([f"{n.output[0]}_mean_out", f"{n.output[0]}_var_out"])
    return out


def _bn_model() -> onnx.ModelProto:
    """y = Gemm(BatchNorm(x), W): an inference-mode BatchNormalization, opset 17."""
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["h"], name="bn"),
             helper.make_node("Gemm", ["h", "W"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", F, ["N", 3])],
                          [helper.make_tensor_value_info("y", F, ["N", 2])],
                          [numpy_helper.from_array(a, n) for a, n in ((SCALE, "scale"), (BIAS, "bias"),
                                                                      (MEAN, "mean"), (VAR, "var"))]
                          + [numpy_helper.from_array(RNG.standard_normal((2, 3)).astype(np.float32), "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _loads(model: onnx.ModelProto) -> ort.InferenceSession:
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


def test_the_outputs_go_and_the_values_are_the_formulas() -> None:
    model = _with_statistics_outputs(_bn_model())
    stripped = inference_batch_norms(model)
    assert [len(n.output) for n in stripped.graph.node] == [1, 1]
    x = RNG.standard_normal((4, 3)).astype(np.float32)
    w = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "W"))
    want = ((x - MEAN) / np.sqrt(VAR + 1e-5) * SCALE + BIAS) @ w.T
    np.testing.assert_allclose(_loads(stripped).run(None, {"x": x})[0], want, rtol=1e-5, atol=1e-6)


def test_convert_artifacts_and_export_write_loadable_models(tmp_path, monkeypatch) -> None:
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    model = _bn_model()
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 loss_input_names=["y"], additional_output_names=["y"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=src)
    eval_path = src / "eval_model.onnx"
    onnx.save(_with_statistics_outputs(onnx.load(eval_path)), eval_path)  # as onnxruntime-training's
    monkeypatch.setattr(convert, "translate_training_model", lambda m: m)  # (tested elsewhere)
    convert.convert_artifacts(src, dst)
    x, t = RNG.standard_normal((4, 3)).astype(np.float32), np.zeros((4, 2), np.float32)
    converted = _loads(onnx.load(dst / "eval_model.onnx"))
    state = CheckpointState.load_checkpoint(str(src / "checkpoint"))
    module = Module(str(src / "training_model.onnx"), state, str(eval_path))
    module.eval()
    loss, y = module(x, t)
    module.export_model_for_inferencing(str(tmp_path / "inference.onnx"), ["y"])
    exported = _loads(onnx.load(tmp_path / "inference.onnx"))
    np.testing.assert_allclose(exported.run(None, {"x": x})[0], y, rtol=1e-6)
    given = {"x": x, "target": t, "W": state.parameters["W"].data}  # the eval model takes W as an input
    feeds = {i.name: given[i.name] for i in converted.get_inputs()}
    np.testing.assert_allclose(converted.run(["y"], feeds)[0], y, rtol=1e-6)


def test_convert_artifacts_puts_an_opset_12_eval_batch_norm_in_inference_mode(tmp_path, monkeypatch) -> None:
    """Below opset 14 a BatchNormalization with statistics outputs is in training mode (there is no
    ``training_mode`` attribute): onnxruntime-training's eval model of a model exported in training mode has
    them. Module's eval runs it in inference mode (ef6ba22); ``convert_artifacts`` kept the outputs, so the
    converted eval model normalized each batch by its own statistics in onnxruntime. Its output now is the
    BatchNorm formula with the running statistics, in onnxruntime, as Module's eval gives it."""
    src, dst = tmp_path / "src", tmp_path / "dst"
    src.mkdir()
    artifacts.generate_artifacts(_bn_model(), requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 loss_input_names=["y"], additional_output_names=["y"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=src)
    eval_path = src / "eval_model.onnx"
    old = onnx.load(eval_path)  # as onnxruntime-training's, of an opset-12 export: BatchNormalization-9's
    old.opset_import[0].version = 12  # four statistics outputs (the other nodes read the same at 12)
    bn = next(n for n in old.graph.node if n.op_type == "BatchNormalization")
    bn.output.extend(f"h_{s}" for s in ("mean", "var", "saved_mean", "saved_var"))
    onnx.save(old, eval_path)
    monkeypatch.setattr(convert, "translate_training_model", lambda m: m)  # (tested elsewhere)
    convert.convert_artifacts(src, dst)
    x, t = RNG.standard_normal((4, 3)).astype(np.float32), np.zeros((4, 2), np.float32)
    converted = _loads(onnx.load(dst / "eval_model.onnx"))
    state = CheckpointState.load_checkpoint(str(src / "checkpoint"))
    w = state.parameters["W"].data
    want = ((x - MEAN) / np.sqrt(VAR + 1e-5) * SCALE + BIAS) @ w.T
    given = {"x": x, "target": t, "W": w}
    feeds = {i.name: given[i.name] for i in converted.get_inputs()}
    np.testing.assert_allclose(converted.run(["y"], feeds)[0], want, rtol=1e-5, atol=1e-6)
    module = Module(str(src / "training_model.onnx"), state, str(eval_path))
    module.eval()
    np.testing.assert_allclose(module(x, t)[1], want, rtol=1e-5, atol=1e-6)
