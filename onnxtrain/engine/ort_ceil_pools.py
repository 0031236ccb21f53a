"""Pools under ``ceil_mode`` whose last window would start in the end padding, given the smaller end pads that
make the same windows, for onnxruntime.

Under ``ceil_mode`` a window that would start at or past the end of the input and its begin pad is dropped
(torch's rule, which onnxruntime's and the numpy engine's kernels follow: a 3-row input, kernel 2, stride 2,
pads 1 gives 2 rows). ONNX's shape inference counts that window (3 rows), and onnxruntime plans its buffers
from the inferred shape: in a training graph it then fails at run time ("Shape mismatch attempting to re-use
buffer. {2,3,2,8} != {2,3,3,8}"). On such an axis the node takes the end pad
``max(0, (out − 1)·stride + (k − 1)·dilation + 1 − in − begin)`` (smaller than its own), which makes ONNX's
count ``out`` with the same windows at the same places; every kept window lies inside the padded input, so
neither a MaxPool's values and Indices nor an AveragePool's (with or without ``count_include_pad``) change.
Only pools whose input's spatial sizes are known before the run are rewritten (with unknown sizes inference
gives no dims to plan by).
"""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.ir.builder import replace_attributes, static_shape, value_types
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
    return out if changed else model


def _rewrite_one(model: onnx.ModelProto, types: dict) -> bool:
    """Rewrite the first pool of ``model`` that needs it (its stale declared output types dropped); whether
    there was one."""
    for g in walk_graphs(model.graph):
        for n in g.node:
            pads = _end_pads(n, types) if _candidate(n) else None
            if pads is None:
                continue
            replace_attributes(n, pads=pads)
            kept = [v for v in g.value_info if v.name not in set(n.output)]
            del g.value_info[:]
            g.value_info.extend(kept)
            return True
    return False


def _candidate(node: onnx.NodeProto) -> bool:
    if node.op_type not in _POOLS or node.domain not in DEFAULT_DOMAINS:
        return False
    a = {x.name: x for x in node.attribute}
    auto_pad = a["auto_pad"].s if "auto_pad" in a else b"NOTSET"
    return "ceil_mode" in a and a["ceil_mode"].i == 1 and auto_pad in (b"NOTSET", b"")


def _end_pads(node: onnx.NodeProto, types: dict) -> list[int] | None:
    """The pads that give ``node``'s windows with a count ONNX's inference agrees with, or None when no window
    is dropped or the input's spatial sizes are unknown."""
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
    for i in range(nd):
        size, k_eff, s, begin, end = x[2 + i], (kernel[i] - 1) * dil[i] + 1, strides[i], pads[i], pads[nd + i]
        count = _ceil_count(size + begin + end - k_eff, s)
        if count is None:
            return None
        if (count - 1) * s < size + begin:
            new_ends.append(end)
            continue
        count -= 1  # the last window starts in the end pad: dropped
        dropped = True
        end = max(0, (count - 1) * s + k_eff - size - begin)
        if _ceil_count(size + begin + end - k_eff, s) != count:
            return None
        new_ends.append(end)
    return pads[:nd] + new_ends if dropped else None


def _ceil_count(span: int, stride: int) -> int | None:
    """ONNX's ceil_mode window count over ``span`` (padded size less the dilated kernel), None below zero."""
    return None if span < 0 else -(-span // stride) + 1
