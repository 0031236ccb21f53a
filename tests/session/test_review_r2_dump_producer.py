"""Review R2: the producer fields of the legacy TrainingSession's model dumps (model_with_training_graph_path,
model_with_gradient_graph_path, model_after_graph_transforms_path, SessionOptions.optimized_model_filepath).

Oracle: onnxruntime-training 1.16.3's TrainingSession (its own venv, tests/ortt.py) on the same model, whose
producer is "pytorch" 2.13.0: every dump keeps the model's producer name and version, and so does its
GradientGraphBuilder's model (1.19.2's too, checked by hand). onnxtrain named itself (onnxtrain 0.1.0,
f56f0beb; an empty version before) in all but the transformed model's dump and in the GradientGraphBuilder's
model, though it keeps a user's producer elsewhere as onnxruntime does (export, artifacts,
optimized_model_filepath of an InferenceSession)."""

from __future__ import annotations

import inspect
import json
import os
import warnings

import onnx

import onnxtrain
from tests.ortt import ensure_ort_legacy, run_script
from tests.training.test_review_r1_session_config_entries import legacy_peer_model

DUMPS = {"training": "model_with_training_graph_path", "gradient": "model_with_gradient_graph_path",
         "transformed": "model_after_graph_transforms_path", "optimized": None}


def _model() -> onnx.ModelProto:
    return legacy_peer_model(producer_name="pytorch", producer_version="2.13.0")


def _make(lib, path: str, folder: str, dumps: dict) -> object:
    """A TrainingSession of ``lib`` (onnxruntime or onnxtrain) on ``path``, each dump asked in ``folder``."""
    p = lib.TrainingParameters()
    p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
    p.optimizer_attributes_map = {"W": {}}
    p.optimizer_int_attributes_map = {"W": {}}
    so = lib.SessionOptions()
    for kind, option in dumps.items():
        where = folder + "/" + kind + ".onnx"
        if option:
            setattr(p, option, where)
        else:
            so.optimized_model_filepath = where
    return lib.TrainingSession(path, p, so)


_SCRIPT = "import json, sys, onnx, onnxruntime as ort\n" + inspect.getsource(_make) + r"""
path, folder, dumps = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
_make(ort, path, folder, dumps)
from onnxruntime.capi._pybind_state import GradientGraphBuilder
b = GradientGraphBuilder(open(path, "rb").read(), {"loss"}, {"W"}, "loss")
b.build()
gm = onnx.load_from_string(b.get_model())
fields = {"gradient_graph_builder": [gm.producer_name, gm.producer_version]}
for kind in dumps:
    m = onnx.load(folder + "/" + kind + ".onnx", load_external_data=False)
    fields[kind] = [m.producer_name, m.producer_version]
print(json.dumps(fields))
"""


def _fields(folder: str) -> dict[str, list[str]]:
    out = {}
    for kind in DUMPS:
        m = onnx.load(os.path.join(folder, kind + ".onnx"), load_external_data=False)
        out[kind] = [m.producer_name, m.producer_version]
    return out


def test_dumps_keep_the_models_producer_as_1_16_3(tmp_path) -> None:
    path = str(tmp_path / "base.onnx")
    onnx.save(_model(), path)
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    want = run_script(_SCRIPT, path, str(theirs), json.dumps(DUMPS), python=ensure_ort_legacy())
    assert want == {kind: ["pytorch", "2.13.0"] for kind in [*DUMPS, "gradient_graph_builder"]}, want
    b = onnxtrain.GradientGraphBuilder(_model().SerializeToString(), {"loss"}, {"W"}, "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    assert [gm.producer_name, gm.producer_version] == want.pop("gradient_graph_builder")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _make(onnxtrain, path, str(ours), DUMPS)
    assert _fields(str(ours)) == want
