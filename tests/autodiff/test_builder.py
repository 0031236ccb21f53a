"""GradientGraphBuilder and build_gradient_model: interface, leanness, stop-gradient, errors, CLI."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import GradientGraphBuilder
from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, run_engine, to_float64
from tests.session.helpers import mlp_model


def _model(nodes, inputs, outputs, inits=(), opset=17):
    g = helper.make_graph(nodes, "m", inputs, outputs, list(inits))
    return make_model(g, opset)


def test_builder_api_outputs_and_order(tmp_path) -> None:
    model = mlp_model(loss="mse")
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W2", "b1", "W1"}, "loss")
    b.build()
    m = onnx.load_from_string(b.get_model())
    names = [o.name for o in m.graph.output]
    assert names == ["loss", "logits", "W1_grad", "W2_grad", "b1_grad"]  # a set comes out sorted
    onnx.checker.check_model(m, full_check=True)
    b.save(tmp_path / "g.onnx")
    assert onnx.load(str(tmp_path / "g.onnx")).graph.output[2].name == "W1_grad"
    b2 = GradientGraphBuilder(model.SerializeToString(), ["loss"], ["b1", "W1"], "loss")
    b2.build()
    assert [o.name for o in onnx.load_from_string(b2.get_model()).graph.output][2:] == ["b1_grad", "W1_grad"]


def _pred_then_loss(loss_is_output: bool) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.array([[1.5, -2.0], [0.5, 1.0]]), "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["pred"]),
             helper.make_node("Sub", ["pred", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceSum", ["d2"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("pred", T.DOUBLE, [3, 2])]
    if loss_is_output:
        outputs.append(helper.make_tensor_value_info("loss", T.DOUBLE, []))
    inputs = [helper.make_tensor_value_info(n, T.DOUBLE, [3, 2]) for n in ("x", "y")]
    return _model(nodes, inputs, outputs, [w])


@pytest.mark.parametrize("loss_is_output", [True, False])
def test_builder_keeps_the_model_outputs_in_place_as_onnxruntime(loss_is_output: bool) -> None:
    """onnxruntime's builder appended the gradients to the model's outputs, in their order; a loss that was
    no output stayed none. Values: the forward's from onnx.reference, the gradient from finite
    differences."""
    model = _pred_then_loss(loss_is_output)
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"W", "x"}, "loss")
    assert b.get_model() == model.SerializeToString()  # before build(): the model as given
    b.build()
    m = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(m, full_check=True)
    want = ["pred", "loss"] if loss_is_output else ["pred"]
    assert [o.name for o in m.graph.output] == want + ["W_grad", "x_grad"]
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, 2)), "y": rng.standard_normal((3, 2))}
    got = dict(zip([o.name for o in m.graph.output], run_engine(m, feeds)))
    from onnx.reference import ReferenceEvaluator

    ref = ReferenceEvaluator(model).run(None, feeds)
    for name, value in zip(want, ref):
        np.testing.assert_allclose(got[name], value, rtol=1e-12)
    gradcheck(_pred_then_loss(True), "loss", ["W"], feeds)
    w = numpy_helper.to_array(model.graph.initializer[0])
    np.testing.assert_allclose(got["W_grad"], feeds["x"].T @ (2 * (feeds["x"] @ w - feeds["y"])), rtol=1e-12)


def test_ys_no_gradient_reaches_are_ignored_as_onnxruntime_ignored_them() -> None:
    """ys that are graph inputs, of an integer type, or that no x reaches take no incoming gradient (an
    input ``<y>_grad`` with no reader, int64 for an ArgMax, had to be fed); onnxruntime's builder logged and
    ignored them. The built model runs in onnxruntime with the ys' own feeds only, its gradients those of
    the loss alone (its closed form)."""
    import onnxruntime as ort

    model = _pred_then_loss(True)
    g = model.graph
    g.node.extend([helper.make_node("ArgMax", ["pred"], ["top"], axis=1),
                   helper.make_node("Neg", ["y"], ["other"])])
    g.output.extend([helper.make_tensor_value_info("top", T.INT64, [3, 1]),
                     helper.make_tensor_value_info("other", T.DOUBLE, [3, 2])])
    b = GradientGraphBuilder(model.SerializeToString(), ["loss", "top", "other", "y"], ["W"], "loss")
    with pytest.warns(UserWarning, match=r"\['top', 'other', 'y'\] are not differentiable"):
        b.build()
    m = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(m, full_check=True)
    assert [i.name for i in m.graph.input] == ["x", "y"]
    rng = np.random.default_rng(4)
    feeds = {"x": rng.standard_normal((3, 2)), "y": rng.standard_normal((3, 2))}
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in m.graph.output], sess.run(None, feeds)))
    w = numpy_helper.to_array(g.initializer[0])
    want = 2 * feeds["x"].T @ (feeds["x"] @ w - feeds["y"])  # d/dW of sum((xW − y)²)
    np.testing.assert_allclose(got["W_grad"], want, rtol=1e-12)


def test_builder_errors_are_runtime_errors_as_onnxruntime() -> None:
    model = _pred_then_loss(True)
    with pytest.raises(RuntimeError, match="nope"):
        GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"nope"}, "loss").build()
    with pytest.raises(ValueError, match="nope"):  # GradientError: also the ValueError it was
        GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"nope"}, "loss").build()


def test_gradients_match_finite_differences_on_an_mlp() -> None:
    model = to_float64(mlp_model(loss="mse"))
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((5, 8)), "y": rng.standard_normal((5, 4))}
    gradcheck(model, "loss", ["W1", "b1", "W2", "b2"], feeds)


@pytest.mark.parametrize("opset", [9, 13])
def test_to_float64_keeps_resize_scales_float32(opset: int) -> None:
    """Resize's and Upsample's scales take float32 only: to_float64 made them float64 (an invalid model that
    gradcheck could not run); they are cast back, and the gradient matches finite differences."""
    op, ins = ("Upsample", ["x", "s"]) if opset == 9 else ("Resize", ["x", "", "s"])
    g = helper.make_graph([helper.make_node(op, ins, ["y"], name="up", mode="linear"),
                           helper.make_node("Mul", ["y", "y"], ["y2"]),
                           helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", T.FLOAT, [1, 1, 2, 3])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])],
                          [numpy_helper.from_array(np.array([1, 1, 2, 1.5], np.float32), "s")])
    model = to_float64(helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8))
    onnx.checker.check_model(model, full_check=True)
    x = np.random.default_rng(0).standard_normal((1, 1, 2, 3))
    gradcheck(model, "loss", ["x"], {"x": x})


def test_batch_norm_7_spatial_0_on_a_matrix_has_its_gradient() -> None:
    """BatchNormalization-7 with spatial=0 on an (N, C) input (per-channel statistics, as spatial=1): the
    gradient builder failed in onnx's converter, naming no node; checked against finite differences."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(v, k) for k, v in
             {"sc": np.array([1.5, 0.5]), "b": np.array([0.1, -0.2]), "mean": np.array([0.3, -0.1]),
              "var": np.array([0.8, 1.3])}.items()]
    nodes = [helper.make_node("BatchNormalization", ["x", "sc", "b", "mean", "var"], ["y"], name="bn",
                              epsilon=1e-3, spatial=0),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.DOUBLE, [3, 2])],
                          [helper.make_tensor_value_info("loss", T.DOUBLE, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 7)], ir_version=7)
    gradcheck(model, "loss", ["x", "sc", "b"], {"x": rng.standard_normal((3, 2))})


def test_value_used_twice_gets_one_sum() -> None:
    w = numpy_helper.from_array(np.array([1.5, -2.0]), "w")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"]),
        helper.make_node("Mul", ["a", "w"], ["b"]),
        helper.make_node("Add", ["b", "w"], ["c"]),
        helper.make_node("ReduceSum", ["c"], ["loss"], keepdims=0),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [2])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [w],
    )
    g = build_gradient_model(m, "loss", ["w"])
    sums = [n for n in g.graph.node if n.op_type == "Sum"]
    assert len(sums) == 1 and len(sums[0].input) == 3
    assert not [n for n in g.graph.node if n.op_type == "Add" and "Grad" in n.name]
    gradcheck(m, "loss", ["w"], {"x": np.array([0.3, 0.7])})


def test_unreachable_x_gets_zero_and_integer_paths_stop() -> None:
    w = numpy_helper.from_array(np.array([1.0, 2.0]), "w")
    unused = numpy_helper.from_array(np.ones((3, 2)), "unused")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"]),
        helper.make_node("Cast", ["a"], ["ai"], to=T.INT64),  # integer: no gradient through here
        helper.make_node("Cast", ["ai"], ["af"], to=T.DOUBLE),
        helper.make_node("Add", ["a", "af"], ["b"]),
        helper.make_node("Mul", ["unused", "unused"], ["dead"]),
        helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [2])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [w, unused],
    )
    g = build_gradient_model(m, "loss", ["w", "unused"])
    onnx.checker.check_model(g, full_check=True)
    out = dict(zip([o.name for o in g.graph.output], run_engine(g, {"x": np.array([3.0, 4.0])})))
    np.testing.assert_array_equal(out["w_grad"], [3.0, 4.0])
    np.testing.assert_array_equal(out["unused_grad"], np.zeros((3, 2)))
    assert not any("dead" in n.output for n in g.graph.node)  # dead nodes are removed


def test_op_without_rule_names_node_and_op() -> None:
    w = numpy_helper.from_array(np.ones((1, 1, 2, 2)), "w")
    nodes = [
        helper.make_node("Mul", ["x", "w"], ["a"]),
        helper.make_node("MyNorm", ["a"], ["b"], name="my_norm", domain="my.ops"),  # a custom op: no rule
        helper.make_node("ReduceSum", ["b"], ["loss"], keepdims=0),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [1, 1, 2, 2])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [w],
    )
    m.opset_import.append(helper.make_opsetid("my.ops", 1))
    m.graph.value_info.append(helper.make_tensor_value_info("b", T.DOUBLE, [1, 1, 2, 2]))
    with pytest.raises(GradientError, match=r"'my_norm' \(my\.ops\.MyNorm\).*ops with rules .*Add"):
        build_gradient_model(m, "loss", ["w"])


def test_invalid_loss_shapes_are_refused_by_name() -> None:
    """A cross-entropy node with rank-1 scores (torch's exporter once wrote one) is not a valid model: the
    builder names the node instead of emitting a gradient graph that fails later."""
    w = numpy_helper.from_array(np.ones(5, np.float32), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["s"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["s", "labels"], ["loss"], name="ce")]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.FLOAT, [5]),
         helper.make_tensor_value_info("labels", T.INT64, [5])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [w],
    )
    with pytest.raises(GradientError, match=r"'ce'.*needs scores of shape \(N, C, ...\), got rank 1 \('s'\)"):
        build_gradient_model(m, "loss", ["w"])


def _if_model(loss_through_if: bool) -> onnx.ModelProto:
    """w is read only inside an If's branches; the loss goes through the If or only through v."""
    branch = {
        name: helper.make_graph(
            [helper.make_node(op, ["x", "w"], [name])],
            name,
            [],
            [helper.make_tensor_value_info(name, T.DOUBLE, [2])],
        )
        for name, op in (("then_out", "Mul"), ("else_out", "Add"))
    }
    nodes = [
        helper.make_node(
            "If", ["c"], ["y"], name="branch", then_branch=branch["then_out"], else_branch=branch["else_out"]
        ),
        helper.make_node("Mul", ["x", "v"], ["z"]),
        helper.make_node("Add", ["y", "z"] if loss_through_if else ["z", "z"], ["s"]),
        helper.make_node("ReduceSum", ["s"], ["loss"], keepdims=0),
    ]
    inits = [numpy_helper.from_array(np.array([1.5, -2.0]), n) for n in ("w", "v")]
    return _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [2]), helper.make_tensor_value_info("c", T.BOOL, [])],
        [
            helper.make_tensor_value_info("loss", T.DOUBLE, []),
            helper.make_tensor_value_info("y", T.DOUBLE, [2]),
        ],
        inits,
    )


@pytest.mark.parametrize("cond", [True, False])
def test_gradient_through_if_branches(cond: bool) -> None:
    """w is read only inside the branches (then: x·w, else: x + w): its gradient flows through the If's
    gradient If, checked against central differences in float64 for both branches."""
    m = _if_model(True)
    feeds = {"x": np.array([0.5, 3.0]), "c": np.array(cond)}
    grads = gradcheck(m, "loss", ["w", "v"], feeds)
    np.testing.assert_allclose(grads["w"], feeds["x"] if cond else np.ones(2))
    g = build_gradient_model(m, "loss", ["w"])
    onnx.checker.check_model(g, full_check=True)
    assert [n.op_type for n in g.graph.node].count("If") == 2


def test_a_branch_off_the_path_keeps_what_it_reads() -> None:
    """The If is not on the path of v's gradient; the gradient model still runs it (y is an output) and
    keeps the initializer w that only its branches read."""
    m = build_gradient_model(_if_model(False), "loss", ["v"])
    onnx.checker.check_model(m, full_check=True)
    assert "w" in {t.name for t in m.graph.initializer}
    x = np.array([0.5, 3.0])
    for c in (True, False):
        outs = run_engine(m, {"x": x, "c": np.array(c)})
        got = dict(zip([o.name for o in m.graph.output], outs))
        np.testing.assert_allclose(got["v_grad"], 2 * x)  # loss = sum(2·x·v)
        np.testing.assert_allclose(got["y"], x * [1.5, -2.0] if c else x + [1.5, -2.0])


def test_unknown_names_are_errors() -> None:
    model = mlp_model(loss="mse")
    with pytest.raises(GradientError, match="nope"):
        build_gradient_model(model, "nope", ["W1"])
    with pytest.raises(GradientError, match="W9"):
        build_gradient_model(model, "loss", ["W9"])


def test_old_opset_is_upgraded() -> None:
    w = numpy_helper.from_array(np.array([[1.0, 2.0], [3.0, 4.0]]), "w")
    nodes = [
        helper.make_node("MatMul", ["x", "w"], ["a"]),
        helper.make_node("ReduceSum", ["a"], ["loss"], keepdims=0),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [1, 2])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [w],
        opset=13,
    )
    g = build_gradient_model(m, "loss", ["w"])
    assert g.opset_import[0].version >= 17
    onnx.checker.check_model(g, full_check=True)
    gradcheck(m, "loss", ["w"], {"x": np.array([[0.5, -1.0]])})


def test_cli_gradient_graph(tmp_path) -> None:
    path = tmp_path / "m.onnx"
    onnx.save(mlp_model(loss="mse"), str(path))
    out = tmp_path / "g.onnx"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "onnxtrain",
            "gradient-graph",
            str(path),
            "--loss",
            "loss",
            "--wrt",
            "W1,b2",
            "-o",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    assert [o.name for o in onnx.load(str(out)).graph.output][-2:] == ["W1_grad", "b2_grad"]
    r = subprocess.run(
        [sys.executable, "-m", "onnxtrain", "gradient-graph", "--help"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0 and "--all-initializers" in r.stdout


def test_linear_weight_gradient_is_one_gemm_without_a_transpose() -> None:
    """torch exports Linear as MatMul(x, Transpose(W)): dW is Gemm(dY, x) directly, not the transpose of
    Gemm(x, dY), and its values match finite differences."""
    w = numpy_helper.from_array(np.arange(12.0).reshape(3, 4) / 10, "W")  # (out, in) as torch keeps it
    nodes = [
        helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]),
        helper.make_node("MatMul", ["x", "Wt"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0),
    ]
    m = _model(
        nodes,
        [helper.make_tensor_value_info("x", T.DOUBLE, [2, 5, 4])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [w],
    )
    g = build_gradient_model(m, "loss", ["W"])
    onnx.checker.check_model(g, full_check=True)
    made_by = {o: n for n in g.graph.node for o in n.output}
    assert made_by["W_grad"].op_type == "Gemm"
    transposed = [n for n in g.graph.node if n.op_type == "Transpose" and n.input[0] in made_by]
    assert not any(made_by[n.input[0]].op_type == "Gemm" for n in transposed)
    gradcheck(m, "loss", ["W"], {"x": np.random.default_rng(1).standard_normal((2, 5, 4))})


def test_a_forward_output_declared_without_shape_takes_the_inferred_one() -> None:
    """onnx.checker refuses a graph output whose tensor type has no shape: the gradient model gives the
    forward output kept among its outputs the shape inference finds."""
    w = numpy_helper.from_array(np.ones((2, 3)), "w")
    nodes = [helper.make_node("Mul", ["x", "w"], ["y"]),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    outputs = [helper.make_tensor_value_info("y", T.DOUBLE, None),
               helper.make_tensor_value_info("loss", T.DOUBLE, [])]
    m = _model(nodes, [helper.make_tensor_value_info("x", T.DOUBLE, [2, 3])], outputs, [w])
    g = build_gradient_model(m, "loss", ["w"])
    y = next(o for o in g.graph.output if o.name == "y")
    assert [d.dim_value for d in y.type.tensor_type.shape.dim] == [2, 3]
    onnx.checker.check_model(g, full_check=True)



def _reshaped(name: str, rank: int) -> tuple[list, list]:
    """``name`` reshaped by a shape fed at run time: a value of rank ``rank`` whose dims the builder cannot
    see; returns (nodes, graph inputs)."""
    return [helper.make_node("Reshape", [f"{name}_in", f"{name}_shape"], [name])], [
        helper.make_tensor_value_info(f"{name}_in", T.DOUBLE, [f"{name}_size"]),
        helper.make_tensor_value_info(f"{name}_shape", T.INT64, [rank]),
    ]


def _tanh_sum(value: str) -> list:
    return [helper.make_node("Tanh", [value], ["t"]),
            helper.make_node("ReduceSum", ["t"], ["loss"], keepdims=0)]


LOSS = helper.make_tensor_value_info("loss", T.DOUBLE, [])


def test_two_inputs_of_unknown_dims_are_summed_back_at_run_time() -> None:
    """Add(x, y) with every dim unknown: y of shape [1, 5] beside x of [3, 5] gets a [1, 5] gradient summed
    over the rows (the builder cannot assume the dims agree), matching finite differences."""
    nx, ix = _reshaped("x", 2)
    ny, iy = _reshaped("y", 2)
    m = _model([*nx, *ny, helper.make_node("Add", ["x", "y"], ["s"]), *_tanh_sum("s")], [*ix, *iy], [LOSS])
    rng = np.random.default_rng(0)
    feeds = {"x_in": rng.standard_normal(15), "x_shape": np.array([3, 5]),
             "y_in": rng.standard_normal(5), "y_shape": np.array([1, 5])}
    g = build_gradient_model(m, "loss", ["x_in", "y_in"])
    onnx.checker.check_model(g, full_check=True)
    grads = dict(zip([o.name for o in g.graph.output], run_engine(g, feeds)))
    assert grads["y_in_grad"].shape == (5,)
    gradcheck(m, "loss", ["x_in", "y_in"], feeds)


def test_broadcast_partners_of_size_one_need_no_run_time_check() -> None:
    """x of unknown dims plus a [1, 1] bias, and attention's scores Q·Kᵀ whose inner dims are unknown: the
    other inputs show x is not broadcast, so its gradient needs no run-time shape comparison (NonZero)."""
    nx, ix = _reshaped("x", 2)
    bias = numpy_helper.from_array(np.array([[0.5]]), "b")
    m = _model([*nx, helper.make_node("Add", ["x", "b"], ["s"]), *_tanh_sum("s")], ix, [LOSS], [bias])
    feeds = {"x_in": np.random.default_rng(1).standard_normal(12), "x_shape": np.array([3, 4])}
    g = build_gradient_model(m, "loss", ["x_in", "b"])
    onnx.checker.check_model(g, full_check=True)
    assert "NonZero" not in {n.op_type for n in g.graph.node}
    gradcheck(m, "loss", ["x_in", "b"], feeds)
    # Q [2, 2, 3, kq] · K [2, 2, kk, 3]: kq and kk differ in name (both 4 at run time). (A batch dim "n" on
    # both would need the check: two inputs sharing a name may be fed n and 1, a broadcast.)
    q = helper.make_tensor_value_info("q", T.DOUBLE, [2, 2, 3, "kq"])
    k = helper.make_tensor_value_info("k", T.DOUBLE, [2, 2, "kk", 3])
    m = _model([helper.make_node("MatMul", ["q", "k"], ["a"]), *_tanh_sum("a")], [q, k], [LOSS])
    rng = np.random.default_rng(2)
    feeds = {"q": rng.standard_normal((2, 2, 3, 4)), "k": rng.standard_normal((2, 2, 4, 3))}
    g = build_gradient_model(m, "loss", ["q", "k"])
    onnx.checker.check_model(g, full_check=True)
    assert "NonZero" not in {n.op_type for n in g.graph.node}
    gradcheck(m, "loss", ["q", "k"], feeds)


@pytest.mark.parametrize("loss_name", ["", "loss", "not_in_graph"])
def test_builder_seeds_only_a_y_named_as_the_loss(loss_name: str) -> None:
    """onnxruntime seeded ``<loss>_grad`` with ones only for a y of that name: with y = the logits and the
    loss name empty, another value or absent, ``logits_grad`` is a graph input and the gradients are the
    vector-Jacobian products of the fed ``logits_grad`` (none from the loss)."""
    model = mlp_model(loss="mse", act="Tanh")
    b = GradientGraphBuilder(model.SerializeToString(), {"logits"}, ["W2", "b2"], loss_name)
    b.build()
    m = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(m, full_check=True)
    assert "logits_grad" in [i.name for i in m.graph.input]
    rng = np.random.default_rng(4)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rng.standard_normal((5, 4)).astype(np.float32)
    g = rng.standard_normal((5, 4)).astype(np.float32)
    out = dict(zip([o.name for o in m.graph.output], run_engine(m, {"x": x, "y": y, "logits_grad": g})))
    w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
    hidden = np.tanh(x.astype(np.float64) @ w["W1"].T + w["b1"])
    np.testing.assert_allclose(out["W2_grad"], g.T.astype(np.float64) @ hidden, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(out["b2_grad"], g.sum(0), rtol=1e-5, atol=1e-6)
    zero = dict(zip([o.name for o in m.graph.output], run_engine(m, {"x": x, "y": y, "logits_grad": 0 * g})))
    assert not zero["W2_grad"].any()


def test_builder_refuses_an_x_the_ys_do_not_depend_on() -> None:
    model = mlp_model(loss="mse")
    model.graph.initializer.append(numpy_helper.from_array(np.zeros(3, np.float32), "unused"))
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, ["W1", "unused"], "loss")
    with pytest.raises(GradientError, match="'unused' does not reach 'loss'"):
        b.build()
    b = GradientGraphBuilder(model.SerializeToString(), {"logits"}, ["W1"], "loss")  # y must exist
    b.build()
    with pytest.raises(GradientError, match="y_node_arg_names is empty"):
        GradientGraphBuilder(model.SerializeToString(), set(), ["W1"], "loss")


def test_upgrade_keeps_onnxruntime_layer_norm_of_an_older_opset() -> None:
    """onnxruntime's LayerNormalization fusion writes the node into opset-14 models, before ONNX adopted it
    (opset 17, same signature); the version converter has no adapter for it. The upgrade carries it over
    unchanged: the opset-17 model passes the full checker and normalises as the formula does (onnx.reference),
    its mean and inverse standard deviation outputs included."""
    from onnx.reference import ReferenceEvaluator

    from onnxtrain.autodiff.opset_upgrade import upgrade_opset

    rng = np.random.default_rng(0)
    scale, bias = rng.standard_normal(6).astype(np.float32), rng.standard_normal(6).astype(np.float32)
    nodes = [
        helper.make_node("Relu", ["x"], ["r"]),
        helper.make_node(
            "LayerNormalization", ["r", "scale", "bias"], ["y", "mean", "inv_std"], axis=-1, epsilon=1e-3
        ),
    ]
    outputs = (("y", 6), ("mean", 1), ("inv_std", 1))
    graph = helper.make_graph(
        nodes,
        "ln14",
        [helper.make_tensor_value_info("x", T.FLOAT, [4, 6])],
        [helper.make_tensor_value_info(n, T.FLOAT, [4, d]) for n, d in outputs],
        [numpy_helper.from_array(scale, "scale"), numpy_helper.from_array(bias, "bias")],
    )
    old = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)], ir_version=8)
    new = upgrade_opset(old, 17)
    onnx.checker.check_model(new, full_check=True)
    assert [(o.domain, o.version) for o in new.opset_import] == [("", 17)]
    assert [(n.domain, n.op_type) for n in new.graph.node] == [("", "Relu"), ("", "LayerNormalization")]
    x = rng.standard_normal((4, 6)).astype(np.float32)
    y, mean, inv_std = ReferenceEvaluator(new).run(None, {"x": x})
    r = np.maximum(x, 0).astype(np.float64)
    mu = r.mean(-1, keepdims=True)
    inv = 1 / np.sqrt(r.var(-1, keepdims=True) + 1e-3)
    np.testing.assert_allclose(y, (r - mu) * inv * scale + bias, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(mean, mu, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(inv_std, inv, rtol=1e-5)


def test_hard_swish_gradient_is_its_kernels_derivative_in_float64() -> None:
    """HardSwish's 1/6 is a float32 constant in ONNX's body and in the kernel; the gradient's slope uses the
    same one (it used an exact 1/3: 3e-8 off in float64, where finite differences cannot tell)."""
    from onnxtrain.testing import run_engine

    a = float(np.float32(1 / 6))
    x = np.random.default_rng(0).standard_normal((3, 50)) * 4
    nodes = [helper.make_node("HardSwish", ["x"], ["h"]),
             helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", T.DOUBLE, [3, 50])],
                              [helper.make_tensor_value_info("loss", T.DOUBLE, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    gm = build_gradient_model(model, "loss", ["x"])
    out = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x})))
    want = np.where(x <= -3, 0, np.where(x >= 3, 1, 2 * a * x + 0.5))
    np.testing.assert_allclose(out["x_grad"], want, rtol=1e-15, atol=0)
    assert out["loss"] == pytest.approx((x * np.clip(a * x + 0.5, 0, 1)).sum(), rel=1e-15)


def test_a_custom_domain_op_named_like_a_standard_one_has_no_rule():
    """``my.dom:Relu`` is not ONNX's Relu: the gradient builder refuses it by name instead of applying Relu's
    rule (it wrote a Greater/Where backward for an op whose meaning it cannot know)."""
    g = helper.make_graph(
        [helper.make_node("Mul", ["x", "w"], ["h"]), helper.make_node("Relu", ["h"], ["r"], domain="my.dom"),
         helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0)], "g",
        [helper.make_tensor_value_info("x", T.FLOAT, [3])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])],
        [numpy_helper.from_array(np.ones(3, np.float32), "w")])
    opsets = [helper.make_opsetid("", 17), helper.make_opsetid("my.dom", 1)]
    model = helper.make_model(g, opset_imports=opsets)
    with pytest.raises(GradientError, match=r"\(my\.dom\.Relu\) lies on the path"):
        build_gradient_model(model, "loss", ["w"])


def test_unreadable_models_are_refused_alike_as_bytes_and_as_a_path(tmp_path) -> None:
    """Garbage given as a path or as bytes is the sessions' ModelParseError (onnxruntime's InvalidProtobuf)
    either way (bytes gave protobuf's DecodeError, a path the parse error)."""
    from onnxtrain.engine.interface import ModelParseError

    garbage = b"\x08\x07this is not an onnx model\xff\xff"
    (tmp_path / "g.onnx").write_bytes(garbage)
    for given in (garbage, str(tmp_path / "g.onnx")):
        with pytest.raises(ModelParseError):
            build_gradient_model(given, "loss", ["W"])
        with pytest.raises(ModelParseError):
            GradientGraphBuilder(given, {"loss"}, {"W"}, "loss")


def test_an_x_whose_only_path_has_no_gradient_names_the_node() -> None:
    # it read "'X' does not reach 'loss'", though X reaches it, through a Unique
    from onnx import TensorProto

    nodes = [helper.make_node("Unique", ["X"], ["U"], name="uniq", sorted=1),
             helper.make_node("ReduceSum", ["U"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("X", TensorProto.FLOAT, [2, 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    b = GradientGraphBuilder(model.SerializeToString(), {"loss"}, {"X"}, "loss")
    why = "'X' does not reach 'loss' through a differentiable path \\(it passes through 'uniq' \\(Unique\\)"
    with pytest.raises(GradientError, match=why + ", which has no gradient\\)"):
        b.build()
