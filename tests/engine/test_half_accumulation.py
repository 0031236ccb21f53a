"""float16 and bfloat16 in kernels that accumulate: CumSum, AveragePool/LpPool and their Global forms, Conv
(with bias), ConvTranspose, Col2Im, Mean, Sum and LRN's window sum in float32 and round to the half type
once, as ONNX's reference and onnxruntime do; bfloat16 Conv and RNN/GRU/LSTM outputs keep the declared type;
MaxPool runs on bfloat16.

Oracles: float64 numpy/torch results (an output rounded once is within half an ulp of them; summing in
the half type was several ulps off, or stopped growing, or overflowed), onnxruntime's float16 kernels, and,
for bfloat16 (which onnxruntime's CPU kernels lack), onnxruntime in float32 on the same bfloat16 values.
"""

from __future__ import annotations

from typing import Any

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model

F16 = np.dtype(np.float16)
BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [F16, BF16]
ONCE = 0.51  # ulps: rounded once from a float32 sum (float32's own error is ~1e-4 of a half ulp)
CANCEL = 1 / 16  # products of mixed signs: ulps taken at no less than 1/16 of the largest output


def _model(op: str, inputs: list[Any], opset: int, n_outputs: int = 1, out_types: list[int] | None = None,
           **attrs: Any) -> onnx.ModelProto:
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    outs = [f"y{i}" for i in range(n_outputs)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs, strict=True) if n]
    elem = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)
    types = out_types or [elem] * n_outputs
    g_out = [helper.make_tensor_value_info(n, t, None) for n, t in zip(outs, types, strict=True)]
    graph = helper.make_graph([helper.make_node(op, names, outs, **attrs)], op, g_in, g_out)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=10)


def _ours(op: str, inputs: list[Any], opset: int = 22, n_outputs: int = 1, fuse: bool = True,
          **attrs: Any) -> list[np.ndarray]:
    feeds = {f"x{i}": v for i, v in enumerate(inputs) if v is not None}
    return compile_model(_model(op, inputs, opset, n_outputs, **attrs), fuse=fuse).run(feeds)


def _ort(op: str, inputs: list[Any], opset: int = 22, n_outputs: int = 1, **attrs: Any) -> list[np.ndarray]:
    ort = pytest.importorskip("onnxruntime")
    model = _model(op, inputs, opset, n_outputs, **attrs)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {f"x{i}": v for i, v in enumerate(inputs) if v is not None})


def _f32(inputs: list[Any]) -> list[Any]:
    """The inputs' float values in float32 (bfloat16 → float32 is exact); integer inputs as they are."""
    return [v if v is None or v.dtype.kind in "iu" else v.astype(np.float32) for v in inputs]


def _ulps(y: np.ndarray, ref: Any, dt: np.dtype, floor: float = 0.0) -> float:
    """max |y − ref| in ulps of ``dt`` at |ref|, or at ``floor`` × max|ref| where |ref| is smaller (sums
    that cancel to near zero carry float32's own error, large in ulps of a tiny result)."""
    ref = np.asarray(ref, dtype=np.float64)
    mant, emin = (10, -14) if dt == F16 else (7, -126)
    lo = max(2.0 ** emin, floor * float(np.max(np.abs(ref))))
    e = np.floor(np.log2(np.maximum(np.abs(ref), lo)))
    ulp = 2.0 ** (np.maximum(e, emin) - mant)
    assert y.dtype == dt, f"output is {y.dtype}, not {dt}"
    return float(np.max(np.abs(y.astype(np.float64) - ref) / ulp))


def _rand(rng: np.random.Generator, shape: tuple[int, ...], dt: np.dtype, lo: float = -1.0,
          hi: float = 1.0) -> np.ndarray:
    return rng.uniform(lo, hi, shape).astype(dt)


# --- CumSum --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_cumsum_of_ones_counts_past_the_half_types_integer_range(dt: np.dtype) -> None:
    # summed in float16 the running sum stopped at 2048 (bfloat16: 256)
    x = np.ones(4096, dt)
    (y,) = _ours("CumSum", [x, np.array(0, np.int64)], opset=14)
    assert y.dtype == dt
    np.testing.assert_array_equal(y.astype(np.float64), np.arange(1, 4097).astype(dt).astype(np.float64))


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("mode", [{}, {"reverse": 1}, {"exclusive": 1}, {"reverse": 1, "exclusive": 1}],
                         ids=["plain", "reverse", "exclusive", "reverse_exclusive"])
def test_cumsum_is_rounded_once(dt: np.dtype, mode: dict[str, int]) -> None:
    rng = np.random.default_rng(1)
    x = _rand(rng, (3, 2048), dt, 0.0, 1.0)
    (y,) = _ours("CumSum", [x, np.array(1, np.int64)], opset=14, **mode)
    x64 = x.astype(np.float64)
    if mode.get("reverse"):
        x64 = x64[:, ::-1]
    ref = np.cumsum(x64, axis=1)
    if mode.get("exclusive"):
        ref = np.concatenate([np.zeros((3, 1)), ref[:, :-1]], axis=1)
    if mode.get("reverse"):
        ref = ref[:, ::-1]
    assert _ulps(y, ref, dt) <= ONCE
    if dt == F16:  # onnxruntime's float16 CumSum
        (r,) = _ort("CumSum", [x, np.array(1, np.int64)], opset=14, **mode)
        assert np.max(np.abs(y.astype(np.float64) - r.astype(np.float64))
                      / np.spacing(np.abs(r)).astype(np.float64)) <= 1


def test_cumsum_float32_is_unchanged() -> None:
    x = np.random.default_rng(2).uniform(0, 1, (4, 999)).astype(np.float32)
    (y,) = _ours("CumSum", [x, np.array(1, np.int64)], opset=14)
    np.testing.assert_array_equal(y, np.cumsum(x, axis=1, dtype=np.float32))


# --- pools ---------------------------------------------------------------------------------------------

def _torch_avg_pool(x: np.ndarray, k: list[int], s: list[int], p: list[int], include_pad: bool,
                    ceil: bool) -> np.ndarray:
    torch = pytest.importorskip("torch")
    t = torch.from_numpy(x.astype(np.float64))
    y = torch.nn.functional.avg_pool2d(t, k, s, p, ceil_mode=ceil, count_include_pad=include_pad)
    return y.numpy()


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("k,s,p,include_pad,ceil", [
    ([3, 3], [1, 1], [0, 0], False, False),
    ([3, 3], [2, 2], [1, 1], True, False),
    ([3, 3], [2, 2], [1, 1], False, True),
    ([8, 8], [8, 8], [0, 0], False, False),
    ([7, 5], [1, 2], [3, 2], False, False),
])
def test_average_pool_sums_and_divides_in_float32(dt: np.dtype, k: list[int], s: list[int], p: list[int],
                                                   include_pad: bool, ceil: bool) -> None:
    rng = np.random.default_rng(3)
    x = _rand(rng, (2, 3, 32, 32), dt, 0.5, 1.5)
    attrs = {"kernel_shape": k, "strides": s, "pads": p + p, "count_include_pad": int(include_pad),
             "ceil_mode": int(ceil)}
    (y,) = _ours("AveragePool", [x], **attrs)
    assert _ulps(y, _torch_avg_pool(x, k, s, p, include_pad, ceil), dt) <= ONCE
    if dt == F16:
        (r,) = _ort("AveragePool", [x], **attrs)
        assert _ulps(r, _torch_avg_pool(x, k, s, p, include_pad, ceil), dt) <= ONCE  # the oracle agrees


@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_average_pool_of_exact_sums_is_unbiased(dt: np.dtype) -> None:
    """Integer values: the window sums are exact, so only the division rounds (1/9 rounded to the half type
    and multiplied biased every output by the same relative error)."""
    x = np.random.default_rng(4).integers(1, 30, (4, 8, 30, 30)).astype(dt)
    (y,) = _ours("AveragePool", [x], kernel_shape=[3, 3])
    ref = _torch_avg_pool(x, [3, 3], [1, 1], [0, 0], False, False)
    assert _ulps(y, ref, dt) <= ONCE
    rel = (y.astype(np.float64) - ref) / ref
    assert abs(float(rel.mean())) < (1e-4 if dt == F16 else 5e-4)


def test_float16_average_pool_of_large_values_does_not_overflow() -> None:
    x = np.full((1, 1, 4, 4), 60000, F16)
    (y,) = _ours("AveragePool", [x], kernel_shape=[2, 2], strides=[2, 2])
    np.testing.assert_array_equal(y, np.full((1, 1, 2, 2), 60000, F16))
    (y,) = _ours("LpPool", [np.full((1, 1, 4, 4), 300, F16)], kernel_shape=[2, 2], p=2)
    np.testing.assert_array_equal(y, np.full((1, 1, 3, 3), 600, F16))  # x² = 90000 > 65504


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("p", [1, 2, 3])
def test_lp_pool_in_float32(dt: np.dtype, p: int) -> None:
    torch = pytest.importorskip("torch")
    x = _rand(np.random.default_rng(5), (2, 3, 24, 24), dt, 0.5, 1.5)
    (y,) = _ours("LpPool", [x], kernel_shape=[6, 6], strides=[2, 2], p=p)
    ref = torch.nn.functional.lp_pool2d(torch.from_numpy(x.astype(np.float64)), p, 6, 2).numpy()
    assert _ulps(y, ref, dt) <= ONCE


@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_global_pools_in_float32(dt: np.dtype) -> None:
    x = _rand(np.random.default_rng(6), (2, 3, 64, 64), dt, 0.5, 1.5)
    x64 = x.astype(np.float64)
    (y,) = _ours("GlobalAveragePool", [x])
    assert _ulps(y, x64.mean(axis=(2, 3), keepdims=True), dt) <= ONCE  # bfloat16 gave 0.125
    for p in (1, 2, 3):
        (y,) = _ours("GlobalLpPool", [x], p=p)
        ref = (np.abs(x64) ** p).sum(axis=(2, 3), keepdims=True) ** (1 / p)
        assert _ulps(y, ref, dt) <= ONCE
    if dt == F16:
        (r,) = _ort("GlobalAveragePool", [x])
        np.testing.assert_array_equal(_ours("GlobalAveragePool", [x])[0], r)


def test_float16_global_lp_pool_squares_do_not_overflow() -> None:
    (y,) = _ours("GlobalLpPool", [np.full((1, 2, 2, 2), 300, F16)], p=2)
    np.testing.assert_array_equal(y, np.full((1, 2, 1, 1), 600, F16))


@pytest.mark.parametrize("pads", [[0, 0, 0, 0], [1, 1, 1, 1]])
def test_max_pool_on_bfloat16(pads: list[int]) -> None:
    x = _rand(np.random.default_rng(7), (2, 4, 9, 9), BF16, -2.0, -1.0)  # all negative: the pad must lose
    attrs = {"kernel_shape": [3, 3], "strides": [2, 2], "pads": pads}
    tp = onnx.TensorProto
    y, idx = _ours("MaxPool", [x], n_outputs=2, out_types=[tp.BFLOAT16, tp.INT64], **attrs)
    r, ridx = _ort("MaxPool", _f32([x]), n_outputs=2, out_types=[tp.FLOAT, tp.INT64], **attrs)
    assert y.dtype == BF16
    np.testing.assert_array_equal(y.astype(np.float32), r)
    np.testing.assert_array_equal(idx, ridx)
    (y1,) = _ours("MaxPool", [x], **attrs)
    np.testing.assert_array_equal(y1.astype(np.float32), r)


# --- Conv, ConvTranspose, Col2Im ----------------------------------------------------------------------

def _torch_conv(x: np.ndarray, w: np.ndarray, b: np.ndarray | None, transpose: bool = False,
                **kw: Any) -> np.ndarray:
    torch = pytest.importorskip("torch")
    f = torch.nn.functional.conv_transpose2d if transpose else torch.nn.functional.conv2d
    t = [torch.from_numpy(v.astype(np.float64)) if v is not None else None for v in (x, w, b)]
    return f(t[0], t[1], t[2], **kw).numpy()


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("c,m,group,stride,pad,bias", [
    (64, 8, 1, 1, 1, True),  # 3×3 shifted GEMMs in float32
    (3, 5, 1, 2, 0, True),  # im2col
    (8, 8, 4, 1, 1, True),  # grouped
    (16, 4, 1, 1, 0, False),
])
def test_conv_rounds_once_and_keeps_the_half_type(dt: np.dtype, c: int, m: int, group: int, stride: int,
                                                 pad: int, bias: bool) -> None:
    rng = np.random.default_rng(8)
    x = _rand(rng, (2, c, 12, 12), dt)
    w = _rand(rng, (m, c // group, 3, 3), dt)
    b = _rand(rng, (m,), dt) * np.asarray(8, dt) if bias else None
    attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "group": group}
    (y,) = _ours("Conv", [x, w, b] if bias else [x, w], **attrs)
    assert y.dtype == dt  # bfloat16 came out float32 (numpy's bfloat16 matmul)
    ref = _torch_conv(x, w, b, stride=stride, padding=pad, groups=group)
    assert _ulps(y, ref, dt, CANCEL) <= ONCE  # the bias was added after a rounding: 1 ulp
    if dt == F16:
        (r,) = _ort("Conv", [x, w, b] if bias else [x, w], **attrs)
        assert _ulps(r, ref, dt, CANCEL) <= ONCE


def test_bfloat16_conv_add_relu_graph_stays_bfloat16() -> None:
    rng = np.random.default_rng(9)
    x, w = _rand(rng, (1, 4, 8, 8), BF16), _rand(rng, (4, 4, 3, 3), BF16)
    bf = onnx.TensorProto.BFLOAT16
    g = helper.make_graph(
        [helper.make_node("Conv", ["x", "w"], ["c"], pads=[1, 1, 1, 1]),
         helper.make_node("Add", ["c", "x"], ["a"]), helper.make_node("Relu", ["a"], ["y"])], "g",
        [helper.make_tensor_value_info("x", bf, x.shape), helper.make_tensor_value_info("w", bf, w.shape)],
        [helper.make_tensor_value_info("y", bf, None)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 22)], ir_version=10)
    for fuse in (True, False):
        (y,) = compile_model(model, fuse=fuse).run({"x": x, "w": w})
        assert y.dtype == BF16


@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("c,m,group,k,stride,pad,out_pad", [
    (64, 8, 1, 3, 1, 1, 0),  # as the equivalent Conv (shifted GEMMs)
    (4, 6, 1, 3, 1, 0, 0),  # col2im over flattened rows
    (6, 4, 1, 4, 2, 1, 0),  # strided col2im
    (4, 4, 2, 3, 2, 1, 1),  # grouped, output_padding
])
def test_conv_transpose_sums_contributions_in_float32(dt: np.dtype, c: int, m: int, group: int, k: int,
                                                      stride: int, pad: int, out_pad: int) -> None:
    rng = np.random.default_rng(10)
    x = _rand(rng, (2, c, 10, 10), dt)
    w = _rand(rng, (c, m // group, k, k), dt)
    b = _rand(rng, (m,), dt)
    attrs = {"strides": [stride] * 2, "pads": [pad] * 4, "group": group, "output_padding": [out_pad] * 2}
    (y,) = _ours("ConvTranspose", [x, w, b], **attrs)
    ref = _torch_conv(x, w, b, transpose=True, stride=stride, padding=pad, groups=group,
                      output_padding=out_pad)
    assert _ulps(y, ref, dt, CANCEL) <= ONCE


def test_float16_conv_transpose_cancelling_contributions_do_not_overflow() -> None:
    # the one output kept by the pads is 40000 + 40000 − 40000 − 40000 = 0: summed in float16, the partial
    # 80000 became inf
    x = np.ones((1, 1, 1, 4), F16)
    w = np.array([40000, 40000, -40000, -40000], F16).reshape(1, 1, 1, 4)
    (y,) = _ours("ConvTranspose", [x, w], pads=[0, 3, 0, 3])
    ref = _torch_conv(x, w, None, transpose=True, padding=(0, 3))
    np.testing.assert_array_equal(ref, [[[[0.0]]]])
    np.testing.assert_array_equal(y, np.zeros((1, 1, 1, 1), F16))


@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_col2im_sums_blocks_in_float32(dt: np.dtype) -> None:
    torch = pytest.importorskip("torch")
    x = _rand(np.random.default_rng(11), (2, 3 * 16, 144), dt)
    image, block = np.array([13, 13], np.int64), np.array([4, 4], np.int64)
    (y,) = _ours("Col2Im", [x, image, block], opset=18, dilations=[1, 1], pads=[1, 1, 1, 1], strides=[1, 1])
    ref = torch.nn.functional.fold(torch.from_numpy(x.astype(np.float64)), (13, 13), (4, 4),
                                   padding=1).numpy()
    assert _ulps(y, ref, dt, CANCEL) <= ONCE


# --- RNN / GRU / LSTM ---------------------------------------------------------------------------------

@pytest.mark.parametrize("op,gates", [("RNN", 1), ("GRU", 3), ("LSTM", 4)])
def test_bfloat16_recurrent_outputs_are_bfloat16(op: str, gates: int) -> None:
    rng = np.random.default_rng(12)
    hid, n_in = 8, 5
    x = _rand(rng, (6, 3, n_in), BF16)
    w = _rand(rng, (2, gates * hid, n_in), BF16) * np.asarray(0.5, BF16)
    r = _rand(rng, (2, gates * hid, hid), BF16) * np.asarray(0.5, BF16)
    b = _rand(rng, (2, 2 * gates * hid), BF16) * np.asarray(0.1, BF16)
    n_out = 3 if op == "LSTM" else 2
    attrs = {"hidden_size": hid, "direction": "bidirectional"}
    ys = _ours(op, [x, w, r, b], n_outputs=n_out, **attrs)
    refs = _ort(op, _f32([x, w, r, b]), n_outputs=n_out, **attrs)  # float32 on the same values
    for y, ref in zip(ys, refs, strict=True):
        assert y.dtype == BF16  # Y_h and Y_c were float32
        assert _ulps(y, ref, BF16, CANCEL) <= ONCE


# --- Mean ----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("fuse", [True, False])
def test_mean_sums_and_divides_in_float32(dt: np.dtype, fuse: bool) -> None:
    rng = np.random.default_rng(13)
    xs = [_rand(rng, (64, 32), dt, 0.0, 4.0) for _ in range(15)] + [_rand(rng, (32,), dt, 0.0, 4.0)]
    (y,) = _ours("Mean", xs, fuse=fuse)
    ref = np.mean(np.stack([np.broadcast_to(v.astype(np.float64), (64, 32)) for v in xs]), axis=0)
    assert _ulps(y, ref, dt) <= ONCE
    if dt == F16:
        (r,) = _ort("Mean", xs)
        assert _ulps(r, ref, dt) <= ONCE


# --- Sum -----------------------------------------------------------------------------------------------

def _sum_graph(dt: np.dtype, k: int, then: str | None = None) -> onnx.ModelProto:
    """Sum of ``k`` products x_i · x_0 (so its inputs and output are intermediate values of no declared
    type), optionally followed by an elementwise ``then`` (a cluster the Sum's Adds could join)."""
    elem = helper.np_dtype_to_tensor_dtype(dt)
    nodes = [helper.make_node("Mul", [f"x{i}", "x0"], [f"p{i}"]) for i in range(k)]
    nodes.append(helper.make_node("Sum", [f"p{i}" for i in range(k)], ["s" if then else "y0"]))
    if then:
        nodes.append(helper.make_node(then, ["s"], ["y0"]))
    g_in = [helper.make_tensor_value_info(f"x{i}", elem, None) for i in range(k)]
    g = helper.make_graph(nodes, "sum", g_in, [helper.make_tensor_value_info("y0", elem, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


@pytest.mark.parametrize("dt", HALVES, ids=str)
def test_sum_adds_in_float32_fused_and_unfused_alike(dt: np.dtype) -> None:
    """Variadic Sum of half inputs adds in float32 and rounds once (it folded in the half type, 3 ulps off
    over 16 inputs); the fusion expand_sums, which rewrites float32 Sums as Adds, leaves it as it is, so
    fused and unfused give the same bits."""
    rng = np.random.default_rng(17)
    xs = [_rand(rng, (64, 32), dt, 0.0, 4.0) for _ in range(15)] + [_rand(rng, (32,), dt, 0.0, 4.0)]
    ref = np.sum(np.stack([np.broadcast_to(v.astype(np.float64), (64, 32)) for v in xs]), axis=0)
    (fused,) = _ours("Sum", xs)
    (plain,) = _ours("Sum", xs, fuse=False)
    assert fused.tobytes() == plain.tobytes()
    assert _ulps(fused, ref, dt) <= ONCE
    if dt == F16:
        (r,) = _ort("Sum", xs)
        assert _ulps(r, ref, dt) <= ONCE
    (two,) = _ours("Sum", xs[:2])  # two inputs: one rounding either way
    assert two.tobytes() == (xs[0].astype(np.float32) + xs[1].astype(np.float32)).astype(dt).tobytes()


@pytest.mark.parametrize("dt", [*HALVES, np.dtype(np.float32)], ids=str)
@pytest.mark.parametrize("then", [None, "Neg"])
def test_sum_of_intermediates_is_expanded_only_in_full_precision(dt: np.dtype, then: str | None) -> None:
    """The Sum's type comes from the graph or, for values of no declared type, from type inference: a float32
    Sum becomes Adds (and joins the products' cluster), a half one stays a Sum; fused = unfused bitwise."""
    from onnxtrain.engine.plan import Plan

    m = _sum_graph(dt, 6, then)
    fused, plain = Plan(m), Plan(m, fuse=False)
    ops = [st.node.op_type for st in fused.steps]
    assert ("Sum" in ops) == (dt != np.float32)
    rng = np.random.default_rng(3)
    feeds = {f"x{i}": _rand(rng, (16, 24), dt) for i in range(6)}
    got, want = fused.run(feeds)[0], plain.run(feeds)[0]
    assert got.dtype == dt and got.tobytes() == want.tobytes()
    if dt != np.float32:
        x = [v.astype(np.float32) for v in feeds.values()]
        # each product rounded to the half type, as the Muls give them, then summed in float32
        s = (x[0] * x[0]).astype(dt).astype(np.float32)
        for v in x[1:]:
            s += (v * x[0]).astype(dt).astype(np.float32)
        s = s.astype(dt)
        assert want.tobytes() == (-s if then else s).tobytes()


# --- LRN -----------------------------------------------------------------------------------------------

@pytest.mark.parametrize("dt", HALVES, ids=str)
@pytest.mark.parametrize("size", [3, 5])
def test_lrn_window_sum_in_float32(dt: np.dtype, size: int) -> None:
    rng = np.random.default_rng(size)
    x = _rand(rng, (2, 16, 5, 5), dt, -3.0, 3.0)
    attrs = {"size": size, "alpha": 1e-2, "beta": 0.75, "bias": 1.0}
    (y,) = _ours("LRN", [x], opset=13, **attrs)
    w = x.astype(np.float64)
    sq = np.pad(w * w, ((0, 0), ((size - 1) // 2, size // 2), (0, 0), (0, 0)))
    s = sum(sq[:, i:i + 16] for i in range(size))
    ref = w / (1.0 + 1e-2 / size * s) ** 0.75
    assert _ulps(y, ref, dt) <= ONCE
    if dt == F16:
        (r,) = _ort("LRN", [x], opset=13, **attrs)
        assert _ulps(r, ref, dt) <= ONCE
