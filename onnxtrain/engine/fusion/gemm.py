"""Weight gradients of batched MatMul and of Conv as one GEMM each."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    FLOATS,
    SWAP01,
    absorb_crop,
    constant_of,
    consumers,
    crop_axes,
    make_step,
    producers,
    protected_slots,
    run_steps,
    swapped_conv,
    transposes_by,
)
from onnxtrain.engine.kernels.half_cast import HALF
from onnxtrain.engine.kernels.matmul import fits_onto, half_product_plus
from onnxtrain.engine.parallel import for_ranges_with_own_blas
from onnxtrain.engine.registry import Attrs
from onnxtrain.ir.conv_shapes import live_offsets

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


# ---- weight gradient of a batched MatMul ---------------------------------------------------------------
def fuse_matmul_weight_grads(plan: Plan, steps: list[Step]) -> list[Step]:
    """ReduceSum(MatMul(Transpose(A, swap last two), B), leading axes, keepdims=0) → A_flat^T @ B_flat."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, red in enumerate(steps):
        if (
            red.node.op_type != "ReduceSum"
            or len(red.inputs) < 2
            or red.attrs.get("keepdims", 1) != 0
            or red.attrs.get("noop_with_empty_axes", 0)
        ):
            continue
        axes = constant_of(plan, red.inputs[1])
        m = prod.get(red.inputs[0])
        if axes is None or m is None or steps[m].node.op_type != "MatMul":
            continue
        mm = steps[m]
        t = prod.get(mm.inputs[0])
        if t is None or steps[t].node.op_type != "Transpose":
            continue
        tr = steps[t]
        perm = list(tr.attrs.get("perm") or [])
        nd = len(perm)
        if (
            nd < 3
            or perm != [*range(nd - 2), nd - 1, nd - 2]
            or sorted(np.asarray(axes).reshape(-1).tolist()) != list(range(nd - 2))
        ):
            continue
        if (
            cons.get(tr.outputs[0]) != [m]
            or cons.get(mm.outputs[0]) != [k]
            or tr.outputs[0] in kept
            or mm.outputs[0] in kept
        ):
            continue
        members = [tr, mm, red]
        replace[k] = make_step(
            plan,
            "FusedMatMulWeightGrad",
            members,
            (tr.inputs[0], mm.inputs[1], red.inputs[1]),
            red.outputs,
            _matmul_weight_grad(plan, members, nd),
        )
        drop.update((t, m))
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _matmul_weight_grad(plan: Plan, members: list[Step], nd: int) -> Callable:
    tr, mm, red = members

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        a, b, axes = inputs
        if (
            a.ndim == nd
            and b.ndim == nd
            and a.shape[:-1] == b.shape[:-1]
            and a.dtype == b.dtype
            and a.dtype in FLOATS
            and a.size
            and b.size  # (an empty last axis: reshape(-1, 0) names no row count; the steps make the zeros)
        ):
            return (np.matmul(a.reshape(-1, a.shape[-1]).T, b.reshape(-1, b.shape[-1])),)
        env = {tr.inputs[0]: a, mm.inputs[1]: b, red.inputs[1]: axes}
        run_steps(plan, members, env)
        return (env[red.outputs[0]],)

    return run


# ---- weight gradient of a Conv -------------------------------------------------------------------------
def fuse_conv_weight_grads(plan: Plan, steps: list[Step]) -> list[Step]:
    """Transpose(Conv(Transpose(X), Transpose(dY))) with batch/channel swaps (group 1) → GEMMs."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, last in enumerate(steps):
        c = swapped_conv(steps, prod, last)
        if c is None or steps[c].attrs.get("group", 1) != 1:
            continue
        conv = steps[c]
        tx, tdy = prod.get(conv.inputs[0]), prod.get(conv.inputs[1])
        if tx is None or tdy is None or tx == tdy:
            continue
        if not (transposes_by(steps[tx], SWAP01) and transposes_by(steps[tdy], SWAP01)):
            continue
        inner = [steps[tx].outputs[0], steps[tdy].outputs[0], conv.outputs[0]]
        if (
            cons.get(inner[0]) != [c]
            or cons.get(inner[1]) != [c]
            or cons.get(inner[2]) != [k]
            or any(s in kept for s in inner)
        ):
            continue
        members = [steps[tx], steps[tdy], conv, last]
        # a Slice after it: only the kernel's own taps are computed (its bounds: inputs of the unfused steps)
        at, crop, bounds = absorb_crop(plan, steps, cons, kept, k, members, drop)
        ins = (steps[tx].inputs[0], steps[tdy].inputs[0], *bounds)
        replace[at] = make_step(plan, "FusedConvWeightGrad", members, ins, members[-1].outputs,
                                _conv_weight_grad(plan, members, crop))
        drop.update((tx, tdy, c))
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _conv_weight_grad(plan: Plan, members: list[Step], crop: dict[int, int] | None) -> Callable:
    """The fused step's kernel; ``crop``: the Slice after it (members[-1]) as axis → end, or None."""
    tx, tdy, conv = members[:3]
    at = conv.attrs

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x, dy = inputs[:2]
        nd = x.ndim - 2
        axes = crop_axes(crop, x.ndim)
        limit = [axes.get(2 + i) for i in range(nd)]
        strides = list(at.get("strides") or [1] * nd)  # the forward conv's dilations
        dil = list(at.get("dilations") or [1] * nd)  # the forward conv's strides
        pads = list(at.get("pads") or [0] * (2 * nd))
        if (
            nd >= 1
            and dy.ndim == x.ndim
            and x.shape[0] == dy.shape[0]
            and x.dtype == dy.dtype
            and x.dtype in FLOATS
            and x.size
            and dy.size  # (an empty batch or no channels: the steps' zeros, which the routes do not make)
            and len(strides) == nd
            and len(dil) == nd
            and len(pads) == 2 * nd
            and all(0 <= a < x.ndim for a in axes)  # else the Slice itself says what is wrong
        ):
            grad = _weight_grad_2d if nd == 2 else _weight_grad_nd
            dw = _live_taps_grad(grad, x, dy, strides, dil, pads, limit)
            if dw is not None:
                if any(a < 2 for a in axes):  # a crop of the channels too
                    return (np.ascontiguousarray(dw[tuple(slice(0, axes.get(a)) for a in range(dw.ndim))]),)
                return (dw,)
        env = {tx.inputs[0]: inputs[0], tdy.inputs[0]: inputs[1]}
        if crop is not None:
            env.update(zip(members[-1].inputs[1:], inputs[2:], strict=True))
        run_steps(plan, members, env)
        return (env[members[-1].outputs[0]],)

    return run


def _live_taps_grad(grad: Callable, x: np.ndarray, dy: np.ndarray, strides: list[int], dil: list[int],
                    pads: list[int], limit: list[int | None]) -> np.ndarray | None:
    """``grad``'s weight gradient (``_weight_grad_2d`` or ``_weight_grad_nd``, same arguments) without the
    kernel offsets that read only padding at every output: their gradients are zeros, and the rest is the
    gradient of the smaller kernel, its begin pads moved by its first offset (X's rows before the first
    that any offset reads dropped). A dilation wider than X (DeepLabV3's ASPP, 3×3 at dilation 36 over 4²
    planes: only the centre reads X) otherwise pads X by the dilation and multiplies all those zeros."""
    if not any(pads):  # every offset reads X at the first output
        return grad(x, dy, strides, dil, pads, limit)
    span = _live_span(x.shape[2:], dy.shape[2:], tuple(strides), tuple(dil), tuple(pads), tuple(limit))
    if span is None:
        return grad(x, dy, strides, dil, pads, limit)
    k, first, cut, skip, sub_pads = span
    part = grad(x[(slice(None), slice(None), *(slice(v, None) for v in skip))], dy, strides, dil,
                list(sub_pads), list(cut))
    if part is None:
        return None
    dw = np.zeros(part.shape[:2] + k, part.dtype)
    dw[(slice(None), slice(None), *(slice(a, a + c) for a, c in zip(first, cut, strict=True)))] = part
    return dw


@functools.lru_cache(maxsize=256)
def _live_span(xsp: tuple[int, ...], ysp: tuple[int, ...], strides: tuple[int, ...], dil: tuple[int, ...],
               pads: tuple[int, ...], limit: tuple[int | None, ...]) -> tuple[tuple[int, ...], ...] | None:
    """For :func:`_live_taps_grad`: (kernel dims, first live offset, live offsets, X's rows skipped, the
    smaller kernel's pads) per axis, or None where every offset reads X (or none does)."""
    nd = len(xsp)
    padded = [xsp[i] + pads[i] + pads[nd + i] for i in range(nd)]
    k = _kernel_dims(padded, ysp, list(strides), list(dil), limit)
    # offset t of axis i reads X's rows t·strides − pad + j·dil, outputs j
    span = live_offsets(k, strides, pads[:nd], dil, ysp, xsp)
    if span is None:
        return None
    first, last = span
    cut = [b - a + 1 for a, b in zip(first, last, strict=True)]
    begin = [pads[i] - first[i] * strides[i] for i in range(nd)]
    skip = [max(0, -b) for b in begin]
    begin = [max(0, b) for b in begin]
    # end pads: as many as the last offset reads past X (more would only lengthen the kernel that cut caps)
    end = [max(0, (cut[i] - 1) * strides[i] + (ysp[i] - 1) * dil[i] + 1 - (xsp[i] - skip[i]) - begin[i])
           for i in range(nd)]
    return tuple(k), tuple(first), tuple(cut), tuple(skip), tuple(begin + end)


def _weight_grad_2d(x: np.ndarray, dy: np.ndarray, strides: list[int], dil: list[int],
                    pads: list[int], limit: list[int | None]) -> np.ndarray | None:
    """A 2-D Conv's weight gradient (``strides``: the forward conv's dilations, ``dil`` its strides) by the
    GEMMs that suit its shape, each kernel axis cut to its ``limit`` (None: whole); None when the unfused
    nodes must run."""
    if any(pads):
        x = _padded(x, pads)
    n, ci, h, w = x.shape
    oh, ow = dy.shape[2:]
    kh, kw = _kernel_dims(x.shape[2:], dy.shape[2:], strides, dil, limit)
    if kh == kw == 1 and oh * ow >= POINTWISE_MIN_POSITIONS:  # a 1×1 kernel reads every dil-th position
        taps = x[:, :, : (oh - 1) * dil[0] + 1 : dil[0], : (ow - 1) * dil[1] + 1 : dil[1]]  # at stride 1: X
        return _pointwise_weight_grad(taps, dy)
    if _shifted_grad_fits(x, dy, [kh, kw], dil):
        dw = _weight_grad_shifted(x, dy, [kh, kw], strides)
        if np.isfinite(dw).all():  # else an inf or NaN in x met the padded zeros (0·inf): unfused
            return dw
    elif kh > 0 and kw > 0 and ci >= PATCHES_MIN_CHANNELS:
        return _weight_grad_patches(x, dy, kh, kw, strides, dil)
    if kh > 0 and kw > 0:
        x = np.ascontiguousarray(x)
        sn, sc, sh, sw = x.strides
        view = np.lib.stride_tricks.as_strided(
            x,
            (n, ci, kh, kw, oh, ow),
            (sn, sc, sh * strides[0], sw * strides[1], sh * dil[0], sw * dil[1]),
            writeable=False,
        )
        return _weight_grad_gemm(dy, view)
    return None


def _weight_grad_nd(x: np.ndarray, dy: np.ndarray, strides: list[int], dil: list[int],
                    pads: list[int], limit: list[int | None]) -> np.ndarray | None:
    """A 1-D or 3-D+ Conv's weight gradient by shifted GEMMs when its forward strides are 1 and its
    channels and products fit them, by channels-last patches when it is strided and large enough, each
    kernel axis cut to its ``limit``; else None (the unfused Conv: see kernels/conv.py's per-output GEMMs)."""
    nd = x.ndim - 2
    padded = [x.shape[2 + i] + pads[i] + pads[nd + i] for i in range(nd)]
    k = _kernel_dims(padded, dy.shape[2:], strides, dil, limit)
    whole = _kernel_dims(padded, dy.shape[2:], strides, dil, [None] * nd)  # what the unfused Conv computes
    patch_values = x.shape[0] * x.shape[1] * int(np.prod(dy.shape[2:])) * int(np.prod(whole))
    # windows when strided (the shifted GEMMs need stride 1) or 3-D+ (faster than them at stride 1 too)
    windows = nd >= PATCHES_ND_STRIDE_1_RANK or any(d != 1 for d in dil)
    if windows and min(k) > 0 and patch_values >= PATCHES_ND_MIN_VALUES:
        return _weight_grad_windows_nd(_padded(x, pads) if any(pads) else x, dy, k, strides, dil)
    if not _shifted_grad_fits(x, dy, k, dil):
        return None
    if any(pads):
        x = _padded(x, pads)
    dw = _weight_grad_shifted(x, dy, k, strides)
    return dw if np.isfinite(dw).all() else None  # an inf or NaN in x met dY's padded zeros: unfused


def _weight_grad_windows_nd(x: np.ndarray, dy: np.ndarray, k: list[int], strides: list[int],
                            dil: list[int]) -> np.ndarray:
    """A 1-D or 3-D+ weight gradient by GEMMs with copied input windows: channels-last patches, or for a 3-D+
    one with few channels (a patch's last-axis run of fewer than PATCH_RUN_MIN values) channels-first
    columns."""
    if len(k) >= 3 and x.shape[1] * k[-1] < PATCH_RUN_MIN:
        return _weight_grad_columns_nd(x, dy, k, strides, dil)
    return _weight_grad_patches_nd(x, dy, k, strides, dil)


def _padded(x: np.ndarray, pads: list[int]) -> np.ndarray:
    """``x`` (N, C, spatial...) zero-padded by ONNX ``pads`` (the begins of every axis, then the ends)."""
    nd = x.ndim - 2
    return np.pad(x, ((0, 0), (0, 0), *zip(pads[:nd], pads[nd:], strict=True)))


def _kernel_dims(padded: Sequence[int], out: Sequence[int], strides: list[int], dil: list[int],
                 limit: Sequence[int | None]) -> list[int]:
    """The forward kernel's dims from the padded input's and the output gradient's (``strides``: the forward
    conv's dilations, ``dil`` its strides), each at most its ``limit`` (None: no limit)."""
    dims = [(p - d * (o - 1) - 1) // s + 1 for p, o, s, d in zip(padded, out, strides, dil, strict=True)]
    return [v if c is None else min(v, c) for v, c in zip(dims, limit, strict=True)]


def _shifted_grad_fits(x: np.ndarray, dy: np.ndarray, k: list[int], dil: list[int]) -> bool:
    """Whether the shifted GEMMs suit this weight gradient: forward strides 1, and channels and GEMMs
    within their bounds."""
    n, ci = x.shape[:2]
    return (min(k) > 0 and all(d == 1 for d in dil) and ci >= SHIFTED_MIN_CHANNELS
            and ci * dy.shape[1] <= SHIFTED_MAX_CHANNEL_PAIRS and n * int(np.prod(k)) <= SHIFTED_MAX_GEMMS)


COLS_BYTES = 512 << 10  # im2col columns per GEMM of a Conv weight gradient: a few samples, cache-sized
# From this many input channels on, a Conv weight gradient takes its columns from the input laid out
# channels last (_weight_grad_patches): each copied run is a kernel row's kw·c consecutive values instead
# of an output row. Measured on 2 cores against the im2col GEMMs: LeNet's conv2 (64×6×14², 16 outputs, 5×5)
# 1035 → 529 µs, 1.5-1.7x on three shapes of 16-32 channels, as fast at 26×26 outputs, slower at 1-3
# channels; the same accuracy (RMS error against float64 within 5 %).
PATCHES_MIN_CHANNELS = 6
PATCH_POSITIONS = 8192  # output positions per GEMM (a chunk of samples)
# A strided 1-D or 3-D Conv's weight gradient with at least this many patch values (samples × output
# positions × kernel taps × input channels) takes them channels last too (_weight_grad_patches_nd), whatever
# its channels; smaller ones run the unfused Conv. Training steps on 2 cores, unfused → patches (ms): 3-D
# 3×3×3 stride 2 at 32³, batch 4-8: 16 → 32 channels 95 → 36, 3 → 16 39.6 → 15.7, 1 → 8 18.8 → 7.8; 1-D
# stride 2: 1 → 16 channels by 9 over 16,000 samples 10.4 → 2.4, 16 → 32 by 5 over 4,000 10.6 → 7.1, 64 → 64
# by 3 over 1,000 7.4 → 7.2; 3 → 8 by 7 over 1,000, stride 3, batch 32 (224 K values) 0.83 → 1.13
PATCHES_ND_MIN_VALUES = 1 << 18
# ... and from this many spatial axes on, also at stride 1, where the shifted GEMMs lose (3-D, kernels alone,
# ms, shifted → patches: 16 → 32 channels at 32³, batch 4 97 → 59; 8 → 8 at 24³ 15.3 → 9.2; 3 → 16 at 32³
# 34.7 → 19.8; 16 → 16 at 16³, batch 8 16.6 → 9.6). 1-D keeps them (8 × 16 → 16 over 4,000 by 5: 3.2 shifted
# against 10.9 by patches)
PATCHES_ND_STRIDE_1_RANK = 3
# ... where a patch's last-axis run (input channels × kernel width) has fewer values than this, the windows
# are copied channels first instead, as columns along the output positions (3-D 3×3×3, kernels alone, ms,
# patches → columns: 1 → 8 channels at 32³ stride 2, batch 8 3.7 → 1.5; 3 → 16 13.2 → 8.2; 1 → 16 at 48³
# stride 1, batch 2 18.3 → 10.9; slower from 8 channels: 8 → 16 7.9 → 8.8, 16 → 32 16.2 → 26.7). 1-D keeps
# the patches (mixed: one channel by 11 over 40,000 samples at stride 4, 8.0 → 26.8)
PATCH_RUN_MIN = 16


# A 1×1 Conv's weight gradient over at least this many output positions is one GEMM per sample on the
# tensors as they are, summed (no channels-last copies). Measured on 2 cores against _weight_grad_patches:
# MobileNet's 1×1 layers at batch 16 (16 → 96 channels at 32²: 1,246 → 490 µs; 144 → 24 at 16²: 993 → 380),
# ResNet's at batch 32 (64 → 256 at 28²: 10.9 → 6.2 ms; 256 → 1024 at 14²: 25.2 → 25.7); slower below (512
# → 512 at 7², batch 64: 12.3 → 22.3 ms)
POINTWISE_MIN_POSITIONS = 128


def _pointwise_weight_grad(x: np.ndarray, dy: np.ndarray) -> np.ndarray:
    """dW[o, c, 0, 0] = Σ_n dy[n, o, :] · x[n, c, :] (the positions flattened), a batched GEMM then a sum;
    the side with more channels gives the products' rows (OpenBLAS is faster so, the same dot products: 2
    cores, ms, MobileNetV2's 144 → 24 channels at 16², batch 16, 0.41 → 0.26 alone, 0.64 → 0.49 in its
    training step; 24 → 144 0.38 against 0.26 the other way round; 16 → 96 at 32² 0.94 against 0.60)."""
    n, ci = x.shape[:2]
    co = dy.shape[1]
    xs, dys = x.reshape(n, ci, -1), dy.reshape(n, co, -1)
    if ci > co:  # dWᵀ = Σ_n x[n] · dy[n]ᵀ
        dwt = np.add.reduce(np.matmul(xs, dys.transpose(0, 2, 1)), axis=0)
        return np.ascontiguousarray(dwt.T).reshape(co, ci, 1, 1)
    per_sample = np.matmul(dys, xs.transpose(0, 2, 1))
    return np.add.reduce(per_sample, axis=0).reshape(co, ci, 1, 1)


# A stride-1 Conv's weight gradient with few channels: per kernel offset, one GEMM per sample of the output
# gradient with the input shifted by that offset, both laid on the padded input's rows so that the shifted
# input is a view (no im2col copy). For input × output channels up to SHIFTED_MAX_CHANNEL_PAIRS, from
# SHIFTED_MIN_CHANNELS inputs, and up to SHIFTED_MAX_GEMMS products (samples × offsets). Measured on 2 cores
# against the patches/im2col GEMMs (ms): ResNet's 3×3 layers at batch 32, 16 channels at 32² 6.01 → 2.55,
# 32 at 16² 2.88 → 2.62, a 3-channel stem 1.63 → 0.87; slower at 64 channels (1.71 → 3.87) or with one
# input channel (LeNet's conv1, 0.82 → 1.27), and no faster at 1,600 products (LeNet's conv2, 1.17 / 1.18)
SHIFTED_MIN_CHANNELS = 3
SHIFTED_MAX_CHANNEL_PAIRS = 1024
SHIFTED_MAX_GEMMS = 512
# The per-sample products are too small for OpenBLAS to split over its threads, so the samples are split
# over the run's threads instead (each GEMM on the thread that makes it: the same products, summed in the
# same order, so the same bits), SHIFTED_GRAD_GROUP samples at a time over all the kernel's offsets (their
# planes stay in cache). ResNet's 3×3 layers at batch 32 alone, 2 cores, ms: 16 channels at 32² 1.89 →
# 1.30, 16 → 32 at 32² 3.99 → 2.46, 32 at 16² 2.02 → 1.33
SHIFTED_GRAD_GROUP = 4


def _weight_grad_shifted(xp: np.ndarray, dy: np.ndarray, k: list[int], steps: list[int]) -> np.ndarray:
    """dW[o, c, κ] = Σ_n dy[n, o] · xp[n, c] shifted by κ·s (``steps`` s: the forward conv's dilations; its
    strides are 1): the output gradient zero-padded to the padded input's rows (all axes but the first), so
    that every shift of the input is a contiguous run of its flattened planes (the padded places meet
    zeros)."""
    n, ci = xp.shape[:2]
    sizes = xp.shape[2:]
    co, out = dy.shape[1], dy.shape[2:]
    plane = int(np.prod(sizes))
    row = plane // sizes[0]
    run = out[0] * row
    buf = np.zeros((n, ci, plane + row), xp.dtype)  # a row of slack: the last shift's run passes the plane
    buf[:, :, :plane] = xp.reshape(n, ci, plane)
    dyp = np.zeros((n, co, out[0], *sizes[1:]), xp.dtype)
    dyp[(Ellipsis, *(slice(0, o) for o in out[1:]))] = dy
    dyp = dyp.reshape(n, co, run)
    flat = [plane // int(np.prod(sizes[:i + 1])) for i in range(len(sizes))]  # element strides of the axes
    taps = list(itertools.product(*(range(v) for v in k)))
    offsets = [sum(i * s * f for i, s, f in zip(kk, steps, flat, strict=True)) for kk in taps]
    per_sample = np.empty((len(taps), n, co, ci), xp.dtype)  # every offset's product of every sample

    def samples(lo: int, hi: int) -> None:
        for a in range(lo, hi, SHIFTED_GRAD_GROUP):  # a few samples' planes stay in cache over the offsets
            b = min(hi, a + SHIFTED_GRAD_GROUP)
            for j, off in enumerate(offsets):
                np.matmul(dyp[a:b], buf[a:b, :, off:off + run].transpose(0, 2, 1), out=per_sample[j, a:b])

    for_ranges_with_own_blas(n, samples)
    dw = np.empty((co, ci, *k), xp.dtype)
    for j, kk in enumerate(taps):  # the samples summed in order, as before the split
        dw[(slice(None), slice(None), *kk)] = np.add.reduce(per_sample[j], axis=0)
    return dw


def _weight_grad_patches(x: np.ndarray, dy: np.ndarray, kh: int, kw: int, strides: list[int],
                         dil: list[int]) -> np.ndarray:
    """dW[o, c, i, j] = sum over n, y, x of dy[n, o, y, x] * x[n, c, i·s + y·d, j·s' + x·d'] (``strides``
    s are the forward conv's dilations, ``dil`` d its strides) as GEMMs of the output gradient, [o,
    positions], with the patches of x, [positions, (i, j, c)], over chunks of samples."""
    n, ci = x.shape[:2]
    co, oh, ow = dy.shape[1:]
    xt = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # channels last
    dyt = np.ascontiguousarray(dy.transpose(1, 0, 2, 3))  # [o, n, y, x]
    sn, sh, sw, sc = xt.strides
    chunk = max(1, min(n, PATCH_POSITIONS // max(oh * ow, 1)))
    patches = np.empty((chunk, oh, ow, kh, kw, ci), x.dtype)
    out = None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        view = np.lib.stride_tricks.as_strided(
            xt[lo:hi], (hi - lo, oh, ow, kh, kw, ci),
            (sn, sh * dil[0], sw * dil[1], sh * strides[0], sw * strides[1], sc), writeable=False)
        p = patches[:hi - lo]
        np.copyto(p, view)
        part = dyt[:, lo:hi].reshape(co, -1) @ p.reshape(-1, kh * kw * ci)
        if out is None:
            out = part
        else:
            out += part
    return np.ascontiguousarray(out.reshape(co, kh, kw, ci).transpose(0, 3, 1, 2))


def _weight_grad_patches_nd(x: np.ndarray, dy: np.ndarray, k: list[int], strides: list[int],
                            dil: list[int]) -> np.ndarray:
    """:func:`_weight_grad_patches` for any number of spatial axes (a strided 1-D or 3-D Conv): GEMMs of the
    output gradient with the channels-last patches of ``x`` over blocks of about PATCH_POSITIONS output
    positions (samples, or rows of the first output axis of one sample)."""
    n, ci = x.shape[:2]
    co, out = dy.shape[1], dy.shape[2:]
    taps = int(np.prod(k))
    xt = np.ascontiguousarray(np.moveaxis(x, 1, -1))  # (n, *sizes, ci)
    dyt = np.ascontiguousarray(np.moveaxis(dy, 1, 0))  # (co, n, *out)
    sn, *axes, sc = xt.strides
    inner = int(np.prod(out[1:]))  # positions per row of the first output axis
    rows = max(1, PATCH_POSITIONS // max(inner, 1))
    if rows >= out[0]:  # whole samples per block
        per = max(1, rows // max(out[0], 1))
        blocks = [(lo, min(n, lo + per), 0, out[0]) for lo in range(0, n, per)]
    else:  # rows of one sample per block
        blocks = [(i, i + 1, a, min(out[0], a + rows)) for i in range(n) for a in range(0, out[0], rows)]
    shape_strides = [a * d for a, d in zip(axes, dil, strict=True)] + [a * s for a, s in zip(axes, strides,
                                                                                               strict=True)]
    dw = np.zeros((co, taps * ci), x.dtype)
    buf = np.empty(max((hi - lo) * (b - a) * inner for lo, hi, a, b in blocks) * taps * ci, x.dtype)
    for lo, hi, a, b in blocks:
        base = xt[lo:hi, a * dil[0]:]
        shape = (hi - lo, b - a, *out[1:], *k, ci)
        view = np.lib.stride_tricks.as_strided(base, shape, (sn, *shape_strides, sc), writeable=False)
        patches = buf[:int(np.prod(shape))].reshape(shape)
        np.copyto(patches, view)
        dw += dyt[:, lo:hi, a:b].reshape(co, -1) @ patches.reshape(-1, taps * ci)
    return np.ascontiguousarray(np.moveaxis(dw.reshape(co, *k, ci), -1, 1))


def _weight_grad_columns_nd(x: np.ndarray, dy: np.ndarray, k: list[int], strides: list[int],
                            dil: list[int]) -> np.ndarray:
    """dW[o, (c, κ)] = Σ dY[o, positions] · columns[(c, κ), positions]: im2col of the input as it lies
    (channels first), whose copies run along the output positions, over blocks of whole samples of about
    PATCH_POSITIONS positions (``strides``: the forward conv's dilations, ``dil`` its strides)."""
    n, ci = x.shape[:2]
    co, out = dy.shape[1], dy.shape[2:]
    taps, positions = int(np.prod(k)), int(np.prod(out))
    x = np.ascontiguousarray(x)
    sn, sc, *axes = x.strides
    dyt = np.ascontiguousarray(np.moveaxis(dy, 1, 0)).reshape(co, n, positions)
    per = max(1, PATCH_POSITIONS // max(positions, 1))
    dw = np.zeros((co, ci * taps), x.dtype)
    buf = np.empty(ci * taps * min(n, per) * positions, x.dtype)
    tap_strides = [a * s for a, s in zip(axes, strides, strict=True)]
    position_strides = [a * d for a, d in zip(axes, dil, strict=True)]
    for lo in range(0, n, per):
        hi = min(n, lo + per)
        shape = (ci, *k, hi - lo, *out)
        view = np.lib.stride_tricks.as_strided(x[lo:hi], shape, (sc, *tap_strides, sn, *position_strides),
                                               writeable=False)
        columns = buf[:int(np.prod(shape))].reshape(shape)
        np.copyto(columns, view)
        dw += dyt[:, lo:hi].reshape(co, -1) @ columns.reshape(ci * taps, -1).T
    return dw.reshape(co, ci, *k)


def _weight_grad_gemm(dy: np.ndarray, view: np.ndarray) -> np.ndarray:
    """dW[o, c, i, j] = sum over n, y, x of dy[n, o, y, x] * view[n, c, i, j, y, x], as GEMMs over chunks of
    samples whose im2col columns stay in cache (measured on LeNet's conv1: 1.38 -> 0.37 ms, against one
    tensordot whose transposing copy of all the columns is the slow part)."""
    n, ci, kh, kw, oh, ow = view.shape
    co = dy.shape[1]
    if n == 0:
        return np.zeros((co, ci, kh, kw), dy.dtype)
    per_sample = ci * kh * kw * oh * ow * view.itemsize
    chunk = max(1, min(n, COLS_BYTES // max(per_sample, 1)))
    out = None
    for lo in range(0, n, chunk):
        hi = min(n, lo + chunk)
        cols = np.ascontiguousarray(view[lo:hi].transpose(1, 2, 3, 0, 4, 5)).reshape(ci * kh * kw, -1)
        d2 = np.ascontiguousarray(dy[lo:hi].transpose(1, 0, 2, 3)).reshape(co, -1)
        part = d2 @ cols.T
        if out is None:
            out = part
        else:
            out += part
    return out.reshape(co, ci, kh, kw)


# ---- MatMul followed by a bias Add -----------------------------------------------------------------------
def fuse_matmul_bias(plan: Plan, steps: list[Step]) -> list[Step]:
    """Add(MatMul(A, B), bias) → the product with the bias added in place (no second output array).

    Runs after the elementwise clusters, so only Adds no cluster took are rewritten. The bias is added on
    the side the graph's Add has it: the sums commute, but where both operands are NaN the result is the
    first one's (its sign and payload).
    """
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, add in enumerate(steps):
        side = matmul_product_side(steps, k, prod, cons, kept)
        if side is None:
            continue
        m = prod[add.inputs[side]]  # read by this Add alone: no earlier Add took it
        mm = steps[m]
        members = [mm, add]
        replace[k] = make_step(
            plan,
            "FusedMatMulAdd",
            members,
            (*mm.inputs, add.inputs[1 - side]),
            add.outputs,
            _matmul_add(plan, members, side),
        )
        drop.add(m)
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def matmul_product_side(
    steps: list[Step], k: int, prod: dict[int, int], cons: dict[int, list[int]], kept: set[int]
) -> int | None:
    """For a two-input ``Add`` at ``steps[k]``: the side (0 or 1) that is a MatMul's product read by that Add
    alone and not kept (a graph output), which :func:`fuse_matmul_bias` adds the other side into; else
    None."""
    add = steps[k]
    if add.node.op_type != "Add" or len(add.inputs) != 2:
        return None
    for side in (0, 1):
        s = add.inputs[side]
        m = prod.get(s)
        if m is not None and steps[m].node.op_type == "MatMul" and cons.get(s) == [k] and s not in kept:
            return side
    return None


def _matmul_add(plan: Plan, members: list[Step], side: int) -> Callable:
    """The fused step's kernel; ``side``: the product's place in the Add (0 first, 1 second)."""
    mm, add = members
    first = side == 1  # the bias is the Add's first operand

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        a, b, bias = inputs
        if type(a) is type(b) is type(bias) is np.ndarray and a.dtype == HALF:
            y = half_product_plus(a, b, bias, first)  # float16: the bias added while the product is float32
            if y is not None:
                return (y,)
        y = plan._call(mm, [a, b])[0]
        if (
            type(y) is np.ndarray
            and type(bias) is np.ndarray
            and y.flags.writeable
            and y.dtype == np.result_type(y, bias)
            and fits_onto(y.shape, bias.shape)
            and not np.may_share_memory(y, a)
            and not np.may_share_memory(y, b)
            and not np.may_share_memory(y, bias)
        ):
            np.add(*((bias, y) if first else (y, bias)), out=y)  # the product is ours: the bias added into it
            return (y,)
        return plan._call(add, [bias, y] if first else [y, bias])

    return run
