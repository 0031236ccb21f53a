"""Built-in models made with onnx.helper: forward graph plus an in-graph loss, ready to train."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import make_model

OPSET = 17


def mlp(sizes: Sequence[int], seed: int = 0, loss: bool = True) -> onnx.ModelProto:
    """An MLP ``sizes[0] → … → sizes[-1]`` with ReLU; inputs ``x`` [N, sizes[0]] (and ``y`` int64 [N]).

    Outputs ``loss`` (softmax cross-entropy, mean) when ``loss`` is set, then ``logits``. Weights
    are He-initialised from ``seed`` and named ``fc<k>.weight`` / ``fc<k>.bias`` like torch's Linear.
    """
    if len(sizes) < 2:
        raise ValueError(f"mlp needs at least an input and an output size, got {list(sizes)}")
    rng = np.random.default_rng(seed)
    inits, nodes, h = [], [], "x"
    for k, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        w = (rng.standard_normal((b, a)) * np.sqrt(2.0 / a)).astype(np.float32)
        inits += [numpy_helper.from_array(w, f"fc{k}.weight"), numpy_helper.from_array(np.zeros(b, np.float32),
                                                                                        f"fc{k}.bias")]
        out = "logits" if k == len(sizes) - 2 else f"h{k}"
        nodes.append(helper.make_node("Gemm", [h, f"fc{k}.weight", f"fc{k}.bias"], [out], transB=1, name=f"fc{k}"))
        if out != "logits":
            nodes.append(helper.make_node("Relu", [out], [f"{out}_relu"], name=f"relu{k}"))
            h = f"{out}_relu"
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", sizes[0]])]
    outputs = [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", sizes[-1]])]
    if loss:
        nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"], name="loss"))
        inputs.append(helper.make_tensor_value_info("y", TensorProto.INT64, ["N"]))
        outputs.insert(0, helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    graph = helper.make_graph(nodes, "mlp", inputs, outputs, inits)
    model = make_model(graph, OPSET, producer_name="onnxtrain")
    onnx.checker.check_model(model, full_check=True)
    return model
