"""Global gradient norm and the clipping divisor (spec §10), as standard ONNX nodes."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import HALF_TYPES, NodeWriter

_FLOAT, _DOUBLE = TensorProto.FLOAT, TensorProto.DOUBLE


def norm_type(grad_types: Sequence[int]) -> int:
    """The type the global norm is computed in: float64 when a gradient is, else float32."""
    return _DOUBLE if _DOUBLE in grad_types else _FLOAT


def norm_dtype(weights: Iterable[np.ndarray]) -> np.dtype:
    """:func:`norm_type` for the arrays of the trained weights: the numpy dtype a session feeds or returns
    the global norm in when it computes it itself (across ranks)."""
    return np.dtype(np.float64 if any(w.dtype == np.float64 for w in weights) else np.float32)




def global_norm(w: NodeWriter, grads: Sequence[str], out_name: str = "global_gradient_norm",
                grad_types: Sequence[int] = ()) -> str:
    """N = sqrt(Σ_tensors Σ_elements g²), a scalar named ``out_name``: float32, or float64 when one of
    the gradients (of types ``grad_types``, float32 when not given) is (:func:`norm_type`)."""
    et = norm_type(grad_types)
    parts = []
    for k, g in enumerate(grads):
        own = grad_types[k] if grad_types else _FLOAT
        if own in HALF_TYPES:  # squares summed in the norm's type (a float16 sum overflows at a norm of 256)
            parts.append(w.one("ReduceSumSquare", w.one("Cast", g, to=et), keepdims=0))
            continue
        part = w.one("ReduceSumSquare", g, keepdims=0)
        parts.append(part if own == et else w.one("Cast", part, to=et))
    total = parts[0] if len(parts) == 1 else w.one("Sum", *parts)
    return w.emit("Sqrt", [total], [w.names(out_name)])[0]


def clip_divisor(w: NodeWriter, norm: str, max_norm: float, loss_scale: str | None = None,
                 norm_et: int = _FLOAT, out_et: int | None = None) -> str:
    """s = L, or N / max_norm when N > L·max_norm (L = loss scale, a float32 input, 1 without mixed
    precision), computed in the norm's type ``norm_et`` and given in ``out_et`` (default the same)."""
    mx = w.const(max_norm, norm_et)
    if loss_scale is None:
        scale = w.const(1.0, norm_et)
    else:
        scale = loss_scale if norm_et == _FLOAT else w.one("Cast", loss_scale, to=norm_et)
    over = w.one("Greater", norm, w.one("Mul", scale, mx))
    s = w.one("Where", over, w.one("Div", norm, mx), scale)
    return s if out_et in (None, norm_et) else w.one("Cast", s, to=out_et)
