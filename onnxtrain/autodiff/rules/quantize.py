"""Gradient rules of the quantization ops (same names and order as engine/kernels/quantize.py).

Every op here either outputs integers (or float8/float4 codes) or reads them, so none carries a
gradient of its own. DequantizeLinear's float output depends smoothly on x_scale (dY·(x − x_zero_point)),
but its schema allows no float64 scale, so such a rule could not be checked by a float64 gradient row;
it is left without one.

Quantization-aware training differentiates the pair instead: ``y = DequantizeLinear(QuantizeLinear(x, s,
zp), s, zp')`` gets the straight-through estimator of torch's fake quantizer,

    dX = dY  where  qmin <= round(x / s) + zp <= qmax,   0 elsewhere

(:func:`find_fake_quants`; the builder applies it at the DequantizeLinear node).
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


def _same_value(bw: _Backward, a: str, b: str) -> bool:
    if a == b:
        return True
    va, vb = bw.constant_value(a), bw.constant_value(b)
    return va is not None and vb is not None and np.shape(va) == np.shape(vb) and bool(np.all(va == vb))


def _fake_quant(bw: _Backward, q: object, d: object) -> FakeQuant | None:
    """The pattern of Q feeding D, or None when it does not apply (blocked quantization, a float8 target,
    different scales, unknown ranks or types)."""
    if len(q.input) < 2 or len(d.input) < 2 or not _same_value(bw, q.input[1], d.input[1]):
        return None
    qa, da = parse_attributes(q, bw.opset), parse_attributes(d, bw.opset)
    if qa.get("block_size") or da.get("block_size"):
        return None
    x, scale = q.input[0], q.input[1]
    zp = q.input[2] if len(q.input) > 2 else ""
    to = elem_type(bw.types, zp) if zp else (qa.get("output_dtype") or _T.UINT8)
    s_shape, x_shape = static_shape(bw.types, scale), static_shape(bw.types, x)
    s_type, x_type = elem_type(bw.types, scale), elem_type(bw.types, x)
    if to not in _RANGES or s_shape is None or not s_type or not x_type:
        return None
    unsqueeze: list[int] = []
    if len(s_shape) == 1:
        if x_shape is None:
            return None
        r = len(x_shape)
        axis, d_axis = qa.get("axis", 1) % max(r, 1), da.get("axis", 1) % max(r, 1)
        if axis != d_axis and s_shape[0] != 1:
            return None
        unsqueeze = list(range(1, r - axis))
    elif len(s_shape) > 1:
        return None
    lo, hi = _RANGES[to]
    # the forward divides in the precision attribute's type, else the scale's, a float8e8m0 or int32 scale
    # in float32 (engine/kernels/quantize.py)
    div = qa.get("precision") or s_type
    if div not in _FLOATS:
        div = _T.FLOAT
    y_type = da.get("output_dtype") or s_type
    return FakeQuant(x, scale, zp, s_type, x_type, lo, hi, unsqueeze, div_type=div, y_type=y_type)


def find_fake_quants(bw: _Backward) -> dict[int, FakeQuant]:
    """The QuantizeLinear -> DequantizeLinear pairs of the forward graph, keyed by the index of the
    DequantizeLinear node."""
    found: dict[int, FakeQuant] = {}
    for k, d in enumerate(bw.fwd_nodes):
        if d.op_type != "DequantizeLinear" or not d.input:
            continue
        where = bw.producer.get(d.input[0])
        q = bw.fwd_nodes[where[0]] if where else None
        if q is None or q.op_type != "QuantizeLinear":
            continue
        fq = _fake_quant(bw, q, d)
        if fq is not None:
            found[k] = fq
    return found
