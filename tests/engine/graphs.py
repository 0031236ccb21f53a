"""Small float32 graphs for the engine's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def model(nodes, inputs, outputs, inits=()) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` whose named inputs and outputs are float32 of any shape."""
    f = TensorProto.FLOAT
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, None) for n in inputs],
        [helper.make_tensor_value_info(n, f, None) for n in outputs],
        list(inits),
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def on_device_mlp(folder: Path) -> Callable[[], tuple[Any, Any, Any]]:
    """Writes the on-device training artifacts of x·W1 + b1 → ReLU → ·W2 (8 → 300 → 4, cross-entropy,
    AdamW) into ``folder``; returns a function opening them as (state, Module, Optimizer), with the given
    session options if any."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    rng = np.random.default_rng(5)
    inits = [
        numpy_helper.from_array((rng.standard_normal((8, 300)) * 0.3).astype(np.float32), "W1"),
        numpy_helper.from_array(np.zeros(300, np.float32), "b1"),
        numpy_helper.from_array((rng.standard_normal((300, 4)) * 0.3).astype(np.float32), "W2"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W1"], ["h"]),
        helper.make_node("Add", ["h", "b1"], ["hb"]),
        helper.make_node("Relu", ["hb"], ["hr"]),
        helper.make_node("MatMul", ["hr", "W2"], ["logits"]),
    ]
    f = TensorProto.FLOAT
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", f, ["N", 8])],
                          [helper.make_tensor_value_info("logits", f, ["N", 4])], inits)
    artifacts.generate_artifacts(
        helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]),
        requires_grad=["W1", "b1", "W2"],
        loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=artifacts.OptimType.AdamW,
        artifact_directory=str(folder),
    )

    def open_(session_options: Any = None) -> tuple[Any, Any, Any]:
        state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
        module = Module(str(folder / "training_model.onnx"), state, session_options=session_options)
        return state, module, Optimizer(str(folder / "optimizer_model.onnx"), module)

    return open_
