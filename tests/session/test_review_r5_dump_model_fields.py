"""Review R5 of 11b96cdb: onnxruntime-training 1.16.3's legacy TrainingSession keeps more of the user's model
than its producer in every dump (model_with_training_graph_path, model_with_gradient_graph_path,
model_after_graph_transforms_path, optimized_model_filepath) and in its GradientGraphBuilder's model: the
model's doc_string, domain, model_version, metadata_props and graph name (checked in its venv). onnxtrain
kept them in the transformed dump only; the training, gradient and optimized dumps and the
GradientGraphBuilder's model dropped them (the training and optimized dumps named their graph
training_graph). Not compared: the opset imports (1.16.3 lists every domain it registers)."""

from __future__ import annotations

import json
import os
import warnings

import onnx

import onnxtrain
from tests.ortt import ensure_ort_legacy, run_script
from tests.session.test_review_r2_dump_producer import _SCRIPT, DUMPS, _make
from tests.training.test_review_r1_session_config_entries import legacy_peer_model

_FIELDS = ("[m.producer_name, m.producer_version, m.doc_string, m.domain, m.model_version, "
           "[[p.key, p.value] for p in m.metadata_props], m.graph.name]")
# (the R2 test's script, each model's fields widened to the ones above)
_WIDE = (_SCRIPT.replace("[m.producer_name, m.producer_version]", _FIELDS)
         .replace("[gm.producer_name, gm.producer_version]", _FIELDS.replace("m.", "gm.")))


def _fields(m: onnx.ModelProto) -> list:
    return eval(_FIELDS, {"m": m})  # noqa: S307 - the same expression as the venv's script


def _model() -> onnx.ModelProto:
    m = legacy_peer_model(producer_name="pytorch", producer_version="2.13.0")
    m.doc_string, m.domain, m.model_version = "a described model", "org.example", 7
    onnx.helper.set_model_props(m, {"author": "R5", "licence": "MIT"})
    return m


def test_dumps_and_the_builders_model_keep_the_models_fields_as_1_16_3(tmp_path) -> None:
    assert _WIDE.count(_FIELDS) == 1 and _WIDE.count(_FIELDS.replace("m.", "gm.")) == 1
    path = str(tmp_path / "base.onnx")
    onnx.save(_model(), path)
    theirs, ours = tmp_path / "theirs", tmp_path / "ours"
    theirs.mkdir()
    ours.mkdir()
    want = run_script(_WIDE, path, str(theirs), json.dumps(DUMPS), python=ensure_ort_legacy())
    base = _fields(_model())
    assert all(w == base for w in want.values()), (want, base)  # (1.16.3 keeps every field)
    b = onnxtrain.GradientGraphBuilder(_model().SerializeToString(), {"loss"}, {"W"}, "loss")
    b.build()
    got = {"gradient_graph_builder": _fields(onnx.load_from_string(b.get_model()))}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        _make(onnxtrain, path, str(ours), DUMPS)
    for kind in DUMPS:
        got[kind] = _fields(onnx.load(os.path.join(ours, kind + ".onnx"), load_external_data=False))
    assert got == want


def test_a_dump_is_put_back_byte_for_byte() -> None:
    """The dump may be the session's own graph: after the save it serializes as before (fields that were
    unset stay unset, not set to their defaults), with or without a graph name."""
    from onnxtrain.session import described_as

    for name in ("training_graph", None):
        graph = onnx.helper.make_graph([], name or "", [], [])
        dump = onnx.helper.make_model(graph, producer_name="onnxtrain", producer_version="0.1.0")
        if name is None:
            dump.graph.ClearField("name")
        onnx.helper.set_model_props(dump, {"onnxtrain.same_size_dims": "{}", "shared": "the dump's"})
        model = _model()
        onnx.helper.set_model_props(model, {"shared": "the model's", "onnxtrain.stale": "1", "author": "R5"})
        before = dump.SerializeToString()
        with described_as(dump, model):
            assert _fields(dump)[:5] == _fields(model)[:5] and dump.graph.name == model.graph.name
            assert {p.key: p.value for p in dump.metadata_props} == {
                "shared": "the dump's", "author": "R5", "onnxtrain.same_size_dims": "{}"}
        assert dump.SerializeToString() == before
