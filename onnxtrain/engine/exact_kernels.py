"""float64 kernels for :mod:`~onnxtrain.engine.exact_rounding` where an op's own kernel, given float64, is not
accurate to a few float64 ulps over the float32 range, or not the value its float32 kernel approximates.

Gelu's ``x/2 · (1 + erf(x/√2))`` cancels for negative x: 1 + erf is 3e-3 at x = -3 but 2e-9 at -6, where the
float64 erf's last bit is a float32 ulp of the sum, and the engine's float64 erf is -1 exactly below -8.5,
where Gelu is still a normal float32 down to -13. Below -3 the sum is taken as erfc(-x/√2) instead: for
many tail values, ``exp(-z²)`` (z² split into an exact square and a small rest) times Laplace's continued
fraction for ``erfc(z)·exp(z²)`` to a fixed depth, over the whole array (within 4 float64 ulps of the exact
erfc on 4,000 values of z in [2.12, 11]; libm's within 2); for a few, libm's ``math.erfc`` value by value,
cheaper there. Both give the same Gelu rounded to float32 on every float32 from -3 down to -20 (23 M
values), and -0.0 below. The tanh form's ``(1 + tanh(u)) / 2`` is ``1 / (1 + exp(-2u))``, which does not
cancel.

Sigmoid's own float64 formula is accurate, but where float32's exp(-x) overflows (x below -88.72284) the
float32 kernel gives 0, as torch's float32 sigmoid does, while the value is a positive subnormal down to
-103.97. The float64 route keeps those zeros: a marked Sigmoid differs from an unmarked one only in its
last bit, and a subnormal's few bits would not be a better value (the correctly rounded sigmoid(-100) is
1.6 % above the exact one, so its log is -99.98: above torch's binary-cross-entropy clamp at -100, which
the exact log is below).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxtrain.engine.kernels.elementwise import erf
from onnxtrain.engine.registry import Attrs, Kernel

# constants as ONNX's function body has them (its float attributes are float32), as the float32 kernel
_GELU_C = math.sqrt(float(np.float32(2 / math.pi)))
_GELU_C3 = float(np.float32(0.044715)) * _GELU_C
_ERFC_BELOW = -3.0  # 1 + erf(x/√2) is 2.7e-3 here: the float64 erf's error grows 370-fold, still < 2e-13
# terms of the continued fraction: from z = 3/√2 (x = -3) up, 45 bring it within a float64 ulp
_CF_DEPTH = 52
# fewer tail values than this take libm's erfc value by value (the fraction's 104 passes cost 55 µs however
# few the values; libm 90-140 ns a value): the same float32 results on every float32 input either way
_ARRAY_TAIL_MIN = 512
_libm_erfc = np.frompyfunc(math.erfc, 1, 1)
_RSQRT_PI = 1 / math.sqrt(math.pi)


def erfc_tail(z: np.ndarray) -> np.ndarray:
    """erfc of a float64 array of values from 3/√2 up (+inf too), within a few float64 ulps."""
    zh = np.trunc(z * 16)
    zh /= 16  # z's leading bits: zh² is exact, and z² = zh² + (z - zh)(z + zh)
    with np.errstate(invalid="ignore"):  # z = inf: inf - inf in the rest; exp(-zh²) makes its erfc 0
        rest = z - zh
        rest *= z + zh
    rest[np.isinf(z)] = 0.0
    e = np.exp(-(zh * zh))
    e *= np.exp(-rest)
    # erfc(z)·exp(z²)·√π = 1 / (z + (1/2) / (z + 1 / (z + (3/2) / (z + ...)))), from the last term back
    t = z.copy()
    for k in range(_CF_DEPTH, 0, -1):
        np.divide(k * 0.5, t, out=t)
        t += z
    e /= t
    e *= _RSQRT_PI
    return e


def gelu64(inputs: Sequence[Any], attrs: Attrs) -> tuple[np.ndarray]:
    """Gelu of a float64 array, each value within a few float64 ulps of the exact one (``approximate``
    'none' or 'tanh')."""
    x = np.asarray(inputs[0], np.float64)
    if x.ndim == 0:  # (numpy gives a 0-d array's results as scalars, which out= and item assignment refuse)
        return (gelu64([x.reshape(1)], attrs)[0].reshape(()),)
    if attrs["approximate"] == "tanh":
        u = x * x
        u *= -2 * _GELU_C3
        u -= 2 * _GELU_C
        u *= x  # -2 · √(2/π) · (x + 0.044715 x³)
        with np.errstate(over="ignore"):
            np.exp(u, out=u)
        u += 1
        return (np.divide(x, u, out=u),)
    if attrs["approximate"] != "none":
        raise ValueError(f"Gelu: approximate must be 'none' or 'tanh', got {attrs['approximate']!r}")
    s = erf(x * math.sqrt(0.5))
    s += 1
    tail = x < _ERFC_BELOW
    if tail.any():
        z = x[tail] * -math.sqrt(0.5)
        s[tail] = erfc_tail(z) if z.size >= _ARRAY_TAIL_MIN else _libm_erfc(z).astype(np.float64)
    s *= x
    s *= 0.5
    return (s,)


def _exp_overflow_start() -> float:
    """The least float32 whose numpy float32 exp is inf (88.72284 here)."""
    start = np.float32(88.72).view(np.int32)
    candidates = (start + np.arange(1024, dtype=np.int32)).view(np.float32)
    with np.errstate(over="ignore"):
        return float(candidates[np.argmax(np.isinf(np.exp(candidates)))])


_SIGMOID_ZERO_AT = -_exp_overflow_start()  # at and below: float32's exp(-x) overflows, Sigmoid is 0


def sigmoid64(inputs: Sequence[Any], attrs: Attrs) -> tuple[np.ndarray]:
    """1 / (1 + exp(-x)) of a float64 array, 0 where float32's exp(-x) overflows (as the float32 kernel)."""
    x = np.asarray(inputs[0], np.float64)
    if x.ndim == 0:
        return (sigmoid64([x.reshape(1)], attrs)[0].reshape(()),)
    with np.errstate(over="ignore"):
        y = np.exp(-x)
    y += 1
    np.divide(1.0, y, out=y)
    y[x <= _SIGMOID_ZERO_AT] = 0.0
    return (y,)


# op → its float64 kernel, where the op's own one given float64 is not the value wanted
FLOAT64_KERNELS: dict[str, Kernel] = {"Gelu": gelu64, "Sigmoid": sigmoid64}
