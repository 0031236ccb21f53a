"""Bias gradients summed while their input is still in cache.

A linear layer's gradient is, in the order autodiff writes it, ``dW = GEMM(dY, X)``, ``dX = GEMM(dY, W)``
and then ``db = ReduceSum(dY)``. By the time the sum runs, the two products have streamed X, W, dW and dX
through the caches and ``dY`` comes back from memory: in the bench MLP's step at batch 256 the first
layer's bias sum took 2-5× its time in cache. This pass moves such a ``ReduceSum`` up to just after the
step that makes ``dY``, ahead of the products between them. The same kernel on the same arrays: the same
bits; only the order of independent steps changes (the plan recomputes the frees afterwards).

The moved sum's result now lives while the products run, so only a small one moves: a sum over axis 0 of a
``dY`` that a ``Gemm`` among the products reads (so ``dY`` is 2-D and the result is one row of it at most).
A sum over other axes can be nearly as large as ``dY`` (a per-row bias ``(M, 1)`` of an ``(M, 2)`` Gemm gives
half of it); moved, it raised the plan's peak memory (``Plan.peak_bytes``) by that much.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnxtrain.engine.fusion.common import producers, static_axes
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

# the steps a sum may move ahead of: products, which read dY but neither write into it nor need the sum
PRODUCTS = frozenset({"Gemm", "MatMul", "FusedMatMulAdd", "FusedMatMulWeightGrad"})


def sum_early(plan: Plan, steps: list[Step]) -> list[Step]:
    """Move each ``ReduceSum`` that only products separate from the step making its data input to just
    after that step (module docstring)."""
    prod = producers(steps)
    after: dict[int, list[int]] = {}  # producer's index → the sums placed right after it, in order
    for k, st in enumerate(steps):
        p = _earliest(plan, steps, prod, k, st)
        if p is not None:
            after.setdefault(p, []).append(k)
    if not after:
        return steps
    moved = {k for ks in after.values() for k in ks}
    out: list[Step] = []
    for k, st in enumerate(steps):
        if k in moved:
            continue
        out.append(st)
        out.extend(steps[m] for m in after.get(k, ()))
    return out


def _earliest(plan: Plan, steps: list[Step], prod: dict[int, int], k: int, st: Step) -> int | None:
    """The index of the step a movable ``ReduceSum`` at ``k`` may follow at once, or None."""
    if st.node.op_type != "ReduceSum" or st.node.domain not in DEFAULT_DOMAINS or not st.inputs:
        return None
    data = st.inputs[0]
    p = prod.get(data)
    if data < 0 or p is None or p >= k - 1:
        return None
    # the other inputs (the axes) must be ready there: constants, graph inputs or made no later than p
    if any(s >= 0 and prod.get(s, -1) > p for s in st.inputs[1:]):
        return None
    if steps[p].node.op_type == "ReduceSum":  # a sum of a sum: left where it is
        return None
    if not all(steps[m].node.op_type in PRODUCTS for m in range(p + 1, k)):
        return None
    return p if _sums_rows_of_2d(plan, steps, p, k, st) else None


def _sums_rows_of_2d(plan: Plan, steps: list[Step], p: int, k: int, st: Step) -> bool:
    """True when the sum at ``k`` reduces axis 0 of its input (fixed axes) and a ``Gemm`` between ``p`` and
    ``k`` reads that input (so it is 2-D): its result is at most one row of it."""
    axes = static_axes(plan, st)
    if not axes or not any(a in (0, -2) for a in axes):
        return False
    data = st.inputs[0]
    return any(steps[m].node.op_type == "Gemm" and steps[m].node.domain in DEFAULT_DOMAINS
               and data in steps[m].inputs[:2] for m in range(p + 1, k))
