"""Op table rows for the reduction kernels (onnxtrain/engine/kernels/reduce.py)."""

from __future__ import annotations

import numpy as np

from tests.op_cases import OpCase

_ALL = ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
        "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")
_POSITIVE = {"ReduceLogSum"}  # log of a sum: keep the inputs positive


def _with_axes(shape: tuple[int, ...], axes: tuple[int, ...] | None, low: float, high: float):
    def make(rng: np.random.Generator, dt) -> list:
        x = rng.uniform(low, high, shape).astype(dt)
        return [x] if axes is None else [x, np.array(axes, dtype=np.int64)]

    return make


def _rows(op: str) -> list[OpCase]:
    low, high = (0.5, 2.0) if op in _POSITIVE else (-2.0, 2.0)
    new = 13 if op == "ReduceSum" else 18  # the first opset taking axes as an input
    return [
        OpCase(op, make_inputs=_with_axes((2, 3, 4), (1,), low, high), opset=new, wrt=(0,)),
        OpCase(op, make_inputs=_with_axes((2, 3, 4), (0, -1), low, high), attrs={"keepdims": 0},
               opset=new, wrt=(0,), variant="two_axes_nokeep"),
        OpCase(op, make_inputs=_with_axes((3, 4), None, low, high), opset=new, wrt=(0,),
               variant="all_keep"),
        OpCase(op, make_inputs=_with_axes((3, 4), None, low, high), attrs={"keepdims": 0}, opset=new,
               wrt=(0,), variant="all_scalar"),
        OpCase(op, make_inputs=_with_axes((3, 4), (), low, high), attrs={"noop_with_empty_axes": 1},
               opset=new, wrt=(0,), variant="noop"),
        OpCase(op, [(2, 3, 4)], attrs={"axes": [-2], "keepdims": 0}, low=low, high=high, opset=new - 1,
               variant="axes_attr"),
        OpCase(op, [(2, 3)], low=low, high=high, opset=new - 1, variant="attr_default_axes"),
    ]


CASES = [row for op in _ALL for row in _rows(op)]


# gradient rows (autodiff/rules/reduce.py)
def _two_way_ties(shape: tuple[int, ...], largest: bool):
    """Rows (last axis) whose max (or min) is attained exactly twice: the gradient splits evenly."""

    def make(rng: np.random.Generator, dt) -> list:
        x = rng.permutation(np.arange(np.prod(shape), dtype=np.float64)).reshape(shape) / 4 - 1
        flat = x.reshape(-1, shape[-1])
        for row in flat:
            k = int(np.argmax(row) if largest else np.argmin(row))
            row[(k + 1) % shape[-1]] = row[k]
        return [flat.reshape(shape).astype(dt)]

    return make


def _grad_rows(op: str) -> list[OpCase]:
    low, high = (0.5, 2.0) if op in _POSITIVE else (-2.0, 2.0)
    new = 13 if op == "ReduceSum" else 18
    return [
        OpCase(op, [(3, 4)], attrs={"noop_with_empty_axes": 1}, low=low, high=high, opset=new,
               variant="grad_noop_no_axes"),
        OpCase(op, [(2, 3, 2, 2)], attrs={"axes": [0, 2], "keepdims": 1}, low=low, high=high,
               opset=new - 1, variant="grad_attr_two_axes_keep"),
        OpCase(op, make_inputs=_with_axes((2, 3, 4), (2, 0, 1), low, high), attrs={"keepdims": 0},
               opset=new, wrt=(0,), variant="grad_all_listed_nokeep"),
    ]


CASES += [row for op in _ALL for row in _grad_rows(op)]
CASES += [
    OpCase("ReduceMax", make_inputs=_two_way_ties((3, 4), True), attrs={"axes": [-1]}, variant="grad_ties"),
    OpCase("ReduceMin", make_inputs=_two_way_ties((2, 2, 5), False), attrs={"axes": [2], "keepdims": 0},
           variant="grad_ties_nokeep"),
]


def _with_zeros(shape: tuple[int, ...]):
    """Rows (last axis) with no zero, one zero and two zeros, in turn: the product's gradient is the
    product of the other elements, 0 for every element of a row with two zeros."""

    def make(rng: np.random.Generator, dt) -> list:
        x = rng.uniform(-2.0, 2.0, shape)
        flat = x.reshape(-1, shape[-1])
        for i, row in enumerate(flat):
            row[rng.permutation(shape[-1])[: i % 3]] = 0.0
        return [flat.reshape(shape).astype(dt)]

    return make


CASES += [
    OpCase("ReduceProd", make_inputs=_with_zeros((3, 2, 5)), attrs={"axes": [-1]}, opset=17,
           variant="grad_zeros"),
    OpCase("ReduceProd", make_inputs=_with_zeros((6, 4)), attrs={"keepdims": 0}, opset=17,
           variant="grad_zeros_all"),
    OpCase("ReduceProd", make_inputs=_with_zeros((3, 4)), attrs={"noop_with_empty_axes": 1}, opset=18,
           variant="grad_zeros_noop"),
]


# onnxruntime's gradient checks (orttraining/test/gradient/gradient_ops_test.cc): the shapes and attributes
# of theirs that the rows above did not have
CASES += [
    # rows of zeros: the norm is not differentiable there; its central differences are 0, as the rule gives
    OpCase("ReduceL2", make_inputs=lambda rng, dt: [np.array([[1, 1], [0, 0], [3, 0], [0, 0]], dt)],
           attrs={"axes": [-1]}, opset=11, variant="grad_ort_zero_rows"),
    OpCase("ReduceLogSumExp", [(4, 3, 2)], attrs={"axes": [-2, -1], "keepdims": 0}, opset=11,
           variant="grad_ort_v11_neg_axes"),
    OpCase("ReduceMean", [(4, 3, 2)], attrs={"axes": [0, 1, 2], "keepdims": 0}, opset=11,
           variant="grad_ort_v11_all_listed"),
]
