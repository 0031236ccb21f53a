"""``ORT_LOAD_CONFIG_FROM_MODEL`` set to another value than 0 or 1 and the on-device Module and Optimizer,
against onnxruntime-training 1.19.2: each makes an InferenceSession, whose constructor refuses the value
("The only supported values ... are '0' and '1'"), so neither is made; onnxtrain's refuse it too, naming the
variable and the value (a RuntimeError, as there, and a ValueError)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.ortt import PREAMBLE, run_script

PEER = PREAMBLE + r"""
import os
import onnxruntime.capi._pybind_state as C
folder = sys.argv[1]
out = {}
state = C.load_checkpoint(folder + "/checkpoint")
dev = C.OrtDevice(C.OrtDevice.cpu(), C.OrtDevice.default_memory(), 0)
for what in ("Module", "Optimizer"):
    os.environ.pop("ORT_LOAD_CONFIG_FROM_MODEL", None)
    module = C.Module(folder + "/training_model.onnx", state, None, dev, C.SessionOptions())
    os.environ["ORT_LOAD_CONFIG_FROM_MODEL"] = "2"
    try:
        if what == "Module":
            C.Module(folder + "/training_model.onnx", state, None, dev, C.SessionOptions())
        else:
            C.Optimizer(folder + "/optimizer_model.onnx", state, dev, C.SessionOptions())
        out[what] = "made"
    except RuntimeError as e:
        out[what] = "refused" if "ORT_LOAD_CONFIG_FROM_MODEL" in str(e) else str(e)
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    w = numpy_helper.from_array(np.ones((4, 2), np.float32), "W")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, 2])],
                              initializer=[w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out = tmp_path_factory.mktemp("artifacts")
    artifacts.generate_artifacts(model, requires_grad=["W"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(out))
    return str(out)


def test_module_and_optimizer_refuse_another_value_as_onnxruntime_training(folder, monkeypatch) -> None:
    assert run_script(PEER, folder) == {"Module": "refused", "Optimizer": "refused"}
    state = CheckpointState.load_checkpoint(folder + "/checkpoint")
    module = Module(folder + "/training_model.onnx", state)
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "2")
    for make in (lambda: Module(folder + "/training_model.onnx", state),
                 lambda: Optimizer(folder + "/optimizer_model.onnx", module)):
        with pytest.raises(RuntimeError, match="ORT_LOAD_CONFIG_FROM_MODEL.*'2'") as info:
            make()
        assert isinstance(info.value, ValueError)
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "0")
    Optimizer(folder + "/optimizer_model.onnx", Module(folder + "/training_model.onnx", state))
