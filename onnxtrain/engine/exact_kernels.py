"""float64 kernels for :mod:`~onnxtrain.engine.exact_rounding` where an op's own kernel, given float64, is not
accurate to a few float64 ulps over the float32 range.

Gelu's ``x/2 · (1 + erf(x/√2))`` cancels for negative x: 1 + erf is 3e-3 at x = -3 but 2e-9 at -6, where the
float64 erf's last bit is a float32 ulp of the sum, and the engine's float64 erf is -1 exactly below -8.5,
where Gelu is still a normal float32 down to -13. Below -3 the sum is taken as erfc(-x/√2) instead
(``math.erfc``, one value at a time: only tail values pay it). The tanh form's ``(1 + tanh(u)) / 2`` is
``1 / (1 + exp(-2u))``, which does not cancel.
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
_erfc = np.frompyfunc(math.erfc, 1, 1)


def gelu64(inputs: Sequence[Any], attrs: Attrs) -> tuple[np.ndarray]:
    """Gelu of a float64 array, each value within a few float64 ulps of the exact one (``approximate``
    'none' or 'tanh')."""
    x = np.asarray(inputs[0], np.float64)
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
        s[tail] = _erfc(x[tail] * -math.sqrt(0.5)).astype(np.float64)
    s *= x
    s *= 0.5
    return (s,)


# op → its float64 kernel, where the op's own one is not accurate enough
FLOAT64_KERNELS: dict[str, Kernel] = {"Gelu": gelu64}
