"""An ``onnxblock.TrainingBlock`` passed to ``generate_artifacts`` as the loss is refused, saying so.

onnxruntime-training 1.19.2 cannot use one there either: its generator wraps the loss in a TrainingBlock
of its own, so the gradient graph is built twice, and the artifacts either fail to generate ("two nodes
with same node name", when the inner block marks parameters) or fail to load in a Module. onnxtrain
failed at generation too, but with messages about the model ("the model has value(s)
['lazy_reset_grad'] ...: rename them", "the model already has a value named 'fc1.weight_grad'") that
sent the user to rename values. It now refuses the argument before building anything, naming the block
and the fix (a plain ``onnxblock.Block``).

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) on the same two cases: it must fail to give a Module
(so refusing takes nothing a script could use).
"""

from __future__ import annotations

import os

import onnx
import pytest

from onnxtrain.training import artifacts, onnxblock
from tests.ortt import PREAMBLE, run_script, small_mlp

_ORT_SCRIPT = PREAMBLE + r"""
import tempfile
import numpy as np
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module
base = onnx.load(sys.argv[1])

class MyLoss(onnxblock.TrainingBlock):
    def __init__(self):
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()

    def build(self, output):
        return self.mse(output)

out = {}
for marked in (False, True):
    folder = tempfile.mkdtemp()
    block = MyLoss()
    if marked:
        block.requires_grad("fc1.weight")
    try:
        artifacts.generate_artifacts(base, requires_grad=["fc1.weight"], loss=block,
                                     artifact_directory=folder)
        state = CheckpointState.load_checkpoint(folder + "/checkpoint")
        Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
        out[str(marked)] = None
    except Exception as e:
        out[str(marked)] = type(e).__name__
print(json.dumps(out))
"""


class MyLoss(onnxblock.TrainingBlock):
    def __init__(self) -> None:
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()

    def build(self, output: str) -> str:
        return self.mse(output)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("ortt_tb_loss") / "base.onnx")
    onnx.save(small_mlp(), path)
    return run_script(_ORT_SCRIPT, path)


@pytest.mark.parametrize("marked", [False, True])
def test_a_training_block_as_the_loss_is_refused_naming_it(reference, marked, tmp_path):
    assert reference[str(marked)] is not None  # onnxruntime-training gives no Module either
    block = MyLoss()
    if marked:
        block.requires_grad("fc1.weight")
    with pytest.raises(artifacts.ArtifactError, match="MyLoss is a TrainingBlock") as info:
        artifacts.generate_artifacts(small_mlp(), requires_grad=["fc1.weight"], loss=block,
                                     artifact_directory=str(tmp_path))
    assert isinstance(info.value, RuntimeError) and "onnxblock.Block" in str(info.value)
    assert os.listdir(tmp_path) == []
