"""A model that lists its loss output twice (valid ONNX; onnxruntime runs it) is taken by
``generate_artifacts(loss=None)`` as onnxruntime-training 1.19.2's generator takes it: the training model
keeps both outputs (it was refused, blaming ``additional_output_names`` the call did not pass), and the Module
trains it to the formula's weights. ``additional_output_names`` repeating a loss output is still refused."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.ortt import PREAMBLE, run_script

_W = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], np.float32)
_X = np.arange(6, dtype=np.float32).reshape(2, 3)


def _model() -> onnx.ModelProto:
    vi = helper.make_tensor_value_info
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [vi("x", TensorProto.FLOAT, [2, 3])],
                          [vi("loss", TensorProto.FLOAT, []), vi("y", TensorProto.FLOAT, [2, 2]),
                           vi("loss", TensorProto.FLOAT, [])], [numpy_helper.from_array(_W, "W")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import artifacts
artifacts.generate_artifacts(onnx.load(sys.argv[1]), requires_grad=["W"], loss=None,
                             optimizer=artifacts.OptimType.SGD, artifact_directory=sys.argv[2])
print(json.dumps([[o.name for o in onnx.load(sys.argv[2] + f"/{m}_model.onnx").graph.output]
                  for m in ("training", "eval")]))
"""


def test_a_loss_listed_twice_is_kept_twice_and_trains(tmp_path) -> None:
    from onnxtrain.training import api, artifacts

    base = tmp_path / "twice.onnx"
    m = _model()
    m.ir_version = 10
    onnx.save(m, base)
    (tmp_path / "ort").mkdir()
    theirs = run_script(_ORT_SCRIPT, str(base), str(tmp_path / "ort"))
    ours = tmp_path / "ours"
    ours.mkdir()
    artifacts.generate_artifacts(_model(), requires_grad=["W"], loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=ours)
    training = onnx.load(ours / "training_model.onnx")
    onnx.checker.check_model(training, full_check=True)
    evaluation = onnx.load(ours / "eval_model.onnx")
    assert [[o.name for o in m.graph.output] for m in (training, evaluation)] == theirs
    state = api.CheckpointState.load_checkpoint(str(ours / "checkpoint"))
    module = api.Module(str(ours / "training_model.onnx"), state)
    opt = api.Optimizer(str(ours / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    outs = module(_X)
    np.testing.assert_allclose(outs[0], (_X @ _W).sum(), rtol=1e-6)
    np.testing.assert_array_equal(outs[2], outs[0])
    opt.step()
    grad = np.repeat(_X.sum(0)[:, None], 2, axis=1)
    np.testing.assert_allclose(state.parameters["W"].data, _W - 0.1 * grad, rtol=1e-6)


def test_additional_outputs_repeating_the_loss_are_refused(tmp_path) -> None:
    from onnxtrain.training import artifacts

    with pytest.raises(Exception, match="additional_output_names must not repeat"):
        artifacts.generate_artifacts(_model(), requires_grad=["W"], loss=None,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path,
                                     additional_output_names=["loss"])
