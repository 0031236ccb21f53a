"""Gradients through values that ONNX shape inference leaves untyped (GroupNormalization-21 in an IR 8 model):
their element type comes from the schemas, so a float64 graph gets float64 gradient constants (a float32 one
made the gradient graph invalid: the checker, onnxruntime and onnxtrain refused it), and their shape from
their input's (the rules and function bodies after them need a rank and a type)."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime
import torch
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.ir.builder import elem_type, value_types
from onnxtrain.ir.elem_types import fill_elem_types


def group_norm_model() -> onnx.ModelProto:
    d = TensorProto.DOUBLE
    nodes = [
        helper.make_node("GroupNormalization", ["a", "s", "b"], ["y"], num_groups=2, stash_type=d),
        helper.make_node("ReduceSumSquare", ["y"], ["l1"], keepdims=0),
        helper.make_node("Sin", ["y"], ["sy"]),
        helper.make_node("ReduceSum", ["sy"], ["l2"], keepdims=0),
        helper.make_node("Add", ["l1", "l2"], ["loss"]),
    ]
    g = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("a", d, ["N", 4, "H"]), helper.make_tensor_value_info("s", d, [4]),
         helper.make_tensor_value_info("b", d, [4])],
        [helper.make_tensor_value_info("loss", d, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 21)], ir_version=8)


def onnx_inferred_types(m: onnx.ModelProto) -> dict[str, onnx.TypeProto]:
    g = onnx.shape_inference.infer_shapes(m).graph
    return {v.name: v.type for v in (*g.value_info, *g.input, *g.output)}


def test_schema_types_fill_what_inference_left() -> None:
    m = group_norm_model()
    types = onnx_inferred_types(m)
    assert elem_type(types, "y") == TensorProto.UNDEFINED  # the premise: inference cannot type it
    fill_elem_types(m, types)
    assert [elem_type(types, v) for v in ("y", "l1", "sy", "l2")] == [TensorProto.DOUBLE] * 4


def test_float64_gradients_through_untyped_values() -> None:
    m = group_norm_model()
    gm = build_gradient_model(m, "loss", ["a", "s", "b"])
    onnx.checker.check_model(gm, full_check=True)
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 4, 3)), "s": rng.standard_normal(4), "b": rng.standard_normal(4)}
    names = ["a_grad", "s_grad", "b_grad"]
    ort = onnxruntime.InferenceSession(gm.SerializeToString()).run(names, feeds)
    ours = compile_model(gm).run(feeds, names)
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    y = torch.nn.functional.group_norm(t["a"], 2, t["s"], t["b"], eps=1e-5)
    ((y * y).sum() + torch.sin(y).sum()).backward()
    for k, got_ort, got in zip(("a", "s", "b"), ort, ours):
        np.testing.assert_allclose(got, t[k].grad.numpy(), rtol=1e-10, atol=1e-12)
        np.testing.assert_allclose(got_ort, t[k].grad.numpy(), rtol=1e-10, atol=1e-12)


def test_loop_outputs_are_not_typed_from_their_first_carried_value() -> None:
    """A Loop carrying an int64 counter and the untyped float64 value: its outputs each keep their own type
    (Loop's V is one type string for values of different types; the float output was typed int64 and its
    gradient silently dropped)."""
    d = TensorProto.DOUBLE
    vi = helper.make_tensor_value_info
    body = helper.make_graph(
        [helper.make_node("Add", ["c_in", "one"], ["c_out"]), helper.make_node("Sin", ["v_in"], ["v_out"]),
         helper.make_node("Identity", ["cond_in"], ["cond_out"])],
        "body",
        [vi("i", TensorProto.INT64, []), vi("cond_in", TensorProto.BOOL, []),
         vi("c_in", TensorProto.INT64, []), vi("v_in", d, None)],
        [vi("cond_out", TensorProto.BOOL, []), vi("c_out", TensorProto.INT64, []), vi("v_out", d, None)],
        [onnx.numpy_helper.from_array(np.array(1, np.int64), "one")])
    m = group_norm_model()
    g = m.graph
    consts = [("M", np.array(2, np.int64)), ("c0", np.array(0, np.int64)), ("t", np.array(True))]
    del g.node[1:]
    g.node.extend(helper.make_node("Constant", [], [n], value=onnx.numpy_helper.from_array(v))
                  for n, v in consts)
    g.node.extend([helper.make_node("Loop", ["M", "t", "c0", "y"], ["cnt", "yl"], body=body),
                   helper.make_node("ReduceSumSquare", ["yl"], ["loss"], keepdims=0)])
    types = value_types(m)
    fill_elem_types(m, types)
    assert elem_type(types, "yl") != TensorProto.INT64
    gm = build_gradient_model(m, "loss", ["a", "s", "b"])
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((2, 4, 3)), "s": rng.standard_normal(4), "b": rng.standard_normal(4)}
    got = compile_model(gm).run(feeds, ["a_grad", "s_grad", "b_grad"])
    t = {k: torch.tensor(v, requires_grad=True) for k, v in feeds.items()}
    y = torch.nn.functional.group_norm(t["a"], 2, t["s"], t["b"], eps=1e-5)
    (torch.sin(torch.sin(y)) ** 2).sum().backward()
    for k, v in zip(("a", "s", "b"), got):
        np.testing.assert_allclose(v, t[k].grad.numpy(), rtol=1e-10, atol=1e-12)


def normalization_chain() -> onnx.ModelProto:
    """GroupNormalization → MeanVarianceNormalization → InstanceNormalization → RMSNormalization at opset
    23, float32 (MeanVarianceNormalization's function body adds a float32 epsilon): ONNX inference types none
    of the values after the first (InstanceNormalization's rule needs a rank, RMSNormalization's function body
    a type)."""
    d = TensorProto.FLOAT
    nodes = [
        helper.make_node("GroupNormalization", ["a", "s", "b"], ["y"], num_groups=2),
        helper.make_node("MeanVarianceNormalization", ["y"], ["m"], axes=[0, 2]),
        helper.make_node("InstanceNormalization", ["m", "s2", "b2"], ["i"]),
        helper.make_node("RMSNormalization", ["i", "r"], ["z"], axis=-1),
        helper.make_node("Sin", ["z"], ["sz"]),
        helper.make_node("Mul", ["sz", "z"], ["p"]),
        helper.make_node("ReduceSum", ["p"], ["loss"], keepdims=0),
    ]
    vi = helper.make_tensor_value_info
    g = helper.make_graph(
        nodes, "g",
        [vi("a", d, ["N", 4, 5]), vi("s", d, [4]), vi("b", d, [4]), vi("s2", d, [4]), vi("b2", d, [4]),
         vi("r", d, [5])],
        [vi("loss", d, [])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])


def test_normalization_outputs_take_their_inputs_shape() -> None:
    m = normalization_chain()
    assert elem_type(onnx_inferred_types(m), "i") == TensorProto.UNDEFINED  # the premise
    types = value_types(m)
    for v in ("y", "m", "i", "z"):
        t = types[v].tensor_type
        assert t.elem_type == TensorProto.FLOAT
        assert [d.dim_param or d.dim_value for d in t.shape.dim] == ["N", 4, 5], v


def test_gradients_after_group_normalization_vs_torch() -> None:
    m = normalization_chain()
    names = ["a", "s", "b", "s2", "b2", "r"]
    gm = build_gradient_model(m, "loss", names)
    onnx.checker.check_model(gm, full_check=True)
    rng = np.random.default_rng(1)
    shapes = {"a": (3, 4, 5), "s": (4,), "b": (4,), "s2": (4,), "b2": (4,), "r": (5,)}
    feeds = {k: rng.standard_normal(v).astype(np.float32) for k, v in shapes.items()}
    got = compile_model(gm).run(feeds, [f"{k}_grad" for k in names])
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    y = torch.nn.functional.group_norm(t["a"], 2, t["s"], t["b"], eps=1e-5)
    mean = y.mean(dim=(0, 2), keepdim=True)
    var = (y * y).mean(dim=(0, 2), keepdim=True) - mean * mean
    mv = (y - mean) / (torch.sqrt(var) + 1e-9)
    i = torch.nn.functional.instance_norm(mv, weight=t["s2"], bias=t["b2"], eps=1e-5)
    z = torch.nn.functional.rms_norm(i, (5,), t["r"], eps=1e-5)
    (torch.sin(z) * z).sum().backward()
    # InstanceNormalization removes s and b: their gradients are float32 noise around 0
    scale = max(float(np.abs(t[k].grad.numpy()).max()) for k in names)
    for k, v in zip(names, got):
        np.testing.assert_allclose(v, t[k].grad.numpy(), rtol=1e-4, atol=2e-5 * scale, err_msg=k)


def test_group_normalization_of_an_input_without_a_shape_keeps_its_type() -> None:
    """A float input declared without a shape: GroupNormalization's output took no type, so the
    RMSNormalization after it (a function body that needs its input's type) was refused; onnxruntime runs
    it. Values against onnxruntime."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("GroupNormalization", ["x", "s", "b"], ["g"], num_groups=2),
             helper.make_node("RMSNormalization", ["g", "r"], ["y"], axis=-1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, None)],
                          [helper.make_tensor_value_info("y", f, None)],
                          [onnx.numpy_helper.from_array(np.array([1.0, 0.5, 2.0, 1.5], np.float32), "s"),
                           onnx.numpy_helper.from_array(np.array([0.1, 0.2, 0.3, 0.4], np.float32), "b"),
                           onnx.numpy_helper.from_array(np.array([1.0, 2.0, 0.5], np.float32), "r")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 23)])
    assert elem_type(value_types(m), "g") == f
    x = np.random.default_rng(0).standard_normal((2, 4, 3)).astype(np.float32)
    want = onnxruntime.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x})[0]
    np.testing.assert_allclose(compile_model(m).run({"x": x})[0], want, rtol=1e-5, atol=1e-6)
