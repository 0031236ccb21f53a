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
