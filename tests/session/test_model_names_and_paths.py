"""Models that break ONNX's naming rules are refused as onnxruntime refuses them (a name defined twice) or
named (nodes out of order); the learning-rate feed's name must be its own; a path-only run needs only the
inputs on the path to its fetches (onnxruntime's label-less ``eval_step``)."""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.errors import Fail
from onnxtrain.training import artifacts
from tests.session.helpers import params

ort = pytest.importorskip("onnxruntime")
RNG = np.random.default_rng(11)
W0 = RNG.standard_normal((4, 3)).astype(np.float32)


def _mlp() -> onnx.ModelProto:
    """x @ W + B → logits; a squared-error loss against y; probability = LogSoftmax(logits)."""
    nodes = [helper.make_node("MatMul", ["x", "W"], ["xw"], name="mm"),
             helper.make_node("Add", ["xw", "B"], ["logits"], name="add"),
             helper.make_node("LogSoftmax", ["logits"], ["probability"], name="lsm", axis=1),
             helper.make_node("Sub", ["logits", "y"], ["d"], name="sub"),
             helper.make_node("Mul", ["d", "d"], ["dd"], name="sq"),
             helper.make_node("ReduceMean", ["dd"], ["loss"], name="mean", keepdims=0)]
    graph = helper.make_graph(
        nodes, "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
         helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("probability", TensorProto.FLOAT, ["N", 3])],
        [numpy_helper.from_array(W0, "W"), numpy_helper.from_array(np.zeros(3, np.float32), "B")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _twice_written() -> onnx.ModelProto:
    m = _mlp()
    m.graph.node.insert(1, helper.make_node("Neg", ["xw"], ["xw"], name="neg"))
    return m


def _output_named_like_input() -> onnx.ModelProto:
    m = _mlp()  # the MatMul writes 'x': with a square W the gradient came out wrong, silently
    m.graph.node[0].output[0] = "x"
    m.graph.node[1].input[0] = "x"
    return m


def _initializer_named_like_output() -> onnx.ModelProto:
    m = _mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.zeros((5, 3), np.float32), "xw"))
    return m


def _input_declared_twice() -> onnx.ModelProto:
    m = _mlp()
    m.graph.input.append(copy.deepcopy(m.graph.input[0]))
    return m


@pytest.mark.parametrize("make, name", [(_twice_written, "xw"), (_output_named_like_input, "x"),
                                        (_initializer_named_like_output, "xw"), (_input_declared_twice, "x")])
def test_a_name_defined_twice_is_refused_as_onnxruntime_refuses_it(make, name: str) -> None:
    data = make().SerializeToString()
    with pytest.raises(Exception, match="(?i)duplicate definition"):
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for build in (lambda: onnxtrain.InferenceSession(data),
                  lambda: onnxtrain.TrainingSession(data, params()),
                  lambda: onnxtrain.GradientGraphBuilder(data, {"loss"}, {"W", "B"}, "loss")):
        with pytest.raises(Fail, match=f"'{name}'"):
            build()


def test_a_name_defined_twice_in_a_body_is_refused() -> None:
    then = helper.make_graph([helper.make_node("Neg", ["x"], ["t"]), helper.make_node("Abs", ["x"], ["t"])],
                             "then", [], [helper.make_tensor_value_info("t", TensorProto.FLOAT, None)])
    other = helper.make_graph([helper.make_node("Abs", ["x"], ["e"])], "else", [],
                              [helper.make_tensor_value_info("e", TensorProto.FLOAT, None)])
    graph = helper.make_graph(
        [helper.make_node("If", ["c"], ["y"], then_branch=then, else_branch=other)], "g",
        [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
         helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    data = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(Fail, match="graph 'then'.*'t'"):
        onnxtrain.InferenceSession(data.SerializeToString())


def _reversed(m: onnx.ModelProto) -> onnx.ModelProto:
    nodes = list(m.graph.node)
    m.graph.ClearField("node")
    m.graph.node.extend(reversed(nodes))
    return m


def test_nodes_out_of_order_are_sorted_as_onnxruntime_sorts_them(tmp_path) -> None:
    """A hand-built graph listing its nodes out of order: onnxruntime sorts them at load and runs it (it was
    refused here, naming the first node that read a later value); a cycle is still refused."""
    x = np.random.default_rng(0).standard_normal((5, 4)).astype(np.float32)
    y = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    ordered, backwards = _mlp().SerializeToString(), _reversed(_mlp()).SerializeToString()
    want = ort.InferenceSession(backwards, providers=["CPUExecutionProvider"]).run(None, {"x": x, "y": y})
    got = onnxtrain.InferenceSession(backwards).run(None, {"x": x, "y": y})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-6)
    lr = np.array([0.1], np.float32)
    runs = []
    for model in (ordered, backwards):
        sess = onnxtrain.TrainingSession(model, params())
        runs.append([sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})[0] for _ in range(3)])
    np.testing.assert_array_equal(runs[0], runs[1])
    for folder, model in (("a", _mlp()), ("b", _reversed(_mlp()))):
        (tmp_path / folder).mkdir()
        artifacts.generate_artifacts(model, requires_grad=["W", "B"], loss=None,
                                     artifact_directory=str(tmp_path / folder))
    grads = [onnxtrain.GradientGraphBuilder(m, {"loss"}, {"W"}, "loss") for m in (ordered, backwards)]
    for b in grads:
        b.build()
    assert onnx.load_from_string(grads[0].get_model()).graph.output == \
        onnx.load_from_string(grads[1].get_model()).graph.output
    cycle = _mlp()
    cycle.graph.node[0].input[0] = "d"  # mm reads sub's output, which reads mm's through add
    with pytest.raises(Fail, match="topological order"):
        onnxtrain.InferenceSession(cycle.SerializeToString())


def test_a_weight_that_reaches_the_loss_only_through_ops_without_a_gradient_is_named() -> None:
    """Left to find its weights, the session said only "no trainable weight reaches the loss; check
    weights_to_train": it now names the weight and the node that stops its gradient, as it does when the
    weight is named in weights_to_train and as the gradient builder does."""
    w = numpy_helper.from_array(np.ones(4, np.float32), "W")
    nodes = [helper.make_node("Mul", ["x", "W"], ["a"], name="scale"),
             helper.make_node("Round", ["a"], ["b"], name="rounding"),
             helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0, name="total")]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    with pytest.raises(Fail, match="no trainable weight reaches the loss: 'W' does not reach 'loss' through "
                                   "a differentiable path \\(it passes through 'rounding' \\(Round\\)"):
        onnxtrain.TrainingSession(data, params())


@pytest.mark.parametrize("name, why", [("loss", "node 'mean' \\(ReduceMean\\) computes it"),
                                       ("logits", "node 'add' \\(Add\\) computes it"),
                                       ("W", "an initializer"), ("", "must name the learning-rate feed"),
                                       ("x", "of shape \\['N', 4\\], not one value")])
def test_learning_rate_feed_named_like_a_value_of_the_model_is_refused(name: str, why: str) -> None:
    # 'loss' stepped with the computed loss as its learning rate (27.5 times the fed rate), silently
    with pytest.raises(ValueError, match=why):
        onnxtrain.TrainingSession(_mlp().SerializeToString(), params(lr_params_feed_name=name))


@pytest.mark.parametrize("value", ["logits", "W"])
def test_a_model_value_named_like_the_accumulation_output_is_refused_by_name(value: str) -> None:
    """Under gradient accumulation the session adds ``Group_Accumulated_Gradients``; a model value of that
    name (here a node output or an initializer) was refused as a type clash between two unrelated nodes."""
    m = _mlp()
    for n in m.graph.node:
        n.input[:] = ["Group_Accumulated_Gradients" if x == value else x for x in n.input]
        n.output[:] = ["Group_Accumulated_Gradients" if x == value else x for x in n.output]
    for t in m.graph.initializer:
        t.name = "Group_Accumulated_Gradients" if t.name == value else t.name
    p = params(gradient_accumulation_steps=2)
    if value == "W":
        p.weights_to_train = {"B"}
    with pytest.raises(ValueError, match="a value named 'Group_Accumulated_Gradients'.*rename it"):
        onnxtrain.TrainingSession(m.SerializeToString(), p)
    onnxtrain.TrainingSession(_mlp().SerializeToString(), p)  # the same options train the model as it was


def test_learning_rate_feed_may_be_a_one_value_float_input() -> None:
    m = _mlp()
    m.graph.input.append(helper.make_tensor_value_info("rate", TensorProto.FLOAT, [1]))
    s = onnxtrain.TrainingSession(m.SerializeToString(), params(lr_params_feed_name="rate"))
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 3)).astype(np.float32)
    s.run(["loss"], {"x": x, "y": y, "rate": np.array([0.1], np.float32)})
    d = x @ W0 - y  # B starts at zero
    np.testing.assert_allclose(s.get_state()["W"], W0 - 0.1 * x.T @ (2 * d / d.size), rtol=1e-5, atol=1e-6)


def _path_only() -> onnxtrain.RunOptions:
    ro = onnxtrain.RunOptions()
    ro.only_execute_path_to_fetches = True
    return ro


def test_path_only_evaluation_needs_only_the_inputs_on_the_path() -> None:
    # onnxruntime's MNIST test evaluated with the data alone: eval_step(data, fetches=['probability'])
    data = _mlp().SerializeToString()
    x = RNG.standard_normal((6, 4)).astype(np.float32)
    logits = x.astype(np.float64) @ W0  # B starts at zero
    want = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    s = onnxtrain.TrainingSession(data, params())
    before = s.get_state()
    got = s.run(["probability"], {"x": x}, _path_only())[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for k, v in s.get_state().items():
        np.testing.assert_array_equal(v, before[k])  # an evaluation: nothing updated
    inf = onnxtrain.InferenceSession(data)
    got = inf.run(["probability"], {"x": x}, _path_only())[0]
    np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    for sess in (s, inf):  # without the option every input is needed, as before
        with pytest.raises(ValueError, match="missing input"):
            sess.run(["probability"], {"x": x})


def test_an_empty_model_file_is_refused_by_name(tmp_path) -> None:
    path = tmp_path / "empty.onnx"
    path.write_bytes(b"")  # it loaded as a model of no graph: run() returned []
    with pytest.raises(Exception, match="No graph was found"):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    for build in (lambda: onnxtrain.InferenceSession(str(path)),
                  lambda: onnxtrain.TrainingSession(str(path), params())):
        with pytest.raises(RuntimeError, match="empty.onnx .0 bytes. holds no graph"):
            build()


def test_an_initializer_whose_data_does_not_fill_its_shape_is_refused_by_name() -> None:
    m = _mlp()
    m.graph.initializer[0].dims[:] = [4, 4]  # 12 values: a bare numpy reshape error named nothing
    data = m.SerializeToString()
    with pytest.raises(ort.capi.onnxruntime_pybind11_state.Fail, match="Incompatible dimensions"):
        ort.InferenceSession(data, providers=["CPUExecutionProvider"])
    for build in (lambda: onnxtrain.InferenceSession(data),
                  lambda: onnxtrain.TrainingSession(data, params())):
        with pytest.raises(Fail, match="initializer 'W' of shape \\[4, 4\\] holds 48 bytes"):
            build()


def test_an_integer_loss_is_named() -> None:
    m = _mlp()
    m.graph.node.append(helper.make_node("Cast", ["loss"], ["iloss"], name="to_int", to=TensorProto.INT64))
    m.graph.output.append(helper.make_tensor_value_info("iloss", TensorProto.INT64, []))
    with pytest.raises(ValueError, match="loss_output_name 'iloss' is a tensor of int64"):  # it blamed
        onnxtrain.TrainingSession(m.SerializeToString(),  # weights_to_train
                                  params(loss_output_name="iloss"))


def test_a_loss_of_many_values_trains_on_their_sum_with_a_warning() -> None:
    m = _mlp()
    m.graph.node.append(helper.make_node("Mul", ["d", "d"], ["per_value"], name="sq2"))
    m.graph.output.append(helper.make_tensor_value_info("per_value", TensorProto.FLOAT, ["N", 3]))
    with pytest.warns(UserWarning, match="'per_value' is declared of shape \\['N', 3\\].*sum of its values"):
        s = onnxtrain.TrainingSession(m.SerializeToString(), params(loss_output_name="per_value"))
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 3)).astype(np.float32)
    s.run(["per_value"], {"x": x, "y": y, "Learning_Rate": np.array([0.01], np.float32)})
    d = x.astype(np.float64) @ W0 - y
    np.testing.assert_allclose(s.get_state()["W"], W0 - 0.01 * x.T @ (2 * d), rtol=1e-5, atol=1e-6)


def test_an_integer_weight_asked_for_is_left_out_with_a_warning() -> None:
    m = _mlp()
    m.graph.initializer.append(numpy_helper.from_array(np.array([2], np.int64), "reps"))
    m.graph.node.append(helper.make_node("Tile", ["probability", "reps"], ["tiled"], name="tile"))
    m.graph.output.append(helper.make_tensor_value_info("tiled", TensorProto.FLOAT, None))
    with pytest.warns(UserWarning, match="\\['reps'\\] are not of a float type and are not trained"):
        s = onnxtrain.TrainingSession(m.SerializeToString(), params(weights_to_train={"W", "reps"}))
    assert "reps" not in s.get_state() or s.get_state()["reps"].dtype == np.int64


def test_a_micro_step_without_the_loss_scale_is_refused_as_a_missing_input() -> None:
    # it failed inside the graph (a TypeError about None at node 'LossScale_Mul')
    from onnxtrain import zoo

    p = params(training_optimizer_name="AdamOptimizer", use_mixed_precision=True,
                gradient_accumulation_steps=4, gradient_accumulation_mode="auto")
    s = onnxtrain.TrainingSession(zoo.mlp([16, 8, 10]).SerializeToString(), p)
    x, y = RNG.standard_normal((8, 16)).astype(np.float32), RNG.integers(0, 10, 8)
    with pytest.raises(ValueError, match="missing input\\(s\\) \\['loss_scale'\\]"):
        s.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([1e-3], np.float32)})


def test_weights_also_declared_as_inputs_train() -> None:
    # IR < 4 and torch's keep_initializers_as_inputs list each weight as an input too: the legacy session
    # declared them a second time in its graphs and refused the model
    m = _mlp()
    m.graph.input.extend(helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
                         for t in m.graph.initializer)
    m.ir_version = 3
    m.opset_import[0].version = 9
    m.graph.node[-1].ClearField("attribute")  # ReduceMean-9 takes keepdims as an attribute; mean of all
    m.graph.node[-1].attribute.append(helper.make_attribute("keepdims", 0))
    s = onnxtrain.TrainingSession(m.SerializeToString(), params())
    x, y = RNG.standard_normal((5, 4)).astype(np.float32), RNG.standard_normal((5, 3)).astype(np.float32)
    s.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    d = x.astype(np.float64) @ W0 - y
    np.testing.assert_allclose(s.get_state()["W"], W0 - 0.1 * x.T @ (2 * d / d.size), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("case", ["two initializers", "Constant over an initializer", "two Constants"])
def test_repeated_constants_take_the_last_as_onnxruntime(case: str) -> None:
    # onnxruntime warns and takes the last definition; they were refused as duplicates
    first = numpy_helper.from_array(np.array([1.0, 1.0], np.float32), "c")
    last = np.array([2.0, 1.0], np.float32)
    nodes = [helper.make_node("Mul", ["x", "c"], ["y"])]
    inits = [first]
    if case == "two initializers":
        inits.append(numpy_helper.from_array(last, "c"))
    else:
        if case == "two Constants":
            inits = []
            nodes.insert(0, helper.make_node("Constant", [], ["c"], value=first))
        again = helper.make_node("Constant", [], ["c"], value=numpy_helper.from_array(last))
        nodes.insert(len(nodes) - 1, again)
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    data = model.SerializeToString()
    x = np.array([3.0, 3.0], np.float32)
    so = ort.SessionOptions()
    so.log_severity_level = 3
    want = ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    np.testing.assert_array_equal(onnxtrain.InferenceSession(data).run(None, {"x": x})[0], want)
