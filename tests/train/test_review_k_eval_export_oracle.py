"""Review K: ``onnxtrain eval`` and ``onnxtrain export`` of a short run of every shipped config, against a
float64 forward of the checkpoint's weights by ``onnx.reference`` (onnx's own evaluator, not onnxtrain's
engine): the config's model graph with its float weights, inputs, Casts and constants made float64,
BatchNormalization in inference mode on the checkpoint's running statistics. The eval loss (softmax
cross-entropy over the whole eval set, per token for the transformer) agrees to rtol 1e-5 and the accuracy
exactly, whatever the eval batch size (7 rows: the last batch partial); the exported model passes onnx's full
check and, run by onnxruntime 1.32 on 1, 3 and all eval rows, gives the oracle's logits (atol 1e-5)."""

from __future__ import annotations

import glob
import json
import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.cli import main
from onnxtrain.train import data as data_mod
from onnxtrain.train import load_config
from onnxtrain.train.model import build_model
from onnxtrain.train.session import feed_names
from onnxtrain.train.state import checkpoint_weights
from tests.train.conftest import config_path


def _float64(model: onnx.ModelProto, weights: dict[str, np.ndarray]) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    del g.value_info[:]
    for i, t in enumerate(g.initializer):
        a = np.asarray(weights.get(t.name, numpy_helper.to_array(t)))
        a = a.astype(np.float64) if a.dtype == np.float32 else a
        g.initializer[i].CopyFrom(numpy_helper.from_array(a, t.name))
    for v in [*g.input, *g.output]:
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = TensorProto.DOUBLE
    for n in g.node:
        for a in n.attribute:
            if a.name == "to" and a.i == TensorProto.FLOAT:
                a.i = TensorProto.DOUBLE
            if a.type == onnx.AttributeProto.TENSOR and a.t.data_type == TensorProto.FLOAT:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype(np.float64), a.t.name))
            if n.op_type == "BatchNormalization" and a.name == "training_mode":
                a.i = 0
            if n.op_type == "GridSample" and a.name == "mode" and a.s == b"bilinear":
                a.s = b"linear"  # (onnx.reference knows opset 20's name only)
        if n.op_type == "BatchNormalization":
            del n.output[1:]
    return m


def _oracle(cfg_path: str, ckpt: str) -> tuple[float, float, dict[str, np.ndarray], np.ndarray]:
    cfg = load_config(cfg_path, [])
    model = build_model(cfg)
    m = _float64(model, checkpoint_weights(load_checkpoint(ckpt)))
    data = feed_names(cfg, model, data_mod.load_data(cfg)).eval
    feeds = {k: v.astype(np.float64) if v.dtype == np.float32 else v for k, v in data.items()}
    logits, = ReferenceEvaluator(m).run([cfg.model.logits], feeds)
    assert logits.dtype == np.float64
    y = data[cfg.model.labels].astype(np.int64)
    z = logits - logits.max(axis=1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(axis=1, keepdims=True))
    nll = -np.take_along_axis(logp, np.expand_dims(y, 1), axis=1)
    return float(nll.mean()), float(np.mean(logits.argmax(axis=1) == y)), data, logits


@pytest.mark.parametrize("name", ["digits_mlp", "digits_cnn", "digits_stn", "tiny_transformer"])
def test_eval_and_export_of_a_short_run_agree_with_a_float64_forward(tmp_path, capsys, name) -> None:
    run = str(tmp_path / name)
    assert main(["train", config_path(name), "--set", "training.steps=3", "--set", "training.epochs=null",
                 "--set", "output.plot=false", "--output-dir", run, "-q"]) == 0
    own = os.path.join(run, "config.yaml")
    ckpt, = glob.glob(os.path.join(run, "checkpoints", "*.ckpt"))
    loss, acc, data, logits = _oracle(own, ckpt)
    for checkpoint in (run, ckpt):
        for batch in ([], ["--set", "training.eval_batch_size=7"]):
            capsys.readouterr()
            assert main(["eval", own, "--checkpoint", checkpoint, "--json", *batch]) == 0
            got = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
            np.testing.assert_allclose(got["eval_loss"], loss, rtol=1e-5)
            assert got["eval_accuracy"] == acc
    target = str(tmp_path / "model.onnx")
    assert main(["export", own, "--checkpoint", run, "-o", target]) == 0
    onnx.checker.check_model(onnx.load(target), full_check=True)
    sess = ort.InferenceSession(target, providers=["CPUExecutionProvider"])
    x = data[sess.get_inputs()[0].name]
    for rows in (1, 3, len(x)):
        got, = sess.run(None, {sess.get_inputs()[0].name: x[:rows]})
        np.testing.assert_allclose(got, logits[:rows], atol=1e-5, rtol=1e-5)
