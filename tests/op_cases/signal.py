"""Op table rows for the signal kernels (onnxtrain/engine/kernels/signal.py).

dft_length, axis (DFT since opset 20), frame_step and frame_length are graph inputs here, so the
gradient rules take their run-time paths; tests/engine/test_signal.py covers fixed values.
"""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

# onnxruntime's one-sided inverse DFT reads a spectrum that is not dft_length // 2 + 1 long differently
# from numpy's irfft, which the ONNX reference and the engine follow (it agrees on exact lengths and
# on cutting with an even dft_length)
_ORT_IRFFT = ("onnxruntime's IRFFT of a spectrum shorter than dft_length // 2 + 1, or longer with an odd "
              "dft_length, differs from numpy's irfft (the ONNX reference)")
_ORT_STFT = "onnxruntime's STFT needs a window or a frame_length"


def _i64(v):
    return None if v is None else np.array(v, dtype=np.int64)


def _signal(shape, *ints):
    """(rng, dtype) -> [x, then the integer inputs (None: omitted)]."""

    def make(rng, dt):
        return [rng.uniform(-2, 2, shape).astype(dt), *(_i64(v) for v in ints)]

    return make


def _stft(shape, step, window=None, frame_length=None):
    def make(rng, dt):
        w = None if window is None else rng.uniform(0.5, 1.5, window).astype(dt)
        return [rng.uniform(-2, 2, shape).astype(dt), _i64(step), w, _i64(frame_length)]

    return make


def _dft(variant, shape, length=None, opset=17, axis=None, ort_skip=None, **attrs):
    """A DFT row; ``axis`` is an attribute before opset 20 and an input since."""
    if opset >= 20:
        ints = (length, axis) if axis is not None else (length,)
        inputs = _signal(shape, *ints)
    else:
        attrs = {**attrs, "axis": 1 if axis is None else axis}
        inputs = _signal(shape, length)
    return OpCase("DFT", make_inputs=inputs, attrs=attrs, opset=opset, wrt=(0,), variant=variant,
                  ort_skip=ort_skip)


def _sized(op, size, variant="", **attrs):
    """A window row. Its output type is an attribute, float64 here: onnx.reference computes float32
    Hann and Hamming windows in float32 and the engine in float64, which the f64 run's 1e-10 would
    see (float32 windows are checked against torch in tests/engine/test_signal.py)."""
    attrs.setdefault("output_datatype", 11)
    return OpCase(op, make_inputs=lambda rng, dt: [_i64(size)], attrs=attrs, grad=False, variant=variant)


def _mel(n_mel, length, rate, lo, hi):
    def make(rng, dt):
        return [_i64(n_mel), _i64(length), _i64(rate), np.array(lo, dtype=dt), np.array(hi, dtype=dt)]

    return make


_IRFFT = {"inverse": 1, "onesided": 1}

CASES = [
    _dft("complex", (2, 5, 2)),
    _dft("real", (2, 5, 1)),
    _dft("onesided", (2, 6, 1), onesided=1),
    _dft("onesided_odd", (2, 5, 1), onesided=1),
    _dft("onesided_long", (2, 5, 1), 8, onesided=1),
    _dft("onesided_short", (2, 6, 1), 3, onesided=1),
    _dft("short", (2, 5, 2), 3),
    _dft("long", (2, 5, 2), 8),
    _dft("real_long", (2, 3, 1), 5),
    _dft("inverse", (2, 6, 2), inverse=1),
    _dft("inverse_real", (2, 5, 1), inverse=1),
    _dft("inverse_short", (2, 6, 2), 4, inverse=1),
    _dft("inverse_long", (2, 4, 2), 7, inverse=1),
    _dft("irfft", (2, 4, 2), **_IRFFT),
    _dft("irfft_odd", (2, 4, 2), 7, **_IRFFT),
    _dft("irfft_cut", (2, 5, 2), 6, **_IRFFT),
    _dft("irfft_padded", (2, 2, 2), 6, ort_skip=_ORT_IRFFT, **_IRFFT),
    _dft("axis0", (5, 3, 2), axis=0),
    _dft("axis1_rank4", (3, 5, 4, 2), 6, axis=1),
    _dft("axis_neg3_onesided", (3, 4, 5, 1), axis=-3, onesided=1),
    _dft("axis2_irfft", (2, 3, 4, 2), 5, axis=2, ort_skip=_ORT_IRFFT, **_IRFFT),
    _dft("v20_default_axis", (3, 4, 2), opset=20),
    _dft("v20_axis1_rank4", (3, 5, 4, 2), 3, opset=20, axis=1),
    _dft("v20_onesided", (2, 5, 1), 8, opset=20, axis=-2, onesided=1),
    _dft("v20_inverse", (2, 3, 2), 5, opset=20, axis=1, inverse=1),
    _dft("v20_irfft", (3, 4, 2, 2), opset=20, axis=1, **_IRFFT),
    _dft("v20_irfft_odd_neg_axis", (4, 3, 2), 5, opset=20, axis=-3, ort_skip=_ORT_IRFFT, **_IRFFT),
    OpCase("STFT", make_inputs=_stft((2, 16, 1), 4, window=8), variant="window"),
    OpCase("STFT", make_inputs=_stft((2, 15, 1), 3, frame_length=6), wrt=(0,), variant="frame_length"),
    OpCase("STFT", make_inputs=_stft((1, 14, 1), 5, window=6, frame_length=6), attrs={"onesided": 0},
           wrt=(0, 2), variant="twosided"),
    OpCase("STFT", make_inputs=_stft((2, 12, 2), 2, window=5), attrs={"onesided": 0}, variant="complex"),
    OpCase("STFT", make_inputs=_stft((2, 11, 1), 3, window=4), opset=20, variant="v20"),
    OpCase("STFT", make_inputs=_stft((1, 9, 1), 2), wrt=(0,), variant="whole_signal", ort_skip=_ORT_STFT),
    _sized("HannWindow", 10),
    _sized("HannWindow", 9, "symmetric", periodic=0),
    _sized("HammingWindow", 10),
    _sized("HammingWindow", 8, "symmetric", periodic=0),
    _sized("BlackmanWindow", 10),
    _sized("BlackmanWindow", 11, "symmetric", periodic=0),
    _sized("BlackmanWindow", 6, "half", output_datatype=10),
    OpCase("MelWeightMatrix", make_inputs=_mel(8, 16, 8192, 0.0, 4096.0), grad=False),
    OpCase("MelWeightMatrix", make_inputs=_mel(6, 64, 16000, 20.0, 8000.0), attrs={"output_datatype": 11},
           grad=False, variant="double"),
    OpCase("MelWeightMatrix", make_inputs=_mel(10, 512, 22050, 100.0, 9000.0), grad=False, variant="wide"),
]
