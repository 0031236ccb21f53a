"""Op table rows for softmax and the normalization kernels (onnxtrain/engine/kernels/normalization.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

# reasons for rows onnx.reference cannot check (tests/engine/test_normalization.py checks them)
_FLAT_SKIP = "onnx.reference ignores the opset<13 flatten-to-2D semantics; checked against onnxruntime"
_STASH = (np.float32, "Mean and InvStdDev are of stash_type (float32 by default), as onnxruntime "
                      "gives them; onnx.reference keeps the input's float64")
_MVN_SKIP = ("onnx.reference cannot run the float64 case (float epsilon in the function body); "
             "checked against onnxruntime in float32")
# GroupNormalization-21 computes in stash_type (float32 by default); a float64 stash keeps the f64 check exact
_F64 = 11


def _bn_inputs(shape: tuple[int, ...]):
    """x, scale, bias, running mean, running var (positive)."""

    def make(rng: np.random.Generator, dt) -> list:
        c = shape[1]
        return [rng.uniform(-2, 2, shape).astype(dt), rng.uniform(0.5, 1.5, c).astype(dt),
                rng.uniform(-1, 1, c).astype(dt), rng.uniform(-0.5, 0.5, c).astype(dt),
                rng.uniform(0.5, 2, c).astype(dt)]

    return make


CASES = [
    OpCase("Softmax", [(3, 5)], opset=13),
    OpCase("Softmax", [(2, 3, 4)], attrs={"axis": 1}, opset=13, variant="axis1"),
    OpCase("Softmax", [(2, 3, 4)], attrs={"axis": 0}, low=-30, high=30, opset=13, variant="axis0_wide"),
    OpCase("Softmax", [(2, 3, 4)], opset=11, variant="flatten_v11", skip=_FLAT_SKIP),
    OpCase("Softmax", [(2, 3, 4)], attrs={"axis": 2}, opset=11, variant="v11_axis2"),
    OpCase("LogSoftmax", [(3, 5)], opset=13),
    OpCase("LogSoftmax", [(2, 3, 4)], attrs={"axis": -2}, low=-30, high=30, opset=13,
           variant="axis_neg2_wide"),
    OpCase("LogSoftmax", [(2, 3, 4)], opset=11, variant="flatten_v11", skip=_FLAT_SKIP),
    OpCase("LayerNormalization", [(2, 3, 8), (8,), (8,)], opset=17),
    OpCase("LayerNormalization", [(2, 3, 4), (3, 4)], attrs={"axis": 1, "epsilon": 1e-3}, opset=17,
           variant="axis1_nobias"),
    OpCase("LayerNormalization", [(4, 6), (6,), (6,)], n_outputs=3, grad_outputs=(0,), opset=17,
           variant="stats", f64_dtypes={1: _STASH, 2: _STASH}),
    OpCase("LayerNormalization", [(2, 3, 4), (1, 4), (4,)], attrs={"axis": -2}, n_outputs=2,
           grad_outputs=(0,), opset=17, variant="bcast_scale_mean", f64_dtypes={1: _STASH}),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((2, 3, 4, 4)), wrt=(0, 1, 2), opset=15),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((4, 3)), attrs={"epsilon": 1e-2}, wrt=(0, 1, 2),
           opset=15, variant="2d"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((3, 2, 5)), attrs={"training_mode": 1},
           n_outputs=3, wrt=(0, 1, 2), grad_outputs=(0,), opset=15, variant="training"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((6, 3)), attrs={"training_mode": 1}, n_outputs=3,
           wrt=(0, 1, 2), grad_outputs=(0,), opset=15, variant="training_2d"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((2, 4, 3, 3)),
           attrs={"training_mode": 1, "momentum": 0.8}, grad=False, opset=15,
           variant="training_y_only"),  # forward only: ONNX wants all 3 outputs in training mode
    OpCase("InstanceNormalization", [(2, 3, 5), (3,), (3,)], opset=6),
    OpCase("InstanceNormalization", [(2, 3, 2, 4), (3,), (3,)], attrs={"epsilon": 1e-2}, opset=6,
           variant="4d"),
    OpCase("GroupNormalization", [(2, 4, 3), (4,), (4,)], attrs={"num_groups": 2, "stash_type": _F64},
           opset=21),
    OpCase("GroupNormalization", [(2, 6, 2, 2), (6,), (6,)],
           attrs={"num_groups": 3, "epsilon": 1e-3, "stash_type": _F64},
           opset=21, variant="4d"),
    OpCase("GroupNormalization", [(2, 4, 3), (2,), (2,)], attrs={"num_groups": 2}, opset=18,
           variant="v18_group_scale", grad=False),  # onnx.checker refuses the deprecated opset-18 form
    OpCase("LpNormalization", [(3, 4)], opset=13),
    # onnx.reference sums x (not |x|) for p=1: positive inputs here, negative ones in test_normalization.py
    OpCase("LpNormalization", [(3, 4, 2)], attrs={"axis": 1, "p": 1}, low=0.1, opset=13, variant="l1_axis1"),
    OpCase("MeanVarianceNormalization", [(2, 3, 2, 2)], opset=13, skip=_MVN_SKIP),
    OpCase("MeanVarianceNormalization", [(3, 4)], attrs={"axes": [1]}, opset=13, variant="axes1",
           skip=_MVN_SKIP),
]

# gradient rows (autodiff/rules/normalization.py)
CASES += [
    OpCase("Softmax", [(5,)], attrs={"axis": 0}, variant="grad_1d"),
    OpCase("LogSoftmax", [(2, 3, 4)], attrs={"axis": 0}, variant="grad_axis0"),
    OpCase("LayerNormalization", [(3, 5), (3, 5), (3, 5)], attrs={"axis": 0}, variant="grad_axis0"),
    OpCase("LayerNormalization", [(2, 2, 3, 2), (3, 2)], attrs={"axis": -2}, variant="grad_4d_nobias"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((5, 3)), attrs={"training_mode": 1}, n_outputs=3,
           wrt=(0, 1, 2), grad_outputs=(0,), variant="grad_training_2d"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((2, 2, 2, 3, 2)),
           attrs={"training_mode": 1, "epsilon": 1e-3}, n_outputs=3, wrt=(0, 1, 2), grad_outputs=(0,),
           variant="grad_training_5d"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((2, 3, 4)), wrt=(0,),
           variant="grad_inference_x_only"),
    # inference mode differentiated w.r.t. the given mean and variance as well
    OpCase("BatchNormalization", make_inputs=_bn_inputs((2, 3, 4, 4)), wrt=(0, 1, 2, 3, 4),
           variant="grad_inference_stats"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((5, 3)), attrs={"epsilon": 1e-2}, wrt=(3, 4),
           variant="grad_inference_stats_2d"),
    OpCase("LpNormalization", [(3, 4)], attrs={"axis": 0}, variant="grad_axis0"),
    OpCase("LpNormalization", [(2, 3, 4)], attrs={"p": 1}, low=0.2, variant="grad_l1_last"),
]
# at opset 17 directly (the rows above at opset 6 go through the version converter first)
CASES += [
    OpCase("InstanceNormalization", [(2, 3, 2, 3), (3,), (3,)], attrs={"epsilon": 1e-3}, variant="grad_v17"),
]

# LRN: onnx.reference's LRN loops over the batch axis where it means the channels, so it is only right when
# N == C (tests/engine/test_normalization.py checks other shapes and the gradient against torch)
CASES += [
    OpCase("LRN", [(3, 3, 2, 2)], attrs={"size": 3}, opset=13),
    OpCase("LRN", [(4, 4, 3, 2)], attrs={"size": 2, "alpha": 0.5, "beta": 0.6, "bias": 2.0}, opset=13,
           variant="even_size"),
    OpCase("LRN", [(5, 5, 2, 1)], attrs={"size": 4, "alpha": 1.5, "beta": 1.2, "bias": 0.5}, opset=13,
           variant="wide_window"),
    OpCase("LRN", [(2, 2, 3, 3)], attrs={"size": 1, "alpha": 0.8}, opset=13, variant="size1"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    # one sample: the batch statistics are over the spatial positions only
    OpCase("BatchNormalization", make_inputs=_bn_inputs((1, 4, 2)), attrs={"training_mode": 1}, n_outputs=3,
           wrt=(0, 1, 2), grad_outputs=(0,), opset=15, variant="grad_ort_training_one_sample"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((3, 1, 2, 4)), attrs={"training_mode": 1},
           n_outputs=3, wrt=(0, 1, 2), grad_outputs=(0,), opset=15, variant="grad_ort_training_one_channel"),
    OpCase("BatchNormalization", make_inputs=_bn_inputs((3, 2, 1, 3, 2, 2)), attrs={"training_mode": 1},
           n_outputs=3, wrt=(0, 1, 2), grad_outputs=(0,), opset=15, variant="grad_ort_training_6d"),
]
