"""Half-precision accumulation: float16 and bfloat16 inputs of kernels that sum (CumSum, the pools, Conv,
ConvTranspose, variadic Sum and Mean, LRN) are computed in float32 and rounded to the half type once at the
end, as ONNX's reference and onnxruntime do (summing in the half type loses every term below half an ulp of
the running sum: a float16 cumulative sum of ones stops at 2048)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from onnxtrain.engine.kernels.half_cast import from_single, to_single
from onnxtrain.engine.registry import Attrs, Inputs, Outputs

F32 = np.dtype(np.float32)


def is_half(dt: np.dtype) -> bool:
    """True for float types narrower than float32: float16, bfloat16 (kind 'V' in ml_dtypes), float8.
    The itemsize test comes first, so float32/float64 pay one comparison."""
    return dt.itemsize < 4 and dt.kind in "fV"


def is_float(dt: np.dtype) -> bool:
    """True for numpy floats and the ml_dtypes ones (bfloat16, float8)."""
    return dt.kind == "f" or dt.name.startswith(("bfloat", "float"))


def in_float32(run: Callable[[Inputs, Attrs], Outputs], inputs: Inputs, attrs: Attrs) -> Outputs:
    """Kernel ``run`` on the float16/bfloat16 ``inputs`` taken to float32 (other inputs as they are), its
    float32 outputs rounded once to the first input's type."""
    dt = inputs[0].dtype
    ys = run([to_single(v) if v is not None and is_half(v.dtype) else v for v in inputs], attrs)
    return tuple(from_single(y, dt) if isinstance(y, np.ndarray) and y.dtype == F32 else y for y in ys)
