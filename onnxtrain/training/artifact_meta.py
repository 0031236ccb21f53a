"""What the artifact generator's graphs share: its error types, the metadata keys it writes, and the last
step of every model it emits (the lowest IR version its opsets allow, and onnx.checker's full check)."""

from __future__ import annotations

import json
from typing import Any

import onnx
from onnx import helper

from onnxtrain.graph_transforms import mixed_precision as mp_pass
from onnxtrain.ir.builder import unknown_versions
from onnxtrain.ir.large import check_model_full
from onnxtrain.training.onnxblock.model_accessor import BlockError
from onnxtrain.version import PRODUCER

LOSS_SCALE = mp_pass.LOSS_SCALE
LOSS_SCALING_KEY = "onnxtrain.loss_scaling"
RECOMPUTE_KEY = "onnxtrain.recompute"
OPTIMIZER_IO_KEY = "onnxtrain.optimizer_io"


class ArtifactError(BlockError):
    """Artifacts cannot be generated; the message names the argument, parameter or value at fault.

    A ``RuntimeError`` (what onnxruntime-training raises) and a ``ValueError``.
    """


class UnknownLossInput(ArtifactError, LookupError):
    """A ``loss_input_names`` entry that is no value of the model (onnxruntime-training raised
    LookupError)."""


def add_metadata(m: onnx.ModelProto, key: str, value: dict[str, Any]) -> None:
    """Record ``value`` as JSON under ``key`` in the model's metadata_props."""
    p = m.metadata_props.add()
    p.key = key
    p.value = json.dumps(value, sort_keys=True)


def finish_model(m: onnx.ModelProto, what: str) -> onnx.ModelProto:
    """Lowest IR version the opsets allow; onnx.checker full check (an error here is a bug of ours). Opsets
    or an IR version newer than the installed onnx knows are refused (it would stamp an IR version too old
    for them)."""
    opsets = list(m.opset_import)
    unknown = unknown_versions(m)
    if unknown:
        raise ArtifactError(f"the model's {unknown}")
    out = helper.make_model(
        m.graph,
        opset_imports=opsets,
        **PRODUCER,
        ir_version=max(helper.find_min_ir_version_for(opsets, True), 3),
    )
    out.functions.extend(m.functions)
    out.metadata_props.extend(m.metadata_props)
    try:
        check_model_full(out)
    except Exception as err:
        raise ArtifactError(f"the generated {what} model fails onnx.checker: {err}") from None
    return out
