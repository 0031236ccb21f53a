"""GradientGraphBuilder's ``options``: a SessionOptions' external-data folder is honoured for model bytes (its
own error recommended the entry, which it then ignored); arguments of the wrong type are TypeErrors, as
onnxruntime's binding raised them. Oracle for the values: d(sum(x·W))/dW = xᵀ·1, run on onnxruntime."""

from __future__ import annotations

import os

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import GradientGraphBuilder, SessionOptions


def _model():
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["L"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("L", TensorProto.FLOAT, [])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_model_bytes_with_external_data_read_from_the_options_folder(tmp_path, monkeypatch) -> None:
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save(_model(), str(folder / "m.onnx"), save_as_external_data=True, location="m.data",
              size_threshold=0)
    data = (folder / "m.onnx").read_bytes()
    monkeypatch.chdir(tmp_path)  # not the data's folder
    so = SessionOptions()
    so.add_session_config_entry("session.model_external_initializers_file_folder_path", str(folder))
    builder = GradientGraphBuilder(data, {"L"}, {"W"}, "L", so)
    builder.build()
    out = str(tmp_path / "grad.onnx")
    builder.save(out)
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    sess = ort.InferenceSession(out, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    np.testing.assert_allclose(got["W_grad"], np.repeat(x.sum(0)[:, None], 2, axis=1), rtol=1e-6)
    assert os.path.exists(out)


@pytest.mark.parametrize("options", ["bogus", {"use_memory_efficient_gradient": True}, 3])
def test_options_of_another_type_are_refused(options) -> None:
    with pytest.raises(TypeError, match="options must be a SessionOptions"):
        GradientGraphBuilder(_model().SerializeToString(), {"L"}, {"W"}, "L", options)


def test_a_loss_name_that_is_no_string_is_refused() -> None:
    with pytest.raises(TypeError, match="loss_node_arg_name must be a str, got NoneType"):
        GradientGraphBuilder(_model().SerializeToString(), {"L"}, {"W"}, None)
