"""Slice outputs keep their input's dims on the axes they do not slice (onnxtrain/ir/slices.py), so that a
sliced causal mask leaves the masked scores' batch dim known and the autodiff sums nothing at run time."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import symbolic_shape, value_types
from onnxtrain.testing import gradcheck, to_float64

T = 6


def masked_scores(opset: int = 17, axes: str = "unsqueezed", chained: bool = True,
                  seq: int | str = T) -> onnx.ModelProto:
    """scores [B, 2, seq, seq] masked by a (1, 1, 8, 8) causal buffer cut to the scores' length (read from
    their shape at run time), as exporters write it; loss = ReduceSum(Softmax(masked) · w)."""
    nodes = [
        helper.make_node("Shape", ["s"], ["shape"]),
        helper.make_node("Gather", ["shape", "two"], ["t"], axis=0),
        helper.make_node("Unsqueeze", ["t", "zero1"], ["end"]),
    ]
    inits = [
        numpy_helper.from_array(np.tril(np.ones((1, 1, 8, 8), np.bool_)), "buffer"),
        numpy_helper.from_array(np.array(2, np.int64), "two"),
        numpy_helper.from_array(np.array([0], np.int64), "zero1"),
        numpy_helper.from_array(np.array([0], np.int64), "start"),
        numpy_helper.from_array(np.array(-1e9, np.float32), "fill"),
    ]
    if axes == "unsqueezed":  # axes made from constants by Unsqueeze, as torch's exporter writes them
        for k in (2, 3):
            nodes += [helper.make_node("Constant", [], [f"a{k}"],
                                       value=numpy_helper.from_array(np.array(k, np.int64))),
                      helper.make_node("Unsqueeze", [f"a{k}", "zero1"], [f"ax{k}"])]
        first, second = ["ax2"], ["ax3"]
    elif axes == "runtime":  # axes that depend on the input: left unknown
        nodes += [helper.make_node("Unsqueeze", ["t", "zero1"], ["tt"]),
                  helper.make_node("Sub", ["tt", "tt"], ["z"]),
                  helper.make_node("Add", ["z", "two1"], ["ax2"])]
        inits.append(numpy_helper.from_array(np.array([2], np.int64), "two1"))
        first, second = ["ax2"], ["ax2"]
        chained = False
    else:  # no axes: starts of length 4 slice every axis
        inits += [numpy_helper.from_array(np.zeros(4, np.int64), "start4")]
        first = []
    if axes == "none":
        nodes += [helper.make_node("Concat", ["one3", "end"], ["end4"], axis=0),
                  helper.make_node("Slice", ["buffer", "start4", "end4"], ["mask"])]
        inits.append(numpy_helper.from_array(np.array([1, 1, 8], np.int64), "one3"))
    elif chained:
        nodes += [helper.make_node("Slice", ["buffer", "start", "end", *first], ["half"]),
                  helper.make_node("Slice", ["half", "start", "end", *second], ["mask"])]
    else:
        nodes += [helper.make_node("Slice", ["buffer", "start", "end", *first], ["mask"])]
    nodes += [helper.make_node("Where", ["mask", "s", "fill"], ["masked"]),
              helper.make_node("Softmax", ["masked"], ["p"], axis=-1),
              helper.make_node("Mul", ["p", "w"], ["pw"]),
              helper.make_node("ReduceSum", ["pw"], ["loss"], keepdims=0)]
    inputs = [helper.make_tensor_value_info("s", TensorProto.FLOAT, ["B", 2, seq, seq]),
              helper.make_tensor_value_info("w", TensorProto.FLOAT, [2, seq, seq])]
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    g = helper.make_graph(nodes, "masked", inputs, [loss], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def test_unsliced_axes_keep_their_dims_through_two_slices() -> None:
    """A length known only at run time: the unsliced axes keep their dims, so the masked scores keep their
    batch dim (not their length: ONNX's broadcast of an unknown dim with "T" is unknown)."""
    types = value_types(masked_scores(seq="T"))
    assert symbolic_shape(types, "half")[:2] == [1, 1] and symbolic_shape(types, "half")[3] == 8
    assert symbolic_shape(types, "mask")[:2] == [1, 1]
    assert symbolic_shape(types, "masked")[:2] == ["B", 2]


def test_sliced_axes_cut_to_a_known_length_have_it() -> None:
    """The length read from a static dim of the scores' shape: the slices' every dim is known."""
    types = value_types(masked_scores())
    assert symbolic_shape(types, "half") == [1, 1, T, 8]
    assert symbolic_shape(types, "mask") == [1, 1, T, T]
    assert symbolic_shape(types, "masked") == ["B", 2, T, T]


def test_slices_without_axes_or_with_runtime_axes() -> None:
    """No axes input: the starts' length names the sliced axes (here all four, their bounds read from
    constants and the scores' shape); axes computed from the input: nothing is assumed."""
    assert symbolic_shape(value_types(masked_scores(axes="none")), "mask") == [1, 1, 8, T]
    model = masked_scores(axes="runtime", seq="T")  # axes computed from a dim known only at run time
    plain = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    want = {v.name: v.type for v in plain.graph.value_info}
    assert symbolic_shape(value_types(model), "mask") == symbolic_shape(want, "mask")


@pytest.mark.parametrize("opset,seq", [(13, T), (17, T), (17, "T")])
def test_masked_scores_gradient_has_no_runtime_broadcast_and_is_right(opset, seq) -> None:
    model = masked_scores(opset, seq=seq)
    g = build_gradient_model(model, "loss", ["s", "w"], outputs=["loss"])
    onnx.checker.check_model(g, full_check=True)
    if isinstance(seq, int):  # a run-time length still sums the scores' gradient over run-time axes
        assert "NonZero" not in {n.op_type for n in g.graph.node}
    rng = np.random.default_rng(0)
    feeds = {"s": rng.standard_normal((3, 2, T, T)), "w": rng.standard_normal((2, T, T))}
    gradcheck(to_float64(model), "loss", ["s", "w"], feeds, rtol=1e-6, atol=1e-9)


def test_a_refined_round_that_fails_keeps_the_first_rounds_types(monkeypatch) -> None:
    model = masked_scores()
    real = onnx.shape_inference.infer_shapes
    calls = []

    def failing_after_the_first(m, **kw):
        calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("inference failed")
        return real(m, **kw)

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", failing_after_the_first)
    types = value_types(model)
    # the declared output's check, the first round, then the refined one: strict, then lenient inference
    assert len(calls) == 4
    plain = real(model, strict_mode=False, data_prop=True)
    assert symbolic_shape(types, "masked") == symbolic_shape({v.name: v.type for v in plain.graph.value_info},
                                                             "masked")
    assert symbolic_shape(types, "p") is not None  # not the bare model's (no value infos at all)


def test_refined_value_infos_name_no_made_up_dims() -> None:
    """The dims still unknown go unnamed into the next round, where inference may reuse its made-up names
    ("unk__3") for other dims: equal names would make the autodiff take different dims as equal."""
    from onnxtrain.ir.builder import _inferred_types, _skeleton
    from onnxtrain.ir.shape_values import ShapeValues
    from onnxtrain.ir.slices import refined_slices

    model = masked_scores(seq="T")
    types = _inferred_types(model, _skeleton(model), model)
    refined = refined_slices(model, types, 17, ShapeValues(model, types, 17))
    assert [v.name for v in refined] == ["half"]
    dims = refined[0].type.tensor_type.shape.dim
    assert [d.dim_value for d in dims[:2]] == [1, 1] and dims[3].dim_value == 8
    assert not dims[2].HasField("dim_value") and not dims[2].dim_param
