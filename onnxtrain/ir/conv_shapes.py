"""Shapes of ConvTranspose outputs as the ONNX spec (and onnxtrain's kernel) computes them.

ONNX 1.23's shape inference of ``ConvTranspose`` disagrees with the spec in three known cases:

- ``auto_pad`` SAME_UPPER/SAME_LOWER with an ``output_padding``: it gives S·s + output_padding, the spec S·s;
- ``auto_pad`` SAME_* where k_eff + output_padding < s: it gives the full output s·(S − 1) + output_padding
  + k_eff, the spec S·s (the extra rows are zeros no input reaches);
- an ``output_shape`` entry below X's size on that axis: it stops adding dims there, so Y gets a wrong rank
  (``output_shape`` [6, 3] on X 5×4 gives [N, M, 6]).

Every value after Y inherited the wrong shape, and so did the gradients built on them: a Conv with stride 2
after a SAME ConvTranspose with output_padding got an input gradient one row too long.
:func:`refined_conv_transposes` gives Y's dims by the spec's formula (:func:`conv_transpose_geometry`, the
one the kernel in engine/kernels/conv.py and the gradient rule use too) where they differ from those inference
gave; :func:`declared_outputs` makes a copy of the model in which each such Y comes from an ``Identity`` of a
graph input of that type, so that another round of inference carries the corrected dims to the values after Y
without contradicting itself (a value info declaring them would: strict inference refuses it, and the lenient
one's check of declared ranks puts the short rank back).

Where X's spatial sizes are not static, an axis's size is X's dim name when the node keeps it (stride 1 and
SAME, or stride 1 and pads that take back k_eff − 1 − output_padding) and unknown otherwise; an
``output_shape`` gives the size on its own.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import NamedTuple

import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS, node_reads
from onnxtrain.ir.shape_values import Dim, unknown
from onnxtrain.ir.types import symbolic_shape


class ConvTransposeGeometry(NamedTuple):
    """Per spatial axis: Y's size, the full output's size s·(S − 1) + output_padding + k_eff, and the begin
    and end pads cropped off it (negative: zero rows added); an int where it follows from what is known, X's
    dim name where Y keeps it (``out`` only), None where it is unknown."""

    out: list[Dim]
    full: list[Dim]
    pad_begin: list[int | None]
    pad_end: list[int | None]


def conv_transpose_growth(kernel: int, stride: int, dilation: int, output_padding: int) -> int:
    """The full output's size less s·S: s·(S − 1) + output_padding + k_eff = s·S + this."""
    return output_padding + (kernel - 1) * dilation + 1 - stride


def conv_transpose_geometry(
    sizes: Sequence[Dim],
    kernel: Sequence[Dim],
    strides: Sequence[int],
    dilations: Sequence[int],
    output_padding: Sequence[int],
    auto_pad: str | bytes | None = "NOTSET",
    pads: Sequence[int] | None = None,
    output_shape: Sequence[int] | None = None,
) -> ConvTransposeGeometry:
    """The ConvTranspose output-size formula of the ONNX spec, the one source of the shape inference here,
    the gradient rule (autodiff/rules/conv.py) and the kernel (engine/kernels/conv.py).

    ``sizes`` are X's and ``kernel`` W's spatial sizes (ints, or dim names / None where not static). The full
    output is s·(S − 1) + output_padding + k_eff on each axis, k_eff = (k − 1)·d + 1. With ``output_shape``
    (its last len(sizes) entries) Y has those sizes, otherwise under ``auto_pad`` SAME_* S·s; the pads are
    then the difference to the full output, split evenly with the odd one at the end (SAME_UPPER) or at the
    beginning (else). Otherwise (``auto_pad`` NOTSET or VALID) Y is the full output less ``pads`` (begins,
    then ends; VALID: none). Raises ValueError for an unknown ``auto_pad`` or a wrong number of pads or
    output_shape entries; the caller checks the lengths of the other attributes and that Y is not empty."""
    nd = len(sizes)
    if isinstance(auto_pad, bytes):
        auto_pad = auto_pad.decode()
    auto_pad = auto_pad or "NOTSET"
    growth = [conv_transpose_growth(kernel[i], strides[i], dilations[i], output_padding[i])
              if isinstance(kernel[i], int) else None for i in range(nd)]
    full: list[Dim] = [strides[i] * sizes[i] + growth[i]  # type: ignore[operator]
                       if isinstance(sizes[i], int) and growth[i] is not None else None for i in range(nd)]
    if output_shape is not None or auto_pad in ("SAME_UPPER", "SAME_LOWER"):
        want: list[Dim]
        totals: list[int | None]  # full − want
        if output_shape is not None:
            if len(output_shape) < nd:
                raise ValueError(f"output_shape {list(output_shape)} must have at least {nd} values")
            want = [int(v) for v in list(output_shape)[len(output_shape) - nd:]]
            totals = [f - v if isinstance(f, int) else None for f, v in zip(full, want)]  # type: ignore[operator]
        else:  # S·s, and full − S·s is the growth whatever S is
            want = [_scaled(sizes[i], strides[i]) for i in range(nd)]
            totals = growth
        # the pads follow from the requested size; SAME_UPPER puts the odd one at the end
        pb = [None if t is None else t // 2 if auto_pad == "SAME_UPPER" else t - t // 2 for t in totals]
        pe = [None if t is None or b is None else t - b for t, b in zip(totals, pb)]
        return ConvTransposeGeometry(want, full, pb, pe)
    if auto_pad not in ("NOTSET", "VALID"):
        raise ValueError(f"unknown auto_pad {auto_pad!r}")
    pads = list(pads or [0] * (2 * nd)) if auto_pad == "NOTSET" else [0] * (2 * nd)
    if len(pads) != 2 * nd:
        raise ValueError(f"pads {pads} must have {2 * nd} values")
    out: list[Dim] = []
    for i in range(nd):
        crop = pads[i] + pads[nd + i]
        f, size = full[i], sizes[i]
        if isinstance(f, int):
            out.append(f - crop)
        elif growth[i] is not None and growth[i] == crop:  # s·S: X's name where s is 1
            out.append(_scaled(size, strides[i]))
        else:
            out.append(None)
    return ConvTransposeGeometry(out, full, pads[:nd], pads[nd:])


def conv_transpose_dims(attrs: dict, x: Sequence[Dim], w: Sequence[Dim] | None) -> list[Dim] | None:
    """Y's dims for a ConvTranspose with attributes ``attrs`` (name → value) of X with dims ``x`` and W with
    dims ``w`` (None: rank unknown), as the kernel computes them (:func:`conv_transpose_geometry`): ints
    where they follow from static sizes, X's dim name where Y keeps it, None where they are unknown; None
    when the node is malformed (the kernel would refuse it)."""
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
    try:
        spatial = conv_transpose_geometry(x[2:], kernel, strides, dil, out_pad, attrs.get("auto_pad"),
                                          attrs.get("pads"), attrs.get("output_shape")).out
    except ValueError:
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


def same_pads(auto_pad: str, size: int, k_eff: int, stride: int) -> tuple[int, int]:
    """(begin, end) pads of auto_pad SAME_UPPER/SAME_LOWER: output size is ceil(size / stride)."""
    out = -(-size // stride)
    total = max(0, (out - 1) * stride + k_eff - size)
    small = total // 2
    return (small, total - small) if auto_pad == "SAME_UPPER" else (total - small, small)


def reads_input(start: int, step: int, count: int, size: int) -> bool:
    """Whether some of the ``count`` positions start + j·step lie in [0, size): whether a kernel offset (or
    an output) of a Conv reads X anywhere but its padding, or a ConvTranspose offset's products land in its
    output."""
    lo = max(0, -(start // step))
    return lo <= min(count - 1, (size - 1 - start) // step)


def live_offsets(k: Sequence[int], scale: Sequence[int], shift: Sequence[int], step: Sequence[int],
                 count: Sequence[int], size: Sequence[int]) -> tuple[list[int], list[int]] | None:
    """(first, last) live kernel offset per axis, offset t of axis i being live where
    ``reads_input(t·scale[i] − shift[i], step[i], count[i], size[i])``; None where some axis has no live
    offset, or every offset of every axis is live."""
    first, last = [], []
    for i in range(len(k)):
        live = [t for t in range(k[i]) if reads_input(t * scale[i] - shift[i], step[i], count[i], size[i])]
        if not live:
            return None
        first.append(live[0])
        last.append(live[-1])
    if all(a == 0 and b == v - 1 for a, b, v in zip(first, last, k, strict=True)):
        return None
    return first, last
