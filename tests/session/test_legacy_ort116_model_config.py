"""``ORT_LOAD_CONFIG_FROM_MODEL=1`` and the legacy TrainingSession, against onnxruntime-training 1.16.3.

onnxruntime reads the session options of a model's metadata entry ``ort_config`` when the environment
variable is 1, in the InferenceSession constructor that is given the model (another value than 0 or 1 makes
no session at all). The legacy binding constructs
its TrainingSession without the model and loads it afterwards, so with the variable 1 its constructor
refuses every model ("ModelProto needs to be parsed to check for ORT config within it", a RuntimeError),
whether the model has an ``ort_config`` or not: the legacy session never applied a model's options.
onnxtrain's TrainingSession is made as without the variable (its options are the ones given), and warns
when the model carries an ``ort_config`` it does not apply; its InferenceSession applies them, as 1.16.3's.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

CONFIG = {"session_options": {"intra_op_num_threads": 1, "enable_profiling": 1}}

PEER = r"""
import contextlib, io, json, os, sys
import numpy as np
import onnxruntime as ort
ort.set_default_logger_severity(3)
out = {}
for value in ("1", "2"):
    os.environ["ORT_LOAD_CONFIG_FROM_MODEL"] = value
    for name in ("with_config", "without_config"):
        path = sys.argv[1] + "/" + name + ".onnx"
        p = ort.TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = "SGDOptimizer"
        p.optimizer_attributes_map = {"w": {}}
        p.optimizer_int_attributes_map = {"w": {}}
        for kind in ("train", "infer"):
            try:
                with contextlib.redirect_stdout(io.StringIO()):  # (its provider fallback prints)
                    if kind == "train":
                        s = ort.TrainingSession(path, p, None, ["CPUExecutionProvider"])
                        out[f"{value}/{kind}/{name}"] = {"ok": True}
                    else:
                        s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                        on = bool(s.get_session_options().enable_profiling)
                        out[f"{value}/{kind}/{name}"] = {"profiling": on}
                        s.end_profiling()
            except Exception as e:
                out[f"{value}/{kind}/{name}"] = {"error": type(e).__name__, "message": str(e)}
print(json.dumps(out))
"""


def _model(config: dict | None) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((4, 10), 0.1, np.float32), "w")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)
    if config is not None:
        helper.set_model_props(m, {"ort_config": json.dumps(config)})
    onnx.checker.check_model(m, full_check=True)
    return m


def _params() -> onnxtrain.TrainingParameters:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return p


@pytest.fixture
def models(tmp_path, monkeypatch) -> str:
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "1")
    monkeypatch.chdir(tmp_path)  # (the profiles an InferenceSession writes)
    onnx.save(_model(CONFIG), os.fspath(tmp_path / "with_config.onnx"))
    onnx.save(_model(None), os.fspath(tmp_path / "without_config.onnx"))
    return os.fspath(tmp_path)


def test_the_legacy_session_cannot_be_made_with_the_variable_in_1_16_3(models) -> None:
    from tests.ortt import ensure_ort_legacy, run_script

    peer = run_script(PEER, models, python=ensure_ort_legacy())
    for name in ("with_config", "without_config"):
        got = peer[f"1/train/{name}"]
        assert got.get("error") == "RuntimeError", got
        assert "ModelProto needs to be parsed to check for ORT config" in got["message"], got
        for kind in ("train", "infer"):  # a value other than 0 and 1: no session at all
            got = peer[f"2/{kind}/{name}"]
            assert got.get("error") == "RuntimeError" and "ORT_LOAD_CONFIG_FROM_MODEL" in got["message"], got
    assert peer["1/infer/with_config"] == {"profiling": True}  # its InferenceSession applies the config
    assert peer["1/infer/without_config"] == {"profiling": False}


def test_another_value_of_the_variable_is_refused_by_every_session(models, monkeypatch) -> None:
    """As onnxruntime (1.16.3 above, and 1.32) makes no session when the variable is not 0 or 1."""
    monkeypatch.setenv("ORT_LOAD_CONFIG_FROM_MODEL", "2")
    path = os.path.join(models, "without_config.onnx")
    for make in (lambda: onnxtrain.TrainingSession(path, _params()),
                 lambda: onnxtrain.InferenceSession(path)):
        with pytest.raises(RuntimeError, match="ORT_LOAD_CONFIG_FROM_MODEL must be '0' or '1'.*'2'"):
            make()


def test_onnxtrains_training_session_keeps_its_options_and_says_so(models) -> None:
    with pytest.warns(UserWarning, match="does not apply the session options of the model's metadata entry "
                                         "ort_config"):
        sess = onnxtrain.TrainingSession(os.path.join(models, "with_config.onnx"), _params())
    options = sess.get_session_options()
    assert (options.enable_profiling, options.intra_op_num_threads) == (False, 0)
    feeds = {"x": np.ones((2, 4), np.float32), "Learning_Rate": np.array([0.1], np.float32)}
    loss, = sess.run(["loss"], feeds)
    assert loss == pytest.approx(8.0)  # 20 sums of 4 × 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no config: nothing to say
        onnxtrain.TrainingSession(os.path.join(models, "without_config.onnx"), _params())
    inference = onnxtrain.InferenceSession(os.path.join(models, "with_config.onnx"))
    assert inference.get_session_options().enable_profiling is True  # as 1.16.3's InferenceSession
    inference.end_profiling()
