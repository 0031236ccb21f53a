"""Op table rows for the shape-manipulation kernels (onnxtrain/engine/kernels/shape.py)."""

from __future__ import annotations

import numpy as np
from onnx import numpy_helper

from tests.op_cases import OpCase


def _i64(*v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _x(*shape: int):
    """An input maker: one float tensor of ``shape`` (then the fixed extra inputs given later)."""

    def with_extra(*extra):
        return lambda rng, dt: [rng.uniform(-2, 2, shape).astype(dt), *extra]

    return with_extra


CASES = [
    # Reshape: 0 copies a dim, -1 infers one; allowzero keeps a literal 0
    OpCase("Reshape", make_inputs=_x(2, 3, 4)(_i64(4, 6)), wrt=(0,)),
    OpCase("Reshape", make_inputs=_x(2, 3, 4)(_i64(0, -1)), wrt=(0,), variant="zero_minus1"),
    OpCase("Reshape", make_inputs=_x(2, 3, 4)(_i64(-1)), wrt=(0,), variant="flat"),
    OpCase(
        "Reshape", make_inputs=_x(0, 3)(_i64(3, 0)), attrs={"allowzero": 1}, wrt=(0,), variant="allowzero"
    ),
    OpCase("Transpose", [(2, 3, 4)]),
    OpCase("Transpose", [(2, 3, 4, 5)], attrs={"perm": [0, 2, 3, 1]}, variant="perm"),
    OpCase("Concat", [(2, 3), (2, 4), (2, 1)], attrs={"axis": 1}),
    OpCase("Concat", [(2, 3), (1, 3)], attrs={"axis": -2}, variant="neg_axis"),
    OpCase("Split", [(6, 4)], attrs={"axis": 0}, n_outputs=3, opset=13),
    OpCase(
        "Split",
        make_inputs=_x(3, 7)(_i64(2, 5)),
        attrs={"axis": 1},
        n_outputs=2,
        wrt=(0,),
        opset=13,
        variant="sizes",
    ),
    OpCase(
        "Split",
        [(2, 7)],
        attrs={"axis": -1, "num_outputs": 3},
        n_outputs=3,
        opset=18,
        variant="num_outputs_uneven",
    ),
    OpCase("Slice", make_inputs=_x(5, 6)(_i64(1, 0), _i64(4, 6)), wrt=(0,), opset=13),
    OpCase(
        "Slice",
        make_inputs=_x(5, 6, 2)(_i64(-1, 1), _i64(-100, 5), _i64(0, 1), _i64(-2, 2)),
        wrt=(0,),
        opset=13,
        variant="neg_steps",
    ),
    # a start below -dim with a negative step (clamped to 0 by the spec, empty in onnx.reference):
    # tests/engine/test_shape_indexing.py checks it against onnxruntime
    OpCase(
        "Slice", make_inputs=_x(4, 6)(_i64(2), _i64(2**62), _i64(-1)), wrt=(0,), opset=13, variant="huge_end"
    ),
    OpCase("Squeeze", make_inputs=_x(2, 1, 3, 1)(_i64(1, -1)), wrt=(0,), opset=13),
    OpCase("Squeeze", [(1, 3, 1)], opset=13, variant="all"),
    OpCase("Unsqueeze", make_inputs=_x(2, 3)(_i64(0, -1)), wrt=(0,), opset=13),
    OpCase("Unsqueeze", make_inputs=_x(2, 3)(_i64(3, 1)), wrt=(0,), opset=13, variant="unsorted"),
    OpCase("Flatten", [(2, 3, 4)], attrs={"axis": 2}),
    OpCase("Flatten", [(2, 3, 4)], attrs={"axis": 0}, variant="axis0"),
    OpCase("Flatten", [(2, 3, 4)], attrs={"axis": -1}, variant="neg_axis"),
    OpCase("Expand", make_inputs=_x(3, 1)(_i64(2, 3, 4)), wrt=(0,)),
    OpCase("Expand", make_inputs=_x(2, 3)(_i64(3)), wrt=(0,), variant="smaller_shape"),
    OpCase("Shape", [(2, 3, 4)], grad=False),
    OpCase("Shape", [(2, 3, 4, 5)], attrs={"start": 1, "end": -1}, grad=False, variant="start_end"),
    OpCase("Size", [(2, 3, 4)], grad=False),
    OpCase("Constant", attrs={"value_floats": [1.0, 2.5]}, make_inputs=lambda rng, dt: [], grad=False),
    OpCase("Constant", attrs={"value_int": 7}, make_inputs=lambda rng, dt: [], grad=False, variant="int"),
    OpCase(
        "Constant",
        attrs={"value": numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(2, 3))},
        make_inputs=lambda rng, dt: [],
        grad=False,
        variant="tensor",
    ),
    OpCase("ConstantOfShape", make_inputs=lambda rng, dt: [_i64(2, 3)], grad=False),
    OpCase(
        "ConstantOfShape",
        make_inputs=lambda rng, dt: [_i64(3)],
        attrs={"value": numpy_helper.from_array(np.array([5], dtype=np.int32))},
        grad=False,
        variant="int32",
    ),
    OpCase("Range", make_inputs=lambda rng, dt: [np.array(v, dtype=dt) for v in (1.0, 4.0, 0.5)], grad=False),
    OpCase(
        "Range",
        make_inputs=lambda rng, dt: [np.array(v, dtype=np.int64) for v in (10, -3, -4)],
        grad=False,
        variant="int_neg",
    ),
    OpCase("Tile", make_inputs=_x(2, 3)(_i64(2, 3)), wrt=(0,)),
    OpCase("Pad", make_inputs=_x(2, 3)(_i64(1, 2), None, np.array([1], np.int32)), wrt=(0,), opset=18,
           variant="int32_axes", ort_skip="onnxruntime's shape inference refuses int32 axes"),
    OpCase("Pad", make_inputs=_x(3, 4)(_i64(1, 2), None, np.array([-1], np.int32)), attrs={"mode": "reflect"},
           wrt=(0,), opset=18, variant="int32_axes_reflect",
           ort_skip="onnxruntime's shape inference refuses int32 axes"),
    OpCase("Tile", make_inputs=_x(2, 1, 3)(_i64(1, 4, 1)), wrt=(0,), variant="3d"),
    OpCase("Pad", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (2, 3)).astype(dt), _i64(1, 0, 2, 1),
                                               np.array(1.5, dt)], wrt=(0, 2), opset=13),
    OpCase("Pad", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (2, 3)).astype(dt), _i64(1, 0, 2, 1),
                                               np.array([1.5], dt)], wrt=(0, 2), opset=13,
           variant="value_1d"),
    OpCase("Pad", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (3, 4)).astype(dt), _i64(2, 1, 1, 3),
                                               np.array(0.5, dt)], attrs={"mode": "edge"}, wrt=(0, 2),
           opset=13, variant="edge_value"),
    OpCase(
        "Pad",
        make_inputs=_x(3, 4)(_i64(2, 1, 1, 3)),
        attrs={"mode": "reflect"},
        wrt=(0,),
        opset=13,
        variant="reflect",
    ),
    OpCase(
        "Pad",
        make_inputs=_x(3, 4)(_i64(2, 1, 1, 3)),
        attrs={"mode": "edge"},
        wrt=(0,),
        opset=13,
        variant="edge",
    ),
    OpCase(
        "Pad",
        make_inputs=_x(3, 4)(_i64(2, 1, 1, 3)),
        attrs={"mode": "wrap"},
        wrt=(0,),
        opset=19,
        variant="wrap",
    ),
    OpCase("Pad", make_inputs=_x(2, 3, 4)(_i64(1, 2), None, _i64(-1)), wrt=(0,), opset=18, variant="axes"),
    # negative pads: onnx.reference cannot run them; see tests/engine/test_shape_indexing.py
    OpCase("DepthToSpace", [(1, 8, 2, 3)], attrs={"blocksize": 2}),
    OpCase("DepthToSpace", [(2, 8, 2, 2)], attrs={"blocksize": 2, "mode": "CRD"}, variant="crd"),
    OpCase("SpaceToDepth", [(2, 2, 4, 6)], attrs={"blocksize": 2}),
    OpCase(
        "ReverseSequence",
        make_inputs=_x(4, 3, 2)(_i64(4, 1, 3)),
        attrs={"batch_axis": 1, "time_axis": 0},
        wrt=(0,),
    ),
    OpCase(
        "ReverseSequence",
        make_inputs=_x(3, 5)(_i64(2, 5, 0)),
        attrs={"batch_axis": 0, "time_axis": 1},
        wrt=(0,),
        variant="batch_first",
    ),
    OpCase("EyeLike", [(3, 4)], attrs={"k": 1}, grad=False),
    OpCase("EyeLike", [(4, 3)], attrs={"k": -1, "dtype": 7}, grad=False, variant="int64"),
    OpCase("Trilu", [(2, 4, 5)]),
    OpCase(
        "Trilu",
        make_inputs=_x(4, 5)(np.array(-1, dtype=np.int64)),
        attrs={"upper": 0},
        wrt=(0,),
        variant="lower_k",
    ),
]

# gradient rows (onnxtrain/autodiff/rules/shape.py): more shapes, attributes, opsets and index edge cases
CASES += [
    OpCase("Reshape", make_inputs=_x(2, 3, 4)(_i64(3, 1, -1)), wrt=(0,), opset=21, variant="grad_opset21"),
    OpCase("Transpose", [(3, 5)], variant="grad_2d"),
    OpCase("Transpose", [(2, 3, 4)], attrs={"perm": [2, 0, 1]}, opset=21, variant="grad_perm201"),
    OpCase(
        "Concat",
        [(2, 3, 1), (2, 3, 4), (2, 3, 2)],
        attrs={"axis": -1},
        wrt=(1,),
        opset=18,
        variant="grad_wrt_middle",
    ),
    OpCase("Concat", [(1, 4), (3, 4)], attrs={"axis": 0}, opset=21, variant="grad_axis0"),
    OpCase(
        "Split",
        [(2, 9)],
        attrs={"axis": -1, "num_outputs": 3},
        n_outputs=3,
        grad_outputs=(0, 2),
        opset=18,
        variant="grad_unused_output",
    ),
    OpCase(
        "Split",
        make_inputs=_x(5, 2, 3)(_i64(1, 4)),
        n_outputs=2,
        grad_outputs=(1,),
        wrt=(0,),
        opset=18,
        variant="grad_sizes_one_used",
    ),
    # unit steps (Pad path): negative starts, huge ends, empty ranges, negative axes, int32 indices
    OpCase(
        "Slice",
        make_inputs=_x(4, 5, 3)(_i64(-3, 1), _i64(2**62, -1), _i64(0, -1)),
        wrt=(0,),
        opset=18,
        variant="grad_neg_axes",
    ),
    OpCase(
        "Slice",
        make_inputs=_x(4, 5)(_i64(-100, 3), _i64(2, -(2**62)), _i64(0, 1)),
        wrt=(0,),
        variant="grad_huge_and_empty",
    ),
    OpCase(
        "Slice",
        make_inputs=_x(3, 6)(
            np.array([-4], dtype=np.int32), np.array([100], dtype=np.int32), np.array([1], dtype=np.int32)
        ),
        wrt=(0,),
        variant="grad_int32",
    ),
    OpCase("Slice", make_inputs=_x(4, 3)(_i64(1), _i64(3)), wrt=(0,), opset=18, variant="grad_no_axes"),
    OpCase(
        "Slice",
        make_inputs=_x(5, 4)(_i64(0, 1), _i64(4, 3), _i64(0, 1), _i64(1, 1)),
        wrt=(0,),
        variant="grad_unit_steps",
    ),
    # steps (iota trick): 2 and -2 with a huge negative end, -3 from the end
    OpCase(
        "Slice",
        make_inputs=_x(7, 6)(_i64(1, -1), _i64(7, -(2**62)), _i64(0, 1), _i64(2, -2)),
        wrt=(0,),
        opset=18,
        variant="grad_steps_2_neg2",
    ),
    OpCase(
        "Slice",
        make_inputs=_x(2, 8)(_i64(-1), _i64(-9), _i64(-1), _i64(-3)),
        wrt=(0,),
        variant="grad_step_neg3",
    ),
    OpCase("Squeeze", make_inputs=_x(1, 4, 1)(_i64(0)), wrt=(0,), opset=21, variant="grad_one_axis"),
    OpCase("Unsqueeze", make_inputs=_x(3)(_i64(-1, 0)), wrt=(0,), opset=21, variant="grad_neg"),
    OpCase("Flatten", [(2, 3, 2, 2)], attrs={"axis": 1}, opset=21, variant="grad_4d"),
    OpCase("Expand", make_inputs=_x(3, 1, 5)(_i64(2, 3, 4, 5)), wrt=(0,), variant="grad_lead_and_inner"),
    OpCase("Expand", make_inputs=_x(1, 4)(_i64(3, 1)), wrt=(0,), opset=18, variant="grad_both_broadcast"),
    OpCase("Tile", make_inputs=_x(5)(_i64(3)), wrt=(0,), variant="grad_1d"),
    OpCase("Tile", make_inputs=_x(2, 3, 2)(_i64(2, 1, 3)), wrt=(0,), opset=18, variant="grad_mixed"),
    OpCase(
        "Pad",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (2, 3, 4)).astype(dt),
            _i64(1, 2, 0, 3),
            np.array(0.5, dtype=dt),
            _i64(-1, 0),
        ],
        wrt=(0,),
        opset=18,
        variant="grad_axes_value",
    ),
    OpCase("Pad", make_inputs=_x(3, 4)(_i64(0, 0, 0, 0)), wrt=(0,), variant="grad_zero_pads"),
    OpCase(
        "Pad",
        make_inputs=_x(2, 4, 5)(_i64(2, 3, 1, 2), None, _i64(2, 1)),
        attrs={"mode": "reflect"},
        wrt=(0,),
        opset=18,
        variant="grad_reflect_axes",
    ),
    OpCase(
        "Pad",
        make_inputs=_x(3, 2)(_i64(3, 4, 2, 5)),
        attrs={"mode": "edge"},
        wrt=(0,),
        opset=18,
        variant="grad_edge_wide",
    ),
    OpCase(
        "Pad",
        make_inputs=_x(2, 3, 4)(_i64(0, 1, 2, 0, 2, 1)),
        attrs={"mode": "wrap"},
        wrt=(0,),
        opset=21,
        variant="grad_wrap_3d",
    ),
    OpCase("DepthToSpace", [(1, 18, 2, 2)], attrs={"blocksize": 3}, variant="grad_b3"),
    OpCase("DepthToSpace", [(2, 9, 1, 2)], attrs={"blocksize": 3, "mode": "CRD"}, variant="grad_crd_b3"),
    OpCase("SpaceToDepth", [(1, 2, 6, 3)], attrs={"blocksize": 3}, variant="grad_b3"),
    OpCase(
        "ReverseSequence",
        make_inputs=_x(3, 4, 2)(_i64(1, 4, 2)),
        attrs={"batch_axis": 0, "time_axis": 1},
        wrt=(0,),
        variant="grad_3d",
    ),
    OpCase("Trilu", make_inputs=_x(2, 3, 5)(np.array(2, dtype=np.int64)), wrt=(0,), variant="grad_upper_k2"),
    OpCase(
        "Trilu",
        make_inputs=_x(5, 3)(np.array(-1, dtype=np.int64)),
        attrs={"upper": 0},
        wrt=(0,),
        variant="grad_lower_tall",
    ),
]

# CenterCropPad: crops and pads (odd differences put the extra element at the end), with and without axes
CASES += [
    OpCase("CenterCropPad", make_inputs=_x(5, 4, 3)(_i64(3, 7, 3)), wrt=(0,), opset=18),
    OpCase("CenterCropPad", make_inputs=_x(2, 6, 5)(_i64(3, 8)), attrs={"axes": [1, -1]}, wrt=(0,),
           opset=18, variant="axes_crop_pad_odd"),
    OpCase("CenterCropPad", make_inputs=_x(3, 4, 2)(_i64(6, 1)), attrs={"axes": [2, 0]}, wrt=(0,),
           opset=18, variant="axes_unordered"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    OpCase("Flatten", [(2, 3, 4)], attrs={"axis": 3}, opset=11, variant="grad_ort_axis_rank"),
    OpCase("Flatten", [(2, 3, 4)], attrs={"axis": -3}, opset=11, variant="grad_ort_neg_rank"),
    OpCase("Concat", [(2,), (2,), (2,)], attrs={"axis": 0}, variant="grad_ort_1d"),
    OpCase("Split", [(9, 5)], attrs={"axis": 0}, n_outputs=3, opset=11, variant="grad_ort_v11_equal"),
    OpCase("Squeeze", [(1, 2, 1, 3, 1)], attrs={"axes": [0, 2, 4]}, opset=11, variant="grad_ort_v11_axes"),
    OpCase("Unsqueeze", [(2, 3)], attrs={"axes": [0, 2, 4]}, opset=11, variant="grad_ort_v11_axes"),
    # Slice-10, the first taking its bounds as inputs: axes and steps given, the end past the size
    OpCase("Slice", make_inputs=_x(2, 4, 2)(_i64(1, 0), _i64(2, 9), _i64(0, 1), _i64(1, 2)), wrt=(0,),
           opset=10, variant="grad_ort_v10_steps"),
    OpCase("Tile", make_inputs=_x(2, 2, 3)(_i64(1, 1, 1)), wrt=(0,), opset=11, variant="grad_ort_ones"),
    OpCase("Expand", make_inputs=_x(2, 3, 1)(_i64(1, 1)), wrt=(0,), opset=11,
           variant="grad_ort_shorter_shape"),
]
