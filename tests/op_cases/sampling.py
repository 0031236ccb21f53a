"""Op table rows for the sampling kernels (onnxtrain/engine/kernels/sampling.py).

onnx.reference computes sampling coordinates in float32, so the inputs here are dyadic: grid points
sit at pixel coordinates k + j/16 with j odd (never on a tap boundary, a half-way rounding tie or a
padding fold, so float64 finite differences are smooth), and image sizes make the normalization exact
(align_corners=0: powers of two; align_corners=1: one more than a power of two).
"""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

ORT_16 = "onnxruntime has no float64 GridSample before opset 20 (test_sampling*.py check float32 there)"
ORT_CUBIC_3D = "onnxruntime's GridSample supports cubic mode on 4-D inputs only"
ORT_1D = "onnxruntime's GridSample takes 4-D and 5-D inputs only"


def pixel_coords(rng: np.random.Generator, shape: tuple[int, ...], lo: int, hi: int) -> np.ndarray:
    """Pixel coordinates k + j/16, k in [lo, hi), j odd."""
    return rng.integers(lo, hi, shape) + rng.choice(np.arange(1, 16, 2), shape) / 16.0


def grid_inputs(x_shape: tuple[int, ...], out: tuple[int, ...], align: int, reach: int = 3):
    """X and a grid whose pixel coordinates lie in [-reach, size - 1 + reach) on each axis."""

    def make(rng, dt):
        x = rng.uniform(-2, 2, x_shape).astype(dt)
        sizes = np.asarray(x_shape[2:], dtype=np.float64)
        cols = []
        for d in sizes:  # axis order; the grid lists the last axis first
            u = pixel_coords(rng, (x_shape[0], *out), -reach, int(d) - 1 + reach)
            scale = (d - 1) / 2 if align else d / 2
            cols.append((u - (d - 1) / 2) / scale)
        return [x, np.stack(cols[::-1], axis=-1).astype(dt)]

    return make


def _gs(variant, x_shape, out, mode, padding="zeros", align=0, opset=20, reach=3, **kw):
    attrs = {"mode": mode, "padding_mode": padding, "align_corners": align}
    if opset < 20:
        kw.setdefault("ort_skip", ORT_16)
    return OpCase("GridSample", attrs=attrs, make_inputs=grid_inputs(x_shape, out, align, reach), opset=opset,
                  variant=variant, **kw)


CASES = [
    # onnx.reference knows only the opset-20 mode names: bilinear and bicubic (opset 16-19) are checked
    # against torch and onnxruntime in tests/engine/test_sampling.py and tests/autodiff/test_sampling_grad.py
    _gs("v16_nearest_border_align", (1, 3, 5, 3), (4, 3), "nearest", "border", 1, opset=16),
    _gs("v17_nearest_reflection", (2, 2, 4, 4), (3, 2), "nearest", "reflection", opset=17, reach=6),
    # opset 20: linear with every padding mode and both align_corners
    _gs("linear_zeros", (2, 2, 4, 8), (3, 4), "linear"),
    _gs("linear_zeros_align", (1, 2, 5, 3), (4, 3), "linear", align=1),
    _gs("linear_border", (1, 3, 4, 4), (3, 5), "linear", "border"),
    _gs("linear_border_align", (2, 1, 3, 5), (3, 3), "linear", "border", 1),
    _gs("linear_reflection", (1, 2, 4, 2), (4, 4), "linear", "reflection", reach=9),
    _gs("linear_reflection_align", (1, 2, 5, 3), (3, 4), "linear", "reflection", 1, reach=9),
    _gs("nearest_zeros", (2, 2, 4, 4), (3, 3), "nearest"),
    _gs("nearest_reflection_align", (1, 2, 3, 5), (4, 3), "nearest", "reflection", 1, reach=7),
    _gs("cubic_zeros_align", (1, 2, 5, 5), (3, 3), "cubic", align=1),
    _gs("cubic_reflection", (1, 2, 4, 8), (3, 3), "cubic", "reflection", reach=6),
    # onnx.reference also clamps cubic coordinates beyond the border (torch and onnxruntime do not, nor the
    # engine): keep them inside here; tests/engine/test_sampling.py covers the rest against torch
    _gs("cubic_border_inside", (1, 2, 4, 4), (3, 3), "cubic", "border", reach=0),
    _gs("linear_1d", (2, 2, 8), (5,), "linear", "border", ort_skip=ORT_1D),
    _gs("linear_3d_zeros", (1, 2, 4, 2, 4), (2, 3, 2), "linear"),
    _gs("linear_3d_reflection_align", (1, 1, 3, 5, 3), (2, 2, 3), "linear", "reflection", 1, reach=5),
    _gs("nearest_3d_border", (1, 2, 2, 4, 4), (2, 2, 3), "nearest", "border"),
    _gs("cubic_3d_zeros", (1, 1, 4, 4, 2), (2, 2, 2), "cubic", ort_skip=ORT_CUBIC_3D),
]


def _affine(r, align, n=2):
    """theta with dyadic entries (k/8) and sizes that make the base grid exact."""
    sizes = ([5, 9], [3, 5, 3])[r - 2] if align else ([4, 8], [2, 4, 4])[r - 2]

    def make(rng, dt):
        theta = (rng.integers(-12, 13, (n, r, r + 1)) / 8.0).astype(dt)
        return [theta, np.array([n, 3, *sizes], dtype=np.int64)]

    return make


_REF_F32 = "onnx.reference's AffineGrid always returns float32"
_F32 = {0: (np.float64, _REF_F32)}

CASES += [
    OpCase("AffineGrid", attrs={"align_corners": a}, make_inputs=_affine(r, a), opset=20, wrt=(0,),
           f64_dtypes=_F32, ref_skip=_REF_F32, variant=f"{r}d_align{a}")
    for r in (2, 3) for a in (0, 1)
]


def _deform(x_shape, w_shape, out, og=1, mask=True, bias=True, reach=1):
    """X, W, offsets putting every sample at k + j/16 (j odd), optional bias and mask."""

    def make(rng, dt):
        n, r = x_shape[0], len(x_shape) - 2
        kk = int(np.prod(w_shape[2:]))
        x = rng.uniform(-2, 2, x_shape).astype(dt)
        w = rng.uniform(-1, 1, w_shape).astype(dt)
        off = pixel_coords(rng, (n, og * kk * r, *out), -reach, reach).astype(dt)
        b = rng.uniform(-1, 1, w_shape[:1]).astype(dt) if bias else None
        m = rng.uniform(0, 1, (n, og * kk, *out)).astype(dt) if mask else None
        return [x, w, off, b, m] if mask else [x, w, off, b]

    return make


# sizes one more than a power of two: onnx.reference normalizes the sampling positions by (size - 1)
CASES += [
    OpCase("DeformConv", make_inputs=_deform((1, 2, 5, 5), (3, 2, 2, 2), (4, 4), mask=False, bias=False),
           opset=19, variant="basic"),
    OpCase("DeformConv", attrs={"pads": [1, 0, 1, 1], "strides": [2, 1], "dilations": [1, 2]},
           make_inputs=_deform((2, 2, 5, 9), (2, 2, 3, 2), (3, 8)), opset=19,
           variant="pads_strides_dilations"),
    OpCase("DeformConv", attrs={"group": 2, "offset_group": 2, "pads": [1, 1, 1, 1]},
           make_inputs=_deform((1, 4, 5, 3), (4, 2, 2, 2), (6, 4), og=2), opset=19,
           variant="groups"),
]
