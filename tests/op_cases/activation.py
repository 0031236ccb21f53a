"""Op table rows for the activation kernels (onnxtrain/engine/kernels/activation.py)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from tests.op_cases import OpCase
from tests.op_cases.elementwise import erf_friendly


def _clip_inputs(lo: float | None, hi: float | None, shape: tuple[int, ...] = (3, 4)) -> Any:
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        return [rng.uniform(-2, 2, shape).astype(dt), None if lo is None else np.array(lo, dt),
                None if hi is None else np.array(hi, dt)]

    return make


def _clip_int8(rng: np.random.Generator, dt: Any) -> list[Any]:
    return [rng.integers(-100, 100, (3, 4)).astype(np.int8), np.array(-20, np.int8), np.array(30, np.int8)]


def _prelu(x: tuple[int, ...], slope: tuple[int, ...]) -> Any:
    return lambda rng, dt: [rng.uniform(-2, 2, x).astype(dt), rng.uniform(0.05, 0.5, slope).astype(dt)]


def _ties(rng: np.random.Generator, dt: Any) -> list[Any]:
    return [rng.integers(0, 3, (2, 3, 4)).astype(dt)]  # repeated maxima: the first one wins


CASES = [
    OpCase("Relu", [(3, 4)]),
    OpCase("Relu", [(2, 3, 4, 5)], variant="4d"),
    OpCase("Sigmoid", [(3, 4)], low=-6.0, high=6.0),
    OpCase("Sigmoid", [(2, 50)], low=-40.0, high=40.0, variant="wide"),
    OpCase("Tanh", [(3, 4)], low=-3.0, high=3.0),
    OpCase("Gelu", make_inputs=erf_friendly((3, 4), math.sqrt(2)), opset=20),
    OpCase("Gelu", [(2, 3, 4)], low=-4.0, high=4.0, attrs={"approximate": "tanh"}, opset=20, variant="tanh"),
    OpCase("LeakyRelu", [(3, 4)]),
    OpCase("LeakyRelu", [(3, 4)], attrs={"alpha": 0.2}, variant="alpha"),
    OpCase("LeakyRelu", [(3, 4)], attrs={"alpha": 1.5}, variant="alpha_gt1"),
    OpCase("PRelu", make_inputs=_prelu((3, 4), (3, 4))),
    OpCase("PRelu", make_inputs=_prelu((2, 3, 4), (3, 1)), variant="bcast_channel"),
    OpCase("PRelu", make_inputs=_prelu((2, 3, 4), (1,)), variant="bcast_scalar"),
    OpCase("Elu", [(3, 4)], low=-3.0, high=3.0),
    OpCase("Elu", [(3, 4)], low=-3.0, high=3.0, attrs={"alpha": 0.5}, variant="alpha"),
    OpCase("Selu", [(3, 4)], low=-3.0, high=3.0),
    OpCase("Selu", [(3, 4)], low=-3.0, high=3.0, attrs={"alpha": 2.0, "gamma": 3.0}, variant="attrs"),
    # Celu's schema admits float32 only, so the float64 gradient checks cannot build a valid model
    OpCase("Celu", [(3, 4)], low=-3.0, high=3.0, grad=False),
    OpCase("Celu", [(3, 4)], low=-3.0, high=3.0, attrs={"alpha": 2.0}, grad=False, variant="alpha"),
    OpCase("HardSigmoid", [(3, 4)], low=-6.0, high=6.0),
    OpCase("HardSigmoid", [(3, 4)], low=-3.0, high=3.0, attrs={"alpha": 0.5, "beta": 0.6}, variant="attrs"),
    OpCase("HardSwish", [(3, 5)], low=-5.0, high=5.0),
    OpCase("Softplus", [(3, 4)], low=-5.0, high=5.0),
    OpCase("Softplus", [(2, 50)], low=-60.0, high=60.0, variant="wide"),
    OpCase("Softsign", [(3, 4)], low=-5.0, high=5.0),
    OpCase("Mish", [(3, 4)], low=-5.0, high=5.0, opset=18),
    OpCase("Clip", make_inputs=_clip_inputs(-0.5, 0.8), opset=13, wrt=(0,)),
    OpCase("Clip", make_inputs=_clip_inputs(-0.5, None), opset=13, wrt=(0,), variant="min_only"),
    OpCase("Clip", make_inputs=_clip_inputs(None, 0.3), opset=13, wrt=(0,), variant="max_only"),
    OpCase("Clip", make_inputs=_clip_inputs(None, None), opset=13, variant="none"),
    OpCase("Clip", make_inputs=_clip_inputs(1.0, -1.0), opset=13, wrt=(0,), variant="min_gt_max"),
    OpCase("Clip", make_inputs=_clip_int8, opset=13, grad=False, variant="int8"),
    # the opset-6 form (bounds as attributes); gradients are checked on the opset-13 rows
    OpCase("Clip", [(3, 4)], attrs={"min": -0.5, "max": 0.5}, opset=6, grad=False, variant="attrs_v6"),
    OpCase("ThresholdedRelu", [(3, 4)], low=-3.0, high=3.0),
    OpCase("ThresholdedRelu", [(3, 4)], low=-3.0, high=3.0, attrs={"alpha": 0.3}, variant="alpha"),
    OpCase("Shrink", [(3, 4)]),
    OpCase("Shrink", [(3, 4)], attrs={"lambd": 1.0, "bias": 0.4}, variant="soft"),
    OpCase("Hardmax", [(3, 4)], opset=13, grad=False),
    OpCase("Hardmax", [(2, 3, 4)], attrs={"axis": 1}, opset=13, grad=False, variant="axis1"),
    OpCase("Hardmax", make_inputs=_ties, attrs={"axis": 0}, opset=13, grad=False, variant="ties_axis0"),
    # onnx.reference has only the opset-13 Hardmax, so the v11 row keeps to the last axis, where the
    # two agree; tests/engine/test_activation.py checks the 2-D flattening of v1-v11
    OpCase("Hardmax", [(2, 3, 4)], attrs={"axis": -1}, opset=11, grad=False, variant="v11_last_axis"),
]


# ---- gradient rows of autodiff/rules/activation.py (variants the rows above do not cover) ---------

def _g_off_kinks(shape: tuple[int, ...], kinks: tuple[float, ...] = (0.0,), low: float = -4.0,
                 high: float = 4.0, gap: float = 0.05) -> Any:
    """Uniform values pushed at least ``gap`` away from the points where the op has a kink."""
    def make(rng: np.random.Generator, dt: Any) -> list[Any]:
        x = rng.uniform(low, high, shape)
        for k in kinks:
            near = np.abs(x - k) < gap
            x[near] = k + np.where(x[near] >= k, gap, -gap)
        return [x.astype(dt)]

    return make


def _g_prelu(x: tuple[int, ...], slope: tuple[int, ...]) -> Any:
    return lambda rng, dt: [_g_off_kinks(x)(rng, dt)[0], rng.uniform(0.05, 0.5, slope).astype(dt)]


CASES += [
    OpCase("Sigmoid", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Tanh", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Gelu", make_inputs=erf_friendly((2, 1, 5), math.sqrt(2)), attrs={"approximate": "none"}, opset=20,
           variant="grad_none_3d"),
    OpCase("Gelu", [(2, 1, 5)], attrs={"approximate": "tanh"}, opset=21, variant="grad_tanh_3d"),
    OpCase("LeakyRelu", make_inputs=_g_off_kinks((2, 3, 4)), attrs={"alpha": -0.5}, variant="grad_neg_alpha"),
    OpCase("PRelu", make_inputs=_g_prelu((2, 3, 4, 2), (3, 1, 1)), variant="grad_channel"),
    OpCase("Elu", make_inputs=_g_off_kinks((2, 1, 5)), attrs={"alpha": -0.7}, variant="grad_neg_alpha"),
    OpCase("Selu", make_inputs=_g_off_kinks((2, 1, 5)), attrs={"alpha": 2.0, "gamma": 0.5},
           variant="grad_3d"),
    OpCase("HardSigmoid", make_inputs=_g_off_kinks((2, 1, 5), (-1.0, 1.0), -2.0, 2.0),
           attrs={"alpha": 0.5, "beta": 0.5}, variant="grad_3d"),
    OpCase("HardSwish", make_inputs=_g_off_kinks((2, 3, 4), (-3.0, 3.0), -5.0, 5.0), variant="grad_3d"),
    OpCase("Softplus", [(2, 1, 5)], variant="grad_3d"),
    OpCase("Softsign", make_inputs=_g_off_kinks((2, 1, 5)), variant="grad_3d"),
    OpCase("Mish", [(2, 1, 5)], opset=18, variant="grad_3d"),
    OpCase("ThresholdedRelu", make_inputs=_g_off_kinks((2, 1, 5), (-0.5,)), attrs={"alpha": -0.5},
           variant="grad_neg_alpha"),
    OpCase("Shrink", make_inputs=_g_off_kinks((2, 1, 5), (-1.0, 1.0)), attrs={"lambd": 1.0, "bias": 0.3},
           variant="grad_3d"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    OpCase("Clip", make_inputs=_clip_inputs(-0.7, 1.2, (2, 2, 2)), opset=12, wrt=(0,),
           variant="grad_ort_v12"),
    OpCase("Clip", make_inputs=_clip_inputs(0.3, None, (2, 2, 2)), opset=12, wrt=(0,),
           variant="grad_ort_v12_min_only"),
]
