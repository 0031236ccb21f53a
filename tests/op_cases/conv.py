"""Op table rows for the convolution kernels (onnxtrain/engine/kernels/conv.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

# onnx.reference cannot be the oracle of these gradient graphs
GROUPED_CONV_TRANSPOSE = (
    "onnx.reference mis-computes grouped ConvTranspose (op-coverage §1.4); onnxruntime and torch check it"
)

CASES = [
    OpCase("Conv", [(2, 2, 5, 5), (3, 2, 3, 3), (3,)], {"pads": [1, 1, 1, 1]}),
    OpCase(
        "Conv",
        [(1, 3, 6, 7), (2, 3, 3, 2)],
        {"strides": [2, 2], "pads": [1, 0, 0, 1]},
        variant="strides_asym_pads_nobias",
    ),
    OpCase(
        "Conv",
        [(1, 2, 7, 7), (2, 2, 3, 3), (2,)],
        {"dilations": [2, 1], "pads": [2, 1, 2, 1]},
        variant="dilations",
    ),
    OpCase(
        "Conv",
        [(2, 4, 5, 5), (6, 2, 3, 3), (6,)],
        {"group": 2},
        variant="group2",
        ref_skip=GROUPED_CONV_TRANSPOSE,
    ),
    OpCase(
        "Conv",
        [(2, 3, 5, 5), (6, 1, 3, 3), (6,)],
        {"group": 3, "pads": [1, 1, 1, 1]},
        variant="depthwise_mult2",
        ref_skip=GROUPED_CONV_TRANSPOSE,
    ),
    OpCase("Conv", [(2, 3, 4, 4), (4, 3, 1, 1), (4,)], variant="pointwise"),
    OpCase("Conv", [(2, 2, 9), (3, 2, 3), (3,)], {"strides": [2], "pads": [1, 2]}, variant="1d"),
    OpCase("Conv", [(1, 2, 4, 4, 4), (2, 2, 2, 3, 2), (2,)], {"pads": [1, 0, 1, 0, 1, 0]}, variant="3d"),
    OpCase(
        "Conv",
        [(1, 2, 7, 6), (2, 2, 3, 3)],
        {"auto_pad": "SAME_UPPER", "strides": [2, 2]},
        variant="same_upper",
    ),
    OpCase("Conv", [(1, 2, 6, 6), (2, 2, 2, 2)], {"auto_pad": "SAME_LOWER"}, variant="same_lower"),
    OpCase("Conv", [(1, 2, 6, 5), (2, 2, 3, 3)], {"auto_pad": "VALID", "strides": [1, 2]}, variant="valid"),
    OpCase(
        "Conv",
        [(1, 1, 5, 5), (1, 1, 3, 3)],
        {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]},
        variant="kernel_shape_attr",
    ),
    OpCase("ConvTranspose", [(2, 2, 3, 3), (2, 3, 3, 3), (3,)], variant="basic"),
    OpCase(
        "ConvTranspose",
        [(1, 2, 3, 4), (2, 2, 3, 3)],
        {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 0]},
        variant="strides_pads_output_padding",
    ),
    OpCase("ConvTranspose", [(1, 2, 3, 3), (2, 1, 2, 2), (1,)], {"dilations": [2, 2]}, variant="dilations"),
    OpCase(
        "ConvTranspose",
        [(1, 1, 3, 3), (1, 2, 3, 3)],
        {"strides": [3, 2], "output_shape": [10, 8]},
        variant="output_shape",
    ),
    OpCase(
        "ConvTranspose",
        [(1, 1, 3, 3), (1, 2, 3, 3)],
        {"strides": [2, 2], "auto_pad": "SAME_UPPER"},
        variant="same_upper",
    ),
    # stride 1 in 2-D takes the flattened-rows col2im: pads, per-axis dilation, SAME
    OpCase(
        "ConvTranspose",
        [(2, 3, 5, 6), (3, 2, 3, 2), (2,)],
        {"pads": [1, 0, 2, 1], "dilations": [1, 2]},
        variant="stride1_pads_dil",
    ),
    OpCase("ConvTranspose", [(1, 2, 4, 4), (2, 2, 3, 3)], {"auto_pad": "SAME_LOWER"}, variant="stride1_same"),
    OpCase("ConvTranspose", [(1, 2, 4), (2, 2, 3), (2,)], {"strides": [2], "pads": [1, 0]}, variant="1d"),
    OpCase("ConvTranspose", [(1, 1, 2, 3, 2), (1, 2, 2, 2, 2)], {"strides": [1, 2, 1]}, variant="3d"),
    # no bias: onnx.reference adds the first group's bias to every group (grouped cases are checked
    # against torch in tests/engine/test_conv_pool_resize.py)
    OpCase(
        "ConvTranspose", [(1, 2, 3, 3), (2, 1, 3, 3)], {"group": 2, "strides": [2, 2]}, variant="depthwise"
    ),
]

# gradient-focused rows (rules in onnxtrain/autodiff/rules/conv.py); grouped, non-depthwise rows are
# checked against torch in tests/autodiff/test_conv_vs_torch.py (onnx.reference's grouped
# ConvTranspose, which dX uses, is only right for depthwise)
CASES += [
    OpCase(
        "Conv",
        [(2, 2, 9, 8), (3, 2, 3, 2), (3,)],
        {"strides": [2, 2], "dilations": [2, 2], "pads": [2, 1, 1, 0]},
        variant="grad_stride2_dil2",
    ),
    OpCase(
        "Conv",
        [(2, 3, 7, 7), (3, 1, 3, 3), (3,)],
        {"group": 3, "strides": [2, 2], "pads": [1, 1, 1, 1]},
        variant="grad_depthwise_stride2",
    ),
    OpCase(
        "Conv",
        [(2, 2, 11), (3, 2, 3)],
        {"dilations": [3], "strides": [2], "pads": [0, 2]},
        variant="grad_1d_dil3",
    ),
    OpCase(
        "Conv",
        [(1, 2, 5, 6, 5), (2, 2, 2, 3, 2), (2,)],
        {"strides": [2, 1, 2], "pads": [1, 0, 0, 1, 1, 0]},
        variant="grad_3d_stride",
    ),
    OpCase(
        "Conv",
        [(2, 2, 7, 6), (2, 2, 3, 2)],
        {"auto_pad": "SAME_UPPER", "strides": [2, 3]},
        variant="grad_same_upper_stride",
    ),
    OpCase(
        "ConvTranspose",
        [(1, 2, 3, 4), (2, 3, 3, 2), (3,)],
        {"strides": [2, 3], "dilations": [2, 1], "pads": [1, 0, 2, 1], "output_padding": [1, 2]},
        variant="grad_stride_dil_outpad",
    ),
]


def _col2im(n: int, c: int, image: tuple[int, ...], block: tuple[int, ...], blocks: int):
    """Col2Im inputs: X (n, c·prod(block), blocks), image_shape and block_shape (int64)."""

    def make(rng: np.random.Generator, dt) -> list:
        x = rng.uniform(-2, 2, (n, c * int(np.prod(block)), blocks)).astype(dt)
        return [x, np.array(image, np.int64), np.array(block, np.int64)]

    return make


# Col2Im (N-D); the 2-D rows are also checked against torch's fold in tests/engine/test_conv_pool_resize.py
CASES += [
    OpCase("Col2Im", make_inputs=_col2im(2, 2, (4, 5), (2, 2), 12), wrt=(0,), opset=18),
    OpCase("Col2Im", make_inputs=_col2im(1, 3, (5, 6), (2, 3), 6), attrs={"strides": [2, 2],
           "pads": [1, 0, 0, 1], "dilations": [1, 2]}, wrt=(0,), opset=18, variant="strides_pads_dil"),
    OpCase("Col2Im", make_inputs=_col2im(2, 1, (7,), (3,), 3), attrs={"strides": [2], "pads": [1, 0]},
           wrt=(0,), opset=18, variant="1d"),
    OpCase("Col2Im", make_inputs=_col2im(1, 2, (3, 4, 3), (2, 2, 2), 12), wrt=(0,), opset=18, variant="3d"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    # a 1x1 kernel with pads: the border of Y is the bias alone
    OpCase("Conv", [(1, 1, 1, 1), (1, 1, 1, 1), (1,)], {"kernel_shape": [1, 1], "pads": [1, 1, 1, 1]},
           variant="grad_ort_pointwise_pads"),
    OpCase("Conv", [(2, 1, 5), (1, 1, 1), (1,)], {"kernel_shape": [1], "pads": [1, 1]},
           variant="grad_ort_1d_pointwise_pads"),
    OpCase("Conv", [(2, 1, 5, 5), (1, 1, 3, 3), (1,)], {"dilations": [2, 2]},
           variant="grad_ort_dilated_1x1_out"),
    OpCase("Conv", [(2, 1, 7, 5), (1, 1, 3, 3), (1,)], {"dilations": [2, 2], "pads": [1, 1, 1, 1]},
           variant="grad_ort_dilated_pads"),
    OpCase("Conv", [(2, 1, 7, 5, 5), (1, 1, 3, 3, 3), (1,)], {"strides": [2, 2, 2], "pads": [1] * 6},
           variant="grad_ort_3d_strided"),
]
