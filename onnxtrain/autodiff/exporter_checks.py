"""What torch's exporters do to a model that is meant for training, told to the user: a BatchNorm traced in
training mode but written as inference BatchNormalization, and parameters renamed or folded away."""

from __future__ import annotations

import re

import onnx

from onnxtrain.ir.graphs import is_training_batch_norm
from onnxtrain.user_warning import warn

_FX_NODE = "pkg.torch.onnx.fx_node"  # the dynamo exporter's record of the torch call a node came from
_TRAINING_BATCH_NORM = ("_native_batch_norm_legit_functional", "native_batch_norm.default")

_EXPORT_HINT = (
    "torch.onnx.export renames, folds or merges parameters unless asked not to: pass optimize=False "
    "(dynamo, the default exporter) or do_constant_folding=False with "
    "training=torch.onnx.TrainingMode.TRAINING (dynamo=False); a weight that modules share (tied) is written "
    "once, under one of its names, which named_parameters(remove_duplicate=False) lists among the others"
)


def _from_torch(model: onnx.ModelProto) -> bool:
    return model.producer_name == "pytorch"


def export_hint(model: onnx.ModelProto) -> str:
    """For an error about a parameter name: the exporter options that keep torch's names (else "")."""
    return f" ({_EXPORT_HINT})" if _from_torch(model) else ""


def _traced_in_training(node: onnx.NodeProto) -> bool:
    """Whether the dynamo exporter's record says ``node`` came from a batch norm that used batch statistics
    (its ``training`` argument, the sixth, was True)."""
    fx = next((p.value for p in node.metadata_props if p.key == _FX_NODE), "")
    if not any(t in fx for t in _TRAINING_BATCH_NORM) or "args = (" not in fx:
        return False
    args = fx.split("args = (", 1)[1].split(")", 1)[0].split(",")
    return len(args) > 5 and args[5].strip() == "True"


def warn_inference_batch_norms(model: onnx.ModelProto) -> None:
    """Warn about BatchNormalization nodes that torch traced in training mode but wrote for inference (the
    dynamo exporter does so): they normalise with the running statistics and never update them."""
    names = [n.name or n.output[0] for n in model.graph.node if n.op_type == "BatchNormalization"
             and not is_training_batch_norm(n) and _traced_in_training(n)]
    if names:
        warn(f"BatchNormalization {names}: torch traced them in training mode but its exporter wrote them "
             "for inference (no training_mode): this gradient graph normalises with the running statistics "
             "and never updates them, unlike torch's training. The training APIs (TrainingSession, "
             "generate_artifacts) put every BatchNormalization in training mode, as onnxruntime's did; for "
             "this graph, export with dynamo=False, training=torch.onnx.TrainingMode.TRAINING, "
             "do_constant_folding=False.")


def warn_folded_constants(model: onnx.ModelProto, trained: list[str]) -> None:
    """Warn when weights found to train are constants torch's dynamo exporter made (``val_<n>``: folded
    transposes of parameters, an attention scale), which its optimizer leaves instead of the parameters."""
    made = [w for w in trained if re.fullmatch(r"val_\d+", w)]
    if made and _from_torch(model):
        warn(f"training {made}: constants torch's exporter computed (named val_<n>: e.g. a parameter's "
             f"folded transpose or an attention scale), not the module's parameters; {_EXPORT_HINT}, or "
             "list weights_to_train")
