"""A strided ConvTranspose as one GEMM per kernel shift, added into its output by BLAS.

Along an axis of stride s and dilation d, kernel offset k sends input i to output i·s + k·d = (i + t)·s + r
with shift t = k·d // s and phase r = k·d mod s: the outputs of one phase form a dense grid, onto which the
offset adds the input shifted by t. The canvas here holds output positions as rows and (last-axis phase,
output channel) as columns, so that each kernel shift (with one phase of each other axis) is a single GEMM
Xᵀ·W over every offset it holds, written at a row offset, and the last axis's phases lie side by side: one
transposing copy per phase of the other axes gives the output. Rows run over (axis 0, batch, axis 1, ...):
axis 0 outside the batch needs no padding for its shift, the other axes are padded by their largest shift
(in 1-D the batch leads and the one axis is padded), and a shift is a row offset.

The col2im it replaces (``conv.py``: a batched matmul per image, then one strided add per kernel offset)
took 75.5 ms against 36.2 here for DCGAN's 512 → 256 channels from 4² at batch 64, 4×4 at stride 2, and
89–104 against 43–47 for its 128 → 64 from 16², where the strided adds were most of it (bench/HISTORY.md).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from onnxtrain.engine.cblas import gemm

# below these the col2im path of conv.py is as fast or faster (2 cores, float32, ms, shifts / col2im):
# 64 × 64 × 32² → 8 channels, 4×4 at stride 2, 37.6 / 32.1 (16 columns; → 16 channels 60.4 / 95.0);
# 16 × 32 × 16² → 4, 0.60 / 0.59; 2 × 16 × 64 → 16 in 1-D (131 K multiply-adds) 0.036 / 0.025
MIN_CHANNELS_PER_GROUP = 8  # input channels: the GEMMs' inner dimension
MIN_COLUMNS = 32  # last-axis stride × output channels per group: the GEMMs' width
MIN_MACS = 1 << 19  # multiply-adds: below, the per-GEMM calls cost more than the strided adds
# a 1×1 kernel (a strided 1×1 Conv's input gradient: ResNet's projection shortcut) has one offset, whose one
# strided copy col2im makes anyway: 2 cores, ms, shifts / col2im: 32 × 32 × 16² → 16, 4.75 / 0.24; 32 × 64 ×
# 8² → 32, 0.43 / 0.18; 16 × 144 × 8² → 24, 0.31 / 0.11 (3×3 kernels keep the shifts: 1.23 / 2.36)
MIN_OFFSETS = 2


def fits(x: np.ndarray, g: dict[str, Any]) -> bool:
    """True when a ConvTranspose of ``x`` with geometry ``g`` (conv.py's ``_convt_geometry``) is strided and
    wide enough for the shifted GEMMs."""
    s = g["strides"]
    return (any(v > 1 for v in s) and x.dtype in (np.float32, np.float64)
            and g["cg"] >= MIN_CHANNELS_PER_GROUP and s[-1] * g["mg"] >= MIN_COLUMNS
            and x.size * g["mg"] * g["K"] >= MIN_MACS and g["K"] >= MIN_OFFSETS)


def _row_layout(n: int, ins: list[int], ext: list[int]) -> tuple[list[int], list[int], list[int]]:
    """(X's row dims, the canvas's row dims, each spatial axis's row pitch) for inputs of sizes ``ins`` on
    a canvas of extents ``ext``."""
    nd = len(ins)
    if nd == 1:
        return [n, ext[0]], [n, ext[0]], [1]
    xdims, cdims = [ins[0], n] + ext[1:], [ext[0], n] + ext[1:]
    pitch = [0] * nd
    p = 1
    for i in range(nd - 1, 0, -1):
        pitch[i] = p
        p *= ext[i]
    pitch[0] = p * n
    return xdims, cdims, pitch


def _copy_slices(out: int, pb: int, s: int, r: int, ext: int) -> tuple[slice, slice, bool]:
    """(output slice, canvas slice, whether every output of phase ``r`` is on the canvas) for an axis of
    output size ``out``, begin pad ``pb`` and stride ``s`` whose phase ``r`` has ``ext`` canvas rows."""
    first = (r - pb) % s  # the first output o with (o + pb) mod s == r
    want = len(range(first, out, s))
    o, q = first, (first + pb) // s
    if q < 0:  # outputs before the canvas: negative pads
        o, q = o - q * s, 0
    cnt = max(0, min(len(range(o, out, s)), ext - q))
    return slice(o, o + cnt * s, s), slice(q, q + cnt), cnt == want


def plan(xs: tuple[int, ...], g: dict[str, Any]) -> dict[str, Any]:
    """The GEMM steps and output copies of a ConvTranspose of input shape ``xs`` and geometry ``g``."""
    n, ins = xs[0], list(xs[2:])
    nd = len(ins)
    s, dil, k, out, pb = g["strides"], g["dil"], g["k"], g["out"], g["pb"]
    top = [(k[i] - 1) * dil[i] // s[i] for i in range(nd)]
    ext = [ins[i] + top[i] for i in range(nd)]
    xdims, cdims, pitch = _row_layout(n, ins, ext)
    rows = int(np.prod(cdims))
    padded = range(nd) if nd == 1 else range(1, nd)
    slack = sum(top[i] * pitch[i] for i in padded)  # rows the largest shift writes past the canvas
    outer = list(itertools.product(*(range(v) for v in s[:-1])))  # phases of every axis but the last
    by_shift: dict[tuple[tuple[int, ...], int], list[tuple[int, int]]] = {}
    for j, kk in enumerate(itertools.product(*(range(v) for v in k))):
        t = tuple(kk[i] * dil[i] // s[i] for i in range(nd))
        r = tuple(kk[i] * dil[i] % s[i] for i in range(nd))
        by_shift.setdefault((t, outer.index(r[:-1])), []).append((r[-1], j))
    # steps: (outer phase, row offset, first last-axis phase, kernel offsets of consecutive last-axis phases)
    steps = []
    for (t, ph), taps in by_shift.items():
        off = sum(t[i] * pitch[i] for i in range(nd))
        taps.sort()
        run = [taps[0]]
        for rl, j in taps[1:]:
            if g["group"] == 1 and rl == run[-1][0] + 1:
                run.append((rl, j))
                continue
            steps.append((ph, off, run[0][0], [jj for _, jj in run]))
            run = [(rl, j)]
        steps.append((ph, off, run[0][0], [jj for _, jj in run]))
    # copies: (outer phase, output slices, canvas slices); whole: they write every output (else zeros first)
    copies = []
    lo, hi = max(0, -pb[-1]), min(out[-1], ext[-1] * s[-1] - pb[-1])
    last = (slice(lo, max(lo, hi)), slice(lo + pb[-1], max(lo, hi) + pb[-1]))
    whole = lo == 0 and hi == out[-1]
    for ph, r in enumerate(outer):
        axes = [_copy_slices(out[i], pb[i], s[i], r[i], ext[i]) for i in range(nd - 1)]
        whole = whole and all(a[2] for a in axes)
        if all(a[1].stop > a[1].start for a in axes) and hi > lo:
            copies.append((ph, tuple(a[0] for a in axes) + last[:1], tuple(a[1] for a in axes) + last[1:]))
    # aligned: every phase of the other axes starts on the output's first row and fills it to the end (begin
    # pads and output sizes multiples of the stride, as a U-Net's 2×2 up-convolution): then one copy writes
    # the output whole, from the canvas's rows selected here (2.5 against 3.9 ms over two phases of 16 × 32 ×
    # 64²)
    aligned = None
    first = [pb[i] // s[i] for i in range(nd - 1)]  # the canvas row of each axis's first output
    if nd >= 2 and whole and all(pb[i] % s[i] == 0 and out[i] % s[i] == 0 and first[i] + out[i] // s[i]
                                 <= ext[i] for i in range(nd - 1)):
        aligned = tuple(slice(first[i], first[i] + out[i] // s[i]) for i in range(nd - 1)) + last[1:]
    return {"xdims": xdims, "cdims": cdims, "ext": ext, "rows": rows, "slack": slack, "phases": len(outer),
            "span": int(np.prod(xdims)), "steps": steps, "copies": copies, "whole": whole, "aligned": aligned}


def conv_transpose(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """ConvTranspose without bias of ``x`` by ``w`` with geometry ``g`` (where :func:`fits`)."""
    n, c = x.shape[:2]
    ins = x.shape[2:]
    nd = len(ins)
    group, m, mg, cg, sl = g["group"], g["m"], g["mg"], g["cg"], g["strides"][-1]
    p = g.get("shifts")
    if p is None:
        p = g["shifts"] = plan(x.shape, g)
    rows, span, cols = p["rows"], p["span"], sl * m
    # X as (C, rows), zeros where an axis is padded
    xb = np.zeros([c] + p["xdims"], x.dtype)
    if nd == 1:
        xb[:, :, :ins[0]] = x.swapaxes(0, 1)
    else:
        xb[(slice(None),) * 3 + tuple(slice(0, v) for v in ins[1:])] = np.moveaxis(x, (0, 1), (2, 0))
    xf = xb.reshape(c, span)
    wt = np.ascontiguousarray(w.reshape(c, mg, -1).transpose(2, 0, 1))  # (offset, C, M/group)
    # every outer phase's canvas (rows, columns), each running into the next by the slack rows (which
    # receive only products of X's zero padding), the last into spare rows
    buf = np.zeros((p["phases"] * rows + p["slack"]) * cols, x.dtype)
    it = buf.itemsize
    canvas = as_strided(buf, (p["phases"], rows + p["slack"], cols), (rows * cols * it, cols * it, it))
    for ph, off, r, taps in p["steps"]:
        dst = canvas[ph, off:off + span]
        if group == 1:
            b = wt[taps[0]] if len(taps) == 1 else wt[taps].transpose(1, 0, 2).reshape(c, len(taps) * m)
            gemm(xf.T, b, dst[:, r * m:(r + len(taps)) * m], accumulate=True)
            continue
        for q in range(group):
            gemm(xf[q * cg:(q + 1) * cg].T, wt[taps[0], q * cg:(q + 1) * cg],
                 dst[:, r * m + q * mg:r * m + (q + 1) * mg], accumulate=True)
    y = (np.empty if p["whole"] else np.zeros)((n, m) + tuple(g["out"]), x.dtype)
    ext, cd = p["ext"], p["cdims"]
    if p["aligned"] is not None:
        _copy_aligned(buf, y, p, g)
        return y
    for ph, dst, src in p["copies"]:
        v = buf[ph * rows * cols:(ph + 1) * rows * cols]
        if nd == 1:
            v = v.reshape(n, ext[0] * sl, m)[:, src[0]].swapaxes(1, 2)
        else:  # (axis 0, N, axes 1.., last axis with its phases, M) → (N, M, axes...)
            v = v.reshape([cd[0], n] + cd[2:-1] + [ext[-1] * sl, m])[(src[0], slice(None)) + src[1:]]
            v = np.moveaxis(v, (1, nd + 1), (0, 1))
        y[(slice(None), slice(None)) + dst] = v
    return y


def _copy_aligned(buf: np.ndarray, y: np.ndarray, p: dict[str, Any], g: dict[str, Any]) -> None:
    """Write every outer phase of the canvas ``buf`` into ``y`` in one copy (``p["aligned"]``)."""
    n, m = y.shape[:2]
    s, ext, out = g["strides"], p["ext"], g["out"]
    outer = len(out) - 1  # axes split into phases outside the columns
    # (phases.., axis 0, N, axes 1.., last axis with its phases, M), the rows and columns that are output
    v = buf[:p["phases"] * p["rows"] * s[-1] * m].reshape(
        tuple(s[:-1]) + (ext[0], n) + tuple(ext[1:-1]) + (ext[-1] * s[-1], m))
    sel = p["aligned"]
    v = v[(slice(None),) * outer + (sel[0], slice(None)) + sel[1:]]
    # → (N, M, axis 0, its phase, axis 1, its phase, ..., last axis)
    order = [outer + 1, 2 * outer + 2]
    for i in range(outer):
        order += [outer if i == 0 else outer + 1 + i, i]
    order.append(2 * outer + 1)
    shape = (n, m) + tuple(d for i in range(outer) for d in (out[i] // s[i], s[i])) + (out[-1],)
    y.reshape(shape)[...] = v.transpose(order)
