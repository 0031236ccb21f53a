"""Dilated Convs and pools with ``auto_pad`` SAME_* given explicit pads for onnxruntime, which refuses or
miscomputes the combination.

onnxruntime 1.32's Conv kernel fails at run time on a Conv that has both dilations and ``auto_pad``
SAME_UPPER or SAME_LOWER ("Dilation not supported for AutoPadType::SAME_UPPER or AutoPadType::SAME_LOWER"),
a node torch's TorchScript exporter writes for ``nn.Conv2d(..., padding="same", dilation=2)``; its pools
(MaxPool, AveragePool, LpPool) compute SAME pads as if the kernel were not dilated, silently: a 3×3 pool
dilated by 2 at stride 1 shrinks a 7×8 input to 5×6. ONNX defines SAME padding from the output size
``ceil(in / stride)``: a total of ``(out - 1)·stride + (k - 1)·dilation + 1 - in`` per spatial axis, the odd
one at the end (SAME_UPPER) or the beginning (SAME_LOWER). At stride 1 the total is ``(k - 1)·dilation``
whatever the input size, so the node takes those pads as its ``pads`` attribute; at a larger stride only
where the input's spatial sizes are known: a Conv whose sizes are not is left to onnxruntime's error, a
pool (which would give wrong values) is refused here, as one whose pads reach its kernel's size (which
onnxruntime refuses when explicit). The values are the same.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx

from onnxtrain.ir.builder import replace_attributes, static_kernel, static_shape
from onnxtrain.ir.conv_shapes import same_pads
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

_SAME = (b"SAME_UPPER", b"SAME_LOWER")


def dilated_same_pads(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each dilated SAME-padded Conv or pool (bodies' too) given explicit pads (module
    docstring); a copy, or ``model`` itself when none needs them or a Conv's pads cannot be known before the
    run. ValueError for a pool that onnxruntime cannot run right (:func:`_check_pool_pads`)."""
    if not any(_candidate(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    types = typed()
    changed = False
    for g in walk_graphs(out.graph):
        for n in g.node:
            pads = _explicit_pads(n, types) if _candidate(n) else None
            if n.op_type in _POOLS and _candidate(n):
                _check_pool_pads(n, pads)
            if pads is None:
                continue
            replace_attributes(n, ("auto_pad",), pads=pads)
            changed = True
    return out if changed else model


def _attrs(node: onnx.NodeProto) -> dict[str, onnx.AttributeProto]:
    return {a.name: a for a in node.attribute}


_POOLS = ("MaxPool", "AveragePool", "LpPool")


def _check_pool_pads(node: onnx.NodeProto, pads: list[int] | None) -> None:
    """ValueError for a dilated SAME pool that onnxruntime cannot run right: its pads unknown before the run
    (a stride above 1 over unknown sizes), or one of them as wide as the kernel (which onnxruntime refuses
    when explicit)."""
    kernel = list(_attrs(node)["kernel_shape"].ints)
    why = None
    if pads is None:
        why = "at a stride above 1 its pads need the input's spatial sizes, which the model leaves unknown"
    elif any(p >= kernel[i % len(kernel)] for i, p in enumerate(pads)):
        why = f"its SAME pads {pads} reach the kernel's size {kernel}, which onnxruntime refuses explicitly"
    if why is not None:
        name = node.name or node.output[0]
        raise ValueError(f"node {name!r} ({node.op_type}): onnxruntime computes the SAME padding of a "
                         f"dilated pool as if it were not dilated, and {why}: run it on the numpy engine "
                         "(the default backend)")


def _candidate(node: onnx.NodeProto) -> bool:
    if node.op_type not in ("Conv", *_POOLS) or node.domain not in DEFAULT_DOMAINS:
        return False
    a = _attrs(node)
    return ("auto_pad" in a and a["auto_pad"].s in _SAME and "dilations" in a
            and any(d != 1 for d in a["dilations"].ints))


def _explicit_pads(node: onnx.NodeProto, types: dict) -> list[int] | None:
    """The begin and end pads of every spatial axis, or None when a size they need is unknown."""
    a = _attrs(node)
    dil = list(a["dilations"].ints)
    kernel = static_kernel(node, types)
    if kernel is None or len(kernel) != len(dil):
        return None
    strides = list(a["strides"].ints) if "strides" in a else [1] * len(dil)
    sizes: list[int | None] = [None] * len(dil)
    if any(s != 1 for s in strides):
        x = static_shape(types, node.input[0])
        if x is None or len(x) != len(dil) + 2 or any(d is None for d in x[2:]):
            return None
        sizes = x[2:]
    auto_pad = a["auto_pad"].s.decode()
    # (at stride 1 the pads do not depend on the size: any size gives them)
    pairs = [same_pads(auto_pad, 1 if size is None else size, (kk - 1) * d + 1, s)
             for kk, d, s, size in zip(kernel, dil, strides, sizes, strict=True)]
    return [b for b, _ in pairs] + [e for _, e in pairs]
