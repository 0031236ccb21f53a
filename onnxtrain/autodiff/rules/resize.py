"""Gradient rule of Resize (same name as engine/kernels/resize.py).

Every Resize mode is linear in X and separable: along each resized axis, Y = Mᵀ·X for an (n, m)
matrix M whose row j is the resize of the impulse e_j. M is built in the graph by resizing an
identity matrix with the node's own mode, coordinate transform, nearest_mode, cubic coefficients,
antialias and the axis's scale/size/roi, so it matches the runtime's Resize exactly; then
dX = M·dY along that axis (MatMul for the last two axes, Einsum elsewhere). roi/scales/sizes get no
gradient.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, numpy_helper
from onnx.helper import tensor_dtype_to_np_dtype

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient

# attributes copied onto the identity's Resize (extrapolation_value is dropped: the constant fill of
# tf_crop_and_resize does not depend on X, so its gradient is zero)
_COPIED = ("mode", "coordinate_transformation_mode", "nearest_mode", "cubic_coeff_a", "exclude_outside",
           "antialias")


class _Param:
    """One of roi/scales/sizes: its constant value when known, else slices of the runtime tensor."""

    def __init__(self, g: GradCtx, i: int):
        self.g = g
        self.name = g.node.input[i] if g.has_x(i) else ""
        self.value = g.constant_value(self.name) if self.name else None
        if self.value is not None and self.value.size == 0:  # an empty scales tensor means "absent"
            self.name, self.value = "", None
        self.elem = g.elem_type(self.name) if self.name else TensorProto.UNDEFINED

    def __bool__(self) -> bool:
        return bool(self.name)

    def piece(self, k: int) -> str | float | int:
        """Element ``k`` (a Python number when constant, else a 1-element tensor)."""
        if self.value is not None:
            return self.value.reshape(-1)[k].item()
        g = self.g
        return g.emit("Slice", self.name, g.ints([k]), g.ints([k + 1]), g.ints([0]))


def _vector(g: GradCtx, parts: list[Any], elem: int) -> str:
    """A 1-D tensor of ``elem`` from numbers and 1-element tensors."""
    np_dt = tensor_dtype_to_np_dtype(elem)
    if all(not isinstance(p, str) for p in parts):
        return g.w.const(np.array(parts, dtype=np_dt), elem)
    pieces = [p if isinstance(p, str) else g.w.const(np.array([p], dtype=np_dt), elem) for p in parts]
    return g.emit("Concat", *pieces, axis=0)


@gradient("Resize", uses=("x1", "x2", "x3"), stop=(1, 2, 3), linear=True, uncomputed=(1, 2))
def resize_grad(g: GradCtx) -> None:
    # Y = X ×_a M_aᵀ over the resized axes a  ⇒  dX = dY ×_a M_a
    xs = g.static_shape(0)
    if xs is None:
        raise RuleError("Resize gradient needs the rank of X")
    r = len(xs)
    ctm = g.attr("coordinate_transformation_mode") or "half_pixel"
    policy = g.attr("keep_aspect_ratio_policy") or "stretch"
    roi, scales, sizes = _Param(g, 1), _Param(g, 2), _Param(g, 3)
    if sizes and policy != "stretch":
        _keep_aspect_ratio_grad(g, xs, roi, sizes)
        return
    if ctm == "tf_half_pixel_for_nn" and (g.attr("nearest_mode") or "round_prefer_floor") in ("ceil",
                                                                                              "round_prefer_ceil"):
        raise RuleError("tf_half_pixel_for_nn with a ceil nearest_mode is not supported")
    if ctm == "tf_crop_and_resize" and not roi:
        raise RuleError("tf_crop_and_resize without roi")
    if not scales and not sizes:
        raise RuleError("Resize without scales or sizes")
    axes = [a % r for a in (g.attr("axes") or range(r))]
    attrs = {a.name: g.attr(a.name) for a in g.node.attribute if a.name in _COPIED}
    shape_x: str | None = None
    d = g.dy(0)
    for k, a in enumerate(axes):
        n = xs[a]
        if scales:
            s = scales.piece(k)
            if not isinstance(s, str) and s == 1.0 and ctm != "tf_crop_and_resize":
                continue
        else:
            s = sizes.piece(k)
            if not isinstance(s, str) and n is not None and s == n and ctm != "tf_crop_and_resize":
                continue
        if n is None:
            shape_x = shape_x or g.shape(0)
            n_t: str | int = g.emit("Slice", shape_x, g.ints([a]), g.ints([a + 1]), g.ints([0]))
        else:
            n_t = n
        # impulses run along one axis of an identity, the resize along the other: for the last
        # axis resize along axis 0, giving Mᵀ (m, n) and dX = dY·Mᵀ; otherwise M (n, m), dX = M·dY
        along = 0 if a == r - 1 else 1
        nn = _vector(g, [n_t, n_t], TensorProto.INT64)
        # the matrix in float32 for bfloat16 (EyeLike has no bfloat16 form before opset 22), cast after
        wide = TensorProto.FLOAT if g.dtype == TensorProto.BFLOAT16 else g.dtype
        zero = numpy_helper.from_array(np.zeros(1, dtype=tensor_dtype_to_np_dtype(wide)))
        eye = g.emit("EyeLike", g.emit("ConstantOfShape", nn, value=zero))
        roi_in = ""
        if ctm == "tf_crop_and_resize":
            lo, hi = roi.piece(k), roi.piece(len(axes) + k)
            parts = [lo, 0.0, hi, 1.0] if along == 0 else [0.0, lo, 1.0, hi]
            roi_in = _vector(g, parts, roi.elem or g.dtype)
        if scales:
            sc = _vector(g, [s, 1.0] if along == 0 else [1.0, s], TensorProto.FLOAT)
            m = g.emit("Resize", eye, roi_in, sc, **attrs)
        else:
            sz = _vector(g, [s, n_t] if along == 0 else [n_t, s], TensorProto.INT64)
            m = g.emit("Resize", eye, roi_in, "", sz, **attrs)
        if wide != g.dtype:
            m = g.emit("Cast", m, to=g.dtype)
        if a == r - 1:
            d = g.emit("MatMul", d, m)  # (…, m)·(m, n)
        elif a == r - 2:
            d = g.emit("MatMul", m, d)  # (n, m)·(…, m, W)
        else:
            letters = "abcdefghijklmnopqrstuvwxy"[:r]
            out = letters[:a] + "z" + letters[a + 1:]
            d = g.in_float32("Einsum", d, m, equation=f"{letters},z{letters[a]}->{out}")
    g.set_dx(0, d)


def _keep_aspect_ratio_grad(g: GradCtx, xs: list[int | None], roi: _Param, sizes: _Param) -> None:
    """dX for a Resize whose ``sizes`` keep the aspect ratio: every resized axis uses one common scale and
    its own rounded size, which no Resize of an identity reproduces (scales give floor(n·s) rows). With a
    static X and constant sizes (and roi), each axis's matrix comes from the kernel's own plan, as a
    constant: dX = dY ×_a M_a along each resized axis."""
    from onnxtrain.engine.kernels.resize import axis_matrices
    from onnxtrain.engine.registry import Attrs

    if any(v is None for v in xs) or sizes.value is None or (roi and roi.value is None):
        raise RuleError("a Resize with keep_aspect_ratio_policy needs a static input shape and constant "
                        "sizes (and roi) for its gradient")
    dt = np.dtype(tensor_dtype_to_np_dtype(g.dtype))
    attrs = Attrs(dict(g.attrs), "Resize", g.node.name, g.opset)
    r = len(xs)
    d = g.dy(0)
    shape = tuple(int(v) for v in xs)  # type: ignore[arg-type]
    for a, mat in axis_matrices(attrs, shape, dt, roi.value, sizes.value):
        if a == r - 1:
            d = g.emit("MatMul", d, g.const(mat))  # (…, m)·(m, n)
        elif a == r - 2:
            d = g.emit("MatMul", g.const(np.ascontiguousarray(mat.T)), d)  # (n, m)·(…, m, W)
        else:
            letters = "abcdefghijklmnopqrstuvwxy"[:r]
            out = letters[:a] + "z" + letters[a + 1:]
            d = g.in_float32("Einsum", d, g.const(np.ascontiguousarray(mat.T)),
                             equation=f"{letters},z{letters[a]}->{out}")
    g.set_dx(0, d)
