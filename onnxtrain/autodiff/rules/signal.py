"""Gradient rules of the signal ops (same names as engine/kernels/signal.py).

DFT and STFT are linear in their signal. With complex values packed as (real, imaginary) pairs and a
real loss, the gradient of ``z ↦ A·z`` is ``Aᴴ·dY`` (``conj`` negates the imaginary half):

- forward DFT of length L, one-sided or not: ``Aᴴ = conj(F)`` after zero-padding a one-sided dY to L,
  computed as ``conj(DFT(conj(dY), dft_length=L))``;
- inverse DFT: ``Aᴴ = F/L``, i.e. ``DFT(dY)/L``;
- one-sided inverse (IRFFT, real output): bin k of the one-sided spectrum stands for ``c_k`` bins of
  the full one (1 for the DC and Nyquist bins, whose imaginary parts are ignored, else 2), so
  ``dZ_k = c_k/L · RFFT(dY)_k``.

The gradient graphs use the forward transform only: onnxruntime's float64 inverse DFT agrees with
numpy to about 1e-8 only. The result is then cut or zero-padded back to the input's length along the
axis (the adjoint of the node's padding or truncation to dft_length), and a real input keeps the real
half. Sizes unknown when the graph is built (a dft_length or axis fed at run time, dynamic shapes)
are computed by the graph. The windows and MelWeightMatrix are constants.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient, no_gradient
from onnxtrain.autodiff.rules.shape import as_int64, zeros

I64 = TensorProto.INT64
Dim = int | str  # a size known when the graph is built, or the name of a 0-d int64 tensor

no_gradient("BlackmanWindow", "HammingWindow", "HannWindow", "MelWeightMatrix")


def _scalar(g: GradCtx, v: Dim) -> str:
    return g.int64(v) if isinstance(v, int) else v


def _vec(g: GradCtx, v: Dim) -> str:
    return g.ints([v]) if isinstance(v, int) else g.emit("Reshape", v, g.ints([1]))


def _int_input(g: GradCtx, i: int) -> Dim:
    """Forward input ``i`` (an integer scalar): its value when fixed, else a 0-d int64 tensor."""
    c = g.constant_value(i)
    if c is not None:
        return int(np.asarray(c).reshape(()))
    return g.emit("Reshape", as_int64(g, g.x(i)), g.ints([]))


def _size(g: GradCtx, i: int, axis: Dim, output: bool = False) -> Dim:
    """The length of forward input (or output) ``i`` along ``axis``."""
    s = g.static_shape(i, output)
    if isinstance(axis, int) and s is not None and s[axis] is not None:
        return int(s[axis])  # type: ignore[arg-type]
    return g.emit("Gather", g.shape(i, output), _scalar(g, axis), axis=0)


def _conj(g: GradCtx, t: str) -> str:
    return g.emit("Mul", t, g.const([1.0, -1.0]))


def emit_dft(g: GradCtx, t: str, axis: Dim, length: Dim | None = None, onesided: bool = False) -> str:
    """A forward DFT node of ``t`` along ``axis`` (an attribute before opset 20, an input since)."""
    n = None if length is None else _scalar(g, length)
    flag = 1 if onesided else None
    if g.opset >= 20:
        return g.emit("DFT", t, n, _scalar(g, axis), onesided=flag)
    if not isinstance(axis, int):
        raise RuleError("DFT before opset 20 needs a fixed axis")
    return g.emit("DFT", t, n, axis=axis, onesided=flag)


def like_input(g: GradCtx, i: int, t: str) -> str:
    """A complex (..., 2) gradient as forward input ``i`` is stored: its real half for a real input."""
    s = g.static_shape(i)
    last = s[-1] if s else None
    if last == 2:
        return t
    ends = g.ints([1]) if last == 1 else g.emit("Slice", g.shape(i), g.ints([-1]), g.ints([2**62]))
    return g.emit("Slice", t, g.ints([0]), ends, g.ints([-1]))


def _pad_end(g: GradCtx, t: str, axis: Dim, extra: Dim) -> str:
    """``t`` zero-padded by ``extra`` elements at the end of ``axis``."""
    if g.opset >= 18:
        return g.emit("Pad", t, g.emit("Concat", g.ints([0]), _vec(g, extra), axis=0), None, _vec(g, axis))
    rank = g.rank(0)
    if rank is None or not isinstance(axis, int):
        raise RuleError("DFT gradient before opset 18 needs the input's rank")
    a = axis % rank
    parts = [g.ints([0] * (rank + a)), _vec(g, extra)]
    if a < rank - 1:
        parts.append(g.ints([0] * (rank - a - 1)))
    return g.emit("Pad", t, g.emit("Concat", *parts, axis=0))


def _fit(g: GradCtx, t: str, axis: Dim, cur: int | None, n: Dim) -> str:
    """``t``, of length ``cur`` (None: unknown) along ``axis``, cut or zero-padded to length ``n``."""
    if cur is not None and isinstance(n, int):
        if n == cur:
            return t
        if n > cur:
            return _pad_end(g, t, axis, n - cur)
        return g.emit("Slice", t, g.ints([0]), g.ints([n]), _vec(g, axis))
    ax = _scalar(g, axis)
    have = g.emit("Gather", g.emit("Shape", t), ax, axis=0) if cur is None else _scalar(g, cur)
    extra = g.emit("Max", g.emit("Sub", _scalar(g, n), have), _scalar(g, 0))
    return g.emit("Slice", _pad_end(g, t, axis, extra), g.ints([0]), _vec(g, n), _vec(g, axis))


def _dft_axis(g: GradCtx) -> Dim:
    rank = g.rank(0)
    axis = (_int_input(g, 2) if g.has_x(2) else -2) if g.opset >= 20 else int(g.attr("axis"))
    return axis % rank if isinstance(axis, int) and rank is not None else axis


def _dft_length(g: GradCtx, axis: Dim, n: Dim, irfft: bool) -> Dim:
    """The node's DFT length L: dft_length, else the input's length (2·(length − 1) for IRFFT)."""
    if g.has_x(1):
        return _int_input(g, 1)
    if not irfft:
        return n
    if isinstance(n, int):
        return 2 * (n - 1)
    return g.emit("Mul", g.emit("Sub", n, _scalar(g, 1)), _scalar(g, 2))


def _irfft_weights(g: GradCtx, r: str, axis: Dim, length: Dim) -> str:
    """``c_k / L`` along ``axis`` of the one-sided spectrum ``r``, broadcastable against it."""
    rank = g.rank(0)
    if isinstance(length, int) and isinstance(axis, int) and rank is not None:
        c = np.full(length // 2 + 1, 2.0)
        c[0] = 1.0
        if length % 2 == 0:
            c[-1] = 1.0
        return g.const((c / length).reshape([-1] + [1] * (rank - 1 - axis % rank)))
    # the bin index k along the axis, as a float tensor shaped like r
    k = g.emit("CumSum", zeros(g, g.emit("Shape", r), 1.0), _scalar(g, axis), exclusive=1)
    lf = g.emit("Cast", _scalar(g, length), to=g.dtype)
    dc = g.emit("Cast", g.emit("Equal", k, g.const(0.0)), to=g.dtype)
    nyquist = g.emit("Cast", g.emit("Equal", g.emit("Add", k, k), lf), to=g.dtype)
    c = g.emit("Sub", g.emit("Sub", g.const(2.0), dc), nyquist)
    return g.emit("Div", c, lf)


@gradient("DFT", uses=("x1", "x2"), stop=(1, 2), linear=True)
def dft_grad(g: GradCtx) -> None:
    inverse, onesided = bool(g.attr("inverse")), bool(g.attr("onesided"))
    axis = _dft_axis(g)
    n = _size(g, 0, axis)
    dy = g.dy(0)
    s = g.static_shape(0)
    real = bool(s) and s[-1] == 1
    if not inverse:  # conj(F)·dY, dY zero-padded to L when one-sided
        if onesided:
            length: Dim | None = _dft_length(g, axis, n, False)
        elif g.has_x(1):  # only the size matters, and only when known: dY has length L
            length = _int_input(g, 1) if g.constant_value(1) is not None else None
        else:
            length = n
        r = emit_dft(g, _conj(g, dy), axis, length if onesided else None)
        gz = like_input(g, 0, r if real else _conj(g, r))
        cur = length if isinstance(length, int) else None
    elif not onesided:  # F·dY / L
        length = _dft_length(g, axis, n, False)
        r = emit_dft(g, dy, axis)
        scale = g.const(1.0 / length) if isinstance(length, int) else g.emit("Cast", length, to=g.dtype)
        gz = like_input(g, 0, g.emit("Mul" if isinstance(length, int) else "Div", r, scale))
        cur = length if isinstance(length, int) else None
    else:  # IRFFT: c_k/L · RFFT(dY)_k
        length = _dft_length(g, axis, n, True)
        r = emit_dft(g, dy, axis, onesided=True)
        gz = like_input(g, 0, g.emit("Mul", r, _irfft_weights(g, r, axis, length)))
        cur = length // 2 + 1 if isinstance(length, int) else None
    g.set_dx(0, _fit(g, gz, axis, cur, n))


def _frame_length(g: GradCtx) -> Dim:
    """STFT's frame length: frame_length, else the window's length, else the signal's."""
    if g.has_x(3):
        return _int_input(g, 3)
    if g.has_x(2):
        return _size(g, 2, 0)
    return _size(g, 0, 1)


def _frame_index(g: GradCtx, frames: Dim, length: Dim, step: Dim) -> str:
    """``[frames, length]`` int64 positions in the signal: ``f·step + t``."""
    if isinstance(frames, int) and isinstance(length, int) and isinstance(step, int):
        return g.w.const(np.arange(frames)[:, None] * step + np.arange(length), I64)
    zero, one = _scalar(g, 0), _scalar(g, 1)
    starts = g.emit("Mul", g.emit("Range", zero, _scalar(g, frames), one), _scalar(g, step))
    offsets = g.emit("Range", zero, _scalar(g, length), one)
    return g.emit("Add", g.emit("Unsqueeze", starts, g.ints([1])), g.emit("Unsqueeze", offsets, g.ints([0])))


@gradient("STFT", uses=("x0", "x1", "x2", "x3"), stop=(1, 3))
def stft_grad(g: GradCtx) -> None:
    # frames[b, f, t] = signal[b, f·step + t]·window[t]; Y = DFT of each frame (one-sided or not)
    # a signal of rank 2 is [batch, length], real (torch's export; onnxruntime reads it so)
    length = _frame_length(g)
    s = g.static_shape(0)
    flat_signal = g.rank(0) == 2
    real = flat_signal or (bool(s) and s[-1] == 1)
    r = emit_dft(g, _conj(g, g.dy(0)), 2, length)
    if flat_signal:  # [batch, frames, length]: the real half, without its axis
        d_frames = g.emit("Squeeze", g.emit("Slice", r, g.ints([0]), g.ints([1]), g.ints([-1])), g.ints([-1]))
    else:
        d_frames = like_input(g, 0, r if real else _conj(g, r))  # [batch, frames, length, 1 or 2]
    idx = _frame_index(g, _size(g, 0, 1, output=True), length, _int_input(g, 1))
    window = g.has_x(2)
    if g.needs_dx(0):  # overlap-add of the windowed frame gradients
        w_shape = g.ints([-1] if flat_signal else [-1, 1])
        upd = g.emit("Mul", d_frames, g.emit("Reshape", g.x(2), w_shape)) if window else d_frames
        if flat_signal:
            flat = g.ints([0, -1])
        elif s is not None and s[-1] is not None:
            flat = g.ints([0, -1, int(s[-1])])  # type: ignore[arg-type]
        else:
            last = g.emit("Slice", g.shape(0), g.ints([2]), g.ints([3]))
            flat = g.emit("Concat", g.ints([0, -1]), last, axis=0)
        upd = g.emit("Reshape", upd, flat)
        i_shape = g.ints([1, -1] if flat_signal else [1, -1, 1])
        where = g.emit("Expand", g.emit("Reshape", idx, i_shape), g.emit("Shape", upd))
        g.set_dx(0, g.emit("ScatterElements", zeros(g, g.shape(0)), where, upd, axis=1, reduction="add"))
    if window and g.needs_dx(2):
        frames = g.emit("Gather", g.x(0), idx, axis=1)
        axes = [0, 1] if flat_signal else [0, 1, 3]
        g.set_dx(2, g.reduce("ReduceSum", g.emit("Mul", d_frames, frames), axes, keepdims=0))
