"""A seeded Dropout in a Module's training model: every call draws a new mask, however the calls mix
accumulating steps and steps after lazy_reset_grad (two compiled forms of the model, whose generators each
restarted from the seed: the step after a reset repeated the mask of the step before)."""

from __future__ import annotations

import os

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import SessionOptions
from onnxtrain.ir.builder import make_model
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module


def dropout_model() -> object:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 8)) * 0.3).astype(np.float32), "W1"),
             numpy_helper.from_array((rng.standard_normal((4, 32)) * 0.3).astype(np.float32), "W2"),
             numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "tm")]
    nodes = [helper.make_node("Gemm", ["x", "W1"], ["h"], transB=1),
             helper.make_node("Dropout", ["h", "ratio", "tm"], ["hd"], seed=7),
             helper.make_node("Gemm", ["hd", "W2"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(
        nodes, "m",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8]),
         helper.make_tensor_value_info("y", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return make_model(g, 17)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_calls_never_repeat_a_mask(tmp_path, backend: str) -> None:
    artifacts.generate_artifacts(dropout_model(), requires_grad=["W1", "W2"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(tmp_path))
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((16, 8)).astype(np.float32), rng.integers(0, 4, 16)
    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    losses = {}
    for every in (1, 2, 0):  # lazy_reset_grad before every call, every second call, never
        state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
        module = Module(os.path.join(tmp_path, "training_model.onnx"), state, session_options=so)
        seq = []
        for k in range(6):
            if every and k % every == 0:
                module.lazy_reset_grad()
            seq.append(float(np.asarray(module(x, y)).ravel()[0]))
        assert len(set(seq)) == len(seq), (every, seq)  # the weights do not change: a repeat is a mask
        losses[every] = seq
    if backend == "numpy":  # one generator for both forms: the same draws whatever the resets
        assert losses[1] == losses[2] == losses[0]
