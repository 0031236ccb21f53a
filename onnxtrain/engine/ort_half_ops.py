"""float16 MeanVarianceNormalization, GlobalLpPool from opset 22 and float64 GlobalLpPool, which onnxruntime
1.32 cannot load, written as standard ops it can.

A sweep of one-node float16 models of every op of onnxtrain's registry through the onnxruntime backend (at
opsets 9 to 23) left these refused at load, where the numpy engine runs them:

    MeanVarianceNormalization (float16)  onnxruntime's function body at opsets 9, 10, 13 and 18 mixes types
    GlobalLpPool (opset 22 on)           onnxruntime has no kernel of that version, float32 included
    GlobalLpPool (float64)               no float64 kernel at any opset

Each becomes what the numpy engine computes: the normalization the same node on x cast to float32 (the
engine's statistics are float32 too) and cast back, GlobalLpPool ``ReduceL2`` (p = 2) or
``Pow(ReduceSum(Pow(|x|, p)), 1/p)`` over the spatial axes (float16 in float32, as the engine).

float16 Celu, refused too, is invalid ONNX (Celu's T is float32; the engine lets float64 through) and the
numpy engine refuses it by name as well, so it is left so. bfloat16 is not handled: onnxruntime's CPU
provider has no bfloat16 kernel of even ``Add``. Nodes of the main graph whose input type is known are
rewritten; the others stay onnxruntime's error.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.attrs import parse_attributes
from onnxtrain.ir.builder import NameGen, elem_type, model_opset, static_shape, with_nodes_replaced
from onnxtrain.ir.graphs import DEFAULT_DOMAINS

_LP_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16)
_GLOBAL_LP_SINCE = 22  # onnxruntime 1.32 registers GlobalLpPool up to version 21


def _candidate(node: onnx.NodeProto) -> bool:
    return (node.op_type in ("GlobalLpPool", "MeanVarianceNormalization") and node.domain in DEFAULT_DOMAINS
            and len(node.input) > 0)


def half_ops(model: onnx.ModelProto, typed: Callable[[], dict]) -> onnx.ModelProto:
    """``model`` with each node above (main graph) written as ops onnxruntime loads (a copy), or ``model``
    itself when there is none."""
    opset = model_opset(model)
    if not any(_candidate(n) for n in model.graph.node):
        return model
    types = typed()
    found = [k for k, n in enumerate(model.graph.node) if _candidate(n) and _supported(n, types, opset)]
    if not found:
        return model

    def replace(_k: int, n: onnx.NodeProto, names: NameGen, out: onnx.ModelProto) -> list[onnx.NodeProto]:
        return _rewrite(n, names, out, opset, types)

    return with_nodes_replaced(model, found, replace)


def _supported(node: onnx.NodeProto, types: dict, opset: int) -> bool:
    t = elem_type(types, node.input[0])
    if node.op_type == "GlobalLpPool":
        shape = static_shape(types, node.input[0])
        wanted = opset >= _GLOBAL_LP_SINCE or t == TensorProto.DOUBLE
        return wanted and t in _LP_FLOATS and shape is not None and len(shape) > 2
    return t == TensorProto.FLOAT16


def _rewrite(node: onnx.NodeProto, names: NameGen, model: onnx.ModelProto, opset: int,
             types: dict) -> list[onnx.NodeProto]:
    base = node.name or node.op_type
    x, y = node.input[0], node.output[0]
    out: list[onnx.NodeProto] = []

    def make(op: str, ins: list[str], name: str | None = None, **kw: object) -> str:
        name = name or names(f"{y}/{op}")
        out.append(helper.make_node(op, ins, [name], name=names(f"{base}/{op}"), **kw))
        return name

    half = elem_type(types, x) == TensorProto.FLOAT16
    if node.op_type == "MeanVarianceNormalization":
        wide = make("Cast", [x], to=TensorProto.FLOAT)
        inner = helper.make_node("MeanVarianceNormalization", [wide], [names(f"{y}/float")],
                                 name=names(f"{base}/float"))
        inner.attribute.extend(node.attribute)
        out.append(inner)
        make("Cast", [inner.output[0]], y, to=TensorProto.FLOAT16)
    else:  # GlobalLpPool
        p = float(parse_attributes(node, opset).get("p") or 2)
        src = make("Cast", [x], to=TensorProto.FLOAT) if half else x
        dtype = np.float64 if elem_type(types, x) == TensorProto.DOUBLE else np.float32
        axes = list(range(2, len(static_shape(types, x) or [])))
        axes_name = names(f"{y}/axes")
        model.graph.initializer.append(numpy_helper.from_array(np.array(axes, np.int64), axes_name))

        def reduce(op: str, value: str, dest: str | None) -> str:
            # axes an input from opset 18 (ReduceSum: 13), an attribute before
            if opset >= (13 if op == "ReduceSum" else 18):
                return make(op, [value, axes_name], dest, keepdims=1)
            return make(op, [value], dest, axes=axes, keepdims=1)

        final = None if half else y
        if p == 2:
            s = reduce("ReduceL2", src, final)
        else:
            exponent, root = names(f"{y}/p"), names(f"{y}/root")
            model.graph.initializer.extend([numpy_helper.from_array(np.array(p, dtype), exponent),
                                            numpy_helper.from_array(np.array(1.0 / p, dtype), root)])
            total = reduce("ReduceSum", make("Pow", [make("Abs", [src]), exponent]), None)
            s = make("Pow", [total, root], final)
        if half:
            make("Cast", [s], y, to=TensorProto.FLOAT16)
    return out
