"""Review R4 of 23acbd0d (onnxblock's ClipGradNorm clips a float16/bfloat16 gradient in float32 and a half
parameter's float32 step reads that value before it is rounded): the clip computes in float64 when another
parameter of the model is float64, and the widened value a half parameter's float32 update then read was
float64, so the optimizer model failed onnx.checker (a float32 Mul given a float64 operand). Before 23acbd0d
such a model was built (the coefficient cast to the half type).

Oracle: numpy in float64 for the clip coefficient and the clipped gradient, the half parameter's step
``half(float32(w) - float32(lr) · float32(g·c))`` (the clipped value's rounding to float32 from float64 is
the only difference to one rounding; within one half ulp either way)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxtrain import InferenceSession
from onnxtrain.training import onnxblock

MAX_NORM = 0.5
HALF = {"float16": np.float16, "bfloat16": ml_dtypes.bfloat16}


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    def key(x: np.ndarray) -> np.ndarray:
        i = x.view(np.uint16).astype(np.int64)
        return np.where(i >= 0x8000, 0x8000 - i, i)
    return int(np.abs(key(a) - key(b)).max())


@pytest.mark.parametrize("kind", sorted(HALF))
@pytest.mark.parametrize("opt", ["SGD", "AdamW"])
def test_clip_over_a_half_and_a_float64_parameter_builds_and_steps(opt: str, kind: str) -> None:
    half = HALF[kind]
    rng = np.random.default_rng(4)
    params = {"H": (rng.standard_normal(300) * 0.1).astype(np.float32).astype(half),
              "D": rng.standard_normal((7, 5)) * 0.1}
    block = getattr(onnxblock.optim, opt)(clip_grad=onnxblock.optim.ClipGradNorm(MAX_NORM))
    with onnxblock.empty_base():
        block(([numpy_helper.from_array(a, n) for n, a in params.items()], []))
    model = block.to_model_proto()
    onnx.checker.check_model(model, full_check=True)
    lr = 0.05
    feeds = {"learning_rate": np.array([lr], np.float32), "step": np.array([2], np.int64)}
    for n, a in params.items():
        feeds[n] = a
        feeds[f"{n}_grad"] = (rng.standard_normal(a.shape) * 0.1).astype(np.float32).astype(a.dtype)
        feeds[f"{n}.momentum0"] = np.zeros_like(a)
        feeds[f"{n}.momentum1"] = np.zeros_like(a)
    outs = [o.name for o in model.graph.output]
    got = dict(zip(outs, InferenceSession(model.SerializeToString()).run(
        outs, {i.name: feeds[i.name] for i in model.graph.input})))
    g64 = {n: feeds[f"{n}_grad"].astype(np.float64) for n in params}
    norm = np.sqrt(sum(np.sum(g ** 2) for g in g64.values()))
    assert norm > MAX_NORM
    coef = min(MAX_NORM / (norm + 1e-6), 1.0)
    clipped = next(v for k, v in got.items() if k.startswith("H_grad"))
    assert clipped.dtype == half
    assert _ulps(clipped, (g64["H"] * coef).astype(half)) <= 1
    if opt == "SGD":
        new = next(v for k, v in got.items() if k.startswith("H") and not k.startswith("H_grad")
                   and v.shape == params["H"].shape and "momentum" not in k)
        assert new.dtype == half
        want = (params["H"].astype(np.float32) - np.float32(lr) * (g64["H"] * coef).astype(np.float32))
        assert _ulps(new, want.astype(half)) <= 1
        assert np.count_nonzero(new.view(np.uint16) != params["H"].view(np.uint16)) > 100  # it steps
