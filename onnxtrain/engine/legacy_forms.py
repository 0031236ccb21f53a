"""Nodes of an old operator version in a form the kernels do not run.

The kernels follow the newer versions of their operators (and the older forms they were written for: the
``axes`` attribute of Unsqueeze-11, Clip-6's bounds, ...). A few forms of opsets before 9 are run by none,
and would give wrong values or a numpy error: the elementwise ops' ``broadcast=1`` with an ``axis``
(opsets 1 to 6, NumPy-style broadcasting from opset 7), Pad-1's ``paddings``, Reshape-1's ``shape``
attribute, Cast-1's string ``to``, Concat-1 without an ``axis``, BatchNormalization's ``spatial=0``
(opsets 7 and 8), PRelu's per-channel 1-D slope (before opset 7) and Tile-1's ``tiles`` and ``axis``
inputs. Such nodes are refused by name
(onnxruntime has no kernel for most of them), with the way to convert the model.
"""

from __future__ import annotations

from collections.abc import Callable

import onnx
from onnx import AttributeProto

from onnxtrain.ir.graphs import DEFAULT_DOMAINS

_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "And", "Or", "Xor", "Equal", "Greater", "Less")


def _attrs(node: onnx.NodeProto) -> dict[str, AttributeProto]:
    return {a.name: a for a in node.attribute}


def _axis_broadcast(node: onnx.NodeProto, rank: Callable[[str], int | None]) -> str | None:
    a = _attrs(node)
    if "broadcast" in a and a["broadcast"].i and "axis" in a:
        ra, rb = rank(node.input[0]), rank(node.input[1])
        if ra is not None and rb is not None and a["axis"].i in (ra - rb, -rb):
            return None  # the last axes aligned: NumPy's broadcasting
        return (f"broadcast=1 with axis={a['axis'].i} (the second input aligned at that axis, where "
                "NumPy-style broadcasting aligns the last axes)")
    return None


def _named(name: str, what: str) -> Callable[[onnx.NodeProto, Callable[[str], int | None]], str | None]:
    return lambda node, _: f"attribute {name!r} ({what})" if name in _attrs(node) else None


def _string_to(node: onnx.NodeProto, _: Callable[[str], int | None]) -> str | None:
    a = _attrs(node).get("to")
    string = a is not None and a.type == AttributeProto.STRING
    return "a string 'to' (an integer type since Cast-6)" if string else None


def _no_axis(node: onnx.NodeProto, _: Callable[[str], int | None]) -> str | None:
    return None if "axis" in _attrs(node) else "no 'axis' (Concat-1 takes 1 then; required since Concat-4)"


def _spatial(node: onnx.NodeProto, rank: Callable[[str], int | None]) -> str | None:
    a = _attrs(node).get("spatial")
    if a is None or a.i != 0 or rank(node.input[0]) == 2:  # of (N, C): per value is per channel
        return None
    return "spatial=0 (statistics per value, not per channel)"


def _channel_slope(node: onnx.NodeProto, rank: Callable[[str], int | None]) -> str | None:
    rx, rs = rank(node.input[0]), rank(node.input[1])
    if rx is not None and rx > 2 and rs == 1:  # a [C] slope: per channel (axis 1) before PRelu-7
        return ("a 1-D slope, applied per channel (axis 1) before PRelu-7, where NumPy-style broadcasting "
                "aligns it with the last axis")
    return None


def _tiles_axis(node: onnx.NodeProto, _: Callable[[str], int | None]) -> str | None:
    if len(node.input) < 3:  # (the schema requires all three: the check of the node's inputs says so)
        return None
    return ("inputs 'tiles' and 'axis' (Tile-1 repeats along one axis; one 'repeats' per dimension since "
            "Tile-6)")


# op → (the opsets where the form exists, what makes a node that form)
_FORMS: dict[str, tuple[range, Callable[[onnx.NodeProto, Callable[[str], int | None]], str | None]]] = {
    **{op: (range(1, 7), _axis_broadcast) for op in _BROADCASTING},
    "Pad": (range(1, 2), _named("paddings", "Pad-1's pads")),
    "Reshape": (range(1, 5), _named("shape", "Reshape-1's target, an input since Reshape-5")),
    "Cast": (range(1, 6), _string_to),
    "Concat": (range(1, 4), _no_axis),
    "BatchNormalization": (range(1, 9), _spatial),
    "PRelu": (range(1, 7), _channel_slope),
    "Tile": (range(1, 6), _tiles_axis),
}
# the way out where converting the opset is none (onnx's converter keeps PRelu's [C] slope as it is)
_ADVICE = {"PRelu": "give the slope the shape [C, 1, ..., 1] (one 1 per spatial axis of X)",
           # (nor has it an adapter for Tile-1)
           "Tile": "write it as a Tile of opset 6 or later, with a 'repeats' input (the count per dimension)"}


def legacy_form(node: onnx.NodeProto, opset: int, rank: Callable[[str], int | None]) -> str | None:
    """What makes ``node`` (in a model of default-domain ``opset``) an old form no kernel runs; else None.
    ``rank``: a value's rank where known (a form that means what the kernel does for those ranks runs)."""
    form = _FORMS.get(node.op_type)
    if form is None or node.domain not in DEFAULT_DOMAINS or opset not in form[0]:
        return None
    return form[1](node, rank)


def refusal(node: onnx.NodeProto, k: int, opset: int, why: str) -> str:
    """The error message for ``node`` (index ``k``), refused for ``why``."""
    label = repr(node.name) if node.name else f"#{k} (unnamed)"
    advice = _ADVICE.get(node.op_type, "convert the model to a newer opset with "
                                       "onnx.version_converter.convert_version(model, 9) or later")
    return (f"node {label} ({node.op_type}, opset {opset}) has a form of an older version of its operator "
            f"that the engine does not run: {why}; {advice}")
