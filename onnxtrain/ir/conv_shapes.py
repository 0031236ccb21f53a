"""Shapes of ConvTranspose outputs as the ONNX spec (and onnxtrain's kernel) computes them.

ONNX 1.23's shape inference of ``ConvTranspose`` disagrees with the spec in three known cases:

- ``auto_pad`` SAME_UPPER/SAME_LOWER with an ``output_padding``: it gives S·s + output_padding, the spec S·s;
- ``auto_pad`` SAME_* where k_eff + output_padding < s: it gives the full output s·(S − 1) + output_padding
  + k_eff, the spec S·s (the extra rows are zeros no input reaches);
- an ``output_shape`` entry below X's size on that axis: it stops adding dims there, so Y gets a wrong rank
  (``output_shape`` [6, 3] on X 5×4 gives [N, M, 6]).

Every value after Y inherited the wrong shape, and so did the gradients built on them: a Conv with stride 2
after a SAME ConvTranspose with output_padding got an input gradient one row too long.
:func:`refined_conv_transposes` gives Y's dims by the kernel's formula (engine/kernels/conv.py) where they
differ from those inference gave; :func:`declared_outputs` makes a copy of the model in which each such Y
comes from an ``Identity`` of a graph input of that type, so that another round of inference carries the
corrected dims to the values after Y without contradicting itself (a value info declaring them would: strict
inference refuses it, and the lenient one's check of declared ranks puts the short rank back).

Where X's spatial sizes are not static, an axis's size is X's dim name when the node keeps it (stride 1 and
SAME, or stride 1 and pads that take back k_eff − 1 − output_padding) and unknown otherwise; an
``output_shape`` gives the size on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS, node_reads
from onnxtrain.ir.shape_values import Dim, unknown
from onnxtrain.ir.types import symbolic_shape


def conv_transpose_dims(attrs: dict, x: Sequence[Dim], w: Sequence[Dim] | None) -> list[Dim] | None:
    """Y's dims for a ConvTranspose with attributes ``attrs`` (name → value) of X with dims ``x`` and W with
    dims ``w`` (None: rank unknown), as the kernel computes them: ints where they follow from static sizes,
    X's dim name where Y keeps it, None where they are unknown; None when the node is malformed (the kernel
    would refuse it)."""
    nd = len(x) - 2
    if nd < 1 or (w is not None and len(w) != len(x)):
        return None
    group = int(attrs.get("group") or 1)
    strides = list(attrs.get("strides") or [1] * nd)
    dil = list(attrs.get("dilations") or [1] * nd)
    out_pad = list(attrs.get("output_padding") or [0] * nd)
    if len(strides) != nd or len(dil) != nd or len(out_pad) != nd or min(strides + dil) < 1:
        return None
    kernel: list[Dim] = list(w[2:]) if w is not None else [None] * nd
    if attrs.get("kernel_shape") is not None:
        ks = list(attrs["kernel_shape"])
        if len(ks) != nd or any(isinstance(a, int) and a != b for a, b in zip(kernel, ks)):
            return None
        kernel = ks
    auto_pad = attrs.get("auto_pad") or "NOTSET"
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    out_shape = attrs.get("output_shape")
    pads = list(attrs.get("pads") or [0] * (2 * nd)) if auto_pad == "NOTSET" else [0] * (2 * nd)
    if out_shape is not None:
        if len(out_shape) < nd:
            return None
        spatial: list[Dim] = [int(v) for v in list(out_shape)[-nd:]]
    elif auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        spatial = [_scaled(x[2 + i], strides[i]) for i in range(nd)]
    elif auto_pad in ("NOTSET", "VALID") and len(pads) == 2 * nd:
        spatial = []
        for i in range(nd):
            k = kernel[i]
            if not isinstance(k, int):
                spatial.append(None)
                continue
            # s·(S − 1) + output_padding + k_eff − pads = s·S + grow
            grow = out_pad[i] + (k - 1) * dil[i] + 1 - strides[i] - pads[i] - pads[nd + i]
            size = x[2 + i]
            if isinstance(size, int):
                spatial.append(strides[i] * size + grow)
            else:
                spatial.append(_scaled(size, strides[i]) if grow == 0 else None)
    else:
        return None
    if any(isinstance(v, int) and v < 1 for v in spatial):
        return None  # an empty output: the kernel refuses the node
    m = w[1] if w is not None else None
    if isinstance(m, int):
        m *= group
    elif group != 1:
        m = None
    return [x[0], m, *spatial]


def _scaled(size: Dim, stride: int) -> Dim:
    """``size``·``stride``: an int for an int, the same name for stride 1, else unknown."""
    if isinstance(size, int):
        return size * stride
    return size if stride == 1 and not unknown(size) else None


def refined_conv_transposes(model: onnx.ModelProto,
                            types: dict[str, onnx.TypeProto]) -> list[onnx.ValueInfoProto]:
    """Value infos of the ConvTranspose outputs in ``model``'s graph whose dims in ``types`` differ from the
    kernel's (:func:`conv_transpose_dims`): a static size inference has wrong, a rank it has wrong or does
    not know, or X's dim name where it has none. Dims the kernel does not tell stay as inference has them
    (unnamed where it made a name up)."""
    out = []
    for n in model.graph.node:
        if n.op_type != "ConvTranspose" or n.domain not in DEFAULT_DOMAINS or len(n.input) < 2:
            continue
        x, y = symbolic_shape(types, n.input[0]), n.output[0]
        if x is None or not y:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        want = conv_transpose_dims(attrs, x, symbolic_shape(types, n.input[1]))
        if want is None:
            continue
        have = symbolic_shape(types, y)
        if have is None or len(have) != len(want):
            dims = want
        else:
            dims = [d if isinstance(d, int) or (isinstance(d, str) and not unknown(d) and unknown(h)) else h
                    for h, d in zip(have, want)]
            if dims == have:
                continue
        tp = types.get(y) or types.get(n.input[0])
        if tp is None or not tp.HasField("tensor_type"):
            continue
        dims = [None if unknown(d) else d for d in dims]
        out.append(helper.make_tensor_value_info(y, tp.tensor_type.elem_type, dims))
    return out


def declared_outputs(model: onnx.ModelProto, infos: Iterable[onnx.ValueInfoProto],
                     fresh: Callable[[str], str]) -> tuple[onnx.ModelProto, list[str]]:
    """A copy of ``model`` in which the node making each value of ``infos`` (in the main graph) is replaced
    by an ``Identity`` of a new graph input of the value's type (named by ``fresh``); returns it with the new
    inputs' names.

    The shapes the copy declares for the values after those (value infos of ONNX ops' outputs, graph
    outputs) are dropped, and those of the values themselves given their new types: a model saved after
    ONNX's inference declares the wrong dims all the way down, which the next round would keep."""
    by_name = {v.name: v for v in infos}
    out = onnx.ModelProto()
    out.CopyFrom(model)
    g = out.graph
    nodes, added = [], []
    after: set[str] = set()  # values computed from the replaced ones, by nodes ONNX's inference knows
    for n in g.node:
        if len(n.output) == 1 and n.output[0] in by_name:
            src = fresh(f"{n.output[0]}_declared")
            added.append(src)
            g.input.append(helper.make_value_info(src, by_name[n.output[0]].type))
            nodes.append(helper.make_node("Identity", [src], [n.output[0]], name=n.name))
            continue
        nodes.append(n)
        if n.domain in DEFAULT_DOMAINS and any(r in by_name or r in after for r in node_reads(n)):
            after.update(o for o in n.output if o)
    del g.node[:]
    g.node.extend(nodes)
    kept = [v for v in g.value_info if v.name not in after and v.name not in by_name]
    del g.value_info[:]
    g.value_info.extend(kept)
    for o in g.output:
        if o.name in by_name:
            o.type.CopyFrom(by_name[o.name].type)
        elif o.name in after and o.type.HasField("tensor_type"):
            o.type.tensor_type.ClearField("shape")
    return out, added
