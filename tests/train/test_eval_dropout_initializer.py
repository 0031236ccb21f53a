"""onnxtrain eval of a checkpoint of a model whose Dropout takes its training_mode from an initializer (as
torch exports it): the inference-mode model no longer reads that initializer, which the checkpoint holds as
a frozen tensor; eval fed it anyway and failed ("unknown feed 'tm'"). Now eval scores the checkpoint to the
run's own last eval."""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main
from onnxtrain.data import load_digits


def test_eval_of_a_model_with_a_dropout_mode_initializer(tmp_path) -> None:
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((16, 64)) * 0.1).astype(np.float32), "W1"),
             numpy_helper.from_array(np.zeros(16, np.float32), "b1"),
             numpy_helper.from_array((rng.standard_normal((10, 16)) * 0.1).astype(np.float32), "W2"),
             numpy_helper.from_array(np.zeros(10, np.float32), "b2"),
             numpy_helper.from_array(np.array(0.2, np.float32), "ratio"),
             numpy_helper.from_array(np.array(True), "tm")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Dropout", ["r", "ratio", "tm"], ["d"]),
             helper.make_node("Gemm", ["d", "W2", "b2"], ["logits"], transB=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 64])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 10])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), str(tmp_path / "m.onnx"))
    train, test = load_digits()
    np.savez(tmp_path / "d.npz", x=train.x[:256], y=train.y[:256].astype(np.int64))
    (tmp_path / "cfg.yaml").write_text(
        "model: {path: m.onnx, add_loss: cross_entropy, logits: logits, labels: labels}\n"
        "data: {source: files, path: d.npz, feeds: {x: x, labels: y}, eval_fraction: 0.25}\n"
        "optimizer: {name: adam, lr: 1.0e-2}\ntraining: {steps: 6, batch_size: 32, eval_every: 6}\n")
    out = tmp_path / "out"
    assert main(["train", str(tmp_path / "cfg.yaml"), "-q", "--output-dir", str(out)]) == 0
    logged = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    want = [r["eval_loss"] for r in logged if "eval_loss" in r][-1]
    printed = io.StringIO()  # the --json line
    with contextlib.redirect_stdout(printed):
        assert main(["eval", str(tmp_path / "cfg.yaml"), "--checkpoint", str(out), "--json"]) == 0
    got = json.loads(printed.getvalue().strip().splitlines()[-1])
    assert got["eval_loss"] == want
