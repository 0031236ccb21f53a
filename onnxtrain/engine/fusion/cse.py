"""Common subexpressions: a step repeating an earlier deterministic step is dropped."""

from __future__ import annotations

from typing import TYPE_CHECKING

from onnxtrain.engine.fusion.common import attr_key, protected_slots
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, RANDOM_OPS

if TYPE_CHECKING:
    from onnxtrain.engine.plan import Plan, Step


def eliminate_common_steps(plan: Plan, steps: list[Step]) -> list[Step]:
    """Drop steps that repeat an earlier deterministic step on the same inputs; rewire their consumers."""
    kept_slots = protected_slots(plan)
    last_use: dict[int, int] = {}
    for k, st in enumerate(steps):
        for s in st.inputs:
            last_use[s] = k
    seen: dict[tuple, Step] = {}
    alias: dict[int, int] = {}
    out: list[Step] = []
    for k, st in enumerate(steps):
        ins = tuple(alias.get(s, s) for s in st.inputs)
        if ins != st.inputs:
            st = type(st)(st.fn, ins, st.outputs, st.attrs, st.free, st.node)
        if st.node.op_type in RANDOM_OPS or not st.inputs or st.node.domain not in DEFAULT_DOMAINS:
            out.append(st)
            continue
        key = (st.node.op_type, st.fn, ins, len(st.outputs), attr_key(st.node))
        first = seen.get(key)
        # merge only when the first outputs are alive here anyway: a later copy that recomputes a value
        # freed long ago (gradient checkpointing) is there to save memory and stays
        if (
            first is None
            or any(s in kept_slots for s in st.outputs)
            or any((a >= 0) != (b >= 0) for a, b in zip(first.outputs, st.outputs))
            or any(last_use.get(s, -1) < k and s not in kept_slots for s in first.outputs if s >= 0)
        ):
            if first is None or any(last_use.get(s, -1) < k for s in first.outputs if s >= 0):
                seen[key] = st
            out.append(st)
            continue
        for a, b in zip(st.outputs, first.outputs):
            if a >= 0:
                alias[a] = b
    return out
