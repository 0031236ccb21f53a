"""Signal-processing kernels: DFT, STFT, the Blackman / Hamming / Hann windows and MelWeightMatrix.

Complex tensors follow ONNX's layout: a trailing axis of size 2 holds (real, imaginary); a trailing
axis of size 1 is a real signal. Transforms run through ``numpy.fft`` and come back in the input's
float type.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from onnxtrain.engine.registry import Attrs, Inputs, Outputs, kernel
from onnxtrain.ir.types import np_dtype


def _scalar(v: Any, op: str, what: str) -> int:
    """An integer scalar input (a 0-d or one-element tensor) as a Python int."""
    a = np.asarray(v)
    if a.size != 1 or a.dtype.kind not in "iu":
        raise ValueError(f"{op}: {what} must be one integer, got {a.dtype} of shape {a.shape}")
    return int(a.reshape(()))


def _as_complex(x: np.ndarray, op: str, what: str) -> np.ndarray:
    """A (..., 1) real or (..., 2) complex ONNX tensor as a numpy array without the trailing axis."""
    if x.ndim < 2 or x.shape[-1] not in (1, 2):
        raise ValueError(f"{op}: {what} must have a trailing axis of size 1 (real) or 2 (complex), "
                         f"got shape {x.shape}")
    if x.shape[-1] == 1:
        return x[..., 0]
    return x[..., 0] + 1j * x[..., 1]


def _pack(z: np.ndarray, dtype: np.dtype) -> np.ndarray:
    """A complex array as an ONNX (..., 2) tensor of ``dtype``."""
    out = np.empty(z.shape + (2,), dtype=dtype)
    out[..., 0] = z.real
    out[..., 1] = z.imag
    return out


def dft_axis(axis: int, rank: int) -> int:
    """``axis`` of a DFT node made non-negative; the trailing (real, imaginary) axis is not allowed."""
    if not -rank <= axis <= rank - 2 or axis == -1:
        raise ValueError(f"DFT: axis {axis} is out of range for an input of rank {rank} "
                         f"(allowed: [-{rank}, -2] and [0, {rank - 2}])")
    return axis % rank


def _dft(x: np.ndarray, length_in: Any, axis: int, inverse: bool, onesided: bool) -> np.ndarray:
    a = dft_axis(axis, x.ndim)
    z = _as_complex(x, "DFT", "input")
    n = x.shape[a]
    if length_in is not None:
        length = _scalar(length_in, "DFT", "dft_length")
    else:
        length = 2 * (n - 1) if inverse and onesided else n
    if length < 1:
        raise ValueError(f"DFT: dft_length must be >= 1, got {length}")
    if inverse and onesided:  # one-sided spectrum -> real signal
        y = np.fft.irfft(z, n=length, axis=a)
        return y[..., None].astype(x.dtype, copy=False)
    if inverse:
        y = np.fft.ifft(z, n=length, axis=a)
    elif onesided and x.shape[-1] == 1:
        y = np.fft.rfft(z, n=length, axis=a)
    else:
        y = np.fft.fft(z, n=length, axis=a)
        if onesided:
            y = y[(slice(None),) * a + (slice(0, length // 2 + 1),)]
    return _pack(y, x.dtype)


@kernel("DFT", since=17)
def dft_17(inputs: Inputs, attrs: Attrs) -> Outputs:
    length = inputs[1] if len(inputs) > 1 else None
    return (_dft(inputs[0], length, attrs["axis"], bool(attrs["inverse"]), bool(attrs["onesided"])),)


@kernel("DFT", since=20)
def dft_20(inputs: Inputs, attrs: Attrs) -> Outputs:
    length = inputs[1] if len(inputs) > 1 else None
    axis = _scalar(inputs[2], "DFT", "axis") if len(inputs) > 2 and inputs[2] is not None else -2
    return (_dft(inputs[0], length, axis, bool(attrs["inverse"]), bool(attrs["onesided"])),)


def stft_sizes(signal_length: int, frame_step: int, window_length: int | None,
               frame_length: int | None) -> tuple[int, int]:
    """(frame length, number of frames) of an STFT node; raises ValueError on inconsistent inputs."""
    if frame_length is None:
        frame_length = window_length if window_length is not None else signal_length
    if window_length is not None and window_length != frame_length:
        raise ValueError(f"STFT: window has length {window_length} but frame_length is {frame_length}")
    if frame_step < 1 or not 1 <= frame_length <= signal_length:
        raise ValueError(f"STFT: frame_step {frame_step} must be >= 1 and frame_length {frame_length} "
                         f"in [1, {signal_length}] (the signal length)")
    return frame_length, (signal_length - frame_length) // frame_step + 1


@kernel("STFT", since=17)
def stft(inputs: Inputs, attrs: Attrs) -> Outputs:
    x = inputs[0]
    if x.ndim == 2:  # [batch, length], as torch exports a real signal and onnxruntime reads it
        x = x[..., None]
    if x.ndim != 3:
        raise ValueError(f"STFT: signal must have rank 3 [batch, length, 1 or 2] (or 2, a real signal), "
                         f"got shape {x.shape}")
    z = _as_complex(x, "STFT", "signal")
    step = _scalar(inputs[1], "STFT", "frame_step")
    window = inputs[2] if len(inputs) > 2 else None
    fl_in = inputs[3] if len(inputs) > 3 else None
    if window is not None and window.ndim != 1:
        raise ValueError(f"STFT: window must be 1-D, got shape {window.shape}")
    fl, _ = stft_sizes(x.shape[1], step, None if window is None else window.shape[0],
                       None if fl_in is None else _scalar(fl_in, "STFT", "frame_length"))
    frames = sliding_window_view(z, fl, axis=1)[:, ::step]  # [batch, frames, frame_length]
    if window is not None:
        frames = frames * window
    if attrs["onesided"] and x.shape[-1] == 1:
        y = np.fft.rfft(frames, axis=-1)
    else:
        y = np.fft.fft(frames, axis=-1)
        if attrs["onesided"]:
            y = y[..., : fl // 2 + 1]
    return (_pack(y, x.dtype),)


def _window(inputs: Inputs, attrs: Attrs, coeffs: tuple[float, ...]) -> np.ndarray:
    """Σ_k (-1)^k coeffs[k]·cos(2πkn/N), n < size, N = size (periodic) or size - 1 (symmetric)."""
    size = _scalar(inputs[0], attrs.op, "size")
    if size < 0:
        raise ValueError(f"{attrs.op}: size must be >= 0, got {size}")
    dtype = np_dtype(attrs["output_datatype"])
    period = size if attrs["periodic"] else size - 1
    if period == 0:  # a symmetric window of one sample: its peak (the formula would divide by zero)
        return np.ones(size, dtype=dtype)
    phase = np.arange(size, dtype=np.float64) * (2 * math.pi / period)
    w = np.full(size, coeffs[0])
    for k, c in enumerate(coeffs[1:], start=1):
        w += (-1) ** k * c * np.cos(k * phase)
    if dtype.kind in "iu":  # the cast truncates: a peak of exactly 1 computed as 1 - 1e-16 must stay 1
        w = np.round(w, 9)
    return w.astype(dtype)


@kernel("HannWindow", since=17)
def hann_window(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (_window(inputs, attrs, (0.5, 0.5)),)


@kernel("HammingWindow", since=17)
def hamming_window(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (_window(inputs, attrs, (25 / 46, 21 / 46)),)


@kernel("BlackmanWindow", since=17)
def blackman_window(inputs: Inputs, attrs: Attrs) -> Outputs:
    return (_window(inputs, attrs, (0.42, 0.5, 0.08)),)


@kernel("MelWeightMatrix", since=17)
def mel_weight_matrix(inputs: Inputs, attrs: Attrs) -> Outputs:
    op = "MelWeightMatrix"
    n_mel = _scalar(inputs[0], op, "num_mel_bins")
    length = _scalar(inputs[1], op, "dft_length")
    rate = _scalar(inputs[2], op, "sample_rate")
    lo, hi = np.asarray(inputs[3]), np.asarray(inputs[4])
    if n_mel < 1 or length < 1 or rate < 1 or lo.size != 1 or hi.size != 1:
        raise ValueError(f"{op}: num_mel_bins {n_mel}, dft_length {length} and sample_rate {rate} must be "
                         f">= 1 and the edge frequencies scalars (shapes {lo.shape}, {hi.shape})")
    n_bins = length // 2 + 1

    def mel(hz: np.ndarray) -> float:  # the log in the edges' own precision, as the ONNX reference does
        t = hz.dtype.type
        return float(t(2595) * np.log1p(hz.reshape(()) / t(700))) / math.log(10)

    lo_mel = mel(lo)
    step = (mel(hi) - lo_mel) / (n_mel + 2)  # ONNX spaces n_mel + 2 points by range / (n_mel + 2)
    hz = 700 * np.expm1((np.arange(n_mel + 2) * step + lo_mel) / 2595 * math.log(10))
    edge = ((length + 1) * hz // rate).astype(np.int64)  # spectrogram bin of each band edge
    left, centre, right = edge[:-2], edge[1:-1], edge[2:]
    if edge.min() < 0 or edge.max() > n_bins or centre.max() >= n_bins:
        raise ValueError(f"{op}: the band edges fall outside the {n_bins} spectrogram bins "
                         f"(lower_edge_hertz {lo}, upper_edge_hertz {hi}, sample_rate {rate})")
    j = np.arange(n_bins)[:, None]
    rise = np.where(centre > left, (j - left) / np.maximum(centre - left, 1), 1.0)
    fall = (right - j) / np.maximum(right - centre, 1)
    out = np.zeros((n_bins, n_mel))
    up = (j >= left) & (j <= centre) & ((centre > left) | (j == centre))
    out[up] = np.broadcast_to(rise, out.shape)[up]
    down = (j >= centre) & (j < right)
    out[down] = np.broadcast_to(fall, out.shape)[down]
    return (out.astype(np_dtype(attrs["output_datatype"])),)
