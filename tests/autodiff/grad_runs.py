"""The gradient graph of a test model, checked and run by both engines (onnxtrain's and onnxruntime 1.32)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model


def gradients_by_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray],
                      wrt: list[str]) -> tuple[onnx.ModelProto, list[dict[str, np.ndarray]]]:
    """The gradient model of ``loss`` w.r.t. ``wrt`` (it passes the full check), and its outputs by name as
    onnxtrain's engine and onnxruntime compute them."""
    grad = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(grad, full_check=True)
    names = [o.name for o in grad.graph.output]
    so = ort.SessionOptions()
    so.log_severity_level = 4
    theirs = ort.InferenceSession(grad.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
        None, feeds)
    ours = compile_model(grad).run(dict(feeds))
    return grad, [dict(zip(names, ours)), dict(zip(names, theirs))]
