"""The small torch MLP (4 → 8 → 3, modules fc1, relu, fc2) that on-device tests export."""

from __future__ import annotations

import os

import onnx
import pytest

torch = pytest.importorskip("torch")


def export_mlp(folder: str | os.PathLike) -> tuple[str, onnx.ModelProto, torch.nn.Module]:
    """(path, model, net): the seeded MLP exported at opset 17, dynamic batch, to ``folder``/mlp.onnx."""
    torch.manual_seed(0)
    net = torch.nn.Sequential()
    net.add_module("fc1", torch.nn.Linear(4, 8))
    net.add_module("relu", torch.nn.ReLU())
    net.add_module("fc2", torch.nn.Linear(8, 3))
    path = os.path.join(folder, "mlp.onnx")
    torch.onnx.export(net, torch.randn(2, 4), path, input_names=["input"], output_names=["output"],
                      dynamic_axes={"input": {0: "batch"}}, dynamo=False, opset_version=17)
    return path, onnx.load(path), net
