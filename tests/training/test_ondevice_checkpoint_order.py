"""generate_artifacts writes the checkpoint's parameters in the model's initializer order (spec §1.2).

Oracle: onnxruntime-training 1.19.2's generator (tests/ortt.py) on the same model; saving a state keeps
sorting by name, as onnxruntime-training's CheckpointState.save_checkpoint does.
"""

from __future__ import annotations

import json
import os

import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState
from tests.ortt import PREAMBLE, ensure_ortt, run_script

np = pytest.importorskip("numpy")

# initializer order far from the alphabetical one
ORDER = ["zeta.weight", "zeta.bias", "alpha.weight", "alpha.bias", "mid.weight", "mid.bias"]
TRAINABLE = ["zeta.weight", "zeta.bias", "mid.weight", "mid.bias"]
FROZEN = ["alpha.weight", "alpha.bias"]


def _model() -> onnx.ModelProto:
    rng = np.random.default_rng(0)
    dims = {"zeta": (4, 6), "alpha": (6, 5), "mid": (5, 3)}
    inits = []
    for n in ORDER:
        layer, kind = n.split(".")
        shape = dims[layer] if kind == "weight" else dims[layer][1:]
        inits.append(numpy_helper.from_array(rng.standard_normal(shape).astype(np.float32), n))
    nodes, h = [], "input"
    for layer in ("zeta", "alpha", "mid"):
        nodes += [helper.make_node("MatMul", [h, f"{layer}.weight"], [f"{layer}.mm"]),
                  helper.make_node("Add", [f"{layer}.mm", f"{layer}.bias"], [f"{layer}.out"])]
        h = f"{layer}.out"
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["b", 4])],
                          [helper.make_tensor_value_info(h, TensorProto.FLOAT, ["b", 3])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m


_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import artifacts
base, folder, trainable, frozen = json.loads(sys.argv[1])
artifacts.generate_artifacts(onnx.load(base), requires_grad=trainable, frozen_params=frozen,
                             loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                             artifact_directory=folder, nominal_checkpoint=True)
"""


def test_generated_checkpoint_keeps_initializer_order(tmp_path):
    python = ensure_ortt()
    base = str(tmp_path / "model.onnx")
    onnx.save(_model(), base)
    theirs, ours = str(tmp_path / "ort"), str(tmp_path / "ot")
    os.makedirs(theirs)
    os.makedirs(ours)
    run_script(_ORT_SCRIPT, json.dumps([base, theirs, TRAINABLE, FROZEN]), python=python)
    artifacts.generate_artifacts(onnx.load(base), requires_grad=TRAINABLE, frozen_params=FROZEN,
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=ours, nominal_checkpoint=True)
    for name in ("checkpoint", "nominal_checkpoint"):
        want, got = load_checkpoint(os.path.join(theirs, name)), load_checkpoint(os.path.join(ours, name))
        assert list(want.trainable) == ["zeta.weight", "zeta.bias", "mid.weight", "mid.bias"], name
        assert list(got.trainable) == list(want.trainable), name
        assert list(got.frozen) == list(want.frozen) == FROZEN, name
    # a state saved by the API is sorted by name, as onnxruntime-training's save_checkpoint writes it
    saved = str(tmp_path / "saved")
    CheckpointState.save_checkpoint(CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint")), saved)
    assert list(load_checkpoint(saved).trainable) == sorted(TRAINABLE)
