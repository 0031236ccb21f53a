"""Op table rows for the resize kernels (onnxtrain/engine/kernels/resize.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase


def _scales(shape, scales, roi=None):
    """X, roi (omitted unless given), scales (always float32, as ONNX requires)."""

    def make(rng, dt):
        r = None if roi is None else np.array(roi, dtype=dt)
        return [rng.uniform(-2, 2, shape).astype(dt), r, np.array(scales, dtype=np.float32)]

    return make


def _sizes(shape, sizes, roi=None):
    """X, roi (omitted unless given), no scales, sizes (int64)."""

    def make(rng, dt):
        r = None if roi is None else np.array(roi, dtype=dt)
        return [rng.uniform(-2, 2, shape).astype(dt), r, None, np.array(sizes, dtype=np.int64)]

    return make


def _case(variant, make, opset=19, grad=True, **attrs):
    return OpCase("Resize", attrs=attrs, make_inputs=make, opset=opset, wrt=(0,), variant=variant, grad=grad)


CASES = [
    _case("nearest_up", _scales((1, 2, 2, 3), [1, 1, 2, 3]), mode="nearest"),
    _case("nearest_down", _scales((1, 1, 4, 5), [1, 1, 0.6, 0.6]), mode="nearest"),
    _case("nearest_sizes_asym_floor", _sizes((1, 2, 3, 3), [1, 2, 7, 5]), mode="nearest",
          coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    _case("nearest_align_corners_ceil", _sizes((1, 1, 4, 4), [1, 1, 7, 3]), mode="nearest",
          coordinate_transformation_mode="align_corners", nearest_mode="round_prefer_ceil"),
    _case("nearest_half_pixel_ceil", _sizes((1, 1, 3, 4), [1, 1, 5, 6]), mode="nearest", nearest_mode="ceil"),
    _case("linear_up", _scales((2, 2, 3, 3), [1, 1, 2, 2]), mode="linear"),
    _case("linear_down_align_corners", _scales((1, 2, 4, 6), [1, 1, 0.6, 0.6]), mode="linear",
          coordinate_transformation_mode="align_corners"),
    _case("linear_pytorch_half_pixel", _sizes((1, 1, 5, 4), [1, 1, 3, 1]), mode="linear",
          coordinate_transformation_mode="pytorch_half_pixel"),
    _case("linear_half_pixel_symmetric", _scales((1, 1, 4, 5), [1, 1, 1.7, 0.8]), mode="linear",
          coordinate_transformation_mode="half_pixel_symmetric"),
    _case("linear_1d", _scales((2, 3, 5), [1, 1, 1.6]), mode="linear"),
    # cubic rows use dyadic source coordinates: onnx.reference computes cubic weights in float32
    # (cubic_coeff_a is an np.float32), so any other ratio differs from float64 by ~1e-7
    _case("cubic_up", _scales((1, 2, 4, 4), [1, 1, 2, 4]), mode="cubic"),
    _case("cubic_exclude_outside", _scales((1, 1, 4, 4), [1, 1, 2, 0.5]), mode="cubic",
          cubic_coeff_a=-0.5, exclude_outside=1),
    _case("cubic_asymmetric_down", _sizes((1, 1, 4, 4), [1, 1, 2, 8]), mode="cubic",
          coordinate_transformation_mode="asymmetric"),
    _case("tf_crop_and_resize_linear", _sizes((1, 1, 4, 4), [1, 1, 3, 3], [0, 0, 0.4, 0.6, 1, 1, 1.2, 1.7]),
          mode="linear", coordinate_transformation_mode="tf_crop_and_resize", extrapolation_value=10.0),
    _case("tf_crop_and_resize_nearest_axes", _sizes((1, 1, 4, 4), [3, 3], [0.4, 0.6, 1.2, 1.7]),
          mode="nearest", coordinate_transformation_mode="tf_crop_and_resize", axes=[2, 3]),
    _case("antialias_linear", _sizes((1, 1, 8, 8), [1, 1, 3, 5]), mode="linear", antialias=1, opset=18),
    OpCase("Resize", attrs={"mode": "cubic", "antialias": 1}, opset=18, wrt=(0,), variant="antialias_cubic",
           make_inputs=_scales((1, 1, 8, 7), [1, 1, 0.5, 0.6]),
           skip="onnx.reference normalises antialias cubic weights in float32; checked against torch in "
                "tests/engine/test_conv_pool_resize.py"),
    _case("axes_not_larger", _sizes((1, 1, 4, 6), [6, 6]), mode="linear", axes=[2, 3],
          keep_aspect_ratio_policy="not_larger", opset=18, grad=False),  # sizes fed: see below
    _case("axes_not_smaller", _sizes((1, 1, 4, 6), [6, 6]), mode="nearest", axes=[3, 2],
          keep_aspect_ratio_policy="not_smaller", opset=18, grad=False),  # sizes fed: see below
    # (a keep_aspect_ratio_policy gradient needs constant sizes: tests/autodiff/test_resize_keep_aspect.py)
    _case("single_axis_scales", _scales((2, 2, 3, 4), [2.5]), mode="linear", axes=[3], opset=18),
    _case("opset13", _scales((1, 2, 3, 3), [1, 1, 2, 2]), mode="linear", opset=13),
    OpCase("Upsample", attrs={"mode": "nearest"}, opset=9, wrt=(0,),
           make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (1, 2, 2, 3)).astype(dt),
                                        np.array([1, 1, 2, 3], dtype=np.float32)]),
]

# gradient-focused rows (rule in onnxtrain/autodiff/rules/resize.py)
CASES += [
    _case("grad_linear_align_corners_up", _scales((1, 2, 3, 4), [1, 1, 2, 1.5]), mode="linear",
          coordinate_transformation_mode="align_corners"),
    _case("grad_nearest_asymmetric_floor_down", _scales((2, 1, 6, 5), [1, 1, 0.5, 0.4]), mode="nearest",
          coordinate_transformation_mode="asymmetric", nearest_mode="floor"),
    _case("grad_cubic_half_pixel_x2", _scales((1, 1, 3, 4), [1, 1, 2, 2]), mode="cubic"),
]
