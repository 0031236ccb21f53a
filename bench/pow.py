"""Pow by one exponent in onnxtrain's engine against onnxruntime on the same one-node model.

    python -m bench.pow [--repeats 7] [--quick]

X is float32 (16, 64, 512) from a normal distribution (half the bases negative, as a GELU's input) or its
absolute value, for the exponents models use: the cube of GPT-2's tanh GELU (``x ** 3``, which numpy's
float32 pow took ~60 ns a value for on negative bases), 1 (the power in the gradient of RMSNorm's square when
the exponent is read at run time), 4, 1.5, 0.5, -0.5 and 5 (float64's power). Results are checked against
onnxruntime's first (within 1 ulp); figures are medians of interleaved runs, as ms and as onnxtrain's time
over onnxruntime's (onnxruntime with 2 intra-op threads).
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import TensorProto, helper

from bench.common import add_repo_to_path, layer_bench_args, timed_against_onnxruntime

add_repo_to_path()
from onnxtrain.engine import compile_model  # noqa: E402

SHAPE = (16, 64, 512)
QUICK_SHAPE = (4, 8, 16)
# (label, exponent, bases of both signs)
CASES = [("x ** 3, GPT-2's GELU", 3.0, True), ("x ** 1, a square's gradient", 1.0, True),
         ("x ** 4", 4.0, True), ("|x| ** 1.5", 1.5, False), ("|x| ** 0.5", 0.5, False),
         ("|x| ** -0.5", -0.5, False), ("x ** 5", 5.0, True)]


def pow_model(shape: tuple[int, ...], exponent: float) -> onnx.ModelProto:
    """One Pow node of X (float32, ``shape``) by a constant 0-d exponent."""
    e = helper.make_tensor("e", TensorProto.FLOAT, [], [exponent])
    g = helper.make_graph([helper.make_node("Pow", ["X", "e"], ["Y"])], "pow",
                          [helper.make_tensor_value_info("X", TensorProto.FLOAT, list(shape))],
                          [helper.make_tensor_value_info("Y", TensorProto.FLOAT, list(shape))],
                          initializer=[e])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main(argv: list[str] | None = None) -> int:
    quick, repeats = layer_bench_args("python -m bench.pow", __doc__, argv, 7, 5)
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = 2
    shape = QUICK_SHAPE if quick else SHAPE
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32)
    for label, exponent, signed in CASES:
        model = pow_model(shape, exponent)
        theirs = ort.InferenceSession(model.SerializeToString(), opts, providers=["CPUExecutionProvider"])
        ours = compile_model(model)
        feeds = {"X": x if signed else np.abs(x)}
        np.testing.assert_array_max_ulp(ours.run(feeds)[0], theirs.run(None, feeds)[0], maxulp=1)
        line = timed_against_onnxruntime(label, ours, theirs, feeds, repeats, 0.02 if quick else 0.05)
        print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
