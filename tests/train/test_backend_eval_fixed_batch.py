"""`onnxtrain train` on a model declaring a fixed batch (a torch export without ``dynamic_axes``): eval runs
``training.eval_batch_size`` rows at once, which the numpy engine ran while the onnxruntime backend refused
them ("Got: 80 Expected: 16") after the whole run had trained, leaving no checkpoint and no model. Both
backends now give the same eval metrics."""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main


def _fixed_batch_mlp(path: str) -> None:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((32, 64)) * 0.2).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(64, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((64, 5)) * 0.2).astype(np.float32), "W2"),
             numpy_helper.from_array(np.zeros(5, np.float32), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h1"]),
             helper.make_node("Relu", ["h1"], ["h"]), helper.make_node("MatMul", ["h", "W2"], ["l0"]),
             helper.make_node("Add", ["l0", "b2"], ["logits"])]
    g = helper.make_graph(nodes, "net", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [16, 32])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, [16, 5])], inits,
                          value_info=[helper.make_tensor_value_info("h", TensorProto.FLOAT, [16, 64])])
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)


@pytest.fixture
def run_dir(tmp_path):
    _fixed_batch_mlp(str(tmp_path / "net.onnx"))
    r = np.random.default_rng(0)
    np.savez(tmp_path / "d.npz", x=r.standard_normal((400, 32)).astype(np.float32), y=r.integers(0, 5, 400))
    (tmp_path / "cfg.yaml").write_text(
        f"model: {{path: {tmp_path / 'net.onnx'}, add_loss: cross_entropy, labels: labels}}\n"
        f"data: {{source: files, path: {tmp_path / 'd.npz'}, feeds: {{x: x, labels: y}}, "
        "eval_fraction: 0.2}\n"
        "optimizer: {name: adam, lr: 1.0e-3}\n"
        "training: {batch_size: 16, steps: 8, eval_every: 8, seed: 3}\n")
    return tmp_path


def _last_eval(out: str) -> dict[str, float]:
    with open(os.path.join(out, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return next(r for r in reversed(rows) if "eval_loss" in r)


def test_fixed_batch_model_evaluates_alike_on_both_backends(run_dir) -> None:
    evals = {}
    for backend in ("numpy", "onnxruntime"):
        out = str(run_dir / f"out_{backend}")
        assert main(["train", str(run_dir / "cfg.yaml"), "-q", "--output-dir", out, "--set",
                     f"training.backend={backend}"]) == 0
        assert os.path.exists(os.path.join(out, "model.onnx"))
        evals[backend] = _last_eval(out)
    np.testing.assert_allclose(evals["onnxruntime"]["eval_loss"], evals["numpy"]["eval_loss"], rtol=1e-5)
    assert evals["onnxruntime"]["eval_accuracy"] == evals["numpy"]["eval_accuracy"]
