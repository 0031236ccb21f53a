"""Pad's default constant for string and bool tensors, SplitToSequence by an empty split, and the node type
check of map-typed ai.onnx.ml inputs.

Oracles: the ONNX spec for a string Pad (its default constant is "0, empty string or False"; onnxruntime
has no string Pad and onnx.reference pads with the integer 0), onnxruntime 1.32 for bool Pads, for
SplitToSequence (onnx.reference agrees on an empty axis only) and for the map-typed ops DictVectorizer and
CastMap (engine/kernels/ml_maps.py; tests/engine/test_ml_maps.py has the rest of their cases), where its
Python API can feed their maps (float values only), else the spec's values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.interface import InvalidNodeError
from onnxtrain.engine.kernels.shape import pad
from onnxtrain.engine.registry import Attrs, parse_attributes
from onnxtrain.testing import run_engine

ort = pytest.importorskip("onnxruntime")

_ML = "ai.onnx.ml"
_S, _I64, _F, _B, _D = (TensorProto.STRING, TensorProto.INT64, TensorProto.FLOAT, TensorProto.BOOL,
                        TensorProto.DOUBLE)
_vi = helper.make_tensor_value_info


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[onnx.ValueInfoProto],
           opset: int = 21, ml: int | None = None) -> onnx.ModelProto:
    """A checked model of ``nodes`` at ONNX ``opset`` (and ai.onnx.ml ``ml``)."""
    opsets = [helper.make_opsetid("", opset)] + ([helper.make_opsetid(_ML, ml)] if ml else [])
    m = helper.make_model(helper.make_graph(nodes, "g", inputs, outputs), opset_imports=opsets, ir_version=10)
    onnx.checker.check_model(m, full_check=True)
    return m


def _ort(model: onnx.ModelProto, feeds: dict) -> list:
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


def _assert_strings(got: np.ndarray, want: np.ndarray) -> None:
    """Equal string tensors whose every element is a str (not a number that prints alike)."""
    assert got.shape == want.shape
    assert all(isinstance(v, str) for v in got.ravel()), [type(v).__name__ for v in got.ravel()]
    assert got.tolist() == want.tolist()


# ---- Pad: the default constant of string and bool tensors


def _pad_model(elem: int, opset: int, with_axes: bool) -> onnx.ModelProto:
    names = ["x", "pads", "", "axes"] if with_axes else ["x", "pads"]
    ins = [_vi("x", elem, [2, 2]), _vi("pads", _I64, [None])]
    if with_axes:
        ins.append(_vi("axes", _I64, [1]))
    return _model([helper.make_node("Pad", names, ["y"], mode="constant")], ins,
                  [_vi("y", elem, [None, None])], opset=opset)


@pytest.mark.parametrize("opset", [13, 18, 21])
def test_string_pad_without_constant_value_pads_empty_strings(opset: int) -> None:
    x = np.array([["a", "b"], ["c", "d"]], dtype=object)
    y = run_engine(_pad_model(_S, opset, False), {"x": x, "pads": np.array([1, 0, 0, 1], np.int64)})[0]
    # the spec: the padding is the empty string
    _assert_strings(y, np.array([["", "", ""], ["a", "b", ""], ["c", "d", ""]], dtype=object))
    if opset >= 18:  # the axes input
        feeds = {"x": x, "pads": np.array([2, 1], np.int64), "axes": np.array([-1], np.int64)}
        y = run_engine(_pad_model(_S, opset, True), feeds)[0]
        _assert_strings(y, np.array([["", "", "a", "b", ""], ["", "", "c", "d", ""]], dtype=object))


def test_string_pad_feeds_string_concat() -> None:
    """A StringConcat after the Pad gets strings: the same result as onnx.reference's StringConcat of the
    tensor padded as the spec says."""
    s = _S
    nodes = [helper.make_node("Pad", ["x", "pads"], ["y"]),
             helper.make_node("StringConcat", ["y", "y"], ["z"])]
    m = _model(nodes, [_vi("x", s, [2]), _vi("pads", _I64, [2])],
               [_vi("z", s, [None])])
    z = run_engine(m, {"x": np.array(["a", "b"], dtype=object), "pads": np.array([1, 1], np.int64)})[0]
    concat = _model([helper.make_node("StringConcat", ["y", "y"], ["z"])], [_vi("y", s, [4])],
                    [_vi("z", s, [None])])
    want = ReferenceEvaluator(concat).run(None, {"y": np.array(["", "a", "b", ""], dtype=object)})[0]
    _assert_strings(z, want)


def test_bool_pad_without_constant_value_pads_false() -> None:
    m = _pad_model(_B, 21, False)
    feeds = {"x": np.array([[True, False], [True, True]]), "pads": np.array([1, 1, 1, 1], np.int64)}
    got, want = run_engine(m, feeds)[0], _ort(m, feeds)[0]
    assert got.dtype == want.dtype == np.bool_
    np.testing.assert_array_equal(got, want)


def _attribute_pad(x: np.ndarray, pads: list[int]) -> np.ndarray:
    """Opset 2's Pad kernel on ``x``, with the attributes the engine parses for a node that gives no value
    (the schema fills in 0.0). Its schema allows floats only, so the engine refuses such a node at load:
    the kernel is called as the plan would call it."""
    node = helper.make_node("Pad", ["x"], ["y"], pads=pads)
    return pad([x], Attrs(parse_attributes(node, 2), op="Pad", opset=2))[0]


def test_attribute_pad_of_strings_and_bools_without_value() -> None:
    y = _attribute_pad(np.array(["a", "b"], dtype=object), [1, 2])
    _assert_strings(y, np.array(["", "a", "b", "", ""], dtype=object))
    y = _attribute_pad(np.array([True, True]), [1, 0])
    assert y.dtype == np.bool_ and y.tolist() == [False, True, True]


def test_attribute_pad_of_floats_matches_onnxruntime() -> None:
    """The float form the schema allows still pads with its value, or 0 when none is given."""
    f = _F
    x = np.array([[1.0, 2.0]], np.float32)
    for attrs in ({}, {"value": -1.5}):
        node = helper.make_node("Pad", ["x"], ["y"], pads=[0, 1, 1, 0], **attrs)
        m = _model([node], [_vi("x", f, [1, 2])], [_vi("y", f, [None, None])],
                   opset=2)
        m.ir_version = 3
        np.testing.assert_array_equal(run_engine(m, {"x": x})[0], _ort(m, {"x": x})[0])


# ---- SplitToSequence with an empty split tensor


def _split_model(keepdims: int | None, axis: int = 0, split_rank: int = 1) -> onnx.ModelProto:
    """SplitToSequence of a matrix x by a split input of rank ``split_rank``, and the sequence's length."""
    f = _F
    kw = {} if keepdims is None else {"keepdims": keepdims}
    nodes = [helper.make_node("SplitToSequence", ["x", "split"], ["q"], axis=axis, **kw),
             helper.make_node("SequenceLength", ["q"], ["n"])]
    ins = [_vi("x", f, [None, None]), _vi("split", _I64, [None] * split_rank)]
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(f, None))
    return _model(nodes, ins, [helper.make_value_info("q", seq), _vi("n", _I64, [])])


def _same_sequences(got: list, want: list) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert g.shape == w.shape
        np.testing.assert_array_equal(g, w)


@pytest.mark.parametrize("shape, split", [
    ((0, 3), []), ((0, 3), np.zeros((1, 0), np.int64)), ((0, 3), 1), ((0, 3), 4),
])
def test_split_of_an_empty_axis_gives_no_piece(shape: tuple[int, ...], split: object) -> None:
    """An empty axis split by an empty split tensor (lengths adding up to 0) or a scalar: no piece, as
    onnxruntime (and for the empty tensor, onnx.reference) gives."""
    m = _split_model(None, split_rank=np.ndim(split))
    feeds = {"x": np.zeros(shape, np.float32), "split": np.array(split, np.int64)}
    got, want = run_engine(m, feeds), _ort(m, feeds)
    assert int(got[1]) == int(want[1]) == 0
    _same_sequences(got[0], want[0])
    if np.ndim(split) == 1:
        assert int(ReferenceEvaluator(m).run(None, feeds)[1]) == 0


@pytest.mark.parametrize("keepdims", [None, 0, 1])
@pytest.mark.parametrize("axis", [0, 1, -1])
def test_empty_split_of_a_nonempty_axis_splits_into_ones(keepdims: int | None, axis: int) -> None:
    """The spec asks split's lengths to add up to the axis' length, which an empty split does not;
    onnxruntime 1.32 takes an empty split as none given (pieces of length 1, keepdims applying)."""
    m = _split_model(keepdims, axis)
    feeds = {"x": np.arange(6, dtype=np.float32).reshape(2, 3), "split": np.array([], np.int64)}
    got, want = run_engine(m, feeds), _ort(m, feeds)
    assert int(got[1]) == int(want[1]) == (2 if axis == 0 else 3)
    _same_sequences(got[0], want[0])


def test_split_sizes_that_do_not_add_up_are_still_refused() -> None:
    m = _split_model(None)
    feeds = {"x": np.zeros((3, 2), np.float32), "split": np.array([1, 1], np.int64)}
    with pytest.raises(Exception, match=r"split sizes \[1, 1\] do not add up to dimension 3 of axis 0"):
        run_engine(m, feeds)


# ---- map-typed inputs of ai.onnx.ml ops


def _map_input(key: int, value: int) -> onnx.ValueInfoProto:
    value_type = helper.make_tensor_type_proto(value, None)
    return helper.make_value_info("x", helper.make_map_type_proto(key, value_type))


def _dict_vectorizer(key: int, value: int, out: int, **vocab: list) -> onnx.ModelProto:
    node = helper.make_node("DictVectorizer", ["x"], ["y"], domain=_ML, **vocab)
    return _model([node], [_map_input(key, value)], [_vi("y", out, [1, 2])], ml=3)


@pytest.mark.parametrize("key, value, vocab, feed, want", [
    (_I64, _F, {"int64_vocabulary": [1, 2]}, {2: np.float32(3.0)}, np.array([[0.0, 3.0]], np.float32)),
    (_S, _D, {"string_vocabulary": ["a", "b"]}, {"b": 3.0}, np.array([[0.0, 3.0]])),
    (_I64, _S, {"int64_vocabulary": [1, 2]}, {2: "three"}, np.array([["", "three"]], dtype=object)),
])
def test_dict_vectorizer_runs_as_onnxruntime(key: int, value: int, vocab: dict, feed: dict,
                                            want: np.ndarray) -> None:
    """A map of float values as onnxruntime gives it; of double and string values (onnxruntime's Python
    API feeds maps of float values only), as the spec says: each vocabulary entry's value, or zero ("")."""
    m = _dict_vectorizer(key, value, value, **vocab)
    if value == _F:  # a valid model, which onnxruntime runs
        np.testing.assert_array_equal(_ort(m, {"x": {2: np.float32(3.0)}})[0], [[0.0, 3.0]])
        want = _ort(m, {"x": feed})[0]
    got = run_engine(m, {"x": feed})[0]
    assert got.dtype == want.dtype and got.shape == want.shape == (1, 2)
    assert got.tolist() == want.tolist()


def test_cast_map_runs_as_onnxruntime() -> None:
    node = helper.make_node("CastMap", ["x"], ["y"], domain=_ML, map_form="SPARSE", max_map=3)
    m = _model([node], [_map_input(_I64, _F)],
               [_vi("y", _F, [1, 3])], ml=3)
    want = _ort(m, {"x": {1: np.float32(2.0)}})[0]
    np.testing.assert_array_equal(want, [[0.0, 2.0, 0.0]])
    got = run_engine(m, {"x": {1: np.float32(2.0)}})[0]
    assert got.dtype == want.dtype == np.float32
    np.testing.assert_array_equal(got, want)


def test_zip_map_output_type_agrees_with_its_declaration() -> None:
    """ZipMap's schema gives its output as seq(map(int64, float)): the graph's declaration of the same type
    is no mismatch, and the engine's dicts equal onnxruntime's."""
    f = _F
    maps = helper.make_map_type_proto(_I64, helper.make_tensor_type_proto(f, None))
    seq = helper.make_sequence_type_proto(maps)
    node = helper.make_node("ZipMap", ["x"], ["y"], domain=_ML, classlabels_int64s=[7, 8])
    m = _model([node], [_vi("x", f, [1, 2])], [helper.make_value_info("y", seq)], ml=1)
    x = {"x": np.array([[0.25, 0.75]], np.float32)}
    assert _ort(m, x)[0] == run_engine(m, x)[0] == [{7: 0.25, 8: 0.75}]


def test_a_map_type_the_schema_does_not_allow_is_still_invalid() -> None:
    """CastMap takes maps of int64 keys only: a map of string keys is refused naming the input, the types
    spelled alike."""
    node = helper.make_node("CastMap", ["x"], ["y"], domain=_ML)
    g = helper.make_graph([node], "g", [_map_input(_S, _F)],
                          [_vi("y", _F, [1, 3])])
    opsets = [helper.make_opsetid("", 21), helper.make_opsetid(_ML, 3)]
    m = helper.make_model(g, opset_imports=opsets, ir_version=10)
    with pytest.raises(onnx.shape_inference.InferenceError, match="unsupported type"):  # as onnx's checker
        onnx.checker.check_model(m, full_check=True)
    with pytest.raises(InvalidNodeError) as e:
        run_engine(m, {})
    assert str(e.value) == ("node #0 (unnamed) (ai.onnx.ml.CastMap, opset 3): input 0 'x' is "
                            "map(string,tensor(float)), not allowed for T1 of CastMap-1 "
                            "(map(int64,tensor(string)), map(int64,tensor(float)))")


@pytest.mark.parametrize("keepdims", [0, 1])
@pytest.mark.parametrize("axis", [0, 1])
def test_gradient_through_a_constant_empty_split(keepdims: int, axis: int) -> None:
    """The pieces of an empty split are those of none given (squeezed with keepdims=0): their gradients are
    stacked back, as for no split (float64 central differences)."""
    from onnxtrain.testing import gradcheck

    d = TensorProto.DOUBLE
    nodes = [
        helper.make_node("SplitToSequence", ["x", "split"], ["q"], axis=axis, keepdims=keepdims),
        helper.make_node("SequenceAt", ["q", "one"], ["p"]),
        helper.make_node("Mul", ["p", "p"], ["p2"]),
        helper.make_node("ReduceSum", ["p2"], ["loss"], keepdims=0),
    ]
    inits = [helper.make_tensor("split", _I64, [0], []), helper.make_tensor("one", _I64, [], [1])]
    g = helper.make_graph(nodes, "g", [_vi("x", d, [2, 3])], [_vi("loss", d, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.arange(6, dtype=np.float64).reshape(2, 3) / 7
    grads = gradcheck(m, "loss", ["x"], {"x": x})
    want = np.zeros_like(x)
    (want.__setitem__((1,), 2 * x[1]) if axis == 0 else want.__setitem__((slice(None), 1), 2 * x[:, 1]))
    np.testing.assert_allclose(grads["x"], want, rtol=1e-12)
