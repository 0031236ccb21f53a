"""A loss written as an ``onnxblock.ForwardBlock`` (instead of a plain ``Block``) generates and trains, as in
onnxruntime-training 1.19.2.

onnxruntime-training's ``generate_artifacts`` calls such a loss inside its own TrainingBlock: the
ForwardBlock registers its result as the graph outputs and the training model is built on top, as for a
plain Block. In onnxtrain the ForwardBlock's call replaced the model being built under the generator, whose
graph it still held, so generation failed with ``KeyError: 'fc1.weight'``.

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) generates the same artifacts and runs one training
call; onnxtrain's artifacts must have the same inputs and outputs (the generated loss name aside) and give
the same loss and gradients; the same loss as a plain Block gives the same artifacts.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, run_script, small_mlp

_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module
folder = sys.argv[1]
base = onnx.load(folder + "/base.onnx")

class Loss(onnxblock.ForwardBlock):
    def __init__(self):
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()
        self.l1 = onnxblock.loss.L1Loss(reduction="sum")
        self.add = onnxblock.blocks.Add()

    def build(self, output):
        return self.add(self.mse(output), self.l1(output, "target2"))

artifacts.generate_artifacts(base, requires_grad=["fc1.weight", "fc2.bias"], frozen_params=["fc1.bias"],
                             loss=Loss(), artifact_directory=folder)
data = np.load(folder + "/data.npz")
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
module = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
loss = module(data["x"], data["t"], data["t2"])
m = onnx.load(folder + "/training_model.onnx")
print(json.dumps({"inputs": [i.name for i in m.graph.input], "outputs": [o.name for o in m.graph.output],
                  "loss": float(loss), "grads": {n: state.parameters[n].grad.tolist()
                                                  for n in ("fc1.weight", "fc2.bias")}}))
"""


def _loss(kind: type) -> onnxblock.Block:
    class Loss(kind):
        def __init__(self) -> None:
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()
            self.l1 = onnxblock.loss.L1Loss(reduction="sum")
            self.add = onnxblock.blocks.Add()

        def build(self, output: str) -> str:
            return self.add(self.mse(output), self.l1(output, "target2"))

    return Loss()


def _generate_and_run(folder, kind: type, data: dict) -> dict:
    artifacts.generate_artifacts(small_mlp(), requires_grad=["fc1.weight", "fc2.bias"],
                                 frozen_params=["fc1.bias"], loss=_loss(kind), artifact_directory=str(folder))
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    loss = module(data["x"], data["t"], data["t2"])
    m = onnx.load(str(folder / "training_model.onnx"))
    return {"inputs": [i.name for i in m.graph.input], "outputs": [o.name for o in m.graph.output],
            "loss": float(loss),
            "grads": {n: state.parameters[n].grad.copy() for n in ("fc1.weight", "fc2.bias")}}


@pytest.fixture(scope="module")
def data():
    rng = np.random.default_rng(7)
    return {"x": rng.standard_normal((5, 4)).astype(np.float32),
            "t": rng.standard_normal((5, 3)).astype(np.float32),
            "t2": rng.standard_normal((5, 3)).astype(np.float32)}


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data):
    folder = tmp_path_factory.mktemp("ortt_forward_loss")
    onnx.save(small_mlp(), str(folder / "base.onnx"))
    np.savez(str(folder / "data.npz"), **data)
    return run_script(_ORT_SCRIPT, str(folder))


def _without_loss_name(names: list[str]) -> list[str]:
    return ["<loss>" if n.startswith("onnx::") else n for n in names]


def test_a_forward_block_loss_trains_as_in_onnxruntime_training(reference, data, tmp_path):
    ours = _generate_and_run(tmp_path, onnxblock.ForwardBlock, data)
    assert _without_loss_name(ours["inputs"]) == _without_loss_name(reference["inputs"])
    assert _without_loss_name(ours["outputs"]) == _without_loss_name(reference["outputs"])
    np.testing.assert_allclose(ours["loss"], reference["loss"], rtol=1e-5)
    for name, grad in reference["grads"].items():
        np.testing.assert_allclose(ours["grads"][name], np.array(grad, np.float32), rtol=1e-5, atol=1e-6,
                                   err_msg=name)


def test_a_forward_block_loss_gives_the_plain_blocks_artifacts(data, tmp_path):
    (tmp_path / "fwd").mkdir()
    (tmp_path / "plain").mkdir()
    fwd = _generate_and_run(tmp_path / "fwd", onnxblock.ForwardBlock, data)
    plain = _generate_and_run(tmp_path / "plain", onnxblock.Block, data)
    assert fwd["inputs"] == plain["inputs"] and fwd["outputs"] == plain["outputs"]
    assert fwd["loss"] == plain["loss"]
    for name in plain["grads"]:
        np.testing.assert_array_equal(fwd["grads"][name], plain["grads"][name])
