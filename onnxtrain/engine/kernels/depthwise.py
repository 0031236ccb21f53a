"""Grouped convolutions whose groups are too small or too lopsided for im2col + one batched matmul.

Conv's and ConvTranspose's kernels (engine/kernels/conv.py) hand three shapes here (a depthwise Conv with
tiny output planes goes channels last, one einsum over all the channels; one with narrow rows at stride 1 or
2 by banded GEMMs):

- **depthwise** (each group reads one input channel): the output is a sum over kernel offsets of the
  input shifted by that offset times one weight per plane, K multiply-adds on views of the padded input
  instead of an im2col copy K times its size and thousands of one-row matmuls;
- **transposed depthwise** (ConvTranspose with one output channel per group, the input gradient of a
  depthwise Conv): the same shifted adds, into a canvas;
- **few outputs** (a grouped Conv with fewer output positions than kernel offsets: the weight gradient of
  a grouped Conv, whose "kernel" is the output gradient): per output position one product of each group's
  taps with its planes' windows in every image (a GEMM over the images), instead of an im2col copy as many
  times the input as there are output positions.

Strided access becomes unit-stride by splitting the padded image into phases (the pixels whose
coordinates are equal modulo the stride, or the dilation for few outputs), and the rows of a plane are
laid end to end, so each kernel offset reads or writes one contiguous run per plane; columns that run
past a row's end are junk, cropped at the end. Where planes are small, the planes that share a weight are
laid end to end too (a channel's images; a group's channels for few outputs), one run for them all, as a
numpy call per short plane costs more than its values. Planes go in blocks that stay in cache across the
kernel offsets, split over the run's threads, each thread padding and splitting its block into a buffer of
its own and writing the block's outputs cropped (the padded, split image never goes through memory whole):
every output element is summed in the same order whatever the split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from onnxtrain.engine.blas import can_pin_blas_threads, single_threaded_blas
from onnxtrain.engine.kernels.finite import all_finite
from onnxtrain.engine.parallel import parallel_for, row_ranges

# output elements of a block of planes, one numpy call per kernel offset each: fewer, longer calls measured
# faster up to here (MobileNet step 42.0 -> 40.4 ms from 64 K; forward 16 x 96 x 32^2: 4.3 -> 2.8 ms)
BLOCK = 1 << 18
# elements of a thread's scratch for a block of depthwise planes (their phases, sums and products): smaller
# blocks cost more in numpy calls than they keep in cache (16 × 96 × 112², stride 2, one thread: 2^17 40 ms,
# 2^19 22 ms); against splitting the whole input first (2 threads, ms): 16 × 96 × 112² stride 2 25.6-35.4 →
# 19.8-20.5, 16 × 144 × 56² stride 2 18.5-24.0 → 6.4-9.6, 16 × 32 × 112² 14.4-17.5 → 10.9-12.6
SCRATCH = 1 << 19
CHANNEL_MAJOR_RUN = 1 << 16  # elements of a channel's planes laid end to end, at most (see _lanes)
# below these sizes im2col and a batched matmul cost less than the Python loop over kernel offsets
MIN_DEPTHWISE = 1 << 15  # output elements of a depthwise Conv
MIN_TRANSPOSED = 1 << 13  # output elements of a transposed depthwise Conv
MIN_WINDOW = 32  # kernel offsets of a few-outputs Conv (the dot products' length)
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))
MAX_CHANNEL_MAJOR_PLANE = 2048  # elements of a (phase) plane: larger planes go plane by plane (see _lanes)
# a 2-D depthwise Conv whose padded rows are narrow goes by banded GEMMs (_depthwise_rows): each output takes
# Wp / (kw · stride) times the products of the shifted adds, in BLAS. Narrow: at most kw + this many values a
# kernel column at stride 1 (2 cores, ms, banded / shifted adds: 3×3 16 × 192 × 16², Wp 18, 2.25 / 2.76, at
# 18² 4.08 / 3.65; 5×5 16 × 64 × 36² 5.97 / 9.77, at 40² 11.95 / 11.69; 7×7 8 × 64 × 64² 21.9 / 24.3)
ROWS_EXTRA_WIDTH_PER_TAP = 3
# ... and at stride 2, at most this many a kernel column and stride (its band is every other column; 3×3 16 ×
# 96 × 32², Wp 33, 0.72-0.96×, at 40² 1.34×; 5×5 16 × 48 × 56² 0.96×, at 72² 1.23×)
ROWS_MAX_WIDTH_PER_TAP = 6
# ... and has at least this many output elements (measured 1.5-3.5x faster than the shifted adds from 16 × 64
# × 32² by 3×3 and 7×7 down to 4 × 16 × 16²; smaller ones keep the shifted adds, which
# tests/engine/test_depthwise.py drives at small sizes)
MIN_BANDED = 1 << 15
# ... or this many with a kernel of at least WIDE_TAPS offsets (5×5, ConvNeXt's 7×7), where the banded GEMMs
# also beat im2col's batched matmul below MIN_DEPTHWISE (2 cores, ms, im2col → banded: 8 × 64 × 8² by 7×7
# 0.66 → 0.35, 2 × 64 × 8² 0.15 → 0.13, 8 × 32 × 8² by 5×5 0.15 → 0.11; 3×3 about even there)
MIN_BANDED_WIDE = 1 << 13
WIDE_TAPS = 25
# ... at strides up to this (1 core, ms, shifted adds → banded: 16 × 144 × 16² 2.8 → 1.3, 4 × 40 × 31² 0.57 →
# 0.31)
ROWS_MAX_STRIDE = 2
# a depthwise Conv with at most this many output elements a plane and this many channels goes channels
# innermost (_depthwise_channels_last): one einsum over runs of all the channels, where per-plane and
# per-channel calls cost more than their values (1 core, ms, banded GEMMs → channels last: 16 × 576 × 4²
# 0.96 → 0.51, 16 × 384 × 4² 0.61 → 0.33, 1 × 576 × 4² 0.085 → 0.058; about even at 8², slower above)
CHANNELS_LAST_MAX_PLANE = 16
CHANNELS_LAST_MIN_CHANNELS = 32
# a depthwise Conv's weight gradient (a few-outputs Conv of one image whose groups hold the batch's planes,
# stride and dilation 1) goes by row products (_rows_weight_grad) while its padded rows have at most this
# many values per output column: each product also makes Wp / kw times the sums needed (2 cores, ms,
# few outputs → rows: 8 × 64 × 8² by 7×7 0.82 → 0.28, 8 × 32 × 16² 7×7 0.88 → 0.40, 16 × 144 × 16² 3×3
# 1.42 → 1.24; 16 × 32 × 32² 3×3, 34 values a column of 3, 0.97 → 1.33 kept)
ROWS_GRAD_MAX_WIDTH_PER_TAP = 8
# ... and with at least this many kernel offsets (the output gradient's plane) whether it has few outputs or
# not (ms, im2col → rows: 16 × 576 × 4² by 3×3 2.28 → 0.84, 16 × 192 × 8² stride 2 0.88 → 0.40; over 2²
# planes, 4 offsets, 0.61 → 0.79 kept)
ROWS_GRAD_MIN_TAPS = 9


def _steps(sizes: Sequence[int]) -> list[int]:
    """C-order element steps of an array of ``sizes``."""
    return [int(np.prod(sizes[i + 1:])) for i in range(len(sizes))]


def _grid(sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every index of an array of ``sizes``, in C order."""
    return itertools.product(*(range(v) for v in sizes))


def _blocks(units: int, per_unit: int, work: int, fn: Callable[..., None],
            scratch: Callable[[int], Any] | None = None, block: int | None = None,
            gemms: bool = False) -> None:
    """``fn(lo, hi, buffer)`` over ranges of units of about ``block`` (by default :data:`BLOCK`) elements,
    split over the threads. ``buffer``: what ``scratch`` returns for a block's most units (None without
    it), made once per thread, here in the calling thread (the worker's own allocations measured slower:
    16 × 144 × 16² depthwise forward 2.2 ms against 1.6 on two threads). With ``gemms`` (``fn`` makes BLAS
    calls), OpenBLAS runs each call on the thread that makes it while there are several (where OpenBLAS
    split them over its own threads too, both stalled: 8 × 64 × 56² by 7×7 on banded GEMMs, 2 threads, 89 →
    15 ms)."""
    rows = max(1, (BLOCK if block is None else block) // max(per_unit, 1))
    parts = row_ranges(units, work)
    buffers = [scratch(min(rows, hi - lo)) if scratch else None for lo, hi in parts]

    def part(i: int) -> None:
        lo, hi = parts[i]
        for a in range(lo, hi, rows):
            fn(a, min(a + rows, hi), buffers[i])

    if gemms and len(parts) > 1 and can_pin_blas_threads():
        with single_threaded_blas():
            parallel_for(len(parts), part)
    else:
        parallel_for(len(parts), part)


def _cached(g: dict[str, Any], key: str, make: Callable[[], Any]) -> Any:
    """``g[key]``, made on first use (``g`` is the node's geometry for these shapes, kept by the kernel)."""
    value = g.get(key)
    if value is None:
        value = g[key] = make()
    return value


class _Phases:
    """An image of ``sizes`` per plane split by ``factor`` per axis into phases of ``sizes``/factor
    (rounded up), each phase a block of ``planes`` planes, laid out flat (``length`` values)."""

    def __init__(self, planes: int, sizes: Sequence[int], factor: Sequence[int]):
        self.factor = list(factor)
        self.sizes = [-(-v // f) for v, f in zip(sizes, factor, strict=True)]
        self.plane = int(np.prod(self.sizes))
        self.row = self.plane // self.sizes[0]  # a plane's rows laid end to end; runs may pass the end by one
        self.planes = planes
        self.steps = _steps(self.sizes)
        self.count = int(np.prod(factor))
        self.length = self.count * planes * self.plane

    def offset(self, coords: Sequence[int]) -> int:
        """Element offset, within a plane of phase 0, of the pixel at image ``coords``."""
        phase = [c % f for c, f in zip(coords, self.factor, strict=True)]
        index = int(np.ravel_multi_index(phase, self.factor)) if self.count > 1 else 0
        return index * self.planes * self.plane + sum(c // f * s for c, f, s in
                                                       zip(coords, self.factor, self.steps, strict=True))

    def blocks(self, buf: np.ndarray) -> np.ndarray:
        """``buf`` as (phase, plane, *phase sizes)."""
        shape = (self.count, self.planes) + tuple(self.sizes)
        return buf[:int(np.prod(shape))].reshape(shape)

    def split(self, x: np.ndarray, pads: Sequence[int], sizes: Sequence[int],
              channel_major: bool = False) -> np.ndarray:
        """X (N, C, *spatial) placed at ``pads`` in a zero image of ``sizes`` (cropped to fit), split; its
        planes in (C, N) order when ``channel_major``, else (N, C)."""
        buf = np.zeros(self.length, dtype=x.dtype)
        xs = x.swapaxes(0, 1) if channel_major else x
        blocks = self.blocks(buf).reshape((self.count,) + xs.shape[:2] + tuple(self.sizes))
        self.fill(blocks.swapaxes(0, 1), xs, pads, sizes)
        return buf

    def fill(self, dst: np.ndarray, xs: np.ndarray, pads: Sequence[int], sizes: Sequence[int]) -> None:
        """Write the planes ``xs`` (units, planes, *spatial), placed at ``pads`` in images of ``sizes``
        (cropped to fit), into the phases ``dst`` (units, phase, planes, *phase sizes); the padding is left
        as it is."""
        for index, phase in enumerate(_grid(self.factor)):
            src, at = [slice(None)] * 2, [slice(None)] * 2
            for r, f, p, size, have in zip(phase, self.factor, pads, sizes, xs.shape[2:], strict=True):
                lo = max(0, -(-(p - r) // f))  # first phase index whose pixel lies in X
                hi = -(-(p + min(have, size - p) - r) // f)
                if hi <= lo:
                    break
                start = r + f * lo - p
                src.append(slice(start, start + f * (hi - lo - 1) + 1, f))
                at.append(slice(lo, hi))
            else:
                dst[:, index][tuple(at)] = xs[tuple(src)]


def _shifted(planes: int, sizes: Sequence[int], stride: Sequence[int],
             g: dict[str, Any]) -> tuple[_Phases, list[int]]:
    """The phases of an image of ``sizes`` split by ``stride``, and the offset of each kernel position
    (dilated) in them."""
    split = _Phases(planes, sizes, stride)
    return split, [split.offset([i * d for i, d in zip(kk, g["dil"], strict=True)]) for kk in _grid(g["k"])]


# --------------------------------------------------------------------------------------------- Conv

def conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray | None:
    """A grouped Conv that has few outputs or is depthwise (``g``: Conv's geometry), if big enough to
    gain; else None (also for an empty X, which im2col takes)."""
    if x.size == 0:
        return None
    if _rows_grad_fit(g):
        return _finite_or_none(_rows_weight_grad(x, w, g))
    if _few_fit(g):
        return _finite_or_none(_few_outputs(x, w, g))
    if g["cg"] == 1 and _channels_last_fits(x, g):
        return _depthwise_channels_last(x, w, g)
    if g["cg"] == 1 and _rows_fit(g):
        return _finite_or_none(_depthwise_rows(x, w, g))
    if g["cg"] == 1 and x.shape[0] * g["m"] * g["L"] > MIN_DEPTHWISE:
        return _depthwise(x, w, g)
    return None


def banded_fits(x: np.ndarray, g: dict[str, Any]) -> bool:
    """True when :func:`conv` would take a depthwise Conv of ``x``, of geometry ``g``, by banded GEMMs (or,
    over tiny planes, channels last)."""
    return (x.dtype in FAST_DTYPES and g["cg"] == 1 and not _few_fit(g)
            and _rows_fit(g))


def _rows_fit(g: dict[str, Any]) -> bool:
    """True when a depthwise Conv of geometry ``g`` is for :func:`_depthwise_rows`: 2-D, stride 1 or 2,
    output rows narrow enough that its banded matrices stay mostly useful products."""
    if g["nd"] != 2 or max(g["strides"]) > ROWS_MAX_STRIDE or g["k"][1] < 2:
        return False
    kw, sw = g["k"][1], g["strides"][1]
    per_tap = kw + ROWS_EXTRA_WIDTH_PER_TAP if sw == 1 else ROWS_MAX_WIDTH_PER_TAP * sw
    return (g["sizes"][1] <= per_tap * kw
            and g["n"] * g["m"] * g["L"] >= (MIN_BANDED_WIDE if g["K"] >= WIDE_TAPS else MIN_BANDED))


def _channels_last_fits(x: np.ndarray, g: dict[str, Any]) -> bool:
    """True when a depthwise Conv of ``x``, of geometry ``g``, is for :func:`_depthwise_channels_last`:
    tiny output planes over many channels."""
    return (not _few_fit(g) and g["L"] <= CHANNELS_LAST_MAX_PLANE
            and x.shape[1] >= CHANNELS_LAST_MIN_CHANNELS and x.size > 0)


def _depthwise_channels_last(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """Depthwise Conv with the channels innermost: X padded as (N, *sizes, C), then one einsum of its
    windows (N, *out, *kernel, C), a strided view, with the weights (*kernel, C, mult): each output's taps
    summed in kernel order, every call walking runs of all the channels instead of one run per plane."""
    n, c = x.shape[:2]
    out, m, k, nd = g["out"], g["m"], g["k"], g["nd"]
    mult = m // c
    xp = np.zeros((n,) + tuple(g["sizes"]) + (c,), dtype=x.dtype)
    keep = [min(v, s - b) for v, s, b in zip(x.shape[2:], g["sizes"], g["pb"], strict=True)]
    xp[(slice(None),) + tuple(slice(b, b + v) for b, v in zip(g["pb"], keep, strict=True))] = \
        np.moveaxis(x[(Ellipsis,) + tuple(slice(0, v) for v in keep)], 1, -1)
    steps = xp.strides[1:-1]
    view_strides = (tuple(st * s for st, s in zip(steps, g["strides"], strict=True))
                    + tuple(st * d for st, d in zip(steps, g["dil"], strict=True)) + (xp.strides[-1],))
    # (*kernel, C, mult), contiguous: einsum's inner loop runs over C (strided C measured 4x slower)
    wk = np.ascontiguousarray(np.moveaxis(w.reshape((c, mult) + tuple(k)), (0, 1), (-2, -1)))
    o_ix, k_ix = "".join(chr(ord("a") + i) for i in range(nd)), "".join(chr(ord("p") + i) for i in range(nd))
    y = np.empty((n,) + tuple(out) + (c, mult), dtype=x.dtype)
    if mult == 1:
        wk, y2, spec = wk[..., 0], y[..., 0], f"n{o_ix}{k_ix}z,{k_ix}z->n{o_ix}z"
    else:
        y2, spec = y, f"n{o_ix}{k_ix}z,{k_ix}zj->n{o_ix}zj"
    per_image = int(np.prod(out)) * m

    def block(lo: int, hi: int, buffer: None) -> None:
        v = np.ndarray((hi - lo,) + tuple(out) + tuple(k) + (c,), x.dtype, xp, lo * xp.strides[0],
                       (xp.strides[0],) + view_strides)
        np.einsum(spec, v, wk, out=y2[lo:hi])

    _blocks(n, per_image, n * per_image * g["K"], block)
    y = y.reshape((n,) + tuple(out) + (m,))
    return np.ascontiguousarray(np.moveaxis(y, -1, 1))


def _banded(w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """The depthwise weights (M, 1, kh, kw) as (M, kh, Wp, Wout) banded matrices: band[m, i, t, b] =
    w[m, 0, i, j] where t = b·stride + j·dilation (a padded row's value t times it gives output column b)."""
    m, (kh, kw), wp, wo = w.shape[0], g["k"], g["sizes"][1], g["out"][1]
    sw = g["strides"][1]
    band = np.zeros((m, kh, wp, wo), dtype=w.dtype)
    it = band.itemsize
    diagonal = np.ndarray((m, kh, kw, wo), w.dtype, band, 0,
                          (kh * wp * wo * it, wp * wo * it, g["dil"][1] * wo * it, (sw * wo + 1) * it))
    diagonal[...] = w.reshape(m, kh, kw)[..., None]
    return band


def _depthwise_rows(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """2-D depthwise Conv as, per kernel row, one GEMM per channel: the channel's padded rows (all its
    images end to end, every stride-th row from the kernel row on) times a banded (Wp, Wout) matrix of that
    kernel row's taps, summed over the kernel rows; the rows past each image's last output row are junk,
    cropped."""
    n, c = x.shape[:2]
    (hp, wp), (ho, wo), m = g["sizes"], g["out"], g["m"]
    mult, kh, dh, sh = m // c, g["k"][0], g["dil"][0], g["strides"][0]
    hq = -(-hp // sh) * sh  # an image's padded rows, a whole number of strides
    rows, per = n * hq, n * hq // sh  # padded rows of a channel; output rows (junk ones too)
    buf = np.zeros((c, rows + (kh - 1) * dh, wp), dtype=x.dtype)  # zero rows after: the last shifts' slack
    keep = [min(v, s - b) for v, s, b in zip(x.shape[2:], g["sizes"], g["pb"], strict=True)]
    planes = buf[:, :rows].reshape(c, n, hq, wp)
    planes[:, :, g["pb"][0]:g["pb"][0] + keep[0], g["pb"][1]:g["pb"][1] + keep[1]] = \
        x[:, :, :keep[0], :keep[1]].swapaxes(0, 1)
    band = _banded(w, g).reshape(c, mult, kh, wp, wo)
    y = np.empty((c, mult, per, wo), dtype=x.dtype)

    def block(lo: int, hi: int, products: np.ndarray) -> None:
        tmp = products[:hi - lo]
        for j in range(mult):
            yb = y[lo:hi, j]
            for i in range(kh):
                a = buf[lo:hi, i * dh:i * dh + rows:sh]
                if i == 0:
                    np.matmul(a, band[lo:hi, j, i], out=yb)
                else:
                    np.matmul(a, band[lo:hi, j, i], out=tmp)
                    yb += tmp

    _blocks(c, mult * per * wo, c * mult * per * wo * kh * wp, block,
            lambda most: np.empty((most, per, wo), dtype=x.dtype), gemms=True)
    y = y.reshape(c, mult, n, hq // sh, wo)[:, :, :, :ho]
    return np.ascontiguousarray(y.transpose(2, 0, 1, 3, 4)).reshape(n, m, ho, wo)


def _lanes(n: int, c: int, plane: int) -> tuple[bool, int, int]:
    """How the planes of a depthwise kernel's ``c`` channels are laid out and walked: (channel-major, units,
    planes per unit). Channel-major ((C, N) order) makes each channel's ``n`` planes one contiguous run
    under one weight: one ufunc call per channel and kernel offset instead of one per plane, which costs
    more than a small plane's values (144 channels × 16 images at 16²: 3.1 → 2.0 ms). Large planes stay
    plane by plane in (N, C) order: there the calls are few, and the split and crop copies in (C, N) order
    cost more (16 × 96 × 112², stride 2: 15.1 → 20.5 ms for the split)."""
    if n > 1 and plane <= MAX_CHANNEL_MAJOR_PLANE and n * plane <= CHANNEL_MAJOR_RUN:
        return True, c, n
    return False, n * c, 1


def _unit_weights(w: np.ndarray, n: int, c: int, per: int, channel_major: bool) -> np.ndarray:
    """The weights (C·per, 1, K…) of ``c`` channels or groups as (unit, per, K) for the layout of
    :func:`_lanes`: a unit's own when channel-major, else copied out to each of the ``n`` images' planes."""
    wc = w.reshape(c, per, -1)
    if channel_major:
        return wc
    return np.ascontiguousarray(np.broadcast_to(wc, (n,) + wc.shape)).reshape(n * c, per, -1)


def _depthwise(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """y[p, j, o] = Σ_κ w[c(p)·mult + j, 0, κ] · xpad[p, o·s + κ·d]: per kernel offset one product with
    one weight per plane over the run of its phase, added up in kernel order. Each thread splits a block of
    units at a time into phases of its own, sums them there and writes the block's outputs cropped, so the
    padded, split input and the junk columns never leave the cache."""
    n, c = x.shape[:2]
    out, m, K = g["out"], g["m"], g["K"]
    mult, it = m // c, x.itemsize
    plane = _Phases(1, g["sizes"], g["strides"]).plane
    channel_major, units, per_unit = _lanes(n, c, plane)
    split, offsets = _cached(g, f"shifted{per_unit}", lambda: _shifted(per_unit, g["sizes"], g["strides"], g))
    # a channel's planes whole, one contiguous run (the rows past out[0] junk); a lone plane only to out[0],
    # which measured faster for large planes (16 × 144 × 56²: 22.5 against 30.8 ms for whole planes)
    length = per_unit * plane if channel_major else out[0] * split.row
    rows = split.sizes[0] if channel_major else out[0]
    unit = split.length  # a unit's phases; a plane of zeros after a block's: the runs' slack
    wu = _unit_weights(w, n, c, mult, channel_major)
    xs = x.swapaxes(0, 1) if channel_major else x.reshape((n * c, 1) + x.shape[2:])
    y = np.empty((n, c, mult) + tuple(out), dtype=x.dtype)
    ys = y.transpose((1, 2, 0) + tuple(range(3, y.ndim))) if channel_major else y.reshape(
        (n * c, mult, 1) + tuple(out))
    crop = (Ellipsis,) + tuple(slice(0, o) for o in out)

    def scratch(most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.zeros(most * unit + plane, dtype=x.dtype), np.empty((most, mult, length), dtype=x.dtype),
                np.empty((most, mult, length), dtype=x.dtype))

    def block(lo: int, hi: int, buffers: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        phases, sums, tmp = buffers
        count = hi - lo
        split.fill(phases[:count * unit].reshape((count, split.count, per_unit) + tuple(split.sizes)),
                   xs[lo:hi], g["pb"], g["sizes"])
        yb, t = sums[:count], tmp[:count]
        for j, off in enumerate(offsets):
            v = np.ndarray((count, 1, length), x.dtype, phases, off * it, (unit * it, 0, it))
            wj = wu[lo:hi, :, j, None]
            if j == 0:
                np.multiply(v, wj, out=yb)
            else:
                np.multiply(v, wj, out=t)
                yb += t
        ys[lo:hi] = yb.reshape((count, mult, per_unit, rows) + tuple(split.sizes[1:]))[crop]

    _blocks(units, unit + 2 * mult * length, units * mult * length * K, block, scratch, SCRATCH)
    return y.reshape((n, m) + tuple(out))


def _rows_grad_fit(g: dict[str, Any]) -> bool:
    """True when a grouped Conv of geometry ``g`` is for :func:`_rows_weight_grad`: one image, 2-D, stride 1
    (dilated or not: the Conv's own stride), one output channel and several planes a group, enough kernel
    offsets, padded rows narrow enough for its products."""
    return (g["n"] == 1 and g["nd"] == 2 and g["m"] == g["group"] and g["cg"] > 1
            and g["strides"] == [1, 1] and g["K"] >= ROWS_GRAD_MIN_TAPS
            and g["sizes"][1] <= ROWS_GRAD_MAX_WIDTH_PER_TAP * g["out"][1])


def _few_fit(g: dict[str, Any]) -> bool:
    """True when a grouped Conv of geometry ``g`` is for :func:`_few_outputs`."""
    return g["L"] < g["K"] and g["K"] >= MIN_WINDOW


def weight_grad_planes(xs: np.ndarray, wv: np.ndarray, g: dict[str, Any]) -> np.ndarray | None:
    """A grouped Conv of one image, given as its groups' planes ``xs`` (group, cg, *spatial) and weights
    ``wv`` (group, M/group, cg, *kernel), views in any layout, of geometry ``g``: (M, *out) by row products
    or few-outputs dot products where one fits, else None. A depthwise weight gradient hands the batch's X
    and dY here as they are (engine/fusion/grouped_weight_grad.py), without the copies that lay them out as
    that one image."""
    if xs.dtype not in FAST_DTYPES or xs.size == 0 or wv.size == 0:
        return None
    if _rows_grad_fit(g):
        return _finite_or_none(_rows_weight_grad_planes(xs, wv, g))
    if _few_fit(g):
        return _finite_or_none(_few_outputs_planes(xs, wv, g))
    return None


def _finite_or_none(y: np.ndarray) -> np.ndarray | None:
    """``y`` if all its values are finite, else None. The banded rows, the few-outputs dot products and the
    rows weight gradient multiply X by zero taps outside each output's window, so that an inf or NaN in X
    turns outputs far from it into NaN (inf · 0); the caller's im2col then computes such an X."""
    return y if all_finite(y) else None


def _rows_weight_grad(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """:func:`_rows_weight_grad_planes` of a one-image Conv's X and W."""
    group, cg = g["group"], g["cg"]
    y = _rows_weight_grad_planes(x[0].reshape((group, cg) + x.shape[2:]), w.reshape((group, 1) + w.shape[1:]),
                                 g)
    return y.reshape((1,) + y.shape)


def _rows_weight_grad_planes(xs: np.ndarray, wv: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """y[0, c, i, j] = Σ_{q, a, b} w[c, q, a, b] · xpad[0, c·cg + q, a·d + i, b·e + j] (a depthwise weight
    gradient: x the batch's planes of channel c, w their output gradients, (d, e) the dilations, which are
    the Conv's strides) by row products: for each output row i, per group, every d-th padded row from i of
    every plane (a (Wp, cg·Hq/d) view, the rows past each plane's last window meeting zero rows of w) times
    w's rows (cg·Hq/d, kw): P[t, b] = Σ_a x[a·d + i, t]·w[a, b], of which y[i, j] = Σ_b P[b·e + j, b] sums
    a diagonal. ``xs``: the groups' planes (group, cg, *spatial), ``wv`` their weights (group, 1, cg, kh, kw);
    returns (group, oh, ow)."""
    group, cg, (kh, kw), (dh, dw) = g["group"], g["cg"], g["k"], g["dil"]
    (hp, wp), (oh, ow), pb = g["sizes"], g["out"], g["pb"]
    hq = -(-hp // dh) * dh  # a plane's padded rows, a whole number of dilations
    rows = cg * hq
    dtype = xs.dtype
    buf = np.zeros((group, rows + oh, wp), dtype=dtype)  # zero rows after: the last offsets' slack
    keep = [min(v, s - b) for v, s, b in zip(xs.shape[2:], g["sizes"], pb, strict=True)]
    buf[:, :rows].reshape(group, cg, hq, wp)[:, :, pb[0]:pb[0] + keep[0], pb[1]:pb[1] + keep[1]] = \
        xs[:, :, :keep[0], :keep[1]]
    wr = np.zeros((group, cg, hq // dh, kw), dtype=dtype)
    wr[:, :, :kh] = wv[:, 0]
    wr = wr.reshape(group, rows // dh, kw)
    prods = np.empty((group, oh, wp, kw), dtype=dtype)

    def block(lo: int, hi: int, buffer: None) -> None:
        for i in range(oh):
            np.matmul(buf[lo:hi, i:i + rows:dh].transpose(0, 2, 1), wr[lo:hi], out=prods[lo:hi, i])

    _blocks(group, oh * wp * kw, group * oh * wp * kw * rows // dh, block, gemms=True)
    it = prods.itemsize
    diagonals = np.ndarray((group, oh, ow, kw), dtype, prods, 0,
                           prods.strides[:2] + (kw * it, (dw * kw + 1) * it))
    return diagonals.sum(axis=-1)


def _few_outputs(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """y[i, m, o] = Σ_{c, κ} w[m, c, κ] · xpad[i, g(m)·cg + c, o·s + κ·d]: the image split by the
    dilation so that a window's taps are dense, then per output position and group one product of the
    taps, laid on the grid of the group's planes, with the run of their windows in every image."""
    n, c = x.shape[:2]
    group, cg, m = g["group"], g["cg"], g["m"]
    wv = w.reshape((group, m // group) + w.shape[1:])
    if n == 1:
        y = _few_outputs_planes(x[0].reshape((group, cg) + x.shape[2:]), wv, g)
        return y.reshape((1,) + y.shape)
    split, positions = _cached(g, "few_outputs", lambda: _few_outputs_plan(n * c, g))
    taps, length = _few_outputs_taps(wv, split, g)
    # per position one product of each group's taps with its windows in every image, side by side (the
    # images' windows are columns c·plane apart): a GEMM over the images, not one matrix-vector product
    # each; OpenBLAS threads them itself (two of them at once on the engine's threads stall each other:
    # SqueezeBERT's grouped 1×1 weight gradient, 0.3 ms alone, 16-25 ms in a step when split)
    dots = np.empty((len(positions), group, m // group, n), dtype=x.dtype)
    buf = split.split(x, g["pb"], g["sizes"])
    it = x.itemsize
    step = cg * split.plane * it
    for p, off in enumerate(positions):
        v = np.ndarray((group, length, n), x.dtype, buf, off * it, (step, it, c * split.plane * it))
        np.matmul(taps, v, out=dots[p])
    return np.ascontiguousarray(dots.transpose(3, 1, 2, 0)).reshape((n, m) + tuple(g["out"]))


def _few_outputs_plan(planes: int, g: dict[str, Any]) -> tuple[_Phases, list[int]]:
    """The phases (by the dilation) of ``planes`` padded planes, and each output position's offset in
    them."""
    split, strides = _Phases(planes, g["sizes"], g["dil"]), g["strides"]
    return split, [split.offset([i * s for i, s in zip(o, strides, strict=True)]) for o in _grid(g["out"])]


def _few_outputs_taps(wv: np.ndarray, split: _Phases, g: dict[str, Any]) -> tuple[np.ndarray, int]:
    """The weights ``wv`` (group, mg, cg, *kernel) laid on the grid of a group's cg phase planes end to end
    (group, mg, length), and that length: a group's planes lie one after the other, so each group and
    position takes one dot product over all of them (zero taps between the planes' windows), not one per
    plane (a depthwise weight gradient, the 16 images as each group's planes: 192 channels at 8² 0.91 →
    0.71 ms, 32 at 112² 17.1 → 14.8 ms)."""
    group, mg, cg = wv.shape[:3]
    k, plane, it = g["k"], split.plane, wv.itemsize
    run = sum((kk - 1) * s for kk, s in zip(k, split.steps, strict=True)) + 1
    length = (cg - 1) * plane + run
    taps = np.zeros((group, mg, cg * plane), dtype=wv.dtype)
    on_grid = np.ndarray((group, mg, cg, *k), wv.dtype, taps, 0,
                         taps.strides[:2] + (plane * it,) + tuple(s * it for s in split.steps))
    on_grid[...] = wv
    return taps[:, :, :length], length


def _few_outputs_planes(xs: np.ndarray, wv: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """:func:`_few_outputs` of one image given as its groups' planes ``xs`` (group, cg, *spatial) and weights
    ``wv`` (group, mg, cg, *kernel): (M, *out) by matrix-vector products, each thread splitting a block of
    groups at a time into phases of its own, laid out group by group."""
    group, cg, mg, dtype = g["group"], g["cg"], wv.shape[1], xs.dtype
    split, positions = _cached(g, "few_outputs_planes", lambda: _few_outputs_plan(cg, g))
    taps, length = _few_outputs_taps(wv, split, g)
    dots = np.empty((len(positions), group, mg, 1), dtype=dtype)
    unit, it = split.length, xs.itemsize  # a group's phases

    def scratch(most: int) -> np.ndarray:
        return np.zeros((most, split.count, cg) + tuple(split.sizes), dtype=dtype)

    def block(lo: int, hi: int, phases: np.ndarray) -> None:
        split.fill(phases[:hi - lo], xs[lo:hi], g["pb"], g["sizes"])
        for p, off in enumerate(positions):
            v = np.ndarray((hi - lo, length, 1), dtype, phases, off * it, (unit * it, it, it))
            np.matmul(taps[lo:hi], v, out=dots[p, lo:hi])

    _blocks(group, unit, group * length * mg * len(positions), block, scratch, SCRATCH, gemms=True)
    return np.ascontiguousarray(dots[..., 0].transpose(1, 2, 0)).reshape((group * mg,) + tuple(g["out"]))


# ------------------------------------------------------------------------------------ ConvTranspose

def conv_transpose(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray | None:
    """ConvTranspose with one output channel per group (``g``: its geometry, ``g["depthwise"]`` true), if
    big enough to gain (else None):
    canvas[p, o·s + κ·d] += Σ_j w[g(p)·cg + j, 0, κ] · x[image(p), g(p)·cg + j, o] on the canvas split
    by the stride, each kernel offset one contiguous add per input channel and plane. Each thread lays out a
    block of units' inputs and canvases at a time in buffers of its own and writes the block's outputs from
    its canvas's phases."""
    n, cin = x.shape[:2]
    out, full, s, group = g["out"], g["full"], g["strides"], g["group"]
    if n * group * int(np.prod(out)) < MIN_TRANSPOSED or x.size == 0:
        return None
    in_sp, cg, K = x.shape[2:], cin // group, g["K"]
    it = x.itemsize
    plane = _Phases(1, full, s).plane
    channel_major, units, per_unit = _lanes(n, group, plane)
    split, offsets = _cached(g, f"shifted{per_unit}", lambda: _shifted(per_unit, full, s, g))
    # X laid out as the canvas's planes, its rows padded to the phase width and its planes to the phase's
    # height: input pixel o sits at o's offset in a phase's plane, and a unit's planes are one run
    xv = x.reshape((n, group, cg) + tuple(in_sp))
    xv = xv.transpose((1, 2, 0) + tuple(range(3, xv.ndim))) if channel_major else xv.reshape(
        (n * group, cg, 1) + tuple(in_sp))
    length = per_unit * plane
    unit = split.length  # a unit's canvas, its phases; a plane after a block's: the runs' slack
    wu = _unit_weights(w, n, group, cg, channel_major)
    y = np.empty((n, group) + tuple(out), dtype=x.dtype)
    yv = y.swapaxes(0, 1) if channel_major else y.reshape((n * group, 1) + tuple(out))
    # each output pixel j is canvas pixel pads + j, in the phase (pads + j) mod s
    merges = []
    for index, phase in enumerate(_grid(s)):
        dst, src = [slice(None)] * 2, [slice(None)] * 2
        for r, f, p, size in zip(phase, s, g["pb"], out, strict=True):
            first = (r - p) % f  # first output index in this phase
            if first >= size:
                break
            at = (p + first - r) // f
            dst.append(slice(first, size, f))
            src.append(slice(at, at + len(range(first, size, f))))
        else:
            merges.append((index, tuple(dst), tuple(src)))
    inside = (Ellipsis,) + tuple(slice(0, v) for v in in_sp)

    def scratch(most: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        return (np.zeros((most, cg, per_unit) + tuple(split.sizes), dtype=x.dtype),
                np.empty(most * unit + plane, dtype=x.dtype), np.empty((most, length), dtype=x.dtype))

    def block(lo: int, hi: int, buffers: tuple[np.ndarray, np.ndarray, np.ndarray]) -> None:
        xs, canvas, tmp = buffers
        count = hi - lo
        xs[:count][inside] = xv[lo:hi]
        xf = xs[:count].reshape(count, cg, length)
        canvas[:count * unit + plane] = 0
        t = tmp[:count]
        for j, off in enumerate(offsets):
            v = np.ndarray((count, length), x.dtype, canvas, off * it, (unit * it, it))
            for q in range(cg):
                np.multiply(xf[:, q], wu[lo:hi, q, j, None], out=t)
                v += t
        phases = canvas[:count * unit].reshape((count, split.count, per_unit) + tuple(split.sizes))
        for index, dst, src in merges:
            yv[lo:hi][dst] = phases[:, index][src]

    _blocks(units, cg * length + unit + length, units * length * cg * K, block, scratch, SCRATCH)
    return y.reshape((n, g["m"]) + tuple(out))
