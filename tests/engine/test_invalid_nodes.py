"""The numpy engine refuses, when a session is created, nodes of the standard domains that their ONNX schema
does not allow (too many or too few inputs or outputs, an unknown attribute, an attribute of the wrong type,
a required one missing, an input of a type its constraint does not allow or of another type than the
inputs that share its type variable), naming the node, op, opset and what is wrong, as onnxruntime refuses
such a model at load (InvalidGraph); valid nodes that leave optional inputs out or mix types as their
schemas allow still run and equal onnxruntime."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.plan import EngineError, InvalidNodeError, UnsupportedOpError, compile_model
from onnxtrain.errors import InvalidGraph
from tests.session.helpers import params

ort = pytest.importorskip("onnxruntime")
CPU = ["CPUExecutionProvider"]

def one_node(node: onnx.NodeProto, opset: int = 17, shape: tuple[int, ...] = (2, 3)) -> onnx.ModelProto:
    """A model of ``node`` alone, reading the float input ``x``."""
    outs = [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in node.output if o]
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, list(shape))],
                          outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def with_loss(node: onnx.NodeProto) -> onnx.ModelProto:
    """``node`` between a weight and a loss, for TrainingSession: t = x·w, node(t) → y, loss = Σ y."""
    w = numpy_helper.from_array(np.ones((2, 3), np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["t"], name="scale"), node,
             helper.make_node("ReduceSum", ["y"], ["loss"], name="total", keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


# case → (node reading "x" (renamed "t" in the training model), the pieces its message must hold)
CASES = {
    "Relu_two_inputs": (lambda i: helper.make_node("Relu", [i, i], ["y"], name="bad"),
                        ["'bad'", "(Relu, opset 17)", "has 2 inputs; Relu-14 takes 1"]),
    "Relu_two_outputs": (lambda i: helper.make_node("Relu", [i], ["y", "z"], name="bad"),
                         ["'bad'", "(Relu, opset 17)", "has 2 outputs; Relu-14 takes 1"]),
    # an empty name past the schema's last parameter counts too, as for onnx.checker and onnxruntime
    "Relu_trailing_empty_input": (lambda i: helper.make_node("Relu", [i, ""], ["y"], name="bad"),
                                  ["'bad'", "(Relu, opset 17)", "has 2 inputs; Relu-14 takes 1"]),
    "Relu_trailing_empty_output": (lambda i: helper.make_node("Relu", [i], ["y", ""], name="bad"),
                                   ["'bad'", "(Relu, opset 17)", "has 2 outputs; Relu-14 takes 1"]),
    "Add_one_input": (lambda i: helper.make_node("Add", [i], ["y"], name="bad"),
                      ["'bad'", "(Add, opset 17)", "has 1 input; Add-14 takes 2"]),
    "Transpose_unknown_attribute": (lambda i: helper.make_node("Transpose", [i], ["y"], name="bad", foo=3),
                                    ["'bad'", "(Transpose, opset 17)",
                                     "attribute 'foo' is not an attribute of Transpose-13"]),
    "Softmax_float_axis": (lambda i: helper.make_node("Softmax", [i], ["y"], name="bad", axis=1.5),
                           ["'bad'", "(Softmax, opset 17)",
                            "attribute 'axis' is FLOAT; Softmax-13 declares INT"]),
    # an INT where FLOAT is declared: onnx.checker and onnxruntime refuse it too
    "LeakyRelu_int_alpha": (lambda i: helper.make_node("LeakyRelu", [i], ["y"], name="bad", alpha=1),
                            ["'bad'", "(LeakyRelu, opset 17)",
                             "attribute 'alpha' is INT; LeakyRelu-16 declares FLOAT"]),
    "Cast_without_to": (lambda i: helper.make_node("Cast", [i], ["y"], name="bad"),
                        ["'bad'", "(Cast, opset 17)", "required attribute 'to' of Cast-13 is missing"]),
    "Add_empty_required_input": (lambda i: helper.make_node("Add", ["", i], ["y"], name="bad"),
                                 ["'bad'", "(Add, opset 17)",
                                  "input 0 (A) of Add-14 is required, but its name is empty"]),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_inference_session_refuses_the_node_at_creation(case: str) -> None:
    make, pieces = CASES[case]
    model = one_node(make("x"))
    with pytest.raises(InvalidNodeError) as e:
        onnxtrain.InferenceSession(model.SerializeToString())
    for p in pieces:
        assert p in str(e.value), (p, str(e.value))
    # the hierarchy: an EngineError (onnxruntime's Fail) and onnxruntime's InvalidGraph
    assert isinstance(e.value, EngineError) and isinstance(e.value, InvalidGraph)


@pytest.mark.parametrize("case", sorted(CASES))
def test_onnxruntime_refuses_the_same_model(case: str) -> None:
    """The oracle that these models are invalid: onnxruntime refuses them at load."""
    make, _ = CASES[case]
    with pytest.raises(Exception, match="INVALID_GRAPH|Unrecognized attribute|Mismatched attribute type"):
        ort.InferenceSession(one_node(make("x")).SerializeToString(), providers=CPU)


@pytest.mark.parametrize("case", sorted(CASES))
def test_legacy_training_session_refuses_the_node_at_creation(case: str) -> None:
    make, pieces = CASES[case]
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    with pytest.raises(InvalidNodeError) as e:
        onnxtrain.TrainingSession(with_loss(make("t")).SerializeToString(), p)
    for piece in pieces:
        assert piece in str(e.value), (piece, str(e.value))


def test_unnamed_node_is_named_by_its_index() -> None:
    nodes = [helper.make_node("Relu", ["x"], ["r"], name="ok"), helper.make_node("Add", ["r"], ["y"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidNodeError, match=r"node #1 \(unnamed\) \(Add, opset 17\): has 1 input; Add-14 "
                                               "takes 2"):
        onnxtrain.InferenceSession(model.SerializeToString())


def test_every_invalid_node_is_listed() -> None:
    nodes = [helper.make_node("Relu", ["x", "x"], ["r"], name="first"),
             helper.make_node("Transpose", ["r"], ["y"], name="second", foo=3)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidNodeError) as e:
        compile_model(model)
    msg = str(e.value)
    assert "2 invalid nodes" in msg and "'first' (Relu" in msg and "'second' (Transpose" in msg


def test_node_in_a_control_flow_body_is_named_under_its_node() -> None:
    bad = helper.make_node("Relu", ["x", "x"], ["b"], name="inner")
    then = helper.make_graph([bad], "then", [], [helper.make_tensor_value_info("b", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["c"], name="neg")], "else", [],
                              [helper.make_tensor_value_info("c", TensorProto.FLOAT, None)])
    node = helper.make_node("If", ["cond"], ["y"], name="branch", then_branch=then, else_branch=other)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3]),
                                        helper.make_tensor_value_info("cond", TensorProto.BOOL, [])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidNodeError, match=r"node 'branch' \(If\), then_branch: node 'inner' \(Relu, "
                                               r"opset 17\): has 2 inputs; Relu-14 takes 1"):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="INVALID_GRAPH"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def test_ai_onnx_ml_node_is_checked_at_its_domain_opset() -> None:
    node = helper.make_node("LabelEncoder", ["x"], ["y"], name="enc", domain="ai.onnx.ml",
                            keys_floats=[0.0], values_floats=[1.0], foo=1)
    model = one_node(node)
    model.opset_import.append(helper.make_opsetid("ai.onnx.ml", 2))
    with pytest.raises(InvalidNodeError, match=r"node 'enc' \(ai.onnx.ml.LabelEncoder, opset 2\): attribute "
                                               r"'foo' is not an attribute of LabelEncoder-2"):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="INVALID_GRAPH|Unrecognized attribute"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def test_op_without_a_schema_keeps_the_no_kernel_error() -> None:
    model = one_node(helper.make_node("NoSuchOp", ["x"], ["y"], name="odd", foo=1))
    with pytest.raises(UnsupportedOpError, match=r"no kernel for node.*\(ONNX defines no such op"):
        onnxtrain.InferenceSession(model.SerializeToString())


def _instance_norm_running_stats() -> onnx.ModelProto:
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    m = torch.nn.InstanceNorm2d(2, affine=True, track_running_stats=True)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 2, 3, 3),), f, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["y"], training=torch.onnx.TrainingMode.TRAINING,
                          do_constant_folding=False)
    return onnx.load_from_string(f.getvalue())


def test_torchscript_instance_norm_with_running_stats_is_refused() -> None:
    """TorchScript writes a BatchNormalization with 5 outputs (valid only before opset 14) at opset 17: the
    engine ran it and gave another value than torch's; onnxruntime refuses the model."""
    model = _instance_norm_running_stats()
    want = (r"node '/BatchNormalization' \(BatchNormalization, opset 17\): has 5 outputs; "
            r"BatchNormalization-15 takes 1 to 3")
    with pytest.raises(InvalidNodeError, match=want):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="INVALID_GRAPH"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)
    # the legacy TrainingSession, on the model with a loss
    model.graph.node.append(helper.make_node("ReduceSum", ["y"], ["loss"], name="total", keepdims=0))
    del model.graph.output[:]
    model.graph.output.append(helper.make_tensor_value_info("loss", TensorProto.FLOAT, []))
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    with pytest.raises(InvalidNodeError, match=want):
        onnxtrain.TrainingSession(model.SerializeToString(), p)


def _init(name: str, a: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(a, name)


# valid nodes that leave optional inputs out: (node, initializers, input shape, opset)
VALID = {
    "Clip_max_only": (helper.make_node("Clip", ["x", "", "hi"], ["y"], name="clip"),
                      [_init("hi", np.array(0.1, np.float32))], (2, 3), 17),
    "Clip_trailing_empty": (helper.make_node("Clip", ["x", "lo", ""], ["y"], name="clip"),
                            [_init("lo", np.array(-0.1, np.float32))], (2, 3), 17),
    "Resize_sizes_only": (helper.make_node("Resize", ["x", "", "", "sizes"], ["y"], name="resize",
                                           mode="nearest"),
                          [_init("sizes", np.array([1, 1, 4, 6], np.int64))], (1, 1, 2, 3), 17),
    "Dropout_no_ratio": (helper.make_node("Dropout", ["x"], ["y"], name="drop"), [], (2, 3), 17),
    "Dropout_mask_omitted": (helper.make_node("Dropout", ["x", "", ""], ["y", ""], name="drop"), [],
                             (2, 3), 17),
    "Pad_constant_value_omitted": (helper.make_node("Pad", ["x", "pads", ""], ["y"], name="pad"),
                                   [_init("pads", np.array([0, 1, 0, 1], np.int64))], (2, 3), 17),
    "Concat_variadic": (helper.make_node("Concat", ["x", "x", "x"], ["y"], name="cat", axis=0), [],
                        (2, 3), 17),
    "Split_variadic_outputs": (helper.make_node("Split", ["x"], ["y", "z", "w"], name="split", axis=1,
                                                num_outputs=3), [], (2, 3), 18),
}


@pytest.mark.parametrize("case", sorted(VALID))
def test_valid_nodes_with_omitted_optional_values_run_as_onnxruntime(case: str) -> None:
    node, inits, shape, opset = VALID[case]
    model = one_node(node, opset, shape)
    model.graph.initializer.extend(inits)
    x = np.arange(np.prod(shape), dtype=np.float32).reshape(shape) / 5 - 0.5
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"x": x})
    assert len(got) == len(want)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6, atol=1e-7)


def _swish_model(*nodes: onnx.NodeProto) -> onnx.ModelProto:
    g = helper.make_graph(list(nodes), "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 24)])


def test_ops_run_as_their_function_body_are_checked_before_expansion() -> None:
    """Swish (opset 24) has no kernel: the engine runs its ONNX body, built for the node; an invalid Swish is
    refused as written, and the nodes of a model that holds a valid one are checked too."""
    x = np.linspace(-2, 2, 6, dtype=np.float32).reshape(2, 3)
    ok = _swish_model(helper.make_node("Swish", ["x"], ["y"], name="swish", alpha=0.5))
    y = onnxtrain.InferenceSession(ok.SerializeToString()).run(None, {"x": x})[0]
    np.testing.assert_allclose(y, x / (1 + np.exp(-0.5 * x)), rtol=1e-6)
    with pytest.raises(InvalidNodeError, match=r"node 'swish' \(Swish, opset 24\): attribute 'alpha' is INT; "
                                               r"Swish-24 declares FLOAT"):
        onnxtrain.InferenceSession(_swish_model(helper.make_node("Swish", ["x"], ["y"], name="swish",
                                                                 alpha=1)))
    with pytest.raises(InvalidNodeError,
                       match=r"node 'swish' \(Swish, opset 24\): has 2 inputs; Swish-24 takes 1"):
        onnxtrain.InferenceSession(_swish_model(helper.make_node("Swish", ["x", "x"], ["y"], name="swish")))
    both = _swish_model(helper.make_node("Swish", ["x"], ["s"], name="swish"),
                        helper.make_node("Relu", ["s", "s"], ["y"], name="bad"))
    with pytest.raises(InvalidNodeError,
                       match=r"node 'bad' \(Relu, opset 24\): has 2 inputs; Relu-14 takes 1"):
        onnxtrain.InferenceSession(both)


# ---- input types against the schemas' type constraints --------------------------------------------------
_F, _D, _B = TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BOOL
_I32, _I64 = TensorProto.INT32, TensorProto.INT64


def typed_model(nodes: list[onnx.NodeProto], inputs: dict[str, int], outputs: dict[str, int], opset: int = 17,
                inits: list[onnx.TensorProto] = ()) -> onnx.ModelProto:
    """A model of ``nodes`` reading the (2, 3) ``inputs`` (name → element type), with ``outputs`` typed as
    given (name → element type; the types onnxruntime infers for valid nodes)."""
    g = helper.make_graph(nodes, "g",
                          [helper.make_tensor_value_info(n, t, [2, 3]) for n, t in inputs.items()],
                          [helper.make_tensor_value_info(n, t, None) for n, t in outputs.items()],
                          list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


# case → (model, the pieces its message must hold)
TYPE_CASES = {
    "Add_float_double": (typed_model([helper.make_node("Add", ["x", "y"], ["z"], name="bad")],
                                     {"x": _F, "y": _D}, {"z": _F}),
                         ["'bad'", "(Add, opset 17)",
                          "input 1 'y' is tensor(double), but T of input 0 'x' is tensor(float)"]),
    "MatMul_int32_float": (typed_model([helper.make_node("MatMul", ["a", "x"], ["z"], name="bad")],
                                       {"a": _I32, "x": _F}, {"z": _F}),
                           ["'bad'", "(MatMul, opset 17)",
                            "input 1 'x' is tensor(float), but T of input 0 'a' is tensor(int32)"]),
    # Relu takes integers from opset 14 on
    "Relu_int64_opset13": (typed_model([helper.make_node("Relu", ["n"], ["z"], name="bad")], {"n": _I64},
                                       {"z": _I64}, opset=13),
                           ["'bad'", "(Relu, opset 13)", "input 0 'n' is tensor(int64), not allowed for T of "
                            "Relu-13 (tensor(float16), tensor(float), tensor(double), tensor(bfloat16))"]),
    "Gather_float_indices": (typed_model([helper.make_node("Gather", ["x", "i"], ["z"], name="bad")],
                                         {"x": _F, "i": _F}, {"z": _F}),
                             ["'bad'", "(Gather, opset 17)",
                              "input 1 'i' is tensor(float), not allowed for Tind of Gather-13 "
                              "(tensor(int32), tensor(int64))"]),
    # a formal parameter of one type, not a variable
    "Reshape_int32_shape": (typed_model([helper.make_node("Reshape", ["x", "s"], ["z"], name="bad")],
                                        {"x": _F}, {"z": _F},
                                        inits=[numpy_helper.from_array(np.array([3, 2], np.int32), "s")]),
                            ["'bad'", "(Reshape, opset 17)",
                             "input 1 's' is tensor(int32); Reshape-14 takes tensor(int64) there"]),
    # the type of an intermediate value: a Cast's output, as its 'to' gives it
    "MatMul_of_a_cast": (typed_model([helper.make_node("Cast", ["x"], ["c"], name="cast", to=_I32),
                                      helper.make_node("MatMul", ["x", "c"], ["z"], name="bad")],
                                     {"x": _F}, {"z": _F}),
                         ["'bad'", "(MatMul, opset 17)",
                          "input 1 'c' is tensor(int32), but T of input 0 'x' is tensor(float)"]),
    # a variadic input: every value bound to T
    "Concat_one_double": (typed_model([helper.make_node("Concat", ["x", "x", "y"], ["z"], name="bad",
                                                        axis=0)], {"x": _F, "y": _D}, {"z": _F}),
                          ["'bad'", "(Concat, opset 17)",
                           "input 2 'y' is tensor(double), but T of input 0 'x' is tensor(float)"]),
    "Sum_one_double": (typed_model([helper.make_node("Sum", ["x", "y", "x"], ["z"], name="bad")],
                                   {"x": _F, "y": _D}, {"z": _F}),
                       ["'bad'", "(Sum, opset 17)",
                        "input 1 'y' is tensor(double), but T of input 0 'x' is tensor(float)"]),
    # outputs typed by an attribute, or by its default: EyeLike's dtype, RandomNormalLike's input type,
    # Multinomial's int32, QuantizeLinear's uint8 without a zero point
    "Add_of_an_eye_like_double": (typed_model([helper.make_node("EyeLike", ["x"], ["e"], name="eye",
                                                                dtype=_D),
                                               helper.make_node("Add", ["x", "e"], ["z"], name="bad")],
                                              {"x": _F}, {"z": _F}),
                                  ["'bad'", "input 1 'e' is tensor(double), but T of input 0 'x' is "
                                   "tensor(float)"]),
    "Add_of_a_random_like": (typed_model([helper.make_node("RandomNormalLike", ["x"], ["r"], name="rand"),
                                          helper.make_node("Add", ["y", "r"], ["z"], name="bad")],
                                         {"x": _F, "y": _D}, {"z": _D}),
                             ["'bad'", "input 1 'r' is tensor(float), but T of input 0 'y' is "
                              "tensor(double)"]),
    "Add_of_multinomial_draws": (typed_model([helper.make_node("Multinomial", ["x"], ["m"], name="draw"),
                                              helper.make_node("Add", ["n", "m"], ["z"], name="bad")],
                                             {"x": _F, "n": _I64}, {"z": _I64}),
                                 ["'bad'", "input 1 'm' is tensor(int32), but T of input 0 'n' is "
                                  "tensor(int64)"]),
    "Gather_by_quantized_values": (typed_model([helper.make_node("QuantizeLinear", ["x", "s"], ["q"],
                                                                 name="quant"),
                                                helper.make_node("Gather", ["x", "q"], ["z"], name="bad")],
                                               {"x": _F}, {"z": _F},
                                               inits=[numpy_helper.from_array(np.array(0.1, np.float32),
                                                                              "s")]),
                                   ["'bad'", "input 1 'q' is tensor(uint8), not allowed for Tind"]),
}


@pytest.mark.parametrize("case", sorted(TYPE_CASES))
def test_input_types_outside_the_schema_are_refused_at_creation(case: str) -> None:
    """Refused as onnxruntime refuses the model (the oracle): INVALID_GRAPH for a type outside a constraint,
    FAIL "Type Error" for a variable bound to two types."""
    model, pieces = TYPE_CASES[case]
    with pytest.raises(InvalidNodeError) as e:
        onnxtrain.InferenceSession(model.SerializeToString())
    for p in pieces:
        assert p in str(e.value), (p, str(e.value))
    with pytest.raises(Exception, match="INVALID_GRAPH|Type Error"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def _mixed_types() -> onnx.ModelProto:
    """Valid nodes whose inputs are of several types: Gather (float data, int64 indices), Cast, Shape and
    ConstantOfShape (int64), Where (a bool condition), Less (float → bool), Expand (an int64 shape)."""
    nodes = [helper.make_node("Gather", ["x", "i"], ["g"], name="gather", axis=0),
             helper.make_node("Cast", ["g"], ["d"], name="cast", to=_D),
             helper.make_node("Shape", ["g"], ["s"], name="shape"),
             helper.make_node("ConstantOfShape", ["s"], ["zeros"], name="zeros"),
             helper.make_node("Less", ["g", "zeros"], ["neg"], name="less"),
             helper.make_node("Where", ["neg", "zeros", "g"], ["relu"], name="where"),
             helper.make_node("Expand", ["relu", "s"], ["y"], name="expand"),
             helper.make_node("Mul", ["d", "d"], ["dd"], name="square")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", _F, [2, 3])],
                          [helper.make_tensor_value_info("y", _F, None),
                           helper.make_tensor_value_info("dd", _D, None)],
                          [numpy_helper.from_array(np.array([1, 0, 1], np.int64), "i")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_valid_mixed_type_nodes_run_as_onnxruntime() -> None:
    from onnxtrain.engine.node_checks import NodeChecker

    model = _mixed_types()
    x = np.linspace(-1, 1, 6, dtype=np.float32).reshape(2, 3)
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"x": x})
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_allclose(a, b, rtol=1e-6)
    # the types the check sees: declared, and those the schemas (and Cast's 'to') give the outputs
    check = NodeChecker({"": 17}, model.graph)
    assert not any(check.invalid(n, tuple(n.input), tuple(n.output)) for n in model.graph.node)
    assert {n: check.types[n] for n in ("g", "d", "s", "zeros", "neg", "relu", "y", "dd")} == {
        "g": "tensor(float)", "d": "tensor(double)", "s": "tensor(int64)", "zeros": "tensor(float)",
        "neg": "tensor(bool)", "relu": "tensor(float)", "y": "tensor(float)", "dd": "tensor(double)"}


def test_attribute_typed_outputs_run_as_onnxruntime() -> None:
    """Valid nodes whose output types their attributes give (or their defaults): the check records those
    types and passes the nodes that read them, and the outputs equal onnxruntime's."""
    nodes = [helper.make_node("EyeLike", ["x"], ["e"], name="eye", dtype=_D),
             helper.make_node("Cast", ["x"], ["xd"], name="cast", to=_D),
             helper.make_node("Add", ["xd", "e"], ["sum"], name="add"),
             helper.make_node("EyeLike", ["x"], ["f"], name="eye_f"),
             helper.make_node("Mul", ["x", "f"], ["diag"], name="mul"),
             helper.make_node("QuantizeLinear", ["x", "s"], ["q"], name="quant"),
             helper.make_node("Cast", ["q"], ["qi"], name="widen", to=_I64),
             helper.make_node("Gather", ["x", "qi"], ["picked"], name="gather", axis=1)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", _F, [3, 3])],
                          [helper.make_tensor_value_info("sum", _D, None),
                           helper.make_tensor_value_info("diag", _F, None),
                           helper.make_tensor_value_info("picked", _F, None)],
                          [numpy_helper.from_array(np.array(1.0, np.float32), "s")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    x = np.array([[0.2, 1.4, 2.1], [1.0, 0.0, 2.0], [0.4, 1.6, 0.0]], np.float32)
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"x": x})
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"x": x})
    for a, b in zip(got, want):
        assert a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    from onnxtrain.engine.node_checks import NodeChecker

    check = NodeChecker({"": 17}, model.graph)
    assert not any(check.invalid(n, tuple(n.input), tuple(n.output)) for n in model.graph.node)
    assert {n: check.types[n] for n in ("e", "f", "q")} == {
        "e": "tensor(double)", "f": "tensor(float)", "q": "tensor(uint8)"}


def test_declared_sequence_empties_run_as_onnxruntime() -> None:
    """A SequenceEmpty declared as its dtype (or float, its default) makes: the check passes it and the
    output equals onnxruntime's."""
    x = np.array([[0.5, -1.25, 3.0], [2.0, 0.0, -0.5]], np.float32)
    for declared, attrs in ((_F, {}), (_F, {"dtype": _F})):
        model = _sequence_declared(declared, attrs)
        got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, {"x": x})
        want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, {"x": x})
        np.testing.assert_array_equal(got[0], want[0])
        assert got[0].dtype == want[0].dtype


def test_mixed_types_passed_on_reach_a_mismatch() -> None:
    """Types passed on from node to node find a mismatch several nodes down: the Where's branches, a
    double (Cast) and a float (Gather)."""
    model = _mixed_types()
    where = next(n for n in model.graph.node if n.name == "where")
    where.input[1] = "d"
    with pytest.raises(InvalidNodeError, match=r"node 'where' \(Where, opset 17\): input 2 'g' is "
                                               r"tensor\(float\), but T of input 1 'd' is tensor\(double\)"):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="INVALID_GRAPH|Type Error"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def test_input_types_in_a_loop_body_are_checked() -> None:
    """In a body, the types it declares (a loop body's inputs) and those its nodes give are known (those of
    the enclosing graph's values it reads too: the control-flow cases below)."""
    body = helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"], name="keep"),
         helper.make_node("Add", ["v", "it"], ["v_out"], name="inner")], "body",
        [helper.make_tensor_value_info("it", _I64, []), helper.make_tensor_value_info("c", _B, []),
         helper.make_tensor_value_info("v", _F, [2, 3])],
        [helper.make_tensor_value_info("c_out", _B, []), helper.make_tensor_value_info("v_out", _F, [2, 3])])
    node = helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=body)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", _F, [2, 3])],
                          [helper.make_tensor_value_info("y", _F, [2, 3])],
                          [numpy_helper.from_array(np.array(2, np.int64), "n")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(InvalidNodeError, match=r"node 'loop' \(Loop\), body: node 'inner' \(Add, opset 17\): "
                                               r"input 1 'it' is tensor\(int64\), but T of input 0 'v' is "
                                               r"tensor\(float\)"):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="INVALID_GRAPH|Type Error"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


# ---- output types against the types the graph declares --------------------------------------------------
def _declared(nodes: list[onnx.NodeProto], outputs: dict[str, int], value_info: dict[str, int] | None = None,
              opset: int = 17) -> onnx.ModelProto:
    """``typed_model`` of a float input ``x``, with ``value_info`` declared too (name → element type)."""
    model = typed_model(nodes, {"x": _F}, outputs, opset)
    declared = (value_info or {}).items()
    model.graph.value_info.extend(helper.make_tensor_value_info(n, t, None) for n, t in declared)
    return model


def _sequence_declared(declared: int, attrs: dict) -> onnx.ModelProto:
    """x inserted into a SequenceEmpty (``attrs``) declared a sequence of ``declared``, and concatenated."""
    nodes = [helper.make_node("SequenceEmpty", [], ["s"], name="empty", **attrs),
             helper.make_node("SequenceInsert", ["s", "x"], ["s2"], name="insert"),
             helper.make_node("ConcatFromSequence", ["s2"], ["y"], name="concat", axis=0)]
    model = typed_model(nodes, {"x": _F}, {"y": _F}, 17)
    seq = helper.make_sequence_type_proto(helper.make_tensor_type_proto(declared, None))
    model.graph.value_info.append(helper.make_value_info("s", seq))
    return model


# case → (model, the message's piece)
DECLARED_CASES = {
    "graph_output_double_of_a_float_neg": (
        _declared([helper.make_node("Neg", ["x"], ["y"], name="neg")], {"y": _D}),
        "node 'neg' (Neg, opset 17): output 0 'y' is tensor(float) by Neg-13, but the graph declares it "
        "tensor(double)"),
    "value_info_int64_of_a_relu": (
        _declared([helper.make_node("Relu", ["x"], ["r"], name="relu"),
                   helper.make_node("Neg", ["r"], ["y"], name="neg")], {"y": _F}, {"r": _I64}),
        "node 'relu' (Relu, opset 17): output 0 'r' is tensor(float) by Relu-14, but the graph declares it "
        "tensor(int64)"),
    # typed by an attribute: Cast's 'to'
    "cast_to_int32_declared_float": (
        _declared([helper.make_node("Cast", ["x"], ["y"], name="cast", to=_I32)], {"y": _F}),
        "node 'cast' (Cast, opset 17): output 0 'y' is tensor(int32) by Cast-13, but the graph declares it "
        "tensor(float)"),
    # one type by the schema's constraint: Shape's int64
    "shape_declared_int32": (
        _declared([helper.make_node("Shape", ["x"], ["y"], name="shape")], {"y": _I32}),
        "node 'shape' (Shape, opset 17): output 0 'y' is tensor(int64) by Shape-15, but the graph declares "
        "it tensor(int32)"),
    # SequenceEmpty's dtype (float when left out) makes its sequence's element type
    "sequence_empty_double_declared_float": (
        _sequence_declared(_D, {}),
        "node 'empty' (SequenceEmpty, opset 17): output 0 's' is seq(tensor(float)) by SequenceEmpty-11, but "
        "the graph declares it seq(tensor(double))"),
    "sequence_empty_of_doubles_declared_float": (
        _sequence_declared(_F, {"dtype": _D}),
        "node 'empty' (SequenceEmpty, opset 17): output 0 's' is seq(tensor(double)) by SequenceEmpty-11, "
        "but the graph declares it seq(tensor(float))"),
}


@pytest.mark.parametrize("case", sorted(DECLARED_CASES))
def test_outputs_of_another_type_than_declared_are_refused_at_creation(case: str) -> None:
    """A node whose output is not of the type the graph declares for it is refused, as onnxruntime (the
    oracle: its "Type Error ... does not match expected type") refuses the model; the engine used to run
    it and return the node's own type."""
    model, piece = DECLARED_CASES[case]
    with pytest.raises(InvalidNodeError) as e:
        onnxtrain.InferenceSession(model.SerializeToString())
    assert piece in str(e.value), str(e.value)
    with pytest.raises(Exception, match="does not match expected type"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def test_a_wrong_declaration_is_one_error_not_a_cascade() -> None:
    """The nodes after a wrongly declared value are checked with the type its node makes: only the node
    whose output is declared wrong is named (onnxruntime, too, names only it)."""
    model, _ = DECLARED_CASES["value_info_int64_of_a_relu"]
    with pytest.raises(InvalidNodeError) as e:
        onnxtrain.InferenceSession(model.SerializeToString())
    assert "'relu'" in str(e.value) and "'neg'" not in str(e.value), str(e.value)
    with pytest.raises(Exception) as o:
        ort.InferenceSession(model.SerializeToString(), providers=CPU)
    assert "(r) of node (relu)" in str(o.value)


def test_legacy_training_session_refuses_a_wrong_declared_output_type() -> None:
    """A training graph's forward part is checked the same way: the loss declared double, made float."""
    w = numpy_helper.from_array(np.full((3, 3), 0.5, np.float32), "w")
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="mm"),
             helper.make_node("ReduceSumSquare", ["h"], ["loss"], name="loss_node", keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", _F, [2, 3])],
                          [helper.make_tensor_value_info("loss", _D, [])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    params = onnxtrain.TrainingParameters()
    params.loss_output_name = "loss"
    params.weights_to_train = {"w"}
    with pytest.raises(Exception, match=r"node 'loss_node' \(ReduceSumSquare, opset 17\): output 0 'loss' is "
                                        r"tensor\(float\) by ReduceSumSquare-13, but the graph declares it "
                                        r"tensor\(double\)"):
        onnxtrain.TrainingSession(model.SerializeToString(), params)
    with pytest.raises(Exception, match="does not match expected type"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


# ---- control flow: its outputs typed by its bodies, its bodies checked with the enclosing graph's types ---
def _loop_body(extra: str = "v", out_type: int = _F) -> onnx.GraphProto:
    """A Loop body adding ``extra`` (a body input, or a value of the enclosing graph) to its float carried
    value, its output declared of ``out_type``."""
    return helper.make_graph(
        [helper.make_node("Identity", ["c"], ["c_out"], name="keep"),
         helper.make_node("Add", ["v", extra], ["v_out"], name="inner")], "body",
        [helper.make_tensor_value_info("it", _I64, []), helper.make_tensor_value_info("c", _B, []),
         helper.make_tensor_value_info("v", _F, [2, 3])],
        [helper.make_tensor_value_info("c_out", _B, []),
         helper.make_tensor_value_info("v_out", out_type, [2, 3])])


def _control_flow_model(nodes: list[onnx.NodeProto], inputs: dict[str, int], y: int) -> onnx.ModelProto:
    ins = [helper.make_tensor_value_info(n, t, [] if t == _B else [2, 3]) for n, t in inputs.items()]
    g = helper.make_graph(nodes, "g", ins, [helper.make_tensor_value_info("y", y, [2, 3])],
                          [numpy_helper.from_array(np.array(2, np.int64), "n")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _if_node(out: str) -> onnx.NodeProto:
    then = helper.make_graph([helper.make_node("Identity", ["x"], ["t"], name="take")], "then", [],
                             [helper.make_tensor_value_info("t", _F, [2, 3])])
    other = helper.make_graph([helper.make_node("Neg", ["x"], ["e"], name="negate")], "else", [],
                              [helper.make_tensor_value_info("e", _F, [2, 3])])
    return helper.make_node("If", ["c"], [out], name="if", then_branch=then, else_branch=other)


# case → (model, the message's pattern); onnxruntime refuses each
CONTROL_FLOW_CASES = {
    # the body reads a double of the enclosing graph (a Cast's output) into a float Add
    "body_reads_an_outer_double": (
        _control_flow_model([helper.make_node("Cast", ["x"], ["d"], name="cast", to=_D),
                             helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop",
                                              body=_loop_body("d"))], {"x": _F}, _F),
        r"node 'loop' \(Loop\), body: node 'inner' \(Add, opset 17\): input 1 'd' is tensor\(double\), but T "
        r"of input 0 'v' is tensor\(float\)"),
    # an If's output is float by its branches, added to a double after it
    "if_output_added_to_a_double": (
        _control_flow_model([_if_node("r"), helper.make_node("Add", ["r", "xd"], ["y"], name="bad")],
                            {"x": _F, "c": _B, "xd": _D}, _D),
        r"node 'bad' \(Add, opset 17\): input 1 'xd' is tensor\(double\), but T of input 0 'r' is "
        r"tensor\(float\)"),
    # a body's output, float by its Add, declared double by the body
    "body_output_declared_double": (
        _control_flow_model([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop",
                                              body=_loop_body(out_type=_D))], {"x": _F}, _F),
        r"node 'loop' \(Loop\), body: node 'inner' \(Add, opset 17\): output 0 'v_out' is tensor\(float\) by "
        r"Add-14, but the graph declares it tensor\(double\)"),
    # a Loop's carried output, float by its body, declared double by the graph
    "loop_output_declared_double": (
        _control_flow_model([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=_loop_body())],
                            {"x": _F}, _D),
        r"node 'loop' \(Loop, opset 17\): output 0 'y' is tensor\(float\) by Loop-16, but the graph declares "
        r"it tensor\(double\)"),
}


@pytest.mark.parametrize("case", sorted(CONTROL_FLOW_CASES))
def test_control_flow_types_are_checked_as_onnxruntime_checks_them(case: str) -> None:
    model, pattern = CONTROL_FLOW_CASES[case]
    with pytest.raises(InvalidNodeError, match=pattern):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="Type Error|INVALID_GRAPH"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def test_valid_control_flow_with_outer_values_runs_as_onnxruntime() -> None:
    """The same shapes of graph, well typed: a body reading a float of the enclosing graph, an If's float
    output added to a float; the outputs equal onnxruntime's."""
    nodes = [helper.make_node("Neg", ["x"], ["d"], name="neg"),
             helper.make_node("Loop", ["n", "", "x"], ["l"], name="loop", body=_loop_body("d")),
             _if_node("r"), helper.make_node("Add", ["r", "l"], ["y"], name="add")]
    model = _control_flow_model(nodes, {"x": _F, "c": _B}, _F)
    x = np.linspace(-1, 2, 6, dtype=np.float32).reshape(2, 3)
    for c in (True, False):
        feeds = {"x": x, "c": np.array(c)}
        got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, feeds)
        want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)
        assert got[0].dtype == want[0].dtype == np.float32
        np.testing.assert_array_equal(got[0], want[0])


def _scan_body() -> onnx.GraphProto:
    """A Scan body: a float state [2, 3] plus each float row [3] of the scan input."""
    return helper.make_graph(
        [helper.make_node("Add", ["s", "row"], ["s_out"], name="inner"),
         helper.make_node("Identity", ["s_out"], ["row_out"], name="keep")], "body",
        [helper.make_tensor_value_info("s", _F, [2, 3]), helper.make_tensor_value_info("row", _F, [3])],
        [helper.make_tensor_value_info("s_out", _F, [2, 3]),
         helper.make_tensor_value_info("row_out", _F, [2, 3])])


def _scan_node() -> onnx.NodeProto:
    return helper.make_node("Scan", ["x0", "x"], ["y", "rows"], name="scan", body=_scan_body(),
                            num_scan_inputs=1)


# case → (model, the message's pattern): a value handed to a body input that the body declares of another
# type; onnxruntime refuses each ("Tensor element type mismatch")
BODY_INPUT_CASES = {
    "loop_carried_value": (
        _control_flow_model([helper.make_node("Loop", ["n", "", "x"], ["y"], name="loop", body=_loop_body())],
                            {"x": _D}, _F),
        r"node 'loop' \(Loop, opset 17\): input 2 'x' is tensor\(double\), but the body declares its input 2 "
        r"'v' tensor\(float\)"),
    "scan_state": (
        _control_flow_model([_scan_node()], {"x0": _D, "x": _F}, _F),
        r"node 'scan' \(Scan, opset 17\): input 0 'x0' is tensor\(double\), but the body declares its "
        r"input 0 's' tensor\(float\)"),
    "scan_input": (
        _control_flow_model([_scan_node()], {"x0": _F, "x": _D}, _F),
        r"node 'scan' \(Scan, opset 17\): input 1 'x' is tensor\(double\), but the body declares its "
        r"input 1 'row' tensor\(float\)"),
}


@pytest.mark.parametrize("case", sorted(BODY_INPUT_CASES))
def test_a_value_handed_to_a_body_input_of_another_type_is_refused(case: str) -> None:
    """A double handed to a body input declared float: the body's plan ran on its declaration (a float16 Sum
    declared float32 in a Loop body was summed as float32 Adds rounded to float16, 1,435 of 4,096 values
    off); onnxruntime refuses the model, and so does the engine now, naming the node, its input and the
    body's."""
    model, pattern = BODY_INPUT_CASES[case]
    with pytest.raises(InvalidNodeError, match=pattern):
        onnxtrain.InferenceSession(model.SerializeToString())
    with pytest.raises(Exception, match="element type mismatch"):
        ort.InferenceSession(model.SerializeToString(), providers=CPU)


def _shadowing_models() -> dict[str, tuple[onnx.ModelProto, dict[str, np.ndarray]]]:
    """Valid models whose bodies reuse an outer name for a value of another type: an If branch's Shape
    output named like the graph's float output, an untyped Loop body input named like a float graph input."""
    then = helper.make_graph([helper.make_node("Shape", ["x"], ["y"]),
                              helper.make_node("Cast", ["y"], ["t"], to=_F)], "then", [],
                             [helper.make_tensor_value_info("t", _F, [2])])
    other = helper.make_graph([helper.make_node("ReduceSum", ["x"], ["f"], keepdims=0)], "else", [],
                              [helper.make_tensor_value_info("f", _F, [])])
    g = helper.make_graph([helper.make_node("If", ["c"], ["z"], then_branch=then, else_branch=other),
                           helper.make_node("Relu", ["z"], ["y"])], "g",
                          [helper.make_tensor_value_info("c", _B, []),
                           helper.make_tensor_value_info("x", _F, [2, 3])],
                          [helper.make_tensor_value_info("y", _F, None)])
    branch = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cin"], ["cout"]), helper.make_node("Add", ["x", "one"], ["xo"])],
        "body",
        [helper.make_tensor_value_info("i", _I64, []), helper.make_tensor_value_info("cin", _B, []),
         helper.make_empty_tensor_value_info("x")],
        [helper.make_tensor_value_info("cout", _B, []), helper.make_empty_tensor_value_info("xo")],
        [numpy_helper.from_array(np.array(1, np.int64), "one")])
    g = helper.make_graph([helper.make_node("Loop", ["n", "", "k"], ["r"], body=body),
                           helper.make_node("Cast", ["r"], ["rf"], to=_F),
                           helper.make_node("Add", ["rf", "x"], ["out"])], "g",
                          [helper.make_tensor_value_info(n, t, [])
                           for n, t in (("n", _I64), ("k", _I64), ("x", _F))],
                          [helper.make_tensor_value_info("out", _F, [])])
    loop = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    return {"if_branch_output": (branch, {"c": np.array(True), "x": np.ones((2, 3), np.float32)}),
            "loop_body_input": (loop, {"n": np.array(3, np.int64), "k": np.array(2, np.int64),
                                       "x": np.array(0.5, np.float32)})}


@pytest.mark.parametrize("case", ["if_branch_output", "loop_body_input"])
def test_a_body_reusing_an_outer_name_runs_as_onnxruntime(case: str) -> None:
    """The enclosing graph's type of a name does not apply to a body value of that name (the check before
    the fix refused both: "'one' is tensor(int64), but T of input 0 'x' is tensor(float)")."""
    from onnxtrain.engine.plan import check_nodes

    model, feeds = _shadowing_models()[case]
    want = ort.InferenceSession(model.SerializeToString(), providers=CPU).run(None, feeds)
    got = onnxtrain.InferenceSession(model.SerializeToString()).run(None, feeds)
    np.testing.assert_array_equal(got[0], want[0])
    check_nodes(model)  # the whole-model listing (used when functions are expanded) agrees


def _float_plus_double() -> onnx.ModelProto:
    """loss = ReduceSum(x + c), x float and c a double initializer: invalid (onnxruntime refuses it)."""
    nodes = [helper.make_node("Add", ["x", "c"], ["z"], name="mixed"),
             helper.make_node("ReduceSum", ["z"], ["loss"], keepdims=0, name="total")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", _F, [2])],
                          [helper.make_tensor_value_info("loss", _F, [])],
                          [numpy_helper.from_array(np.ones(2, np.float64), "c")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_an_invalid_user_node_is_an_invalid_node_error_on_both_backends(backend: str) -> None:
    """The README's promise on either backend: an InvalidNodeError (onnxruntime's InvalidGraph). A legacy
    session names the user's node alone (on the numpy engine it also listed the training graph's Sqrt and Mul
    that the invalid node made invalid; on the onnxruntime backend it gave onnxruntime's message about the
    training graph); an InferenceSession on the onnxruntime backend gives onnxruntime's message."""
    from onnxtrain.capi.onnxruntime_pybind11_state import InvalidGraph

    so = onnxtrain.SessionOptions()
    if backend == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    model = _float_plus_double().SerializeToString()
    makers = (lambda: onnxtrain.TrainingSession(model, p, so), lambda: onnxtrain.InferenceSession(model, so))
    for make in makers:
        with pytest.raises(InvalidNodeError) as e:
            make()
        assert isinstance(e.value, InvalidGraph)
        if backend == "numpy" or make is makers[0]:
            assert str(e.value) == ("node 'mixed' (Add, opset 17): input 1 'c' is tensor(double), but T of "
                                    "input 0 'x' is tensor(float)")
        else:
            assert "Type Error" in str(e.value)


@pytest.mark.parametrize("op, opset, added, n_in", [("Swish", 23, 24, 1), ("RMSNormalization", 21, 23, 2),
                                                     ("Attention", 22, 23, 3)])
def test_an_op_used_before_its_opset_names_the_opset_that_added_it(op: str, opset: int, added: int,
                                                                    n_in: int) -> None:
    # it read "no kernel for node 'm' (Swish); ops with kernels: ... Swish ...", and the gradient builder
    # "Swish has no gradient rule"
    from onnxtrain.autodiff import GradientError, build_gradient_model

    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])
    node = helper.make_node(op, ["x"] * n_in, ["y"], name="m")
    loss = helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)
    out = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    graph = helper.make_graph([node, loss], "g", [x], [out])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)
    with pytest.raises(InvalidNodeError, match=f"node 'm' \\({op}, opset {opset}\\): {op} is not an operator "
                                               f"of opset {opset}: ONNX added it at opset {added}"):
        onnxtrain.InferenceSession(model.SerializeToString())
    why = f"'m' \\({op}, not an operator of opset {opset}: ONNX added it at opset {added}\\)"
    with pytest.raises(GradientError, match=why):
        build_gradient_model(model, "loss", ["x"])


# an op before the opset that defines it, or in a form deprecated at the model's opset: onnxruntime and the
# checker refuse the model at load; the engine ran most of them (Celu failed at run time on a KeyError) and
# the gradient builder failed in onnx's version converter, naming no node
OLD_OPSET_CASES = {
    "HardSwish_at_11": (helper.make_node("HardSwish", ["x"], ["y"], name="m"), 11,
                        "HardSwish is not an operator of opset 11: ONNX added it at opset 14"),
    "Celu_at_11": (helper.make_node("Celu", ["x"], ["y"], name="m"), 11,
                   "Celu is not an operator of opset 11: ONNX added it at opset 12"),
    "Gelu_at_11": (helper.make_node("Gelu", ["x"], ["y"], name="m"), 11,
                   "Gelu is not an operator of opset 11: ONNX added it at opset 20"),
    "Einsum_at_11": (helper.make_node("Einsum", ["x"], ["y"], name="m", equation="ij->ij"), 11,
                     "Einsum is not an operator of opset 11: ONNX added it at opset 12"),
    "Upsample_at_10": (helper.make_node("Upsample", ["x", "s"], ["y"], name="m"), 10,
                       "Upsample is deprecated at opset 10"),
    "Scatter_at_11": (helper.make_node("Scatter", ["x", "i", "x"], ["y"], name="m"), 11,
                      "Scatter is deprecated at opset 11"),
}


def _old_opset_model(node: onnx.NodeProto, opset: int) -> onnx.ModelProto:
    s = numpy_helper.from_array(np.array([1, 2], np.float32), "s")
    i = numpy_helper.from_array(np.zeros((2, 3), np.int64), "i")
    loss = helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)
    g = helper.make_graph([node, loss], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [s, i])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)


@pytest.mark.parametrize("case", sorted(OLD_OPSET_CASES))
def test_an_op_outside_the_models_opset_is_refused_naming_the_node(case: str) -> None:
    node, opset, why = OLD_OPSET_CASES[case]
    model = _old_opset_model(node, opset).SerializeToString()
    with pytest.raises(Exception, match="INVALID_GRAPH"):
        ort.InferenceSession(model, providers=CPU)
    expected = f"node 'm' ({node.op_type}, opset {opset}): {why}"
    for make in (lambda: onnxtrain.InferenceSession(model),
                 lambda: onnxtrain.GradientGraphBuilder(model, {"loss"}, {"x"}, "loss").build(),
                 lambda: onnxtrain.TrainingSession(model, params())):
        with pytest.raises(InvalidNodeError) as e:
            make()
        assert str(e.value).startswith(expected), str(e.value)


def test_layer_normalization_below_opset_17_runs_as_onnxruntime() -> None:
    # onnxruntime registers its own LayerNormalization kernel in ONNX's domain from opset 1
    scale = numpy_helper.from_array(np.array([1.0, 2.0, 0.5], np.float32), "scale")
    node = helper.make_node("LayerNormalization", ["x", "scale"], ["y"], name="ln", axis=-1, epsilon=1e-5)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])], [scale])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)], ir_version=7)
    model = model.SerializeToString()
    x = np.array([[1, 2, 4], [-1, 0, 3]], np.float32)
    want = ort.InferenceSession(model, providers=CPU).run(None, {"x": x})[0]
    np.testing.assert_allclose(onnxtrain.InferenceSession(model).run(None, {"x": x})[0], want, rtol=1e-6)


def _gemm_like(node_name: str) -> bytes:
    """A MatMul + Add model (the engine fuses the pair, naming both in the fused step) whose MatMul node is
    named ``node_name``, serialized; the name's placeholder ``mm0`` is swapped for bytes afterwards."""
    w = numpy_helper.from_array(np.arange(12, dtype=np.float32).reshape(4, 3), "W")
    b = numpy_helper.from_array(np.array([1, -2, 3], np.float32), "B")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["mm"], name=node_name),
             helper.make_node("Add", ["mm", "B"], ["y"], name="add0")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w, b])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 10
    return m.SerializeToString()


def test_a_node_name_that_is_not_utf8_only_labels_the_node():
    """protobuf gives a string field that is not valid UTF-8 as bytes: such a node name crashed the fusion
    pass with a bare TypeError; onnxruntime runs the model, and so does the engine now, and trains it."""
    data = _gemm_like("mm0").replace(b"mm0", b"m\xff0")
    assert isinstance(onnx.load_from_string(data).graph.node[0].name, bytes)
    x = np.arange(8, dtype=np.float32).reshape(2, 4)
    want = ort.InferenceSession(data, providers=CPU).run(None, {"x": x})[0]
    got = onnxtrain.InferenceSession(data).run(None, {"x": x})[0]
    np.testing.assert_array_equal(got, want)


def test_a_value_name_that_is_not_utf8_is_refused_naming_its_node():
    """A value name is not decoded (a reader would not find it under the decoded name): the node reading
    it is named as reading a value nothing makes."""
    data = _gemm_like("mm0").replace(b"\x12\x02mm", b"\x12\x02m\xff")  # the MatMul's output "mm"
    with pytest.raises(EngineError, match=r"node 'add0' \(Add\): input 'mm' is not produced"):
        onnxtrain.InferenceSession(data)


def test_an_unnamed_node_reading_an_undefined_value_is_labelled_by_its_index():
    """Errors name an unnamed node ``#k (unnamed)``, as the README's error labels do (it was ``node ''``)."""
    g = onnx.helper.make_graph(
        [onnx.helper.make_node("Relu", ["x"], ["r"]), onnx.helper.make_node("Add", ["r", "nope"], ["y"])],
        "g",
        [onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [2])],
        [onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [2])])
    model = onnx.helper.make_model(g, opset_imports=[onnx.helper.make_opsetid("", 17)])
    with pytest.raises(EngineError, match=r"node #1 \(unnamed\) \(Add\): input 'nope' is not produced"):
        onnxtrain.InferenceSession(model.SerializeToString())
