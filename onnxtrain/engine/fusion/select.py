"""Where with a one-element condition computes only the branch it returns.

``Where(c, x, y)`` with ``c`` a single boolean is a choice between two whole tensors; when one branch is made
by an Add/Sub/Mul/Div step that nothing else reads, that step moves into the select and runs only when its
branch is chosen. The on-device training graph's gradient accumulator is this pattern,
``Where(reset, g, buffer + g)``: with the reset flag set (every step that calls ``lazy_reset_grad``) the
gradient is returned as it is, without the sum over every parameter and the select's own pass.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import consumers, make_step, producers, protected_slots
from onnxtrain.engine.registry import Attrs

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

LAZY_OPS = frozenset({"Add", "Sub", "Mul", "Div"})  # broadcasting binary ops: their shape is known beforehand


def fuse_lazy_selects(plan: Plan, steps: list[Step]) -> list[Step]:
    """``Where(c, x, y)`` whose ``x`` or ``y`` comes from a :data:`LAZY_OPS` step read by it alone → one step
    that runs that branch's step only when ``c`` (one element) picks it; any other condition runs both."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    drop: set[int] = set()
    replace: dict[int, Step] = {}
    for k, where in enumerate(steps):
        if where.node.op_type != "Where" or len(where.inputs) != 3 or where.inputs[0] < 0:
            continue
        for side in (1, 2):
            s = where.inputs[side]
            m = prod.get(s)
            if m is None or m in drop or cons.get(s) != [k] or s in kept or where.inputs[3 - side] == s:
                continue
            branch = steps[m]
            if branch.node.op_type not in LAZY_OPS or len(branch.inputs) != 2 or min(branch.inputs) < 0:
                continue
            replace[k] = make_step(plan, "LazySelect", [branch, where],
                                   (where.inputs[0], where.inputs[3 - side], *branch.inputs), where.outputs,
                                   _lazy_select(plan, branch, where, side))
            drop.add(m)
            break
    return [replace.get(k, st) for k, st in enumerate(steps) if k not in drop]


def _lazy_select(plan: Plan, branch: Step, where: Step, side: int) -> Callable:
    """The fused step's kernel; ``side`` 1: the lazy branch is taken when c is true, 2: when false."""

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        c, other, a, b = inputs
        flag = type(c) is np.ndarray and c.size == 1 and c.dtype == np.bool_ and all(
            type(v) is np.ndarray for v in (other, a, b))
        if flag:
            try:
                shape = np.broadcast_shapes(c.shape, other.shape, a.shape, b.shape)
            except ValueError:  # the unfused steps fail, naming their node
                flag = False
        if flag:
            lazy_chosen = bool(c.reshape(())) == (side == 1)
            if not lazy_chosen and other.shape == shape and other.dtype == np.result_type(a, b):
                return (other,)  # the chosen tensor itself, as an unfused Where's copy of it would be
        y = plan._call(branch, [a, b])[0]
        if flag and lazy_chosen and type(y) is np.ndarray and y.shape == shape and y.dtype == other.dtype:
            return (y,)
        pair = (y, other) if side == 1 else (other, y)
        return plan._call(where, [c, *pair])

    return run
