"""A model brought to the opset of its gradient graph (:data:`MIN_OPSET`, :data:`BF16_OPSET` for bfloat16)
by onnx's version converter, with the fixes that converter needs around it."""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from onnxtrain.autodiff.converter_fixes import (
    cast_old_dropout_masks,
    drop_idle_pad_values,
    drop_idle_spatial,
    flatten_old_hardmax,
    match_clip_bounds,
    prepare_old_upsamples,
    restore_legacy_resizes,
    unique_body_names,
)
from onnxtrain.autodiff.errors import GradientError
from onnxtrain.ir.builder import model_opset
from onnxtrain.ir.graphs import DEFAULT_DOMAINS, walk_graphs
from onnxtrain.user_warning import warn

MIN_OPSET = 17  # the lowest opset of a gradient graph


# operators onnxruntime runs in the default domain before ONNX adopted them (the same signature): the opset
# that adopted each. The version converter has no adapter for them; they keep their form through it.
EARLY_OPS = {"LayerNormalization": 17}
# operators the converter has no adapter for below an opset, whose older versions are the newer form but
# for an attribute the newer one dropped: the opset, and that attribute (the recurrent ops' output_sequence,
# dropped in opset 7, where Y became optional)
_UNADAPTED = {op: (7, "output_sequence") for op in ("LSTM", "GRU", "RNN")}
_HELD = "onnxtrain.held"


def _hold_early_ops(m: onnx.ModelProto) -> bool:
    """Move ``m``'s nodes of :data:`EARLY_OPS` below their ONNX opset, and of ``_UNADAPTED`` below theirs
    (without the attribute dropped), into a private domain (in place), so that the converter leaves them
    alone; whether there were any."""
    opset = model_opset(m)
    held = False
    if any(opset < _UNADAPTED.get(n.op_type, (0, ""))[0] for g in walk_graphs(m.graph) for n in g.node
           if n.domain in DEFAULT_DOMAINS):
        _declare_recurrent_outputs(m)
    for g in walk_graphs(m.graph):
        for n in g.node:
            if n.domain not in DEFAULT_DOMAINS:
                continue
            if opset < EARLY_OPS.get(n.op_type, 0):
                n.domain, held = _HELD, True
            elif opset < _UNADAPTED.get(n.op_type, (0, ""))[0]:
                kept = [a for a in n.attribute if a.name != _UNADAPTED[n.op_type][1]]
                del n.attribute[:]
                n.attribute.extend(kept)
                n.domain, held = _HELD, True
    if held:
        m.opset_import.append(helper.make_opsetid(_HELD, 1))
    return held


def _declare_recurrent_outputs(m: onnx.ModelProto) -> None:
    """Declare (in place) the type and shape of the outputs of the main graph's recurrent nodes that
    ``_UNADAPTED`` holds (onnx infers none for their old versions; the adapters of the nodes that read them
    need their shapes): Y [seq, directions, batch, hidden], Y_h and Y_c [directions, batch, hidden]."""
    g = m.graph
    inferred = onnx.shape_inference.infer_shapes(m, strict_mode=False).graph
    types = {v.name: v.type for v in (*inferred.input, *inferred.value_info, *inferred.output)}
    declared = {v.name: v for v in (*g.input, *g.output, *g.value_info)}
    for n in g.node:
        if n.op_type not in _UNADAPTED or n.domain not in DEFAULT_DOMAINS:
            continue
        x = types.get(n.input[0])
        if x is None or not x.tensor_type.HasField("shape") or len(x.tensor_type.shape.dim) != 3:
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        both = attrs.get("direction") == b"bidirectional"
        dirs = onnx.TensorShapeProto.Dimension(dim_value=2 if both else 1)
        hidden = onnx.TensorShapeProto.Dimension()
        if "hidden_size" in attrs:
            hidden.dim_value = attrs["hidden_size"]
        seq, batch = x.tensor_type.shape.dim[:2]
        for k, name in enumerate(n.output):
            if not name:
                continue
            dims = [seq, dirs, batch, hidden] if k == 0 else [dirs, batch, hidden]
            v = declared.get(name)
            if v is None:
                v = g.value_info.add()
                v.name = name
            if v.type.tensor_type.HasField("shape") and v.type.tensor_type.shape.dim:
                continue
            v.type.tensor_type.elem_type = x.tensor_type.elem_type
            v.type.tensor_type.shape.ClearField("dim")
            v.type.tensor_type.shape.dim.extend(dims)


def _drop_saved_statistics(m: onnx.ModelProto) -> set[str]:
    """Remove the saved mean and variance outputs (4th and 5th) of training-mode BatchNormalization nodes
    below opset 14, in place, when nothing reads them: the converter refuses them, and opset 14's node has
    only the running statistics (torch's training-mode exports at opset 9-13 write all five). A read one
    is an error naming the node. Returns the first outputs of the nodes in training mode (those with
    statistics outputs: below opset 14 that is what training mode is), for :func:`_mark_training`."""
    read = {name for g in walk_graphs(m.graph) for n in g.node for name in n.input}
    read |= {o.name for o in m.graph.output}
    training: set[str] = set()
    for g in walk_graphs(m.graph):
        for n in g.node:
            if n.op_type != "BatchNormalization" or n.domain not in DEFAULT_DOMAINS:
                continue
            if any(n.output[1:]):
                training.add(n.output[0])
            if len(n.output) < 4:
                continue
            used = [o for o in n.output[3:] if o and o in read]
            if used:
                raise GradientError(f"BatchNormalization node {n.name or n.output[0]!r} (opset "
                                    f"{model_opset(m)}): its saved statistics {used} are read, which opset "
                                    "14 and later cannot express; re-export the model at opset 14 or later")
            del n.output[3:]
    return training


def _mark_training(m: onnx.ModelProto, training: set[str]) -> None:
    """Set ``training_mode=1`` on the converted BatchNormalization nodes whose first output is in
    ``training`` (onnx's converter keeps their statistics outputs but not the mode they meant)."""
    for g in walk_graphs(m.graph):
        for n in g.node:
            if n.op_type == "BatchNormalization" and n.output and n.output[0] in training:
                kept = [a for a in n.attribute if a.name != "training_mode"]
                del n.attribute[:]
                n.attribute.extend([*kept, helper.make_attribute("training_mode", 1)])


BF16_OPSET = 20  # the first opset whose ConstantOfShape (the gradients' zeros and seed) makes bfloat16


def has_bfloat16(model: onnx.ModelProto) -> bool:
    """Whether the main graph declares, holds or casts to a bfloat16 tensor."""
    g, bf16 = model.graph, TensorProto.BFLOAT16
    if any(v.type.tensor_type.elem_type == bf16 for v in (*g.input, *g.output, *g.value_info)):
        return True
    if any(t.data_type == bf16 for t in g.initializer):
        return True
    for n in g.node:
        for a in n.attribute:
            cast = a.name == "to" and n.op_type == "Cast" and a.i == bf16
            if cast or (a.type == onnx.AttributeProto.TENSOR and a.t.data_type == bf16):
                return True
    return False


def upgrade_opset(model: onnx.ModelProto, target: int = MIN_OPSET) -> onnx.ModelProto:
    """``model`` at default-domain opset >= ``target`` (older models go through the version converter; nodes
    of :data:`EARLY_OPS` go through unchanged, standard once ``target`` reaches their opset)."""
    if model_opset(model) >= target:
        return model
    from onnxtrain.engine.node_checks import check_nodes

    check_nodes(model)  # named here, as onnxruntime refuses them: the converter's failures name no node
    old_scans = [n.name or n.op_type for g in walk_graphs(model.graph) for n in g.node
                 if n.op_type == "Scan" and n.domain in DEFAULT_DOMAINS]
    if old_scans and model_opset(model) < 9:
        # onnx's converter drops Scan-8's batch axis from the declared shapes without squeezing the data
        raise GradientError(f"Scan node(s) {old_scans} of opset {model_opset(model)} (with a batch axis): "
                            "gradients need opset 9 or later; re-export the model at a newer opset")
    from onnx import version_converter

    # the converter only sees initializers that are also graph inputs: list them for the conversion
    m = onnx.ModelProto()
    m.CopyFrom(model)
    held = _hold_early_ops(m)
    training_bns = _drop_saved_statistics(m)
    drop_idle_pad_values(m, model_opset(model))
    drop_idle_spatial(m, model_opset(model))
    prepare_old_upsamples(m, model_opset(model))
    refused = flatten_old_hardmax(m, model_opset(model))
    if refused:
        raise GradientError(f"Hardmax node(s) {refused} of opset {model_opset(model)}: gradients need "
                            "opset 5 or later; re-export the model at a newer opset")
    listed = {i.name for i in m.graph.input}
    extra = [
        helper.make_tensor_value_info(t.name, t.data_type, list(t.dims))
        for t in m.graph.initializer
        if t.name not in listed
    ]
    m.graph.input.extend(extra)
    try:
        out = version_converter.convert_version(m, target)
    except Exception as e:
        raise GradientError(
            f"could not upgrade the model from opset {model_opset(model)} to {target}: {e}"
        ) from None
    _mark_training(out, training_bns)
    rounded_down = restore_legacy_resizes(out, model_opset(model))
    if rounded_down and any(n.op_type == "Resize" for g in walk_graphs(model.graph) for n in g.node):
        warn(f"nearest Resize node(s) {', '.join(rounded_down)} of opset {model_opset(model)} take scales "
             "computed in the graph: the gradient graph's copy rounds positions down on every axis, where "
             "Resize-10 rounds up on an axis it downsamples; give the scales as a constant to keep that")
    match_clip_bounds(out, model_opset(model))
    cast_old_dropout_masks(out, model_opset(model))
    unique_body_names(out)
    added = {v.name for v in extra}
    kept = [i for i in out.graph.input if i.name not in added]
    del out.graph.input[:]
    out.graph.input.extend(kept)
    if held:
        for g in walk_graphs(out.graph):
            for n in g.node:
                if n.domain == _HELD:
                    n.domain = ""
        imports = [o for o in out.opset_import if o.domain != _HELD]
        del out.opset_import[:]
        out.opset_import.extend(imports)
    out.ir_version = max(out.ir_version, helper.find_min_ir_version_for([helper.make_opsetid("", target)]))
    return out
