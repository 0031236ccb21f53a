"""Gradient rules of Conv, ConvTranspose and Col2Im (same names as engine/kernels/conv.py).

Both are linear in each argument, so each gradient is again a (transposed) convolution:
Conv's dX is a ConvTranspose of dY with the same W, ConvTranspose's dX a Conv of dY with the same W,
and either op's dW a Conv in which the batch axis plays the channel axis (strides and dilations
swapped), cropped to the kernel size. Col2Im's adjoint is im2col: a Conv of dY with one-hot kernels.

Pads that depend on spatial sizes known only at run time (``auto_pad`` SAME_*, ConvTranspose's
``output_shape``) are computed in the graph from Shape(X) (``ConvGeom.rt``) and applied by Slice/Pad.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.ir.conv_shapes import conv_transpose_geometry, conv_transpose_growth


@dataclass
class ConvGeom:
    """Spatial geometry of one conv-like node, pads resolved from ``auto_pad``."""

    nd: int
    k: list[int]
    strides: list[int]
    dil: list[int]
    pb: list[int]
    pe: list[int]
    # pads known only at run time (``auto_pad`` SAME_* or ConvTranspose's ``output_shape`` with dynamic
    # input sizes): two int64 tensors of nd values, (begin, end); ``pb``/``pe`` are then zeros
    rt: tuple[str, str] | None = None
    # ConvTranspose: Y's spatial sizes as the node computes them (conv_transpose_geometry), None where unknown
    out: list[int | None] | None = None

    @property
    def k_eff(self) -> list[int]:
        return [(k - 1) * d + 1 for k, d in zip(self.k, self.dil)]

    @property
    def pads(self) -> list[int]:
        return self.pb + self.pe


def spatial(g: GradCtx, i: int, output: bool = False) -> list[int | None] | None:
    """Static spatial dims of a forward value (None when the rank is unknown)."""
    s = g.static_shape(i, output)
    return None if s is None else s[2:]


def resolve_pads(
    g: GradCtx,
    nd: int,
    k: Sequence[int],
    strides: Sequence[int],
    dil: Sequence[int],
    in_sp: Sequence[int | None] | None,
) -> tuple[list[int], list[int]]:
    """Begin/end pads of a Conv or pooling node (``auto_pad`` SAME_* needs static input sizes)."""
    auto_pad = g.attr("auto_pad") or "NOTSET"
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        if in_sp is None or any(v is None for v in in_sp):
            raise RuleError(f"auto_pad={auto_pad} needs static spatial input sizes, got {in_sp}")
        pb, pe = [], []
        for i in range(nd):
            out = -(-in_sp[i] // strides[i])
            total = max(0, (out - 1) * strides[i] + (k[i] - 1) * dil[i] + 1 - in_sp[i])
            small = total // 2
            b, e = (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)
            pb.append(b)
            pe.append(e)
        return pb, pe
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    pads = list(g.attr("pads") or [0] * (2 * nd))
    return pads[:nd], pads[nd:]


def _kernel_dims(g: GradCtx, w_index: int | None) -> list[int]:
    ks = g.attr("kernel_shape")
    if ks:
        return list(ks)
    ws = g.static_shape(w_index) if w_index is not None else None
    if ws is None or any(v is None for v in ws[2:]):
        raise RuleError("the kernel size is unknown (no kernel_shape attribute and no static weight shape)")
    return list(ws[2:])


def _static(sp: Sequence[int | None] | None) -> bool:
    return sp is not None and all(v is not None for v in sp)


def sp_dims(g: GradCtx, shape: str, nd: int) -> str:
    """The spatial dims (entries 2 … nd+1) of a shape tensor."""
    return g.emit("Slice", shape, g.ints([2]), g.ints([nd + 2]), g.ints([0]))


def _floor_half(g: GradCtx, t: str) -> str:
    """⌊t / 2⌋ of an int64 tensor that may be negative (t − (t mod 2) is even, so the Div is exact)."""
    two = g.ints([2])
    return g.emit("Div", g.emit("Sub", t, g.emit("Mod", t, two)), two)


def _same_pads_at_run_time(
    g: GradCtx, auto_pad: str, k_eff: Sequence[int], strides: Sequence[int], nd: int
) -> tuple[str, str]:
    """(begin, end) pads of ``auto_pad`` SAME_* from X's run-time sizes S: O = ⌈S / s⌉, total =
    max(0, (O − 1)·s + k_eff − S), split evenly, the odd one at the end (UPPER) or the beginning (LOWER)."""
    size = sp_dims(g, g.shape(0), nd)
    out = g.emit("Div", g.emit("Add", size, g.ints([s - 1 for s in strides])), g.ints(strides))
    span = g.emit("Add", g.emit("Mul", out, g.ints(strides)), g.ints([k - s for k, s in zip(k_eff, strides)]))
    total = g.emit("Max", g.emit("Sub", span, size), g.ints([0] * nd))
    small = g.emit("Div", total, g.ints([2] * nd))
    big = g.emit("Sub", total, small)
    return (small, big) if auto_pad == "SAME_UPPER" else (big, small)


def conv_geom(
    g: GradCtx, w_index: int | None = 1, transposed: bool = False, runtime: bool = False
) -> ConvGeom:
    """Geometry of a Conv (or pool, ``w_index=None``) node; ConvTranspose resolves pads from its output.

    Pads that depend on spatial sizes known only at run time are refused unless ``runtime``, which gives
    them as tensors computed from Shape(X) (``ConvGeom.rt``)."""
    k = _kernel_dims(g, w_index)
    nd = len(k)
    strides = list(g.attr("strides") or [1] * nd)
    dil = list(g.attr("dilations") or [1] * nd)
    k_eff = [(k[i] - 1) * dil[i] + 1 for i in range(nd)]
    auto_pad = g.attr("auto_pad") or "NOTSET"
    same = auto_pad in ("SAME_UPPER", "SAME_LOWER")
    if not transposed:
        in_sp = spatial(g, 0)
        if runtime and same and not _static(in_sp):
            return ConvGeom(nd, k, strides, dil, [0] * nd, [0] * nd,
                            _same_pads_at_run_time(g, auto_pad, k_eff, strides, nd))
        pb, pe = resolve_pads(g, nd, k, strides, dil, in_sp)
        return ConvGeom(nd, k, strides, dil, pb, pe)
    # ConvTranspose: the spec's output size and pads (conv_transpose_geometry, as in the kernel)
    out_shape = g.attr("output_shape")
    in_sp = spatial(g, 0)
    out_pad = list(g.attr("output_padding") or [0] * nd)
    if len(out_pad) != nd:
        raise RuleError(f"output_padding {out_pad} must have {nd} values")
    if (out_shape is not None or same) and not _static(in_sp):
        if not runtime:
            raise RuleError("ConvTranspose with output_shape or auto_pad SAME needs static input sizes")
        # total = s·S + growth − out, out = output_shape or S·s, from S at run time
        size = sp_dims(g, g.shape(0), nd)
        growth = [conv_transpose_growth(k[i], strides[i], dil[i], out_pad[i]) for i in range(nd)]
        full = g.emit("Add", g.emit("Mul", size, g.ints(strides)), g.ints(growth))
        if out_shape is not None:
            want = g.ints(list(out_shape)[-nd:])
        else:
            want = g.emit("Mul", size, g.ints(strides))
        total = g.emit("Sub", full, want)
        half = _floor_half(g, total)  # the kernel's total // 2, also for negative totals
        pb_t = half if auto_pad == "SAME_UPPER" else g.emit("Sub", total, half)
        return ConvGeom(nd, k, strides, dil, [0] * nd, [0] * nd, (pb_t, g.emit("Sub", total, pb_t)))
    sizes = in_sp if in_sp is not None and len(in_sp) == nd else [None] * nd
    try:
        t = conv_transpose_geometry(sizes, k, strides, dil, out_pad, auto_pad, g.attr("pads"), out_shape)
    except ValueError as e:
        raise RuleError(str(e)) from None
    # all pads are ints: given, or (output_shape, SAME_*) from static sizes
    return ConvGeom(nd, k, strides, dil, t.pad_begin, t.pad_end, out=t.out)  # type: ignore[arg-type]


def pads_tensor(g: GradCtx, geo: ConvGeom) -> str:
    """Pad's ``pads`` input for (N, C, spatial…) from the run-time pads: [0, 0, pb…, 0, 0, pe…]."""
    if geo.rt is None:
        raise RuleError("pads_tensor needs run-time pads")
    return g.emit("Concat", g.ints([0, 0]), geo.rt[0], g.ints([0, 0]), geo.rt[1], axis=0)


def _attrs(**kw: list[int] | int | None) -> dict[str, list[int] | int]:
    """Drop attributes equal to their defaults (all-ones strides/dilations, zero pads, group 1)."""
    out: dict[str, list[int] | int] = {}
    for name, v in kw.items():
        if v is None:
            continue
        if isinstance(v, list):
            default = 1 if name in ("strides", "dilations") else 0
            if all(x == default for x in v):
                continue
        elif name == "group" and v == 1:
            continue
        out[name] = v
    return out


def dims_vec(g: GradCtx, parts: Sequence[int | tuple[str, int, int]]) -> str:
    """A 1-D int64 shape tensor from ints and ``(shape_tensor, start, end)`` slices of shape tensors."""
    if all(isinstance(p, int) for p in parts):
        return g.ints(parts)  # type: ignore[arg-type]
    pieces: list[str] = []
    run: list[int] = []
    for p in parts:
        if isinstance(p, int):
            run.append(p)
            continue
        if run:
            pieces.append(g.ints(run))
            run = []
        shape, start, end = p
        pieces.append(g.emit("Slice", shape, g.ints([start]), g.ints([end]), g.ints([0])))
    if run:
        pieces.append(g.ints(run))
    return pieces[0] if len(pieces) == 1 else g.emit("Concat", *pieces, axis=0)


def pad_end_to(g: GradCtx, t: str, shape: str, rank: int) -> str:
    """Zero-pad the spatial end of ``t`` up to the spatial sizes in ``shape`` (dynamic sizes)."""
    have = g.emit("Slice", g.emit("Shape", t), g.ints([2]), g.ints([rank]), g.ints([0]))
    want = g.emit("Slice", shape, g.ints([2]), g.ints([rank]), g.ints([0]))
    pads = g.emit("Concat", g.ints([0] * (rank + 2)), g.emit("Sub", want, have), axis=0)
    return g.emit("Pad", t, pads)


def transposed_back(
    g: GradCtx,
    dy: str,
    w: str,
    geo: ConvGeom,
    group: int,
    in_sp: Sequence[int | None] | None,
    out_sp: Sequence[int | None] | None,
    x_shape: str | None,
) -> str:
    """``ConvTranspose(dy, w)``: the adjoint of a strided window op, cropped/padded to the input size.

    output_padding restores input rows no window reached (output size = s·(O−1) + op + k_eff − pads);
    when that would be negative (a ceil-mode pool overhangs) the end pad grows instead.
    """
    pb, pe = list(geo.pb), list(geo.pe)
    static = in_sp is not None and out_sp is not None and all(v is not None for v in (*in_sp, *out_sp))
    if static:
        op = []
        for i in range(geo.nd):
            r = in_sp[i] + pb[i] + pe[i] - geo.strides[i] * (out_sp[i] - 1) - geo.k_eff[i]  # type: ignore[index,operator]
            if r < 0:
                pe[i] -= r
                r = 0
            op.append(r)
        return g.emit(
            "ConvTranspose",
            dy,
            w,
            **_attrs(strides=geo.strides, pads=pb + pe, dilations=geo.dil, group=group, output_padding=op),
        )
    if x_shape is None:
        raise RuleError("dynamic spatial sizes need the input's shape")
    rank = geo.nd + 2
    if geo.rt is not None:
        # begin pads known at run time: the full (unpadded) ConvTranspose, cut to [pb, pb + S), then
        # zero-padded at the end up to S where no window reached the last input rows
        t = g.emit("ConvTranspose", dy, w, **_attrs(strides=geo.strides, dilations=geo.dil, group=group))
        want = g.emit("Slice", x_shape, g.ints([2]), g.ints([rank]), g.ints([0]))
        t = g.emit("Slice", t, geo.rt[0], g.emit("Add", geo.rt[0], want), g.ints(list(range(2, rank))))
        return pad_end_to(g, t, x_shape, rank)
    # sizes known only at run time: crop the begin pads only, then cut or zero-pad the end to X's sizes (an
    # end crop of the whole end pad would drop the last input rows when (S + pads − k_eff) % s leaves some)
    t = g.emit(
        "ConvTranspose", dy, w,
        **_attrs(strides=geo.strides, pads=pb + [0] * geo.nd, dilations=geo.dil, group=group),
    )
    want = g.emit("Slice", x_shape, g.ints([2]), g.ints([rank]), g.ints([0]))
    t = g.emit("Slice", t, g.ints([0] * geo.nd), want, g.ints(list(range(2, rank))))
    return pad_end_to(g, t, x_shape, rank)


def weight_grad(
    g: GradCtx,
    inp: str,
    inp_shape: str | None,
    inp_sp: Sequence[int | None] | None,
    dout: str,
    dout_shape: str | None,
    dout_sp: Sequence[int | None] | None,
    c_in: int,
    c_out: int,
    group: int,
    geo: ConvGeom,
) -> str:
    """dW[m, c, κ] = Σ_{n,o} dout[n, m, o]·inp[n, g(m)·C/g + c, o·s + κ·d − pb]  →  (c_out, c_in/g, k…).

    A Conv whose channels are ``inp``'s batch (per group) and whose "kernel" is ``dout``: strides and
    dilations swap roles; the result (C/g, c_out, k′…) is transposed and cropped to k.
    """
    nd = geo.nd
    sp_perm = list(range(2, nd + 2))
    cg, mg = c_in // group, c_out // group
    if group == 1:
        a = g.emit("Transpose", inp, perm=[1, 0, *sp_perm])  # (C, N, S…)
        b = g.emit("Transpose", dout, perm=[1, 0, *sp_perm])  # (M, N, O…)
    else:
        # inp (N, C, S…) → (N, g, C/g, L) → (C/g, g, N, L) → (C/g, g·N, S…)
        a = g.emit("Reshape", inp, g.ints([0, group, cg, -1]))
        a = g.emit("Transpose", a, perm=[2, 1, 0, 3])
        a = g.emit("Reshape", a, _sp_shape(g, [cg, -1], inp_sp, inp_shape, nd))
        # dout (N, M, O…) → (N, g, M/g, L′) → (g, M/g, N, L′) → (M, N, O…)
        b = g.emit("Reshape", dout, g.ints([0, group, mg, -1]))
        b = g.emit("Transpose", b, perm=[1, 2, 0, 3])
        b = g.emit("Reshape", b, _sp_shape(g, [c_out, -1], dout_sp, dout_shape, nd))
    if geo.rt is not None:  # pads known at run time (negative ones crop): pad explicitly
        a = g.emit("Pad", a, pads_tensor(g, geo))
    r = g.emit("Conv", a, b, **_attrs(strides=geo.dil, dilations=geo.strides, pads=geo.pads, group=group))
    r = g.emit("Transpose", r, perm=[1, 0, *sp_perm])  # (M, C/g, k′…)
    k_full = None
    if geo.rt is None and _static(inp_sp) and _static(dout_sp):
        k_full = [
            (inp_sp[i] + geo.pb[i] + geo.pe[i] - (dout_sp[i] - 1) * geo.strides[i] - 1)  # type: ignore
            // geo.dil[i]
            + 1
            for i in range(nd)
        ]
    if k_full != geo.k:
        r = g.emit("Slice", r, g.ints([0] * nd), g.ints(geo.k), g.ints(sp_perm))
    return r


def _sp_shape(
    g: GradCtx, lead: list[int], sp: Sequence[int | None] | None, shape: str | None, nd: int
) -> str:
    if sp is not None and all(v is not None for v in sp):
        return g.ints([*lead, *sp])  # type: ignore[list-item]
    if shape is None:
        raise RuleError("dynamic spatial sizes need a shape tensor")
    return dims_vec(g, [*lead, (shape, 2, nd + 2)])


def _channels(g: GradCtx, w: int, axis: int, what: str) -> int:
    ws = g.static_shape(w)
    if ws is None or ws[axis] is None:
        raise RuleError(f"grouped convolution needs a static {what}")
    return ws[axis]  # type: ignore[return-value]


def bias_grad(g: GradCtx, nd: int) -> str:
    """dB = Σ dY over the batch and spatial axes."""
    return g.reduce("ReduceSum", g.dy(0), [0, *range(2, nd + 2)], keepdims=0)


@gradient("Conv", uses=("x0", "x1"))
def conv_grad(g: GradCtx) -> None:
    # Y = X ⋆ W (+ B):  dX = ConvTranspose(dY, W) with the same geometry; dW from weight_grad; dB = Σ dY
    geo = conv_geom(g, runtime=True)
    group = int(g.attr("group") or 1)
    dy = g.dy(0)
    x_sp, y_sp = spatial(g, 0), spatial(g, 0, output=True)
    dyn = any(v is None for v in (*(x_sp or [None]), *(y_sp or [None])))
    if g.needs_dx(0):
        g.set_dx(0, transposed_back(g, dy, g.x(1), geo, group, x_sp, y_sp, g.shape(0) if dyn else None))
    if g.needs_dx(1):
        m = _channels(g, 1, 0, "weight shape") if group > 1 else 0
        c = _channels(g, 1, 1, "weight shape") * group if group > 1 else 0
        g.set_dx(
            1,
            weight_grad(
                g,
                g.x(0),
                g.shape(0) if dyn else None,
                x_sp,
                dy,
                g.shape(0, output=True) if dyn else None,
                y_sp,
                c,
                m,
                group,
                geo,
            ),
        )
    if g.has_x(2) and g.needs_dx(2):
        g.set_dx(2, bias_grad(g, geo.nd))


@gradient("ConvTranspose", uses=("x0", "x1"))
def conv_transpose_grad(g: GradCtx) -> None:
    # Y = ConvTranspose(X, W) is the adjoint of Conv(·, W):  dX = Conv(dY, W) with the same geometry;
    # dW[c, m, κ] = Σ X[n, c, i]·dY[n, m, i·s + κ·d − pb]: weight_grad with the roles of X and dY swapped
    geo = conv_geom(g, transposed=True, runtime=True)
    op = list(g.attr("output_padding") or [0] * geo.nd)
    limit = [max(s, d) for s, d in zip(geo.strides, geo.dil)]
    if any(o >= m for o, m in zip(op, limit)):
        # the spec's (and torch's) limit: each output_padding below its axis's stride or dilation
        raise RuleError(f"attribute output_padding {op} must be below max(stride, dilation) {limit} on each "
                        f"axis (strides {geo.strides}, dilations {geo.dil})")
    group = int(g.attr("group") or 1)
    dy = g.dy(0)
    x_sp, y_sp = spatial(g, 0), spatial(g, 0, output=True)
    if y_sp is not None and len(y_sp) != geo.nd:
        # ONNX's inference stops adding dims at an output_shape entry below X's size: every value after Y
        # has a wrong rank, and their gradient rules (dY's among them) would be built on it
        raise RuleError(f"ONNX shape inference gives Y {len(y_sp)} spatial dims instead of {geo.nd}")
    if geo.rt is None and _static(x_sp) and (_static(y_sp) or min(geo.pads) < 0):
        # Y's sizes as the node computes them, s·(S − 1) + output_padding + k_eff − pads, not as ONNX's
        # inference has them: under auto_pad SAME_* that gives S·s + output_padding, and the full output
        # when k_eff + output_padding < s (where the spec's S·s adds zero rows: negative pads)
        y_sp = list(geo.out)  # type: ignore[arg-type]
    if geo.rt is None and min(geo.pads) < 0:
        # output_shape (or SAME's S·s) beyond the full output: the extra rows (negative pads) are zeros no
        # input reaches, so crop them off dY and continue with the remaining non-negative pads
        lo = [max(0, -p) for p in geo.pb]
        hi = [o - max(0, -p) for o, p in zip(y_sp, geo.pe)]  # type: ignore[operator]
        dy = g.emit("Slice", dy, g.ints(lo), g.ints(hi), g.ints(range(2, geo.nd + 2)))
        y_sp = [h - b for h, b in zip(hi, lo)]
        geo = ConvGeom(
            geo.nd, geo.k, geo.strides, geo.dil, [max(0, p) for p in geo.pb], [max(0, p) for p in geo.pe]
        )
    dyn = any(v is None for v in (*(x_sp or [None]), *(y_sp or [None])))
    if g.needs_dx(0):
        # pads known at run time (possibly negative: output_shape beyond the full output): Pad dY first
        src = dy if geo.rt is None else g.emit("Pad", dy, pads_tensor(g, geo))
        dx = g.emit(
            "Conv", src, g.x(1), **_attrs(strides=geo.strides, pads=geo.pads, dilations=geo.dil, group=group)
        )
        # The Conv sees the full output, s·(S − 1) + output_padding + k_eff rows, and so has S + ⌊op / s⌋
        # windows: output_padding ≥ s (allowed below the dilation) adds ⌊op / s⌋ past X's last row, whose
        # rows of Y no input reaches; cut them off
        extra = [o // s for o, s in zip(op, geo.strides)]
        if any(extra):
            axes = [2 + i for i, e in enumerate(extra) if e]
            dx = g.emit("Slice", dx, g.ints([0] * len(axes)), g.ints([-e for e in extra if e]), g.ints(axes))
        g.set_dx(0, dx)
    if g.needs_dx(1):
        c = _channels(g, 1, 0, "weight shape") if group > 1 else 0
        m = _channels(g, 1, 1, "weight shape") * group if group > 1 else 0
        g.set_dx(
            1,
            weight_grad(
                g,
                dy,
                g.shape(0, output=True) if dyn else None,
                y_sp,
                g.x(0),
                g.shape(0) if dyn else None,
                x_sp,
                m,
                c,
                group,
                geo,
            ),
        )
    if g.has_x(2) and g.needs_dx(2):
        g.set_dx(2, bias_grad(g, geo.nd))


@gradient("Col2Im", uses=("x1", "x2"), stop=(1, 2), linear=True)
def col2im_grad(g: GradCtx) -> None:
    # Y[n, c, p] sums X[n, c·K + k, l] over the (block offset k, block l) landing on p, so dX is the im2col
    # of dY: dX[n, c·K + k, l] = dY_padded[n, c, l·s + k·d]. With the channels moved into the batch, that
    # is a Conv of dY (N·C, 1, *image) with K one-hot kernels W[k, 0, κ] = [κ = k], reshaped to X's shape
    image, block = g.constant_value(1), g.constant_value(2)
    if image is not None:
        shape = g.ints([-1, 1, *np.asarray(image).reshape(-1).tolist()])
    else:
        shape = g.emit("Concat", g.ints([-1, 1]), g.x(1), axis=0)
    dy = g.emit("Reshape", g.dy(0), shape)
    bf16 = g.dtype == TensorProto.BFLOAT16 and g.opset < 22
    if block is not None:
        b = [int(v) for v in np.asarray(block).reshape(-1)]
        k = int(np.prod(b))
        w = g.const(np.eye(k).reshape(k, 1, *b))
    else:
        k = g.emit("ReduceProd", g.x(2), keepdims=1)  # (1,)
        eye = g.emit("EyeLike", g.emit("ConstantOfShape", g.emit("Concat", k, k, axis=0)),
                     dtype=TensorProto.FLOAT if bf16 else g.dtype)  # (no bfloat16 EyeLike before opset 22)
        w = g.emit("Reshape", eye, g.emit("Concat", k, g.ints([1]), g.x(2), axis=0))
    conv = g.in_float32 if bf16 else g.emit  # (no bfloat16 Conv before opset 22; it casts w to float32)
    cols = conv("Conv", dy, w, **_attrs(strides=g.attr("strides"), pads=g.attr("pads"),
                                        dilations=g.attr("dilations")))
    g.set_dx(0, g.emit("Reshape", cols, g.shape(0)))
