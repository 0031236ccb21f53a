"""ConvTransposes whose ``output_padding`` reaches their stride, or whose ``auto_pad`` SAME_* pads are
negative, rewritten for onnxruntime (it refuses the first and clamps the second).

ONNX (and torch) allow an ``output_padding`` below max(stride, dilation); onnxruntime 1.32 fails at run time
on one at or above the stride ("output_padding may be too large for stride"). The output is the full
transposed convolution (s·(S − 1) + k_eff rows) followed by ``output_padding`` rows of zeros, cropped by the
pads: rows [begin, full + output_padding − end). On such an axis the node takes no output_padding and the
end pad less it, and where the end pad is smaller than the output_padding, a ``Pad`` appends the rows of
zeros the pad did not crop. The same values. A bias belongs on every row, those added too: a rewritten node
that adds rows hands its bias to an ``Add`` after them (it left the added rows at zero, without the bias).
Only nodes with explicit pads (no ``auto_pad`` SAME_*, no
``output_shape``) are rewritten; the others stay as they are.

Under ``auto_pad`` SAME_* (no ``output_shape``) Y has S·s rows, so the pads total output_padding + k_eff − s
whatever S is (:func:`onnxtrain.ir.conv_shapes.conv_transpose_geometry`, the numpy engine's formula); a
kernel narrower than the stride makes that negative, which onnxruntime clamps to 0 (a 1×1 kernel at stride
2: 9 rows where ONNX says 10). :func:`same_conv_transposes` gives such nodes (and those whose
output_padding reaches their stride, for the rewrite above) explicit pads, the negative ones as rows of
zeros a ``Pad`` adds on their side.

With an ``output_shape`` the pads total s·(S − 1) + output_padding + k_eff − output_shape, split as under
SAME (the odd one at the end for SAME_UPPER, at the beginning otherwise); onnxruntime 1.32 refuses such a
node whose output_padding reaches its stride ("Explicit output_shape is inconsistent", whatever the
output_shape), and one whose total is below zero (an output larger than the full one, whose extra rows
ONNX's formula makes zeros). :func:`output_shape_conv_transposes` gives both explicit pads instead, where
X's spatial sizes are in the model (the negative ones as rows of zeros a ``Pad`` adds), and the rewrite
above then takes the output_padding. Where they are not, the first kind (from opset 12) runs without pads,
output_shape and output_padding, giving the s·(S − 1) + k_eff rows of the full output, and the pads come
from that output's Shape at run time: its rows [begin, begin + output_shape) with zeros outside them, a
``Pad`` by the rows that window overhangs and a ``Slice`` of it (:func:`_run_time_window`); the second kind
is left to onnxruntime's error.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen, model_opset, replace_attributes, static_kernel, static_shape
from onnxtrain.ir.conv_shapes import conv_transpose_geometry
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

_WINDOW_OPSET = 12  # Max of int64 values, for the pads taken at run time
_BIAS_OPSET = 7  # the first Add onnxruntime runs, for a bias moved after added rows


def large_output_paddings(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each ConvTranspose (bodies' too) whose output_padding reaches its stride rewritten
    (module docstring); a copy, or ``model`` itself when there is none."""
    if not any(_split(n) is not None for g in walk_graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    opset = model_opset(out)
    for g in walk_graphs(out.graph):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            split = _split(n)
            if split is None:
                nodes.append(n)
                continue
            op, pads, zeros = split
            replace_attributes(n, output_padding=op, pads=pads)
            nodes.append(n)
            if any(zeros):
                nodes.extend(_append_zeros(n, zeros, names, opset))
        del g.node[:]
        g.node.extend(nodes)
    return out


def _split(node: onnx.NodeProto) -> tuple[list[int], list[int], list[int]] | None:
    """(output_padding, pads, rows of zeros to append per spatial axis) that onnxruntime runs for ``node``, or
    None when it needs no rewrite or cannot have one."""
    if node.op_type != "ConvTranspose" or node.domain not in DEFAULT_DOMAINS:
        return None
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    op = list(a.get("output_padding") or [])
    nd = len(op)
    strides = list(a.get("strides") or [1] * nd)
    if not op or len(strides) != nd or all(p < s for p, s in zip(op, strides, strict=True)):
        return None
    auto_pad = a.get("auto_pad", b"NOTSET")
    if "output_shape" in a or (auto_pad.decode() if isinstance(auto_pad, bytes) else auto_pad) not in (
            "NOTSET", "VALID"):
        return None
    pads = list(a.get("pads") or [0] * (2 * nd))
    if len(pads) != 2 * nd:
        return None
    new_op, ends, zeros = [], [], []
    for i in range(nd):
        p, end = op[i], pads[nd + i]
        if p < strides[i]:
            new_op.append(p)
            ends.append(end)
            zeros.append(0)
        else:
            new_op.append(0)
            ends.append(max(0, end - p))
            zeros.append(max(0, p - end))
    return new_op, pads[:nd] + ends, zeros


def _append_zeros(node: onnx.NodeProto, zeros: list[int], names: NameGen, opset: int) -> list[onnx.NodeProto]:
    """Nodes that rename ``node``'s output and append ``zeros`` rows of zeros at the end of each spatial axis
    under its old name."""
    return _zero_rows(node, [0] * len(zeros), zeros, names, opset, "output_padding")


def same_conv_transposes(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each ConvTranspose (bodies' too) under ``auto_pad`` SAME_* whose pads onnxruntime would
    get wrong or refuse given explicit pads (module docstring); a copy, or ``model`` itself when there is
    none. ``typed``: a getter of the value types (a kernel size the node does not state comes from W's)."""

    def rewrite(n: onnx.NodeProto, types: dict, names: NameGen, opset: int) -> list[onnx.NodeProto] | None:
        plan = _same_pads(n, types)
        if plan is None:
            return None
        pads, before, after = plan
        replace_attributes(n, ("auto_pad",), pads=pads)
        return _zero_rows(n, before, after, names, opset) if any(before) or any(after) else []

    return _each_node(model, _same_kind, typed, rewrite)


def _each_node(model: onnx.ModelProto, kind: Callable[[onnx.NodeProto], bool], typed: Callable[[], dict],
               rewrite: Callable[[onnx.NodeProto, dict, NameGen, int], list[onnx.NodeProto] | None]
               ) -> onnx.ModelProto:
    """``model`` with ``rewrite(node, types, names, opset)`` applied to each node (bodies' too) of ``kind``:
    it changes the node in place and returns the nodes to put after it, or None for a node it leaves as it
    is; a copy, or ``model`` itself when no node changed."""
    if not any(kind(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    types = typed()
    out = onnx.ModelProto()
    out.CopyFrom(model)
    names = NameGen.for_model(out)
    opset = model_opset(out)
    changed = False
    for g in walk_graphs(out.graph):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            added = rewrite(n, types, names, opset) if kind(n) else None
            nodes.append(n)
            if added is not None:
                nodes.extend(added)
                changed = True
        del g.node[:]
        g.node.extend(nodes)
    return out if changed else model


def _same_kind(node: onnx.NodeProto) -> bool:
    if node.op_type != "ConvTranspose" or node.domain not in DEFAULT_DOMAINS:
        return False
    a = {x.name: x for x in node.attribute}
    return "auto_pad" in a and a["auto_pad"].s in (b"SAME_UPPER", b"SAME_LOWER") and "output_shape" not in a


def _same_pads(node: onnx.NodeProto, types: dict) -> tuple[list[int], list[int], list[int]] | None:
    """(explicit pads, rows of zeros to add before, after, per spatial axis) for a SAME ConvTranspose whose
    pads are negative somewhere or whose output_padding reaches its stride; None when it needs neither (or
    its kernel size is unknown)."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    kernel = static_kernel(node, types)
    if not kernel:
        return None
    nd = len(kernel)
    strides = list(a.get("strides") or [1] * nd)
    dil = list(a.get("dilations") or [1] * nd)
    op = list(a.get("output_padding") or [0] * nd)
    if not len(strides) == len(dil) == len(op) == nd:
        return None  # (the node's own error, on the numpy engine as on onnxruntime)
    geo = conv_transpose_geometry([None] * nd, kernel, strides, dil, op, a["auto_pad"])
    begin, end = list(geo.pad_begin), list(geo.pad_end)
    if min(begin + end) >= 0 and all(p < s for p, s in zip(op, strides, strict=True)):
        return None
    before, after = [max(0, -b) for b in begin], [max(0, -e) for e in end]
    return [max(0, b) for b in begin] + [max(0, e) for e in end], before, after


def output_shape_conv_transposes(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each ConvTranspose (bodies' too) with an ``output_shape`` that onnxruntime refuses
    given explicit pads and rows of zeros (module docstring); a copy, or ``model`` itself when there is
    none. ValueError naming the node for one whose output_padding reaches its stride over spatial sizes the
    model does not give."""

    def rewrite(n: onnx.NodeProto, types: dict, names: NameGen, opset: int) -> list[onnx.NodeProto] | None:
        plan = _shape_pads(n, types, opset)
        if plan is None:
            return None
        if isinstance(plan, _Window):
            replace_attributes(n, ("auto_pad", "output_shape", "pads", "output_padding"))
            return _run_time_window(n, plan, names)
        pads, before, after = plan
        replace_attributes(n, ("auto_pad", "output_shape"), pads=pads)
        return _zero_rows(n, before, after, names, opset, "output_shape") if any(before) or any(after) else []

    return _each_node(model, _shape_kind, typed, rewrite)


def _shape_kind(node: onnx.NodeProto) -> bool:
    return (node.op_type == "ConvTranspose" and node.domain in DEFAULT_DOMAINS
            and any(a.name == "output_shape" for a in node.attribute))


class _Window(NamedTuple):
    """The rows of a ConvTranspose's output_shape taken at run time from its full output."""

    output_padding: list[int]
    want: list[int]  # output_shape's spatial sizes
    upper: bool  # SAME_UPPER: the odd pad at the end


def _shape_pads(node: onnx.NodeProto, types: dict,
                opset: int) -> tuple[list[int], list[int], list[int]] | _Window | None:
    """(explicit pads, rows of zeros to add before, after, per spatial axis) for a ConvTranspose with an
    output_shape whose output_padding reaches its stride or whose pads are negative somewhere; a
    :class:`_Window` for the first kind over unknown sizes (ValueError naming the node below opset 12, or
    for an output_shape of fewer entries than spatial axes); None when it has neither, or its sizes are
    unknown and its output_padding is below its stride."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    kernel = static_kernel(node, types)
    shape = static_shape(types, node.input[0])
    nd = (len(kernel) if kernel else len(shape) - 2 if shape and len(shape) > 2
          else len(a.get("strides") or a.get("output_padding") or []))
    strides = list(a.get("strides") or [1] * nd)
    dil = list(a.get("dilations") or [1] * nd)
    op = list(a.get("output_padding") or [0] * nd)
    if not nd or not len(strides) == len(dil) == len(op) == nd:
        return None  # (the node's own error, on the numpy engine as on onnxruntime)
    large = any(p >= s for p, s in zip(op, strides, strict=True))
    sizes = shape[2:] if shape is not None and len(shape) == nd + 2 else None
    if not kernel or sizes is None or None in sizes:
        if not large:
            return None
        want = [int(v) for v in a["output_shape"]][-nd:]
        auto_pad = a.get("auto_pad", b"NOTSET")
        if opset >= _WINDOW_OPSET and len(want) == nd:
            return _Window(op, want, auto_pad in (b"SAME_UPPER", "SAME_UPPER"))
        name = node.name or node.output[0]
        raise ValueError(f"node {name!r} (ConvTranspose): onnxruntime refuses an output_shape with an "
                         f"output_padding {op} at or above the strides {strides}, and its pads need X's "
                         f"spatial sizes, which the model leaves unknown (taken at run time from opset "
                         f"{_WINDOW_OPSET}, the model's is {opset}): declare them, or run it on the numpy "
                         "engine (the default backend)")
    geo = conv_transpose_geometry(sizes, kernel, strides, dil, op, a.get("auto_pad", "NOTSET"),
                                  output_shape=list(a["output_shape"]))
    begin, end = list(geo.pad_begin), list(geo.pad_end)
    if not large and min(begin + end) >= 0:
        return None
    before, after = [max(0, -b) for b in begin], [max(0, -e) for e in end]
    return [max(0, b) for b in begin] + [max(0, e) for e in end], before, after


def _zero_rows(node: onnx.NodeProto, before: list[int], after: list[int], names: NameGen, opset: int,
               what: str = "same_pads") -> list[onnx.NodeProto]:
    """Nodes that rename ``node``'s output and add ``before`` and ``after`` rows of zeros on each spatial
    axis under its old name (the Pad named after the node and ``what``)."""
    y = node.output[0]
    if opset < _BIAS_OPSET and len(node.input) > 2 and node.input[2]:
        raise ValueError(f"node {node.name or y!r} (ConvTranspose): on the onnxruntime backend its bias goes "
                         "to an Add after the rows of zeros it needs (onnxruntime refuses its pads), and "
                         f"onnxruntime has no Add below opset {_BIAS_OPSET} (the model's is {opset}): "
                         "convert the model to a newer opset (onnx.version_converter.convert_version), or "
                         "run it on the numpy engine (the default backend)")
    inner = names(f"{y}_unpadded")
    node.output[0] = inner
    bias = _detach_bias(node)
    padded = y if bias is None else names(f"{y}_padded")
    spec = [0, 0, *before, 0, 0, *after]
    label = names(f"{node.name or y}_{what}")
    if opset < 11:
        out = [helper.make_node("Pad", [inner], [padded], name=label, pads=spec)]
    else:
        amounts = names(f"{y}_pads")
        const = helper.make_node("Constant", [], [amounts], name=names(f"{label}_pads"),
                                 value=numpy_helper.from_array(np.array(spec, np.int64), amounts))
        out = [const, helper.make_node("Pad", [inner, amounts], [padded], name=label)]
    if bias is not None:
        out += _add_bias(bias, padded, y, len(before), label, names)
    return out


def _detach_bias(node: onnx.NodeProto) -> str | None:
    """``node``'s bias input, taken off it (the rows a rewrite adds need the bias too), or None."""
    if len(node.input) < 3 or not node.input[2]:
        return None
    bias = node.input[2]
    del node.input[2:]
    return bias


def _add_bias(bias: str, x: str, y: str, nd: int, label: str, names: NameGen) -> list[onnx.NodeProto]:
    """Nodes writing ``y`` = ``x`` plus the per-channel ``bias`` on every row of its ``nd`` spatial axes
    (opset 7 on: numpy broadcasting)."""
    shape = names(f"{y}_bias_shape")
    column = names(f"{y}_bias_column")
    return [helper.make_node("Constant", [], [shape], name=names(f"{label}_bias_shape"),
                             value=numpy_helper.from_array(np.array([-1] + [1] * nd, np.int64), shape)),
            helper.make_node("Reshape", [bias, shape], [column], name=names(f"{label}_bias_column")),
            helper.make_node("Add", [x, column], [y], name=names(f"{label}_bias"))]


def _run_time_window(node: onnx.NodeProto, window: _Window, names: NameGen) -> list[onnx.NodeProto]:
    """Nodes that rename ``node``'s output (its full output, without output_padding) and take the rows
    ``window`` asks for under its old name, the pads from the full output's Shape: ONNX's total
    s·(S − 1) + output_padding + k_eff − output_shape split with the odd one at the end (SAME_UPPER) or at the
    beginning (else), floor halves as the numpy engine's geometry, rows outside the full output zeros."""
    y = node.output[0]
    full = names(f"{y}_full")
    node.output[0] = full
    bias = _detach_bias(node)
    label = node.name or y
    nd = len(window.want)
    out: list[onnx.NodeProto] = []

    def make(op: str, ins: list[str], dest: str | None = None, **kw: object) -> str:
        dest = dest or names(f"{y}_{op}")
        out.append(helper.make_node(op, ins, [dest], name=names(f"{label}_output_shape/{op}"), **kw))
        return dest

    def const(values: list[int]) -> str:
        dest = names(f"{y}_const")
        out.append(helper.make_node("Constant", [], [dest], name=names(f"{label}_output_shape/Constant"),
                                    value=numpy_helper.from_array(np.array(values, np.int64), dest)))
        return dest

    sizes = make("Slice", [make("Shape", [full]), const([2]), const([2 + nd])])
    excess = [p - w for p, w in zip(window.output_padding, window.want, strict=True)]
    total = make("Add", [sizes, const(excess)])
    two, zero = const([2] * nd), const([0] * nd)
    half = make("Div", [make("Sub", [total, make("Mod", [total, two], fmod=0)]), two])  # floor(total / 2)
    begin = half if window.upper else make("Sub", [total, half])
    start = make("Max", [begin, zero])
    end = make("Add", [start, const(window.want)])
    before = make("Max", [make("Neg", [begin]), zero])
    after = make("Max", [make("Sub", [make("Add", [begin, const(window.want)]), sizes]), zero])
    amounts = make("Concat", [const([0, 0]), before, const([0, 0]), after], axis=0)
    padded = make("Pad", [full, amounts])
    window_rows = make("Slice", [padded, start, end, const(list(range(2, 2 + nd)))],
                       y if bias is None else None)
    if bias is not None:
        out += _add_bias(bias, window_rows, y, nd, label, names)
    return out
