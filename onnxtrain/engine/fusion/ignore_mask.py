"""The ignore_index mask of a mean cross-entropy gradient as one step.

For a loss with ``ignore_index`` (−100 in torch's exports unless the model sets another) and mean reduction,
the gradient rule (autodiff/rules/loss.py, ``_class_factor``) writes eight small nodes before the fused
gradient::

    E = Equal(labels, ii)            L = Where(E, 0, labels)         K = Where(E, 0.0, 1.0)
    M = Max(ReduceSum(K), 1)         U = Unsqueeze(Div(dL, M) · K, [1])

that is, the labels with ignored entries set to class 0 and the per-sample factor dL/max(kept, 1) for a
kept sample, 0 for an ignored one. Eight steps of the run loop cost 50-70 µs of a small training step
(bench MLP at batch 64, out of cache); their arithmetic is a few hundred nanoseconds. One step makes ``L``
and ``U`` instead. When no label is ``ii`` (the usual batch; labels and dL of the graph's types, at most
2**24 labels), ``L`` is the labels themselves, every ``K`` is 1, the count is the labels' size, and each
factor is ``dL / max(size, 1)`` (``d · 1.0`` is ``d``, bit for bit): a comparison, one scalar division and
a fill. Otherwise the step runs the original kernels in order (the same bits by construction).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from onnxtrain.engine.fusion.common import (
    FLOATS,
    constant_of,
    consumers,
    make_step,
    producers,
    protected_slots,
    run_steps,
)
from onnxtrain.engine.registry import Attrs, find_kernel
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

# a float32 sum of this many ones or fewer is exact (each partial sum is an integer below 2**24)
MAX_EXACT_COUNT = 1 << 24


def fuse_ignore_masks(plan: Plan, steps: list[Step]) -> list[Step]:
    """Each ignore mask of a mean cross-entropy gradient (module docstring) whose intermediate values
    nothing else reads → one ``IgnoreMaskFactor`` step making the masked labels and the per-sample factor,
    placed before the first step that reads either."""
    cons, prod, kept = consumers(steps), producers(steps), protected_slots(plan)
    fused: dict[int, Step] = {}  # position → the fused step placed before the step there
    dropped: set[int] = set()
    for k, st in enumerate(steps):
        found = _mask_chain(plan, steps, cons, kept, k, st)
        if found is None or dropped.intersection(found):
            continue
        e, w0, kf, red, mx, div, mul, unsq = (steps[m] for m in found)
        ins = (e.inputs[0], e.inputs[1], w0.inputs[1], kf.inputs[1], kf.inputs[2], mx.inputs[1],
               div.inputs[0], unsq.inputs[1])
        outs = (w0.outputs[0], unsq.outputs[0])
        readers = [r for o in outs for r in cons.get(o, ())]
        at = min(readers, default=len(steps))
        # the step's inputs are made before its first reader (the labels, dL; the rest are constants)
        if any(prod.get(s, -1) >= at for s in ins if s >= 0) or at in fused:
            continue
        members = [steps[m] for m in found]
        fused[at] = make_step(plan, "IgnoreMaskFactor", members, ins, outs,
                              _ignore_factor(plan, members, ins, outs, outs[1] not in kept))
        dropped.update(found)
    if not fused:
        return steps
    out: list[Step] = []
    for k, st in enumerate(steps):
        if k in fused:
            out.append(fused[k])
        if k not in dropped:
            out.append(st)
    if len(steps) in fused:
        out.append(fused[len(steps)])
    return out


def _plain(plan: Plan, st: Step, op: str, n_inputs: int) -> bool:
    """``st`` is an unfused ``op`` node of the default domain with ``n_inputs`` present inputs, one output."""
    return (st.node.op_type == op and st.node.domain in DEFAULT_DOMAINS and len(st.inputs) == n_inputs
            and min(st.inputs) >= 0 and len(st.outputs) == 1 and st.fn is find_kernel(op, plan.opset))


def _scalar(plan: Plan, s: int, kind: str, value: float) -> bool:
    """Slot ``s`` is a folded 0-d constant of dtype kind ``kind`` (``"f"``: float32/64) equal to ``value``."""
    v = constant_of(plan, s)
    if v is None or v.shape != () or v.dtype.kind not in kind or (kind == "f" and v.dtype not in FLOATS):
        return False
    return bool(v == value) and not (value == 0 and kind == "f" and np.signbit(v))


def _mask_chain(plan: Plan, steps: list[Step], cons: dict[int, list[int]], kept: set[int], k: int,
                e: Step) -> list[int] | None:
    """Indices of [Equal, Where (labels), Where (float mask), ReduceSum, Max, Div, Mul, Unsqueeze] when step
    ``k`` is the Equal of such a mask whose inner values only the chain reads; else None."""
    if not _plain(plan, e, "Equal", 2) or constant_of(plan, e.inputs[1]) is None:
        return None
    ii = constant_of(plan, e.inputs[1])
    # (one of more dims than 1 would widen the Equal, and so both outputs, beyond 1-D labels' shape)
    if ii.size != 1 or ii.ndim > 1 or ii.dtype.kind not in "iu":  # type: ignore[union-attr]
        return None
    eq = e.outputs[0]
    readers = cons.get(eq, [])
    if len(readers) != 2 or eq in kept:
        return None
    w0 = kf = None
    for r in readers:
        st = steps[r]
        if not _plain(plan, st, "Where", 3) or st.inputs[0] != eq:
            return None
        if st.inputs[2] == e.inputs[0] and _scalar(plan, st.inputs[1], "iu", 0):
            w0 = r
        elif _scalar(plan, st.inputs[1], "f", 0.0) and _scalar(plan, st.inputs[2], "f", 1.0):
            kf = r
    if w0 is None or kf is None:
        return None
    kslot = steps[kf].outputs[0]
    kr = cons.get(kslot, [])
    if len(kr) != 2 or kslot in kept:
        return None
    red = next((r for r in kr if steps[r].node.op_type == "ReduceSum"), None)
    mul = next((r for r in kr if steps[r].node.op_type == "Mul"), None)
    if red is None or mul is None:
        return None
    rs = steps[red]
    if not _plain(plan, rs, "ReduceSum", 1) or {a.name: a.i for a in rs.node.attribute} != {"keepdims": 0}:
        return None
    mx = _only_reader(steps, cons, kept, rs.outputs[0])
    if mx is None or not _plain(plan, steps[mx], "Max", 2) or steps[mx].inputs[0] != rs.outputs[0]:
        return None
    if not _scalar(plan, steps[mx].inputs[1], "f", 1.0):
        return None
    div = _only_reader(steps, cons, kept, steps[mx].outputs[0])
    if div is None or not _plain(plan, steps[div], "Div", 2) or steps[div].inputs[1] != steps[mx].outputs[0]:
        return None
    if _only_reader(steps, cons, kept, steps[div].outputs[0]) != mul:
        return None
    if not _plain(plan, steps[mul], "Mul", 2) or steps[mul].inputs != (steps[div].outputs[0], kslot):
        return None
    unsq = _only_reader(steps, cons, kept, steps[mul].outputs[0])
    if (unsq is None or not _plain(plan, steps[unsq], "Unsqueeze", 2)
            or steps[unsq].inputs[0] != steps[mul].outputs[0]):
        return None
    axes = constant_of(plan, steps[unsq].inputs[1])
    if axes is None or axes.dtype.kind != "i" or axes.reshape(-1).tolist() != [1]:
        return None
    w, k_ = steps[w0], steps[kf]
    ints = {constant_of(plan, s).dtype for s in (e.inputs[1], w.inputs[1])}  # type: ignore[union-attr]
    floats = {constant_of(plan, s).dtype  # type: ignore[union-attr]
              for s in (k_.inputs[1], k_.inputs[2], steps[mx].inputs[1])}
    if len(ints) != 1 or len(floats) != 1:  # (the kernel is specialised for one labels' and one float type)
        return None
    return [k, w0, kf, red, mx, div, mul, unsq]


def _only_reader(steps: list[Step], cons: dict[int, list[int]], kept: set[int], s: int) -> int | None:
    """The one step reading slot ``s`` when exactly one does and ``s`` is not a graph output."""
    r = cons.get(s, [])
    return r[0] if len(r) == 1 and s not in kept else None


def _ignore_factor(plan: Plan, members: list[Step], ins: Sequence[int], outs: Sequence[int],
                   cached: bool) -> Callable:
    """The fused step's kernel over (labels, ii, 0, 0.0, 1.0, 1, dL, axes) (slots ``ins``) → (masked labels,
    factor) (slots ``outs``). ``cached``: the factor may be an array kept from an earlier run (read-only; not
    a graph output)."""
    ii = constant_of(plan, members[0].inputs[1])
    lt, ft = ii.dtype, constant_of(plan, members[4].inputs[1]).dtype  # type: ignore[union-attr]
    made: dict[tuple, np.ndarray] = {}  # (labels' shape, dL's bits) → the factor

    def run(inputs: Sequence[Any], attrs: Attrs) -> Sequence[Any]:
        lab, dl = inputs[0], inputs[6]
        if (
            type(lab) is np.ndarray
            and lab.dtype == lt
            and lab.ndim > 0
            and lab.size <= MAX_EXACT_COUNT
            and type(dl) is np.ndarray
            and dl.dtype == ft
            and dl.shape == ()
            and not np.count_nonzero(np.equal(lab, ii))
        ):
            # nothing ignored: the Where's labels are the labels' values, the mask all 1.0, its sum the
            # labels' size (exact), and each factor dL / max(size, 1) times 1.0, which is that quotient
            key = (lab.shape, dl.tobytes())
            f = made.get(key)
            if f is None:
                d = np.divide(dl, np.maximum(ft.type(lab.size), inputs[5]))
                f = np.full(lab.shape[:1] + (1,) + lab.shape[1:], d, dtype=ft)
                if cached:
                    f.flags.writeable = False
                    if len(made) >= MAX_KEPT:
                        made.clear()
                    made[key] = f
            return lab, f
        env = dict(zip(ins, inputs))  # otherwise the mask's original steps, in order
        run_steps(plan, members, env)
        return env[outs[0]], env[outs[1]]

    return run


MAX_KEPT = 8  # factors kept per step (a batch shape and dL's value each)

