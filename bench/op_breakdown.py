"""Where a forward's time goes, onnxtrain against onnxruntime: kernel time per group of ops.

Both engines write the same chrome-trace format (``SessionOptions.enable_profiling``), one event per node
run with its op type. Each op type falls into a group (matrix products, softmax, layer norm, elementwise,
layout); fused steps go where their members would (onnxtrain's ``FusedElementwise`` and onnxruntime's
``BiasGelu`` are both elementwise work). Figures are milliseconds of kernel time per forward, summed over
the profiled runs and divided by their number; the time between kernels is not in them.
"""

from __future__ import annotations

import json
import os
import tempfile
import time
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx

GROUPS: dict[str, frozenset[str]] = {
    "matrix products": frozenset({
        "MatMul", "Gemm", "FusedMatMulAdd", "FusedMatMulWeightGrad", "FusedMatMul", "FusedGemm",
        "TransposeMatMul", "Conv", "FusedConv", "Attention", "MultiHeadAttention",
    }),
    "softmax": frozenset({"Softmax", "MaskedSoftmax", "LogSoftmax", "BiasSoftmax"}),
    "layer norm": frozenset({"LayerNormalization", "SkipLayerNormalization", "SimplifiedLayerNormalization"}),
    "elementwise": frozenset({
        "FusedElementwise", "FusedElementwiseGroup", "LazySelect", "BiasGelu", "FastGelu", "Gelu", "BiasAdd",
        "Add", "Sub", "Mul", "Div", "Erf", "Tanh", "Sqrt", "Pow", "Exp", "Log", "Relu", "Neg", "Where",
        "Cast", "Equal", "Not",
    }),
    "layout and shapes": frozenset({
        "Reshape", "Transpose", "Concat", "Split", "Slice", "Gather", "Unsqueeze", "Squeeze", "Shape",
        "Expand", "Identity", "ConstantOfShape", "Range", "Flatten",
    }),
}
OTHER = "other"
SETTLE_S = 0.3  # seconds between the two engines' profiles


def group_of(op: str) -> str:
    """The group an op type's time is counted in."""
    for name, ops in GROUPS.items():
        if op in ops:
            return name
    return OTHER


def kernel_events(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The node-kernel events of a chrome trace (not onnxruntime's fences or session events)."""
    return [e for e in events if e.get("cat") == "Node" and str(e.get("name", "")).endswith("_kernel_time")]


def kernel_ms(events: list[dict[str, Any]], runs: int) -> dict[str, float]:
    """Kernel milliseconds per run by group, from the kernel events of ``runs`` runs."""
    out: dict[str, float] = {}
    for e in events:
        g = group_of(str(e.get("args", {}).get("op_name", "")))
        out[g] = out.get(g, 0.0) + float(e["dur"]) / 1e3 / runs
    return out


def _profiled(make: Callable[[Any], Any], options: Any, feeds: Mapping[str, np.ndarray], runs: int,
              warmup: int) -> dict[str, float]:
    """Kernel ms per run of a session made by ``make(options)`` with profiling on; the first ``warmup``
    runs are profiled too (a session profiles from its start) and left out."""
    with tempfile.TemporaryDirectory(prefix="onnxtrain-breakdown-") as tmp:
        options.enable_profiling = True
        options.profile_file_prefix = os.path.join(tmp, "profile_")
        sess = make(options)
        for _ in range(warmup + runs):
            sess.run(None, dict(feeds))
        with open(sess.end_profiling()) as f:
            events = kernel_events(json.load(f))
    per_run = len(events) // (warmup + runs)
    return kernel_ms(events[warmup * per_run:], runs)


def breakdown(model: onnx.ModelProto, feeds: Mapping[str, np.ndarray], runs: int = 20,
              warmup: int = 3) -> dict[str, dict[str, float]]:
    """{"onnxtrain": {group: ms}, "onnxruntime": {group: ms}}: kernel time per forward of ``model``."""
    import onnxruntime as ort

    import onnxtrain

    data = model.SerializeToString()
    ours = _profiled(lambda so: onnxtrain.InferenceSession(data, so), onnxtrain.SessionOptions(), feeds,
                     runs, warmup)
    time.sleep(SETTLE_S)  # numpy's OpenBLAS threads busy-wait for a while after their last call
    theirs = _profiled(lambda so: ort.InferenceSession(data, so, providers=["CPUExecutionProvider"]),
                       ort.SessionOptions(), feeds, runs, warmup)
    return {"onnxtrain": ours, "onnxruntime": theirs}


def table(result: Mapping[str, Mapping[str, float]]) -> list[str]:
    """Lines of a table: group, onnxtrain ms, onnxruntime ms, ratio; largest gap first, then the total."""
    ours, theirs = result["onnxtrain"], result["onnxruntime"]
    groups = sorted(set(ours) | set(theirs), key=lambda g: -(ours.get(g, 0.0) - theirs.get(g, 0.0)))
    lines = [f"    {'kernel ms per forward':24s} {'onnxtrain':>10s} {'onnxruntime':>12s} {'ratio':>7s}"]
    for g in groups + ["total"]:
        a = sum(ours.values()) if g == "total" else ours.get(g, 0.0)
        b = sum(theirs.values()) if g == "total" else theirs.get(g, 0.0)
        r = f"{a / b:6.2f}×" if b > 0 else "      -"
        lines.append(f"    {g:24s} {a:10.2f} {b:12.2f} {r:>7s}")
    return lines
