"""Gradient rules of the detection ops (same names as engine/kernels/detection.py).

RoiAlign and MaxRoiPool differentiate w.r.t. the feature map only; boxes and batch indices get none
(as in torchvision). The box geometry is recomputed from the boxes at run time with the kernel's
formulas. Samples per box vary with the box size (RoiAlign's adaptive ``sampling_ratio=0``, MaxRoiPool's
windows), so the rules pad every box to the largest count and mask the padding.

Float16 and bfloat16 graphs compute the geometry (and RoiAlign's whole backward) in float32, as the
kernels do.

Tie rule for the max modes: a bin's whole gradient goes to its first maximal candidate (MaxRoiPool: in
row-major window order; RoiAlign max: in (row sample, row tap, column sample, column tap) order).
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, numpy_helper
from onnx.helper import tensor_dtype_to_np_dtype

from onnxtrain.autodiff.context import GradCtx
from onnxtrain.autodiff.registry import gradient, no_gradient

no_gradient("NonMaxSuppression")


def _dim(g: GradCtx, axis: int) -> str:
    """Dimension ``axis`` of X as an int64 scalar (a constant when static)."""
    s = g.static_shape(0)
    if s is not None and s[axis] is not None:
        return g.int64(int(s[axis]))
    return g.shape_entry(g.shape(0), axis)


def _column(g: GradCtx, t: str, k: int) -> str:
    """Column ``k`` of a (R, n) tensor, as (R, 1)."""
    return g.emit("Slice", t, g.ints([k]), g.ints([k + 1]), g.ints([1]))


def _range(g: GradCtx, n: str) -> str:
    return g.emit("Range", g.int64(0), n, g.int64(1))


def _scatter_into_x(g: GradCtx, target: str, values: str) -> str:
    """dX: ``values`` added at the flat positions ``target`` of X (zero elsewhere), shaped like X."""
    shape = g.shape(0)
    zero = numpy_helper.from_array(np.zeros(1, dtype=tensor_dtype_to_np_dtype(g.dtype)))
    zeros = g.emit("ConstantOfShape", g.emit("ReduceProd", shape, keepdims=1), value=zero)
    flat = g.ints([-1])
    acc = g.emit("ScatterElements", zeros, g.emit("Reshape", target, flat), g.emit("Reshape", values, flat),
                 axis=0, reduction="add")
    return g.emit("Reshape", acc, shape)


def _plane_base(g: GradCtx, batch: str) -> str:
    """Flat offset of plane (batch[r], c) of X: (b·C + c)·H·W, shape (R, C)."""
    c, hw = _dim(g, 1), g.emit("Mul", _dim(g, 2), _dim(g, 3))
    b = g.emit("Reshape", batch, g.ints([-1, 1]))
    return g.emit("Mul", g.emit("Add", g.emit("Mul", b, c), _range(g, c)), hw)


def _first_max(g: GradCtx, idx: str, vals: str, valid: str | None) -> tuple[str, str]:
    """Over the last axis of (R, C, P, Q, K) candidates: the flat X position of the first maximum among
    the valid ones (all when ``valid`` is None), and its index along K (both (R, C, P, Q, 1))."""
    masked = vals if valid is None else g.emit("Where", valid, vals, g.const(-np.inf))
    am = g.emit("ArgMax", masked, axis=4, keepdims=1)
    return g.emit("GatherElements", idx, am, axis=4), am


# ---- RoiAlign -----------------------------------------------------------------------------------


class _Axis:
    """Bilinear taps of RoiAlign's samples along one axis, per box: positions (int64) and weights, each
    (R, P, G, 2) with G the most samples of any box; ``exists`` (R, 1, G, 1) masks the padding."""

    def __init__(self, g: GradCtx, start: str, extent: str, pooled: int, axis: int):
        ratio = int(g.attr("sampling_ratio") or 0)
        size = _dim(g, axis)
        size_f = g.emit("Cast", size, to=g.dtype)
        self.bin = g.emit("Div", extent, g.const(float(pooled)))  # (R, 1)
        if ratio > 0:
            self.grid = g.const(float(ratio))
            n = g.int64(ratio)
            self.exists = None
        else:
            self.grid = g.emit("Ceil", self.bin)
            top = g.emit("Cast", g.emit("ReduceMax", self.grid, keepdims=0), to=TensorProto.INT64)
            n = g.emit("Max", top, g.int64(1))
        i = g.emit("Reshape", g.emit("Cast", _range(g, n), to=g.dtype), g.ints([1, 1, -1]))  # (1, 1, G)
        p = g.const(np.arange(pooled, dtype=np.float64).reshape(1, pooled, 1))
        r3 = g.ints([-1, 1, 1])
        bin3 = g.emit("Reshape", self.bin, r3)
        grid3 = self.grid if ratio > 0 else g.emit("Reshape", self.grid, r3)
        # a box without samples (grid <= 0) divides by 1 instead: its positions stay finite, all masked
        safe = grid3 if ratio > 0 else g.emit("Max", grid3, g.const(1.0))
        pos = g.emit(
            "Add",
            g.emit("Add", g.emit("Reshape", start, r3), g.emit("Mul", p, bin3)),
            g.emit("Div", g.emit("Mul", g.emit("Add", i, g.const(0.5)), bin3), safe),
        )  # (R, P, G): the kernel's formula, term by term
        valid = g.emit("And", g.emit("GreaterOrEqual", pos, g.const(-1.0)),
                       g.emit("LessOrEqual", pos, size_f))
        if ratio <= 0:
            exists = g.emit("Less", i, grid3)  # (R, 1, G)
            valid = g.emit("And", valid, exists)
            self.exists = g.emit("Unsqueeze", exists, g.ints([-1]))
        last = g.emit("Sub", size_f, g.const(1.0))
        c = g.emit("Clip", pos, g.const(0.0), last)
        lo_f = g.emit("Floor", c)
        lo = g.emit("Cast", lo_f, to=TensorProto.INT64)
        hi = g.emit("Min", g.emit("Add", lo, g.int64(1)), g.emit("Sub", size, g.int64(1)))
        frac = g.emit("Sub", c, lo_f)
        zero = g.const(0.0)
        w_lo = g.emit("Where", valid, g.emit("Sub", g.const(1.0), frac), zero)
        w_hi = g.emit("Where", valid, frac, zero)
        self.pos = self._pair(g, lo, hi)
        self.w = self._pair(g, w_lo, w_hi)
        self.size = size

    @staticmethod
    def _pair(g: GradCtx, a: str, b: str) -> str:
        ax = g.ints([-1])
        return g.emit("Concat", g.emit("Unsqueeze", a, ax), g.emit("Unsqueeze", b, ax), axis=-1)

    def matrix(self, g: GradCtx) -> str:
        """(R, P, size): the summed tap weights of each output row (or column) on each input position."""
        onehot = g.emit("Equal", g.emit("Unsqueeze", self.pos, g.ints([-1])), _range(g, self.size))
        w = g.emit("Mul", g.emit("Cast", onehot, to=g.dtype), g.emit("Unsqueeze", self.w, g.ints([-1])))
        return g.reduce("ReduceSum", w, [2, 3], keepdims=0)


def _roi_axes(g: GradCtx, rois: str) -> tuple[_Axis, _Axis]:
    half = (g.attr("coordinate_transformation_mode") or "output_half_pixel") == "half_pixel"
    scale = float(g.attr("spatial_scale") if g.attr("spatial_scale") is not None else 1.0)
    s = g.emit("Sub", g.emit("Mul", rois, g.const(scale)), g.const(0.5 if half else 0.0))
    x1, y1, x2, y2 = (_column(g, s, k) for k in range(4))
    rh, rw = g.emit("Sub", y2, y1), g.emit("Sub", x2, x1)
    if not half:  # malformed boxes become 1x1
        rh, rw = g.emit("Max", rh, g.const(1.0)), g.emit("Max", rw, g.const(1.0))
    return (_Axis(g, y1, rh, int(g.attr("output_height")), 2),
            _Axis(g, x1, rw, int(g.attr("output_width")), 3))


@gradient("RoiAlign", uses=("x0", "x1", "x2"), stop=(1, 2), uncomputed=(1,))
def roi_align_grad(g: GradCtx) -> None:
    # float16 and bfloat16 work in float32, as the kernel does: their sample positions are too coarse
    low = g.dtype if g.dtype in (TensorProto.FLOAT16, TensorProto.BFLOAT16) else None
    if low is not None:
        g.dtype = TensorProto.FLOAT
    try:
        up = (lambda t: g.emit("Cast", t, to=TensorProto.FLOAT)) if low is not None else (lambda t: t)
        ay, ax = _roi_axes(g, up(g.x(1)))
        if (g.attr("mode") or "avg") == "avg":
            dx = _roi_align_avg_dx(g, ay, ax, up(g.dy(0)))
        else:
            dx = _roi_align_max_dx(g, ay, ax, up(g.x(0)), up(g.dy(0)))
    finally:
        if low is not None:
            g.dtype = low
    g.set_dx(0, dx if low is None else g.emit("Cast", dx, to=low))


def _roi_align_avg_dx(g: GradCtx, ay: _Axis, ax: _Axis, dy: str) -> str:
    # Y[r] = My[r] · X[b_r] · Mx[r]ᵀ / count_r, so dX[n] = Σ_{r: b_r = n} My[r]ᵀ · dY[r] · Mx[r] / count_r,
    # done as one batched product over (r, p): (N, 1, H, R·P) @ (C, R·P, W), never (R, C, H, W)
    count = g.emit("Max", g.emit("Mul", ay.grid, ax.grid), g.const(1.0))
    my = g.emit("Div", ay.matrix(g), g.emit("Reshape", count, g.ints([-1, 1, 1])))  # (R, P, H)
    t = g.emit("MatMul", dy, g.emit("Unsqueeze", ax.matrix(g), g.ints([1])))  # (R, C, P, W)
    b = g.emit("Unsqueeze", g.x(2), g.ints([1]))
    owner = g.emit("Cast", g.emit("Equal", b, _range(g, _dim(g, 0))), to=g.dtype)  # (R, N)
    a = g.emit("Mul", g.emit("Unsqueeze", owner, g.ints([2, 3])), g.emit("Unsqueeze", my, g.ints([1])))
    a = g.emit("Reshape", g.emit("Transpose", a, perm=[1, 3, 0, 2]), g.ints([0, 0, -1]))  # (N, H, R·P)
    w = g.emit("Unsqueeze", _dim(g, 3), g.ints([0]))
    t = g.emit("Reshape", g.emit("Transpose", t, perm=[1, 0, 2, 3]),
               g.emit("Concat", g.ints([0, -1]), w, axis=0))  # (C, R·P, W)
    return g.emit("MatMul", g.emit("Unsqueeze", a, g.ints([1])), t)


def _roi_align_max_dx(g: GradCtx, ay: _Axis, ax: _Axis, x: str, dy: str) -> str:
    # every (sample, tap) value w·X[pos] is a candidate, laid out (R, C, P, Q, Gy, 2, Gx, 2); the bin's
    # gradient goes to the first maximum, scaled by its weight
    ey, ex = [1, 3, 6, 7], [1, 2, 4, 5]
    ypart = g.emit("Mul", ay.pos, _dim(g, 3))
    offsets = g.emit("Add", g.emit("Unsqueeze", ypart, g.ints(ey)), g.emit("Unsqueeze", ax.pos, g.ints(ex)))
    idx = g.emit("Add", g.emit("Reshape", _plane_base(g, g.x(2)), g.ints([0, 0, 1, 1, 1, 1, 1, 1])), offsets)
    wts = g.emit("Mul", g.emit("Unsqueeze", ay.w, g.ints(ey)), g.emit("Unsqueeze", ax.w, g.ints(ex)))
    vals = g.emit("Mul", g.emit("Gather", g.emit("Reshape", x, g.ints([-1])), idx, axis=0), wts)
    five = g.ints([0, 0, 0, 0, -1])
    exists = _exists(g, ay, ax)
    valid = None
    if exists is not None:
        valid = g.emit("Reshape", g.emit("Expand", exists, g.emit("Shape", vals)), five)
    target, am = _first_max(g, g.emit("Reshape", idx, five), g.emit("Reshape", vals, five), valid)
    # a box without samples (all padding): its ArgMax points at padding, whose weights _Axis made 0
    w_all = g.emit("Expand", g.emit("Reshape", wts, five), g.emit("Shape", g.emit("Reshape", idx, five)))
    chosen = g.emit("GatherElements", w_all, am, axis=4)
    return _scatter_into_x(g, target, g.emit("Mul", g.emit("Unsqueeze", dy, g.ints([-1])), chosen))


def _exists(g: GradCtx, ay: _Axis, ax: _Axis) -> str | None:
    """Which (Gy, 2, Gx, 2) candidates are real samples, as (R, 1, 1, 1, Gy, 1, Gx, 1); None if all."""
    if ay.exists is None:
        return None
    ey = g.emit("Unsqueeze", ay.exists, g.ints([1, 3, 6, 7]))  # (R, 1, 1, 1, G, 1, 1, 1)
    ex = g.emit("Unsqueeze", ax.exists, g.ints([1, 2, 4, 5]))  # (R, 1, 1, 1, 1, 1, G, 1)
    return g.emit("And", ey, ex)


# ---- MaxRoiPool ---------------------------------------------------------------------------------


def _windows(g: GradCtx, lo: str, hi: str, pooled: int, axis: int) -> tuple[str, str, str]:
    """Clipped bin windows of each box along one axis, from its rounded corners (R, 1) int64:
    positions (R, P, K), a mask of those inside their window, and whether each bin is non-empty (R, P)."""
    one = g.int64(1)
    ext = g.emit("Max", g.emit("Add", g.emit("Sub", hi, lo), one), one)
    p = g.ints(list(range(pooled)))
    big_p = g.int64(pooled)
    start = g.emit("Add", g.emit("Div", g.emit("Mul", p, ext), big_p), lo)
    ends = g.emit("Mul", g.ints(list(range(1, pooled + 1))), ext)
    end_raw = g.emit("Add", ends, g.int64(pooled - 1))  # ceil division by P
    end = g.emit("Add", g.emit("Div", end_raw, big_p), lo)
    size = _dim(g, axis)
    zero = g.int64(0)
    start = g.emit("Min", g.emit("Max", start, zero), size)
    end = g.emit("Min", g.emit("Max", end, zero), size)
    span = g.emit("Sub", end, start)
    k = _range(g, g.emit("Max", g.emit("ReduceMax", span, keepdims=0), one))
    pos = g.emit("Add", g.emit("Unsqueeze", start, g.ints([-1])), k)  # (R, P, K)
    inside = g.emit("Less", pos, g.emit("Unsqueeze", end, g.ints([-1])))
    pos = g.emit("Min", pos, g.emit("Sub", size, one))
    return pos, inside, g.emit("Greater", span, zero)


@gradient("MaxRoiPool", uses=("x0", "x1"), stop=(1,), uncomputed=(1,))
def max_roi_pool_grad(g: GradCtx) -> None:
    # candidates of bin (r, p, q) are X[b_r, c, rows(r, p), cols(r, q)], laid out (R, C, P, Q, Kh, Kw);
    # the bin's gradient goes to the first maximum in row-major window order
    rois = g.x(1)
    ph, pw = (int(v) for v in g.attr("pooled_shape"))
    scale = float(g.attr("spatial_scale") if g.attr("spatial_scale") is not None else 1.0)
    corner = g.emit("Slice", rois, g.ints([1]), g.ints([5]), g.ints([1]))
    fdt = TensorProto.FLOAT if g.dtype in (TensorProto.FLOAT16, TensorProto.BFLOAT16) else g.dtype
    if fdt != g.dtype:  # the kernel scales float16 corners in float32
        corner = g.emit("Cast", corner, to=fdt)
    v = g.emit("Mul", corner, g.const(scale, fdt))
    half_up = g.emit("Floor", g.emit("Add", g.emit("Abs", v), g.const(0.5, fdt)))
    rounded = g.emit("Mul", g.emit("Sign", v), half_up)
    corners = g.emit("Cast", rounded, to=TensorProto.INT64)  # half away from zero, like C's round
    x1, y1, x2, y2 = (_column(g, corners, k) for k in range(4))
    rows, in_r, full_r = _windows(g, y1, y2, ph, 2)
    cols, in_c, full_c = _windows(g, x1, x2, pw, 3)
    batch = g.emit("Cast", _column(g, rois, 0), to=TensorProto.INT64)
    er, ec = [1, 3, 5], [1, 2, 4]
    idx = g.emit("Add", g.emit("Reshape", _plane_base(g, batch), g.ints([0, 0, 1, 1, 1, 1])),
                 g.emit("Add", g.emit("Unsqueeze", g.emit("Mul", rows, _dim(g, 3)), g.ints(er)),
                        g.emit("Unsqueeze", cols, g.ints(ec))))
    valid = g.emit("And", g.emit("Unsqueeze", in_r, g.ints(er)), g.emit("Unsqueeze", in_c, g.ints(ec)))
    vals = g.emit("Gather", g.emit("Reshape", g.x(0), g.ints([-1])), idx, axis=0)
    five = g.ints([0, 0, 0, 0, -1])
    valid = g.emit("Expand", valid, g.emit("Shape", vals))
    target, _ = _first_max(g, g.emit("Reshape", idx, five), g.emit("Reshape", vals, five),
                           g.emit("Reshape", valid, five))
    # empty bins output 0 and pass no gradient
    full = g.emit("And", g.emit("Unsqueeze", full_r, g.ints([1, 3])),
                  g.emit("Unsqueeze", full_c, g.ints([1, 2])))
    dy = g.emit("Where", full, g.dy(0), g.const(0.0))
    g.set_dx(0, _scatter_into_x(g, target, g.emit("Unsqueeze", dy, g.ints([-1]))))
