"""``expand_functions``: a node of an op ONNX defines by a function, replaced by that body (attributes
bound, outputs the node leaves out not computed, an older body moved to the model's opset), and the engine
and the gradient builder taking that path only for ops they have no kernel or rule for."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine.plan import Plan
from onnxtrain.ir.builder import make_model
from onnxtrain.ir.functions import FunctionExpansionError, expand_functions, has_function


def _one(op: str, inputs: dict[str, list], outputs: list[str], opset: int, **attrs) -> onnx.ModelProto:
    """A model of one ``op`` node on float inputs of the given shapes (None: untyped); the outputs are
    declared with the first input's shape."""
    node = helper.make_node(op, list(inputs), outputs, name=f"{op.lower()}_node", **attrs)
    g_in = [helper.make_tensor_value_info(n, TensorProto.FLOAT, s) if s is not None
            else helper.make_value_info(n, onnx.TypeProto()) for n, s in inputs.items()]
    g_out = [helper.make_tensor_value_info(o, TensorProto.FLOAT, next(iter(inputs.values())))
             for o in outputs]
    return make_model(helper.make_graph([node], op, g_in, g_out), opset)


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-x))


def test_attribute_references_are_bound() -> None:
    """Swish's body reads its alpha through an attribute reference: the given alpha, else the default 1."""
    x = np.linspace(-3, 3, 12, dtype=np.float64).reshape(3, 4)
    for attrs, alpha in (({"alpha": 1.702}, 1.702), ({}, 1.0)):
        model = _one("Swish", {"x": [3, 4]}, ["y"], 24, **attrs)
        expanded = expand_functions(model, lambda n: True)
        onnx.checker.check_model(expanded, full_check=True)
        assert "Swish" not in {n.op_type for n in expanded.graph.node}
        assert not any(a.ref_attr_name for n in expanded.graph.node for a in n.attribute)
        y = Plan(model).run({"x": x.astype(np.float32)}, ["y"])[0]
        np.testing.assert_allclose(y, x * _sigmoid(alpha * x), rtol=1e-6, atol=1e-7)


def test_outputs_left_out_are_not_computed() -> None:
    """Attention with only Y: no node of its body computes the present key and value or the scores output."""
    shapes = {"q": [1, 2, 3, 4], "k": [1, 2, 3, 4], "v": [1, 2, 3, 4]}
    few = expand_functions(_one("Attention", shapes, ["y"], 23), lambda n: True)
    many = expand_functions(_one("Attention", shapes, ["y", "pk", "pv", "qk"], 23, qk_matmul_output_mode=1),
                            lambda n: True)
    assert len(few.graph.node) < len(many.graph.node)
    made = {o for n in few.graph.node for o in n.output}
    assert "y" in made and not made & {"pk", "pv", "qk"}


def test_an_older_body_moves_to_the_model_opset() -> None:
    """SwiGLU (opset 28) holds a Swish whose body is written for opset 24: converted, it runs at 28."""
    model = _one("SwiGLU", {"a": [2, 3], "b": [2, 3]}, ["y"], 28, alpha=0.5)
    expanded = expand_functions(model, lambda n: True)
    assert {n.op_type for n in expanded.graph.node}.isdisjoint({"SwiGLU", "Swish"})
    onnx.checker.check_model(expanded, full_check=True)
    rng = np.random.default_rng(0)
    a, b = (rng.uniform(-2, 2, (2, 3)).astype(np.float32) for _ in range(2))
    y = Plan(model).run({"a": a, "b": b}, ["y"])[0]
    np.testing.assert_allclose(y, a * _sigmoid(0.5 * a) * b, rtol=1e-6)


def test_picks_only_what_is_asked_and_has_a_body() -> None:
    model = _one("Swish", {"x": [3]}, ["y"], 24)
    assert expand_functions(model, lambda n: False) is model  # nothing picked: the same model
    sig = _one("Sigmoid", {"x": [3]}, ["y"], 24)
    assert expand_functions(sig, lambda n: True) is sig  # Sigmoid has no function body
    assert has_function("Swish", 24) and not has_function("Swish", 23) and not has_function("Sigmoid", 24)
    assert not has_function("Swish", 24, "com.microsoft")


def test_unknown_input_type_is_an_error_naming_the_node() -> None:
    """RMSNormalization's body depends on its input's type: unknown, the error names the node and input."""
    model = _one("RMSNormalization", {"x": None, "scale": [4]}, ["y"], 23)
    with pytest.raises(FunctionExpansionError, match=r"rmsnormalization_node.*'x'"):
        expand_functions(model, lambda n: True)


def test_engine_and_builder_take_the_body_only_without_kernel_or_rule() -> None:
    """The plan keeps a LayerNormalization (it has a kernel; its schema has a body too) and expands an
    RMSNormalization; the gradient graph differentiates RMSNormalization's body and stays standard."""
    ln = _one("LayerNormalization", {"x": [2, 4], "s": [4]}, ["y"], 23)
    assert Plan(ln).model is ln
    rms = _one("RMSNormalization", {"x": [2, 4], "s": [4]}, ["y"], 23)
    plan = Plan(rms)
    assert "RMSNormalization" not in {n.op_type for n in plan.model.graph.node}
    x = np.arange(8, dtype=np.float32).reshape(2, 4) - 3.5
    s = np.array([0.5, 1.0, 1.5, 2.0], np.float32)
    want = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + 1e-5) * s
    np.testing.assert_allclose(plan.run({"x": x, "s": s}, ["y"])[0], want, rtol=1e-6)
    grads = build_gradient_model(_with_sum(rms), "loss", ["x", "s"])
    onnx.checker.check_model(grads, full_check=True)
    assert "RMSNormalization" not in {n.op_type for n in grads.graph.node}
    ln_loss = build_gradient_model(_with_sum(ln), "loss", ["x", "s"])
    assert "LayerNormalization" in {n.op_type for n in ln_loss.graph.node}  # it has a rule: kept whole


def _with_sum(model: onnx.ModelProto, y: str = "y") -> onnx.ModelProto:
    out = onnx.ModelProto()
    out.CopyFrom(model)
    out.graph.node.append(helper.make_node("ReduceSum", [y], ["loss"], keepdims=0))
    del out.graph.output[:]
    out.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    return out


def test_the_node_outputs_keep_their_inferred_shapes() -> None:
    """RMSNormalization's body reduces over axes computed at run time, which shape inference cannot follow:
    the expanded node's output still carries the shape inferred for the op, which a later MatMul's gradient
    needs (a mixed-precision model, without torch's value_info, failed on it)."""
    rms = _one("RMSNormalization", {"x": [2, 3, 4], "s": [4]}, ["h"], 23)
    rms.graph.node.append(helper.make_node("MatMul", ["h", "w"], ["y"]))
    rms.graph.initializer.append(onnx.numpy_helper.from_array(np.ones((4, 5), np.float32), "w"))
    del rms.graph.output[:]
    rms.graph.output.append(helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3, 5]))
    expanded = expand_functions(rms, lambda n: n.op_type == "RMSNormalization")
    declared = {v.name: v for v in expanded.graph.value_info}
    dims = [d.dim_value for d in declared["h"].type.tensor_type.shape.dim]
    assert dims == [2, 3, 4]
    grads = build_gradient_model(_with_sum(rms, "y"), "loss", ["x", "s", "w"])
    onnx.checker.check_model(grads, full_check=True)


def test_bodies_get_their_own_copies_of_outer_constants() -> None:
    """LinearAttention's body is a Scan whose body unsqueezes by axes held in constants outside it; shape
    inference does not see outer values, so the Scan's outputs got no rank (its gradient needs them). Each
    body now has its own copies: the Scan's outputs have ranks, the model passes the checker."""
    shapes = {"q": [2, 3, 8], "k": [2, 3, 8], "v": [2, 3, 8], "past": [2, 2, 4, 4], "decay": [2, 3, 2],
              "beta": [2, 3, 2]}
    model = _one("LinearAttention", shapes, ["y", "state"], 27, q_num_heads=2, kv_num_heads=2)
    model.graph.output[1].CopyFrom(helper.make_tensor_value_info("state", TensorProto.FLOAT, [2, 2, 4, 4]))
    expanded = expand_functions(model, lambda n: n.op_type == "LinearAttention")
    onnx.checker.check_model(expanded, full_check=True)
    outer = {o for n in expanded.graph.node if n.op_type == "Constant" for o in n.output}
    (scan,) = [n for n in expanded.graph.node if n.op_type == "Scan"]
    body = next(a.g for a in scan.attribute if a.name == "body")
    assert not {v for n in body.node for v in n.input} & outer
    assert {n.op_type for n in body.node[:2]} == {"Constant"}
    inferred = onnx.shape_inference.infer_shapes(expanded)
    types = {v.name: v.type for v in inferred.graph.value_info}
    assert [len(types[o].tensor_type.shape.dim) for o in scan.output] == [4, 4]
