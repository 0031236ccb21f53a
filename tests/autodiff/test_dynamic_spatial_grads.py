"""Conv, ConvTranspose and pooling gradients when the spatial sizes are symbolic (an export with dynamic
height and width): ceil-mode pools, auto_pad SAME, MaxPool's column-major Indices and ConvTranspose's
output_shape. Each gradient graph is built once from a model whose input is (N, C, 'H', 'W'), then run at
two spatial sizes (odd ones among them, where ceil mode adds a partial window) and compared with torch
autograd in float64; the graph passes onnx.checker's full check and onnxruntime gives the engine's values.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
F = torch.nn.functional


# ---- the spec's formulas, written out here as the oracle's padding -----------------------------------
def same_pads(size: int, k: int, s: int, d: int, upper: bool) -> tuple[int, int]:
    """auto_pad SAME_*: output ⌈size / s⌉, the total pad split with the odd one at the end (UPPER) or
    the beginning (LOWER)."""
    out = -(-size // s)
    total = max(0, (out - 1) * s + (k - 1) * d + 1 - size)
    return (total // 2, total - total // 2) if upper else (total - total // 2, total // 2)


def _tpad(pads_hw: list[tuple[int, int]]) -> tuple[int, ...]:
    """torch's F.pad order (last axis first) from per-axis (begin, end) pads."""
    out: list[int] = []
    for b, e in reversed(pads_hw):
        out += [b, e]
    return tuple(out)


def _sum_pool(t: Any, k: list[int], s: list[int], ceil: bool = False) -> Any:
    """Window sums (no division), torch's avg_pool2d with divisor 1."""
    return F.avg_pool2d(t, k, s, ceil_mode=ceil, divisor_override=1)


# ---- model, gradient graph, runs ------------------------------------------------------------------------
def _model(op: str, attrs: dict[str, Any], c: int, w_shape: tuple[int, ...] | None, bias: int | None,
           elem: int, opset: int) -> onnx.ModelProto:
    """loss = Σ op(x[, w, b]) · u with x (N, c, H, W) and u of a symbolic shape, fed at run time."""
    names = ["x"]
    ins = [helper.make_tensor_value_info("x", elem, ["N", c, "H", "W"])]
    if w_shape is not None:
        names.append("w")
        ins.append(helper.make_tensor_value_info("w", elem, w_shape))
    if bias is not None:
        names.append("b")
        ins.append(helper.make_tensor_value_info("b", elem, [bias]))
    ins.append(helper.make_tensor_value_info("u", elem, ["N", "M", "P", "Q"]))
    nodes = [helper.make_node(op, names, ["y"], name="node", **attrs),
             helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, op, ins, [helper.make_tensor_value_info("loss", elem, [])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)], ir_version=9)


def _check_at_sizes(
    op: str,
    attrs: dict[str, Any],
    fn: Callable[..., Any],
    sizes: list[tuple[int, int]],
    c: int = 2,
    w_shape: tuple[int, ...] | None = None,
    bias: int | None = None,
    opset: int = 17,
    distinct: bool = False,
) -> None:
    """The gradient graph in float64, run at each (H, W), against torch autograd (``fn(x, w, b, (H, W))``);
    the float32 graph (onnxruntime's CPU pools and convolutions take no float64) on onnxruntime against
    the engine, and both against torch."""
    wrt = ["x"] + (["w"] if w_shape is not None else []) + (["b"] if bias is not None else [])
    graphs = {}
    for dtype in (np.float64, np.float32):
        model = _model(op, attrs, c, w_shape, bias, helper.np_dtype_to_tensor_dtype(np.dtype(dtype)), opset)
        gmodel = build_gradient_model(model, "loss", wrt)
        onnx.checker.check_model(gmodel, full_check=True)
        graphs[dtype] = gmodel
    g32 = graphs[np.float32]
    sess = ort.InferenceSession(g32.SerializeToString(), providers=["CPUExecutionProvider"])
    ort_refuses = op == "Conv" and "auto_pad" in attrs and any(v != 1 for v in attrs.get("dilations", [1]))
    out_names = [o.name for o in g32.graph.output]
    rng = np.random.default_rng(11)
    for hw in sizes:
        xs = (2, c, *hw)
        if distinct:  # no ties for max pooling (exact in float32 too)
            x = rng.permutation(int(np.prod(xs))).reshape(xs) / np.prod(xs)
        else:
            x = rng.standard_normal(xs)
        feeds = {"x": x}
        if w_shape is not None:
            feeds["w"] = rng.standard_normal(w_shape)
        if bias is not None:
            feeds["b"] = rng.standard_normal(bias)
        ts = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
        y = fn(ts["x"], ts.get("w"), ts.get("b"), hw)
        feeds["u"] = rng.standard_normal(tuple(y.shape))
        (y * torch.tensor(feeds["u"])).sum().backward()
        want = {f"{n}_grad": ts[n].grad.numpy() for n in wrt}
        ours = dict(zip(out_names, run_engine(graphs[np.float64], feeds)))
        for k, v in want.items():
            np.testing.assert_allclose(ours[k], v, rtol=1e-10, atol=1e-12,
                                       err_msg=f"{op} {k} at {hw}: engine (float64) vs torch")
        f32 = {k: v.astype(np.float32) for k, v in feeds.items()}
        ours32 = dict(zip(out_names, run_engine(g32, f32)))
        if ort_refuses:  # onnxruntime's own Conv kernel refuses the forward node, not our backward
            with pytest.raises(Exception, match="Dilation not supported for AutoPadType::SAME"):
                sess.run(None, f32)
        else:
            theirs32 = dict(zip(out_names, sess.run(None, f32)))
            for k in out_names:
                np.testing.assert_allclose(theirs32[k], ours32[k], rtol=1e-5, atol=1e-5,
                                           err_msg=f"{op} {k} at {hw}: onnxruntime vs engine (float32)")
        for k, v in want.items():
            np.testing.assert_allclose(ours32[k], v, rtol=1e-4, atol=1e-4,
                                       err_msg=f"{op} {k} at {hw}: engine (float32) vs torch")


def _ceil_matters(k: int, s: int, p: int, size: int) -> bool:
    """Whether ceil mode's rounding up changes the output count on an axis of ``size`` (one more window,
    or one that is dropped again because it would start in the end pad)."""
    span = size + 2 * p - k
    return -(-span // s) != span // s


# ---- AveragePool ------------------------------------------------------------------------------------------
AVG_CEIL = [  # kernel, stride, pad, sizes
    (3, 2, 1, [(7, 6), (10, 9)]),
    (2, 2, 0, [(7, 9), (4, 5)]),
    (3, 2, 0, [(8, 7), (9, 6)]),
    (2, 3, 1, [(10, 7), (8, 11)]),  # the extra ceil-mode window would start in the end pad: dropped
]


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("k,s,p,sizes", AVG_CEIL, ids=lambda v: str(v))
def test_average_pool_ceil_mode_dynamic(k: int, s: int, p: int, sizes: list, include_pad: int) -> None:
    assert any(_ceil_matters(k, s, p, v) for hw in sizes for v in hw)
    attrs = {"kernel_shape": [k, k], "strides": [s, s], "pads": [p] * 4, "ceil_mode": 1,
             "count_include_pad": include_pad}
    _check_at_sizes("AveragePool", attrs, lambda x, w, b, hw: F.avg_pool2d(
        x, k, s, p, ceil_mode=True, count_include_pad=bool(include_pad)), sizes)


@pytest.mark.parametrize("include_pad", [0, 1])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("k,s", [((3, 3), (2, 2)), ((2, 4), (2, 3))], ids=str)
def test_average_pool_auto_pad_same_dynamic(k, s, auto_pad: str, include_pad: int) -> None:
    upper = auto_pad == "SAME_UPPER"

    def fn(x, w, b, hw):
        pads = [same_pads(hw[i], k[i], s[i], 1, upper) for i in range(2)]
        total = _sum_pool(F.pad(x, _tpad(pads)), list(k), list(s))
        if include_pad:  # SAME's windows all lie inside X and its pads: k elements each
            return total / float(np.prod(k))
        return total / _sum_pool(F.pad(torch.ones_like(x), _tpad(pads)), list(k), list(s))

    attrs = {"kernel_shape": list(k), "strides": list(s), "auto_pad": auto_pad,
             "count_include_pad": include_pad}
    _check_at_sizes("AveragePool", attrs, fn, [(7, 6), (10, 11)])


# ---- LpPool ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("p_norm", [2, 3])
@pytest.mark.parametrize("k,s,sizes", [(3, 2, [(8, 7), (9, 10)]), (2, 2, [(5, 7), (6, 9)])], ids=str)
def test_lp_pool_ceil_mode_dynamic(k: int, s: int, sizes: list, p_norm: int) -> None:
    """LpPool's ceil_mode (opset 18): the partial window sums the elements it covers (torch's lp_pool2d
    would scale that sum up to a full window, so the oracle is a sum pool)."""
    assert any(_ceil_matters(k, s, 0, v) for hw in sizes for v in hw)
    attrs = {"kernel_shape": [k, k], "strides": [s, s], "ceil_mode": 1, "p": p_norm}
    _check_at_sizes("LpPool", attrs, lambda x, w, b, hw: _sum_pool(
        x.abs() ** p_norm, [k, k], [s, s], ceil=True) ** (1.0 / p_norm), sizes, opset=18)


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_lp_pool_auto_pad_same_dynamic(auto_pad: str) -> None:
    upper = auto_pad == "SAME_UPPER"

    def fn(x, w, b, hw):
        pads = [same_pads(hw[i], 2, 2, 1, upper) for i in range(2)]
        return _sum_pool(F.pad(x, _tpad(pads)) ** 2, [2, 2], [2, 2]).sqrt()

    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": auto_pad, "p": 2}
    _check_at_sizes("LpPool", attrs, fn, [(7, 6), (5, 9)])


# ---- MaxPool ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("k,s,p,ceil,d", [(3, 2, 1, 0, 1), (2, 2, 0, 1, 1), (3, 2, 1, 1, 2)], ids=str)
def test_max_pool_column_major_indices_dynamic(k: int, s: int, p: int, ceil: int, d: int) -> None:
    """storage_order=1: the Indices are decoded with the run-time H and W."""
    attrs = {"kernel_shape": [k, k], "strides": [s, s], "pads": [p] * 4, "ceil_mode": ceil,
             "dilations": [d, d], "storage_order": 1}
    _check_at_sizes("MaxPool", attrs, lambda x, w, b, hw: F.max_pool2d(
        x, k, s, p, dilation=d, ceil_mode=bool(ceil)), [(7, 6), (9, 11)], distinct=True)


@pytest.mark.parametrize("storage_order", [0, 1])
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
def test_max_pool_auto_pad_same_dynamic(auto_pad: str, storage_order: int) -> None:
    """In float32, non-overlapping windows try MaxUnpool, which needs static sizes: SAME's pads at run
    time must not stop the ScatterElements form."""
    upper = auto_pad == "SAME_UPPER"

    def fn(x, w, b, hw):
        pads = [same_pads(hw[i], 2, 2, 1, upper) for i in range(2)]
        return F.max_pool2d(F.pad(x, _tpad(pads), value=-np.inf), 2, 2)

    attrs = {"kernel_shape": [2, 2], "strides": [2, 2], "auto_pad": auto_pad, "storage_order": storage_order}
    _check_at_sizes("MaxPool", attrs, fn, [(7, 6), (5, 9)], distinct=True)


# ---- Conv -----------------------------------------------------------------------------------------------
CONV_SAME = [  # w shape, strides, dilations, group, sizes
    ((4, 3, 3, 3), (1, 1), (1, 1), 1, [(7, 6), (5, 8)]),
    ((4, 3, 2, 4), (1, 1), (2, 1), 1, [(7, 6), (6, 9)]),
    ((4, 3, 3, 3), (2, 2), (1, 1), 1, [(7, 6), (10, 9)]),
    ((6, 1, 4, 3), (2, 3), (1, 1), 3, [(9, 8), (6, 11)]),
    ((6, 1, 4, 3), (2, 3), (1, 2), 3, [(9, 8), (6, 11)]),
]


@pytest.mark.filterwarnings("ignore:Using padding='same'")  # torch's note on its own zero-padded copy
@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("ws,s,d,group,sizes", CONV_SAME, ids=str)
def test_conv_auto_pad_same_dynamic(ws, s, d, group: int, sizes: list, auto_pad: str) -> None:
    upper = auto_pad == "SAME_UPPER"
    c = ws[1] * group

    def fn(x, w, b, hw):
        if upper and s == (1, 1):  # torch's padding='same' puts the odd pad at the end, as SAME_UPPER
            return F.conv2d(x, w, b, padding="same", dilation=d, groups=group)
        pads = [same_pads(hw[i], ws[2 + i], s[i], d[i], upper) for i in range(2)]
        return F.conv2d(F.pad(x, _tpad(pads)), w, b, stride=s, dilation=d, groups=group)

    attrs = {"auto_pad": auto_pad, "strides": list(s), "dilations": list(d), "group": group}
    _check_at_sizes("Conv", attrs, fn, sizes, c=c, w_shape=ws, bias=ws[0])


# ---- ConvTranspose --------------------------------------------------------------------------------------
def _convt_cropped(x, w, b, s, d, group, op, pads):
    """The full ConvTranspose (no pads) then the spec's crop: begin/end pads cut (or, negative, add
    zero rows); output_padding rows are part of the full output before the crop."""
    full = F.conv_transpose2d(x, w, None, stride=s, dilation=d, groups=group)
    full = F.pad(full, _tpad([(0, op[0]), (0, op[1])]))
    y = F.pad(full, _tpad([(-pb, -pe) for pb, pe in pads]))
    return y + b.reshape(1, -1, 1, 1)


def _convt_pads(hw, k, s, d, op, out, upper: bool) -> list[tuple[int, int]]:
    pads = []
    for i in range(2):
        total = s[i] * (hw[i] - 1) + op[i] + (k[i] - 1) * d[i] + 1 - out[i]
        pb = total // 2 if upper else total - total // 2
        pads.append((pb, total - pb))
    return pads


CONVT_SAME = [  # w shape, strides, dilations, output_padding, group
    ((3, 2, 3, 3), (2, 2), (1, 1), (1, 1), 1),
    ((3, 2, 3, 3), (2, 2), (1, 1), (0, 0), 1),
    ((4, 1, 4, 3), (2, 3), (1, 2), (0, 1), 2),
]


@pytest.mark.parametrize("auto_pad", ["SAME_UPPER", "SAME_LOWER"])
@pytest.mark.parametrize("ws,s,d,op,group", CONVT_SAME, ids=str)
def test_conv_transpose_auto_pad_same_dynamic(ws, s, d, op, group: int, auto_pad: str) -> None:
    upper = auto_pad == "SAME_UPPER"
    k = ws[2:]

    def fn(x, w, b, hw):
        if upper and op == (1, 1) and d == (1, 1):  # total pad 1 + 3 − 2 = 2: torch's own padding
            return F.conv_transpose2d(x, w, b, stride=s, padding=1, output_padding=1, groups=group)
        out = [hw[i] * s[i] for i in range(2)]
        return _convt_cropped(x, w, b, s, d, group, op, _convt_pads(hw, k, s, d, op, out, upper))

    attrs = {"auto_pad": auto_pad, "strides": list(s), "dilations": list(d), "output_padding": list(op),
             "group": group}
    _check_at_sizes("ConvTranspose", attrs, fn, [(5, 4), (6, 7)], c=ws[0], w_shape=ws,
                    bias=ws[1] * group)


CONVT_OUT = [  # w shape, strides, dilations, group, output_shape, sizes (X's)
    ((3, 2, 3, 3), (2, 2), (1, 1), 1, (10, 9), [(5, 4), (4, 5)]),  # positive and zero total pads
    # total −1 on W, and on H at X's H 4: output_shape one past the full output, a zero (bias) row added
    ((4, 1, 3, 2), (2, 2), (2, 1), 2, (12, 9), [(5, 4), (4, 4)]),
]


@pytest.mark.parametrize("ws,s,d,group,out,sizes", CONVT_OUT, ids=str)
def test_conv_transpose_output_shape_dynamic(ws, s, d, group: int, out, sizes: list) -> None:
    """output_shape with X's sizes known only at run time: the pads follow from S at run time, and are
    negative (dY's extra rows cropped) where output_shape exceeds the full output."""
    k = ws[2:]
    attrs = {"output_shape": list(out), "strides": list(s), "dilations": list(d), "group": group}
    _check_at_sizes("ConvTranspose", attrs, lambda x, w, b, hw: _convt_cropped(
        x, w, b, s, d, group, (0, 0), _convt_pads(hw, k, s, d, (0, 0), out, False)),
        sizes, c=ws[0], w_shape=ws, bias=ws[1] * group)
