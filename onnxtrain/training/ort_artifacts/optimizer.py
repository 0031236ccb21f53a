"""The optimizer model: onnxtrain's, with the hyper-parameters of onnxruntime-training's."""

from __future__ import annotations

import onnx
from onnx import helper

from onnxtrain.ir.graphs import DEFAULT_DOMAINS
from onnxtrain.training.ort_artifacts.common import (
    BUFFER_SUFFIX,
    MS,
    OPTIMIZER_OPS,
    TranslationError,
    is_onnxruntime_training_model,
    node_label,
)


def _trainable(training_model: onnx.ModelProto) -> list[tuple[str, onnx.TypeProto]]:
    types = {v.name: v.type for v in training_model.graph.input}
    names = [
        v.name[: -len(BUFFER_SUFFIX)] for v in training_model.graph.input if v.name.endswith(BUFFER_SUFFIX)
    ]
    missing = [p for p in names if p not in types]
    if missing:
        raise TranslationError(
            f"the training model has gradient buffers but no inputs for parameter(s) {missing}"
        )
    return [(p, types[p]) for p in names]


def translate_optimizer_model(model: onnx.ModelProto, training_model: onnx.ModelProto) -> onnx.ModelProto:
    """onnxtrain's optimizer model with the hyper-parameters of onnxruntime-training's ``model`` (one
    ``AdamWOptimizer`` or ``SGDOptimizerV2`` node, optionally after ``InplaceClipGradNorm``), for the
    trainable parameters of ``training_model``; a model without them is returned as it is."""
    from onnxtrain.training.artifacts import build_optimizer_model
    from onnxtrain.training.onnxblock import optim
    from onnxtrain.training.onnxblock.optim.optim import ADAMW_OPERATOR_DEFAULTS

    if not is_onnxruntime_training_model(model):
        return model
    if not any(n.op_type in OPTIMIZER_OPS for n in model.graph.node):
        raise TranslationError(
            "not an optimizer model: it has no AdamWOptimizer or SGDOptimizerV2 node (a training or eval "
            "model given as the optimizer model?)"
        )
    clip = None
    block = None
    for node in model.graph.node:
        a = {x.name: helper.get_attribute_value(x) for x in node.attribute}
        if node.op_type == "InplaceClipGradNorm":
            clip = optim.ClipGradNorm(float(a.get("max_norm", 1.0)))
        elif node.op_type == "AdamWOptimizer":
            a = {**ADAMW_OPERATOR_DEFAULTS, **a}  # (its weight decay default is 1e-2, not 0)
            if int(a["adam_mode"]) != 1:
                raise TranslationError(
                    f"{node_label(node)}: adam_mode {a['adam_mode']} (PyTorch's AdamW) is not "
                    "translated; onnxruntime-training's generate_artifacts writes adam_mode 1"
                )
            block = optim.AdamW(
                bias_correction=bool(a["correct_bias"]),
                betas=(float(a["alpha"]), float(a["beta"])),
                eps=float(a["epsilon"]),
                weight_decay=float(a["weight_decay"]),
                clip_grad=None,
            )
        elif node.op_type == "SGDOptimizerV2":
            block = optim.SGD()
        elif node.domain == MS:
            raise TranslationError(
                f"{node_label(node)}: not an optimizer operator this translation knows "
                "(AdamWOptimizer, SGDOptimizerV2, InplaceClipGradNorm)"
            )
    block.clip_grad = clip
    opset = next((o.version for o in training_model.opset_import if o.domain in DEFAULT_DOMAINS), 17)
    return build_optimizer_model(block, _trainable(training_model), max(opset, 17))
