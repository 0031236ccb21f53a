"""Op table rows for the pooling kernels (onnxtrain/engine/kernels/pool.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase


def _unpool_inputs(shape, k):
    """MaxUnpool inputs: pooled values and, per window, one random flat index inside that window."""

    def make(rng, dt):
        n, c, h, w = shape
        x = rng.uniform(-2, 2, shape).astype(dt)
        hi = np.arange(h)[:, None] * k + rng.integers(0, k, (n, c, h, w))
        wi = np.arange(w)[None, :] * k + rng.integers(0, k, (n, c, h, w))
        nc = np.arange(n * c).reshape(n, c, 1, 1)
        return [x, ((nc * h * k + hi) * (w * k) + wi).astype(np.int64)]

    return make


_NO_REF = "onnx.reference has no GlobalLpPool; checked in tests/engine/test_conv_pool_resize.py"

CASES = [
    OpCase("MaxPool", [(2, 2, 4, 4)], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    OpCase(
        "MaxPool",
        [(1, 2, 7, 7)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        variant="3x3s2p1",
    ),
    OpCase(
        "MaxPool", [(1, 2, 6, 7)], {"kernel_shape": [3, 2], "strides": [2, 2], "ceil_mode": 1}, variant="ceil"
    ),
    OpCase("MaxPool", [(1, 1, 7, 7)], {"kernel_shape": [2, 2], "dilations": [2, 2]}, variant="dilations"),
    OpCase("MaxPool", [(2, 3, 9)], {"kernel_shape": [3], "strides": [2], "pads": [1, 1]}, variant="1d"),
    OpCase("MaxPool", [(1, 2, 4, 4, 4)], {"kernel_shape": [2, 2, 2], "strides": [2, 1, 2]}, variant="3d"),
    OpCase(
        "MaxPool",
        [(1, 2, 5, 5)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "auto_pad": "SAME_UPPER"},
        variant="same_upper",
    ),
    OpCase(
        "MaxPool",
        [(2, 2, 5, 6)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        n_outputs=2,
        grad_outputs=(0,),
        variant="indices",
    ),
    OpCase(
        "MaxPool",
        [(1, 2, 5, 4)],
        {"kernel_shape": [2, 2], "strides": [1, 2], "storage_order": 1},
        n_outputs=2,
        grad_outputs=(0,),
        variant="indices_col_major",
    ),
    OpCase("AveragePool", [(2, 2, 4, 4)], {"kernel_shape": [2, 2], "strides": [2, 2]}),
    OpCase(
        "AveragePool", [(1, 2, 5, 5)], {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}, variant="pads_exclude"
    ),
    OpCase(
        "AveragePool",
        [(1, 2, 5, 5)],
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1], "count_include_pad": 1},
        variant="pads_include",
    ),
    OpCase(
        "AveragePool",
        [(1, 2, 6, 7)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "ceil_mode": 1},
        variant="ceil",
    ),
    OpCase("AveragePool", [(2, 2, 8)], {"kernel_shape": [3], "strides": [2], "pads": [1, 0]}, variant="1d"),
    OpCase("AveragePool", [(1, 1, 4, 4, 4)], {"kernel_shape": [2, 2, 2]}, variant="3d"),
    OpCase(
        "AveragePool",
        [(1, 2, 5, 5)],
        {"kernel_shape": [2, 2], "auto_pad": "SAME_LOWER"},
        variant="same_lower",
    ),
    OpCase(
        "AveragePool",
        [(1, 1, 7, 7)],
        {"kernel_shape": [2, 2], "dilations": [2, 2], "pads": [1, 1, 1, 1]},
        opset=19,
        variant="dilations",
    ),
    OpCase("LpPool", [(1, 2, 5, 5)], {"kernel_shape": [2, 2]}),
    OpCase("LpPool", [(1, 2, 6, 6)], {"kernel_shape": [3, 3], "strides": [2, 2], "p": 3}, variant="p3"),
    OpCase("LpPool", [(2, 2, 7)], {"kernel_shape": [3], "strides": [2], "p": 1}, variant="1d_p1"),
    OpCase("GlobalAveragePool", [(2, 3, 4, 5)]),
    OpCase("GlobalAveragePool", [(2, 3, 4, 2, 3)], variant="3d"),
    OpCase("GlobalMaxPool", [(2, 3, 4, 5)]),
    OpCase("GlobalMaxPool", [(1, 4, 1, 7)], variant="thin"),  # onnx.reference handles 2-D only
    OpCase("GlobalLpPool", [(2, 3, 4, 5)], skip=_NO_REF),
    OpCase("GlobalLpPool", [(2, 3, 4, 5)], {"p": 3}, variant="p3", skip=_NO_REF),
    OpCase(
        "MaxUnpool",
        attrs={"kernel_shape": [2, 2], "strides": [2, 2]},
        make_inputs=_unpool_inputs((2, 2, 2, 3), 2),
        wrt=(0,),
    ),
]


def _distinct(*shape):
    """Inputs without ties (a permutation of a grid), so max-pool gradients are well defined."""

    def make(rng, dt):
        n = int(np.prod(shape))
        return [(rng.permutation(n).reshape(shape) * (4.0 / n) - 2.0).astype(dt)]

    return make


# gradient-focused rows (rules in onnxtrain/autodiff/rules/pool.py)
CASES += [
    OpCase(
        "MaxPool",
        make_inputs=_distinct(2, 2, 9, 9),
        attrs={"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        variant="grad_overlap_3x3s2p1",
    ),
    OpCase(
        "MaxPool",
        make_inputs=_distinct(1, 2, 7, 8),
        attrs={"kernel_shape": [3, 2], "strides": [1, 2], "dilations": [2, 1], "ceil_mode": 1},
        variant="grad_dil_ceil",
    ),
    OpCase(
        "AveragePool",
        [(2, 2, 9, 9)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1]},
        variant="grad_3x3s2p1_exclude",
    ),
    OpCase(
        "AveragePool",
        [(1, 2, 7, 6)],
        {
            "kernel_shape": [3, 2],
            "strides": [2, 2],
            "ceil_mode": 1,
            "pads": [1, 0, 0, 0],
            "count_include_pad": 1,
        },
        variant="grad_ceil_include_pad",
    ),
    OpCase(
        "LpPool",
        [(1, 2, 7, 7)],
        {"kernel_shape": [3, 3], "strides": [2, 2], "pads": [1, 1, 1, 1], "p": 3},
        low=0.2,
        variant="grad_p3_pads",
    ),
    OpCase("GlobalMaxPool", make_inputs=_distinct(2, 3, 4, 5), variant="grad_distinct"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
_UNIT_STRIDE_INDICES = ("onnx.reference's MaxPool Indices leave out the batch and channel offset when "
                        "the strides are 1 (onnxruntime's agree with ours)")
CASES += [
    OpCase("MaxPool", make_inputs=_distinct(2, 3, 5, 5), attrs={"kernel_shape": [2, 2], "strides": [1, 1]},
           variant="grad_ort_stride1", ref_skip=_UNIT_STRIDE_INDICES),
    # pads of 2 around a 3-wide window: the corner windows hold one element of X
    OpCase("MaxPool", make_inputs=_distinct(1, 2, 5, 5), attrs={"kernel_shape": [3, 3], "pads": [2, 2, 2, 2]},
           variant="grad_ort_pads2", ref_skip=_UNIT_STRIDE_INDICES),
    OpCase("MaxPool", make_inputs=_distinct(2, 1, 3, 3, 3), attrs={"kernel_shape": [2, 2, 2]},
           variant="grad_ort_3d_stride1", ref_skip=_UNIT_STRIDE_INDICES),
    OpCase("AveragePool", [(1, 3, 7, 8)], {"kernel_shape": [3, 2], "strides": [3, 2], "pads": [1, 0, 1, 0],
                                           "count_include_pad": 1},
           variant="grad_ort_include_pad_asym_kernel"),
    OpCase("AveragePool", [(1, 2, 8, 8, 8)], {"kernel_shape": [3, 3, 3], "strides": [3, 3, 3],
                                              "pads": [1, 1, 1, 0, 0, 0]}, variant="grad_ort_3d_begin_pads"),
    OpCase("AveragePool", [(1, 2, 7, 7, 7)], {"kernel_shape": [3, 3, 3], "strides": [3, 3, 3],
                                              "pads": [1, 1, 1, 1, 1, 1], "count_include_pad": 1},
           variant="grad_ort_3d_include_pad"),
]
