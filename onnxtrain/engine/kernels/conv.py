"""Convolution kernels: Conv (im2col on a strided view + one batched BLAS matmul, or one GEMM over the whole
batch's columns where an image has very few output positions; at stride 1 with few channels one GEMM per
kernel offset on shifted views; with a kernel larger than the output, as in a weight gradient, one GEMM per
output position), ConvTranspose
(strided and wide enough: one GEMM per kernel shift, engine/kernels/conv_transpose_shifts.py; else matmul +
col2im by strided adds, one per kernel offset) and Col2Im (the same strided adds). Grouped
convolutions that are depthwise or have few outputs, and ConvTransposes with one output channel per group,
go to engine/kernels/depthwise.py.

The geometry of a node (pads, output size, window strides, slices) depends only on the input shapes,
so it is computed once per shape and kept in ``attrs.cache``. The helpers ``spatial_attrs``,
``explicit_pads`` and ``pad_input`` are shared with the pooling kernels (SAME pads come from
:func:`onnxtrain.ir.conv_shapes.same_pads`, which the onnxruntime backend's rewrites use too).
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import as_strided

from onnxtrain.engine.cblas import gemm
from onnxtrain.engine.kernels import conv_transpose_shifts as shifts
from onnxtrain.engine.kernels import depthwise
from onnxtrain.engine.kernels.finite import all_finite
from onnxtrain.engine.kernels.half import F32, in_float32, is_half
from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.ir.conv_shapes import conv_transpose_geometry, live_offsets, reads_input, same_pads


def spatial_attrs(attrs: Attrs, nd: int) -> tuple[list[int], list[int]]:
    """``strides`` and ``dilations`` of a conv/pool node for ``nd`` spatial axes (default 1)."""
    strides = list(attrs.get("strides") or [1] * nd)
    dilations = list(attrs.get("dilations") or [1] * nd)
    if len(strides) != nd or len(dilations) != nd:
        raise ValueError(f"strides {strides} / dilations {dilations} do not match {nd} spatial axes")
    if min(strides + dilations, default=1) < 1:
        raise ValueError(f"strides {strides} and dilations {dilations} must be >= 1")
    return strides, dilations


def explicit_pads(attrs: Attrs, in_sp: Sequence[int], k: Sequence[int], strides: Sequence[int],
                  dilations: Sequence[int]) -> tuple[list[int], list[int]]:
    """Begin and end pads of a Conv/pool node from ``auto_pad`` and ``pads``."""
    nd = len(in_sp)
    auto_pad = attrs.get("auto_pad") or "NOTSET"
    if auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        pb, pe = zip(*(same_pads(auto_pad, in_sp[i], (k[i] - 1) * dilations[i] + 1, strides[i])
                       for i in range(nd)), strict=True)
        return list(pb), list(pe)
    if auto_pad == "VALID":
        return [0] * nd, [0] * nd
    if auto_pad != "NOTSET":
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    if len(pads) != 2 * nd:
        raise ValueError(f"pads {pads} must have {2 * nd} values")
    if min(pads, default=0) < 0:
        raise ValueError(f"negative pads {pads} are not supported")
    return pads[:nd], pads[nd:]


def pad_input(x: np.ndarray, pb: Sequence[int], sizes: Sequence[int], fill: Any = 0) -> np.ndarray:
    """``x`` placed at offset ``pb`` in a new (N, C, *sizes) array filled with ``fill`` (cropped to fit);
    ``x`` itself when that is the identity."""
    sp = x.shape[2:]
    if tuple(sizes) == sp and not any(pb):
        return x
    shape = x.shape[:2] + tuple(sizes)
    xp = np.zeros(shape, dtype=x.dtype) if fill == 0 else np.full(shape, fill, dtype=x.dtype)
    keep = [min(n, s - b) for n, s, b in zip(sp, sizes, pb, strict=True)]
    dst = tuple(slice(b, b + kk) for b, kk in zip(pb, keep, strict=True))
    xp[(Ellipsis,) + dst] = x[(Ellipsis,) + tuple(slice(0, kk) for kk in keep)]
    return xp


# ---------------------------------------------------------------------------------------------- Conv

# The stride-1 im2col by flattened rows (_flat_cols) copies Q = out[0] · padded row columns per kernel offset
# where L = prod(out) are needed; it is used while Q ≤ FLAT_MAX_COLUMNS · L, else the windowed im2col.
# Measured on 1 core (ms, rows → windows): 3-D 3×3×3 at 5³ (Q/L 2.8) 0.09 → 0.17, at 8³ dilated (Q/L 4)
# 0.58 → 0.30, 2 × 8 × 32³ by 5³ dilated (Q/L 4) 62 → 12; a 3-D weight gradient (kernel 16³, output 3³:
# Q/L 36) 341 → 26
FLAT_MAX_COLUMNS = 3
# A kernel at least PER_OUTPUT_MIN_RATIO times larger than the output (the weight gradient of a Conv the GEMM
# fusion does not take: 1-D, 3-D, grouped) whose im2col columns would pass PER_OUTPUT_MIN_COLUMNS elements:
# one GEMM per output position on its copied window (_per_output_conv), no buffer prod(out) times the
# input. Measured on 1 core (ms, im2col → per output): that 3-D weight gradient 26 → 9, a ConvTranspose
# 3-D's (kernel 16³ dilated, output 2³) 789 → 3.5 (2 GB of columns by rows), 32 × 16 × 64² by 64² 699 → 33;
# slower on small ones (4 × 256 × 4² by 3², 0.73 → 1.34)
PER_OUTPUT_MIN_RATIO = 2
PER_OUTPUT_MIN_COLUMNS = 1 << 18
# A batch of images with at most this many output positions (im2col columns) each runs as one GEMM over
# every image's columns side by side, not one thin GEMM per image re-reading W (1 core, ms: 16 × 320 × 2²
# 1×1 to 1280 channels 1.9 → 0.56, 16 × 960 × 2² to 320 1.4 → 0.43); at 4² the transposes cost about what the
# GEMM saves (16 × 96 × 4² to 576: 0.24 → 0.26)
ONE_GEMM_MAX_COLUMNS = 4
# ... and with a kernel (or stride) to take windows of, up to this many output positions an image: the windows
# copied straight into columns laid (C·K, N·L), no transposing copy after (_one_gemm_windows). 2 cores, ms,
# medians of 9 interleaved rounds, a GEMM per image → one: 32 × 32 × 16² to 64 at stride 2 (ResNet's) 1.89 →
# 1.37, 32 × 128 × 8² to 256 at stride 2 4.07 → 3.30, 16 × 144 × 16² to 24 at stride 2 3.45 → 2.50, 16 × 256
# × 7² to 256 (stride 1, too wide for the shifted GEMMs) 10.8 → 8.0; even from 196 positions (16 × 64 × 28²
# at stride 2 4.17 / 4.04, 32 × 16 × 32² at stride 2 1.97 / 1.97)
ONE_GEMM_WINDOWS_MAX_COLUMNS = 64
# group-1 im2col columns of more than this many bytes are made and multiplied a few images at a time, each
# chunk's columns about this size, so that they are read back from cache rather than memory: by rows (stride
# 1), or one image at a time where an image's columns alone fill a chunk. Alone, after 5 ms of other work (as
# in a step; ms, 9 interleaved rounds, whole → chunks): LeNet's conv1 64 × 1 × 28² 5×5 1.28 → 0.83, its conv2
# 1.07 → 1.02, a CIFAR ResNet's stem 32 × 3 × 32² 1.24 → 0.99, ResNet-50's 64 × 3 × 224² 7×7 stride 2 253 →
# 193 (its columns 470 MB → 7.4 MB); strided windows a few images a chunk measured slower (MobileNet's stem
# 16 × 3 × 64² 0.66 → 0.79, 32 × 16 × 32² to 32 at stride 2 1.76 → 2.21), so they stay whole
IM2COL_CHUNK_BYTES = 512 << 10


def _conv_geometry(attrs: Attrs, xs: tuple[int, ...], ws: tuple[int, ...]) -> dict[str, Any]:
    nd = len(xs) - 2
    if nd < 1 or len(ws) != len(xs):
        raise ValueError(f"Conv needs X (N, C, *spatial) and W (M, C/group, *kernel); got {xs} and {ws}")
    group = int(attrs.get("group") or 1)
    n, c = xs[:2]
    m, cg = ws[:2]
    k = list(ws[2:])
    ks = attrs.get("kernel_shape")
    if ks is not None and list(ks) != k:
        raise ValueError(f"kernel_shape {list(ks)} does not match W's spatial shape {k}")
    if c != cg * group or m % group:
        raise ValueError(f"channels do not match: X has {c}, W is {ws} with group={group}")
    strides, dil = spatial_attrs(attrs, nd)
    pb, pe = explicit_pads(attrs, xs[2:], k, strides, dil)
    k_eff = [(k[i] - 1) * dil[i] + 1 for i in range(nd)]
    out = [(xs[2 + i] + pb[i] + pe[i] - k_eff[i]) // strides[i] + 1 for i in range(nd)]
    if min(out) < 1:
        raise ValueError(f"Conv output would be empty: input {xs}, kernel {k}, pads {pb + pe}")
    # the padded buffer only needs to reach the last window
    sizes = [(out[i] - 1) * strides[i] + k_eff[i] for i in range(nd)]
    sizes = [max(sizes[i], pb[i]) for i in range(nd)]
    plane = int(np.prod(sizes))
    row = plane // sizes[0]
    big, small = int(np.prod(k)), int(np.prod(out))
    flat = nd > 1 and all(v == 1 for v in strides)
    return {"nd": nd, "n": n, "group": group, "k": k, "strides": strides, "dil": dil, "pb": pb,
            "sizes": sizes,
            "out": out, "K": big, "L": small, "m": m, "cg": cg,
            "identity": all(v == 1 for v in k + strides) and not any(pb) and sizes == list(xs[2:]),
            # stride 1 on 2+ axes: im2col rows are contiguous runs of the flattened padded planes
            "flat": flat, "plane": plane, "row": row, "Q": out[0] * row,
            "flat_strides": [dil[i] * plane // int(np.prod(sizes[:i + 1])) for i in range(nd)],
            # ... worth copying only while the runs' junk columns stay few (see FLAT_MAX_COLUMNS)
            "flat_cols": flat and out[0] * row <= FLAT_MAX_COLUMNS * small,
            # a kernel larger than the output (a weight gradient): one GEMM per output position
            "per_output": (small * PER_OUTPUT_MIN_RATIO <= big
                           and n * c * big * small >= PER_OUTPUT_MIN_COLUMNS),
            "crop": _conv_live_part(attrs, list(xs[2:]), k, strides, dil, pb, out, group)}


def _conv_live_part(node: Attrs, in_sp: list[int], k: list[int], strides: list[int], dil: list[int],
                    pb: list[int], out: list[int], group: int) -> dict[str, Any] | None:
    """Where some kernel offsets read only padding at every output, or some outputs only padding (a
    dilation wider than X: DeepLabV3's ASPP, 3×3 at dilation 36 over 4² planes, reads X by its centre
    alone): the smaller Conv that computes the rest (``attrs``, by ``w`` = W's index, on ``x`` = X's index,
    its first ``keep`` outputs written at ``y``, zeros elsewhere). None where every offset and output reads
    X, or none does."""
    nd = len(k)
    first, last, taps = [], [], []
    for i in range(nd):  # output o reads X's rows o·stride + t·dilation − pad, offsets t
        s, d, n, p = strides[i], dil[i], in_sp[i], pb[i]
        lo, hi = 0, out[i] - 1  # the first and last outputs that read X (scanned only where an end does not)
        while lo <= hi and not reads_input(lo * s - p, d, k[i], n):
            lo += 1
        while hi > lo and not reads_input(hi * s - p, d, k[i], n):
            hi -= 1
        if lo > hi:
            return None
        a, b = 0, k[i] - 1  # ... and offsets, over those outputs
        while a < b and not reads_input(a * d + lo * s - p, s, hi - lo + 1, n):
            a += 1
        while b > a and not reads_input(b * d + lo * s - p, s, hi - lo + 1, n):
            b -= 1
        first.append(lo)
        last.append(hi)
        taps.append((a, b))
    if all(a == 0 and b == v - 1 for (a, b), v in zip(taps, k, strict=True)) and first == [0] * nd and \
            last == [o - 1 for o in out]:
        return None
    keep = [b - a + 1 for a, b in zip(first, last, strict=True)]
    cut = [b - a + 1 for a, b in taps]
    begin = [pb[i] - first[i] * strides[i] - taps[i][0] * dil[i] for i in range(nd)]
    skip = [max(0, -b) for b in begin]  # X's rows before the first that is read
    begin = [max(0, b) for b in begin]
    end = [max(0, (keep[i] - 1) * strides[i] + (cut[i] - 1) * dil[i] + 1 - (in_sp[i] - skip[i]) - begin[i])
           for i in range(nd)]
    sub = Attrs({"strides": strides, "dilations": dil, "group": group, "pads": begin + end},
                op="Conv", name=node.name, opset=node.opset)
    return {"attrs": sub, "keep": keep,
            "x": (slice(None), slice(None), *(slice(v, None) for v in skip)),
            "w": (slice(None), slice(None), *(slice(a, b + 1) for a, b in taps)),
            "y": (slice(None), slice(None), *(slice(a, a + v) for a, v in zip(first, keep, strict=True)))}


def _flat_cols(x: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Stride-1 im2col, (N, C, *kernel, Q): each kernel offset reads Q = out[0] * row consecutive
    elements of a flattened padded plane, so every copied run is contiguous. Columns past a row's
    valid width are junk the caller crops; a tail of one row keeps the last run inside the buffer."""
    n, c = x.shape[:2]
    plane, row, sizes = g["plane"], g["row"], g["sizes"]
    buf = np.zeros(n * c * plane + row, dtype=x.dtype)
    xp = buf[: n * c * plane].reshape((n, c) + tuple(sizes))
    keep = [min(v, s - b) for v, s, b in zip(x.shape[2:], sizes, g["pb"], strict=True)]
    xp[(Ellipsis,) + tuple(slice(b, b + v) for b, v in zip(g["pb"], keep, strict=True))] = \
        x[(Ellipsis,) + tuple(slice(0, v) for v in keep)]
    it = buf.itemsize
    view = _view(buf, (n, c) + tuple(g["k"]) + (g["Q"],),
                 (c * plane * it, plane * it) + tuple(v * it for v in g["flat_strides"]) + (it,))
    cols = np.empty(view.shape, dtype=x.dtype)
    np.copyto(cols, view)
    return cols


def _windows(xp: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """A (N, C, *kernel, *out) strided view: element [n, c, *kk, *o] = xp[n, c, o*stride + kk*dil]."""
    st = xp.strides
    sp = st[2:]
    k_strides = tuple(sp[i] * g["dil"][i] for i in range(g["nd"]))
    o_strides = tuple(sp[i] * g["strides"][i] for i in range(g["nd"]))
    return _view(xp, xp.shape[:2] + tuple(g["k"]) + tuple(g["out"]), st[:2] + k_strides + o_strides)


def _view(base: np.ndarray, shape: tuple[int, ...], strides: tuple[int, ...]) -> np.ndarray:
    """A read-only strided view of ``base`` (the ndarray constructor is ~6x cheaper than as_strided)."""
    if base.flags.c_contiguous:
        v = np.ndarray(shape, base.dtype, base, 0, strides)
        v.flags.writeable = False
        return v
    return as_strided(base, shape, strides, writeable=False)


# A stride-1 Conv with few channels: per kernel offset one GEMM of that offset's weights with the padded
# input shifted by it, the input laid channels first with every plane's rows end to end so that the shift is
# a view (no im2col copy K times the input). From SHIFTED_MIN_CHANNELS input channels while input × output
# channels stay within SHIFTED_MAX_CHANNEL_PAIRS. Measured on 2 cores against im2col (ms, batch 32, 3×3): 16
# channels at 32² 4.35 → 2.87, 32 at 16² 3.05 → 2.43, 64 at 8² 3.01 → 2.11; slower with 3 or 6 input
# channels (0.63 → 1.53, LeNet's conv2 0.50 → 1.16) and at 128 channels (138 → 150 at 28², batch 64)
SHIFTED_MIN_CHANNELS = 8
SHIFTED_MAX_CHANNEL_PAIRS = 4096
SHIFTED_MAX_OFFSETS = 9  # kernel positions (3×3): with LeNet's 5×5 input gradient, 1.20 → 2.96 ms a step
# in 3-D (3×3×3) on 1 core, im2col → shifted (ms): 4 × 16 × 16³ to 16 channels 9.9 → 5.2, to 32 14.7 → 8.4,
# 2 × 32 × 16³ to 32 12.9 → 7.3, 8 × 8 × 8³ to 8 0.86 → 0.59
SHIFTED_MAX_OFFSETS_3D = 27
# 2-D kernels up to 5×5 where both sides have this many channels per group (1 core, im2col → shifted, ms:
# 16 × 32 × 32² by 32@5×5 83.8 → 36.6)
SHIFTED_WIDE_MIN_CHANNELS = 16
SHIFTED_MAX_OFFSETS_WIDE = 25
# a grouped Conv makes one GEMM call per group and kernel offset: each must have at least this many
# multiply-adds (output channels × input channels per group × batch × padded plane), else im2col and one
# batched matmul cost less than the calls. 2 cores, ms, shifted → im2col: 8 groups of 8 channels at 8 × 16²
# (166 K a call) 1.14 → 0.50, 32 of 8 at 16 × 8² (102 K) 4.77 → 1.68, a depthwise weight gradient (256 groups
# of 8 images, 512 a call) 12.5 → 0.19; kept from 2.4 M a call: 4 groups of 8 at 32 × 32² 5.13 / 9.43, 4 of 16
# at 32 × 16² 3.16 / 5.86, 2 of 32 at 16 × 16² 1.87 / 2.55
SHIFTED_MIN_GROUP_WORK = 1 << 20


def _shifted_fits(x: np.ndarray, g: dict[str, Any]) -> bool:
    """True when a stride-1 Conv (or ConvTranspose taken as one) of ``x``, of geometry ``g``, has the
    dtype, channels (per group) and kernel offsets the shifted GEMMs are for."""
    cg, mg = x.shape[1] // g["group"], g["m"] // g["group"]
    if g["nd"] >= 3:
        offsets = SHIFTED_MAX_OFFSETS_3D
    else:
        wide = min(cg, mg) >= SHIFTED_WIDE_MIN_CHANNELS
        offsets = SHIFTED_MAX_OFFSETS_WIDE if wide else SHIFTED_MAX_OFFSETS
    return (x.dtype in depthwise.FAST_DTYPES and cg >= SHIFTED_MIN_CHANNELS
            and cg * mg <= SHIFTED_MAX_CHANNEL_PAIRS and g["K"] <= offsets
            and (g["group"] == 1 or mg * cg * x.shape[0] * g["plane"] >= SHIFTED_MIN_GROUP_WORK))


# Shared padding (below) against the plain padded planes, ResNet's 3×3 Convs at batch 32 alone (2 cores, ms,
# medians of 15 interleaved rounds; the same bits): 16 channels at 32² 6.59 → 6.25, 32 at 16² 2.05 → 1.87
# (faster in 14 of 15 rounds), 64 at 8² 1.95 → 1.71 (15 of 15)
def _shared_pads(keep: Sequence[int], g: dict[str, Any]) -> dict[str, Any] | None:
    """The shifted GEMMs' layout with each padding shared by the neighbours it separates: along every axis
    a run of the input, then max(begin pad, end pad) zeros before the next run (a row's end pad is the next
    row's begin pad; an image's last rows pad the next image's first), where the plain layout pads both
    sides. Outputs then take (extent + max pad) positions per axis instead of (extent + both pads): 8² planes
    padded by 1, 81 positions instead of 100. ``keep``: the input's extents that the windows read. None where
    nothing is shared or an output row would not fit."""
    ends = [s - b - v for s, b, v in zip(g["sizes"], g["pb"], keep, strict=True)]
    pitch = [v + max(b, e) for v, b, e in zip(keep, g["pb"], ends, strict=True)]
    if min(keep) < 1 or pitch == list(g["sizes"]) or any(o > p for o, p in zip(g["out"], pitch, strict=True)):
        return None
    flat = [int(np.prod(pitch[i + 1:])) for i in range(g["nd"])]  # element strides of the axes
    return {"pitch": pitch, "lead": sum(b * f for b, f in zip(g["pb"], flat, strict=True)),
            "offsets": _offsets(g, flat)}


def _offsets(g: dict[str, Any], flat: Sequence[int]) -> list[int]:
    """Each kernel offset's shift in a layout of axis strides ``flat`` (elements)."""
    steps = [d * f for d, f in zip(g["dil"], flat, strict=True)]
    return [sum(i * s for i, s in zip(kk, steps, strict=True))
            for kk in itertools.product(*(range(v) for v in g["k"]))]


def _shifted_layout(x: np.ndarray, g: dict[str, Any]) -> tuple[np.ndarray, list[int], list[int]]:
    """X laid channels first for the shifted GEMMs, the padding shared where it can be (:func:`_shared_pads`):
    the zero-filled buffer (C, positions + slack), the kernel offsets' shifts and the positions' extents per
    axis (output o of image b at b·prod(extents) + Σ o_i·stride_i)."""
    n, c = x.shape[:2]
    keep = [min(v, s - b) for v, s, b in zip(x.shape[2:], g["sizes"], g["pb"], strict=True)]
    lay = g.get("shared", False)
    if lay is False:
        lay = g["shared"] = _shared_pads(keep, g)
    if lay is None:
        extents, lead, offsets, starts = list(g["sizes"]), 0, g.get("offsets"), g["pb"]
        if offsets is None:
            offsets = g["offsets"] = _offsets(g, [int(np.prod(g["sizes"][i + 1:])) for i in range(g["nd"])])
    else:
        extents, lead, offsets, starts = lay["pitch"], lay["lead"], lay["offsets"], [0] * g["nd"]
    span = n * int(np.prod(extents))
    buf = np.zeros((c, max(span + offsets[-1], lead + span)), dtype=x.dtype)  # slack past the last image
    xp = buf[:, lead:lead + span].reshape((c, n, *extents))
    xp[(Ellipsis, *(slice(b, b + v) for b, v in zip(starts, keep, strict=True)))] = \
        x[(Ellipsis, *(slice(0, v) for v in keep))].swapaxes(0, 1)
    return buf, offsets, extents


def _shifted_conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Stride-1 Conv without bias as one GEMM per kernel offset (and group) on shifted views, summed."""
    n, c = x.shape[:2]
    m, group = g["m"], g["group"]
    buf, offsets, extents = _shifted_layout(x, g)
    span = n * int(np.prod(extents))
    cg, mg = c // group, m // group
    wk = np.ascontiguousarray(w.reshape(group, mg, cg, -1).transpose(3, 0, 1, 2))  # (offset, group, mg, cg)
    y = np.empty((m, span), dtype=x.dtype)
    for j, off in enumerate(offsets):  # each product added into y by BLAS as it is written (cblas.py)
        for q in range(group):
            gemm(wk[j, q], buf[q * cg:(q + 1) * cg, off:off + span], y[q * mg:(q + 1) * mg], accumulate=j > 0)
    y = y.reshape((m, n, *extents))[(slice(None), slice(None), *(slice(0, o) for o in g["out"]))]
    return np.ascontiguousarray(y.swapaxes(0, 1))


def _per_output_conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Conv without bias as one GEMM per output position: its window (N, C·K), copied, times W^T (per
    group), written into y laid positions first."""
    n, c = x.shape[:2]
    m, cg, group, K, L = g["m"], g["cg"], g["group"], g["K"], g["L"]
    win = _windows(pad_input(x, g["pb"], g["sizes"]), g)
    buf = np.empty((n, c) + tuple(g["k"]), dtype=x.dtype)
    y = np.empty((L, n, m), dtype=x.dtype)
    if group == 1:
        wt = w.reshape(m, c * K).T
        for p, o in enumerate(itertools.product(*(range(v) for v in g["out"]))):
            np.copyto(buf, win[(Ellipsis,) + o])
            np.matmul(buf.reshape(n, c * K), wt, out=y[p])
    else:
        wt = w.reshape(group, m // group, cg * K).transpose(0, 2, 1)  # (group, cg·K, m/group)
        yg = y.reshape(L, n, group, m // group).transpose(0, 2, 1, 3)  # (L, group, n, m/group)
        for p, o in enumerate(itertools.product(*(range(v) for v in g["out"]))):
            np.copyto(buf, win[(Ellipsis,) + o])
            yg[p] = np.matmul(buf.reshape(n, group, cg * K).transpose(1, 0, 2), wt)
    return np.ascontiguousarray(y.transpose(1, 2, 0)).reshape((n, m) + tuple(g["out"]))


def _conv_gemms(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Conv without bias by shifted GEMMs, one GEMM per output position or im2col, as ``g`` suits."""
    if g["flat"] and not g["identity"] and _shifted_fits(x, g):
        return _shifted_conv(x, w, g)
    if g["per_output"]:
        return _per_output_conv(x, w, g)
    return _im2col_conv(x, w, g)


def _one_gemm(wm: np.ndarray, cols: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """W (M, C·K) times the columns (N, C·K, L) of every image as one GEMM on them laid (C·K, N·L), the
    output laid back (N, M, *out) (its junk columns cropped, as :func:`_im2col_conv`'s)."""
    n, ck, q = cols.shape
    y = np.matmul(wm, np.ascontiguousarray(cols.transpose(1, 0, 2)).reshape(ck, n * q))
    y = y.reshape(wm.shape[0], n, q).transpose(1, 0, 2)
    if g["flat_cols"] and not g["identity"]:
        y = y.reshape((n, g["m"], g["out"][0]) + tuple(g["sizes"][1:]))
        y = y[(Ellipsis,) + tuple(slice(0, o) for o in g["out"][1:])]
    return np.ascontiguousarray(y).reshape((n, g["m"]) + tuple(g["out"]))


def _one_gemm_windows(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Conv without bias, group 1, as one GEMM of W (M, C·K) with every image's windows copied into columns
    laid (C, *kernel, N, *out)."""
    n, c = x.shape[:2]
    nd = g["nd"]
    win = _windows(pad_input(x, g["pb"], g["sizes"]), g)  # (N, C, *kernel, *out)
    cols = np.empty((c, *g["k"], n, *g["out"]), dtype=x.dtype)
    np.copyto(cols, win.transpose((1, *range(2, 2 + nd), 0, *range(2 + nd, 2 + 2 * nd))))
    y = np.matmul(w.reshape(g["m"], c * g["K"]), cols.reshape(c * g["K"], n * g["L"]))
    return np.ascontiguousarray(y.reshape((g["m"], n, *g["out"])).swapaxes(0, 1))


def _im2col_conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Conv without bias as im2col (on a strided view) and one batched matmul."""
    n, c = x.shape[:2]
    m, cg, group, K, L = g["m"], g["cg"], g["group"], g["K"], g["L"]
    if group == 1 and n > 1 and L <= ONE_GEMM_WINDOWS_MAX_COLUMNS and not g["identity"]:
        return _one_gemm_windows(x, w, g)
    per_image = c * K * (g["Q"] if g["flat_cols"] else L) * x.itemsize
    if (group == 1 and not g["identity"] and n > 1 and n * per_image > IM2COL_CHUNK_BYTES
            and (g["flat_cols"] or per_image >= IM2COL_CHUNK_BYTES)):
        per = max(1, IM2COL_CHUNK_BYTES // per_image)
        y = np.empty((n, m, *g["out"]), dtype=x.dtype)
        for lo in range(0, n, per):
            y[lo:lo + per] = _im2col_conv(x[lo:lo + per], w, g)  # (fits: no further chunks)
        return y
    if g["identity"]:  # 1x1 kernel, stride 1, no pad: X itself is the column matrix
        cols = x.reshape(n, c, L)
        cols = cols if group == 1 else cols.reshape(n, group, cg, L)
    elif g["flat_cols"]:
        cols, L = _flat_cols(x, g), g["Q"]
        cols = cols.reshape(n, c * K, L) if group == 1 else cols.reshape(n, group, cg * K, L)
    else:
        xp = pad_input(x, g["pb"], g["sizes"])
        win = _windows(xp, g)
        cols = np.empty(win.shape, dtype=x.dtype)
        np.copyto(cols, win)
        cols = cols.reshape(n, c * K, L) if group == 1 else cols.reshape(n, group, cg * K, L)
    if group == 1 and n > 1 and g["L"] <= ONE_GEMM_MAX_COLUMNS:
        return _one_gemm(w.reshape(m, c * K), cols, g)
    if group == 1:
        y = np.matmul(w.reshape(m, cg * K), cols)
    else:
        y = np.matmul(w.reshape(group, m // group, cg * K), cols)
    if g["flat_cols"] and not g["identity"]:
        # drop the columns that wrapped past the right edge of each padded row
        y = y.reshape((n, m, g["out"][0]) + tuple(g["sizes"][1:]))
        return np.ascontiguousarray(y[(Ellipsis,) + tuple(slice(0, o) for o in g["out"][1:])])
    return y.reshape((n, m) + tuple(g["out"]))


def conv_geometry(attrs: Attrs, xs: tuple[int, ...], ws: tuple[int, ...]) -> dict[str, Any]:
    """A Conv's geometry (strides, pads, sizes, routes' facts) for X of shape ``xs`` and W of ``ws``, kept
    by ``attrs``."""
    return attrs.cached((xs, ws), lambda: _conv_geometry(attrs, xs, ws))


@kernel("Conv", since=1)
def conv(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if is_half(x.dtype):  # float32 products, sums and bias, rounded once (numpy's bfloat16 matmul is float32)
        return in_float32(conv, inputs, attrs)
    g = conv_geometry(attrs, x.shape, w.shape)
    if g["crop"] is not None:  # offsets or outputs that read only padding: the Conv of the rest
        y = _live_part_conv(x, w, g)
        if b is not None:
            y += b.reshape((g["m"],) + (1,) * g["nd"])
        return (y,)
    y = depthwise.conv(x, w, g) if g["group"] > 1 and x.dtype in depthwise.FAST_DTYPES else None
    if y is None:
        y = _conv_gemms(x, w, g)
    if b is not None:
        y += b.reshape((g["m"],) + (1,) * g["nd"])
    return (y,)


def _live_part_conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Conv without bias by its smaller Conv over the offsets and outputs that read X (``g["crop"]``)."""
    c = g["crop"]
    xs = x[c["x"]]
    part = conv([xs if xs.shape == x.shape else np.ascontiguousarray(xs), np.ascontiguousarray(w[c["w"]])],
                c["attrs"])[0]
    part = part[(slice(None), slice(None), *(slice(0, v) for v in c["keep"]))]
    if part.shape[2:] == tuple(g["out"]):
        return np.ascontiguousarray(part)
    y = np.zeros((x.shape[0], g["m"], *g["out"]), x.dtype)
    y[c["y"]] = part
    return y


# ------------------------------------------------------------------------------------- ConvTranspose

def _convt_geometry(attrs: Attrs, xs: tuple[int, ...], ws: tuple[int, ...]) -> dict[str, Any]:
    nd = len(xs) - 2
    if nd < 1 or len(ws) != len(xs):
        raise ValueError(f"ConvTranspose needs X (N, C, *spatial) and W (C, M/group, *kernel); "
                         f"got {xs} and {ws}")
    group = int(attrs.get("group") or 1)
    c, mg = ws[:2]
    if xs[1] != c or c % group:
        raise ValueError(f"channels do not match: X has {xs[1]}, W is {ws} with group={group}")
    k = list(ws[2:])
    ks = attrs.get("kernel_shape")
    if ks is not None and list(ks) != k:
        raise ValueError(f"kernel_shape {list(ks)} does not match W's spatial shape {k}")
    strides, dil = spatial_attrs(attrs, nd)
    in_sp = xs[2:]
    out_pad = list(attrs.get("output_padding") or [0] * nd)
    if len(out_pad) != nd:
        raise ValueError(f"output_padding {out_pad} must have {nd} values")
    # the spec's output size and pads (ir/conv_shapes.py): all ints here, X's and W's sizes being known
    geo = conv_transpose_geometry(in_sp, k, strides, dil, out_pad, attrs.get("auto_pad"), attrs.get("pads"),
                                  attrs.get("output_shape"))
    full: list[int] = geo.full  # type: ignore[assignment]
    out: list[int] = geo.out  # type: ignore[assignment]
    pb: list[int] = geo.pad_begin  # type: ignore[assignment]
    if min(out) < 1:
        raise ValueError(f"ConvTranspose output would be empty: {out}")
    # col2im plan: for each kernel offset, the input range landing inside the output, and where
    steps = []
    for j, kk in enumerate(itertools.product(*(range(v) for v in k))):
        src: list[slice] = []
        dst: list[slice] = []
        for i in range(nd):
            off = kk[i] * dil[i] - pb[i]  # output position of input index 0
            lo = max(0, -(off // strides[i]))  # first input index with off + i*stride >= 0
            hi = min(in_sp[i], (out[i] - 1 - off) // strides[i] + 1)
            if hi <= lo:
                break
            start = off + lo * strides[i]
            src.append(slice(lo, hi))
            dst.append(slice(start, start + (hi - lo - 1) * strides[i] + 1, strides[i]))
        else:
            steps.append((j, tuple(src), tuple(dst)))
    # kernel offsets whose every product falls outside the output (a dilation wider than X, as in DeepLab's
    # ASPP: dilation 36 on 4² planes reads only its centre) are cropped off W before any route runs
    crop = _live_taps(in_sp, k, strides, dil, pb, out, group, attrs)
    # stride 1 in 2-D: col2im by flattened rows (_conv_transpose_flat) when the output lies on the canvas
    flat = (nd == 2 and strides == [1, 1] and group == 1 and all(pb[i] >= 0 and pb[i] + out[i] <= full[i]
                                                                for i in range(nd)))
    return {"nd": nd, "group": group, "k": k, "K": int(np.prod(k)), "m": mg * group, "mg": mg,
            "cg": c // group, "out": out, "steps": steps, "flat": flat, "full": full, "pb": pb, "dil": dil,
            "strides": strides,
            # one output channel per group (a depthwise Conv's input gradient), the output on the canvas
            "depthwise": group > 1 and mg == 1 and all(pb[i] >= 0 and pb[i] + out[i] <= full[i]
                                                       for i in range(nd)),
            # stride 1: the same as a Conv with the kernel flipped and pads k_eff − 1 − pads
            "as_conv": _as_conv_pads(nd, strides, k, dil, pb, full, out, out_pad), "crop": crop}


def _live_taps(in_sp: Sequence[int], k: list[int], strides: list[int], dil: list[int], pb: list[int],
               out: list[int], group: int, node: Attrs) -> tuple[tuple[slice, ...], Attrs] | None:
    """(W's index, the attributes of the ConvTranspose by W[index]) where some kernel offsets, along some
    axis, send no input into the output (their products all land in the cropped pads): the smaller
    ConvTranspose, of offsets [a, b] on each axis with its pads moved by a·dilation, gives the same output.
    None where every offset reaches the output, or none does (it is then zeros: col2im's case).
    ``node``: the node's attributes, whose name and opset the smaller one keeps."""
    nd = len(k)
    span = live_offsets(k, dil, pb, strides, in_sp, out)
    if span is None:
        return None
    lo_tap, hi_tap = span
    begin = [pb[i] - lo_tap[i] * dil[i] for i in range(nd)]
    full = [(in_sp[i] - 1) * strides[i] + (hi_tap[i] - lo_tap[i]) * dil[i] + 1 for i in range(nd)]
    end = [full[i] - begin[i] - out[i] for i in range(nd)]
    attrs = Attrs({"strides": strides, "dilations": dil, "group": group, "pads": begin + end},
                  op="ConvTranspose", name=node.name, opset=node.opset)
    index = tuple(slice(a, b + 1) for a, b in zip(lo_tap, hi_tap, strict=True))
    return (slice(None), slice(None), *index), attrs


def _as_conv_pads(nd: int, strides: list[int], k: list[int], dil: list[int], pb: list[int],
                  full: list[int], out: list[int], out_pad: list[int]) -> list[int] | None:
    """Pads of the Conv equal to a stride-1 ConvTranspose (its kernel flipped, channels swapped within
    each group), or None when there is none (other strides, or an output beyond the canvas).

    The Conv of X padded by k_eff − 1 on each side gives the S + k_eff − 1 rows the input reaches, the
    full output less its output_padding rows (zeros; at stride 1 the spec allows them below the dilation)."""
    if any(s != 1 for s in strides) or nd < 2:
        return None
    k_eff = [(k[i] - 1) * dil[i] + 1 for i in range(nd)]
    begin = [k_eff[i] - 1 - pb[i] for i in range(nd)]
    end = [k_eff[i] - 1 - (full[i] - out_pad[i] - pb[i] - out[i]) for i in range(nd)]
    return begin + end if min(begin + end) >= 0 else None


def _flipped(w: np.ndarray, group: int) -> np.ndarray:
    """ConvTranspose weights (C, M/group, *k) as the equivalent Conv's (M, C/group, *k): channels swapped
    within each group, the kernel reversed on every axis."""
    c, mg = w.shape[:2]
    wg = w.reshape((group, c // group, mg) + w.shape[2:]).swapaxes(1, 2)
    wc = wg.reshape((group * mg, c // group) + w.shape[2:])
    return np.ascontiguousarray(np.flip(wc, axis=tuple(range(2, w.ndim))))


# kernel offsets up to which a stride-1 depthwise ConvTranspose that the banded GEMMs do not take keeps the
# shifted adds on a canvas (depthwise.conv_transpose): with 3×3 the Conv's routes measured no faster (2 cores,
# ms, canvas / Conv: 16 × 144 × 8² 2.5 / 3.2 in a MobileNet step, 16 × 96 × 16² 0.78 / 0.81 alone); with 5×5
# and 7×7 over small planes the canvas's junk dominates (4 × 32 × 16² 5×5 2.35 / 0.30, 8 × 64 × 8² 7×7 3.0 /
# 0.65, 8 × 128 × 4² 4.4 / 0.9)
CANVAS_MAX_OFFSETS = 9


# A 1×1 ConvTranspose (stride 1, no pads, group 1: a Conv's input gradient through a pointwise layer) over
# planes of more than this many positions runs as one batched product Wᵀ·X[n], as the 1×1 Conv does, not by
# the shifted GEMMs (which lay X out channels first and copy the output back). 2 cores, ms, alone (shifted or
# flat → batched): MobileNetV2's 16 × 144 × 16² to 24 0.51 → 0.28, 16 × 96 × 32² to 16 1.20 → 0.80, 16 × 64 ×
# 8² to 384 0.50 → 0.34, 16 × 144 × 6² to 24 0.12 → 0.06, 32 × 64 × 32² to 256 19.1 → 9.6; at 4² and below the
# batched products are the slower (16 × 96 × 4² to 576 0.26 → 0.29, 32 × 512 × 2² to 2048 2.0 → 5.4)
POINTWISE_MIN_PLANE = 16


# A 2-D stride-1 ConvTranspose too wide for the shifted GEMMs (input × output channels past
# SHIFTED_MAX_CHANNEL_PAIRS), group 1, with no more input channels than output ones, runs as the flipped
# Conv's im2col instead of by flattened rows (_conv_transpose_flat), whose GEMM also multiplies each canvas
# row's (k − 1)·dilation columns of slack and whose adds go over every kernel offset's output: up to
# ONE_GEMM_WINDOWS_MAX_COLUMNS output positions an image, or beyond while the columns' rows (input channels ×
# kernel offsets) stay within FLIPPED_IM2COL_MAX_ROWS. 1 core, CPU ms (medians of 7 interleaved, a loaded
# host; flat → im2col): 32 × 128 × 8² 3×3 to 128 17.1 → 13.5, 32 × 64 × 8² to 128 9.7 → 6.5, dilation 2 15.5 →
# 8.9, 8 × 256 × 4² to 256 4.1 → 3.3, 5×5 32 × 128 × 8² to 128 53.6 → 37.5, 8 × 64 × 32² to 128 35.5 → 21.3, 8
# × 128 × 16² to 128 15.5 → 14.0; slower past the rows (8 × 256 × 16² to 256 50.2 → 57.6, 8 × 128 × 16² by 5×5
# 43.3 → 47.7) and with more input than output channels (128 to 64: 8 × 128 × 8² 3.0 → 3.2, 8 × 128 × 32² 25.0
# → 29.3; 8 × 256 × 16² to 128 19.6 → 20.4); bench/HISTORY.md has the grid
FLIPPED_IM2COL_MAX_ROWS = 2048
# ... and from this many output positions over the batch: with fewer the flipped copy of W costs about what
# the GEMM does, where the flattened rows read Wᵀ as a view (1 core, CPU ms, flat → im2col: DeepLabV3's head
# 2 × 256 × 4² 3×3 to 256 1.44 → 1.99, batch 1 0.84 → 1.54, 2 × 256 × 4² to 512 3.2 → 3.9, 2 × 128 × 8² to 128
# 1.01 → 0.96; 4 × 128 × 8² 1.96 → 1.67, 2 × 128 × 16² 3.6 → 3.3)
FLIPPED_IM2COL_MIN_COLUMNS = 256


def _flipped_im2col_pays(x: np.ndarray, cg: dict[str, Any]) -> bool:
    """Whether a stride-1 ConvTranspose of ``x`` runs as the im2col of its flipped Conv, of geometry ``cg``
    (see :data:`FLIPPED_IM2COL_MAX_ROWS`)."""
    n, c, m = x.shape[0], x.shape[1], cg["m"]
    return (cg["nd"] == 2 and cg["group"] == 1 and not cg["identity"] and c <= m
            and c * m > SHIFTED_MAX_CHANNEL_PAIRS and n * cg["L"] >= FLIPPED_IM2COL_MIN_COLUMNS
            and (cg["L"] <= ONE_GEMM_WINDOWS_MAX_COLUMNS or c * cg["K"] <= FLIPPED_IM2COL_MAX_ROWS))


def _conv_transpose_as_conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any],
                            attrs: Attrs) -> np.ndarray | None:
    """A stride-1 ConvTranspose as the equivalent Conv, where that runs as one batched product (1×1, see
    :data:`POINTWISE_MIN_PLANE`), by shifted GEMMs (ResNet's
    16-channel input gradient: 5.91 → 2.46 ms; 4 groups of 16: 4.2 → 1.4 ms), by the depthwise kernel's
    banded GEMMs, or, depthwise with more than :data:`CANVAS_MAX_OFFSETS` kernel offsets, by the depthwise
    Conv's other routes or its im2col, or too wide for the shifted GEMMs by its im2col (see
    :data:`FLIPPED_IM2COL_MAX_ROWS`); else None."""
    if x.dtype not in depthwise.FAST_DTYPES:
        return None
    group = g["group"]
    ws = (g["m"], x.shape[1] // group) + w.shape[2:]
    cg = attrs.cached(("as_conv", x.shape, w.shape), lambda: _conv_geometry(
        Attrs({"pads": g["as_conv"], "dilations": g["dil"], "group": group}), x.shape, ws))
    if group == 1 and cg["identity"] and cg["L"] > POINTWISE_MIN_PLANE:
        n, c = x.shape[:2]
        y = np.matmul(w.reshape(c, g["m"]).T, x.reshape(n, c, cg["L"]))
        return y.reshape((n, g["m"], *cg["out"]))
    if group > 1 and cg["cg"] == 1 and depthwise.banded_fits(x, cg):
        return depthwise.conv(x, _flipped(w, group), cg)
    if group > 1 and cg["cg"] == 1 and cg["K"] > CANVAS_MAX_OFFSETS:
        # a depthwise kernel larger than 3×3: the Conv's own routes (or its im2col), not the canvas's
        wf = _flipped(w, group)
        y = depthwise.conv(x, wf, cg)
        return y if y is not None else _conv_gemms(x, wf, cg)
    if _shifted_fits(x, cg):
        return _shifted_conv(x, _flipped(w, group), cg)
    pays = cg.get("flipped_im2col")
    if pays is None:  # decided once per shape (cg is kept per shape)
        pays = cg["flipped_im2col"] = _flipped_im2col_pays(x, cg)
    if pays:
        return _im2col_conv(x, _flipped(w, group), cg)
    return None


# Input channels up to which _conv_transpose_flat lays each image of X on as many positions as its canvas, so
# that one add per kernel offset and output channel covers every image: the GEMM then multiplies the zero rows
# below each image too, which costs more than the per-image adds save when it is deep. 2 cores, ms, per-image
# → canvas-sized (medians of 5, the same bits): 16 channels 64 × 10² by 5×5 to 6 (LeNet) 1.36 → 1.05, 8 × 32²
# by 5×5 to 8 1.57 → 0.92, 32 × 16² by 3×3 to 16 1.46 → 1.06; 32 at 8² to 64 even, 48 at 12² 0.74 → 0.89,
# 64 at 8² 0.49 → 0.54, 128 1.46 → 1.65
PITCHED_MAX_CHANNELS = 32
# Columns (X's positions over every image) up to which _conv_transpose_flat's GEMM reads Wᵀ as a view, its
# rows (output channel, kernel offset), instead of W copied to rows (offset, channel): with few columns the
# transposing copy of W costs more than the GEMM (DeepLabV3's head over 4² planes). 1 core, ms, medians of 15
# interleaved, copy → view: 2 × 256 × 4² by 3×3 to 256 2.32 → 0.71, dilated 2 8.9 → 2.7, 2 × 512 × 8² 12.3 →
# 5.2, 2 × 128 × 16² 1.75 → 1.49, 16 × 256 × 7² (1,008 columns) 10.6 → 9.4; from 1,152 columns the view is
# 1-8 % slower (4 × 128 × 16² 2.96 → 3.05, 16 × 48 × 12² 3.71 → 4.02, 32 × 128 × 8² 7.78 → 8.10)
FLAT_WEIGHT_VIEW_MAX_COLUMNS = 1024


def _conv_transpose_flat(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Stride-1 2-D ConvTranspose with col2im over flattened rows.

    X's rows are padded with zeros to the canvas width Wf, so that each kernel offset's contribution is one
    contiguous run of the flattened canvas, shifted by ki*dil*Wf + kj*dil: K adds of long runs instead of
    K * N * M * H adds of short rows (LeNet's conv2 input gradient: 1.19 -> 0.74 ms). The padded columns
    carry zeros, so the parts of a run that wrap past a row's end add nothing. Channels lead (X as
    [C, N, ...], the canvas as [M, N, ...]): the contributions are one GEMM for the whole batch, whose rows
    (offset, output channel) make each offset's block contiguous (0.74 -> 0.58 ms). With few input channels
    (:data:`PITCHED_MAX_CHANNELS`) each image of X also takes as many positions as its canvas (zero rows
    below it), so that an offset's run covers every image at once; what it carries past an image's canvas
    is zeros.
    """
    n, c, ih, iw = x.shape
    kw, (dh, dw), m, k = g["k"][1], g["dil"], g["m"], g["K"]
    hf, wf = g["full"]
    pitch = hf * wf + (kw - 1) * dw  # an image's canvas and the slack its last offset's run reaches into
    run = ih * wf
    pitched = c <= PITCHED_MAX_CHANNELS
    per = pitch if pitched else run  # X's positions per image
    xp = np.zeros((c, n, per), x.dtype)
    xp[:, :, :run].reshape(c, n, ih, wf)[..., :iw] = x.transpose(1, 0, 2, 3)
    if n * per <= FLAT_WEIGHT_VIEW_MAX_COLUMNS:  # rows (output channel, kernel offset): Wᵀ as a view
        cols = np.matmul(w.reshape(c, m * k).T, xp.reshape(c, n * per)).reshape(m, k, n * per).swapaxes(0, 1)
    else:  # rows (kernel offset, output channel): each offset's block contiguous, W copied
        wk = w.reshape(c, m, k).transpose(2, 1, 0).reshape(k * m, c)
        cols = np.matmul(wk, xp.reshape(c, n * per)).reshape(k, m, n * per)
    offsets = [ki * dh * wf + kj * dw for ki, kj in (divmod(j, kw) for j in range(k))]
    span = n * pitch
    canvas = np.zeros((m, span + offsets[-1]), x.dtype)
    grid = canvas[:, :span].reshape(m, n, pitch)
    for j, off in enumerate(offsets):
        if pitched:
            canvas[:, off:off + span] += cols[j]
        else:
            grid[:, :, off:off + run] += cols[j].reshape(m, n, run)
    (p0, p1), (o0, o1) = g["pb"], g["out"]
    y = grid[:, :, :hf * wf].reshape(m, n, hf, wf)[:, :, p0:p0 + o0, p1:p1 + o1]
    return np.ascontiguousarray(y.transpose(1, 0, 2, 3))


def _col2im_conv_transpose(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """ConvTranspose without bias as one batched matmul and col2im by strided adds, one per kernel offset."""
    n, c = x.shape[:2]
    in_sp = x.shape[2:]
    lin = int(np.prod(in_sp))
    group, m, mg, cg, K = g["group"], g["m"], g["mg"], g["cg"], g["K"]
    # cols[n, m, k, l] = sum_c W[c, m, k] X[n, c, l]  (per group)
    if group == 1:
        cols = np.matmul(w.reshape(c, m * K).T, x.reshape(n, c, lin))
    else:
        wt = w.reshape(group, cg, mg * K).transpose(0, 2, 1)
        cols = np.matmul(wt, x.reshape(n, group, cg, lin))
    cols = cols.reshape((n, m, K) + in_sp)
    strided = any(s > 1 for s in g["strides"])
    if g["nd"] >= 3 and strided and n * m * int(np.prod(g["out"])) >= PHASES_MIN_OUTPUT:
        return _col2im_by_phases(cols, g)
    y = np.zeros((n, m) + tuple(g["out"]), dtype=x.dtype)
    for j, src, dst in g["steps"]:
        y[(slice(None), slice(None)) + dst] += cols[(slice(None), slice(None), j) + src]
    return y


# A strided 3-D ConvTranspose with at least this many output values adds its kernel offsets' contributions
# into the output laid out by stride phases (the positions equal modulo the stride on every axis, each phase a
# dense block), where each add is unit-stride, then interleaves the phases in one copy; the same bits. col2im
# alone, strided adds → phases (ms): 2 × 32 → 16 channels from 16³ by 3×3×3 at stride 2 8.1 → 5.9. In 2-D
# the strided adds stay faster (1.0-1.5x on six decoder and input-gradient shapes)
PHASES_MIN_OUTPUT = 1 << 15


def _col2im_by_phases(cols: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """col2im of ``cols`` (N, M, K, *in) into the output of geometry ``g`` by stride phases (see
    PHASES_MIN_OUTPUT): phases[n, m, r, q] holds y[n, m, q·s + r] (per axis)."""
    n, m = cols.shape[:2]
    strides, out = g["strides"], g["out"]
    nd = len(out)
    per = [-(-o // s) for o, s in zip(out, strides, strict=True)]  # positions per phase, per axis
    phases = np.zeros((n, m, *strides, *per), dtype=cols.dtype)
    for j, src, dst in g["steps"]:
        where = tuple(d.start % s for d, s in zip(dst, strides, strict=True)) + tuple(
            slice(d.start // s, d.start // s + (sl.stop - sl.start))
            for d, s, sl in zip(dst, strides, src, strict=True))
        phases[(slice(None), slice(None)) + where] += cols[(slice(None), slice(None), j) + src]
    # (n, m, r_0.., q_0..) → (n, m, q_0, r_0, q_1, r_1, ...): each axis's position q·s + r
    order = [0, 1] + [a for i in range(nd) for a in (2 + nd + i, 2 + i)]
    y = phases.transpose(order).reshape((n, m) + tuple(p * s for p, s in zip(per, strides, strict=True)))
    return np.ascontiguousarray(y[(slice(None), slice(None)) + tuple(slice(0, o) for o in out)])


@kernel("ConvTranspose", since=1)
def conv_transpose(inputs: Inputs, attrs: Attrs) -> Outputs:
    x, w = inputs[0], inputs[1]
    b = inputs[2] if len(inputs) > 2 else None
    if is_half(x.dtype):  # the overlapping contributions summed in float32, rounded once
        return in_float32(conv_transpose, inputs, attrs)
    g = attrs.cached((x.shape, w.shape), lambda: _convt_geometry(attrs, x.shape, w.shape))
    if g["crop"] is not None:  # kernel offsets that reach no output: the ConvTranspose by the rest of W
        index, sub = g["crop"]
        return conv_transpose([x, np.ascontiguousarray(w[index])] + ([b] if b is not None else []), sub)
    y = _conv_transpose_as_conv(x, w, g, attrs) if g["as_conv"] is not None else None
    if y is None and g["depthwise"] and x.dtype in depthwise.FAST_DTYPES:
        y = depthwise.conv_transpose(x, w, g)
    if y is None and shifts.fits(x, g):
        y = shifts.conv_transpose(x, w, g)
    if y is None and g["flat"]:
        y = _conv_transpose_flat(x, w, g)
    if y is not None and not all_finite(w):
        # these routes multiply W by zeros (the flipped Conv's padding, a canvas's or padded rows' slack):
        # an inf or NaN in W made NaN of outputs none of its products reach; col2im forms only those.
        # (X meets no such zeros there: its inf or NaN reaches the outputs of its products only)
        y = None
    if y is None:
        y = _col2im_conv_transpose(x, w, g)
    if b is not None:
        y += b.reshape((g["m"],) + (1,) * g["nd"])
    return (y,)


# -------------------------------------------------------------------------------------------- Col2Im

def _col2im_geometry(attrs: Attrs, xs: tuple[int, ...], image: list[int], block: list[int]) -> dict[str, Any]:
    nd = len(image)
    if nd < 1 or len(block) != nd:
        raise ValueError(f"Col2Im: image_shape {image} and block_shape {block} must be non-empty and of "
                         "equal length")
    if len(xs) != 3:
        raise ValueError(f"Col2Im: the input must be (N, C * prod(block_shape), L), got shape {list(xs)}")
    if min(block) < 1 or min(image) < 0:
        raise ValueError(f"Col2Im: bad block_shape {block} or image_shape {image}")
    strides, dil = spatial_attrs(attrs, nd)
    pads = list(attrs.get("pads") or [0] * (2 * nd))
    if len(pads) != 2 * nd or min(pads) < 0:
        raise ValueError(f"Col2Im: pads {pads} must be {2 * nd} non-negative values")
    K = int(np.prod(block))
    if xs[1] % K:
        raise ValueError(f"Col2Im: input channels {xs[1]} are not a multiple of prod(block_shape) = {K}")
    padded = [image[i] + pads[i] + pads[nd + i] for i in range(nd)]
    grid = [(padded[i] - (block[i] - 1) * dil[i] - 1) // strides[i] + 1 for i in range(nd)]
    if min(grid) < 1 or int(np.prod(grid)) != xs[2]:
        raise ValueError(f"Col2Im: the input has {xs[2]} blocks, image_shape {image}, block_shape {block}, "
                         f"pads, strides and dilations give {grid}")
    # for each block offset, where its grid of values lands in the padded image
    steps = []
    for j, kk in enumerate(itertools.product(*(range(v) for v in block))):
        dst = tuple(slice(kk[i] * dil[i], kk[i] * dil[i] + (grid[i] - 1) * strides[i] + 1, strides[i])
                    for i in range(nd))
        steps.append((j, dst))
    crop = tuple(slice(pads[i], pads[i] + image[i]) for i in range(nd))
    return {"c": xs[1] // K, "K": K, "grid": grid, "padded": padded, "steps": steps, "crop": crop}


@kernel("Col2Im", since=18)
def col2im(inputs: Inputs, attrs: Attrs) -> Outputs:
    # Y[n, c, p] = sum over (block offset k, block l) that put X[n, c*K + k, l] at padded position p
    x = inputs[0]
    image = [int(v) for v in np.asarray(inputs[1]).reshape(-1)]
    block = [int(v) for v in np.asarray(inputs[2]).reshape(-1)]
    g = attrs.cached((x.shape, tuple(image), tuple(block)),
                     lambda: _col2im_geometry(attrs, x.shape, image, block))
    n, c, K = x.shape[0], g["c"], g["K"]
    cols = x.reshape((n, c, K, *g["grid"]))
    half = is_half(x.dtype)  # the overlapping blocks summed in float32, rounded once
    y = np.zeros((n, c, *g["padded"]), dtype=F32 if half else x.dtype)
    for j, dst in g["steps"]:
        y[(slice(None), slice(None)) + dst] += cols[:, :, j]
    y = y[(Ellipsis,) + g["crop"]]
    return (y.astype(x.dtype) if half else np.ascontiguousarray(y),)
