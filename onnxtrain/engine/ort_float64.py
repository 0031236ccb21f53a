"""float64 ops that onnxruntime 1.32's CPU provider has no double kernel for, written as standard ops that
have one, so that a float64 model (and its gradient graph) loads on the onnxruntime backend.

onnxruntime refused such a graph at load ("Could not find an implementation for LeakyRelu(6)"), where the
numpy engine runs it in float64. Each node becomes the formula the numpy engine's kernel computes, in
float64 (ONNX's float attributes are float32 values, taken as they are):

    LeakyRelu        Where(x < 0, x·alpha, x)
    Elu / Selu       (alpha·(Exp(Min(x, 0)) − 1) + Max(x, 0)) [· gamma]
    Celu             alpha·(Exp(Min(x, 0) / alpha) − 1) + Max(x, 0)
    Softplus         Max(x, 0) + Log(1 + Exp(−|x|))
    Softsign         x / (|x| + 1)
    Mish             x · Tanh(Softplus(x))
    HardSigmoid      Clip(x·alpha + beta, 0, 1)
    HardSwish        x · Clip(x·(1/6 as float32) + 0.5, 0, 1)
    ThresholdedRelu  Where(x > alpha, x, 0)
    Gelu (tanh)      x · (Tanh(x·(c + c₃·x²)) + 1) · 0.5
    PRelu            Where(x < 0, x·slope, x)
    Mean             Sum(...) / n
    GlobalAveragePool / GlobalMaxPool   ReduceMean / ReduceMax over the spatial axes, kept

The numpy engine's ``expm1`` and ``log1p`` are ``Exp − 1`` and ``Log(1 + ·)`` here: the same values within
a few units of 1e-16 absolute. Nodes of the main graph whose input is known to be float64 are rewritten;
Erf and the exact Gelu (no formula of standard ops) and the trigonometric ops stay onnxruntime's error.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.builder import NameGen, elem_type, model_opset, static_shape, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

_OPS = frozenset({"LeakyRelu", "Elu", "Selu", "Celu", "Softplus", "Softsign", "Mish", "HardSigmoid",
                  "HardSwish", "ThresholdedRelu", "Gelu", "PRelu", "Mean", "GlobalAveragePool",
                  "GlobalMaxPool"})
# the numpy engine's Gelu and HardSwish constants (ONNX's function bodies': float32 values)
_GELU_C = math.sqrt(float(np.float32(2 / math.pi)))
_GELU_C3 = float(np.float32(0.044715)) * _GELU_C
_SIXTH = float(np.float32(1 / 6))


def _candidate(node: onnx.NodeProto) -> bool:
    return node.op_type in _OPS and node.domain in DEFAULT_DOMAINS and len(node.input) > 0


def float64_ops(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each float64 node of the ops above (main graph) written as standard ops that have
    float64 kernels in onnxruntime (a copy), or ``model`` itself when there is none."""
    g = model.graph
    if not any(_candidate(n) for n in g.node):
        return model
    types = typed()
    opset = model_opset(model)
    found = [k for k, n in enumerate(g.node) if _candidate(n) and _supported(n, types, opset)]
    if not found:
        return model

    def replace(_k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        return _Writer(n, names, out, opset, types).nodes()

    return with_nodes_replaced(model, found, replace)


def _supported(node: onnx.NodeProto, types: dict, opset: int) -> bool:
    if elem_type(types, node.input[0]) != TensorProto.DOUBLE:
        return False
    if node.op_type == "Gelu":
        return parse_attributes(node, opset).get("approximate") == "tanh"
    if node.op_type.startswith("Global"):
        shape = static_shape(types, node.input[0])
        return shape is not None and len(shape) > 2
    return True


class _Writer:
    """The nodes of one rewritten node: the last writes its output."""

    def __init__(self, node: onnx.NodeProto, names: NameGen, model: onnx.ModelProto, opset: int, types: dict):
        self.node, self.names, self.model, self.opset, self.types = node, names, model, opset, types
        self.base = node.name or node.op_type
        self.out: list[onnx.NodeProto] = []

    def make(self, op: str, ins: list[str], final: bool = False, **kw: object) -> str:
        name = self.node.output[0] if final else self.names(f"{self.node.output[0]}/{op}")
        self.out.append(helper.make_node(op, ins, [name], name=self.names(f"{self.base}/{op}"), **kw))
        return name

    def const(self, value: float | list[int], dtype: type = np.float64) -> str:
        name = self.names(f"{self.node.output[0]}/const")
        self.model.graph.initializer.append(numpy_helper.from_array(np.array(value, dtype), name))
        return name

    def elu(self, x: str, alpha: float, final: bool, scale: float | None = None, inner: float = 1.0) -> str:
        """alpha·(Exp(Min(x, 0) / inner) − 1) + Max(x, 0), times ``scale``."""
        zero = self.const(0.0)
        low = self.make("Min", [x, zero])
        if inner != 1.0:
            low = self.make("Div", [low, self.const(inner)])
        grown = self.make("Sub", [self.make("Exp", [low]), self.const(1.0)])
        total = self.make("Add", [self.make("Mul", [grown, self.const(alpha)]), self.make("Max", [x, zero])],
                          final and scale is None)
        return total if scale is None else self.make("Mul", [total, self.const(scale)], final)

    def softplus(self, x: str, final: bool) -> str:
        small = self.make("Exp", [self.make("Neg", [self.make("Abs", [x])])])
        tail = self.make("Log", [self.make("Add", [small, self.const(1.0)])])
        return self.make("Add", [self.make("Max", [x, self.const(0.0)]), tail], final)

    def nodes(self) -> list[onnx.NodeProto]:
        n = self.node
        op, x = n.op_type, n.input[0]
        a = parse_attributes(n, self.opset)
        if op == "LeakyRelu":
            below = self.make("Less", [x, self.const(0.0)])
            self.make("Where", [below, self.make("Mul", [x, self.const(a["alpha"])]), x], True)
        elif op == "Elu":
            self.elu(x, a["alpha"], True)
        elif op == "Selu":
            self.elu(x, a["alpha"], True, scale=a["gamma"])
        elif op == "Celu":
            self.elu(x, a["alpha"], True, inner=a["alpha"])
        elif op == "Softplus":
            self.softplus(x, True)
        elif op == "Softsign":
            self.make("Div", [x, self.make("Add", [self.make("Abs", [x]), self.const(1.0)])], True)
        elif op == "Mish":
            self.make("Mul", [x, self.make("Tanh", [self.softplus(x, False)])], True)
        elif op in ("HardSigmoid", "HardSwish"):
            alpha, beta = (a["alpha"], a["beta"] + 0.0) if op == "HardSigmoid" else (_SIXTH, 0.5)
            lin = self.make("Add", [self.make("Mul", [x, self.const(alpha)]), self.const(beta)])
            clipped = self.make("Clip", [lin, self.const(0.0), self.const(1.0)], op == "HardSigmoid")
            if op == "HardSwish":
                self.make("Mul", [clipped, x], True)
        elif op == "ThresholdedRelu":
            self.make("Where", [self.make("Greater", [x, self.const(a["alpha"])]), x, self.const(0.0)], True)
        elif op == "Gelu":
            inner = self.make("Add", [self.make("Mul", [self.make("Mul", [x, x]), self.const(_GELU_C3)]),
                                      self.const(_GELU_C)])
            t = self.make("Add", [self.make("Tanh", [self.make("Mul", [inner, x])]), self.const(1.0)])
            self.make("Mul", [self.make("Mul", [t, x]), self.const(0.5)], True)
        elif op == "PRelu":
            below = self.make("Less", [x, self.const(0.0)])
            self.make("Where", [below, self.make("Mul", [x, n.input[1]]), x], True)
        elif op == "Mean":
            ins = [i for i in n.input if i]
            if len(ins) == 1:
                self.make("Identity", ins, True)
            else:
                self.make("Div", [self.make("Sum", ins), self.const(float(len(ins)))], True)
        else:  # GlobalAveragePool, GlobalMaxPool
            rank = len(static_shape(self.types, x) or [])
            axes = list(range(2, rank))
            reduce = "ReduceMean" if op == "GlobalAveragePool" else "ReduceMax"
            if self.opset >= 18:
                self.make(reduce, [x, self.const(axes, np.int64)], True, keepdims=1)
            else:
                self.make(reduce, [x], True, axes=axes, keepdims=1)
        return self.out
