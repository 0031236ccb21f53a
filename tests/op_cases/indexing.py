"""Op table rows for the indexing kernels (onnxtrain/engine/kernels/indexing.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase


def _i64(v) -> np.ndarray:
    return np.array(v, dtype=np.int64)


def _x(*shape: int):
    """An input maker: one float tensor of ``shape`` followed by the fixed inputs given next."""

    def with_extra(*extra):
        return lambda rng, dt: [rng.uniform(-2, 2, shape).astype(dt), *extra]

    return with_extra


def _scatter(dshape, ishape, high):
    """data, random (possibly negative, repeated) indices in [-high, high), updates."""

    def make(rng, dt):
        idx = rng.integers(-high, high, ishape).astype(np.int64)
        return [rng.uniform(-2, 2, dshape).astype(dt), idx, rng.uniform(-2, 2, ishape).astype(dt)]

    return make


def _scatter_nd_unique(dshape, n, ushape):
    """ScatterND inputs with distinct index tuples over the first two axes (for reduction=none)."""

    def make(rng, dt):
        flat = rng.permutation(dshape[0] * dshape[1])[:n]
        idx = np.stack([flat // dshape[1], flat % dshape[1] - dshape[1]], axis=-1).astype(np.int64)
        return [rng.uniform(-2, 2, dshape).astype(dt), idx, rng.uniform(-2, 2, ushape).astype(dt)]

    return make


def _perm_indices(dshape, axis):
    """ScatterElements inputs whose indices are a permutation along ``axis`` (no duplicates)."""

    def make(rng, dt):
        idx = np.argsort(rng.uniform(size=dshape), axis=axis).astype(np.int64)
        return [rng.uniform(-2, 2, dshape).astype(dt), idx, rng.uniform(-2, 2, dshape).astype(dt)]

    return make


def _one_per_row(rows, cols, negative=False):
    """ScatterElements inputs with one index per row along axis 1 (a cross-entropy gradient's form);
    ``negative``: one index counted from the end."""

    def make(rng, dt):
        idx = rng.integers(0, cols, (rows, 1)).astype(np.int64)
        if negative:
            idx[1, 0] = -1
        return [rng.uniform(-2, 2, (rows, cols)).astype(dt), idx, rng.uniform(-2, 2, (rows, 1)).astype(dt)]

    return make


def _cache(past, update, write_indices=None):
    """TensorScatter inputs: a cache of shape ``past``, an update of shape ``update``, the given write
    indices."""

    def make(rng, dt):
        vals = [rng.uniform(-2, 2, past).astype(dt), rng.uniform(-2, 2, update).astype(dt)]
        return vals if write_indices is None else [*vals, _i64(write_indices)]

    return make


def _zeros_along(shape, axis, where):
    """CumProd inputs: x of ``shape`` with exact zeros along ``axis`` at ``where`` (one tuple of positions per
    lane across the other axes, cycled), and the axis."""

    def make(rng, dt):
        x = np.moveaxis(rng.uniform(-2, 2, shape).astype(dt), axis, -1)
        lanes = x.reshape(-1, x.shape[-1]).copy()
        for k in range(lanes.shape[0]):
            lanes[k, list(where[k % len(where)])] = 0
        return [np.ascontiguousarray(np.moveaxis(lanes.reshape(x.shape), -1, axis)), _i64(axis)]

    return make


CASES = [
    OpCase("Gather", make_inputs=_x(5, 4)(_i64([[0, 4, -1], [2, 2, -5]])), wrt=(0,)),
    OpCase("Gather", make_inputs=_x(3, 5, 2)(_i64([4, 0, -2])), attrs={"axis": 1}, wrt=(0,), variant="axis1"),
    OpCase("Gather", make_inputs=_x(3, 5)(_i64(-1)), attrs={"axis": 1}, wrt=(0,), variant="scalar_index"),
    OpCase("GatherElements", make_inputs=_x(3, 4)(_i64([[0, -1, 2, 2], [1, 0, -3, 1]])), wrt=(0,)),
    OpCase(
        "GatherElements",
        make_inputs=_x(2, 4, 2)(_i64([[[3, 0]], [[-1, 2]]])),
        attrs={"axis": 1},
        wrt=(0,),
        variant="axis1",
    ),
    OpCase("GatherND", make_inputs=_x(3, 4, 2)(_i64([[0, 1], [2, -1], [1, 3]])), wrt=(0,)),
    OpCase("GatherND", make_inputs=_x(1, 0)(_i64([0])), wrt=(0,), variant="empty_inner"),
    OpCase("GatherND", make_inputs=_x(3, 1, 0)(_i64([[0], [0], [0]])), attrs={"batch_dims": 1}, wrt=(0,),
           variant="empty_inner_batch_dims"),
    OpCase("ScatterND", make_inputs=lambda rng, dt: [rng.uniform(-2, 2, (4, 0)).astype(dt), _i64([[1], [3]]),
                                                     np.zeros((2, 0), dt)], wrt=(0, 2), opset=16,
           variant="empty_inner"),
    OpCase("GatherND", make_inputs=_x(3, 4, 2)(_i64([[[1], [0]], [[2], [2]]])), wrt=(0,), variant="k1"),
    OpCase(
        "GatherND",
        make_inputs=_x(2, 4, 3)(_i64([[[1, 2], [3, 0]], [[0, 0], [-1, 1]]])),
        attrs={"batch_dims": 1},
        wrt=(0,),
        variant="batch_dims",
    ),
    OpCase("ScatterElements", make_inputs=_perm_indices((3, 4), 1), attrs={"axis": 1}, wrt=(0, 2), opset=16),
    OpCase(
        "ScatterElements",
        make_inputs=_scatter((4, 3), (6, 3), 4),
        attrs={"reduction": "add"},
        wrt=(0, 2),
        opset=16,
        variant="add_dups",
    ),
    OpCase(
        "ScatterElements",
        make_inputs=_scatter((2, 5, 3), (2, 4, 2), 5),
        attrs={"axis": 1, "reduction": "mul"},
        wrt=(0, 2),
        opset=16,
        variant="mul_smaller",
    ),
    OpCase(
        "ScatterElements",
        make_inputs=_scatter((4, 3), (5, 3), 4),
        attrs={"reduction": "max"},
        wrt=(0, 2),
        opset=18,
        variant="max",
    ),
    OpCase(
        "ScatterElements",
        make_inputs=_scatter((4, 3), (5, 3), 4),
        attrs={"reduction": "min"},
        wrt=(0, 2),
        opset=18,
        variant="min",
    ),
    *(
        OpCase(
            "ScatterElements",
            make_inputs=_one_per_row(6, 5, negative=neg),
            attrs={"axis": 1, "reduction": red},
            wrt=(0, 2),
            opset=18,
            variant=f"one_per_row_{red}" + ("_negative" if neg else ""),
        )
        for red, neg in (("none", False), ("add", False), ("mul", False), ("max", False), ("min", False),
                         ("add", True))
    ),
    OpCase("ScatterND", make_inputs=_scatter_nd_unique((4, 3, 2), 5, (5, 2)), wrt=(0, 2), opset=16),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (5, 3)).astype(dt),
            rng.integers(-5, 5, (200, 1)).astype(np.int64),
            rng.uniform(-2, 2, (200, 3)).astype(dt),
        ],
        attrs={"reduction": "add"},
        wrt=(0, 2),
        opset=16,
        variant="add_many_dups",
    ),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (4, 3)).astype(dt),
            rng.integers(-4, 4, (6, 1)).astype(np.int64),
            rng.uniform(-2, 2, (6, 3)).astype(dt),
        ],
        attrs={"reduction": "mul"},
        wrt=(0, 2),
        opset=16,
        variant="mul",
    ),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (4, 3)).astype(dt),
            rng.integers(-4, 4, (300, 2)).astype(np.int64) % np.array([4, 3]),
            rng.uniform(-2, 2, (300,)).astype(dt),
        ],
        attrs={"reduction": "max"},
        wrt=(0, 2),
        opset=18,
        variant="max_elements",
    ),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (6, 2)).astype(dt),
            rng.integers(0, 6, (150, 1)).astype(np.int64),
            rng.uniform(-2, 2, (150, 2)).astype(dt),
        ],
        attrs={"reduction": "min"},
        wrt=(0, 2),
        opset=18,
        variant="min_rows",
    ),
    OpCase(
        "OneHot",
        make_inputs=lambda rng, dt: [
            _i64([[0, 3, -1], [5, -5, 2]]),
            _i64(5),
            np.array([-1.0, 2.0], dtype=dt),
        ],
        grad=False,
    ),
    OpCase(
        "OneHot",
        make_inputs=lambda rng, dt: [
            _i64([1, 0, 3]),
            np.array(4.0, dtype=dt),
            np.array([0.0, 1.0], dtype=dt),
        ],
        attrs={"axis": 0},
        grad=False,
        variant="axis0",
    ),
    OpCase(
        "TensorScatter", make_inputs=_cache((2, 3, 6, 4), (2, 3, 2, 4), [1, 4]), wrt=(0, 1), opset=24
    ),
    OpCase(
        "TensorScatter",
        make_inputs=_cache((2, 5, 3), (2, 2, 3)),
        attrs={"axis": 1},
        wrt=(0, 1),
        opset=24,
        variant="no_write_indices",
    ),
    OpCase(
        "TensorScatter",
        make_inputs=_cache((3, 5, 2), (3, 3, 2), [4, 0, 3]),
        attrs={"mode": "circular", "axis": 1},
        wrt=(0, 1),
        opset=24,
        variant="circular",
    ),
    OpCase(
        "TensorScatter",
        make_inputs=_cache((2, 2, 4, 3), (2, 2, 3, 3)),
        attrs={"mode": "circular", "axis": 2},
        wrt=(0, 1),
        opset=24,
        variant="circular_no_write_indices",
    ),
    OpCase(
        "TensorScatter",
        make_inputs=lambda rng, dt: [rng.integers(0, 9, (2, 3, 4)).astype(np.int32),
                                     rng.integers(0, 9, (2, 3, 2)).astype(np.int32), _i64([5, 2])],
        attrs={"mode": "circular", "axis": -1},
        grad=False,
        opset=24,
        variant="circular_int32_index_past_end",
    ),
    OpCase("NonZero", make_inputs=lambda rng, dt: [(rng.uniform(size=(3, 4)) > 0.5).astype(dt)], grad=False),
    OpCase("CumSum", make_inputs=_x(3, 4)(_i64(1)), wrt=(0,)),
    OpCase(
        "CumSum",
        make_inputs=_x(3, 4)(_i64(-2)),
        attrs={"exclusive": 1, "reverse": 1},
        wrt=(0,),
        variant="excl_rev",
    ),
    OpCase(
        "CumSum",
        make_inputs=_x(2, 5)(np.array(1, dtype=np.int32)),
        attrs={"exclusive": 1},
        wrt=(0,),
        variant="exclusive",
    ),
    OpCase("CumProd", make_inputs=_x(3, 4)(_i64(1)), wrt=(0,), opset=26),
    OpCase(
        "CumProd",
        make_inputs=_x(3, 4)(np.array(-2, dtype=np.int32)),
        attrs={"exclusive": 1, "reverse": 1},
        wrt=(0,),
        opset=26,
        variant="excl_rev",
    ),
    OpCase(
        "CumProd",
        make_inputs=lambda rng, dt: [rng.integers(-3, 4, (2, 5)).astype(np.int64), _i64(-1)],
        attrs={"exclusive": 1},
        grad=False,
        opset=26,
        variant="int64_exclusive",
    ),
    OpCase("TopK", make_inputs=_x(3, 6)(_i64([3])), n_outputs=2, wrt=(0,), grad_outputs=(0,)),
    OpCase(
        "TopK",
        make_inputs=lambda rng, dt: [rng.integers(0, 3, (4, 7)).astype(dt), _i64([4])],
        attrs={"largest": 0, "axis": 1},
        n_outputs=2,
        grad=False,  # ties at the top-k boundary:
        variant="smallest_ties",
    ),  # not differentiable there
    OpCase(
        "TopK",
        make_inputs=lambda rng, dt: [rng.integers(0, 3, (6, 3)).astype(dt), _i64([4])],
        attrs={"axis": 0},
        n_outputs=2,
        grad=False,
        variant="largest_ties_axis0",
    ),  # forward-only: ties
    OpCase("ArgMax", [(3, 4, 5)], attrs={"axis": 1}, grad=False),
    OpCase(
        "ArgMax",
        make_inputs=lambda rng, dt: [rng.integers(0, 3, (4, 6)).astype(dt)],
        attrs={"axis": -1, "keepdims": 0, "select_last_index": 1},
        grad=False,
        variant="last_index",
    ),
    OpCase("ArgMin", [(3, 4)], attrs={"axis": 0, "keepdims": 0}, grad=False),
    OpCase(
        "ArgMin",
        make_inputs=lambda rng, dt: [rng.integers(0, 3, (4, 6)).astype(dt)],
        attrs={"axis": 1, "select_last_index": 1},
        grad=False,
        variant="last_index",
    ),
    OpCase("Compress", make_inputs=_x(3, 4)(np.array([True, False, True])), attrs={"axis": 0}, wrt=(0,)),
    OpCase(
        "Compress", make_inputs=_x(3, 4)(np.array([False, True, True, False, True])), wrt=(0,), variant="flat"
    ),
    OpCase(
        "Compress",
        make_inputs=_x(3, 4)(np.array([True, False])),
        attrs={"axis": -1},
        wrt=(0,),
        variant="short_condition",
    ),
    OpCase(
        "Unique",
        make_inputs=lambda rng, dt: [rng.integers(0, 4, (10,)).astype(dt)],
        n_outputs=4,
        attrs={"sorted": 0},
        grad=False,
    ),
    OpCase(
        "Unique",
        make_inputs=lambda rng, dt: [rng.integers(0, 2, (5, 2)).astype(dt)],
        n_outputs=4,
        attrs={"axis": 0},
        grad=False,
        variant="axis0",
    ),
]


def _with_zeros(make, slot: int, n_zero: int):
    """``make``'s inputs with the first ``n_zero`` elements of input ``slot`` set to exactly 0."""

    def wrapped(rng, dt):
        vals = make(rng, dt)
        vals[slot].reshape(-1)[:n_zero] = 0
        return vals

    return wrapped


# gradient rows (onnxtrain/autodiff/rules/indexing.py): duplicate and negative indices, other axes
CASES += [
    OpCase(
        "Gather",
        make_inputs=_x(3, 4)(_i64([[-1, 3, 3], [0, -1, 1]])),
        attrs={"axis": -1},
        wrt=(0,),
        variant="grad_last_axis_dups",
    ),
    OpCase(
        "Gather",
        make_inputs=_x(2, 3, 4, 2)(_i64([[2, 2], [-3, 0]])),
        attrs={"axis": 2},
        wrt=(0,),
        opset=18,
        variant="grad_axis2_4d",
    ),
    OpCase("Gather", make_inputs=_x(4, 3)(_i64(-2)), wrt=(0,), variant="grad_scalar_axis0"),
    OpCase(
        "Gather",
        make_inputs=_x(5, 2)(np.array([1, 1, -4, 4, 1], dtype=np.int32)),
        wrt=(0,),
        opset=21,
        variant="grad_int32_dups",
    ),
    OpCase(
        "GatherElements",
        make_inputs=_x(2, 3)(_i64([[2, -1, 0], [1, 1, -3]])),
        attrs={"axis": -1},
        wrt=(0,),
        variant="grad_neg_axis_dups",
    ),
    OpCase(
        "GatherND",
        make_inputs=_x(3, 4)(_i64([[0, 1], [0, 1], [-1, -4], [2, 3]])),
        wrt=(0,),
        opset=18,
        variant="grad_full_dups",
    ),
    OpCase(
        "GatherND",
        make_inputs=_x(2, 3, 4)(_i64([[[2], [2], [-1]], [[0], [1], [0]]])),
        attrs={"batch_dims": 1},
        wrt=(0,),
        variant="grad_batch_dims_dups",
    ),
    OpCase(
        "ScatterElements",
        make_inputs=_perm_indices((3, 4), 0),
        attrs={"axis": -2},
        wrt=(0, 2),
        opset=18,
        variant="grad_none_axis0",
    ),
    OpCase(
        "ScatterElements",
        make_inputs=_scatter((3, 5), (3, 6), 5),
        attrs={"axis": 1, "reduction": "add"},
        wrt=(0, 2),
        variant="grad_add_axis1",
    ),
    # reduction="mul" is multilinear, so the gradient at an update of exactly 0 is checkable
    OpCase(
        "ScatterElements",
        make_inputs=_with_zeros(_scatter((3, 2), (6, 2), 3), 2, 3),
        attrs={"reduction": "mul"},
        wrt=(0, 2),
        variant="grad_mul_zero_updates",
    ),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (3, 4)).astype(dt),
            _i64([[0, 1], [-1, 2], [1, -4]]),
            rng.uniform(-2, 2, (3,)).astype(dt),
        ],
        wrt=(0, 2),
        variant="grad_none_elements",
    ),
    OpCase(
        "ScatterND",
        make_inputs=lambda rng, dt: [
            rng.uniform(-2, 2, (3, 2, 2)).astype(dt),
            _i64([[0, 1], [0, 1], [-1, 0], [2, -2]]),
            rng.uniform(-2, 2, (4, 2)).astype(dt),
        ],
        attrs={"reduction": "add"},
        wrt=(0, 2),
        opset=18,
        variant="grad_add_k2",
    ),
    OpCase(
        "ScatterND",
        make_inputs=_with_zeros(
            lambda rng, dt: [
                rng.uniform(-2, 2, (3, 2)).astype(dt),
                _i64([[0], [0], [-1], [1], [0]]),
                rng.uniform(-2, 2, (5, 2)).astype(dt),
            ],
            2,
            3,
        ),
        attrs={"reduction": "mul"},
        wrt=(0, 2),
        variant="grad_mul_zero_updates",
    ),
    OpCase(
        "TopK",
        make_inputs=_x(5, 3)(_i64([2])),
        attrs={"axis": 0},
        n_outputs=2,
        wrt=(0,),
        grad_outputs=(0,),
        variant="grad_axis0",
    ),
    OpCase(
        "TopK",
        make_inputs=_x(2, 3, 5)(_i64([3])),
        attrs={"largest": 0, "axis": -1},
        n_outputs=2,
        wrt=(0,),
        grad_outputs=(0,),
        opset=18,
        variant="grad_smallest_3d",
    ),
    OpCase(
        "CumSum", make_inputs=_x(2, 3, 4)(_i64(-1)), attrs={"reverse": 1}, wrt=(0,), variant="grad_reverse"
    ),
    OpCase(
        "CumSum",
        make_inputs=_x(4, 3)(np.array(0, dtype=np.int32)),
        attrs={"exclusive": 1, "reverse": 1},
        wrt=(0,),
        opset=18,
        variant="grad_excl_rev_axis0",
    ),
    # CumProd with exact zeros: the gradient is multilinear in x, so central differences are exact there too
    OpCase("CumProd", make_inputs=_zeros_along((3, 5), 1, [(2,), (0,), (4,)]), opset=26, wrt=(0,),
           variant="grad_one_zero"),
    OpCase("CumProd", make_inputs=_zeros_along((3, 6), 1, [(1, 3), (0, 5), (2, 3)]), opset=26, wrt=(0,),
           variant="grad_two_zeros"),
    OpCase("CumProd", make_inputs=_zeros_along((4, 3), 0, [(1,), (0, 3), (2,)]), attrs={"exclusive": 1},
           opset=26, wrt=(0,), variant="grad_zeros_exclusive"),
    OpCase("CumProd", make_inputs=_zeros_along((2, 5), 1, [(3,), (1, 4)]), attrs={"reverse": 1}, opset=26,
           wrt=(0,), variant="grad_zeros_reverse"),
    OpCase("CumProd", make_inputs=_zeros_along((2, 7, 3), -2, [(6,), (0, 1), (3,), (2, 5)]),
           attrs={"exclusive": 1, "reverse": 1}, opset=26, wrt=(0,), variant="grad_zeros_excl_rev_axis_neg2"),
    # 13 elements: four doubling steps, the last partial
    OpCase("CumProd", make_inputs=_zeros_along((2, 13), -1, [(4,), (7, 12)]), opset=26, wrt=(0,),
           variant="grad_zeros_long_axis"),
    OpCase("CumProd", make_inputs=_x(1, 4)(_i64(0)), opset=26, wrt=(0,), variant="grad_axis_of_one"),
    OpCase(
        "Compress",
        make_inputs=_x(2, 3, 4)(np.array([False, True, True, True])),
        attrs={"axis": 2},
        wrt=(0,),
        variant="grad_axis2",
    ),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    OpCase("GatherND", make_inputs=_x(2, 2, 3)(_i64([[[1], [0]], [[2], [1]]])), attrs={"batch_dims": 2},
           wrt=(0,), opset=12, variant="grad_ort_batch_dims2"),
    OpCase("GatherND", make_inputs=_x(2, 2)(_i64([[1, 1], [1, 1]])), wrt=(0,), opset=12,
           variant="grad_ort_same_pair_twice"),
    OpCase("TopK", make_inputs=lambda rng, dt: [rng.permutation(8).reshape(2, 2, 2).astype(dt), _i64([1])],
           attrs={"axis": -2}, n_outputs=2, wrt=(0,), grad_outputs=(0,), opset=11,
           variant="grad_ort_v11_neg_axis"),
]
