"""Ops across the opset versions where their schema changed (attributes become inputs, 2-D coercion gives way
to one axis, outputs change type): one-node models at each version, the engine's forward against
onnxruntime's, and the gradient graph (built by GradientGraphBuilder, which lifts an old model to opset 17)
checked with onnx.checker's full check, run by onnxruntime, and compared with float64 central differences
of onnxruntime's (or onnx.reference's) forward of the model as given."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff.legacy import GradientGraphBuilder
from onnxtrain.engine import compile_model

RNG = np.random.default_rng(0)
X = RNG.standard_normal((2, 3, 4))


def _i64(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def _ort(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    so = ort.SessionOptions()
    so.log_severity_level = 4
    s = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return lambda feeds: s.run(None, feeds)


def _reference(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    from onnx.reference import ReferenceEvaluator

    r = ReferenceEvaluator(model)
    return lambda feeds: r.run(None, feeds)


def _model(op: str, opset: int, attrs: dict, inputs: list[tuple[str, np.ndarray | None, bool]],
           outputs: list[tuple[np.dtype, tuple[int, ...]]], dtype: type = np.float64,
           loss_of: list[int] | None = None) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ``op`` node (inputs: name, value, whether a constant initializer; a float64 value in ``dtype``)
    and, for ``loss_of``, ``loss = Σ_k ReduceSum(y_k · u_k)`` with fixed random u_k."""
    feeds, inits, g_in = {}, [], []
    for name, value, const in inputs:
        if not name:
            continue
        a = np.asarray(value)
        a = a.astype(dtype) if a.dtype == np.float64 else a
        if const:
            inits.append(numpy_helper.from_array(a, name))
        else:
            feeds[name] = a
            et = helper.np_dtype_to_tensor_dtype(a.dtype)
            g_in.append(helper.make_tensor_value_info(name, et, a.shape))
    ys = [f"y{k}" for k in range(len(outputs))]
    nodes = [helper.make_node(op, [n for n, _, _ in inputs], ys, name=f"{op}_{opset}", **attrs)]
    g_out = [helper.make_tensor_value_info(y, helper.np_dtype_to_tensor_dtype(np.dtype(dtype if t.kind == "f"
                                                                                         else t)), shape)
             for y, (t, shape) in zip(ys, outputs)]
    if loss_of is not None:
        terms = []
        for k in loss_of:
            weights = np.random.default_rng(k).uniform(0.5, 1.5, outputs[k][1])  # the same in each model
            u = numpy_helper.from_array(weights.astype(dtype), f"u{k}")
            inits.append(u)
            nodes += [helper.make_node("Mul", [ys[k], u.name], [f"yu{k}"]),
                      helper.make_node("ReduceSum", [f"yu{k}"], [f"l{k}"], keepdims=0)]
            terms.append(f"l{k}")
        nodes.append(helper.make_node("Sum", terms, ["loss"]))
        g_out = [helper.make_tensor_value_info("loss", helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), [])]
    graph = helper.make_graph(nodes, f"{op}_{opset}", g_in, g_out, inits)
    ir = 7 if opset < 15 else helper.find_min_ir_version_for([helper.make_opsetid("", opset)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)
    return model, feeds


def _gradient_checked(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str],
                      forward: Callable[[onnx.ModelProto], Callable], onnxruntime: bool = True) -> None:
    """The gradient model of ``loss`` passes the full check, runs in onnxruntime (unless not
    ``onnxruntime``) and on the engine to the same values, and matches central differences of ``forward``
    (onnxruntime's, onnx.reference's or the engine's)."""
    b = GradientGraphBuilder(model, {"loss"}, wrt, "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(gm, full_check=True)
    names = [o.name for o in gm.graph.output]
    ours = dict(zip(names, compile_model(gm).run(dict(feeds))))
    theirs = dict(zip(names, _ort(gm)(feeds))) if onnxruntime else ours
    loss = forward(model)
    eps = 1e-6
    for w in wrt:
        np.testing.assert_allclose(ours[f"{w}_grad"], theirs[f"{w}_grad"], rtol=1e-9, atol=1e-9, err_msg=w)
        x, fd = feeds[w], np.zeros_like(feeds[w])
        for idx in np.ndindex(x.shape):
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            fd[idx] = (loss({**feeds, w: plus})[0] - loss({**feeds, w: minus})[0]) / (2 * eps)
        np.testing.assert_allclose(ours[f"{w}_grad"], fd, rtol=1e-5, atol=1e-6, err_msg=w)


@pytest.mark.parametrize("opset", [7, 9])
def test_old_dropout_mask_keeps_the_input_type_in_the_gradient_graph(opset: int) -> None:
    """Dropout before opset 10 outputs its mask in the input's float type (bool since Dropout-10); the
    converter lifting the model to opset 17 left the mask bool under the model's float declaration and
    float reads, so onnx.checker refused the gradient graph (and the engine a Mul reading the mask)."""
    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"], name="drop", ratio=0.3),
             helper.make_node("Neg", ["mask"], ["neg_mask"]),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    u = numpy_helper.from_array(RNG.uniform(0.5, 1.5, X.shape), "u")
    masks = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, X.shape) for n in ("mask", "neg_mask")]
    outputs = [helper.make_tensor_value_info("loss", TensorProto.DOUBLE, []), *masks]
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, X.shape)
    graph = helper.make_graph(nodes, "drop", [x], outputs, [u])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=7)
    _gradient_checked(model, {"x": X}, ["x"], _ort)
    b = GradientGraphBuilder(model, {"loss"}, ["x"], "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    got = dict(zip([o.name for o in gm.graph.output], compile_model(gm).run({"x": X})))
    # onnx.reference: inference mode keeps every value (it gives the mask as bool; the schema says T)
    alone = helper.make_graph(nodes[:1], "alone", [x], [helper.make_empty_tensor_value_info("mask")])
    want = _reference(helper.make_model(alone, opset_imports=model.opset_import))({"x": X})[0]
    want = want.astype(np.float64)
    assert got["mask"].dtype == np.float64 and got["neg_mask"].dtype == np.float64
    np.testing.assert_array_equal(got["mask"], want)
    np.testing.assert_array_equal(got["neg_mask"], -want)


def test_gru1_runs_forward_by_its_misspelled_default_direction() -> None:
    """GRU-1's schema gives its direction the default "foward" (sic), which the engine refused ("unknown
    direction"); it means forward: the values of onnxruntime's GRU-7 with direction="forward"."""
    x, w, r = RNG.standard_normal((3, 2, 2)), RNG.standard_normal((1, 6, 2)), RNG.standard_normal((1, 6, 2))
    ins = [("x", x, False), ("w", w, True), ("r", r, True)]
    outs = [(np.dtype(np.float32), (3, 1, 2, 2)), (np.dtype(np.float32), (1, 2, 2))]
    old, feeds = _model("GRU", 1, dict(hidden_size=2), ins, outs, np.float32)
    new, _ = _model("GRU", 7, dict(hidden_size=2, direction="forward"), ins, outs, np.float32)
    for got, want in zip(compile_model(old).run(dict(feeds)), _ort(new)(feeds), strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


RECURRENT = {  # op → (opset, attributes, gates): the first version of each, as the oldest models have it
    "LSTM": (1, dict(hidden_size=2, output_sequence=0), 4),
    "GRU": (3, dict(hidden_size=2, linear_before_reset=1, direction="reverse"), 3),
    "RNN": (1, dict(hidden_size=2, direction="bidirectional"), 1),
}


def _gradients(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str],
               run: Callable[[onnx.ModelProto], Callable]) -> dict[str, np.ndarray]:
    """The gradients of ``loss`` w.r.t. ``wrt`` by GradientGraphBuilder's graph (which passes the full
    check), run by ``run``."""
    b = GradientGraphBuilder(model, {"loss"}, wrt, "loss")
    b.build()
    gm = onnx.load_from_string(b.get_model())
    onnx.checker.check_model(gm, full_check=True)
    got = dict(zip([o.name for o in gm.graph.output], run(gm)(feeds)))
    return {w: got[f"{w}_grad"] for w in wrt}


def _engine(model: onnx.ModelProto) -> Callable[[dict[str, np.ndarray]], list[np.ndarray]]:
    plan = compile_model(model)
    return lambda feeds: plan.run(dict(feeds))


@pytest.mark.parametrize("op", sorted(RECURRENT))
def test_recurrent_nodes_before_opset_7_get_gradients(op: str) -> None:
    """onnx's version converter has no adapter to lift LSTM, GRU and RNN nodes below opset 7 (GradientError
    "could not upgrade the model"), though their form differs from the newer ones' only by the attribute
    ``output_sequence`` (dropped in 7, Y is optional since). onnxruntime runs neither these versions nor
    recurrent ops in float64: the float32 gradient graph runs in onnxruntime to the engine's values, the
    engine's forward equals onnxruntime's of the same node at opset 7, and the float64 gradients match
    central differences of that forward."""
    opset, attrs, gates = RECURRENT[op]
    dirs = 2 if attrs.get("direction") == "bidirectional" else 1
    w, r = RNG.standard_normal((dirs, gates * 2, 3)), RNG.standard_normal((dirs, gates * 2, 2))
    b = RNG.standard_normal((dirs, gates * 4))
    ins = [("x", RNG.standard_normal((4, 2, 3)), False), ("w", w, False), ("r", r, False), ("b", b, False)]
    wrt = ["x", "w", "r", "b"]
    new_attrs = {k: v for k, v in attrs.items() if k != "output_sequence"}
    for dtype in (np.float32, np.float64):
        outs = [(np.dtype(dtype), (4, dirs, 2, 2)), (np.dtype(dtype), (dirs, 2, 2))]
        model, feeds = _model(op, opset, attrs, ins, outs, dtype, loss_of=[0, 1])
        if dtype == np.float32:
            at7, _ = _model(op, 7, new_attrs, ins, outs, dtype, loss_of=[0, 1])
            np.testing.assert_allclose(_engine(model)(feeds)[0], _ort(at7)(feeds)[0], rtol=1e-5, atol=1e-5)
            ours, theirs = _gradients(model, feeds, wrt, _engine), _gradients(model, feeds, wrt, _ort)
            for n in wrt:
                np.testing.assert_allclose(ours[n], theirs[n], rtol=1e-4, atol=1e-5, err_msg=n)
            continue
        loss, eps = _engine(model), 1e-6
        for n, grad in _gradients(model, feeds, wrt, _engine).items():
            fd = np.zeros_like(grad)
            for idx in np.ndindex(fd.shape):
                plus, minus = feeds[n].copy(), feeds[n].copy()
                plus[idx] += eps
                minus[idx] -= eps
                fd[idx] = (loss({**feeds, n: plus})[0] - loss({**feeds, n: minus})[0]) / (2 * eps)
            np.testing.assert_allclose(grad, fd, rtol=1e-5, atol=1e-7, err_msg=n)


@pytest.mark.parametrize("mode", ["nearest", "bilinear"])
def test_upsample1_scales_the_last_two_axes(mode: str) -> None:
    """Upsample-1 (experimental) scales the last two axes by its height_scale and width_scale attributes,
    its 'bilinear' mode Upsample-7's 'linear': the engine failed ("Upsample needs scales"), and the version
    converter keeps 'bilinear', which no later Upsample or Resize knows (the gradient graph failed). Oracle:
    onnxruntime's Upsample-7 with scales [1, 1, h, w] (it runs no Upsample-1); the float32 gradient graph
    runs in onnxruntime to the engine's values; float64 gradients match central differences of that
    forward on the engine."""
    x = RNG.standard_normal((1, 2, 3, 2))
    attrs = dict(height_scale=2.0, width_scale=3.0, mode=mode)
    new = dict(scales=[1.0, 1.0, 2.0, 3.0], mode="linear" if mode == "bilinear" else mode)
    outs = [(np.dtype(np.float32), (1, 2, 6, 6))]
    old, feeds = _model("Upsample", 6, attrs, [("x", x, False)], outs, np.float32)
    at7, _ = _model("Upsample", 7, new, [("x", x, False)], outs, np.float32)
    got = compile_model(old).run(dict(feeds))[0]
    np.testing.assert_allclose(got, _ort(at7)(feeds)[0], rtol=1e-6, atol=1e-6)
    old, feeds = _model("Upsample", 6, attrs, [("x", x, False)], outs, np.float32, loss_of=[0])
    ours, theirs = _gradients(old, feeds, ["x"], _engine), _gradients(old, feeds, ["x"], _ort)
    np.testing.assert_allclose(ours["x"], theirs["x"], rtol=1e-5, atol=1e-6)
    old, feeds = _model("Upsample", 6, attrs, [("x", x, False)], outs, np.float64, loss_of=[0])
    _gradient_checked(old, feeds, ["x"], _engine, onnxruntime=False)


def test_old_dropout_mask_cast_below_opset_15() -> None:
    """The mask's cast holds at a target opset before CastLike (15): upgrade_opset to 13, as the translation
    of onnxruntime-training models does, gives a model onnx.checker passes and onnxruntime runs to the
    values of the model as given (its mask the input's float type)."""
    from onnxtrain.autodiff.opset_upgrade import upgrade_opset

    nodes = [helper.make_node("Dropout", ["x"], ["y", "mask"], name="drop", ratio=0.3),
             helper.make_node("Neg", ["mask"], ["neg_mask"])]
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, X.shape)
    outputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, X.shape) for n in ("y", "neg_mask")]
    model = helper.make_model(helper.make_graph(nodes, "drop", [x], outputs),
                              opset_imports=[helper.make_opsetid("", 9)], ir_version=7)
    lifted = upgrade_opset(model, 13)
    onnx.checker.check_model(lifted, full_check=True)
    feeds = {"x": X.astype(np.float32)}
    got = _ort(lifted)(feeds)
    np.testing.assert_array_equal(got[0], feeds["x"])
    np.testing.assert_array_equal(got[1], -np.ones(X.shape, np.float32))  # every value kept, as the mask says


def _x() -> tuple[str, np.ndarray, bool]:
    return ("x", X, False)


def _c(name: str, value: np.ndarray) -> tuple[str, np.ndarray, bool]:
    return (name, value, True)


F32 = np.dtype(np.float32)
I64 = np.dtype(np.int64)
SCATTER = _i64(0, 2, 1, 0, 0, 2, 1, 0, 1, 1, 1, 1, 0, 0, 0, 0).reshape(2, 2, 4)  # repeated positions


def _form(op: str, opset: int, attrs: dict, inputs: list, outputs: list, loss_of: tuple[int, ...] = (0,),
          fd: str = "ort", compared: int | None = None) -> tuple:
    return op, opset, attrs, inputs, outputs, list(loss_of), fd, compared


def _w(name: str, *shape: int) -> tuple[str, np.ndarray, bool]:
    """A float input ``name`` of random values."""
    return (name, RNG.standard_normal(shape), False)


X234 = [(F32, (2, 3, 4))]
TOP2 = [(F32, (2, 2, 4)), (I64, (2, 2, 4))]
BN_IN = [_x(), _w("s", 3), _w("b", 3), _c("m", RNG.standard_normal(3)), _c("v", RNG.uniform(0.5, 1.5, 3))]
# id → _form(op, opset, attributes, inputs, output (dtype, shape)s, the outputs the loss reads, the float64
# forward the finite differences take: onnxruntime's, or the engine's where onnxruntime has no float64 kernel
# (the float32 forwards are compared either way: with onnx.reference's where onnxruntime has no kernel), how
# many outputs the forwards compare (all by default))
FORMS: dict[str, tuple] = {
    "split2_attribute": _form("Split", 2, dict(axis=2, split=[1, 3]), [_x()],
                              [(F32, (2, 3, 1)), (F32, (2, 3, 3))], (0, 1), "engine"),
    "split11_equal": _form("Split", 11, dict(axis=1), [_w("x", 2, 4, 3)], [(F32, (2, 2, 3))] * 2, (0, 1)),
    "split13_input": _form("Split", 13, dict(axis=2), [_x(), _c("sp", _i64(3, 1))],
                           [(F32, (2, 3, 3)), (F32, (2, 3, 1))], (0, 1)),
    "split18_num_outputs": _form("Split", 18, dict(axis=2, num_outputs=2), [_x()], [(F32, (2, 3, 2))] * 2,
                                 (0, 1)),
    "reducesum11_attribute": _form("ReduceSum", 11, dict(axes=[0, -1], keepdims=0), [_x()], [(F32, (3,))]),
    "reducesum13_input": _form("ReduceSum", 13, dict(keepdims=0), [_x(), _c("ax", _i64(0, -1))],
                               [(F32, (3,))]),
    "reducemean13_attribute": _form("ReduceMean", 13, dict(axes=[1]), [_x()], [(F32, (2, 1, 4))]),
    "reducemean18_input": _form("ReduceMean", 18, dict(keepdims=0), [_x(), _c("ax", _i64(-2))],
                                [(F32, (2, 4))]),
    "reducemax18_no_axes_noop": _form("ReduceMax", 18, dict(noop_with_empty_axes=1),
                                      [_x(), _c("ax", np.zeros(0, np.int64))], X234),
    "reducel2_11_attribute": _form("ReduceL2", 11, dict(axes=[2]), [_x()], [(F32, (2, 3, 1))]),
    "squeeze11_attribute": _form("Squeeze", 11, dict(axes=[-2]), [_w("x", 2, 1, 3)], [(F32, (2, 3))]),
    "squeeze13_input": _form("Squeeze", 13, {}, [_w("x", 2, 1, 3), _c("ax", _i64(1))], [(F32, (2, 3))]),
    "unsqueeze11_attribute": _form("Unsqueeze", 11, dict(axes=[0, -1]), [_x()], [(F32, (1, 2, 3, 4, 1))]),
    "clip6_attributes": _form("Clip", 6, dict(min=-0.5, max=0.3), [_x()], X234, fd="engine"),
    "clip11_inputs": _form("Clip", 11, {}, [_x(), _c("lo", np.array(-0.5)), _c("hi", np.array(0.3))], X234,
                           fd="engine"),
    "clip13_max_only": _form("Clip", 13, {}, [_x(), ("", None, False), _c("hi", np.array(0.2))], X234),
    "pad2_attributes": _form("Pad", 2, dict(pads=[0, 1, 0, 0, 2, 1], value=1.5), [_x()], [(F32, (2, 6, 5))],
                             fd="engine"),
    "pad11_reflect": _form("Pad", 11, dict(mode="reflect"), [_x(), _c("p", _i64(0, 1, 1, 0, 1, 2))],
                           [(F32, (2, 5, 7))]),
    "pad18_axes": _form("Pad", 18, {}, [_x(), _c("p", _i64(1, 2, 0, 1)), _c("cv", np.array(0.5)),
                                        _c("ax", _i64(2, 0))], [(F32, (5, 3, 5))]),
    "slice1_attributes": _form("Slice", 1, dict(starts=[1, -3], ends=[1000, -1], axes=[1, 2]), [_x()],
                               [(F32, (2, 2, 2))], fd="engine"),
    "slice10_inputs": _form("Slice", 10, {}, [_x(), _c("s", _i64(0, -1)), _c("e", _i64(2, -4)),
                                              _c("a", _i64(1, 2)), _c("st", _i64(1, -1))],
                            [(F32, (2, 2, 3))]),
    "softmax1_coerced": _form("Softmax", 1, dict(axis=1), [_x()], X234, fd="engine"),
    "logsoftmax11_default_axis": _form("LogSoftmax", 11, {}, [_x()], X234),
    "softmax13_axis": _form("Softmax", 13, dict(axis=1), [_x()], X234),
    "gemm6_broadcast": _form("Gemm", 6, dict(broadcast=1, transA=1, alpha=0.3, beta=0.7),
                             [_w("a", 4, 3), _w("b", 4, 5), _w("c", 5)], [(F32, (3, 5))], fd="engine"),
    "gemm11_no_c": _form("Gemm", 11, dict(transB=1), [_w("a", 3, 4), _w("b", 5, 4)], [(F32, (3, 5))]),
    "topk1_attribute": _form("TopK", 1, dict(k=2, axis=1), [_x()], TOP2, fd="engine"),
    "topk10_input": _form("TopK", 10, {}, [_x(), _c("k", _i64(2))], [(F32, (2, 3, 2)), (I64, (2, 3, 2))]),
    "topk11_smallest": _form("TopK", 11, dict(axis=1, largest=0), [_x(), _c("k", _i64(2))], TOP2),
    # (saved_var: onnxruntime writes the inverse standard deviation there, onnx.reference the variance)
    "batchnorm9_training": _form("BatchNormalization", 9, dict(epsilon=1e-3), BN_IN,
                                 [(F32, (2, 3, 4))] + [(F32, (3,))] * 4, fd="engine", compared=4),
    "batchnorm14_training": _form("BatchNormalization", 14, dict(epsilon=1e-3, training_mode=1), BN_IN,
                                  [(F32, (2, 3, 4)), (F32, (3,)), (F32, (3,))], fd="engine"),
    "max6_same_shapes": _form("Max", 6, {}, [("a", X, False), _w("b", 2, 3, 4)], X234, fd="engine"),
    "mean13_broadcast": _form("Mean", 13, {}, [("a", X, False), _w("b", 3, 1), _w("c", 4)], X234,
                              fd="engine"),
    "upsample7_attribute": _form("Upsample", 7, dict(scales=[1.0, 1.0, 2.0, 1.5], mode="linear"),
                                 [_w("x", 1, 2, 3, 2)], [(F32, (1, 2, 6, 3))], fd="engine"),
    "upsample9_input": _form("Upsample", 9, dict(mode="nearest"),
                             [_w("x", 1, 2, 3, 2), _c("sc", np.array([1, 1, 2, 3], np.float32))],
                             [(F32, (1, 2, 6, 6))], fd="engine"),
    "resize10_downsample": _form("Resize", 10, dict(mode="linear"),
                                 [_w("x", 1, 2, 3, 4), _c("sc", np.array([1, 1, 2, 0.5], np.float32))],
                                 [(F32, (1, 2, 6, 2))], fd="engine"),
    "groupnorm21_per_channel": _form("GroupNormalization", 21, dict(num_groups=2),
                                     [_w("x", 2, 4, 3), _w("s", 4), _w("b", 4)], [(F32, (2, 4, 3))],
                                     fd="engine"),
    "scatterelements16_add": _form("ScatterElements", 16, dict(axis=1, reduction="add"),
                                   [_x(), _c("i", SCATTER), _w("u", 2, 2, 4)], X234),
    "scatterelements18_max": _form("ScatterElements", 18, dict(axis=1, reduction="max"),
                                   [_x(), _c("i", SCATTER), _w("u", 2, 2, 4)], X234),
    "cumsum11_exclusive_reverse": _form("CumSum", 11, dict(exclusive=1, reverse=1),
                                        [_x(), _c("ax", np.array(1))], X234),
    "gathernd12_batch_dims": _form("GatherND", 12, dict(batch_dims=1),
                                   [_x(), _c("i", _i64(1, 0, 2, 1).reshape(2, 2, 1))], [(F32, (2, 2, 4))]),
    "dropout12_ratio_input": _form("Dropout", 12, {}, [_x(), _c("r", np.array(0.3, np.float32))],
                                   [(F32, (2, 3, 4)), (np.dtype(bool), (2, 3, 4))]),
}


@pytest.mark.parametrize("form", sorted(FORMS))
def test_forms_across_opsets_forward_and_gradient(form: str) -> None:
    """Each form: the engine's forward equals onnxruntime's; the float32 gradient graph (GradientGraphBuilder:
    lifted to opset 17 when older) passes the full check and runs in onnxruntime to the engine's values; the
    float64 gradients match central differences of the forward (see FORMS)."""
    op, opset, attrs, inputs, outputs, loss_of, fd, compared = FORMS[form]
    wrt = [n for n, v, const in inputs if n and not const and np.asarray(v).dtype.kind == "f"]
    model, feeds = _model(op, opset, attrs, inputs, outputs, np.float32)
    try:
        forward = _ort(model)
    except ort.capi.onnxruntime_pybind11_state.NotImplemented:  # (no kernel of that version)
        forward = _reference(model)
    pairs = list(zip(compile_model(model).run(dict(feeds)), forward(feeds), strict=True))
    for k, (ours, theirs) in enumerate(pairs[:compared]):
        np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6, err_msg=f"output {k}")
    model, feeds = _model(op, opset, attrs, inputs, outputs, np.float32, loss_of=loss_of)
    ours, theirs = _gradients(model, feeds, wrt, _engine), _gradients(model, feeds, wrt, _ort)
    for n in wrt:
        np.testing.assert_allclose(ours[n], theirs[n], rtol=1e-4, atol=1e-5, err_msg=n)
    model, feeds = _model(op, opset, attrs, inputs, outputs, np.float64, loss_of=loss_of)
    _gradient_checked(model, feeds, wrt, _ort if fd == "ort" else _engine, onnxruntime=False)
