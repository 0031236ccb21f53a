"""An on-device Module given a session config entry value onnxruntime refuses, against onnxruntime-training
1.19.2 on the same artifacts: 1.19.2 refuses optimization.minimal_build_optimizations = "bogus" (a
RuntimeError) and session.dynamic_block_base = "x" (a ValueError) when the Module is made. onnxtrain's
InferenceSession refuses them with onnxruntime 1.32's classes (session_loading.refuse_bad_ort_entries); its
Module now refuses them too (it took them without a word). A session.dynamic_block_base past int32 is
1.19.2's IndexError (std::stoi's out_of_range), and ours (review R2).

A kept difference (review R2): 1.19.2 takes session.kernel_dispatch_policy = "x",
session.function_expansion_byte_limit / _node_limit = "0" and session.graph_optimizations_loop_level = "abc"
(it reads none of them) where onnxruntime 1.32 refuses them; onnxtrain's Module refuses them on the numpy
engine as its onnxruntime backend (1.32) does, so that both engines agree."""

from __future__ import annotations

import os

import pytest

import onnxtrain
from onnxtrain.errors import InvalidArgument, RuntimeException
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, run_script, small_mlp

ENTRIES = [("optimization.minimal_build_optimizations", "bogus"), ("session.dynamic_block_base", "x"),
           ("session.dynamic_block_base", "99999999999")]
NEWER = [("session.kernel_dispatch_policy", "x"), ("session.function_expansion_byte_limit", "0"),
         ("session.function_expansion_node_limit", "0"), ("session.graph_optimizations_loop_level", "abc")]

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
        found[key + "=" + value] = None
    except Exception as e:
        found[key + "=" + value] = [c.__name__ for c in type(e).__mro__]
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
    found = run_script(_ORT_SCRIPT, str(theirs), json.dumps(ENTRIES + NEWER))
    ours = str(folder / "ours")
    os.makedirs(ours)
    artifacts.generate_artifacts(small_mlp(), requires_grad=["fc1.weight", "fc2.weight"],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=ours)
    return found, ours


def _module(ours: str, key: str, value: str) -> Module:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry(key, value)
    return Module(os.path.join(ours, "training_model.onnx"),
                  CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint")), session_options=so)


@pytest.mark.parametrize(("key", "value"), ENTRIES, ids=[f"{k}={v}" for k, v in ENTRIES])
def test_module_refuses_what_onnxruntime_training_refuses(oracle, key: str, value: str) -> None:
    found, ours = oracle
    theirs = found[key + "=" + value]
    assert theirs is not None
    want = next(c for c in (RuntimeError, ValueError, IndexError) if c.__name__ in theirs)
    with pytest.raises(want, match=key):
        _module(ours, key, value)


@pytest.mark.parametrize(("key", "value"), NEWER, ids=[f"{k}={v}" for k, v in NEWER])
def test_entries_1_19_2_takes_are_refused_as_onnxruntime_1_32_refuses_them(oracle, key: str, value: str
                                                                            ) -> None:
    found, ours = oracle
    assert found[key + "=" + value] is None  # (the kept difference: 1.19.2 takes the value)
    with pytest.raises((InvalidArgument, RuntimeException), match=key):
        _module(ours, key, value)
