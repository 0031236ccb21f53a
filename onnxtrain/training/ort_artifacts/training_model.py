"""The training and eval models: every onnxruntime-only node replaced by standard nodes."""

from __future__ import annotations

import onnx
from onnx import helper, numpy_helper

from onnxtrain.autodiff.opset_upgrade import EARLY_OPS, upgrade_opset
from onnxtrain.ir.builder import value_types
from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.training.ort_artifacts.common import (
    ACCUMULATED_SUFFIX,
    BUFFER_SUFFIX,
    MS,
    Context,
    Emit,
    TranslationError,
    is_foreign,
    is_onnxruntime_training_model,
    node_label,
)
from onnxtrain.training.ort_artifacts.fused import BY_HAND, MIN_OPSET, batch_norm_internal
from onnxtrain.training.ort_artifacts.gradients import GRADS, grad_by_rule

RULES_OPSET = 16  # the opset the translation of a GRADS operator or BatchNormInternal moves a model to


def translate_training_model(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` (an onnxruntime-training training or eval model) with every onnxruntime-only node
    replaced by standard ONNX nodes; a model without such nodes is returned as it is."""
    if not is_onnxruntime_training_model(model):
        return model
    opset = next((o.version for o in model.opset_import if o.domain in DEFAULT_DOMAINS), 0)
    foreign = {n.op_type for n in model.graph.node if is_foreign(n)}
    needed = max((GRADS[op].min_opset if op in GRADS else MIN_OPSET.get(op, 0) for op in foreign), default=0)
    # onnxruntime's own LayerNormalization (its fusion's) before opset 17: standard from 17 on
    early = {n.op_type for n in model.graph.node if n.domain in DEFAULT_DOMAINS and n.op_type in EARLY_OPS}
    needed = max([needed, *(EARLY_OPS[op] for op in early if opset < EARLY_OPS[op])])
    # onnxtrain's gradient rules, which translate GRADS, are written for its gradient builder's opset 17 (the
    # ScatterND/ScatterElements that add of the Gather and cross-entropy gradients need 16, a
    # training-mode BatchNormalization 14): the model moves to 16 first, which defines every operator of
    # opset 17 but the ones 17 brought (LayerNormalization: EARLY_OPS)
    if foreign & (GRADS.keys() | {"BatchNormInternal"}):
        needed = max(needed, RULES_OPSET)
    if opset < needed:  # e.g. GatherNDGrad's ScatterND that adds: the standard nodes move to that opset first
        model = upgrade_opset(_own_ops_apart(model), needed)
        opset = needed
    g = model.graph
    ctx = Context(
        opset,
        value_types(model),
        {o: n for n in g.node for o in n.output if o},
        {t.name: numpy_helper.to_array(t) for t in g.initializer},
        {v.name for v in (*g.input, *g.output, *g.value_info)}
        | {t.name for t in g.initializer}
        | {o for n in g.node for o in n.output}
        | {n.name for n in g.node},
    )
    for n in g.node:
        if n.op_type == "Constant" and not n.domain and n.attribute and n.attribute[0].name == "value":
            ctx.constants[n.output[0]] = numpy_helper.to_array(n.attribute[0].t)
    nodes: list[onnx.NodeProto] = []
    for node in g.node:
        foreign = is_foreign(node)
        if node.domain == MS and node.op_type == "BatchNormInternal":
            extra = [o for o in node.output[3:] if o]
            if extra:  # saved mean / inverse std: only the gradient reads them, and it is translated too
                ctx.producer.update({o: _bn_stand_in(node) for o in extra})
            nodes.extend(batch_norm_internal(node, ctx, Emit(node, ctx, nodes)))
            continue
        if not foreign:
            nodes.append(node)
            continue
        spec = GRADS.get(node.op_type)
        if spec is not None:
            nodes.extend(grad_by_rule(node, spec, ctx))
            continue
        by_hand = BY_HAND.get(node.op_type)
        if by_hand is None:
            raise TranslationError(
                f"{node_label(node)}: onnxruntime-training's {node.op_type} has no standard-ONNX "
                f"translation here (translated: {', '.join(_translated())}); "
                "regenerate the artifacts with onnxtrain.training.artifacts.generate_artifacts"
            )
        by_hand(node, ctx, Emit(node, ctx, nodes))
    result = onnx.ModelProto()
    result.CopyFrom(model)
    del result.graph.node[:]
    result.graph.node.extend(nodes)
    for o in result.graph.output:  # the accumulators' outputs are the new buffers, not flags
        if o.name.endswith(ACCUMULATED_SUFFIX):
            buf = o.name[: -len(ACCUMULATED_SUFFIX)] + BUFFER_SUFFIX
            if buf in ctx.types:
                o.type.CopyFrom(ctx.types[buf])
    keep = [o for o in result.opset_import if o.domain in ("", "ai.onnx", "ai.onnx.ml")]
    del result.opset_import[:]
    result.opset_import.extend(keep)
    del result.graph.value_info[:]
    return result


def _own_ops_apart(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with onnxruntime's own operators of the default domain (``MaxPoolGrad``...) in its
    com.microsoft domain, where ONNX's version converter leaves them (it fails on an operator it has no
    schema of); the translation reads them there alike."""
    moved = [n for n in model.graph.node if is_foreign(n) and n.domain != MS]
    if not moved:
        return model
    out = onnx.ModelProto()
    out.CopyFrom(model)
    for n in out.graph.node:
        if is_foreign(n) and n.domain != MS:
            n.domain = MS
    if not any(o.domain == MS for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(MS, 1))
    return out


def _translated() -> list[str]:
    """The onnxruntime-only operators this module rewrites."""
    return sorted({*GRADS, *BY_HAND, "BatchNormInternal"})


def _bn_stand_in(node: onnx.NodeProto) -> onnx.NodeProto:
    """A standard BatchNormalization with the inputs of onnxruntime's ``BatchNormInternal`` ``node``, for
    its gradient to find the running statistics by."""
    return helper.make_node("BatchNormalization", list(node.input[:5]), ["_"])
