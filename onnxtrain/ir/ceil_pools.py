"""Pools under ``ceil_mode`` whose last window would start in the end padding, given the smaller end pads that
make the same windows.

Under ``ceil_mode`` a window that would start at or past the end of the input and its begin pad is dropped
(torch's rule, which onnxruntime's and the numpy engine's kernels follow: a 3-row input, kernel 2, stride 2,
pads 1 gives 2 rows). ONNX's shape inference counts that window (3 rows), and onnxruntime plans its buffers
from the inferred shape: in a training graph it then fails at run time ("Shape mismatch attempting to re-use
buffer. {2,3,2,8} != {2,3,3,8}"), and every static shape onnxtrain read from inference after such a pool was
wrong too: the gradient builder's Reshapes to a Flatten's or a Conv's input shape failed at run time, and the
models generate_artifacts wrote failed onnx.checker's full check. :func:`ceil_mode_pools` is applied where a
model is read (:func:`onnxtrain.engine.interface.standard_model`) and again for onnxruntime. On such an axis
the node takes the end pad
``(out − 1)·stride + (k − 1)·dilation + 1 − in − begin`` (smaller than its own), which makes ONNX's
count ``out`` with the same windows at the same places; every kept window lies inside the padded input, so
neither a MaxPool's values and Indices nor an AveragePool's (with or without ``count_include_pad``) change.
Where the last kept window ends before the input does (a kernel narrower than the stride: kernel 1, stride 2
over 6 rows keeps 3 windows, ONNX counts 4 even without end pad), no end pad gives ONNX's ceil count ``out``:
the node then takes ``ceil_mode`` 0 with no end pad on that axis (floor's count is ``out``), and on its other
axes the end pads that take in a last window overhanging its end pad. Where that would change values (an
AveragePool counting pads) or needs a pad as wide as the kernel (which onnxruntime refuses), the pool keeps
``ceil_mode`` and reads its input through a ``Slice`` that drops the positions past its last window on the
short axes (no window reads them); a MaxPool whose Indices are read (they number the whole input's positions)
is then left as it is.
Only pools whose input's spatial sizes are known before the run are rewritten (with unknown sizes inference
gives no dims to plan by).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen, replace_attributes, static_shape, value_types
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs

_POOLS = ("MaxPool", "AveragePool", "LpPool")


def ceil_mode_pools(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with each pool (bodies' too) whose ``ceil_mode`` window count ONNX's inference gets wrong
    given the end pads that make its windows (module docstring); a copy, or ``model`` itself when there is
    none."""
    if not any(_candidate(n) for g in walk_graphs(model.graph) for n in g.node):
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    changed = False
    # one pool at a time: a later pool's input sizes are inferred from the earlier ones' new pads (a rewritten
    # pool drops no window, so it is not rewritten again)
    while _rewrite_one(out, value_types(out, declared=False)):
        changed = True
    if changed:
        _redeclare_outputs(out)
    return out if changed else model


def _redeclare_outputs(model: onnx.ModelProto) -> None:
    """Give the graph's outputs the dims inference now finds where their declared ones differ (an exporter
    declares a rewritten pool's output, and the values after it, with ONNX's old count: onnx.checker then
    refuses the model, and its gradient graph)."""
    declared_types = []
    for o in model.graph.output:  # inferred from the nodes alone, not from the stale declarations
        declared_types.append(onnx.TypeProto())
        declared_types[-1].CopyFrom(o.type)
        if o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    types = value_types(model, declared=False)
    for o, tp in zip(model.graph.output, declared_types, strict=True):  # (no copy of the weights)
        o.type.CopyFrom(tp)
    for o in model.graph.output:
        tp = types.get(o.name)
        if tp is None or not tp.HasField("tensor_type") or not o.type.HasField("tensor_type"):
            continue
        now, declared = tp.tensor_type.shape.dim, o.type.tensor_type.shape.dim
        if len(now) != len(declared):
            continue
        for d, n in zip(declared, now):
            if d.HasField("dim_value") and n.HasField("dim_value") and d.dim_value != n.dim_value:
                d.dim_value = n.dim_value


def _rewrite_one(model: onnx.ModelProto, types: dict) -> bool:
    """Rewrite the first pool of ``model`` that needs it (its stale declared output types dropped); whether
    there was one."""
    for g in walk_graphs(model.graph):
        for n in g.node:
            fixed = _end_pads(n, types) if _candidate(n) else None
            if fixed is None:
                continue
            pads, ceil, crops = fixed
            if crops:
                _crop_input(model, g, n, crops)
            replace_attributes(n, pads=pads, ceil_mode=ceil)
            kept = [v for v in g.value_info if v.name not in set(n.output)]
            del g.value_info[:]
            g.value_info.extend(kept)
            return True
    return False


def _crop_input(model: onnx.ModelProto, g: onnx.GraphProto, node: onnx.NodeProto,
                crops: dict[int, int]) -> None:
    """Make ``node`` (of ``g``) read its input through a Slice to the first ``crops[i]`` positions of spatial
    axis i (positions no window reads)."""
    names = NameGen.for_model(model)
    base = node.name or node.output[0]
    consts = []
    for what, values in (("starts", [0] * len(crops)), ("ends", list(crops.values())),
                         ("axes", [2 + i for i in crops])):
        name = names(f"{base}_crop_{what}")
        consts.append(helper.make_node("Constant", [], [name], name=names(f"{name}_node"),
                                       value=numpy_helper.from_array(np.array(values, np.int64), name)))
    cropped = names(f"{node.input[0]}_cropped")
    slice_node = helper.make_node("Slice", [node.input[0], *(c.output[0] for c in consts)], [cropped],
                                  name=names(f"{base}_crop"))
    at = list(g.node).index(node)
    for k, new in enumerate([*consts, slice_node]):
        g.node.insert(at + k, new)
    node.input[0] = cropped


def _candidate(node: onnx.NodeProto) -> bool:
    if node.op_type not in _POOLS or node.domain not in DEFAULT_DOMAINS:
        return False
    a = {x.name: x for x in node.attribute}
    auto_pad = a["auto_pad"].s if "auto_pad" in a else b"NOTSET"
    return "ceil_mode" in a and a["ceil_mode"].i == 1 and auto_pad in (b"NOTSET", b"")


def _end_pads(node: onnx.NodeProto, types: dict) -> tuple[list[int], int, dict[int, int]] | None:
    """The pads and ``ceil_mode`` that give ``node``'s windows with a count ONNX's inference agrees with, and
    the sizes to crop the input to on the spatial axes that need it (axis → size); None when no window is
    dropped, the input's spatial sizes are unknown or no such rewrite exists."""
    a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
    kernel = list(a.get("kernel_shape") or [])
    nd = len(kernel)
    x = static_shape(types, node.input[0])
    if not nd or x is None or len(x) != nd + 2 or any(d is None for d in x[2:]):
        return None
    strides = list(a.get("strides") or [1] * nd)
    dil = list(a.get("dilations") or [1] * nd)
    pads = list(a.get("pads") or [0] * (2 * nd))
    if not len(strides) == len(dil) == nd or len(pads) != 2 * nd:
        return None  # (the node's own error, on either backend)
    new_ends, dropped = [], False
    short: dict[int, int] = {}  # axis → where its last window ends, before the input does (see the docstring)
    # per axis that drops no window but whose last one overhangs the end pad (only ceil_mode counts it): the
    # end pad that takes that window in, for floor's count
    overhangs: dict[int, int] = {}
    for i in range(nd):
        size, k_eff, s, begin, end = x[2 + i], (kernel[i] - 1) * dil[i] + 1, strides[i], pads[i], pads[nd + i]
        span = size + begin + end - k_eff
        count = _ceil_count(span, s)
        if count is None:
            return None
        if (count - 1) * s < size + begin:
            new_ends.append(end)
            if span % s:
                overhangs[i] = end + (-span) % s
            continue
        count -= 1  # the last window starts in the end pad: dropped
        dropped = True
        # the kept windows end inside the input and the end pad; the new end pad ends with the last of them,
        # or at the input's end where that window ends before it (a kernel narrower than the stride): then
        # only floor's count (ceil_mode 0) leaves out the rows past it, which no window reads
        last_end = (count - 1) * s + k_eff - size - begin
        if last_end < 0:
            short[i] = size + last_end
        new_ends.append(max(0, last_end))
    if not dropped:
        return None
    if short and overhangs:
        # floor's count with the overhanging windows padded in: the same values where a pad is neutral (-inf
        # for a MaxPool, 0 for an LpPool, uncounted for an AveragePool without count_include_pad), and a pad
        # below the kernel (onnxruntime refuses others); else the short axes cropped, ceil_mode kept (not for
        # a MaxPool whose Indices are read: they count positions of the whole input)
        if not (node.op_type == "AveragePool" and a.get("count_include_pad")) and all(
                e < kernel[i] for i, e in overhangs.items()):
            for i, e in overhangs.items():
                new_ends[i] = e
            return pads[:nd] + new_ends, 0, {}
        if node.op_type == "MaxPool" and len(node.output) > 1 and node.output[1]:
            return None
        return pads[:nd] + new_ends, 1, short
    return pads[:nd] + new_ends, 0 if short else 1, {}


def _ceil_count(span: int, stride: int) -> int | None:
    """ONNX's ceil_mode window count over ``span`` (padded size less the dilated kernel), None below zero."""
    return None if span < 0 else -(-span // stride) + 1
