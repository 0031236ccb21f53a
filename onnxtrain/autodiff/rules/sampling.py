"""Gradient rules of GridSample, AffineGrid and DeformConv (same names as engine/kernels/sampling.py).

GridSample and DeformConv rebuild the sampler of the kernel in the backward graph: per axis the tap
indices and weights (``TAPS``: polynomials in the tap's distance from the coordinate), padded as in
the forward pass, combined into flat indices into an (batch·spatial, channels) view of X. Then

* dX is a ScatterND (reduction=add) of weight · dY onto those indices;
* d(coordinate) along axis a is Σ_taps dY·X[tap] · ∂weight/∂t_a, times the derivative of the padding
  step (0 where border clamps, ±1 where reflection folds) and of the grid's unnormalization.

Nearest mode gives the grid a zero gradient. DeformConv is that sampler (linear, zero padding, pixel
coordinates = kernel position + offset) followed by a masked grouped MatMul with W, whose gradients
(dW, dmask, dB and the sampled values' gradient) are MatMuls and sums. AffineGrid is linear in theta:
dθ = dGridᵀ · base grid, the base grid made by an AffineGrid of the identity. The rules need static
spatial sizes of X (and DeformConv static channels and W).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from onnx import TensorProto, numpy_helper
from onnx.helper import tensor_dtype_to_np_dtype

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.engine.kernels.sampling import TAPS, bounds, deform_geometry, grid_mode, unnormalize


def _c(g: GradCtx, value: object, dt: int) -> str:
    return g.w.const(np.asarray(value, dtype=tensor_dtype_to_np_dtype(dt)), dt)


def _static_sizes(g: GradCtx, op: str) -> list[int]:
    xs = g.static_shape(0)
    if xs is None or len(xs) < 3 or any(v is None for v in xs[2:]):
        raise RuleError(f"the {op} gradient needs static spatial sizes of X, got {xs}")
    return [int(v) for v in xs[2:]]  # type: ignore[arg-type]


def _reflect(g: GradCtx, v: str, lo: np.ndarray, hi: np.ndarray, dt: int) -> tuple[str, str]:
    """``v`` folded into [lo, hi] (the kernel's ``reflect``), and the phase m: the fold's slope is
    +1 where m <= span and -1 where m > span."""
    span = np.maximum(hi - lo, 1.0)
    z = g.emit("Sub", v, _c(g, lo, dt))
    period = _c(g, 2 * span, dt)
    m = g.emit("Sub", z, g.emit("Mul", g.emit("Floor", g.emit("Div", z, period)), period))
    folded = g.emit("Sub", _c(g, lo + span, dt), g.emit("Abs", g.emit("Sub", m, _c(g, span, dt))))
    return folded, m


def _adjust(g: GradCtx, u: str, sizes: np.ndarray, padding: str, align: bool, dt: int) -> tuple[str, str]:
    """The kernel's ``adjust_coords`` on u (B, P, r), and its derivative (0, 1 or -1 per element)."""
    lo, hi = bounds(sizes, align)
    out = g.emit("Or", g.emit("Less", u, _c(g, lo, dt)), g.emit("Greater", u, _c(g, hi, dt)))
    if padding == "border":
        moved = g.emit("Min", g.emit("Max", u, _c(g, 0.0, dt)), _c(g, sizes - 1, dt))
        slope = g.emit("Cast", g.emit("Not", out), to=dt)
    else:
        moved, m = _reflect(g, u, lo, hi, dt)
        falling = g.emit("And", out, g.emit("Greater", m, _c(g, np.maximum(hi - lo, 1.0), dt)))
        slope = g.emit("Where", falling, _c(g, -1.0, dt), _c(g, 1.0, dt))
    return g.emit("Where", out, moved, u), slope


def _poly(g: GradCtx, coeffs: list[list[float]], d: str, dt: int) -> str:
    """Σ_j coeffs[j]·d^(n-j) per tap (Horner); a constant polynomial is expanded to d's shape."""
    if len(coeffs) == 1:
        return g.emit("Expand", _c(g, coeffs[0], dt), g.emit("Shape", d))
    acc = g.emit("Mul", d, _c(g, coeffs[0], dt))
    for c in coeffs[1:-1]:
        acc = g.emit("Mul", g.emit("Add", acc, _c(g, c, dt)), d)
    return g.emit("Add", acc, _c(g, coeffs[-1], dt))


@dataclass
class _Taps:
    flat: str  # (B, P, T) int64 row indices into the (B·S, C) view of X
    weight: str | None  # (B, P, T) tap weights (None: all ones)
    slopes: list[str] | None  # per axis a, (B, P, T): ∂weight/∂u_a


def _taps(g: GradCtx, u: str, sizes: list[int], mode: str, padding: str, align: bool, dt: int,
          want_slopes: bool) -> _Taps:
    """The sampler's taps at pixel coordinates u (B, P, r), axis order (the kernel's ``sample``)."""
    r = len(sizes)
    sz = np.asarray(sizes, dtype=np.float64)
    if mode == "nearest":
        idx = g.emit("Unsqueeze", u, g.ints([-1]))  # (B, P, r, 1); the caller rounded u
        w = dw = None
    else:
        offs, sgn, coeffs = TAPS[mode]
        base = g.emit("Floor", u)
        t = g.emit("Unsqueeze", g.emit("Sub", u, base), g.ints([-1]))
        d = g.emit("Mul", g.emit("Sub", t, _c(g, offs, dt)), _c(g, sgn, dt))  # (B, P, r, k)
        w = _poly(g, coeffs, d, dt)
        n = len(coeffs) - 1  # d(weight)/dt = Σ_j (n-j)·coeffs[j]·d^(n-j-1) · sign
        dcoeffs = [[coeffs[j][i] * (n - j) * sgn[i] for i in range(len(offs))] for j in range(n)]
        dw = _poly(g, dcoeffs, d, dt) if want_slopes else None
        idx = g.emit("Add", g.emit("Unsqueeze", base, g.ints([-1])), _c(g, offs, dt))
    hi = _c(g, (sz - 1)[:, None], dt)
    if padding == "zeros":
        valid = g.emit("Cast", g.emit("And", g.emit("GreaterOrEqual", idx, _c(g, 0.0, dt)),
                                      g.emit("LessOrEqual", idx, hi)), to=dt)
        w = valid if w is None else g.emit("Mul", w, valid)
        dw = None if dw is None else g.emit("Mul", dw, valid)
        idx = g.emit("Mul", idx, valid)
    else:
        if padding == "reflection":
            lo, top = bounds(sz, align)
            idx, _ = _reflect(g, idx, lo[:, None], top[:, None], dt)
        idx = g.emit("Min", g.emit("Max", idx, _c(g, 0.0, dt)), hi)
    strides = [int(np.prod(sizes[a + 1:])) for a in range(r)]
    strides_col = g.w.const(np.array(strides, dtype=np.int64).reshape(r, 1), TensorProto.INT64)
    idx = g.emit("Mul", g.emit("Cast", idx, to=TensorProto.INT64), strides_col)

    def spread(v: str, a: int) -> str:  # (B, P, r, k) → axis a's taps as (B, P, 1.., k, ..1)
        others = [2 + b for b in range(r) if b != a]
        va = g.emit("Gather", v, g.int64(a), axis=2)
        return g.emit("Unsqueeze", va, g.ints(others)) if others else va

    def flat3(v: str) -> str:
        return g.emit("Reshape", v, g.ints([0, 0, -1]))

    flat = spread(idx, 0)
    for a in range(1, r):
        flat = g.emit("Add", flat, spread(idx, a))
    flat = flat3(flat)
    ws = [spread(w, a) for a in range(r)] if w is not None else []
    weight = None
    if ws:
        weight = ws[0]
        for v in ws[1:]:
            weight = g.emit("Mul", weight, v)
        weight = flat3(weight)
    slopes = None
    if dw is not None:
        slopes = []
        for a in range(r):
            s = spread(dw, a)
            for b in range(r):
                if b != a:
                    s = g.emit("Mul", s, ws[b])
            slopes.append(flat3(s))
    # rows of the (B·S, C) view: add b·S
    nb = g.emit("Gather", g.emit("Shape", u), g.int64(0))
    rows = g.emit("Mul", g.emit("Range", g.int64(0), nb, g.int64(1)), g.int64(int(np.prod(sizes))))
    flat = g.emit("Add", flat, g.emit("Reshape", rows, g.ints([-1, 1, 1])))
    return _Taps(flat, weight, slopes)


def _scatter(g: GradCtx, taps: _Taps, dyt: str, zeros_shape: str, dt: int) -> str:
    """Σ over taps of weight·dY added onto X's rows: (B·S, C) from dyt (B, P, C)."""
    upd = g.emit("Unsqueeze", dyt, g.ints([2]))  # (B, P, 1, C)
    if taps.weight is not None:
        upd = g.emit("Mul", upd, g.emit("Unsqueeze", taps.weight, g.ints([-1])))
    zero = np.zeros(1, dtype=tensor_dtype_to_np_dtype(dt))
    base = g.emit("ConstantOfShape", zeros_shape, value=numpy_helper.from_array(zero))
    return g.emit("ScatterND", base, g.emit("Unsqueeze", taps.flat, g.ints([-1])), upd, reduction="add")


def _coord_grad(g: GradCtx, taps: _Taps, xt: str, dyt: str) -> str:
    """∂loss/∂u (B, P, r): Σ_taps (dY·X[tap]) · ∂weight/∂u_a."""
    vals = g.emit("Gather", xt, taps.flat, axis=0)  # (B, P, T, C)
    s = g.emit("MatMul", vals, g.emit("Unsqueeze", dyt, g.ints([-1])))  # (B, P, T, 1)
    if taps.slopes is None:
        raise RuleError("internal: the sampler's slopes were not built")
    stacked = g.emit("Concat", *[g.emit("Unsqueeze", v, g.ints([-1])) for v in taps.slopes], axis=-1)
    return g.reduce("ReduceSum", g.emit("Mul", stacked, s), [2], keepdims=0)


def _channels_last(g: GradCtx, v: str) -> str:
    """(B, C, *S) → (B, S, C)."""
    return g.emit("Transpose", g.emit("Reshape", v, g.ints([0, 0, -1])), perm=[0, 2, 1])


@gradient("GridSample", uses=("x0", "x1"))
def grid_sample_grad(g: GradCtx) -> None:
    # Y[n, c, p] = Σ_taps w(u_p) · X[n, c, tap(u_p)], u = padding(unnormalize(grid)) in pixel units
    mode = grid_mode(g.attrs, g.opset)
    padding = g.attr("padding_mode") or "zeros"
    align = bool(g.attr("align_corners") or 0)
    sizes = _static_sizes(g, "GridSample")
    r = len(sizes)
    gdt = g.elem_type(g.x(1)) or g.dtype
    # coordinates in float32 at least, as the kernel computes them (a float16 grid's pixel positions
    # would be 1/64 pixel off at 32 pixels)
    dt = TensorProto.FLOAT if gdt in (TensorProto.FLOAT16, TensorProto.BFLOAT16) else gdt
    xdt = g.elem_type(g.x(0)) or g.dtype
    sz = np.asarray(sizes, dtype=np.float64)
    scale, shift = unnormalize(sz, align)
    rev = g.ints(list(range(r - 1, -1, -1)))  # grid lists the last spatial axis first
    u = g.emit("Gather", g.emit("Reshape", g.x(1), g.ints([0, -1, r])), rev, axis=2)
    if dt != gdt:
        u = g.emit("Cast", u, to=dt)
    u = g.emit("Add", g.emit("Mul", u, _c(g, scale, dt)), _c(g, shift, dt))
    if mode == "nearest":
        u = g.emit("Round", u)
    slope = None
    if mode != "cubic" and padding != "zeros":
        u, slope = _adjust(g, u, sz, padding, align, dt)
    want_grid = g.needs_dx(1) and mode != "nearest"
    taps = _taps(g, u, sizes, mode, padding, align, dt, want_grid)
    if xdt != dt:
        taps.weight = None if taps.weight is None else g.emit("Cast", taps.weight, to=xdt)
        taps.slopes = None if taps.slopes is None else [g.emit("Cast", s, to=xdt) for s in taps.slopes]
    dyt = _channels_last(g, g.dy(0))  # (N, P, C)
    s_total = int(np.prod(sizes))
    if g.needs_dx(0):
        shape = g.shape(0)
        n = g.emit("Slice", shape, g.ints([0]), g.ints([1]), g.ints([0]))
        c = g.emit("Slice", shape, g.ints([1]), g.ints([2]), g.ints([0]))
        rows = g.emit("Concat", g.emit("Mul", n, g.ints([s_total])), c, axis=0)
        dxt = _scatter(g, taps, dyt, rows, xdt)
        dx = g.emit("Reshape", dxt, g.emit("Concat", n, g.ints([s_total]), c, axis=0))
        g.set_dx(0, g.emit("Reshape", g.emit("Transpose", dx, perm=[0, 2, 1]), shape))
    if g.needs_dx(1):
        if not want_grid:
            g.set_dx(1, g.zeros_like(g.x(1)))
            return
        xt = g.emit("Flatten", _channels_last(g, g.x(0)), axis=2)  # (N·S, C)
        du = _coord_grad(g, taps, xt, dyt)
        if xdt != dt:
            du = g.emit("Cast", du, to=dt)
        if slope is not None:
            du = g.emit("Mul", du, slope)
        du = g.emit("Mul", du, _c(g, scale, dt))
        if dt != gdt:
            du = g.emit("Cast", du, to=gdt)
        g.set_dx(1, g.emit("Reshape", g.emit("Gather", du, rev, axis=2), g.shape(1)))


@gradient("AffineGrid", uses=("x1",), stop=(1,), linear=True)
def affine_grid_grad(g: GradCtx) -> None:
    # grid[n, p, i] = Σ_j θ[n, i, j] · base[p, j]  ⇒  dθ[n] = dGrid[n]ᵀ · base
    ts = g.static_shape(0)
    ss = g.static_shape(1)
    r = ts[1] if ts is not None and ts[1] is not None else (ss[0] - 2 if ss and ss[0] is not None else None)
    if r not in (2, 3):
        raise RuleError(f"AffineGrid gradient needs theta's static shape, got {ts}")
    size = g.x(1)
    one_size = g.emit("Concat", g.ints([1]), g.emit("Slice", size, g.ints([1]), g.ints([r + 2]), g.ints([0])),
                      axis=0)
    eye = _c(g, np.eye(r, r + 1)[None], g.dtype)
    base = g.emit("AffineGrid", eye, one_size, align_corners=int(g.attr("align_corners") or 0))
    base = g.emit("Reshape", base, g.ints([1, -1, r]))
    base = g.emit("Pad", base, g.ints([0, 0, 0, 0, 0, 1]), _c(g, 1.0, g.dtype))  # homogeneous (1, P, r+1)
    dgt = g.emit("Transpose", g.emit("Reshape", g.dy(0), g.ints([0, -1, r])), perm=[0, 2, 1])
    g.set_dx(0, g.emit("MatMul", dgt, base))


@gradient("DeformConv", uses=("x0", "x1", "x2", "x4"))
def deform_conv_grad(g: GradCtx) -> None:
    # cols[n, c, k, p] = sample(X[n, c], base[k, p] + offset[n, og(c), k, :, p]) · mask[n, og(c), k, p]
    # Y[n, o, p] = Σ_{c in group(o), k} W[o, c, k] · cols[n, c, k, p] + B[o]
    xs, ws = g.static_shape(0), g.static_shape(1)
    if xs is None or ws is None or any(v is None for v in (*xs[1:], *ws)):
        raise RuleError(f"the DeformConv gradient needs static shapes of X (but the batch) and W, got {xs} "
                        f"and {ws}")
    r = len(xs) - 2
    c, m = int(xs[1]), int(ws[0])  # type: ignore[arg-type]
    sizes = [int(v) for v in xs[2:]]  # type: ignore[arg-type]
    geo = deform_geometry(g.attrs, (1, c, *sizes), tuple(ws))  # type: ignore[arg-type]
    kk, p, group, og = geo["K"], geo["P"], geo["group"], geo["og"]
    cg, ci = c // og, c // group  # channels per offset group, per group
    dt = g.dtype
    s_total = int(np.prod(sizes))
    # sampling positions (N·og, K·P, r)
    u = g.emit("Transpose", g.emit("Reshape", g.x(2), g.ints([-1, kk, r, p])), perm=[0, 1, 3, 2])
    u = g.emit("Reshape", g.emit("Add", u, _c(g, geo["base"], dt)), g.ints([-1, kk * p, r]))
    taps = _taps(g, u, sizes, "linear", "zeros", True, dt, g.needs_dx(2))
    has_mask = g.has_x(4)
    mask = g.emit("Reshape", g.x(4), g.ints([-1, og, 1, kk, p])) if has_mask else None
    dy_g = g.emit("Reshape", g.dy(0), g.ints([-1, group, m // group, p]))
    w_g = g.emit("Reshape", g.x(1), g.ints([group, m // group, ci * kk]))
    xt = None
    if g.needs_dx(1) or g.needs_dx(2) or (has_mask and g.needs_dx(4)):
        x_og = g.emit("Reshape", g.x(0), g.ints([-1, cg, s_total]))  # offset groups folded into the batch
        xt = g.emit("Flatten", _channels_last(g, x_og), axis=2)
    if g.needs_dx(1) or (has_mask and g.needs_dx(4)):
        vals = g.emit("Gather", xt, taps.flat, axis=0)  # (N·og, K·P, T, C/og)
        samp = g.emit("MatMul", g.emit("Unsqueeze", taps.weight, g.ints([2])), vals)  # (N·og, K·P, 1, C/og)
        samp = g.emit("Transpose", g.emit("Reshape", samp, g.ints([0, 0, -1])), perm=[0, 2, 1])
        samp = g.emit("Reshape", samp, g.ints([-1, og, cg, kk, p]))
        if g.needs_dx(1):
            cols = g.emit("Mul", samp, mask) if mask else samp
            cols = g.emit("Reshape", cols, g.ints([-1, group, ci * kk, p]))
            dw = g.emit("MatMul", dy_g, g.emit("Transpose", cols, perm=[0, 1, 3, 2]))
            g.set_dx(1, g.emit("Reshape", g.reduce("ReduceSum", dw, [0], keepdims=0), g.shape(1)))
    if g.has_x(3) and g.needs_dx(3):
        g.set_dx(3, g.reduce("ReduceSum", g.dy(0), [0, *range(2, r + 2)], keepdims=0))
    if not (g.needs_dx(0) or g.needs_dx(2) or (has_mask and g.needs_dx(4))):
        return
    dcols = g.emit("MatMul", g.emit("Transpose", w_g, perm=[0, 2, 1]), dy_g)  # (N, group, C/group·K, P)
    dcols = g.emit("Reshape", dcols, g.ints([-1, og, cg, kk, p]))
    if has_mask and g.needs_dx(4):
        dmask = g.reduce("ReduceSum", g.emit("Mul", dcols, samp), [2], keepdims=0)
        g.set_dx(4, g.emit("Reshape", dmask, g.shape(4)))
    if not (g.needs_dx(0) or g.needs_dx(2)):
        return
    dsamp = g.emit("Mul", dcols, mask) if mask else dcols
    dyt = g.emit("Transpose", g.emit("Reshape", dsamp, g.ints([-1, cg, kk * p])), perm=[0, 2, 1])
    if g.needs_dx(0):
        shape = g.shape(0)
        n = g.emit("Slice", shape, g.ints([0]), g.ints([1]), g.ints([0]))
        rows = g.emit("Concat", g.emit("Mul", n, g.ints([og * s_total])), g.ints([cg]), axis=0)
        dxt = g.emit("Reshape", _scatter(g, taps, dyt, rows, dt), g.ints([-1, s_total, cg]))
        g.set_dx(0, g.emit("Reshape", g.emit("Transpose", dxt, perm=[0, 2, 1]), shape))
    if g.needs_dx(2):
        du = g.emit("Reshape", _coord_grad(g, taps, xt, dyt), g.ints([-1, kk, p, r]))
        g.set_dx(2, g.emit("Reshape", g.emit("Transpose", du, perm=[0, 1, 3, 2]), g.shape(2)))
