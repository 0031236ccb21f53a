"""A body (If branch, Loop body) that defines again, as a node output, a name an enclosing graph defines
before the body's node breaks ONNX's single-assignment rule: onnx.checker and onnxruntime refuse the model,
and so must every onnxtrain session and builder (the names were checked body by body, each on its own). A
body's inputs and initializers may take an enclosing graph's names, and a body may use a name the enclosing
graph defines only after the body's node (or as that node's output): both oracles accept those, and so does
onnxtrain, with onnxruntime's values."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.autodiff import build_gradient_model
from onnxtrain.errors import Fail

ort = pytest.importorskip("onnxruntime")
N, F = helper.make_node, TensorProto.FLOAT
W0 = np.linspace(-0.5, 0.5, 12, dtype=np.float32).reshape(4, 3)
X = np.linspace(-1, 1, 8, dtype=np.float32).reshape(2, 4)


def _vi(name: str, dims: list | None = (2, 3), et: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, et, None if dims is None else list(dims))


def _then(nodes: list[onnx.NodeProto], out: str, inits: list[onnx.TensorProto] = ()) -> onnx.GraphProto:
    return helper.make_graph(nodes, "then", [], [_vi(out)], list(inits))


def _else() -> onnx.GraphProto:
    nodes = [N("MatMul", ["x", "W"], ["m2"]), N("Tanh", ["m2"], ["e"])]
    return helper.make_graph(nodes, "else", [], [_vi("e")])


def _model(then: onnx.GraphProto | None = None, before: list[onnx.NodeProto] | None = None,
           after: list[onnx.NodeProto] = (), loop: onnx.NodeProto | None = None) -> onnx.ModelProto:
    """h = x @ W; f = If(c, then, else) (or ``loop``); loss = sum(f + h)."""
    control = loop or N("If", ["c"], ["f"], then_branch=then, else_branch=_else())
    nodes = [*(before if before is not None else [N("MatMul", ["x", "W"], ["h"])]), control, *after,
             N("Add", ["f", "h"], ["s"]), N("ReduceSum", ["s"], ["loss"], keepdims=0)]
    inits = [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(np.array(2, np.int64), "n")]
    g = helper.make_graph(nodes, "g", [_vi("x", [2, 4]), _vi("c", [], TensorProto.BOOL)], [_vi("loss", [])],
                          inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _loop(body_nodes: list[onnx.NodeProto], carried: str = "acc") -> onnx.NodeProto:
    """f = Loop(n) over a body carrying ``carried`` (started from h)."""
    body = helper.make_graph(
        [N("Identity", ["cond_in"], ["cond_out"]), *body_nodes], "body",
        [_vi("it", [], TensorProto.INT64), _vi("cond_in", [], TensorProto.BOOL), _vi(carried)],
        [_vi("cond_out", [], TensorProto.BOOL), _vi("acc_out")])
    return N("Loop", ["n", "", "h"], ["f"], body=body)


# --- refused: a body node writes a name an enclosing graph defines


def _node_output_like_outer_output() -> onnx.ModelProto:
    return _model(_then([N("MatMul", ["x", "W"], ["m"]), N("Sigmoid", ["m"], ["h"])], "h"))


def _node_output_like_outer_input() -> onnx.ModelProto:
    return _model(_then([N("MatMul", ["x", "W"], ["m"]), N("Cast", ["m"], ["c"], to=F),
                         N("Sigmoid", ["c"], ["r"])], "r"))


def _constant_like_outer_initializer() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((4, 3), 0.2, np.float32))
    return _model(_then([N("Constant", [], ["W"], value=w), N("MatMul", ["x", "W"], ["m"]),
                         N("Sigmoid", ["m"], ["r"])], "r"))


def _nested_body_like_outer_output() -> onnx.ModelProto:
    """An If inside a Loop body whose branch writes the outer graph's 'h'."""
    inner = _then([N("Sigmoid", ["acc"], ["h"])], "h")
    other = helper.make_graph([N("Tanh", ["acc"], ["e"])], "else", [], [_vi("e")])
    return _model(loop=_loop([N("If", ["cond_in"], ["acc_out"], then_branch=inner, else_branch=other)]))


def _nested_body_like_body_input() -> onnx.ModelProto:
    """An If inside a Loop body whose branch writes the Loop body's carried input 'acc'."""
    inner = _then([N("Sigmoid", ["h"], ["acc"])], "acc")
    other = helper.make_graph([N("Tanh", ["acc"], ["e"])], "else", [], [_vi("e")])
    return _model(loop=_loop([N("If", ["cond_in"], ["acc_out"], then_branch=inner, else_branch=other)]))


REFUSED = [(_node_output_like_outer_output, "h", "then", "node #0 \\(unnamed\\) \\(MatMul\\) of graph 'g'"),
           (_node_output_like_outer_input, "c", "then", "a graph input of graph 'g'"),
           (_constant_like_outer_initializer, "W", "then", "an initializer of graph 'g'"),
           (_nested_body_like_outer_output, "h", "then", ".*of graph 'g'"),
           (_nested_body_like_body_input, "acc", "then", "a graph input of graph 'body'")]


def _params() -> onnxtrain.TrainingParameters:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    return p


@pytest.mark.parametrize("make, name, body, definer", REFUSED)
def test_body_node_output_redefining_an_enclosing_name_is_refused(make, name: str, body: str,
                                                                  definer: str) -> None:
    m = make()
    with pytest.raises(onnx.checker.ValidationError, match=f"SSA.*'{name}'"):
        onnx.checker.check_model(m, full_check=True)
    with pytest.raises(Exception, match="(?i)invalid"):
        ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    data = m.SerializeToString()
    want = f"in body '{body}' writes '{name}', which {definer}.* already defines"
    for build in (lambda: onnxtrain.InferenceSession(data),
                  lambda: onnxtrain.TrainingSession(data, _params()),
                  lambda: onnxtrain.GradientGraphBuilder(data, {"loss"}, {"W"}, "loss"),
                  lambda: build_gradient_model(m, "loss", ["W"])):
        with pytest.raises(Fail, match=want):
            build()


# --- accepted: names a body may take


def _body_input_like_outer_output() -> onnx.ModelProto:
    return _model(loop=_loop([N("Sigmoid", ["h"], ["q"]), N("Add", ["q", "x2"], ["acc_out"])], carried="h"),
                  before=[N("MatMul", ["x", "W"], ["h"]), N("Sin", ["h"], ["x2"])])


def _body_input_like_outer_initializer() -> onnx.ModelProto:
    return _model(loop=_loop([N("Sigmoid", ["W"], ["q"]), N("Mul", ["q", "h"], ["acc_out"])], carried="W"))


def _body_initializer_like_outer_initializer() -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((4, 3), 0.3, np.float32), "W")
    return _model(_then([N("MatMul", ["x", "W"], ["m"]), N("Sigmoid", ["m"], ["r"])], "r", [w]))


def _body_output_defined_later_outside() -> onnx.ModelProto:
    then = _then([N("MatMul", ["x", "W"], ["m"]), N("Sigmoid", ["m"], ["q"])], "q")
    return _model(then, after=[N("Relu", ["h"], ["q"]), N("Add", ["h", "q"], ["h2"])])


def _body_output_like_the_if_output() -> onnx.ModelProto:
    return _model(_then([N("MatMul", ["x", "W"], ["m"]), N("Sigmoid", ["m"], ["f"])], "f"))


ACCEPTED = [_body_input_like_outer_output, _body_input_like_outer_initializer,
            _body_output_defined_later_outside, _body_output_like_the_if_output]


@pytest.mark.parametrize("make", ACCEPTED)
@pytest.mark.parametrize("c", [True, False])
def test_names_a_body_may_take_run_as_onnxruntime_runs_them(make, c: bool) -> None:
    m = make()
    onnx.checker.check_model(m, full_check=True)
    feeds = {"x": X, "c": np.array(c)}
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(["loss"], feeds)
    got = onnxtrain.InferenceSession(m.SerializeToString()).run(["loss"], feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=1e-6)
    grad = build_gradient_model(m, "loss", ["W"])
    onnx.checker.check_model(grad, full_check=True)


def test_body_initializer_named_like_an_outer_value_loads() -> None:
    """Both oracles load a branch whose initializer takes the outer initializer's name; so does onnxtrain.
    (Which of the two values the branch then reads is left out here: onnxruntime and onnx.reference read
    the outer one.)"""
    data = _body_initializer_like_outer_initializer().SerializeToString()
    onnx.checker.check_model(onnx.load_from_string(data), full_check=True)
    ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    onnxtrain.InferenceSession(data)
    onnxtrain.TrainingSession(data, _params())
