"""Grouped convolutions whose groups are too small or too lopsided for im2col + one batched matmul.

Conv's kernel (engine/kernels/conv.py) hands three shapes here:

- **depthwise** (each group reads one input channel): the output is a sum over kernel offsets of the
  input shifted by that offset times one weight per plane, K multiply-adds on strided views of the padded
  input instead of an im2col copy K times its size and thousands of 1-row matmuls;
- **the transposed depthwise** (ConvTranspose with one output channel per group, the input gradient of a
  depthwise Conv): the same shifted adds, into a canvas;
- **few outputs** (fewer output positions than kernel offsets: the weight gradient of a grouped Conv,
  whose "kernel" is the output gradient): one contraction per output position over a window view,
  instead of an im2col copy as many times the input as there are output positions.

Each works on blocks of planes (image × channel) that stay in cache across the kernel offsets, split over
the run's threads by planes; every output element is summed in the same order whatever the split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import numpy as np

from onnxtrain.engine.parallel import for_rows

BLOCK = 1 << 16  # output elements of a block of planes: its operands stay in a core's cache
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _blocks(planes: int, per_plane: int, work: int, fn: Callable[[int, int], None]) -> None:
    """``fn(lo, hi)`` over ranges of planes of about :data:`BLOCK` elements, split over the threads."""
    rows = max(1, BLOCK // max(per_plane, 1))

    def part(lo: int, hi: int) -> None:
        for a in range(lo, hi, rows):
            fn(a, min(a + rows, hi))

    for_rows(planes, work, part)


def _offsets(k: list[int], steps: list[int]) -> list[int]:
    """Element offset of each kernel position (C order) for per-axis element steps."""
    return [sum(i * s for i, s in zip(kk, steps, strict=True)) for kk in itertools.product(*map(range, k))]


def depthwise_conv(buf: np.ndarray, w: np.ndarray, n: int, c: int, plane: int, rest: tuple[int, ...],
                   rest_steps: tuple[int, ...], k_steps: list[int], k: list[int]) -> np.ndarray:
    """y[p, j, r] = Σ_κ w[c(p)·mult + j, 0, κ] · buf[p·plane + off(κ) + r·rest_steps], p = (image, channel).

    ``buf`` is the flat padded input (``plane`` elements per plane, readable past the last plane as the
    views need); returns (n·c, mult, *rest)."""
    offsets = _offsets(k, k_steps)
    planes, K = n * c, len(offsets)
    mult = w.shape[0] // c
    wp = np.ascontiguousarray(np.broadcast_to(w.reshape(1, c, mult, K), (n, c, mult, K)))
    wp = wp.reshape(planes, mult, K)
    it = buf.itemsize
    y = np.empty((planes, mult) + rest, dtype=buf.dtype)
    per_plane = mult * int(np.prod(rest))
    ones = (1,) * len(rest)
    v_strides = (plane * it, 0) + tuple(s * it for s in rest_steps)

    def block(lo: int, hi: int) -> None:
        yb = y[lo:hi]
        tmp = np.empty_like(yb)
        for j, off in enumerate(offsets):
            v = np.ndarray((hi - lo, 1) + rest, buf.dtype, buf, (lo * plane + off) * it, v_strides)
            wj = wp[lo:hi, :, j].reshape((hi - lo, mult) + ones)
            if j == 0:
                np.multiply(v, wj, out=yb)
            else:
                np.multiply(v, wj, out=tmp)
                yb += tmp

    _blocks(planes, per_plane, planes * per_plane * K, block)
    return y


def depthwise_conv_transpose(x: np.ndarray, w: np.ndarray, group: int, canvas_shape: tuple[int, ...],
                             x_steps: tuple[int, ...], k_steps: list[int], k: list[int],
                             tail: int) -> np.ndarray:
    """canvas[p, off(κ) + r·x_steps] += Σ_j w[g(p)·cg + j, 0, κ] · x[image(p), g(p)·cg + j, r] for the
    ConvTranspose with one output channel per group; returns the flat canvas (n·group, prod + tail)."""
    n, cin = x.shape[:2]
    cg, planes, K = cin // group, n * group, int(np.prod(k))
    rest = x.shape[2:]
    xs = x.reshape((planes, cg) + rest)
    wp = np.ascontiguousarray(np.broadcast_to(w.reshape(1, group, cg, K), (n, group, cg, K)))
    wp = wp.reshape(planes, cg, K)
    offsets = _offsets(k, k_steps)
    plane = int(np.prod(canvas_shape)) + tail
    canvas = np.zeros((planes, plane), dtype=x.dtype)
    it = x.itemsize
    ones = (1,) * len(rest)
    v_strides = (plane * it,) + tuple(s * it for s in x_steps)
    per_plane = int(np.prod(rest))

    def block(lo: int, hi: int) -> None:
        tmp = np.empty((hi - lo,) + rest, dtype=x.dtype)
        base = canvas[lo:hi]
        for j, off in enumerate(offsets):
            v = np.ndarray((hi - lo,) + rest, x.dtype, base, off * it, v_strides)
            for q in range(cg):
                np.multiply(xs[lo:hi, q], wp[lo:hi, q, j].reshape((hi - lo,) + ones), out=tmp)
                v += tmp

    _blocks(planes, per_plane * cg, planes * per_plane * cg * K, block)
    return canvas


def few_outputs_conv(buf: np.ndarray, w: np.ndarray, n: int, group: int, cg: int, plane: int,
                     out_steps: list[int], out: list[int], k_steps: list[int], k: list[int]) -> np.ndarray:
    """y[i, m, o] = Σ_{c, κ} w[m, c, κ] · buf[(i, g(m)·cg + c) plane + off(o) + off(κ)]: per input plane
    and output position one dot product of the plane's window with the taps laid on the plane's grid
    (one contiguous run), summed over each group's planes; returns (n, m, prod(out))."""
    m = w.shape[0]
    mg, rows, it = m // group, group * cg, buf.itemsize
    run = sum((kk - 1) * s for kk, s in zip(k, k_steps, strict=True)) + 1
    taps = np.zeros((rows, mg, run), dtype=buf.dtype)  # row = (group, channel in group)
    grid = np.ndarray((rows, mg, *k), buf.dtype, taps, 0, taps.strides[:2] + tuple(s * it for s in k_steps))
    grid[...] = w.reshape((group, mg, cg, *k)).swapaxes(1, 2).reshape(rows, mg, *k)
    positions = _offsets(out, out_steps)
    dots = np.empty((n, rows, len(positions), mg, 1), dtype=buf.dtype)

    def block(lo: int, hi: int) -> None:
        for i in range(n):
            for p, off in enumerate(positions):
                v = np.ndarray((hi - lo, run, 1), buf.dtype, buf, ((i * rows + lo) * plane + off) * it,
                               (plane * it, it, it))
                np.matmul(taps[lo:hi], v, out=dots[i, lo:hi, p])

    _blocks(rows, run * (1 + mg), n * rows * run * mg * len(positions), block)
    y = dots.reshape(n, group, cg, len(positions), mg).sum(axis=2)
    return y.transpose(0, 1, 3, 2).reshape(n, m, len(positions))
