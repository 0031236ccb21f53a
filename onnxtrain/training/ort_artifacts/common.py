"""What the translation of onnxruntime-training's artifacts shares: the error, the test for
onnxruntime-only nodes, the translation context and the node emitter."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.errors import Fail
from onnxtrain.ir.builder import elem_type, static_shape
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

MS = "com.microsoft"
# onnxruntime-training's optimizer operators (its optimizer models hold one)
OPTIMIZER_OPS = frozenset({"AdamWOptimizer", "SGDOptimizerV2"})
ACCUMULATED_SUFFIX = "_grad.accumulation.out"
BUFFER_SUFFIX = "_grad.accumulation.buffer"


class TranslationError(Fail, ValueError):
    """An onnxruntime-training artifact uses something that has no standard-ONNX translation here (a
    ``ValueError``, and the ``RuntimeError`` onnxruntime-training raised for an artifact it could not use)."""


def is_onnxruntime_training_model(model: onnx.ModelProto) -> bool:
    """Whether ``model`` holds operators that only onnxruntime-training runs (its ``com.microsoft``
    gradient and optimizer kernels, or ``MaxPoolGrad``, which it registers in the default domain)."""
    return any(is_foreign(n) for n in model.graph.node)


# onnxruntime registers these operators of its own in the default domain
_DEFAULT_DOMAIN = frozenset({"MaxPoolGrad", "AveragePoolGrad", "SimplifiedLayerNormalization"})


def is_foreign(node: onnx.NodeProto) -> bool:
    return node.domain == MS or (node.op_type in _DEFAULT_DOMAIN and node.domain in DEFAULT_DOMAINS)


@dataclass
class Context:
    """The model being translated: value types, producers and fresh names."""

    opset: int
    types: dict[str, onnx.TypeProto]
    producer: dict[str, onnx.NodeProto]
    constants: dict[str, np.ndarray]
    taken: set[str]
    # a recurrent training node's all-hidden-states output -> the translated node's inputs and outputs
    recurrent: dict[str, tuple[list[str], list[str]]] = field(default_factory=dict)
    counter: list[int] = field(default_factory=lambda: [0])

    def fresh(self, base: str) -> str:
        while True:
            self.counter[0] += 1
            name = f"{base}__ort{self.counter[0]}"
            if name not in self.taken:
                self.taken.add(name)
                return name


def node_label(node: onnx.NodeProto) -> str:
    return f"node {node.name!r} ({node.domain + '.' if node.domain else ''}{node.op_type})"


class Emit:
    """Appends standard nodes standing in for one onnxruntime node to ``nodes``, with fresh names."""

    def __init__(self, node: onnx.NodeProto, ctx: Context, nodes: list[onnx.NodeProto]) -> None:
        self.base, self.ctx, self.nodes = node.name or node.op_type, ctx, nodes

    def __call__(self, op: str, *inputs: str, output: str | None = None, **attrs: Any) -> str:
        """One single-output node; returns its output's name."""
        o = output or self.ctx.fresh(f"{self.base}/{op}")
        self.nodes.append(
            helper.make_node(op, list(inputs), [o], name=self.ctx.fresh(f"{self.base}/{op}"), **attrs)
        )
        return o


def const(emit: Emit, value: Any, dtype: Any = np.float32) -> str:
    return emit("Constant", value=numpy_helper.from_array(np.asarray(value, dtype)))


def rank_of(ctx: Context, name: str) -> int | None:
    dims = static_shape(ctx.types, name)
    return None if dims is None else len(dims)


def float_elem_type(ctx: Context, name: str) -> int:
    """The element type of float value ``name`` (float32 when the types do not tell)."""
    return elem_type(ctx.types, name) or TensorProto.FLOAT


def float_dtype(ctx: Context, name: str) -> Any:
    """The numpy dtype of float value ``name`` (float32 when the types do not tell)."""
    return helper.tensor_dtype_to_np_dtype(float_elem_type(ctx, name))
