"""Build one-node models from an OpCase and run them on our engine and on oracles."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import helper

from onnxtrain.ir.builder import make_model
from tests.op_cases import OpCase


def one_node_model(case: OpCase, inputs: list[Any]) -> onnx.ModelProto:
    """A model holding one ``case.op`` node; inputs named x0, x1, ...; outputs y0, y1, ..."""
    in_names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    out_names = [f"y{i}" for i in range(case.n_outputs)]
    node = helper.make_node(case.op, in_names, out_names, name=f"{case.op}_0", **case.attrs)
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(np.asarray(v).dtype),
                                          np.shape(v)) for n, v in zip(in_names, inputs) if n]
    g_out = [helper.make_empty_tensor_value_info(n) for n in out_names]
    graph = helper.make_graph([node], case.id, g_in, g_out)
    return make_model(graph, case.opset)


def feeds_of(inputs: list[Any]) -> dict[str, Any]:
    return {f"x{i}": v for i, v in enumerate(inputs) if v is not None}


def run_ours(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    from onnxtrain.engine import compile_model

    return compile_model(model).run(feeds)


def run_reference(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    from onnx.reference import ReferenceEvaluator

    return ReferenceEvaluator(model).run(None, feeds)


def run_reference_body(model: onnx.ModelProto, feeds: dict[str, Any]) -> list[np.ndarray]:
    """onnx.reference running the model's single node as its ONNX function body."""
    from onnxtrain.ir.functions import expand_functions

    op = model.graph.node[0].op_type
    return run_reference(expand_functions(model, lambda n: n.op_type == op), feeds)
