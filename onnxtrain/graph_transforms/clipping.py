"""Global gradient norm and the clipping divisor (spec §10), as standard ONNX nodes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from onnxtrain.ir.builder import NodeWriter


def global_norm(w: NodeWriter, grads: Sequence[str], out_name: str = "global_gradient_norm") -> str:
    """N = sqrt(Σ_tensors Σ_elements g²), a float32 scalar named ``out_name``."""
    parts = [w.one("ReduceSumSquare", g, keepdims=0) for g in grads]
    total = parts[0] if len(parts) == 1 else w.one("Sum", *parts)
    return w.emit("Sqrt", [total], [w.names(out_name)])[0]


def clip_divisor(w: NodeWriter, norm: str, max_norm: float, loss_scale: str | None = None) -> str:
    """s = L, or N / max_norm when N > L·max_norm (L = loss scale, 1 without mixed precision)."""
    mx = w.const(np.float32(max_norm), 1)
    scale = loss_scale if loss_scale is not None else w.const(np.float32(1.0), 1)
    over = w.one("Greater", norm, w.one("Mul", scale, mx))
    return w.one("Where", over, w.one("Div", norm, mx), scale)
