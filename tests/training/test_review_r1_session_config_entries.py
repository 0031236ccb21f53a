"""Review R1: the session config entries review F made the inference session warn of or refuse (ce6736de,
fa1c031b: ``session.set_denormal_as_zero``, ``session.disable_cpu_ep_fallback``) on the two training paths,
which take SessionOptions too and were left as they were: the on-device ``Module`` (onnxtrain/training/api/
module.py, ``_check_session_options``) and the legacy ``TrainingSession`` (onnxtrain/session.py). Both
now warn of the first and refuse the second (these tests were strict xfails until then).

Oracles: onnxruntime-training 1.19.2's Module and 1.16.3's TrainingSession (tests/ortt.py's venvs), each in
a process of its own (the denormal entry sets the thread's FTZ/DAZ flags): with ``set_denormal_as_zero``
they flush a subnormal loss (x · W with x = 1e-40) to 0; with ``disable_cpu_ep_fallback`` they refuse the
session. onnxtrain's numpy engine keeps the subnormal loss and makes the session, without a word."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.training import api, artifacts
from tests.ortt import PREAMBLE, ensure_ort_legacy, run_script

DENORMAL, NO_CPU_FALLBACK = "session.set_denormal_as_zero", "session.disable_cpu_ep_fallback"
X = np.full((2, 3), 1e-40, np.float32)  # the loss sum(x · W) is subnormal: 2.2e-39


def legacy_peer_model(**fields: str) -> onnx.ModelProto:
    """loss = sum(x · W), W of 12 values (1.16.3 renames a weight of 8 or fewer), IR 8 for 1.16.3's onnx;
    ``fields``: ModelProto fields such as producer_name."""
    w = numpy_helper.from_array((np.arange(12, dtype=np.float32).reshape(3, 4) + 1) / 7, "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8, **fields)


_model = legacy_peer_model


_ORT_MODULE = PREAMBLE + r"""
import numpy as np, onnxruntime as ort
from onnxruntime.training.api import CheckpointState, Module
folder, key = sys.argv[1], sys.argv[2]
so = ort.SessionOptions()
so.add_session_config_entry(key, "1")
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
try:
    m = Module(folder + "/training_model.onnx", state, session_options=so)
    print(json.dumps({"loss": float(m(np.full((2, 3), 1e-40, np.float32)))}))
except Exception as e:
    print(json.dumps({"refused": type(e).__name__}))
"""

_ORT_LEGACY = r"""
import json, sys, numpy as np, onnxruntime as ort
path, key = sys.argv[1], sys.argv[2]
so = ort.SessionOptions()
so.add_session_config_entry(key, "1")
p = ort.TrainingParameters()
p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
p.optimizer_attributes_map, p.optimizer_int_attributes_map = {"W": {}}, {"W": {}}
try:
    s = ort.TrainingSession(open(path, "rb").read(), p, so)
    loss, = s.run(["loss"], {"x": np.full((2, 3), 1e-40, np.float32),
                             "Learning_Rate": np.array([0.0], np.float32)})
    print(json.dumps({"loss": float(loss)}))
except Exception as e:
    print(json.dumps({"refused": type(e).__name__}))
"""


@pytest.fixture(scope="module")
def generated(tmp_path_factory) -> str:
    folder = str(tmp_path_factory.mktemp("art"))
    artifacts.generate_artifacts(_model(), requires_grad=["W"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    return folder


def _options(key: str) -> onnxtrain.SessionOptions:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry(key, "1")
    return so




def test_module_warns_of_set_denormal_as_zero(generated) -> None:
    got = run_script(_ORT_MODULE, generated, DENORMAL)
    assert got == {"loss": 0.0}  # onnxruntime-training flushes the subnormal loss
    state = api.CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        module = api.Module(os.path.join(generated, "training_model.onnx"), state,
                            session_options=_options(DENORMAL))
    assert float(module(X)) > 0  # (the numpy engine keeps it)
    assert any(DENORMAL in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_module_refuses_disabled_cpu_fallback(generated) -> None:
    got = run_script(_ORT_MODULE, generated, NO_CPU_FALLBACK)
    assert "refused" in got, got  # onnxruntime-training refuses the Module
    state = api.CheckpointState.load_checkpoint(os.path.join(generated, "checkpoint"))
    with pytest.raises(Exception, match=NO_CPU_FALLBACK.replace(".", r"\.")):  # noqa: PT011
        api.Module(os.path.join(generated, "training_model.onnx"), state,
                   session_options=_options(NO_CPU_FALLBACK))


def _legacy(tmp_path, key: str) -> dict:
    path = str(tmp_path / "plain.onnx")
    onnx.save(_model(), path)
    return run_script(_ORT_LEGACY, path, key, python=ensure_ort_legacy())


def _parameters() -> onnxtrain.TrainingParameters:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    return p


def test_legacy_session_warns_of_set_denormal_as_zero(tmp_path) -> None:
    assert _legacy(tmp_path, DENORMAL) == {"loss": 0.0}  # onnxruntime-training 1.16.3 flushes it
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        sess = onnxtrain.TrainingSession(_model().SerializeToString(), _parameters(), _options(DENORMAL))
    loss, = sess.run(["loss"], {"x": X, "Learning_Rate": np.array([0.0], np.float32)})
    assert float(loss) > 0
    assert any(DENORMAL in str(w.message) for w in seen), [str(w.message) for w in seen]


def test_legacy_session_refuses_disabled_cpu_fallback(tmp_path) -> None:
    got = _legacy(tmp_path, NO_CPU_FALLBACK)
    assert got == {"refused": "InvalidArgument"}, got  # (the CPU provider is the session's, as onnxtrain's)
    with pytest.raises(Exception, match=NO_CPU_FALLBACK.replace(".", r"\.")):  # noqa: PT011
        onnxtrain.TrainingSession(_model().SerializeToString(), _parameters(), _options(NO_CPU_FALLBACK))


def test_the_oracles_answer_without_the_entries(generated, tmp_path) -> None:
    """The oracles themselves, without the entries: the subnormal loss is kept (so the tests above fail for
    the reason they name, not for another)."""
    got = run_script(_ORT_MODULE, generated, "session.some_unread_entry")
    assert got["loss"] > 0, got
    got = _legacy(tmp_path, "session.some_unread_entry")
    assert got["loss"] > 0, got
