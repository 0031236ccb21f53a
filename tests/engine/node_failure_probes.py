"""Single-node models fed values that make the node fail while running (an index out of range, a shape that
does not fit, a broadcast of unequal dims, an axis outside the rank), run unchanged on onnxtrain and on
onnxruntime: which exception class each raises.

``python node_failure_probes.py MODULE`` (``onnxruntime`` in a peer venv) prints one JSON line; the tests
call :func:`run_cases` with a module. Only numpy, onnx and the standard library are used (onnxruntime-training
1.16.3's venv has numpy 1.26 and onnx 1.15).
"""

from __future__ import annotations

import json
import sys
from typing import Any

import numpy as np
from onnx import TensorProto, helper

F, L, B = TensorProto.FLOAT, TensorProto.INT64, TensorProto.BOOL  # float32, int64 (long), bool


def _f(*shape: int) -> np.ndarray:
    return np.ones(shape, np.float32)


def _i(*values: int) -> np.ndarray:
    return np.array(values, np.int64)


def _broadcast(op: str, elem: int = F, opset: int = 17) -> tuple:
    a = {F: _f(2, 3), B: np.ones((2, 3), bool), TensorProto.UINT8: np.ones((2, 3), np.uint8),
         L: np.ones((2, 3), np.int64)}[elem]
    return op, [("a", elem, a), ("b", elem, np.concatenate([a, a])[:4])], {}, 1, opset


# name → (op, [(input, element type, value)], attributes, outputs, opset)
CASES: dict[str, tuple] = {
    "gather_index": ("Gather", [("d", F, _f(3, 2)), ("i", L, _i(5))], {}, 1, 17),
    "gather_negative_index": ("Gather", [("d", F, _f(3, 2)), ("i", L, _i(-4))], {}, 1, 17),
    "gather_axis": ("Gather", [("d", F, _f(3, 2)), ("i", L, _i(0))], {"axis": 3}, 1, 17),
    "gather_elements_index": ("GatherElements", [("d", F, _f(3, 2)), ("i", L, np.array([[5, 0]], np.int64))],
                              {}, 1, 17),
    "gather_nd_index": ("GatherND", [("d", F, _f(3, 2)), ("i", L, np.array([[5]], np.int64))], {}, 1, 17),
    "scatter_elements_index": ("ScatterElements", [("d", F, _f(3, 2)), ("i", L, np.array([[5, 0]], np.int64)),
                                                   ("u", F, _f(1, 2))], {}, 1, 17),
    "scatter_index": ("Scatter", [("d", F, _f(3, 2)), ("i", L, np.array([[5, 0]], np.int64)),
                                  ("u", F, _f(1, 2))], {}, 1, 10),
    "scatter_nd_index": ("ScatterND", [("d", F, _f(3, 2)), ("i", L, np.array([[5]], np.int64)),
                                       ("u", F, _f(1, 2))], {}, 1, 17),
    "reshape_size": ("Reshape", [("d", F, _f(2, 12)), ("s", L, _i(5, 7))], {}, 1, 17),
    "reshape_two_minus_one": ("Reshape", [("d", F, _f(2, 12)), ("s", L, _i(-1, -1))], {}, 1, 17),
    "matmul_dims": ("MatMul", [("a", F, _f(2, 3)), ("b", F, _f(4, 5))], {}, 1, 17),
    "matmul_batch_dims": ("MatMul", [("a", F, _f(2, 2, 3)), ("b", F, _f(3, 2, 4))], {}, 1, 17),
    "gemm_dims": ("Gemm", [("a", F, _f(2, 3)), ("b", F, _f(4, 5))], {}, 1, 17),
    "concat_dims": ("Concat", [("a", F, _f(2, 3)), ("b", F, _f(4, 5))], {"axis": 0}, 1, 17),
    "expand_shape": ("Expand", [("a", F, _f(2, 3)), ("s", L, _i(4, 4))], {}, 1, 17),
    "tile_repeats": ("Tile", [("a", F, _f(2, 3)), ("r", L, _i(2))], {}, 1, 17),
    "split_sizes": ("Split", [("a", F, _f(6, 3)), ("s", L, _i(2, 2))], {"axis": 0}, 2, 17),
    "squeeze_not_one": ("Squeeze", [("a", F, _f(2, 3)), ("ax", L, _i(0))], {}, 1, 17),
    "unsqueeze_axis": ("Unsqueeze", [("a", F, _f(2, 3)), ("ax", L, _i(7))], {}, 1, 17),
    "reduce_sum_axes": ("ReduceSum", [("a", F, _f(2, 3)), ("ax", L, _i(5))], {}, 1, 17),
    "reduce_mean_axes": ("ReduceMean", [("a", F, _f(2, 3))], {"axes": [4]}, 1, 17),
    "cumsum_axis": ("CumSum", [("a", F, _f(2, 3)), ("ax", L, np.array(5, np.int64))], {}, 1, 17),
    "softmax_axis": ("Softmax", [("a", F, _f(2, 3))], {"axis": 4}, 1, 17),
    "flatten_axis": ("Flatten", [("a", F, _f(2, 3))], {"axis": 4}, 1, 17),
    "layer_norm_axis": ("LayerNormalization", [("x", F, _f(3)), ("s", F, _f(3))], {"axis": 1}, 1, 17),
    "layer_norm_scale": ("LayerNormalization", [("x", F, _f(2, 3)), ("s", F, _f(4))], {}, 1, 17),
    "conv_channels": ("Conv", [("x", F, _f(1, 3, 5, 5)), ("w", F, _f(2, 4, 3, 3))], {}, 1, 17),
    "conv_rank": ("Conv", [("x", F, _f(1, 1, 5)), ("w", F, _f(1, 1, 3, 3))], {}, 1, 17),
    "constant_of_shape_negative": ("ConstantOfShape", [("s", L, _i(-2, 3))], {}, 1, 17),
    "slice_step_zero": ("Slice", [("a", F, _f(4, 3)), ("st", L, _i(0)), ("en", L, _i(2)), ("ax", L, _i(0)),
                                  ("sp", L, _i(0))], {}, 1, 17),
    "transpose_perm": ("Transpose", [("a", F, _f(2, 3, 4))], {"perm": [1, 0]}, 1, 17),
    "pad_pads": ("Pad", [("a", F, _f(2, 3)), ("p", L, _i(1, 1))], {}, 1, 17),
    "range_delta_zero": ("Range", [("s", F, np.array(0, np.float32)), ("l", F, np.array(5, np.float32)),
                                   ("d", F, np.array(0, np.float32))], {}, 1, 17),
    "einsum_dims": ("Einsum", [("a", F, _f(2, 3)), ("b", F, _f(4, 5))], {"equation": "ij,jk->ik"}, 1, 17),
    "one_hot_depth": ("OneHot", [("i", L, _i(1)), ("d", L, np.array([-3], np.int64)),
                                 ("v", F, np.array([0, 1], np.float32))], {}, 1, 17),
    "resize_scales": ("Resize", [("x", F, _f(1, 1, 2, 2)), ("r", F, np.zeros(0, np.float32)),
                                 ("s", F, np.array([1, 1, 2], np.float32))], {}, 1, 17),
    "batch_norm_channels": ("BatchNormalization", [("x", F, _f(2, 3, 4)), ("s", F, _f(4)), ("b", F, _f(4)),
                                                   ("m", F, _f(4)), ("v", F, _f(4))], {}, 1, 17),
    "instance_norm_scale": ("InstanceNormalization", [("x", F, _f(2, 3, 4)), ("s", F, _f(4)),
                                                      ("b", F, _f(4))], {}, 1, 17),
    "lrn_rank": ("LRN", [("x", F, _f(3))], {"size": 3}, 1, 17),
    "depth_to_space_channels": ("DepthToSpace", [("x", F, _f(1, 3, 2, 2))], {"blocksize": 2}, 1, 17),
    "nll_label": ("NegativeLogLikelihoodLoss", [("s", F, _f(2, 3)), ("l", L, _i(0, 5))], {}, 1, 17),
    "softmax_cross_entropy_label": ("SoftmaxCrossEntropyLoss", [("s", F, _f(2, 3)), ("l", L, _i(0, 5))],
                                    {}, 1, 17),
    "softmax_cross_entropy_batch": ("SoftmaxCrossEntropyLoss", [("s", F, _f(2, 3)), ("l", L, _i(0, 1, 2))],
                                    {}, 1, 17),
    "where_broadcast": ("Where", [("c", B, np.ones((2, 3), bool)), ("a", F, _f(4, 3)), ("b", F, _f(2, 3))],
                        {}, 1, 17),
    "prelu_broadcast": ("PRelu", [("a", F, _f(2, 3)), ("b", F, _f(4))], {}, 1, 17),
    "mod_broadcast": ("Mod", [("a", F, _f(2, 3)), ("b", F, _f(4, 3))], {"fmod": 1}, 1, 17),
    "bit_shift_broadcast": (*_broadcast("BitShift", TensorProto.UINT8)[:2], {"direction": "LEFT"}, 1, 17),
    **{f"{op.lower()}_broadcast": _broadcast(op) for op in (
        "Add", "Sub", "Mul", "Div", "Pow", "Max", "Min", "Sum", "Mean", "Equal", "Less", "Greater",
        "LessOrEqual", "GreaterOrEqual")},
    **{f"{op.lower()}_broadcast": _broadcast(op, B) for op in ("And", "Or", "Xor")},
    **{f"{op.lower()}_broadcast": _broadcast(op, L, 18) for op in ("BitwiseAnd", "BitwiseOr", "BitwiseXor")},
    # no failure (controls): a window larger than the input, a division by zero
    "max_pool_window": ("MaxPool", [("x", F, _f(1, 1, 2, 2))], {"kernel_shape": [3, 3]}, 1, 17),
    "div_by_zero": ("Div", [("a", F, _f(2)), ("b", F, np.zeros(2, np.float32))], {}, 1, 17),
}


def _output_type(op: str, ins: list) -> int:
    if op in ("Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor"):
        return B
    return ins[0][1] if op.startswith("Bit") else F


def model_bytes(name: str) -> bytes:
    op, ins, attrs, outs, opset = CASES[name]
    node = helper.make_node(op, [n for n, _, _ in ins], [f"o{k}" for k in range(outs)], name="the_node",
                            **attrs)
    g = helper.make_graph([node], "g", [helper.make_tensor_value_info(n, t, None) for n, t, _ in ins],
                          [helper.make_tensor_value_info(f"o{k}", _output_type(op, ins), None)
                           for k in range(outs)])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    return model.SerializeToString()


def run_case(ort: Any, name: str, options: Any = None) -> dict[str, Any]:
    """``{"ok": True}`` or the error's class, the classes it derives from and its message."""
    _, ins, *_ = CASES[name]
    try:
        s = ort.InferenceSession(model_bytes(name), options, providers=["CPUExecutionProvider"])
        s.run(None, {n: v for n, _, v in ins})
        return {"ok": True}
    except Exception as e:  # noqa: BLE001 - every exception is what is compared
        return {"error": type(e).__name__, "mro": [c.__name__ for c in type(e).__mro__][1:],
                "message": str(e)[-400:]}


def run_cases(ort: Any, options: Any = None) -> dict[str, Any]:
    return {name: run_case(ort, name, options) for name in CASES}


if __name__ == "__main__":
    import importlib

    module = importlib.import_module(sys.argv[1])
    if hasattr(module, "set_default_logger_severity"):
        module.set_default_logger_severity(3)
    print(json.dumps(run_cases(module)))
