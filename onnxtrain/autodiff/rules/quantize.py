"""Gradient rules of the quantization ops (same names and order as engine/kernels/quantize.py).

Every op here either outputs integers (or float8/float4 codes) or reads them, so none carries a
gradient of its own. DequantizeLinear's float output depends smoothly on x_scale (dY·(x − x_zero_point)),
but its schema allows no float64 scale, so such a rule could not be checked by a float64 gradient row;
it is left without one.

Quantization-aware training differentiates the pair instead: ``y = DequantizeLinear(QuantizeLinear(x, s,
zp), s, zp')`` gets the straight-through estimator of torch's fake quantizer,

    dX = dY  where  qmin <= round(x / s) + zp <= qmax,   0 elsewhere

(:func:`find_fake_quants`; the builder applies it at the DequantizeLinear node). An integer Clip with
constant bounds between the two (torch's fake quantizer with a narrower quant_min/quant_max, e.g. 7-bit
``QuantizeLinear(uint8) -> Clip(0, 127) -> DequantizeLinear``) narrows [qmin, qmax] to its range; blocked
pairs (``block_size``) repeat each block's scale over its elements. A pair reached any other way (different
scales, other integer ops between, a float8 target, DynamicQuantizeLinear) raises a GradientError naming
its nodes when a gradient would have to cross it, rather than giving that path a silent zero.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
from onnx import NodeProto, TensorProto

from onnxtrain.autodiff.registry import no_gradient
from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.builder import NodeWriter, elem_type, static_shape

if TYPE_CHECKING:
    from onnxtrain.autodiff.builder import _Backward

no_gradient("QuantizeLinear", "DequantizeLinear", "DynamicQuantizeLinear")
no_gradient("MatMulInteger", "QLinearMatMul", "ConvInteger", "QLinearConv")


# ---- the straight-through estimator of a QuantizeLinear -> DequantizeLinear pair -----------------------

_T = TensorProto
# integer type -> (lowest, highest value); float8/float4 targets get no straight-through estimator
_RANGES: dict[int, tuple[int, int]] = {
    _T.UINT8: (0, 255), _T.INT8: (-128, 127), _T.UINT16: (0, 65535), _T.INT16: (-32768, 32767),
    _T.UINT4: (0, 15), _T.INT4: (-8, 7),
}
_FLOATS = frozenset({_T.FLOAT, _T.FLOAT16, _T.BFLOAT16, _T.DOUBLE})
for _name, _lo, _hi in (("UINT2", 0, 3), ("INT2", -2, 1)):  # newer onnx only
    if hasattr(_T, _name):
        _RANGES[getattr(_T, _name)] = (_lo, _hi)


@dataclass
class FakeQuant:
    """One QuantizeLinear -> DequantizeLinear pair to an integer type, the two nodes reading one scale.

    ``stop`` and ``uses`` let the builder treat it as the DequantizeLinear's rule: no input of that node
    gets a gradient through it, and it reads none of them (the gradient goes to ``x``, Q's input).
    """

    x: str
    scale: str
    zero_point: str  # "" when omitted
    scale_type: int
    x_type: int
    lo: int
    hi: int
    unsqueeze: list[int]  # axes making a 1-D (per-axis) scale broadcast against x
    div_type: int = 0  # the type x / scale is computed in (the forward's); 0: scale_type
    y_type: int = 0  # the DequantizeLinear's output type (dy's); 0: x_type
    block: int = 0  # blocked quantization: the block size along ``block_axis``; 0: none
    block_axis: int = 0
    block_shape: list[int] = field(default_factory=list)  # the (static) shape of the blocked scale
    stop: frozenset[int] = field(default=frozenset({0, 1, 2}))
    uses: frozenset[str] = field(default=frozenset())

    def stopped(self, node: NodeProto) -> frozenset[int]:
        """As :meth:`Rule.stopped <onnxtrain.autodiff.registry.Rule.stopped>`: every slot."""
        return self.stop

    def grad(self, w: NodeWriter, dy: str, et: int) -> str:
        """dx, given dy: dy where x quantizes inside the type's range (boundaries included), else 0."""
        ct = self.div_type or self.scale_type
        s = self.scale if ct == self.scale_type else w.one("Cast", self.scale, to=ct)
        # the zero point is cast first: a 4-bit one has no Unsqueeze in onnxruntime
        zp = w.one("Cast", self.zero_point, to=ct) if self.zero_point else ""
        if self.block:
            s = self._unblock(w, s)
            zp = self._unblock(w, zp) if zp else zp
        if self.unsqueeze:
            axes = w.ints(self.unsqueeze)
            s = w.one("Unsqueeze", s, axes)
            zp = w.one("Unsqueeze", zp, axes) if zp else zp
        x = self.x if self.x_type == ct else w.one("Cast", self.x, to=ct)
        v = w.one("Round", w.one("Div", x, s))  # as the forward: divided in the scale's type, half to even
        if zp:
            v = w.one("Add", v, zp)
        inside = w.one("And", w.one("GreaterOrEqual", v, w.const(np.asarray(self.lo), ct)),
                       w.one("LessOrEqual", v, w.const(np.asarray(self.hi), ct)))
        if self.y_type and self.y_type != et:  # a DequantizeLinear output_dtype other than x's type
            dy = w.one("Cast", dy, to=et)
        return w.one("Where", inside, dy, w.const(np.asarray(0.0), et))

    def _unblock(self, w: NodeWriter, t: str) -> str:
        """A blocked scale (or zero point) repeated to x's extent: each value over its block along the axis,
        the last block cut to x's length (Unsqueeze, Expand, Reshape, Slice)."""
        a, b, shp = self.block_axis, self.block, self.block_shape
        t = w.one("Unsqueeze", t, w.ints([a + 1]))
        t = w.one("Expand", t, w.ints([*shp[: a + 1], b, *shp[a + 1:]]))
        t = w.one("Reshape", t, w.ints([*shp[:a], shp[a] * b, *shp[a + 1:]]))
        return w.one("Slice", t, w.ints([0]), w.one("Shape", self.x, start=a, end=a + 1), w.ints([a]))


@dataclass
class UnmatchedQuant:
    """A QuantizeLinear whose integers reach a DequantizeLinear in a way no straight-through estimator covers.

    The builder treats it as a :class:`FakeQuant` (so that it sees the float path through it) but its
    :meth:`grad` raises: a gradient that would have to cross it would otherwise be a silent zero.
    """

    x: str
    what: str
    stop: frozenset[int] = field(default=frozenset({0, 1, 2}))
    uses: frozenset[str] = field(default=frozenset())

    def stopped(self, node: NodeProto) -> frozenset[int]:
        return self.stop

    def grad(self, w: NodeWriter, dy: str, et: int) -> str:
        from onnxtrain.autodiff.builder import GradientError

        raise GradientError(
            f"{self.what}: not a fake-quantization pair the straight-through estimator handles, so "
            f"{self.x!r} would get no gradient through it (it would be silently zero); supported: "
            "QuantizeLinear -> [Clip with constant bounds] -> DequantizeLinear to an integer type, the two "
            "nodes reading one scale"
        )


def _same_value(bw: _Backward, a: str, b: str) -> bool:
    if a == b:
        return True
    va, vb = bw.constant_value(a), bw.constant_value(b)
    return va is not None and vb is not None and np.shape(va) == np.shape(vb) and bool(np.all(va == vb))


def _clip_range(bw: _Backward, c: NodeProto) -> tuple[float, float] | None:
    """The constant bounds of an integer Clip (±inf where omitted), or None when one is not constant."""
    if parse_attributes(c, bw.opset).get("min") is not None and len(c.input) < 2:
        return None  # Clip-6 (float only)
    bounds = []
    for i, default in ((1, -np.inf), (2, np.inf)):
        if len(c.input) <= i or not c.input[i]:
            bounds.append(default)
            continue
        v = bw.constant_value(c.input[i])
        if v is None or np.size(v) != 1:
            return None
        bounds.append(float(np.asarray(v).reshape(())))
    return bounds[0], bounds[1]


def _fake_quant(bw: _Backward, q: NodeProto, d: NodeProto, between: list[NodeProto]) -> FakeQuant | str:
    """The pattern of Q feeding D (through ``between``: Identity, Clip), or why it does not apply."""
    if len(q.input) < 2 or len(d.input) < 2 or not _same_value(bw, q.input[1], d.input[1]):
        return "the two read different scales"
    qa, da = parse_attributes(q, bw.opset), parse_attributes(d, bw.opset)
    x, scale = q.input[0], q.input[1]
    zp = q.input[2] if len(q.input) > 2 else ""
    to = elem_type(bw.types, zp) if zp else (qa.get("output_dtype") or _T.UINT8)
    s_shape, x_shape = static_shape(bw.types, scale), static_shape(bw.types, x)
    s_type, x_type = elem_type(bw.types, scale), elem_type(bw.types, x)
    if to not in _RANGES:
        return "the target type is not an integer type (float8, float4?)"
    if s_shape is None or not s_type or not x_type:
        return "the scale's or x's type or rank is unknown"
    lo, hi = _RANGES[to]
    for c in between:
        if c.op_type == "Identity":
            continue
        rng = _clip_range(bw, c) if c.op_type == "Clip" else None
        if rng is None:
            return f"{c.op_type} node {c.name or c.output[0]!r} lies between them"
        lo, hi = max(lo, rng[0]), min(hi, rng[1])  # lo > hi: an empty range, a constant output
    unsqueeze: list[int] = []
    block, block_axis = int(qa.get("block_size") or 0), 0
    if block or da.get("block_size"):
        r = len(s_shape)
        if (x_shape is not None and len(x_shape) != r) or r == 0 or any(v is None for v in s_shape):
            return "blocked quantization with a scale of unknown shape"
        block_axis = qa.get("axis", 1) % r
        if int(da.get("block_size") or 0) != block or da.get("axis", 1) % r != block_axis:
            return "blocked quantization with different blocks"
    elif len(s_shape) == 1:
        if x_shape is None:
            return "a per-axis scale on x of unknown rank"
        r = len(x_shape)
        axis, d_axis = qa.get("axis", 1) % max(r, 1), da.get("axis", 1) % max(r, 1)
        if axis != d_axis and s_shape[0] != 1:
            return "per-axis quantization along different axes"
        unsqueeze = list(range(1, r - axis))
    elif len(s_shape) > 1:
        return "a scale of rank > 1 without block_size"
    # the forward divides in the precision attribute's type, else the scale's, a float8e8m0 or int32 scale
    # in float32 (engine/kernels/quantize.py)
    div = qa.get("precision") or s_type
    if div not in _FLOATS:
        div = _T.FLOAT
    y_type = da.get("output_dtype") or s_type
    shape = [int(v) for v in s_shape] if block else []
    return FakeQuant(x, scale, zp, s_type, x_type, int(lo), int(hi), unsqueeze, div_type=div, y_type=y_type,
                     block=block, block_axis=block_axis, block_shape=shape)


# integer ops looked through from a DequantizeLinear back to its QuantizeLinear: Identity and a Clip with
# constant bounds are part of the pattern; the others only make an error (UnmatchedQuant) of the pair
_BETWEEN = frozenset({"Identity", "Clip", "Max", "Min", "Relu", "Abs", "Neg", "Cast", "Reshape", "Flatten",
                      "Squeeze", "Unsqueeze", "Transpose", "Expand", "Tile"})


def _quantizer(bw: _Backward, d: NodeProto) -> tuple[NodeProto | None, list[NodeProto]]:
    """The QuantizeLinear (or DynamicQuantizeLinear) whose integers ``d`` reads, directly or through
    :data:`_BETWEEN` ops (listed too, nearest to ``d`` first); None when there is none."""
    between: list[NodeProto] = []
    name = d.input[0]
    while True:
        where = bw.producer.get(name)
        if where is None:
            return None, between
        n = bw.fwd_nodes[where[0]]
        if n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear") and where[1] == 0:
            return n, between
        if n.op_type not in _BETWEEN or not n.input or len(between) > 32:
            return None, between
        between.append(n)
        name = n.input[0]


def find_fake_quants(bw: _Backward) -> dict[int, FakeQuant | UnmatchedQuant]:
    """The QuantizeLinear -> DequantizeLinear pairs of the forward graph, keyed by the index of the
    DequantizeLinear node: a :class:`FakeQuant` where the straight-through estimator applies, else an
    :class:`UnmatchedQuant` (an error if a gradient has to cross it)."""
    found: dict[int, FakeQuant | UnmatchedQuant] = {}
    for k, d in enumerate(bw.fwd_nodes):
        if d.op_type != "DequantizeLinear" or not d.input:
            continue
        q, between = _quantizer(bw, d)
        if q is None or not q.input:
            continue
        names = " -> ".join(f"{n.op_type} {n.name or n.output[0]!r}" for n in [q, *reversed(between), d])
        if q.op_type == "DynamicQuantizeLinear":
            found[k] = UnmatchedQuant(q.input[0], f"{names}: DynamicQuantizeLinear")
            continue
        fq = _fake_quant(bw, q, d, between)
        found[k] = fq if isinstance(fq, FakeQuant) else UnmatchedQuant(q.input[0], f"{names} ({fq})")
    return found
