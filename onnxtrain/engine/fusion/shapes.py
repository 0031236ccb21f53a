"""Shape arithmetic, folded or memoised: steps that compute only from constants and tensor shapes.

An exported model with a dynamic batch recomputes its reshape targets on every run: ``Shape`` of a value,
then ``Gather``/``Unsqueeze``/``Concat``/``Mul``... on tiny int64 tensors (the transformer of the bench has
~140 such steps). Their results depend only on the shapes read, so each such step
is folded or keeps its last results:

* a step whose inputs are all folded constants is run once, at compile time, and becomes a constant;
* a ``Shape``/``Size`` step returns the same array for the same input shape;
* a step whose inputs all come from such steps, from folded constants or from integer initializers returns
  the same outputs when it sees the same input objects (keyed by identity, the inputs held by the entry).

Cached outputs are made read-only, so a kernel that tried to write into one would fail loudly instead of
changing a later run. Steps whose outputs are graph outputs, random ops and outputs larger than
``MAX_ELEMENTS`` are left as they are.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import protected_slots
from onnxtrain.engine.registry import SUBGRAPH_OPS, Attrs, Kernel
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, RANDOM_OPS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

SOURCES = {"Shape", "Size"}
MAX_ENTRIES = 8  # per step: distinct input shapes remembered (a dynamic batch sees a few)
MAX_ELEMENTS = 1 << 16  # larger results are recomputed every run (a mask built from a shape, say)


class _Memo:
    """Base of the memoising kernels: the wrapped kernel and its entries."""

    __slots__ = ("fn", "entries")

    def __init__(self, fn: Kernel):
        self.fn = fn
        self.entries: dict[Any, tuple] = {}

    def _remember(self, key: Any, held: Any, res: Sequence[Any]) -> Sequence[Any]:
        outs = tuple(np.array(r) if isinstance(r, np.generic) else r for r in res)
        for r in outs:
            if isinstance(r, np.ndarray):
                if r.size > MAX_ELEMENTS:
                    return outs
                r.flags.writeable = False
            elif r is not None:
                return outs  # not an array (a sequence, say): not cached
        if len(self.entries) >= MAX_ENTRIES:
            self.entries.clear()
        self.entries[key] = (held, outs)
        return outs


class ShapeOf(_Memo):
    """``Shape``/``Size``: the same result array for the same input shape."""

    __slots__ = ()

    def __call__(self, inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        key = np.shape(inputs[0])
        hit = self.entries.get(key)
        if hit is not None:
            return hit[1]
        return self._remember(key, None, self.fn(inputs, attrs))


class FromShapes(_Memo):
    """A step computed from shape results and constants: the same outputs for the same input objects."""

    __slots__ = ()

    def __call__(self, inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        key = tuple(map(id, inputs))
        hit = self.entries.get(key)
        if hit is not None:
            return hit[1]
        # the entry holds the inputs, so that their ids cannot be reused by other objects while it lives
        return self._remember(key, tuple(inputs), self.fn(inputs, attrs))


def _fold(plan: Plan, st: Step, consts: dict[int, np.ndarray]) -> bool:
    """Run a step whose inputs are all constants (``consts``: slot → value) now and make its outputs
    constants of the plan and of ``consts``; False if it fails."""
    try:
        res = st.fn([consts[s] if s >= 0 else None for s in st.inputs], st.attrs)
    except Exception:
        return False  # left in the plan: the run reports the failure with the node named
    outs = [(s, np.array(r) if isinstance(r, np.generic) else r) for s, r in zip(st.outputs, res) if s >= 0]
    if not all(isinstance(r, np.ndarray) for _, r in outs):
        return False
    for s, r in outs:
        r.flags.writeable = False  # shared by every run from now on
        plan._const_values.append((s, r))
        plan._base_bytes += r.nbytes
        consts[s] = r
    return True


def memoize_shape_steps(plan: Plan, steps: list[Step]) -> list[Step]:
    """Fold steps of constants; wrap the kernels of shape-computing steps in :class:`ShapeOf` /
    :class:`FromShapes`."""
    consts = dict(plan._const_values)
    # small int initializers a run cannot change (one that is also a graph input may be fed, and a feed's
    # array may be rewritten between runs: its results are not memoized by identity; nor those of an array
    # the caller handed in for an initializer and may still write, which the model's own never are)
    fed = set(plan.all_input_names)
    fixed = {plan.slot[n] for n, v in plan.initializers.items()
             if v.dtype.kind in "iub" and v.size <= 64 and n not in fed and not v.flags.writeable}
    derived: set[int] = set()  # slots whose value depends only on shapes read by a SOURCES step
    kept = protected_slots(plan)
    out: list[Step] = []
    for st in steps:
        op = st.node.op_type
        ins = [s for s in st.inputs if s >= 0]
        wrapper: type[_Memo] | None = None
        # a body may hold random ops: control flow is neither folded nor memoised
        opaque = op in RANDOM_OPS or op in SUBGRAPH_OPS
        if st.node.domain not in DEFAULT_DOMAINS or opaque or any(s in kept for s in st.outputs):
            wrapper = None
        elif ins and all(s in consts for s in ins) and _fold(plan, st, consts):
            continue
        elif op in SOURCES and ins:
            wrapper = ShapeOf
        elif ins and all(s in derived or s in fixed or s in consts for s in ins):
            wrapper = FromShapes
        if wrapper is None:
            out.append(st)
            continue
        derived.update(s for s in st.outputs if s >= 0)
        out.append(type(st)(wrapper(st.fn), st.inputs, st.outputs, st.attrs, st.free, st.node))
    return out


def is_memoized(st: Step) -> bool:
    return isinstance(st.fn, _Memo)
