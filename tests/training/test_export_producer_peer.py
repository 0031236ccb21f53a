"""Module.export_model_for_inferencing of a fixed-batch model, and the producer fields of the artifacts,
against onnxruntime-training 1.19.2 on the same model (a 4-8-3 MLP whose batch is fixed at 16, producer
"pytorch" 2.13.0, as a torch export without dynamic_axes writes it).

1.19.2 passes the user's model through: the training, eval and exported inference models keep its producer
name and version and its fixed batch of 16 (an exported model takes 16 rows only; a user who wants any batch
exports the torch model with dynamic_axes, or uses `onnxtrain export`, which frees the batch axis). It is the
producer of the optimizer model ("orttraining", no version). Ours must keep the same for the pass-through
models and name onnxtrain and its version where it is the producer (the optimizer model, the checkpoint's
companion graphs we build)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxtrain
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp

BATCH = 16
NAMES = ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx")

_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
base, folder = sys.argv[1], sys.argv[2]
WEIGHTS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
artifacts.generate_artifacts(onnx.load(base), requires_grad=WEIGHTS, loss=artifacts.LossType.CrossEntropyLoss,
                             optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
state = CheckpointState.load_checkpoint(folder + "/checkpoint")
m = Module(folder + "/training_model.onnx", state, folder + "/eval_model.onnx")
m.export_model_for_inferencing(folder + "/inference.onnx", ["output"])
print(json.dumps(0))
"""


def _fields(path: str) -> dict:
    m = onnx.load(path, load_external_data=False)
    dims = [[d.dim_value or d.dim_param for d in v.type.tensor_type.shape.dim] for v in m.graph.input[:1]]
    return {"producer": (m.producer_name, m.producer_version), "first_input": dims}


def _fixed_model(path: str) -> None:
    m = small_mlp()
    for v in [*m.graph.input, *m.graph.output]:
        v.type.tensor_type.shape.dim[0].dim_value = BATCH
    m.producer_name, m.producer_version = "pytorch", "2.13.0"
    onnx.save(m, path)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    python = ensure_ortt()
    tmp = tmp_path_factory.mktemp("export_producer")
    base = str(tmp / "fixed.onnx")
    _fixed_model(base)
    theirs, ours = str(tmp / "ortt"), str(tmp / "ours")
    os.makedirs(theirs)
    os.makedirs(ours)
    run_script(_ORT_SCRIPT, base, theirs, python=python)
    artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc1.weight", "fc1.bias", "fc2.weight",
                                                                 "fc2.bias"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=ours)
    state = CheckpointState.load_checkpoint(os.path.join(ours, "checkpoint"))
    module = Module(os.path.join(ours, "training_model.onnx"), state, os.path.join(ours, "eval_model.onnx"))
    module.export_model_for_inferencing(os.path.join(ours, "inference.onnx"), ["output"])
    return theirs, ours


@pytest.mark.parametrize("name", ["training_model.onnx", "eval_model.onnx", "inference.onnx"])
def test_pass_through_models_keep_the_input_producer_and_batch(folders, name):
    theirs, ours = folders
    want = _fields(os.path.join(theirs, name))
    assert want == {"producer": ("pytorch", "2.13.0"), "first_input": [[BATCH, 4]]}  # (1.19.2's, as read)
    assert _fields(os.path.join(ours, name)) == want


def test_exported_model_runs_at_its_batch_in_onnxruntime(folders):
    _, ours = folders
    path = os.path.join(ours, "inference.onnx")
    onnx.checker.check_model(onnx.load(path), full_check=True)
    x = np.random.default_rng(0).standard_normal((BATCH, 4)).astype(np.float32)
    want = onnxtrain.InferenceSession(path).run(None, {"input": x})[0]
    got = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


OURS = ("onnxtrain", onnxtrain.__version__)


def test_optimizer_model_names_onnxtrain_and_its_version(folders):
    theirs, ours = folders
    assert _fields(os.path.join(theirs, "optimizer_model.onnx"))["producer"] == ("orttraining", "")
    assert _fields(os.path.join(ours, "optimizer_model.onnx"))["producer"] == OURS


def _loss_model() -> onnx.ModelProto:
    m = small_mlp()
    m.graph.node.append(onnx.helper.make_node("SoftmaxCrossEntropyLoss", ["output", "labels"], ["loss"]))
    m.graph.input.append(onnx.helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["b"]))
    m.graph.output.insert(0, onnx.helper.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []))
    m.producer_name, m.producer_version = "pytorch", "2.13.0"
    return m


def test_gradient_graph_keeps_the_models_producer():
    """As onnxruntime-training 1.16.3's and 1.19.2's GradientGraphBuilder (review R2: checked in their venvs;
    tests/session/test_review_r2_dump_producer.py runs 1.16.3's)."""
    b = onnxtrain.GradientGraphBuilder(_loss_model().SerializeToString(), {"loss"}, {"fc1.weight"}, "loss")
    b.build()
    m = onnx.load_from_string(b.get_model())
    assert (m.producer_name, m.producer_version) == ("pytorch", "2.13.0")


def test_legacy_training_graph_dumps_keep_the_models_producer(tmp_path):
    """As onnxruntime-training 1.16.3's dumps (review R2, tests/session/test_review_r2_dump_producer.py)."""
    p = onnxtrain.TrainingParameters()
    p.weights_to_train = {"fc1.weight", "fc2.weight"}
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    p.model_with_training_graph_path = str(tmp_path / "training.onnx")
    p.model_with_gradient_graph_path = str(tmp_path / "gradient.onnx")
    onnxtrain.TrainingSession(_loss_model().SerializeToString(), p)
    for f in ("training.onnx", "gradient.onnx"):
        m = onnx.load(str(tmp_path / f))
        assert (m.producer_name, m.producer_version) == ("pytorch", "2.13.0"), f


def test_built_in_models_name_onnxtrain_and_its_version():
    from onnxtrain import zoo

    m = zoo.mlp([4, 8, 3])
    assert (m.producer_name, m.producer_version) == OURS


@pytest.mark.parametrize("producer", [("pytorch", "2.13.0"), ("", "")])
def test_optimized_model_file_keeps_the_producer_as_onnxruntime_does(producer, tmp_path):
    m = small_mlp()
    m.producer_name, m.producer_version = producer
    written = {}
    for name, mod in (("ort", ort), ("ours", onnxtrain)):
        so = mod.SessionOptions()
        so.optimized_model_filepath = str(tmp_path / f"{name}.onnx")
        so.graph_optimization_level = mod.GraphOptimizationLevel.ORT_ENABLE_BASIC
        mod.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])
        written[name] = _fields(so.optimized_model_filepath)["producer"]
    assert written["ours"] == written["ort"] == producer
