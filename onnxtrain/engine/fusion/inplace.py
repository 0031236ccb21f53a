"""Activations (and a cross-entropy gradient's scatter) written over a product nothing else reads.

``Relu(MatMul/Gemm(...))`` and the ReLU gradient ``Where(mask, dX, 0)`` with ``dX`` a fresh product each read
an array that dies at that step: the step writes its result into that array instead of a new one. Writing
into memory that is already in cache, with no allocation, halves these steps in a training step (MLP
784-512-512-10 at batch 256: Relu 26-33 → 15-20 µs, the ReLU gradient 48-53 → 28-32 µs, each). The
``ScatterElements`` that puts −1 at the labels of ``Exp(log-probabilities)`` in a cross-entropy gradient
writes into the Exp's array instead of copying it first (4 MB for the GPT decoder's 1,000-word head). The
values are the same bits: the same ufuncs, only the output buffer changes. At run time the step checks that
the array is its own to write (writeable, the output's shape and dtype, not sharing memory with the other
inputs); otherwise it runs the original kernel.

Two patterns become one step each: the ReLU gradient ``Where(Greater(r, c), dX, 0)`` whose mask only it reads
(``InplaceReluGrad``: the mask computed inside, no Greater step), and the cross-entropy gradient
``Mul(ScatterElements(Exp(logp), Unsqueeze(labels), updates), scale)`` with the memoized shape steps that make
its updates and scale (``InplaceCrossEntropyGrad``, named after the Mul: the Exp, the one-per-row scatter and
the scaling in one kernel; the shape steps' results kept per batch shape, as their own memos keep them).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.donation import FRESH_OPS
from onnxtrain.engine.fusion.common import (
    FLOATS,
    broadcasts_onto,
    constant_of,
    consumers,
    make_step,
    producers,
    protected_slots,
)
from onnxtrain.engine.fusion.shapes import MAX_ENTRIES, ShapeOf, is_memoized
from onnxtrain.engine.kernels.clamp import relu_into
from onnxtrain.engine.kernels.elementwise import BITS_INT, SPLIT_MIN
from onnxtrain.engine.kernels.indexing import in_range, row_starts, scatter_elements_into
from onnxtrain.engine.registry import Attrs, find_kernel
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


def fuse_inplace_activations(plan: Plan, steps: list[Step]) -> list[Step]:
    """Rewrite each Relu, and each ``Where(c, x, 0)``, whose data input is a product (a step of
    :data:`~onnxtrain.engine.donation.FRESH_OPS`) read by that step alone, to write into that input; such a
    Where whose ``c`` is a ``Greater`` that it alone reads (a ReLU gradient) computes the mask itself, and a
    cross-entropy gradient's Exp, scatter, Mul and shape steps become one step (module docstring)."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    written = {k: data for k, st in enumerate(steps)
               if (data := _written_input(plan, steps, cons, prod, kept, k, st)) is not None}
    masks = {k: g for k, g in _relu_grad_masks(plan, steps, cons, prod, kept).items() if k in written}
    grads = _cross_entropy_grads(steps, prod, written)
    dropped = set(masks.values()) | {m for members in grads.values() for m in members}
    derived: dict[int, tuple[list[int], list[int], list[int]]] = {}
    for k, (_, sc) in grads.items():  # the shape steps that make the scatter's updates and the scale
        c = steps[k].inputs[1 - steps[k].inputs.index(written[k])]
        found = _absorbed(steps, cons, prod, kept, {steps[sc].inputs[2]: sc, c: k}, dropped | set(written))
        if found is not None:
            derived[k] = found
            dropped.update(found[0])
    unsqueezes: dict[int, int] = {}  # the Unsqueeze that makes a gradient's indices from the labels
    for k, (_, sc) in grads.items():
        u = _labels_unsqueeze(plan, steps, cons, prod, kept, steps[sc].inputs[1],
                              {sc, *derived.get(k, ([],))[0]}, dropped | set(written))
        if u is not None:
            unsqueezes[k] = u
            dropped.add(u)
    out: list[Step] = []
    for k, st in enumerate(steps):
        if k in dropped:  # a ReLU gradient's Greater, computed by its fused Where
            continue
        data = written.get(k)
        if data is None:
            out.append(st)
            continue
        op = st.node.op_type
        if k in masks:
            greater = steps[masks[k]]
            run = _relu_grad_over(plan, greater, st)
            out.append(make_step(plan, "InplaceReluGrad", [greater, st], (*greater.inputs, *st.inputs[1:]),
                                 st.outputs, run))
            continue
        if k in grads:
            e, sc = (steps[m] for m in grads[k])
            pos = st.inputs.index(data)
            upd, c = sc.inputs[2], st.inputs[1 - pos]
            members, roots, leaves = derived.get(k, ([], [], []))
            derive = _ShapeDerived(plan, [steps[m] for m in members], roots, leaves) if members else None
            unsqueeze = steps[unsqueezes[k]] if k in unsqueezes else None
            idx = sc.inputs[1]
            first, axes = (idx, -1) if unsqueeze is None else unsqueeze.inputs
            ins = (e.inputs[0], first, -1 if upd in roots else upd, -1 if c in roots else c, axes,
                   *(-1 if unsqueeze is not None and s == idx else s for s in leaves))
            # the Mul last: the fused step makes its output and is named after it (errors, the profile)
            fused = [e, sc, *(steps[m] for m in members), *([unsqueeze] if unsqueeze else []), st]
            out.append(make_step(plan, "InplaceCrossEntropyGrad", fused, ins, st.outputs,
                                 _cross_entropy_grad_over(plan, e, sc, st, pos, derive, unsqueeze)))
            continue
        if op == "Mul":
            run = _scale_over(plan, st, st.inputs.index(data))
        else:
            over = {"Relu": _relu_over, "Where": _where_zero_over, "ScatterElements": _scatter_over}[op]
            run = over(plan, st)
        out.append(make_step(plan, f"Inplace{op}", [st], st.inputs, st.outputs, run))
    return out


def _written_input(plan: Plan, steps: list[Step], cons: dict[int, list[int]], prod: dict[int, int],
                   kept: set[int], k: int, st: Step) -> int | None:
    """The input slot step ``k`` may write its result into (a product only it reads), or None."""
    op = st.node.op_type
    data = None
    fresh = FRESH_OPS
    if op == "Relu" and len(st.inputs) == 1:
        data = st.inputs[0]
    elif op == "Where" and len(st.inputs) == 3 and min(st.inputs) >= 0 and _is_zero(plan, st.inputs[2]):
        data = st.inputs[1]
    elif op == "ScatterElements" and len(st.inputs) == 3:
        data, fresh = st.inputs[0], SCATTER_FRESH_OPS
    elif op == "Mul" and len(st.inputs) == 2:
        data, fresh = _scattered(steps, prod, st), SCATTERS
    if data is None or data in kept or cons.get(data) != [k] or st.node.domain not in DEFAULT_DOMAINS:
        return None
    m = prod.get(data)
    return data if m is not None and steps[m].node.op_type in fresh else None


# a cross-entropy gradient scatters −1 at the labels of exp(log-probabilities): the Exp's array is new too
SCATTER_FRESH_OPS = FRESH_OPS | {"Exp"}
# a scatter's output is a new array (or its input's, when that was new: above): its scaling may write into it
SCATTERS = frozenset({"ScatterElements"})
# a column operand is tested for one value from this many values of the product (a test costs about 2 µs)
UNIFORM_MIN = 1 << 15


def _scattered(steps: list[Step], prod: dict[int, int], st: Step) -> int | None:
    """The input of a ``Mul`` that a ScatterElements wrote, or None."""
    for s in st.inputs:
        m = prod.get(s)
        if m is not None and steps[m].node.op_type in SCATTERS:
            return s
    return None


def _relu_grad_masks(plan: Plan, steps: list[Step], cons: dict[int, list[int]], prod: dict[int, int],
                     kept: set[int]) -> dict[int, int]:
    """For each ``Where(Greater(r, c), dX, ·)`` whose mask that Where alone reads, computed by the Greater
    kernel itself: the Where's index → the Greater's (the Where is fused only when it is rewritten in place
    below)."""
    greater_kernel = find_kernel("Greater", plan.opset)
    found: dict[int, int] = {}
    for k, st in enumerate(steps):
        if st.node.op_type != "Where" or len(st.inputs) != 3 or min(st.inputs) < 0:
            continue
        mask = st.inputs[0]
        g = prod.get(mask)
        if g is None or mask in kept or cons.get(mask) != [k] or mask in st.inputs[1:]:
            continue
        greater = steps[g]
        if (greater.node.op_type == "Greater" and len(greater.inputs) == 2 and min(greater.inputs) >= 0
                and len(greater.outputs) == 1 and greater.node.domain in DEFAULT_DOMAINS
                and greater.fn is greater_kernel):
            found[k] = g
    return found


def _cross_entropy_grads(steps: list[Step], prod: dict[int, int], written: dict[int, int]
                         ) -> dict[int, tuple[int, int]]:
    """``Mul(ScatterElements(Exp(logp), idx, upd), c)`` (a cross-entropy gradient) where the scatter and
    the Mul each write into their input: the Mul's index → the Exp's and the scatter's."""
    found: dict[int, tuple[int, int]] = {}
    for k, st in enumerate(steps):
        d = written.get(k)
        if st.node.op_type != "Mul" or d is None or st.inputs.count(d) != 1:
            continue
        s = prod[d]
        p = written.get(s)
        if p is None or steps[s].node.op_type != "ScatterElements" or min(steps[s].inputs) < 0:
            continue
        e = prod[p]
        exp = steps[e]
        if (exp.node.op_type == "Exp" and len(exp.inputs) == 1 and exp.inputs[0] >= 0
                and len(exp.outputs) == 1 and exp.node.domain in DEFAULT_DOMAINS):
            found[k] = (e, s)
    return found


def _is_zero(plan: Plan, s: int) -> bool:
    """True when slot ``s`` is a folded one-element float constant whose bits are all zero (+0.0)."""
    v = constant_of(plan, s)
    return v is not None and v.size == 1 and v.dtype.kind == "f" and not v.reshape(-1).view(np.uint8).any()


def _own(x: Any) -> bool:
    return type(x) is np.ndarray and x.flags.writeable and x.flags.c_contiguous


def _relu_over(plan: Plan, st: Step) -> Callable:
    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x = inputs[0]
        if _own(x) and x.dtype.kind == "f":
            return (relu_into(x, out=x),)
        return plan._call(st, list(inputs))

    return run


def _where_zero_over(plan: Plan, st: Step) -> Callable:
    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        c, x, zero = inputs
        it = BITS_INT.get(x.dtype.itemsize) if type(x) is np.ndarray else None
        if (
            it is not None
            and _own(x)
            and x.dtype.kind == "f"
            and type(c) is np.ndarray
            and c.dtype == np.bool_
            and c.shape == x.shape
            and zero.dtype == x.dtype
            and zero.ndim <= x.ndim  # (a [1, 1, 1] zero adds axes to the Where's output)
            and not np.may_share_memory(c, x)
        ):
            # where(c, x, +0.0) as the Where kernel's select computes it, inlined: its general checks cost
            # 15-25 µs more here, out of cache in a training step
            return (_zero_where_not(x, c, it),)
        return plan._call(st, list(inputs))

    return run


def _zero_where_not(x: np.ndarray, mask: np.ndarray, it: np.dtype) -> np.ndarray:
    """``x`` with +0.0 where the boolean ``mask`` is False, in place: its bits times the mask's 0/1 bytes in
    the integer type ``it`` of its width (the Where kernel's select)."""
    bits = x.view(it)
    np.multiply(bits, mask.view(np.int8), out=bits, dtype=it)
    return x


def _relu_grad_over(plan: Plan, greater: Step, where: Step) -> Callable:
    """``Where(Greater(r, c), x, +0.0)`` written into ``x`` in one step: the mask by the ufunc the Greater
    kernel calls (a comparison: exact), then the select as :func:`_where_zero_over` computes it."""

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        r, c, x, zero = inputs
        it = BITS_INT.get(x.dtype.itemsize) if type(x) is np.ndarray else None
        if (
            it is not None
            and _own(x)
            and x.dtype in FLOATS
            and type(r) is np.ndarray
            and r.shape == x.shape
            and r.dtype == x.dtype
            and type(c) is np.ndarray
            and c.dtype == x.dtype
            and c.size == 1
            and c.ndim <= x.ndim
            and zero.dtype == x.dtype
            and zero.ndim <= x.ndim  # (a [1, 1, 1] zero adds axes to the Where's output)
        ):
            return (_zero_where_not(x, np.greater(r, c), it),)
        return plan._call(where, [plan._call(greater, [r, c])[0], x, zero])

    return run


MAX_DERIVED_STEPS = 16  # memoized shape steps one fused step may take in


def _absorbed(steps: list[Step], cons: dict[int, list[int]], prod: dict[int, int], kept: set[int],
              wanted: dict[int, int], taken: set[int]) -> tuple[list[int], list[int], list[int]] | None:
    """The memoized shape steps (:mod:`~onnxtrain.engine.fusion.shapes`) that make the slots of ``wanted``
    (slot → the step that reads it) when nothing but those steps and that reader reads what they make: (their
    indices in order, the wanted slots they make, the slots they read from elsewhere); None when there are
    none, too many, or one is read elsewhere, is a graph output or is in ``taken``."""
    roots = [s for s in wanted if s >= 0 and s in prod and is_memoized(steps[prod[s]])]
    members: set[int] = set()
    todo = list(roots)
    while todo:
        m = prod[todo.pop()]
        if m in members:
            continue
        members.add(m)
        if len(members) > MAX_DERIVED_STEPS or m in taken:
            return None
        todo.extend(i for i in steps[m].inputs if i >= 0 and i in prod and is_memoized(steps[prod[i]]))
    if not members:
        return None
    made = {o for m in members for o in steps[m].outputs if o >= 0}
    for o in made:
        readers = members | ({wanted[o]} if o in roots else set())
        if o in kept or any(r not in readers for r in cons.get(o, ())):
            return None
    leaves = sorted({i for m in members for i in steps[m].inputs if i >= 0 and i not in made})
    return sorted(members), roots, leaves


def _labels_unsqueeze(plan: Plan, steps: list[Step], cons: dict[int, list[int]], prod: dict[int, int],
                      kept: set[int], idx: int, readers: set[int], taken: set[int]) -> int | None:
    """The index of the ``Unsqueeze(labels, [1] or [-1])`` step (axes a folded constant) that makes slot
    ``idx`` when only ``readers`` read it; else None."""
    u = prod.get(idx)
    if u is None or u in taken or idx in kept or any(r not in readers for r in cons.get(idx, ())):
        return None
    st = steps[u]
    if (st.node.op_type != "Unsqueeze" or st.node.domain not in DEFAULT_DOMAINS or len(st.inputs) != 2
            or min(st.inputs) < 0 or len(st.outputs) != 1):
        return None
    axes = constant_of(plan, st.inputs[1])
    if axes is None or axes.dtype.kind != "i" or axes.reshape(-1).tolist() not in ([1], [-1]):
        return None
    return u


class _ShapeDerived:
    """The values of absorbed memoized shape steps: computed by those steps from the leaf values (the tensors
    whose shapes they read, constants and fixed integer initializers) and kept per leaf shapes and constant
    identities, as the steps' own memos keep them."""

    __slots__ = ("plan", "members", "roots", "leaves", "shape_only", "entries")

    def __init__(self, plan: Plan, members: list[Step], roots: list[int], leaves: list[int]) -> None:
        self.plan = plan
        self.members = members
        self.roots = roots
        self.leaves = leaves
        # a leaf that only Shape/Size steps read counts by its shape; any other (a constant) by identity
        self.shape_only = [all(isinstance(st.fn, ShapeOf) for st in members if i in st.inputs)
                           for i in leaves]
        self.entries: dict[tuple, tuple] = {}

    def __call__(self, values: Sequence[Any]) -> dict[int, Any]:
        key = tuple([(v.shape if type(v) is np.ndarray else np.shape(v)) if so else id(v)
                     for v, so in zip(values, self.shape_only)])
        hit = self.entries.get(key)
        if hit is not None:
            return hit[1]
        env = dict(zip(self.leaves, values))
        for st in self.members:
            for o, r in zip(st.outputs, self.plan._call(st, [env[i] if i >= 0 else None for i in st.inputs])):
                if o >= 0:
                    env[o] = r
        got = {s: env[s] for s in self.roots}
        if all(type(v) is np.ndarray and not v.flags.writeable for v in got.values()):  # (as the memos keep)
            if len(self.entries) >= MAX_ENTRIES:
                self.entries.clear()
            # the entry holds the leaves keyed by identity (constants), so that their ids cannot be reused by
            # other objects while it lives; not those keyed by shape (a batch's activations)
            held = tuple(v for v, so in zip(values, self.shape_only) if not so)
            self.entries[key] = (held, got)
        return got


def _cross_entropy_grad_over(plan: Plan, exp: Step, scatter: Step, mul: Step, pos: int,
                             derive: _ShapeDerived | None = None, unsqueeze: Step | None = None) -> Callable:
    """``Mul(ScatterElements(Exp(logp), idx, upd), c)`` in one step over (logp, idx, upd, c): the Exp's
    kernel, then, for one index per row of a 2-D float array along its last axis and a ``c`` that broadcasts
    to it (one value, or a weight per row), the scatter and the scaling written into the Exp's array as
    :func:`scatter_elements_into` (its one-per-row path) and :func:`_scale_over` compute them, without
    their general checks (10-20 µs of a training step out of cache); otherwise the in-place scatter and
    Mul steps. ``pos``: the scattered array's place in the Mul. ``derive``: the absorbed shape steps that
    make the updates or the scale (those inputs are then omitted, and the step's inputs end with the slots
    those steps read); ``unsqueeze``: the absorbed ``Unsqueeze(labels, axes)`` that made the indices (the
    step reads the labels and axes instead)."""
    axis = scatter.attrs.get("axis", 0)
    reduction = scatter.attrs.get("reduction") or "none"
    fast = axis in (1, -1) and reduction in ("add", "none")
    add = reduction == "add"
    scatter_run, scale_run = _scatter_over(plan, scatter), _scale_over(plan, mul, pos)
    plain_exp = exp.fn is find_kernel("Exp", plan.opset)  # (np.exp below its split size)

    upd_slot, c_slot, idx_slot = scatter.inputs[2], mul.inputs[1 - pos], scatter.inputs[1]

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        logp, idx, upd, c, axes, *leaves = inputs
        if unsqueeze is not None:  # idx is the labels: Unsqueeze(labels, [1]) is (N, 1) of the same values
            labels = idx
            idx = (labels.reshape(-1, 1) if type(labels) is np.ndarray and labels.ndim == 1
                   else plan._call(unsqueeze, [labels, axes])[0])
            if derive is not None:
                leaves = [idx if s == idx_slot else v for s, v in zip(derive.leaves, leaves)]
        if derive is not None:
            got = derive(leaves)
            upd, c = got.get(upd_slot, upd), got.get(c_slot, c)
        # below its split size the Exp kernel is np.exp: called here, its result is a new array (it shares no
        # memory with the updates or the scale)
        new = (plain_exp and type(logp) is np.ndarray and logp.ndim == 2 and logp.dtype in FLOATS
               and logp.size < SPLIT_MIN)
        p = np.exp(logp) if new else plan._call(exp, [logp])[0]
        at = None
        if (
            fast
            and (new or (type(p) is np.ndarray and p.ndim == 2 and p.dtype in FLOATS and p.flags.writeable))
            and p.size
            and p.flags.c_contiguous
            and type(idx) is np.ndarray
            and idx.shape == (p.shape[0], 1)
            and type(upd) is np.ndarray
            and upd.shape == idx.shape
            and upd.dtype == p.dtype
            and type(c) is np.ndarray
            and c.dtype == p.dtype
            and broadcasts_onto(c.shape, p.shape)  # (a per-row weight: (N, 1))
            and (new or not (np.may_share_memory(p, upd) or np.may_share_memory(p, c)))
        ):
            at = _row_offsets(idx.reshape(-1), p.shape)
        if at is not None:  # one index per row: distinct positions
            flat = p.reshape(-1)
            if add:
                flat[at] = np.add(flat[at], upd.reshape(-1))
            else:
                flat.put(at, upd.reshape(-1))  # (the same assignment as flat[at] = ..., in fewer steps)
            cc = uniform(c) if p.size >= UNIFORM_MIN else c  # (as _scale_over applies it)
            # the Mul's operand order: where both are NaN, the product is the first one's NaN (sign, payload)
            return (np.multiply(*((p, cc) if pos == 0 else (cc, p)), out=p),)
        try:
            d = scatter_run([p, idx, upd], attrs)[0]
        except Exception as e:  # failed as the ScatterElements node, with its inputs named
            plan._raise_failed(scatter, [p, idx, upd], e)
        return scale_run((d, c) if pos == 0 else (c, d), attrs)

    return run


def _row_offsets(col: np.ndarray, shape: tuple[int, int]) -> np.ndarray | None:
    """The flat offsets of ``col[i]`` in row i of a C-contiguous array of ``shape``, or None when an index is
    outside [0, shape[1]) (the general scatter wraps a negative one, or fails). int64 indices by one call
    that checks and computes them."""
    if col.dtype == _I64:
        try:
            return np.ravel_multi_index((row_starts(shape[0], 1), col), shape)
        except ValueError:
            return None
    return row_starts(*shape) + col if in_range(col, shape[1]) else None


_I64 = np.dtype(np.int64)


def _scale_over(plan: Plan, st: Step, pos: int) -> Callable:
    """``Mul`` written into its input ``pos`` (d); the other (c) applied as one scalar when all its values
    have the same bits."""

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        d, c = inputs[pos], inputs[1 - pos]
        if (
            _own(d)
            and d.dtype.kind == "f"
            and type(c) is np.ndarray
            and c.dtype == d.dtype
            and c.ndim <= d.ndim
            and all(k in (1, n) for k, n in zip(c.shape[::-1], d.shape[::-1]))
            and not np.may_share_memory(c, d)
        ):
            cc = uniform(c) if d.size >= UNIFORM_MIN else c
            # the Mul's operand order: where both are NaN, the product is the first one's NaN (sign, payload)
            return (np.multiply(*((d, cc) if pos == 0 else (cc, d)), out=d),)
        return plan._call(st, list(inputs))

    return run


def uniform(c: np.ndarray) -> np.ndarray:
    """``c``'s one value as a 0-d array when all of ``c``'s values have the same bits, else ``c``."""
    it = BITS_INT.get(c.itemsize)
    if c.size < 2 or it is None:
        return c
    bits = c.reshape(-1).view(it)
    return c.reshape(-1)[0:1].reshape(()) if bool((bits == bits[0]).all()) else c


def _scatter_over(plan: Plan, st: Step) -> Callable:
    own_attrs = st.attrs  # the ScatterElements node's (axis, reduction, its offsets cache)

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        x = inputs[0]
        if _own(x) and all(not np.may_share_memory(x, v) for v in inputs[1:] if type(v) is np.ndarray):
            return scatter_elements_into(inputs, own_attrs, True)
        return plan._call(st, list(inputs))

    return run
