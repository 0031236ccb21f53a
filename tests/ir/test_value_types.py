"""``value_types``: the types ONNX shape inference gives, without handing it the values of large weights."""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir import builder
from onnxtrain.ir.builder import value_types


def _model() -> onnx.ModelProto:
    """x [B, 64] → MatMul with a 64×256 weight (large) → + bias (small) → Reshape to a shape computed from a
    small int64 initializer → ReduceSum: a shape that data propagation must follow."""
    rng = np.random.default_rng(0)
    inits = [
        numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "W"),
        numpy_helper.from_array(np.zeros(256, np.float32), "b"),
        numpy_helper.from_array(np.array([-1, 16, 16], np.int64), "shape"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["h"]),
        helper.make_node("Add", ["h", "b"], ["a"]),
        helper.make_node("Reshape", ["a", "shape"], ["r"]),
        helper.make_node("ReduceSum", ["r"], ["y"], keepdims=0),
    ]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["B", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_types_equal_plain_shape_inference_and_weights_stay_out(monkeypatch) -> None:
    model = _model()
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False, data_prop=True)
    want = {v.name: v.type for v in (*inferred.graph.value_info, *inferred.graph.output)}
    seen = []
    real = onnx.shape_inference.infer_shapes
    monkeypatch.setattr(onnx.shape_inference, "infer_shapes",
                        lambda m, **kw: (seen.append(m), real(m, **kw))[1])
    got = value_types(model)
    for name, tp in want.items():
        if name != "r":
            assert got[name] == tp, name
    # the int64 shape was followed, and its -1 read as the batch (plain inference made up a name for it)
    assert [d.dim_param or d.dim_value for d in got["r"].tensor_type.shape.dim] == ["B", 16, 16]
    w = got["W"].tensor_type
    assert w.elem_type == TensorProto.FLOAT and [d.dim_value for d in w.shape.dim] == [64, 256]
    assert len(seen) == 2  # a second round for the Reshape's dims
    for passed in seen:
        assert [t.name for t in passed.graph.initializer] == ["b", "shape"]  # W (16 K values): an input
        assert passed.ByteSize() < model.ByteSize() // 10
    assert len(model.graph.initializer) == 3 and len(model.graph.input) == 1  # the caller's: untouched
    monkeypatch.setattr(builder, "_DATA_KEPT", 1 << 20)  # every initializer small: the model goes as is
    seen.clear()
    value_types(model)
    assert seen[0] is model


def _per_sample_loss_declared_scalar() -> onnx.ModelProto:
    """Per-sample cross-entropy (reduction none, shape [B]) weighted and summed, whose value info declares the
    per-sample losses rank 0, as torch's dynamo exporter wrote it with dynamic shapes."""
    nodes = [
        helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["l"], reduction="none"),
        helper.make_node("Mul", ["l", "w"], ["lw"]),
        helper.make_node("ReduceSum", ["lw"], ["loss"], keepdims=0),
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["B", 5]),
         helper.make_tensor_value_info("t", TensorProto.INT64, ["B"]),
         helper.make_tensor_value_info("w", TensorProto.DOUBLE, ["B"])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])],
        value_info=[helper.make_tensor_value_info("l", TensorProto.DOUBLE, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_declared_rank_its_producer_contradicts_gives_way_with_a_warning():
    """Lenient inference keeps the wrong declaration (rank 0) and the gradient of the weighted sum came out
    wrong without an error; the computed rank is used instead, and the gradient matches finite
    differences."""
    import pytest

    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.testing import gradcheck

    model = _per_sample_loss_declared_scalar()
    with pytest.warns(UserWarning, match=r"declares value\(s\) with a rank .*'l \(rank 0, computed 1\)'"):
        types = value_types(model)
    assert len(types["l"].tensor_type.shape.dim) == 1
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((4, 5)), "t": np.array([1, 0, 3, 2]), "w": rng.standard_normal(4)}
    with pytest.warns(UserWarning, match="declares value"):
        build_gradient_model(model, "loss", ["x"])
        gradcheck(model, "loss", ["x"], feeds)


def test_a_graph_output_declared_with_a_rank_its_producer_contradicts_is_written_with_the_computed_one():
    """The per-sample losses as the graph output (torch's dynamo export of ``reduction='none'`` with dynamic
    shapes declares it rank 0): the gradient graph declared it rank 0 too and onnx.checker refused it; now
    it carries the computed rank, and the gradient of the losses' sum matches finite differences."""
    import pytest

    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.testing import gradcheck

    g = helper.make_graph(
        [helper.make_node("SoftmaxCrossEntropyLoss", ["x", "t"], ["loss"], reduction="none")], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["B", 5]),
         helper.make_tensor_value_info("t", TensorProto.INT64, ["B"])],
        [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, [])])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.warns(UserWarning, match=r"'loss \(rank 0, computed 1\)'"):
        grad = build_gradient_model(model, "loss", ["x"])
    onnx.checker.check_model(grad, full_check=True)
    assert len(grad.graph.output[0].type.tensor_type.shape.dim) == 1
    feeds = {"x": np.random.default_rng(3).standard_normal((4, 5)), "t": np.array([1, 0, 3, 2])}
    with pytest.warns(UserWarning, match="declares value"):
        gradcheck(model, "loss", ["x"], feeds)
