"""Models past protobuf's 2 GiB, with the threshold lowered so that small models take the same paths: every
writer puts the tensors in ``<file>.data`` (GradientGraphBuilder.save, ``onnxtrain gradient-graph``,
``onnxtrain train``'s and ``export``'s model, generate_artifacts), onnx.checker checks a skeleton, and the
onnxruntime backend hands onnxruntime the tensors in memory. Each of them raised protobuf's EncodeError
("Failed to serialize proto") on a real 2.25 GiB model. Oracles: onnxruntime on the written files, and the
same calls on the model below the threshold."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.cli import main
from onnxtrain.errors import Fail
from onnxtrain.ir import large
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.train.conftest import config_path

X = np.random.default_rng(0).standard_normal((5, 8)).astype(np.float32)


def _mlp(logits: bool = True) -> onnx.ModelProto:
    rng = np.random.default_rng(1)
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "W2"], ["logits"]),
         helper.make_node("ReduceSumSquare", ["logits"], ["loss"], keepdims=0)],
        "mlp", [vi("x", TensorProto.FLOAT, ["N", 8])],
        [vi("logits", TensorProto.FLOAT, ["N", 4])] * logits + [vi("loss", TensorProto.FLOAT, [])],
        [numpy_helper.from_array(rng.standard_normal((8, 64)).astype(np.float32), "W1"),
         numpy_helper.from_array(rng.standard_normal((64, 4)).astype(np.float32), "W2")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.fixture
def small_limit(monkeypatch):
    """Every model with an initializer counts as past the limit; tensors of 1 KiB or more leave the proto."""
    monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 0)
    monkeypatch.setattr(large, "MOVED_TENSOR_BYTES", 1024)


def _ort(path: str, feeds: dict, names: list[str] | None = None) -> list[np.ndarray]:
    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).run(names, feeds)


def test_gradient_graph_builder_saves_with_external_data(tmp_path, small_limit) -> None:
    b = onnxtrain.GradientGraphBuilder(_mlp().SerializeToString(), {"loss"}, {"W1", "W2"}, "loss")
    b.build()
    with pytest.raises(Fail, match="save"):
        b.get_model()
    path = str(tmp_path / "grad.onnx")
    b.save(path)
    assert sorted(os.listdir(tmp_path)) == ["grad.onnx", "grad.onnx.data"]
    onnx.checker.check_model(path, full_check=True)
    got = _ort(path, {"x": X}, ["W1_grad", "W2_grad"])
    large.LARGE_MODEL_BYTES = 2**40  # (monkeypatch restores it) below the limit: the model whole
    want = onnxruntime.InferenceSession(b.get_model(), providers=["CPUExecutionProvider"]).run(
        ["W1_grad", "W2_grad"], {"x": X})
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    b.save(path)  # the model whole again: the earlier data file goes
    assert os.listdir(tmp_path) == ["grad.onnx"]


def test_cli_gradient_graph_writes_external_data(tmp_path, small_limit) -> None:
    onnx.save(_mlp(), str(tmp_path / "m.onnx"))
    out = str(tmp_path / "g.onnx")
    assert main(["gradient-graph", str(tmp_path / "m.onnx"), "--loss", "loss", "--wrt", "W1", "-o", out]) == 0
    assert os.path.exists(out + ".data")
    onnx.checker.check_model(out, full_check=True)
    assert _ort(out, {"x": X}, ["W1_grad"])[0].shape == (8, 64)


def test_check_model_full_checks_the_skeleton(small_limit) -> None:
    m = _mlp()
    large.check_model_full(m)
    m.graph.node[1].attribute.append(helper.make_attribute("alpha", 0.5))  # Relu has no alpha
    with pytest.raises(onnx.checker.ValidationError, match="alpha"):
        large.check_model_full(m)


def _train(folder: str) -> list[float]:
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    files = [os.path.join(folder, f) for f in ("training_model.onnx", "eval_model.onnx")]
    module = Module(files[0], state, files[1])
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    losses = []
    for _ in range(3):
        losses.append(float(module(X)))
        opt.step()
        module.lazy_reset_grad()
    return losses


def test_generate_artifacts_writes_external_data_and_trains_alike(tmp_path, monkeypatch) -> None:
    kw = {"requires_grad": ["W1", "W2"], "loss": None, "optimizer": artifacts.OptimType.AdamW}
    (tmp_path / "whole").mkdir()
    artifacts.generate_artifacts(_mlp(False), artifact_directory=str(tmp_path / "whole"), **kw)
    monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 0)
    (tmp_path / "split").mkdir()
    artifacts.generate_artifacts(_mlp(False), artifact_directory=str(tmp_path / "split"), frozen_params=[],
                                 **{**kw, "requires_grad": ["W2"]})  # W1 frozen: a constant of the models
    (tmp_path / "split2").mkdir()
    artifacts.generate_artifacts(_mlp(False), artifact_directory=str(tmp_path / "split2"), **kw)
    names = sorted(os.listdir(tmp_path / "split"))
    assert {"training_model.onnx.data", "eval_model.onnx.data"} <= set(names), names
    for f in ("training_model.onnx", "eval_model.onnx"):
        onnx.checker.check_model(str(tmp_path / "split" / f), full_check=True)
    monkeypatch.undo()
    np.testing.assert_allclose(_train(str(tmp_path / "split2")), _train(str(tmp_path / "whole")), rtol=1e-6)


def test_onnxruntime_backend_runs_a_large_model_from_memory(tmp_path, small_limit, monkeypatch) -> None:
    path = str(tmp_path / "m.onnx")
    onnx.save(_mlp(), path)
    handed: list[int] = []
    make = onnxruntime.InferenceSession

    def recording(model, *args, **kw):  # the bytes onnxruntime is handed: the weights stay out of them
        handed.append(len(model))
        return make(model, *args, **kw)

    monkeypatch.setattr(onnxruntime, "InferenceSession", recording)
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    got = onnxtrain.InferenceSession(path, so).run(["logits"], {"x": X})[0]
    assert handed and max(handed) < 8 * 64 * 4
    monkeypatch.undo()
    np.testing.assert_allclose(got, _ort(path, {"x": X}, ["logits"])[0], rtol=1e-6)


def test_the_cli_trains_and_exports_with_external_data(tmp_path, small_limit) -> None:
    short = ["--set", "training.steps=2", "--set", "training.eval_every=1000", "-q"]
    out = tmp_path / "run"
    assert main(["train", config_path("digits_mlp"), *short, "--output-dir", str(out)]) == 0
    onnx_files = sorted(f for f in os.listdir(out) if ".onnx" in f)
    assert any(f.endswith(".onnx.data") for f in onnx_files), onnx_files
    exported = str(tmp_path / "exported.onnx")
    assert main(["export", config_path("digits_mlp"), "--checkpoint", str(out), "-o", exported,
                 "--set", f"output.dir={out}"]) == 0
    assert os.path.exists(exported + ".data")
    onnx.checker.check_model(exported, full_check=True)
    x = np.zeros((2, 64), np.float32)
    np.testing.assert_allclose(_ort(exported, {_ort_input(exported): x})[0],
                               _ort(str(out / next(f for f in onnx_files if f.endswith(".onnx"))),
                                    {_ort_input(exported): x})[0], rtol=1e-6)


def _ort_input(path: str) -> str:
    return onnxruntime.InferenceSession(path, providers=["CPUExecutionProvider"]).get_inputs()[0].name
