"""An on-device Module given a session config entry value onnxruntime refuses, against onnxruntime-training
1.19.2 on the same artifacts: 1.19.2 refuses optimization.minimal_build_optimizations = "bogus" (a
RuntimeError) and session.dynamic_block_base = "x" (a ValueError) when the Module is made. onnxtrain's
InferenceSession refuses them with onnxruntime 1.32's classes (session_loading.refuse_bad_ort_entries); its
Module now refuses them too (it took them without a word)."""

from __future__ import annotations

import os

import pytest

import onnxtrain
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, run_script, small_mlp

ENTRIES = [("optimization.minimal_build_optimizations", "bogus"), ("session.dynamic_block_base", "x")]

_ORT_SCRIPT = PREAMBLE + r"""
import onnxruntime as ort
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
folder = sys.argv[1]
artifacts.generate_artifacts(onnx.load(folder + "/base.onnx"), requires_grad=["fc1.weight", "fc2.weight"],
                             loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                             artifact_directory=folder)
found = {}
for key, value in json.loads(sys.argv[2]):
    so = ort.SessionOptions()
    so.add_session_config_entry(key, value)
    try:
        Module(folder + "/training_model.onnx", CheckpointState.load_checkpoint(folder + "/checkpoint"),
               session_options=so)
        found[key] = None
    except Exception as e:
        found[key] = [c.__name__ for c in type(e).__mro__]
print(json.dumps(found))
"""


@pytest.fixture(scope="module")
def oracle(tmp_path_factory):
    import json

    import onnx

    folder = tmp_path_factory.mktemp("module_entries")
    theirs = folder / "ortt"
    theirs.mkdir()
    onnx.save(small_mlp(), str(theirs / "base.onnx"))
    found = run_script(_ORT_SCRIPT, str(theirs), json.dumps(ENTRIES))
    ours = str(folder / "ours")
    os.makedirs(ours)
    artifacts.generate_artifacts(small_mlp(), requires_grad=["fc1.weight", "fc2.weight"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=ours)
    return found, ours


@pytest.mark.parametrize(("key", "value"), ENTRIES, ids=[k for k, _ in ENTRIES])
def test_module_refuses_what_onnxruntime_training_refuses(oracle, key: str, value: str) -> None:
    found, ours = oracle
    assert found[key] is not None and ("RuntimeError" in found[key] or "ValueError" in found[key])
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry(key, value)
    with pytest.raises(RuntimeError if "RuntimeError" in found[key] else ValueError, match=key):
        Module(os.path.join(ours, "training_model.onnx"),
               CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint")), session_options=so)
