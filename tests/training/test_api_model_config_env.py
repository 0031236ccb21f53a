"""``ORT_LOAD_CONFIG_FROM_MODEL`` and the on-device Module and Optimizer, against onnxruntime-training 1.19.2:
each makes an InferenceSession, whose constructor refuses another value than 0 or 1 ("The only supported
values ... are '0' and '1'"), so neither is made; onnxtrain's refuse it too, naming the variable and the value
(a RuntimeError, as there, and a ValueError). Set to 1, 1.19.2 makes neither either ("ModelProto needs to be
parsed to check for ORT config": its training sessions load the model after that check), so no script that
runs there has it set; onnxtrain's are made (the variable may be set for the InferenceSessions of the same
process, which apply a model's ``ort_config``) and warn, naming the variable, that they apply no model's
options."""

from __future__ import annotations

import warnings

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
for value, refusal in (("2", "ORT_LOAD_CONFIG_FROM_MODEL"), ("1", "ModelProto needs to be parsed")):
    for what in ("Module", "Optimizer"):
        os.environ.pop("ORT_LOAD_CONFIG_FROM_MODEL", None)
        module = C.Module(folder + "/training_model.onnx", state, None, dev, C.SessionOptions())
        os.environ["ORT_LOAD_CONFIG_FROM_MODEL"] = value
        try:
            if what == "Module":
                C.Module(folder + "/training_model.onnx", state, None, dev, C.SessionOptions())
            else:
                C.Optimizer(folder + "/optimizer_model.onnx", state, dev, C.SessionOptions())
            out[what + value] = "made"
        except RuntimeError as e:
            out[what + value] = "refused" if refusal in str(e) else str(e)
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


@pytest.fixture(scope="module")
def peer(folder) -> dict:
    return run_script(PEER, folder)


def test_module_and_optimizer_refuse_another_value_as_onnxruntime_training(folder, peer, monkeypatch) -> None:
    assert (peer["Module2"], peer["Optimizer2"]) == ("refused", "refused"), peer
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


def _config_warnings(make) -> tuple[object, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        made = make()
    return made, [str(w.message) for w in caught if "ORT_LOAD_CONFIG_FROM_MODEL" in str(w.message)]


def test_with_one_module_and_optimizer_are_made_with_a_warning(folder, peer, monkeypatch) -> None:
    """1.19.2 makes neither with the variable 1; onnxtrain's are made and say so, naming the variable (and
    say nothing with it unset or 0)."""
    assert (peer["Module1"], peer["Optimizer1"]) == ("refused", "refused"), peer
    state = CheckpointState.load_checkpoint(folder + "/checkpoint")
    module = Module(folder + "/training_model.onnx", state)
    for value in ("", "0"):
        monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", value)
        assert _config_warnings(lambda: Module(folder + "/training_model.onnx", state))[1] == []
        assert _config_warnings(lambda: Optimizer(folder + "/optimizer_model.onnx", module))[1] == []
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    for what, make in (("Module", lambda: Module(folder + "/training_model.onnx", state)),
                       ("Optimizer", lambda: Optimizer(folder + "/optimizer_model.onnx", module))):
        made, said = _config_warnings(make)
        assert type(made).__name__ == what and len(said) == 1, said
        assert said[0].startswith("ORT_LOAD_CONFIG_FROM_MODEL=1") and f"a {what}" in said[0], said
