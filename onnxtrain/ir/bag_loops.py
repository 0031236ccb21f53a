"""Loops that pool bags of table rows: torch's ``nn.EmbeddingBag`` as the TorchScript exporter writes it.

The exported graph has one ``Loop`` iteration per bag. Iteration ``i`` reads the bag's bounds ``S[i]`` and
``E[i]`` from two outer tensors, slices the ids ``ids[S[i]:E[i]]``, gathers those rows of the table and
reduces them over the rows (sum, mean or max) into row ``i`` of the loop's one scan output::

    body(i, cond):  a = Gather(S, i); b = Gather(E, i)
                    rows = Gather(table, Slice(ids, Unsqueeze(a, 0), Unsqueeze(b, 0), [0]))
                    return Cast(c), ReduceMean(rows, axes=[0], keepdims=0)

:func:`match_bag_loop` recognises that body, node by node; the engine then pools all bags at once
(:mod:`onnxtrain.engine.bag_loops`) and the autodiff scatters the pooled gradient into the table in one
step (:mod:`onnxtrain.autodiff.rules.control_flow`), instead of one iteration per bag.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, numpy_helper

from onnxtrain.ir.attrs import attribute_value

REDUCTIONS = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max"}


@dataclass(frozen=True)
class BagLoop:
    """The outer values a bag-pooling Loop reads, by name, and how it reduces a bag."""

    starts: str  # S: 1-D integer tensor, bag i starts at ids position S[i] (Slice semantics)
    ends: str  # E: bag i ends (exclusive) at E[i]
    ids: str  # the 1-D ids sliced
    table: str  # the tensor whose rows (axis 0) are gathered
    reduce: str  # "sum", "mean" or "max"
    cond_source: str | None  # the outer value the body's condition output copies; None: the body's own
    checks: dict[str, list[int]] = field(default_factory=dict)  # outer values (a Slice's axes) that must
    # hold these integers for the match to stand: a caller that cannot see them checks them at run time


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: attribute_value(a) for a in node.attribute}


def match_bag_loop(node: onnx.NodeProto, constant: Callable[[str], Any] | None = None) -> BagLoop | None:
    """The bag pooling a ``Loop`` node does, or None when its body is anything else. ``constant`` gives the
    value of an outer name when it is fixed (else None); outer integers it cannot tell go to ``checks``."""
    if node.op_type != "Loop" or node.domain not in ("", "ai.onnx"):
        return None
    if len(node.input) != 2 or not node.input[0]:  # a trip count, no loop-carried values
        return None
    body = next((a.g for a in node.attribute if a.name == "body"), None)
    if body is None or len(body.input) != 2 or len(body.output) != 2:
        return None
    it, cond_in = body.input[0].name, body.input[1].name
    consts = {t.name: numpy_helper.to_array(t) for t in body.initializer}
    made: dict[str, onnx.NodeProto] = {}
    for n in body.node:
        if n.op_type == "Constant" and len(n.output) == 1 and n.attribute and n.attribute[0].name == "value":
            consts[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
        else:
            made.update((o, n) for o in n.output)
    local = {it, cond_in, *consts, *made}

    def outer(name: str) -> bool:
        return bool(name) and name not in local

    checks: dict[str, list[int]] = {}

    def const(name: str) -> list[int] | None:
        v = consts.get(name)
        if v is None and outer(name) and constant is not None:
            v = constant(name)
        return None if v is None else [int(x) for x in np.asarray(v).reshape(-1)]

    def is_const(name: str, want: list[int]) -> bool:
        """``name`` holds ``want``: known here, or an outer value recorded in ``checks``."""
        got = const(name)
        if got is None and outer(name):
            checks[name] = want
            return True
        return got == want

    def producer(name: str, op: str) -> onnx.NodeProto | None:
        n = made.get(name)
        return n if n is not None and n.op_type == op else None

    used: list[onnx.NodeProto] = []

    def axes_of(n: onnx.NodeProto, at: int) -> list[int] | None:
        """A node's ``axes``: the attribute, else the constant input ``at``."""
        a = _attrs(n).get("axes")
        if a is not None:
            return list(a)
        return const(n.input[at]) if len(n.input) > at and n.input[at] else None

    def bound(name: str) -> str | None:
        """The outer tensor X of ``Unsqueeze(Gather(X, i), [0])``."""
        u = producer(name, "Unsqueeze")
        if u is None or axes_of(u, 1) != [0]:
            return None
        g = producer(u.input[0], "Gather")
        if g is None or _attrs(g).get("axis", 0) != 0 or g.input[1] != it or not outer(g.input[0]):
            return None
        used.extend((u, g))
        return g.input[0]

    red = made.get(body.output[1].name)
    if red is None or red.op_type not in REDUCTIONS or _attrs(red).get("keepdims", 1) != 0:
        return None
    if axes_of(red, 1) != [0]:
        return None
    gather = producer(red.input[0], "Gather")
    if gather is None or _attrs(gather).get("axis", 0) != 0 or not outer(gather.input[0]):
        return None
    sl = producer(gather.input[1], "Slice")
    if sl is None or len(sl.input) < 3 or not outer(sl.input[0]):
        return None
    if len(sl.input) > 3 and sl.input[3] and not is_const(sl.input[3], [0]):
        return None
    if len(sl.input) > 4 and sl.input[4] and not is_const(sl.input[4], [1]):
        return None
    starts, ends = bound(sl.input[1]), bound(sl.input[2])
    if starts is None or ends is None:
        return None
    used.extend((red, gather, sl))
    cond_out = body.output[0].name
    cond_source: str | None = None
    if cond_out != cond_in:
        c = made.get(cond_out)
        if c is None or c.op_type not in ("Identity", "Cast"):
            return None
        if c.op_type == "Cast" and _attrs(c).get("to") != TensorProto.BOOL:
            return None
        if c.input[0] != cond_in:
            if not outer(c.input[0]):
                return None
            cond_source = c.input[0]
        used.append(c)
    if {id(n) for n in made.values()} != {id(n) for n in used}:
        return None  # anything else in the body: not a plain bag pooling
    return BagLoop(starts, ends, sl.input[0], gather.input[0], REDUCTIONS[red.op_type], cond_source, checks)
