"""ConvTransposes whose output_padding reaches their stride on the onnxruntime backend: onnxruntime 1.32
refuses them, so the backend rewrites them (onnxtrain/engine/ort_output_padding.py). Oracles: torch's
conv_transpose with the original attributes (forward values, and a training step by autograd)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine.ort_output_padding import large_output_paddings
from tests.session.helpers import backend_options, params, sgd_matches_torch

ort = pytest.importorskip("onnxruntime")
torch = pytest.importorskip("torch")

# X shape, W shape, attributes (output_padding at or above the stride on at least one axis)
CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "stride-1-dilation-2": ((2, 3, 5, 4), (3, 2, 3, 3), {"dilations": [2, 2], "output_padding": [1, 1]}),
    "end-pad-below": ((2, 3, 4, 5), (3, 4, 3, 2), {"strides": [2, 2], "dilations": [3, 3],
                                                   "pads": [1, 1, 1, 1], "output_padding": [2, 2]}),
    "end-pad-above": ((1, 2, 4, 4), (2, 3, 3, 3), {"strides": [2, 1], "dilations": [3, 2],
                                                   "pads": [0, 1, 3, 0], "output_padding": [2, 1]}),
    "one-axis": ((2, 2, 4, 5), (2, 2, 2, 3), {"strides": [3, 1], "dilations": [4, 3],
                                              "output_padding": [1, 2], "group": 1}),
    "grouped": ((2, 4, 5), (4, 1, 3), {"strides": [2], "dilations": [4], "output_padding": [3], "group": 2}),
    "3d": ((1, 2, 3, 3, 2), (2, 2, 2, 2, 2), {"dilations": [2, 2, 3], "output_padding": [1, 0, 2],
                                              "pads": [0, 1, 0, 1, 0, 2]}),
}


def _model(xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict[str, Any],
           opset: int = 17) -> onnx.ModelProto:
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], name="up", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs),
                                        helper.make_tensor_value_info("w", TensorProto.FLOAT, ws)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(xs))])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)


def _torch(x: Any, w: Any, attrs: dict[str, Any]) -> Any:
    nd = x.ndim - 2
    pads = attrs.get("pads", [0] * 2 * nd)
    begin, end = pads[:nd], pads[nd:]
    fn = (torch.nn.functional.conv_transpose1d, torch.nn.functional.conv_transpose2d,
          torch.nn.functional.conv_transpose3d)[nd - 1]
    # torch's pads are one per axis: take none, then crop ONNX's begin and end pads off the full output and
    # its output_padding rows
    y = fn(x, w, stride=attrs.get("strides", 1), dilation=attrs.get("dilations", 1),
           groups=attrs.get("group", 1), output_padding=attrs["output_padding"])
    idx = (slice(None), slice(None)) + tuple(slice(b, y.shape[2 + i] - e) for i, (b, e) in
                                             enumerate(zip(begin, end, strict=True)))
    return y[idx]


@pytest.mark.parametrize("opset", [17, 10])
@pytest.mark.parametrize("case", list(CASES))
def test_onnxruntime_runs_the_rewrite_with_torchs_values(case: str, opset: int) -> None:
    xs, ws, attrs = CASES[case]
    model = _model(xs, ws, attrs, opset)
    sess_opts = ort.SessionOptions()
    with pytest.raises(Exception, match="output_padding"):  # what the rewrite is for
        ort.InferenceSession(model.SerializeToString(), sess_opts, providers=["CPUExecutionProvider"]).run(
            None, {"x": np.ones(xs, np.float32), "w": np.ones(ws, np.float32)})
    out = large_output_paddings(model)
    onnx.checker.check_model(out, full_check=True)
    ops = [n.op_type for n in out.graph.node]
    assert ops[0] == "ConvTranspose" and set(ops) <= {"ConvTranspose", "Constant", "Pad"}
    rng = np.random.default_rng(len(case))
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "w": w})[0]
    want = _torch(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), attrs).numpy()
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_nodes_onnxruntime_accepts_are_left_as_they_are() -> None:
    for attrs in ({"strides": [2, 2], "output_padding": [1, 1]}, {"strides": [2, 2]},
                  {"dilations": [2, 2], "output_padding": [1, 1], "auto_pad": "SAME_UPPER"}):
        model = _model((1, 2, 4, 4), (2, 2, 3, 3), attrs)
        assert large_output_paddings(model) is model


def test_a_body_node_is_rewritten() -> None:
    xs, ws, attrs = CASES["end-pad-below"]
    inner = _model(xs, ws, attrs).graph
    body = helper.make_graph(list(inner.node), "then", [],
                             [helper.make_tensor_value_info("y", 1, [None] * 4)])
    other = helper.make_graph([helper.make_node("Identity", ["x"], ["z"])], "else", [],
                              [helper.make_tensor_value_info("z", 1, [None] * 4)])
    node = helper.make_node("If", ["c"], ["out"], then_branch=body, else_branch=other)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("c", TensorProto.BOOL, []),
                                        *inner.input], [helper.make_tensor_value_info("out", 1, [None] * 4)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    out = large_output_paddings(model)
    onnx.checker.check_model(out, full_check=True)
    rng = np.random.default_rng(5)
    x, w = rng.standard_normal(xs).astype(np.float32), rng.standard_normal(ws).astype(np.float32)
    got = ort.InferenceSession(out.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"c": np.array(True), "x": x, "w": w})[0]
    want = _torch(torch.tensor(x, dtype=torch.float64), torch.tensor(w, dtype=torch.float64), attrs).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _trains_as_torch(xs: tuple, ws: tuple, attrs: dict[str, Any], seed: int,
                     reference: Callable[[Any, Any], Any]) -> None:
    """Two SGD steps of loss = Σ ConvTranspose(x, W)² on the backend's legacy session against torch's
    ``reference(x, W)`` (the same layer) and autograd."""
    rng = np.random.default_rng(seed)
    w0 = (rng.standard_normal(ws) * 0.3).astype(np.float32)
    nodes = [helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="up", **attrs),
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs)],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w0, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    sess = onnxtrain.TrainingSession(model.SerializeToString(), params("SGDOptimizer"),
                                     backend_options("onnxruntime"))
    wt = torch.tensor(w0, requires_grad=True)
    opt = torch.optim.SGD([wt], lr=1e-3)
    for _ in range(2):
        x = rng.standard_normal(xs).astype(np.float32)
        loss = sess.run(["loss"], {"x": x, "Learning_Rate": np.array([1e-3], np.float32)})[0]
        opt.zero_grad()
        ref = reference(torch.tensor(x), wt).pow(2).sum()
        ref.backward()
        opt.step()
        np.testing.assert_allclose(loss, ref.item(), rtol=1e-5)
        np.testing.assert_allclose(sess.get_state()["W"], wt.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_the_backend_trains_it_as_torch() -> None:
    xs, ws, attrs = CASES["end-pad-below"]
    _trains_as_torch(xs, ws, attrs, 0, lambda x, w: _torch(x, w, attrs))


# SAME ConvTransposes: Y has S·s rows, the pads total output_padding + k_eff − s (negative with a kernel
# narrower than the stride: rows of zeros; onnxruntime clamped them to 0 and gave one row fewer)
SAME_CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "kernel-1-stride-2": ((1, 2, 5, 6), (2, 3, 1, 1), {"strides": [2, 2]}),
    "kernel-2-stride-3": ((1, 2, 4, 3), (2, 3, 2, 2), {"strides": [3, 3]}),
    "mixed-axes": ((2, 2, 4, 5), (2, 3, 1, 3), {"strides": [3, 2]}),
    "output-padding-at-stride": ((1, 2, 5, 4), (2, 3, 3, 3), {"dilations": [2, 2], "output_padding": [1, 1]}),
}


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("case", sorted(SAME_CASES))
def test_a_same_conv_transpose_has_its_shape_and_values_on_the_backend(case: str, auto_pad: str) -> None:
    from onnx.reference import ReferenceEvaluator

    from onnxtrain.engine.backends import make_plan
    from onnxtrain.engine.ort_output_padding import same_conv_transposes
    from onnxtrain.ir.builder import value_types

    xs, ws, attrs = SAME_CASES[case]
    model = _model(xs, ws, {**attrs, "auto_pad": auto_pad})
    rewritten = large_output_paddings(same_conv_transposes(model, lambda: value_types(model)))
    assert rewritten is not model
    onnx.checker.check_model(rewritten, full_check=True)  # the graph handed to onnxruntime
    rng = np.random.default_rng(7)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    got = make_plan(model, "onnxruntime").run(feeds)[0]
    want = make_plan(model, "numpy").run(feeds)[0]
    strides = attrs.get("strides", [1, 1])
    assert got.shape == want.shape == (xs[0], ws[1], *(n * s for n, s in zip(xs[2:], strides)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    if "output_padding" not in attrs:  # (onnx.reference rejects an output_padding at the stride)
        np.testing.assert_allclose(got, ReferenceEvaluator(model).run(None, feeds)[0], rtol=1e-5, atol=1e-5)


# ConvTransposes with an output_shape and an output_padding at or above the stride (valid: below the
# dilation). ONNX: the pads total s·(S − 1) + output_padding + k_eff − output_shape, split as under SAME
# (SAME_UPPER: the odd one at the end; NOTSET and SAME_LOWER: at the beginning); onnxruntime 1.32 refuses
# every such node ("Explicit output_shape is inconsistent"). A total below zero adds rows of zeros.
SHAPE_CASES: dict[str, tuple[tuple[int, ...], tuple[int, ...], dict[str, Any]]] = {
    "cropped": ((1, 2, 4, 5), (2, 3, 3, 3), {"dilations": [2, 2], "output_padding": [1, 1],
                                             "output_shape": [8, 9]}),
    "exact": ((2, 2, 4, 4), (2, 2, 3, 2), {"strides": [2, 1], "dilations": [3, 2], "output_padding": [2, 1],
                                           "output_shape": [15, 7]}),
    "grown": ((1, 2, 4, 3), (2, 2, 3, 3), {"strides": [2, 1], "dilations": [3, 2], "output_padding": [2, 1],
                                           "output_shape": [18, 10]}),
    "full-output-shape": ((1, 2, 3, 3), (2, 2, 3, 3), {"dilations": [2, 2], "output_padding": [1, 0],
                                                       "output_shape": [1, 2, 7, 6]}),
}


def _torch_with_output_shape(x: Any, w: Any, attrs: dict[str, Any], auto_pad: str) -> Any:
    """torch's full transposed convolution (with its output_padding rows), then ONNX's window of it."""
    nd = x.ndim - 2
    full = _torch(x, w, {k: v for k, v in attrs.items() if k != "output_shape"})
    want = list(attrs["output_shape"])[-nd:]
    for i in range(nd):
        total = full.shape[2 + i] - want[i]
        begin = total // 2 if auto_pad == "SAME_UPPER" else total - total // 2
        if begin < 0:  # rows of zeros before
            shape = list(full.shape)
            shape[2 + i] = -begin
            full = torch.cat([torch.zeros(shape, dtype=full.dtype), full], 2 + i)
            begin = 0
        short = begin + want[i] - full.shape[2 + i]
        if short > 0:  # and after
            shape = list(full.shape)
            shape[2 + i] = short
            full = torch.cat([full, torch.zeros(shape, dtype=full.dtype)], 2 + i)
        full = full.narrow(2 + i, begin, want[i])
    return full


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_an_output_shape_with_a_large_output_padding_runs_on_the_backend(case: str, auto_pad: str) -> None:
    """Forward values against torch's transposed convolution cropped or grown to the output_shape by the
    spec's pads, on both backends (it failed on the onnxruntime backend)."""
    from onnxtrain.engine.backends import make_plan

    xs, ws, attrs = SHAPE_CASES[case]
    model = _model(xs, ws, {**attrs, "auto_pad": auto_pad})
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    want = _torch_with_output_shape(torch.tensor(feeds["x"], dtype=torch.float64),
                                    torch.tensor(feeds["w"], dtype=torch.float64), attrs, auto_pad).numpy()
    for backend in ("onnxruntime", "numpy"):
        got = make_plan(model, backend).run(feeds)[0]
        assert got.shape == want.shape, backend
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend)


def test_an_output_shape_with_a_large_output_padding_trains_on_the_backend_as_torch() -> None:
    xs, ws, attrs = SHAPE_CASES["grown"]
    _trains_as_torch(xs, ws, attrs, 3, lambda x, w: _torch_with_output_shape(x, w, attrs, "NOTSET"))


@pytest.mark.parametrize("auto_pad", ["NOTSET", "SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("case", sorted(SHAPE_CASES))
def test_an_output_shape_with_a_large_output_padding_over_unknown_sizes_runs_on_the_backend(
        case: str, auto_pad: str) -> None:
    """X's spatial sizes known only at run time: the pads come from the full output's Shape then (it was
    refused when the session was made). Values against torch and the numpy engine, on several sizes of one
    session (crops, exact and grown outputs, odd and even totals)."""
    from onnxtrain.engine.backends import make_plan

    xs, ws, attrs = SHAPE_CASES[case]
    model = _model((xs[0], xs[1], "H", "W"), ws, {**attrs, "auto_pad": auto_pad})
    plans = {b: make_plan(model, b) for b in ("onnxruntime", "numpy")}
    rng = np.random.default_rng(12)
    for h, w in ((xs[2], xs[3]), (xs[2] - 1, xs[3] + 1), (xs[2] + 2, xs[3])):
        feeds = {"x": rng.standard_normal((xs[0], xs[1], h, w)).astype(np.float32),
                 "w": rng.standard_normal(ws).astype(np.float32)}
        tx, tw = (torch.tensor(feeds[k], dtype=torch.float64) for k in ("x", "w"))
        want = _torch_with_output_shape(tx, tw, attrs, auto_pad).numpy()
        got = {b: p.run(feeds)[0] for b, p in plans.items()}
        for b, y in got.items():
            assert y.shape == want.shape, (b, h, w)
            np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5, err_msg=f"{b} {h}x{w}")
        np.testing.assert_allclose(got["onnxruntime"], got["numpy"], rtol=1e-5, atol=1e-6)


def test_an_output_shape_with_a_large_output_padding_over_unknown_sizes_trains_as_torch() -> None:
    xs, ws, attrs = SHAPE_CASES["cropped"]
    rng = np.random.default_rng(5)
    w0 = (rng.standard_normal(ws) * 0.3).astype(np.float32)
    up = helper.make_node("ConvTranspose", ["x", "W"], ["y"], name="up", **attrs, auto_pad="SAME_UPPER")
    nodes = [up,
             helper.make_node("Mul", ["y", "y"], ["y2"]),
             helper.make_node("ReduceSum", ["y2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT,
                                                                     ["N", xs[1], "H", "W"])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(w0, "W")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    sizes = ((1, 4, 5), (2, 3, 6), (1, 5, 4))
    feeds = [rng.standard_normal((n, xs[1], h, w)).astype(np.float32) for n, h, w in sizes]
    sgd_matches_torch(model, w0, feeds,
                      lambda x, wt: _torch_with_output_shape(x, wt, attrs, "SAME_UPPER").pow(2).sum(), 1e-3)


def test_such_a_node_over_unknown_sizes_below_opset_12_is_refused_by_name() -> None:
    """Below opset 12 (no Max of int64 values for the run-time pads) such a node is still refused when the
    session is made, naming the node."""
    from onnxtrain.engine.backends import make_plan

    _, ws, attrs = SHAPE_CASES["cropped"]
    model = _model((1, 2, "H", "W"), ws, attrs, opset=11)
    with pytest.raises(ValueError, match=r"node 'up' \(ConvTranspose\).*output_shape"):
        make_plan(model, "onnxruntime")


# A bias is added to every output row, those the rewrites add too: the output_padding rows, a SAME node's
# rows of a negative pad and an output_shape's rows beyond the full output. The rewrites appended zeros
# there (found by tests/engine/random_models.py: a 0.3 % loss difference over 20 SGD steps).
BIAS_CASES: dict[str, tuple[tuple[Any, ...], tuple[int, ...], dict[str, Any]]] = {
    "output-padding-rows": ((2, 3, 4, 5), (3, 4, 3, 2), CASES["end-pad-below"][2]),
    "output-padding-1d-grouped": ((2, 4, 5), (4, 1, 3), CASES["grouped"][2]),
    "same-negative-pads": ((1, 2, 5, 6), (2, 3, 1, 1), {"strides": [2, 2], "auto_pad": "SAME_LOWER"}),
    "output-shape-grown": ((1, 2, 4, 3), (2, 2, 3, 3), SHAPE_CASES["grown"][2]),
    "output-shape-run-time": ((1, 2, "H", "W"), (2, 3, 3, 3), SHAPE_CASES["cropped"][2]),
}


def _torch_with_bias(x: Any, w: Any, b: Any, attrs: dict[str, Any]) -> Any:
    """ONNX's ConvTranspose by torch: the window of the full output, then the bias on every row of it."""
    if "output_shape" in attrs:
        y = _torch_with_output_shape(x, w, attrs, attrs.get("auto_pad", "NOTSET"))
    elif "auto_pad" in attrs:  # SAME: the window of S·s rows, the pads split as for an output_shape
        want = [n * s for n, s in zip(x.shape[2:], attrs["strides"], strict=True)]
        same = {**attrs, "output_padding": [0] * (x.ndim - 2), "output_shape": want}
        y = _torch_with_output_shape(x, w, same, attrs["auto_pad"])
    else:
        y = _torch(x, w, attrs)
    return y + b.reshape(1, -1, *[1] * (x.ndim - 2))


def _biased_model(xs: tuple, ws: tuple, attrs: dict[str, Any], opset: int = 17) -> onnx.ModelProto:
    cout = ws[1] * attrs.get("group", 1)
    node = helper.make_node("ConvTranspose", ["x", "w", "b"], ["y"], name="up", **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, xs),
                                        helper.make_tensor_value_info("w", TensorProto.FLOAT, ws),
                                        helper.make_tensor_value_info("b", TensorProto.FLOAT, [cout])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None] * len(xs))])
    ir = 8 if opset > 6 else 3
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=ir)


@pytest.mark.parametrize(("case", "opset"), [(c, 17) for c in sorted(BIAS_CASES)]
                         + [("output-padding-rows", 10), ("output-padding-1d-grouped", 7)])
def test_a_rewritten_node_adds_its_bias_to_the_rows_it_adds(case: str, opset: int) -> None:
    from onnxtrain.engine.backends import make_plan

    xs, ws, attrs = BIAS_CASES[case]
    cout = ws[1] * attrs.get("group", 1)
    model = _biased_model(xs, ws, attrs, opset)
    rng = np.random.default_rng(21)
    shape = tuple(4 if isinstance(d, str) else d for d in xs)
    feeds = {"x": rng.standard_normal(shape).astype(np.float32),
             "w": rng.standard_normal(ws).astype(np.float32),
             "b": rng.standard_normal(cout).astype(np.float32) + 2}
    want = _torch_with_bias(*(torch.tensor(feeds[k], dtype=torch.float64) for k in ("x", "w", "b")),
                            attrs).numpy()
    for backend in ("onnxruntime", "numpy"):
        got = make_plan(model, backend).run(feeds)[0]
        assert got.shape == want.shape, backend
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=backend)


def test_a_biased_node_that_needs_rows_is_refused_by_name_below_opset_7() -> None:
    """The bias goes to an Add, which onnxruntime 1.32 does not run below opset 7: refused when the session is
    made, naming the node (it ran, without the bias on the added rows)."""
    from onnxtrain.engine.backends import make_plan

    xs, ws, attrs = BIAS_CASES["output-padding-rows"]
    with pytest.raises(ValueError, match=r"node 'up' \(ConvTranspose\).*no Add below opset 7"):
        make_plan(_biased_model(xs, ws, attrs, opset=6), "onnxruntime")
    # without a bias it needs no Add, and runs there as before
    model = _model(xs, ws, attrs, opset=6)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal(xs).astype(np.float32), "w": rng.standard_normal(ws).astype(np.float32)}
    want = _torch(*(torch.tensor(feeds[k], dtype=torch.float64) for k in ("x", "w")), attrs).numpy()
    np.testing.assert_allclose(make_plan(model, "onnxruntime").run(feeds)[0], want, rtol=1e-5, atol=1e-5)
