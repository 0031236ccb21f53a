"""Donated feeds: input arrays a caller gives up for one run, whose memory a step may write its outputs into.

A training step reads each weight and optimizer moment once more, in its update, and returns the new value;
the caller then drops the old array. ``Plan.run(..., donate=names)`` says so: an elementwise update may then
write the new values into the old arrays, slice by slice, instead of into fresh ones. That spares the
allocation and, more, the writes into memory that is not in cache (the MLP 784-512-512-10's training step,
medians of 10 interleaved processes: 2.15 → 1.93 ms at batch 64, 3.89 → 3.72 ms at 256). Results are the
same bits; only where they are stored changes. If a run fails after an update has run, the donated arrays
may already hold new values.

Donation is a permission. A step reuses a donated input only when the plan proved, when it was compiled,
that nothing reads the old contents afterwards (:func:`reusable_inputs`), and the run found the array to be
one the caller alone holds (:func:`donated_slots`); otherwise the output gets a fresh array, as without it.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Collection, Mapping
from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.thread_state import bound

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan

# ops whose outputs never share memory with their inputs (their kernels always allocate); the outputs of
# every other op are taken to be possible views of all its inputs
FRESH_OPS = frozenset({
    "Add", "Sub", "Mul", "Div", "MatMul", "Gemm", "Conv", "FusedMatMulAdd", "FusedMatMulWeightGrad",
})
_NONE: frozenset[int] = frozenset()
_local = threading.local()


def reusable_inputs(plan: Plan) -> dict[int, frozenset[int]]:
    """Step index → the graph-input slots that step may overwrite when donated.

    A graph input qualifies at the step of its last use when it is not an initializer or a graph output,
    the step reads it once, and no value that might be a view of it (through ops outside :data:`FRESH_OPS`)
    is read at that step or later or is a graph output.
    """
    inits = {s for s, _ in plan._init_values}
    outputs = set(plan._output_slots)
    inputs = [s for s in plan._input_slots if s not in inits and s not in outputs]
    steps = plan.steps
    last: dict[int, int] = {}  # slot → the last step reading or writing it
    for i, st in enumerate(steps):
        for s in st.inputs:
            if s >= 0:
                last[s] = i
        for s in st.outputs:
            if s >= 0:
                last[s] = i
    n = len(steps)
    # slot → the last step reading a value that may be a view of it (a graph output counts as read at n);
    # found backwards, each step once, since a view's views are views of the slot too
    viewed_until: dict[int, int] = {}
    for st in reversed(steps):
        if st.node.op_type in FRESH_OPS or getattr(st.fn, "fresh_outputs", False):
            continue
        end = -1
        for o in st.outputs:
            if o >= 0:
                end = max(end, n if o in outputs else last.get(o, -1), viewed_until.get(o, -1))
        for s in st.inputs:
            if s >= 0 and viewed_until.get(s, -1) < end:
                viewed_until[s] = end
    found: dict[int, set[int]] = {}
    reads: dict[int, Counter[int]] = {}  # step → how often it reads each slot, counted once a step
    for s in inputs:
        i = last.get(s)
        if i is None or viewed_until.get(s, -1) >= i:
            continue
        if i not in reads:
            reads[i] = Counter(steps[i].inputs)
        if reads[i][s] == 1:
            found.setdefault(i, set()).add(s)
    return {i: frozenset(v) for i, v in found.items()}


def check_fed(feeds: Mapping[str, Any], donate: Collection[str]) -> None:
    """Raise ValueError naming the donated names that are not feeds of the run."""
    missing = [n for n in donate if n not in feeds]
    if missing:
        raise ValueError(f"donated name(s) {missing} are not among the feeds {sorted(feeds)}")


def donatable(feeds: Mapping[str, Any], donate: Collection[str]) -> dict[str, np.ndarray]:
    """The feeds of ``donate`` (all of them feeds: see :func:`check_fed`) whose arrays a run may overwrite:
    writeable, C-contiguous arrays owning their memory, fed under one name only and not the base of another
    feed."""
    ids: dict[int, int] = {}
    bases: set[int] = set()
    for v in feeds.values():
        ids[id(v)] = ids.get(id(v), 0) + 1
        if type(v) is np.ndarray and v.base is not None:
            bases.add(id(v.base))
    out: dict[str, np.ndarray] = {}
    for name in donate:
        v = feeds[name]
        if (
            type(v) is np.ndarray
            and v.base is None
            and v.flags.writeable
            and v.flags.c_contiguous
            and ids[id(v)] == 1
            and id(v) not in bases
        ):
            out[name] = v
    return out


def donated_slots(plan: Plan, feeds: Mapping[str, Any], donate: Collection[str]) -> dict[int, np.ndarray]:
    """The slots of ``donate`` (feed names) whose arrays the run may overwrite (:func:`donatable`), with
    those arrays."""
    check_fed(feeds, donate)
    return {plan.slot[name]: v for name, v in donatable(feeds, donate).items()}


def donating(slots: frozenset[int]) -> AbstractContextManager[None]:
    """Steps run on this thread inside the block may overwrite the inputs in ``slots``."""
    return bound(_local, "slots", slots, _NONE)


def donated_now() -> frozenset[int]:
    """The slots donated to the run in progress on this thread (empty outside :func:`donating`)."""
    return getattr(_local, "slots", _NONE)
