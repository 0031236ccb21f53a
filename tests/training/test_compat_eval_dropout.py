"""The eval model's Dropout keeps its third input slot as ``''`` (training_mode omitted: inference mode), as
onnxruntime-training 1.19.2 writes it (its test ``test_eval_model_has_no_training_mode_dropout`` reads
``node.input[2]``); a Dropout without that input is left as it is. Oracles: onnxruntime-training generating
the same model (tests/ortt.py), torch for the eval loss (dropout off), onnx.checker's full check.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")


def dropout_model() -> onnx.ModelProto:
    """Dropout(x, 0.5, True) -> Gemm(W, b) -> Dropout(·) (no ratio, no mode) = output-0, as torch exports."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 8)).astype(np.float32), "fc.weight"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "fc.bias")]
    nodes = [
        helper.make_node("Constant", [], ["ratio"], value=numpy_helper.from_array(np.array(0.5, np.float32))),
        helper.make_node("Constant", [], ["mode"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("Dropout", ["input-0", "ratio", "mode"], ["d", "mask"], name="drop1"),
        helper.make_node("Gemm", ["d", "fc.weight", "fc.bias"], ["g"], transB=1),
        helper.make_node("Dropout", ["g"], ["output-0"], name="drop2"),
    ]
    x = helper.make_tensor_value_info("input-0", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("output-0", TensorProto.FLOAT, ["batch", 3])
    graph = helper.make_graph(nodes, "dropout", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((6, 8)).astype(np.float32), np.array([0, 2, 1, 1, 0, 2], np.int64)


def dropouts(model: onnx.ModelProto) -> dict[str, list[str]]:
    return {n.name: list(n.input) for n in model.graph.node if n.op_type == "Dropout"}


def generate(folder: str) -> None:
    artifacts.generate_artifacts(dropout_model(), requires_grad=["fc.weight", "fc.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=folder)


def test_eval_dropout_keeps_empty_training_mode_input(tmp_path):
    generate(str(tmp_path))
    evaluation = onnx.load(str(tmp_path / "eval_model.onnx"))
    onnx.checker.check_model(evaluation, full_check=True)
    assert dropouts(evaluation) == {"drop1": ["input-0", "ratio", ""], "drop2": ["g"]}
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    assert dropouts(training)["drop1"] == ["input-0", "ratio", "mode"]  # the training model still drops

    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx")).eval()
    x, labels = data()
    w = {i.name: torch.tensor(numpy_helper.to_array(i), dtype=torch.float64)
         for i in dropout_model().graph.initializer}
    ref = torch.nn.functional.cross_entropy(torch.tensor(x, dtype=torch.float64) @ w["fc.weight"].T
                                            + w["fc.bias"], torch.tensor(labels))
    np.testing.assert_allclose(module(x, labels), ref.numpy(), rtol=1e-6)  # no dropout in eval mode
    np.testing.assert_allclose(module(x, labels), module(x, labels))


_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import artifacts

base, folder = sys.argv[1:3]
model = onnx.load(base)
model.ir_version = 10
artifacts.generate_artifacts(model, requires_grad=["fc.weight", "fc.bias"],
                             loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=folder)
evaluation = onnx.load(folder + "/eval_model.onnx")
print(json.dumps({n.name: list(n.input) for n in evaluation.graph.node if n.op_type == "Dropout"}))
"""


@pytest.mark.slow
def test_eval_dropout_like_onnxruntime_training(tmp_path):
    python = ensure_ortt()
    base = str(tmp_path / "dropout.onnx")
    onnx.save(dropout_model(), base)
    theirs, ours = tmp_path / "ort", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    ref = run_script(_ORT_SCRIPT, base, str(theirs), python=python)
    generate(str(ours))
    assert dropouts(onnx.load(str(ours / "eval_model.onnx"))) == ref
    assert ref["drop1"][2] == ""


def test_random_ops_in_the_eval_model_are_named_in_a_warning(tmp_path) -> None:
    """A channel dropout written as random ops (torch's export of Dropout2d: RandomUniformLike, a comparison
    and a Mul) stays on in eval mode: generate_artifacts names the node in a warning (it was silent); a model
    with Dropout nodes only gives none. The eval model draws anew on every call (two evals differ)."""
    import warnings

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fc.weight")
    keep = numpy_helper.from_array(np.array(0.5, np.float32), "keep")
    nodes = [helper.make_node("RandomUniformLike", ["x"], ["u"], name="channel_noise"),
             helper.make_node("Less", ["u", "keep"], ["kept"]),
             helper.make_node("Cast", ["kept"], ["mask"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "mask"], ["xd"]),
             helper.make_node("Gemm", ["xd", "fc.weight"], ["y"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w, keep])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"eval model draws random values in channel_noise "
                                         r"\(RandomUniformLike\).*nn.Identity"):
        artifacts.generate_artifacts(model, requires_grad=["fc.weight"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.eval()
    x, t = np.ones((64, 4), np.float32), np.zeros((64, 3), np.float32)
    assert float(module(x, t)) != float(module(x, t))
    (tmp_path / "d").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        artifacts.generate_artifacts(dropout_model(), requires_grad=["fc.weight"],
                                     loss=artifacts.LossType.MSELoss, artifact_directory=tmp_path / "d")
