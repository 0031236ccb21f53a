"""Grouped convolutions whose groups are too small or too lopsided for im2col + one batched matmul.

Conv's and ConvTranspose's kernels (engine/kernels/conv.py) hand three shapes here:

- **depthwise** (each group reads one input channel): the output is a sum over kernel offsets of the
  input shifted by that offset times one weight per plane, K multiply-adds on views of the padded input
  instead of an im2col copy K times its size and thousands of one-row matmuls;
- **transposed depthwise** (ConvTranspose with one output channel per group, the input gradient of a
  depthwise Conv): the same shifted adds, into a canvas;
- **few outputs** (a grouped Conv with fewer output positions than kernel offsets: the weight gradient of
  a grouped Conv, whose "kernel" is the output gradient): per plane and output position one dot product
  of the plane's window with the taps, instead of an im2col copy as many times the input as there are
  output positions.

Strided access becomes unit-stride by splitting the padded image into phases (the pixels whose
coordinates are equal modulo the stride, or the dilation for few outputs), and the rows of a plane are
laid end to end, so each kernel offset reads or writes one contiguous run per plane; columns that run
past a row's end are junk, cropped at the end. Planes (image × channel) go in blocks that stay in cache
across the kernel offsets, split over the run's threads by planes: every output element is summed in the
same order whatever the split.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import numpy as np

from onnxtrain.engine.parallel import for_rows

BLOCK = 1 << 16  # output elements of a block of planes: its operands stay in a core's cache
# below these sizes im2col and a batched matmul cost less than the Python loop over kernel offsets
MIN_DEPTHWISE = 1 << 15  # output elements of a depthwise Conv
MIN_TRANSPOSED = 1 << 13  # output elements of a transposed depthwise Conv
MIN_WINDOW = 32  # kernel offsets of a few-outputs Conv (the dot products' length)
FAST_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def _steps(sizes: Sequence[int]) -> list[int]:
    """C-order element steps of an array of ``sizes``."""
    return [int(np.prod(sizes[i + 1:])) for i in range(len(sizes))]


def _grid(sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every index of an array of ``sizes``, in C order."""
    return itertools.product(*(range(v) for v in sizes))


def _blocks(planes: int, per_plane: int, work: int, fn: Callable[[int, int], None]) -> None:
    """``fn(lo, hi)`` over ranges of planes of about :data:`BLOCK` elements, split over the threads."""
    rows = max(1, BLOCK // max(per_plane, 1))

    def part(lo: int, hi: int) -> None:
        for a in range(lo, hi, rows):
            fn(a, min(a + rows, hi))

    for_rows(planes, work, part)


def _cached(g: dict[str, Any], key: str, make: Callable[[], Any]) -> Any:
    """``g[key]``, made on first use (``g`` is the node's geometry for these shapes, kept by the kernel)."""
    value = g.get(key)
    if value is None:
        value = g[key] = make()
    return value


class _Phases:
    """An image of ``sizes`` per plane split by ``factor`` per axis into phases of ``sizes``/factor
    (rounded up), each phase a block of ``planes`` planes, laid out flat (with a row of zeros after when
    ``tail_row``)."""

    def __init__(self, planes: int, sizes: Sequence[int], factor: Sequence[int], tail_row: bool = False):
        self.factor = list(factor)
        self.sizes = [-(-v // f) for v, f in zip(sizes, factor, strict=True)]
        self.plane = int(np.prod(self.sizes))
        self.row = self.plane // self.sizes[0]  # a plane's rows laid end to end; runs may pass the end by one
        self.planes = planes
        self.steps = _steps(self.sizes)
        self.count = int(np.prod(factor))
        self.length = self.count * planes * self.plane + (self.row if tail_row else 0)

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

    def split(self, x: np.ndarray, pads: Sequence[int], sizes: Sequence[int]) -> np.ndarray:
        """X (N, C, *spatial) placed at ``pads`` in a zero image of ``sizes`` (cropped to fit), split."""
        buf = np.zeros(self.length, dtype=x.dtype)
        blocks = self.blocks(buf)
        xs = x.reshape((self.planes,) + x.shape[2:])
        for index, phase in enumerate(_grid(self.factor)):
            src, dst = [slice(None)], [slice(None)]
            for r, f, p, size, have in zip(phase, self.factor, pads, sizes, x.shape[2:], strict=True):
                lo = max(0, -(-(p - r) // f))  # first phase index whose pixel lies in X
                hi = -(-(p + min(have, size - p) - r) // f)
                if hi <= lo:
                    break
                start = r + f * lo - p
                src.append(slice(start, start + f * (hi - lo - 1) + 1, f))
                dst.append(slice(lo, hi))
            else:
                blocks[index][tuple(dst)] = xs[tuple(src)]
        return buf


def _shifted(planes: int, sizes: Sequence[int], stride: Sequence[int],
             g: dict[str, Any]) -> tuple[_Phases, list[int]]:
    """The phases of an image of ``sizes`` split by ``stride`` (a row of slack after them), and the offset
    of each kernel position (dilated) in them."""
    split = _Phases(planes, sizes, stride, tail_row=True)
    return split, [split.offset([i * d for i, d in zip(kk, g["dil"], strict=True)]) for kk in _grid(g["k"])]


# --------------------------------------------------------------------------------------------- Conv

def conv(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray | None:
    """A grouped Conv that has few outputs or is depthwise (``g``: Conv's geometry), if big enough to
    gain; else None."""
    if g["L"] < g["K"] and g["K"] >= MIN_WINDOW:
        return _few_outputs(x, w, g)
    if g["cg"] == 1 and x.shape[0] * g["m"] * g["L"] > MIN_DEPTHWISE:
        return _depthwise(x, w, g)
    return None


def _depthwise(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """y[p, j, o] = Σ_κ w[c(p)·mult + j, 0, κ] · xpad[p, o·s + κ·d]: per kernel offset one product with
    one weight per plane over the run of its phase, added up in kernel order."""
    n, c = x.shape[:2]
    out, m, K = g["out"], g["m"], g["K"]
    mult, planes = m // c, n * c
    split, offsets = _cached(g, "shifted", lambda: _shifted(planes, g["sizes"], g["strides"], g))
    buf = split.split(x, g["pb"], g["sizes"])
    row = split.row
    run = out[0] * row
    wp = np.ascontiguousarray(np.broadcast_to(w.reshape(1, c, mult, K), (n, c, mult, K)))
    wp = wp.reshape(planes, mult, K)
    y = np.empty((planes, mult, run), dtype=x.dtype)
    it, plane = x.itemsize, split.plane

    def block(lo: int, hi: int) -> None:
        yb = y[lo:hi]
        tmp = np.empty_like(yb)
        for j, off in enumerate(offsets):
            v = np.ndarray((hi - lo, 1, run), x.dtype, buf, (lo * plane + off) * it, (plane * it, 0, it))
            wj = wp[lo:hi, :, j, None]
            if j == 0:
                np.multiply(v, wj, out=yb)
            else:
                np.multiply(v, wj, out=tmp)
                yb += tmp

    _blocks(planes, mult * run, planes * mult * run * K, block)
    y = y.reshape((n, m, out[0]) + tuple(split.sizes[1:]))
    return np.ascontiguousarray(y[(Ellipsis,) + tuple(slice(0, o) for o in out[1:])])


def _few_outputs(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray:
    """y[i, m, o] = Σ_{c, κ} w[m, c, κ] · xpad[i, g(m)·cg + c, o·s + κ·d]: the image split by the
    dilation so that a window's taps are dense, then per plane and output position one dot product of the
    taps, laid on the phase's grid, with the run of the window."""
    n, c = x.shape[:2]
    k, out, m, group, cg = g["k"], g["out"], g["m"], g["group"], g["cg"]
    mg, it = m // group, x.itemsize

    def plan() -> tuple[_Phases, list[int]]:
        split = _Phases(n * c, g["sizes"], g["dil"])
        strides = g["strides"]
        return split, [split.offset([i * s for i, s in zip(o, strides, strict=True)]) for o in _grid(out)]

    split, positions = _cached(g, "few_outputs", plan)
    buf = split.split(x, g["pb"], g["sizes"])
    run = sum((kk - 1) * s for kk, s in zip(k, split.steps, strict=True)) + 1
    taps = np.zeros((c, mg, run), dtype=x.dtype)  # row = (group, channel in group)
    on_grid = np.ndarray((c, mg, *k), x.dtype, taps, 0, taps.strides[:2] + tuple(s * it for s in split.steps))
    on_grid[...] = w.reshape((group, mg, cg, *k)).swapaxes(1, 2).reshape(c, mg, *k)
    dots = np.empty((n, c, len(positions), mg, 1), dtype=x.dtype)
    plane = split.plane

    def block(lo: int, hi: int) -> None:
        for i in range(n):
            for p, off in enumerate(positions):
                v = np.ndarray((hi - lo, run, 1), x.dtype, buf, ((i * c + lo) * plane + off) * it,
                               (plane * it, it, it))
                np.matmul(taps[lo:hi], v, out=dots[i, lo:hi, p])

    _blocks(c, run * (1 + mg), n * c * run * mg * len(positions), block)
    y = dots.reshape(n, group, cg, len(positions), mg).sum(axis=2)
    return y.transpose(0, 1, 3, 2).reshape((n, m) + tuple(out))


# ------------------------------------------------------------------------------------ ConvTranspose

def conv_transpose(x: np.ndarray, w: np.ndarray, g: dict[str, Any]) -> np.ndarray | None:
    """ConvTranspose with one output channel per group (``g``: its geometry, ``g["depthwise"]`` true), if
    big enough to gain (else None):
    canvas[p, o·s + κ·d] += Σ_j w[g(p)·cg + j, 0, κ] · x[image(p), g(p)·cg + j, o] on the canvas split
    by the stride, each kernel offset one contiguous add per input channel and plane."""
    n, cin = x.shape[:2]
    out, full, s, group = g["out"], g["full"], g["strides"], g["group"]
    if n * group * int(np.prod(out)) < MIN_TRANSPOSED:
        return None
    in_sp, cg, K = x.shape[2:], cin // group, g["K"]
    planes, it = n * group, x.itemsize
    split, offsets = _cached(g, "shifted", lambda: _shifted(planes, full, s, g))
    row = split.row
    # X's rows padded to the phase width: input pixel o then sits at o's offset in a phase's plane
    xf = np.zeros(x.shape[:3] + tuple(split.sizes[1:]), dtype=x.dtype)
    xf[(Ellipsis,) + tuple(slice(0, v) for v in in_sp[1:])] = x
    run = in_sp[0] * row
    xf = xf.reshape(planes, cg, run)
    wp = np.ascontiguousarray(np.broadcast_to(w.reshape(1, group, cg, K), (n, group, cg, K)))
    wp = wp.reshape(planes, cg, K)
    canvas = np.zeros(split.length, dtype=x.dtype)
    plane = split.plane

    def block(lo: int, hi: int) -> None:
        tmp = np.empty((hi - lo, run), dtype=x.dtype)
        for j, off in enumerate(offsets):
            v = np.ndarray((hi - lo, run), x.dtype, canvas, (lo * plane + off) * it, (plane * it, it))
            for q in range(cg):
                np.multiply(xf[lo:hi, q], wp[lo:hi, q, j, None], out=tmp)
                v += tmp

    _blocks(planes, run * cg, planes * run * cg * K, block)
    # each output pixel j is canvas pixel pads + j, in the phase (pads + j) mod s
    phases = split.blocks(canvas)
    y = np.empty((planes,) + tuple(out), dtype=x.dtype)
    for index, phase in enumerate(_grid(s)):
        dst, src = [slice(None)], [slice(None)]
        for r, f, p, size in zip(phase, s, g["pb"], out, strict=True):
            first = (r - p) % f  # first output index in this phase
            if first >= size:
                break
            count = len(range(first, size, f))
            dst.append(slice(first, size, f))
            src.append(slice((p + first - r) // f, (p + first - r) // f + count))
        else:
            y[tuple(dst)] = phases[index][tuple(src)]
    return y.reshape((n, g["m"]) + tuple(out))
