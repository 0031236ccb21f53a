"""Subgraphs with a shorter gradient than their nodes' rules give one by one.

The tanh GELU as torch exports it, ``y = c4 · x · (c3 + tanh(c2 · (x + c1 · x³)))`` (c4 = 0.5, c3 = 1), is
nine nodes, and x feeds four of them: node by node its gradient is a dozen products and a Sum of five
terms. Written out,

    dy/dx = c4 · ((c3 + t) + x · (1 − t²) · c2 · (1 + 3·c1·x²)),   t = tanh(...)

is twelve elementwise ops that reuse the forward's t (x² and 1 + t are computed again rather than kept):
fewer passes over the activation and fewer values kept for the backward, for any runtime
(onnxruntime-training fuses the pattern into a GeluGrad kernel instead).
The exact GELU, ``y = c4 · x · (1 + erf(x / s))``, likewise:

    dy/dx = c4 · ((1 + erf(u)) + x · exp(−u²) · 2 / (s·√π)),   u = x / s

in nine ops instead of ten and a Sum of two. ``ONNXTRAIN_GELU_GRAD=0`` turns both patterns off (for A/B
comparisons).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter
from onnxtrain.ir.types import symbolic_shape

if TYPE_CHECKING:
    from onnxtrain.autodiff.builder import _Backward


@dataclass
class TanhGelu:
    """One matched tanh GELU: its input, the forward value its gradient reuses (t), and its constants.

    x² and 1 + t are computed again, by the forward's own operations (same bits), rather than kept from
    the forward: a runtime then holds two activations per GELU until the backward instead of four.
    """

    x: str
    tanh: str  # t
    c1: float
    c2: float
    c4: float

    def grad(self, w: NodeWriter, dy: str, et: int) -> str:
        """dx, given dy."""
        one = w.const(np.asarray(1.0), et)
        s = w.one("Sub", one, w.one("Mul", self.tanh, self.tanh))  # 1 − t²
        cube = w.const(np.asarray(3.0 * self.c1), et)
        xr = self.x
        if et in (TensorProto.FLOAT16, TensorProto.BFLOAT16):
            # x·x overflows from |x| = 256 (float32 from 1.8e19), and x·(1 − t²)·r was then 0·inf = NaN:
            # r from x clipped to ±100, where 1 − t² is already 0 (one pass, half types only)
            xr = w.one("Clip", self.x, w.const(np.asarray(-100.0), et), w.const(np.asarray(100.0), et))
        r = w.one("Add", one, w.one("Mul", w.one("Mul", xr, xr), cube))  # 1 + 3·c1·x²
        u = w.one("Mul", w.one("Mul", self.x, s), w.one("Mul", r, w.const(np.asarray(self.c2), et)))
        v = w.one("Add", w.one("Add", self.tanh, one), u)  # (1 + t) + u
        return w.one("Mul", dy, w.one("Mul", v, w.const(np.asarray(self.c4), et)))


def _scalar(bw: _Backward, name: str) -> float | None:
    """The value of a one-element float constant (bfloat16 included), else None."""
    v = bw.constant_value(name)
    if v is None or np.size(v) != 1:
        return None
    a = np.asarray(v)
    if a.dtype.kind != "f" and a.dtype.name != "bfloat16":
        return None
    return float(a.reshape(()).astype(np.float64))


def _keeps_rank(bw: _Backward, x: str, nodes: list[Any]) -> bool:
    """Whether no constant operand of ``nodes`` has a higher rank than x (x's rank known, or every constant
    a 0-d scalar): a one-element constant of higher rank broadcasts y to a larger shape than x, and the
    one-piece gradient, of y's shape, would then need reducing (the node-by-node rules do it)."""
    xs = symbolic_shape(bw.types, x)
    for n in nodes:
        for i in n.input:
            v = bw.constant_value(i)
            if v is not None and np.ndim(v) > 0 and (xs is None or np.ndim(v) > len(xs)):
                return False
    return True


def _split(bw: _Backward, node: Any, op: str) -> tuple[float, str] | None:
    """(constant, other input) of a binary ``op`` node with one scalar constant operand."""
    if node is None or node.op_type != op or len(node.input) != 2:
        return None
    a, b = node.input
    ca, cb = _scalar(bw, a), _scalar(bw, b)
    if ca is not None and cb is None:
        return ca, b
    if cb is not None and ca is None:
        return cb, a
    return None


class _Readers:
    """Who makes and who reads each value of the forward graph."""

    def __init__(self, bw: _Backward):
        self.bw = bw
        self.consumers: dict[str, list[int]] = {}
        for k, n in enumerate(bw.fwd_nodes):
            for i in n.input:
                self.consumers.setdefault(i, []).append(k)
        self.outputs = {o.name for o in bw.model.graph.output}

    def made_by(self, name: str) -> tuple[int, Any] | tuple[None, None]:
        where = self.bw.producer.get(name)
        return (where[0], self.bw.fwd_nodes[where[0]]) if where else (None, None)

    def only_reader(self, name: str) -> tuple[int, Any] | tuple[None, None]:
        """The one node reading ``name`` (None when there are several, or it is a graph output)."""
        readers = self.consumers.get(name, [])
        if len(readers) != 1 or name in self.outputs:
            return None, None
        return readers[0], self.bw.fwd_nodes[readers[0]]

    def gelu_tail(self, v: str, x: str) -> tuple[list[int], str, float] | None:
        """Both GELUs end ``y = c4 · (x · (v + 1))``, each value read once: (the three nodes' indices,
        the name of v + 1, c4), or None."""
        kp, np_ = self.only_reader(v)
        mp = _split(self.bw, np_, "Add")  # p = v + 1
        if mp is None or mp[0] != 1.0:
            return None
        kq, nq = self.only_reader(np_.output[0])
        if nq is None or nq.op_type != "Mul" or sorted(nq.input) != sorted([x, np_.output[0]]):
            return None
        ky, ny = self.only_reader(nq.output[0])
        my = _split(self.bw, ny, "Mul")  # y = c4 · q
        if my is None:
            return None
        return [kp, kq, ky], np_.output[0], my[0]


def find_tanh_gelus(bw: _Backward) -> dict[int, TanhGelu]:
    """The tanh GELUs of the forward graph, keyed by the index of the node making y (the last one)."""
    g = _Readers(bw)
    made_by, only_reader = g.made_by, g.only_reader
    found: dict[int, TanhGelu] = {}
    for tanh in bw.fwd_nodes:
        if tanh.op_type != "Tanh" or len(tanh.input) != 1:
            continue
        _, n4 = made_by(tanh.input[0])
        m4 = _split(bw, n4, "Mul")  # e = c2 · d
        if m4 is None:
            continue
        c2, d = m4
        _, n3 = made_by(d)
        if n3 is None or n3.op_type != "Add" or len(n3.input) != 2:
            continue
        for x, c in (tuple(n3.input), tuple(reversed(n3.input))):  # d = x + c
            _, n2 = made_by(c)
            m2 = _split(bw, n2, "Mul")  # c = c1 · b
            if m2 is None:
                continue
            c1, b = m2
            _, n1 = made_by(b)
            if n1 is None or n1.op_type != "Mul" or len(n1.input) != 2 or x not in n1.input:
                continue
            a = n1.input[1] if n1.input[0] == x else n1.input[0]  # b = x · a
            _, n0 = made_by(a)
            if n0 is None or n0.op_type != "Mul" or list(n0.input) != [x, x]:
                continue
            tail = g.gelu_tail(tanh.output[0], x)  # p = 1 + t, q = x · p, y = c4 · q
            if tail is None:
                continue
            inner = [n0.output[0], n1.output[0], n2.output[0], n3.output[0], n4.output[0], tanh.output[0]]
            if any(only_reader(v)[0] is None for v in inner):
                continue  # an inner value read elsewhere: its own gradient would be lost
            (k_p, _, k_y), _, c4 = tail
            if not _keeps_rank(bw, x, [n2, n4, bw.fwd_nodes[k_p], bw.fwd_nodes[k_y]]):
                continue
            found[k_y] = TanhGelu(x, tanh.output[0], c1, c2, c4)
            break
    return found


@dataclass
class ErfGelu:
    """One matched exact GELU: its input, 1 + erf(u) from the forward, and its constants. u = x / s is
    computed again by the forward's own Div (same bits) rather than kept from the forward."""

    x: str
    divisor: str  # s, the forward Div's constant operand
    shifted: str  # 1 + erf(u)
    slope: float  # 2 / (s·√π), the factor of exp(−u²)
    c4: float

    def grad(self, w: NodeWriter, dy: str, et: int) -> str:
        """dx, given dy."""
        scaled = w.one("Div", self.x, self.divisor)  # u
        bell = w.one("Exp", w.one("Neg", w.one("Mul", scaled, scaled)))  # exp(−u²)
        t = w.one("Mul", w.one("Mul", self.x, bell), w.const(np.asarray(self.slope), et))
        v = w.one("Add", self.shifted, t)
        return w.one("Mul", dy, w.one("Mul", v, w.const(np.asarray(self.c4), et)))


def find_erf_gelus(bw: _Backward) -> dict[int, ErfGelu]:
    """The exact GELUs ``Mul(Mul(x, Add(Erf(Div(x, s)), 1)), c4)`` of the forward graph, keyed by the index
    of the node making y."""
    g = _Readers(bw)
    found: dict[int, ErfGelu] = {}
    for k1, erf in enumerate(bw.fwd_nodes):
        if erf.op_type != "Erf" or len(erf.input) != 1:
            continue
        _, div = g.made_by(erf.input[0])
        if div is None or div.op_type != "Div" or len(div.input) != 2:
            continue
        x, s = div.input[0], _scalar(bw, div.input[1])
        if s is None or s == 0 or _scalar(bw, x) is not None or g.only_reader(div.output[0])[0] != k1:
            continue
        tail = g.gelu_tail(erf.output[0], x)  # p = erf(u) + 1, q = x · p, y = c4 · q
        if tail is None:
            continue
        (k_p, _, k_y), shifted, c4 = tail
        if not _keeps_rank(bw, x, [div, bw.fwd_nodes[k_p], bw.fwd_nodes[k_y]]):
            continue
        found[k_y] = ErfGelu(x, div.input[1], shifted, 2.0 / (s * float(np.sqrt(np.pi))), c4)
    return found
