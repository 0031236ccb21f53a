"""Strided ConvTranspose: onnxtrain's engine against onnxruntime on one-node models.

    python -m bench.convtranspose [--repeats 7] [--quick]

Layers of a DCGAN generator (4×4 at stride 2), a U-Net's 2×2 up-convolutions, the input gradients of
ResNet's and a 3-D network's stride-2 3×3 convolutions, a 1-D decoder and a grouped layer. Per layer, in
float32: onnxtrain's ConvTranspose as the engine picks it, the col2im path alone (one batched matmul and a
strided add per kernel offset, what every strided ConvTranspose ran before the shifted GEMMs of
``engine/kernels/conv_transpose_shifts.py``) and onnxruntime's plain inference package, interleaved
(``bench.common.compare``), medians in ms, and the ratio of the engine's time to onnxruntime's.
"""

from __future__ import annotations

import os
import sys

if __package__ in (None, ""):  # run as a script: make the checkout importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
import onnx
from onnx import helper

from bench.common import add_repo_to_path, layer_bench_args, peers_row

add_repo_to_path()
from onnxtrain.engine import compile_model  # noqa: E402
from onnxtrain.engine.kernels import conv  # noqa: E402
from onnxtrain.engine.registry import Attrs  # noqa: E402

_P1 = {"strides": [2, 2], "pads": [1, 1, 1, 1]}
_GRAD = {"strides": [2, 2], "pads": [1, 1, 1, 1], "output_padding": [1, 1]}
# (name, X shape, W shape, attributes)
CASES = [
    ("dcgan 64×512×4² → 256, 4×4", (64, 512, 4, 4), (512, 256, 4, 4), _P1),
    ("dcgan 64×256×8² → 128, 4×4", (64, 256, 8, 8), (256, 128, 4, 4), _P1),
    ("dcgan 64×128×16² → 64, 4×4", (64, 128, 16, 16), (128, 64, 4, 4), _P1),
    ("dcgan 64×64×32² → 3, 4×4", (64, 64, 32, 32), (64, 3, 4, 4), _P1),
    ("unet 16×128×16² → 64, 2×2", (16, 128, 16, 16), (128, 64, 2, 2), {"strides": [2, 2]}),
    ("unet 16×64×32² → 32, 2×2", (16, 64, 32, 32), (64, 32, 2, 2), {"strides": [2, 2]}),
    ("resnet dX 32×64×8² → 32, 3×3", (32, 64, 8, 8), (64, 32, 3, 3), _GRAD),
    ("resnet dX 32×32×16² → 16, 3×3", (32, 32, 16, 16), (32, 16, 3, 3), _GRAD),
    ("3-D dX 2×32×8³ → 16, 3×3×3", (2, 32, 8, 8, 8), (32, 16, 3, 3, 3),
     {"strides": [2, 2, 2], "pads": [1] * 6, "output_padding": [1, 1, 1]}),
    ("1-D 16×64×1000 → 32, 4", (16, 64, 1000), (64, 32, 4), {"strides": [2], "pads": [1, 1]}),
    ("grouped ×4 16×64×16² → 64, 4×4", (16, 64, 16, 16), (64, 16, 4, 4), {**_P1, "group": 4}),
]
QUICK = [("dcgan 4×64×8² → 32, 4×4", (4, 64, 8, 8), (64, 32, 4, 4), _P1),
         ("1-D 2×16×64 → 16, 4", (2, 16, 64), (16, 16, 4), {"strides": [2], "pads": [1, 1]})]


def one_node(xs: tuple[int, ...], ws: tuple[int, ...], attrs: dict) -> onnx.ModelProto:
    """The ConvTranspose of float32 X and W as a model (opset 17)."""
    geometry = conv._convt_geometry(Attrs(attrs), xs, ws)
    y_shape = (xs[0], ws[1] * attrs.get("group", 1), *geometry["out"])
    node = helper.make_node("ConvTranspose", ["x", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "convtranspose", [helper.make_tensor_value_info("x", 1, xs),
                                                        helper.make_tensor_value_info("w", 1, ws)],
                              [helper.make_tensor_value_info("y", 1, y_shape)])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def main(argv: list[str] | None = None) -> int:
    import onnxruntime as ort

    quick, repeats = layer_bench_args("python -m bench.convtranspose", __doc__, argv, 7, 5)
    print(f"{'layer':34s} {'onnxtrain ms':>12s} {'col2im ms':>10s} {'onnxruntime ms':>14s} {'ratio':>6s}")
    for name, xs, ws, attrs in QUICK if quick else CASES:
        rng = np.random.default_rng(0)
        feeds = {"x": rng.standard_normal(xs, dtype=np.float32),
                 "w": rng.standard_normal(ws, dtype=np.float32)}
        model = one_node(xs, ws, attrs)
        plan = compile_model(model)
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        geometry = conv._convt_geometry(Attrs(attrs), xs, ws)
        theirs = sess.run(None, feeds)[0]
        for ours in (plan.run(feeds)[0], conv._col2im_conv_transpose(feeds["x"], feeds["w"], geometry)):
            np.testing.assert_allclose(ours, theirs, rtol=1e-3, atol=1e-3 * float(np.abs(theirs).max()))
        peers = {"onnxtrain": lambda: plan.run(feeds),  # noqa: B023 - timed right here
                 "col2im": lambda: conv._col2im_conv_transpose(feeds["x"], feeds["w"], geometry),  # noqa: B023
                 "onnxruntime": lambda: sess.run(None, feeds)}  # noqa: B023
        print(peers_row(name, peers, (34, 12, 10, 14), repeats), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
