"""What the fusion passes share: step maps, constants, running and making steps."""

from __future__ import annotations

import itertools
import operator
import weakref
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.engine.registry import Attrs

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step

FLOATS = (np.dtype(np.float32), np.dtype(np.float64))


# ---- helpers ---------------------------------------------------------------------------------------------
# the steps each map was last made of (a copy of the list) and the map: most passes change nothing of a
# large graph, so the next pass asks for the map of the same steps again (10 consumer maps of 34k steps,
# a tenth of a deep chain's fusion). The maps are read only; ``forget_step_maps`` drops them
_LAST_MAPS: dict[str, tuple[list[Step], Any]] = {}
MAPS_MADE = {"consumers": 0, "producers": 0}  # how many maps were made, not taken from the last call


def _same_steps(a: Sequence[Step], b: Sequence[Step]) -> bool:
    return len(a) == len(b) and all(map(operator.is_, a, b))


def _step_map(kind: str, steps: Sequence[Step], make: Callable[[Sequence[Step]], Any]) -> Any:
    last = _LAST_MAPS.get(kind)
    if last is not None and _same_steps(last[0], steps):
        return last[1]
    made = make(steps)
    MAPS_MADE[kind] += 1
    _LAST_MAPS[kind] = (list(steps), made)
    return made


def forget_step_maps() -> None:
    """Drop the maps kept from the last calls (and the steps they hold)."""
    _LAST_MAPS.clear()


def _consumers(steps: Sequence[Step]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for k, st in enumerate(steps):
        for s in st.inputs:
            if s >= 0:
                readers = out.get(s)
                if readers is None:
                    out[s] = [k]
                else:
                    readers.append(k)
    return out


def consumers(steps: Sequence[Step]) -> dict[int, list[int]]:
    """Slot → indices of the steps reading it, in order (read only: shared by the calls on the same steps)."""
    return _step_map("consumers", steps, _consumers)


def producers(steps: Sequence[Step]) -> dict[int, int]:
    """Slot → index of the (last) step writing it (read only, as :func:`consumers`)."""
    return _step_map("producers", steps, lambda sts: {s: k for k, st in enumerate(sts) for s in st.outputs
                                                        if s >= 0})


def protected_slots(plan: Plan) -> set[int]:
    """Slots that must stay visible: graph outputs."""
    return {plan.slot[n] for n in plan.output_names}


def constant_of(plan: Plan, s: int) -> np.ndarray | None:
    """The value of a folded Constant slot (initializers stay feedable, so they do not count)."""
    for slot, v in plan._const_values:
        if slot == s:
            return v
    return None


def static_axes(plan: Plan, red: Step) -> list[int] | None:
    """A reduction step's axes when an attribute or a constant input gives them, else None."""
    for a in red.node.attribute:
        if a.name == "axes":
            return list(a.ints)
    if len(red.inputs) > 1 and red.inputs[1] >= 0:
        v = constant_of(plan, red.inputs[1])
        return None if v is None else [int(i) for i in np.asarray(v).reshape(-1)]
    return None


def keeps_dims(red: Step) -> bool:
    """A reduction step's ``keepdims`` (1 unless the node says otherwise)."""
    return next((a.i for a in red.node.attribute if a.name == "keepdims"), 1) != 0


def broadcasts_onto(small: tuple[int, ...], shape: tuple[int, ...]) -> bool:
    """True when an array of shape ``small`` broadcasts to ``shape`` without enlarging it: no more axes, and
    each of its trailing dims 1 or ``shape``'s (plain Python: fused steps check it on every run)."""
    k = len(small)
    if k > len(shape):
        return False
    for i in range(1, k + 1):
        s = small[-i]
        if s != 1 and s != shape[-i]:
            return False
    return True


SWAP01 = (1, 0)  # a Transpose's perm that swaps the first two axes (and keeps the rest), for transposes_by


def transposes_by(step: Step, lead: Sequence[int]) -> bool:
    """True for a Transpose of a tensor of rank len(``lead``) + 1 or more whose perm is ``lead`` and then
    the remaining axes in order."""
    perm = list(step.attrs.get("perm") or [])
    return (step.node.op_type == "Transpose" and len(perm) > len(lead)
            and perm == [*lead, *range(len(lead), len(perm))])


def swapped_conv(steps: Sequence[Step], prod: dict[int, int], last: Step) -> int | None:
    """When ``last`` is a Transpose swapping the first two axes of a two-input Conv's output (explicit pads):
    that Conv's index (the tail of the gradient builder's Conv weight gradients); else None."""
    if not transposes_by(last, SWAP01):
        return None
    c = prod.get(last.inputs[0])
    if c is None or steps[c].node.op_type != "Conv" or len(steps[c].inputs) != 2:
        return None
    return c if (steps[c].attrs.get("auto_pad") or "NOTSET") == "NOTSET" else None


def _ints(v: Any) -> list[int]:
    return [int(i) for i in np.asarray(v).reshape(-1)]


def prefix_crop(plan: Plan, step: Step) -> dict[int, int] | None:
    """For a Slice that keeps the first ``end`` entries of each axis it names (constant starts of 0, steps of
    1, ends of 0 or more): axis → end, the axes as the node gives them (negative ones too); else None."""
    if step.node.op_type != "Slice":
        return None
    if len(step.inputs) == 1:  # Slice-1: the attributes
        starts, ends = step.attrs.get("starts"), step.attrs.get("ends")
        axes, stepping = step.attrs.get("axes"), None
    else:
        given = [s for s in step.inputs[1:] if s >= 0]
        values = [constant_of(plan, s) if s >= 0 else None for s in step.inputs[1:]]
        if len(given) != sum(v is not None for v in values) or len(values) < 2:
            return None  # a bound read at run time
        starts, ends = values[0], values[1]
        axes = values[2] if len(values) > 2 else None
        stepping = values[3] if len(values) > 3 else None
    if starts is None or ends is None:
        return None
    starts, ends = _ints(starts), _ints(ends)
    axes = list(range(len(starts))) if axes is None else _ints(axes)
    if stepping is not None and any(v != 1 for v in _ints(stepping)):
        return None
    if not len(starts) == len(ends) == len(axes) or any(starts) or min(ends, default=0) < 0:
        return None
    crop = dict(zip(axes, ends, strict=True))
    return crop if len(crop) == len(axes) else None


def absorb_crop(plan: Plan, steps: Sequence[Step], cons: dict[int, list[int]], kept: set[int], k: int,
                members: list[Step], drop: set[int]) -> tuple[int, dict[int, int] | None, tuple[int, ...]]:
    """Where step ``k``'s output (not a graph output) is read by one step alone, a Slice keeping a prefix
    (:func:`prefix_crop`), that Slice joins ``members`` and ``k`` joins ``drop``: returns (the index the fused
    step takes, the crop, the Slice's bound inputs as slots, -1 for an omitted one); else (k, None, ()).
    (A strided Conv's weight gradient, as the gradient builder writes it, is a longer kernel cut so.)"""
    out = steps[k].outputs[0]
    after = cons.get(out, [])
    crop = prefix_crop(plan, steps[after[0]]) if len(after) == 1 and out not in kept else None
    if crop is None:
        return k, None, ()
    at = after[0]
    members.append(steps[at])
    drop.add(k)
    return at, crop, tuple(steps[at].inputs[1:])


def crop_axes(crop: dict[int, int] | None, rank: int) -> dict[int, int]:
    """A :func:`prefix_crop`'s ends by axis of a tensor of ``rank``, negative axes counted from the end."""
    return {} if crop is None else {a + rank if a < 0 else a: e for a, e in crop.items()}


def attr_key(node: onnx.NodeProto) -> bytes:
    return b"".join(a.SerializeToString(deterministic=True) for a in node.attribute)


def run_steps(plan: Plan, steps: Sequence[Step], env: dict[int, Any]) -> None:
    """Run ``steps`` with their original kernels, reading and writing values by slot in ``env``."""
    for st in steps:
        args = [env.get(s) if s >= 0 else None for s in st.inputs]
        res = plan._call(st, args)
        for s, r in zip(st.outputs, res):
            if s >= 0:
                env[s] = r


# per plan: how many of its ``slot`` entries were read, and slot → name from them
_SLOT_NAMES: weakref.WeakKeyDictionary[Plan, tuple[int, dict[int, str]]] = weakref.WeakKeyDictionary()


def slot_names(plan: Plan) -> dict[int, str]:
    """Slot → value name of ``plan`` (the last name of a slot several share), kept with it and brought up
    to date with the names added since (they are only ever added, at the end of ``plan.slot``): made anew for
    each fused step, the map cost the build steps × values (7.6 of 10.1 s building an 8,000-node MLP)."""
    read, names = _SLOT_NAMES.get(plan, (0, {}))
    if read < len(plan.slot):  # the new entries, read from the end
        new = list(itertools.islice(reversed(plan.slot.items()), len(plan.slot) - read))
        names.update((s, n) for n, s in reversed(new))
        _SLOT_NAMES[plan] = (len(plan.slot), names)
    return names


def synthetic_step(
    plan: Plan, op: str, name: str, members: Sequence[Step], ins: Sequence[int], outs: Sequence[int]
) -> tuple[onnx.NodeProto, Attrs]:
    from onnxtrain.engine.plan import FUSED_DOMAIN, fused_doc, fused_members, graph_label

    names = slot_names(plan)
    node = helper.make_node(
        op,
        [names.get(s, "") for s in ins],
        [names.get(s, "") for s in outs],
        name=name,
        domain=FUSED_DOMAIN,
    )
    # the graph's nodes, in order (a member that is itself a fused step: its own; the Adds of an expanded Sum:
    # the Sum, once)
    labels: list[str] = []
    for label in (label for m in members for label in fused_members(m.node) or [graph_label(m.node)]):
        if not labels or labels[-1] != label:
            labels.append(label)
    node.doc_string = fused_doc(labels)
    attrs = Attrs({}, op, name, plan.opset, len(outs), tuple(True for _ in outs))
    return node, attrs


def make_step(
    plan: Plan,
    op: str,
    members: Sequence[Step],
    ins: Sequence[int],
    outs: Sequence[int],
    fn: Callable[[Sequence[Any], Attrs], Sequence[Any]],
) -> Step:
    from onnxtrain.engine.plan import Step

    name = f"{op}({members[-1].node.name or members[-1].node.op_type})"
    node, attrs = synthetic_step(plan, op, name, members, ins, outs)
    return Step(fn, tuple(ins), tuple(outs), attrs, (), node)


# ---- common subexpressions -------------------------------------------------------------------------------
