"""The ``ai.onnx.ml`` kernels (LabelEncoder 1/2/4, Binarizer, ArrayFeatureExtractor) against onnxruntime,
whose CPU provider runs the domain (the oracle), and onnx.reference where the two agree."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine import compile_model
from onnxtrain.engine.interface import EngineError

STR = np.array(["b", "zz", "a", "c", "a"], dtype=object)
NAN = np.float32("nan")

# (id, ml opset, attributes, input, oracles: onnxruntime and/or onnx.reference)
CASES: list[tuple[str, int, dict[str, Any], np.ndarray, str]] = [
    ("le2_int_to_float", 2, dict(keys_int64s=[1, 2, 3], values_floats=[0.5, 1.5, 2.5], default_float=-1.0),
     np.array([[3, 1], [7, 2]], np.int64), "both"),
    ("le2_int_to_float_default", 2, dict(keys_int64s=[4, 2], values_floats=[1.0, 2.0]),
     np.array([2, 5, 4], np.int64), "both"),
    ("le2_string_to_int", 2, dict(keys_strings=["a", "b"], values_int64s=[5, 6], default_int64=-7), STR,
     "both"),
    ("le2_string_to_string", 2, dict(keys_strings=["a", "c"], values_strings=["x", "y"], default_string="?"),
     STR, "both"),
    ("le2_float_to_string_nan_key", 2, dict(keys_floats=[0.5, float("nan"), -1.0],
                                            values_strings=["half", "nan", "minus"], default_string="none"),
     np.array([0.5, NAN, 2.0, -1.0], np.float32), "ort"),
    ("le2_float_to_int_nan_key", 2, dict(keys_floats=[float("nan"), 2.0], values_int64s=[9, 8]),
     np.array([NAN, 2.0, 3.0], np.float32), "ort"),
    ("le4_float_to_int_nan_key", 4, dict(keys_floats=[float("nan"), 2.0], values_int64s=[9, 8]),
     np.array([NAN, 2.0, 3.0], np.float32), "ort"),
    # the spec: the last of repeated keys wins (onnxruntime takes the first)
    ("le2_repeated_key_last_wins", 2, dict(keys_int64s=[1, 2, 1], values_int64s=[10, 20, 30]),
     np.array([1, 2, 3], np.int64), "reference"),
    ("le4_repeated_nan_key_last_wins", 4, dict(keys_floats=[float("nan"), 1.0, float("nan")],
                                               values_int64s=[10, 20, 30]),
     np.array([NAN, 1.0, 3.0], np.float32), "none"),
    ("le2_negative_zero_default", 2, dict(keys_int64s=[1], values_floats=[3.0]), np.array([0, 1], np.int64),
     "both"),
    ("le4_tensors", 4, dict(keys_tensor=numpy_helper.from_array(np.array([1, 5], np.int64), "k"),
                            values_tensor=numpy_helper.from_array(np.array([0.25, 4.0]), "v"),
                            default_tensor=numpy_helper.from_array(np.array([-2.0]), "d")),
     np.array([5, 0, 1], np.int64), "both"),
    ("le4_tensor_values_default_by_type", 4, dict(keys_int64s=[3], values_tensor=numpy_helper.from_array(
        np.array([7], np.int64), "v")), np.array([3, 4], np.int64), "ort"),
    ("le1_strings_to_ints", 1, dict(classes_strings=["a", "b", "c"], default_int64=-1), STR, "ort"),
    ("le1_ints_to_strings", 1, dict(classes_strings=["a", "b", "c"], default_string="none"),
     np.array([2, 0, 3, -1], np.int64), "ort"),
]


def _model(op: str, ml_opset: int, attrs: dict, inputs: list[np.ndarray]) -> onnx.ModelProto:
    """One ``ai.onnx.ml`` node on inputs x0, x1, ...; its output's type from ONNX's shape inference."""
    names = [f"x{i}" for i in range(len(inputs))]
    node = helper.make_node(op, names, ["y"], domain="ai.onnx.ml", name=f"{op}_0", **attrs)
    types = [TensorProto.STRING if v.dtype == object else helper.np_dtype_to_tensor_dtype(v.dtype)
             for v in inputs]
    g = helper.make_graph([node], op, [helper.make_tensor_value_info(n, t, v.shape)
                                       for n, t, v in zip(names, types, inputs)],
                          [helper.make_empty_tensor_value_info("y")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("ai.onnx.ml", ml_opset)]
    m = helper.make_model(g, opset_imports=opsets)
    m.ir_version = 9
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=True)
    m.graph.output[0].CopyFrom(inferred.graph.output[0])
    return m


def _run_all(model: onnx.ModelProto, inputs: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
    feeds = {f"x{i}": v for i, v in enumerate(inputs)}
    ours = compile_model(model).run(feeds)[0]
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = session.run(None, feeds)[0]
    return ours, theirs


def _same(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.shape == theirs.shape
    if theirs.dtype.kind in "OUS":
        assert ours.dtype == object and list(ours.flat) == [str(s) for s in theirs.flat]
    else:
        assert ours.dtype == theirs.dtype
        np.testing.assert_array_equal(ours, theirs)
        assert np.array_equal(np.signbit(ours), np.signbit(theirs))  # -0.0 defaults too


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_label_encoder_matches_onnxruntime(case) -> None:
    _, ml_opset, attrs, x, oracles = case
    model = _model("LabelEncoder", ml_opset, attrs, [x])
    ours, theirs = _run_all(model, [x])
    if oracles in ("both", "ort"):
        _same(ours, theirs)
    if oracles in ("both", "reference"):
        _same(ours, np.asarray(ReferenceEvaluator(model).run(None, {"x0": x})[0]))
    if oracles == "none":  # the spec's words: NaN keys match NaN inputs (v4), the last repeated key wins
        np.testing.assert_array_equal(ours, [30, 20, -1])


def test_binarizer_matches_onnxruntime() -> None:
    x = np.array([[-1.0, 0.5, 0.75], [0.61, 2.0, 0.6]], np.float32)
    ours, theirs = _run_all(_model("Binarizer", 1, dict(threshold=0.6), [x]), [x])
    np.testing.assert_array_equal(ours, theirs)
    assert ours.dtype == x.dtype


def test_binarizer_nan_and_float64_as_onnx_reference() -> None:
    """onnxruntime refuses a NaN input and has no float64 kernel: onnx.reference is the oracle there."""
    for x in (np.array([NAN, 0.7, -NAN], np.float32), np.array([0.1, 0.9, np.nan], np.float64)):
        model = _model("Binarizer", 1, dict(threshold=0.6), [x])
        ours = compile_model(model).run({"x0": x})[0]
        np.testing.assert_array_equal(ours, ReferenceEvaluator(model).run(None, {"x0": x})[0])
        assert ours.dtype == x.dtype and ours.tolist() == [0.0, 1.0, 0.0]


@pytest.mark.parametrize("x,indices", [
    (np.arange(12, dtype=np.float32).reshape(3, 4), np.array([2, 0, 2], np.int64)),
    (np.arange(24, dtype=np.int64).reshape(2, 3, 4), np.array([[3, 1]], np.int64)),
    (np.arange(5, dtype=np.float32), np.array([4, 1], np.int64)),
])
def test_array_feature_extractor_matches_onnxruntime(x, indices) -> None:
    model = _model("ArrayFeatureExtractor", 1, {}, [x, indices])
    ours, theirs = _run_all(model, [x, indices])
    np.testing.assert_array_equal(ours, theirs)
    assert ours.shape == theirs.shape
    np.testing.assert_array_equal(ours, ReferenceEvaluator(model).run(None, {"x0": x, "x1": indices})[0])


def test_array_feature_extractor_index_out_of_range_names_the_node() -> None:
    x, indices = np.ones((2, 3), np.float32), np.array([3], np.int64)
    plan = compile_model(_model("ArrayFeatureExtractor", 1, {}, [x, indices]))
    with pytest.raises(EngineError, match="ArrayFeatureExtractor_0.*index 3 is out of range"):
        plan.run({"x0": x, "x1": indices})


@pytest.mark.parametrize("module", ["ai_onnx_ml.label_encoder", "ai_onnx_ml.binarizer",
                                    "ai_onnx_ml.array_feature_extractor"])
def test_onnx_node_conformance_cases(module) -> None:
    """ONNX's own node cases of these ops (six in onnx 1.23), run as the conformance suite runs its cases."""
    from onnxtrain.conformance import module_cases, run_case

    cases = module_cases(module)
    assert cases
    for _, case in cases:
        run_case(case)


def test_every_ml_op_version_of_onnx_has_a_kernel() -> None:
    """Each operator version the installed onnx defines in ``ai.onnx.ml`` runs (none is refused for want of a
    kernel); the per-op tests check their values."""
    from onnxtrain.engine.registry import has_kernel

    versions = {(s.name, s.since_version) for s in onnx.defs.get_all_schemas_with_history()
                if s.domain == "ai.onnx.ml"}
    assert len(versions) >= 24
    assert sorted(f"{op}-{v}" for op, v in versions if not has_kernel(op, v, "ai.onnx.ml")) == []
