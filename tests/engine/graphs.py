"""Small float32 graphs for the engine's tests."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def model(nodes, inputs, outputs, inits=(), output_types=None) -> onnx.ModelProto:
    """An opset-17 model of ``nodes`` whose named inputs and outputs are float32 of any shape (outputs named
    in ``output_types``, name → element type, of that type)."""
    f = TensorProto.FLOAT
    kinds = output_types or {}
    g = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info(n, f, None) for n in inputs],
        [helper.make_tensor_value_info(n, kinds.get(n, f), None) for n in outputs],
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


def scan_over_pairs(body_nodes: list[onnx.NodeProto], elem: int = TensorProto.FLOAT, **attrs: Any
                    ) -> onnx.NodeProto:
    """A one-input Scan node ``s, ys = Scan(s0, xs)`` whose body maps a 2-element state ``s_in`` and step
    ``x_t`` to ``s_out`` and ``y_t`` (both of 2 elements, type ``elem``) with ``body_nodes``; ``attrs``
    are the node's other attributes (directions, axes, name)."""
    def vi(name: str) -> onnx.ValueInfoProto:
        return helper.make_tensor_value_info(name, elem, [2])

    body = helper.make_graph(body_nodes, "body", [vi("s_in"), vi("x_t")], [vi("s_out"), vi("y_t")])
    return helper.make_node("Scan", ["s0", "xs"], ["s", "ys"], num_scan_inputs=1, body=body, **attrs)
