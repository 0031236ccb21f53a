"""Meanings that onnx's version converter loses when it lifts an old model to the gradient builder's opset.

* Resize-10 and Upsample (opsets 7-9) sample with asymmetric coordinates, nearest rounding down, or up
  on an axis Resize-10 downsamples (onnxruntime's and ONNX's opset-10 test data); the converter writes
  Resize-11+ nodes without those attributes, which then mean half-pixel coordinates and round-half-down
  (and it renames an Upsample's output): every Resize of a converted model below opset 11 is one of
  those, and :func:`restore_legacy_resizes` writes the attributes into them (a nearest Resize that
  downsamples some axes and upsamples others becomes two, one rounding up and one down).
* Clip and Pad before opset 11 take their bounds and padding value as float attributes; the converter
  makes them float32 Constant inputs whatever the input's type: :func:`match_clip_bounds` casts them to it
  (a float64 or float16 Clip's or Pad's gradient graph was refused by onnx.checker and onnxruntime).
* Pad before opset 11 may carry a ``value`` attribute in the edge and reflect modes, where it does
  nothing; the converter keeps it on the Pad-11+ node, whose schema has no such attribute (onnx.checker and
  onnxruntime refuse the gradient graph): :func:`drop_idle_pad_values` removes it before the conversion.
* BatchNormalization before opset 9 may say ``spatial=0``, which the converter refuses; on an (N, C)
  input it means what ``spatial=1`` does: :func:`drop_idle_spatial` removes it there.
* Hardmax before opset 13 takes the maximum over all dims from ``axis`` on (the input read as a matrix);
  the converter keeps the node and its axis, which at 13 means one dim: :func:`flatten_old_hardmax`
  rewrites each as Flatten, a Hardmax over the matrix's rows, and a Reshape back, before the conversion.
* Dropout before opset 10 outputs its mask in the input's float type; the converter keeps the node's mask
  output, bool from Dropout-10 on, under the model's float declaration and float reads (onnx.checker and
  onnxruntime refused the gradient graph): :func:`cast_old_dropout_masks` casts it back.
* Upsample-1 (experimental) names its linear mode 'bilinear', which the converter keeps (no later Upsample
  or Resize knows it), and onnx infers no shape for it (the converter's adapters of the nodes reading it
  need one): :func:`prepare_old_upsamples` renames the mode and declares the output's shape.
* The converter names the constants it adds (``_v_<n>``, e.g. ReduceSum's axes) per graph, so a body may
  define a name its outer graph defines too (not SSA: onnx.checker refuses the gradient graph):
  :func:`unique_body_names` renames the body's copies.
"""

from __future__ import annotations

import math

import numpy as np
import onnx
from onnx import helper, numpy_helper

from onnxtrain.ir.builder import NameGen
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, rename_in_graph, subgraphs, walk_graphs

_SAMPLING = ("coordinate_transformation_mode", "nearest_mode")


def restore_legacy_resizes(model: onnx.ModelProto, opset: int) -> list[str]:
    """Give the Resize nodes of ``model``, converted from default-domain ``opset`` < 11, the sampling of
    Resize-10 and Upsample (in place); returns the names of nearest ones whose scales are not constants,
    which round down on every axis (as an upsampling does)."""
    if opset >= 11:
        return []
    names = None
    unknown: list[str] = []
    for g in walk_graphs(model.graph):
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            nodes.append(n)
            if n.op_type != "Resize" or n.domain not in DEFAULT_DOMAINS:
                continue
            mode = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "mode"), b"nearest")
            kept = [a for a in n.attribute if a.name not in _SAMPLING]
            del n.attribute[:]
            n.attribute.extend(kept)
            n.attribute.append(helper.make_attribute("coordinate_transformation_mode", "asymmetric"))
            if mode not in (b"nearest", "nearest"):
                continue
            scales = _constant(g, n.input[2]) if len(n.input) > 2 else None
            if scales is None:
                unknown.append(n.name or n.output[0])
            values = [] if scales is None else [float(s) for s in scales.reshape(-1)]
            down, up = any(v < 1 for v in values), any(v > 1 for v in values)
            if not (down and up):
                n.attribute.append(helper.make_attribute("nearest_mode", "ceil" if down else "floor"))
                continue
            # down on some axes, up on others: the downsampling first (rounding up), then the rest
            names = names or NameGen.for_model(model)
            first, shrunk = names(f"{n.output[0]}_scales_down"), names(f"{n.output[0]}_down")
            rest = names(f"{n.output[0]}_scales_up")
            g.initializer.extend([
                numpy_helper.from_array(np.where(scales < 1, scales, 1).astype(scales.dtype), first),
                numpy_helper.from_array(np.where(scales < 1, 1, scales).astype(scales.dtype), rest),
            ])
            down_node = helper.make_node("Resize", [n.input[0], n.input[1], first], [shrunk],
                                         name=names(f"{n.name or 'Resize'}_down"))
            down_node.attribute.extend(n.attribute)
            down_node.attribute.append(helper.make_attribute("nearest_mode", "ceil"))
            n.input[0], n.input[2] = shrunk, rest
            n.attribute.append(helper.make_attribute("nearest_mode", "floor"))
            nodes.insert(len(nodes) - 1, down_node)
        del g.node[:]
        g.node.extend(nodes)
    return unknown


def _constant(g: onnx.GraphProto, name: str) -> np.ndarray | None:
    """The value of ``name`` when ``g`` holds it as an initializer or a Constant node's ``value``."""
    for t in g.initializer:
        if t.name == name:
            return numpy_helper.to_array(t)
    for n in g.node:
        if n.op_type == "Constant" and n.domain in DEFAULT_DOMAINS and n.output[0] == name:
            return next((numpy_helper.to_array(a.t) for a in n.attribute if a.name == "value"), None)
    return None


def drop_idle_pad_values(model: onnx.ModelProto, opset: int) -> None:
    """Remove (in place) the ``value`` attribute of the edge- and reflect-mode Pad nodes of ``model`` at
    default-domain ``opset`` < 11 (only constant padding reads it)."""
    if opset >= 11:
        return
    for g in walk_graphs(model.graph):
        for n in g.node:
            if n.op_type != "Pad" or n.domain not in DEFAULT_DOMAINS:
                continue
            mode = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "mode"), b"constant")
            if mode not in (b"constant", "constant"):
                kept = [a for a in n.attribute if a.name != "value"]
                del n.attribute[:]
                n.attribute.extend(kept)


def drop_idle_spatial(model: onnx.ModelProto, opset: int) -> None:
    """Remove (in place) ``spatial=0`` from the BatchNormalization nodes of ``model`` at default-domain
    ``opset`` < 9 whose input is (N, C): there it means what ``spatial=1`` does (per-channel statistics),
    which is the one form the converter lifts. Others keep it (the converter refuses them)."""
    if opset >= 9:
        return
    bns = [n for g in walk_graphs(model.graph) for n in g.node if n.op_type == "BatchNormalization"
           and n.domain in DEFAULT_DOMAINS and any(a.name == "spatial" and a.i == 0 for a in n.attribute)]
    if not bns:
        return
    inferred = onnx.shape_inference.infer_shapes(model)
    g = inferred.graph
    ranks = {v.name: len(v.type.tensor_type.shape.dim) for v in (*g.input, *g.value_info, *g.output)
             if v.type.tensor_type.HasField("shape")}
    ranks.update({t.name: len(t.dims) for t in g.initializer})
    for n in bns:
        if ranks.get(n.input[0]) == 2:
            kept = [a for a in n.attribute if a.name != "spatial"]
            del n.attribute[:]
            n.attribute.extend(kept)


def flatten_old_hardmax(model: onnx.ModelProto, opset: int) -> list[str]:
    """Rewrite (in place) each Hardmax of ``model`` at default-domain ``opset`` < 13 as Flatten at its
    axis, Hardmax over axis 1 and a Reshape to the input's shape (the same values at every opset); returns
    the names of those it cannot rewrite (below opset 5 Reshape takes no shape input)."""
    if opset >= 13:
        return []
    names = None
    refused: list[str] = []
    for g in walk_graphs(model.graph):
        if not any(n.op_type == "Hardmax" and n.domain in DEFAULT_DOMAINS for n in g.node):
            continue
        names = names or NameGen.for_model(model)
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            if n.op_type != "Hardmax" or n.domain not in DEFAULT_DOMAINS:
                nodes.append(n)
                continue
            if opset < 5:
                refused.append(n.name or n.output[0])
                nodes.append(n)
                continue
            axis = next((helper.get_attribute_value(a) for a in n.attribute if a.name == "axis"), 1)
            base = n.name or "Hardmax"
            matrix, rows, shape = (names(f"{n.output[0]}_{s}") for s in ("matrix", "rows", "shape"))
            nodes += [
                helper.make_node("Flatten", [n.input[0]], [matrix], name=names(f"{base}_Flatten"), axis=axis),
                helper.make_node("Hardmax", [matrix], [rows], name=names(base), axis=1),
                helper.make_node("Shape", [n.input[0]], [shape], name=names(f"{base}_Shape")),
                helper.make_node("Reshape", [rows, shape], [n.output[0]], name=names(f"{base}_Reshape")),
            ]
        del g.node[:]
        g.node.extend(nodes)
    return refused


def prepare_old_upsamples(model: onnx.ModelProto, opset: int) -> None:
    """Before the conversion of ``model`` from default-domain ``opset`` < 7, in place: its Upsample nodes'
    mode 'bilinear' becomes 'linear', and the main graph's Upsample outputs get their type and shape
    declared (the input's, the last two dims scaled by height_scale and width_scale) where the input's are
    known."""
    if opset >= 7:
        return
    ups = [n for g in walk_graphs(model.graph) for n in g.node
           if n.op_type == "Upsample" and n.domain in DEFAULT_DOMAINS]
    if not ups:
        return
    for n in ups:
        for a in n.attribute:
            if a.name == "mode" and a.s == b"bilinear":
                a.s = b"linear"
    g = model.graph
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False).graph
    types = {v.name: v.type for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    declared = {v.name: v for v in (*g.input, *g.output, *g.value_info)}
    for n in g.node:
        if n.op_type != "Upsample" or n.domain not in DEFAULT_DOMAINS:
            continue
        x = types.get(n.input[0])
        scale = {a.name: a.f for a in n.attribute if a.name in ("height_scale", "width_scale")}
        if x is None or len(scale) < 2 or not x.tensor_type.HasField("shape"):
            continue
        rank = len(x.tensor_type.shape.dim)
        if rank < 2:
            continue
        factors = [1.0] * (rank - 2) + [scale["height_scale"], scale["width_scale"]]
        dims = [onnx.TensorShapeProto.Dimension() for _ in range(rank)]
        for d, out, factor in zip(x.tensor_type.shape.dim, dims, factors):
            if d.HasField("dim_value"):
                out.dim_value = int(math.floor(d.dim_value * factor))
        v = declared.get(n.output[0])
        if v is None:
            v = g.value_info.add()
            v.name = n.output[0]
        elif v.type.tensor_type.HasField("shape"):
            continue
        v.type.tensor_type.elem_type = x.tensor_type.elem_type
        v.type.tensor_type.shape.dim.extend(dims)


def match_clip_bounds(model: onnx.ModelProto, opset: int) -> None:
    """Give the Constant bounds of the Clip nodes of ``model``, converted from default-domain ``opset`` < 11,
    and the Constant padding value of its Pad nodes their input's element type (in place)."""
    if opset >= 11:
        return
    inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    for g, gi in zip(walk_graphs(model.graph), walk_graphs(inferred.graph)):
        types = {v.name: v.type.tensor_type.elem_type for v in (*gi.input, *gi.value_info, *gi.output)}
        constants = {n.output[0]: n for n in g.node if n.op_type == "Constant" and n.output}
        for n in g.node:
            if n.op_type not in ("Clip", "Pad") or not types.get(n.input[0]):
                continue
            et = types[n.input[0]]
            for bound in n.input[1:] if n.op_type == "Clip" else n.input[2:3]:
                c = constants.get(bound)
                value = next((a for a in c.attribute if a.name == "value"), None) if c is not None else None
                if value is not None and value.t.data_type != et:
                    arr = numpy_helper.to_array(value.t).astype(helper.tensor_dtype_to_np_dtype(et))
                    value.t.CopyFrom(numpy_helper.from_array(arr, value.t.name))


def cast_old_dropout_masks(model: onnx.ModelProto, opset: int) -> None:
    """Give the mask output of the Dropout nodes of ``model``, converted from default-domain ``opset`` < 10,
    the type of the node's input again (in place): the node writes a bool mask under a new name, which a
    Cast to the input's type (a CastLike where that type is not known, from opset 15) turns into the old
    name."""
    if opset >= 10:
        return
    target = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), opset)
    names = types = None
    for g in walk_graphs(model.graph):
        if not any(_has_mask(n) for n in g.node):
            continue
        if types is None:
            names = NameGen.for_model(model)
            inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
            types = {v.name: v.type.tensor_type.elem_type for gi in walk_graphs(inferred.graph)
                     for v in (*gi.input, *gi.value_info, *gi.output)}
        nodes: list[onnx.NodeProto] = []
        for n in g.node:
            nodes.append(n)
            if not _has_mask(n) or not (types.get(n.input[0]) or target >= 15):
                continue
            mask = n.output[1]
            n.output[1] = names(f"{mask}_bool")
            label = names(f"{n.name or 'Dropout'}_mask_Cast")
            et = types.get(n.input[0])
            if et:
                nodes.append(helper.make_node("Cast", [n.output[1]], [mask], name=label, to=et))
            else:
                nodes.append(helper.make_node("CastLike", [n.output[1], n.input[0]], [mask], name=label))
        del g.node[:]
        g.node.extend(nodes)


def _has_mask(n: onnx.NodeProto) -> bool:
    """Whether ``n`` is a default-domain Dropout that outputs its mask."""
    return n.op_type == "Dropout" and n.domain in DEFAULT_DOMAINS and len(n.output) > 1 and bool(n.output[1])


def _defines(g: onnx.GraphProto) -> set[str]:
    """The names graph ``g`` itself defines: its inputs, initializers and node outputs."""
    return ({v.name for v in g.input} | {t.name for t in g.initializer}
            | {o for n in g.node for o in n.output if o})


def unique_body_names(model: onnx.ModelProto) -> None:
    """Rename, in place, the values a control-flow body defines under a name that a graph around it (or an
    earlier body) defines too; the body's reads of them, and its nested bodies', follow."""
    names = NameGen.for_model(model)
    seen = _defines(model.graph)

    def visit(g: onnx.GraphProto) -> None:
        for node in g.node:
            for body in subgraphs(node):
                clash = _defines(body) & seen
                if clash:
                    rename_in_graph(body, {c: names(c) for c in sorted(clash)})
                seen.update(_defines(body))
                visit(body)

    visit(model.graph)
