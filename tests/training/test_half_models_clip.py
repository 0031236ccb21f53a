"""onnxblock's ClipGradNorm in front of AdamW or SGD on float16 parameters (the optimizer model of
generate_artifacts with clip_grad): the gradients are clipped in float32 and rounded to float16 once, and the
update of a parameter that steps in float32 reads the clipped value before that rounding.

Before, the clip computed in float16 (the coefficient cast to float16, then a float16 Mul): two roundings,
and onnxruntime 1.32, which computes that Mul in float32 without the coefficient's Cast, gave other bits for
the same graph (1,640 of 5,000 first moments and 1,970 clipped gradients apart from onnxtrain's engine).

Oracles: the clipped gradient is float16(float32(g) · c), c = min(max_norm / (‖g‖ + 1e-6), 1) from float64's
norm rounded to float32 (within one float16 ulp: the float32 norm's summation order); onnxruntime 1.32 runs
the same optimizer model to the same bits as onnxtrain's engine but where that order moves the float32 norm
by an ulp (a handful of elements, each within one ulp)."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxtrain import InferenceSession
from onnxtrain.training import onnxblock

MAX_NORM = 0.5  # the gradients' norm is about 0.8: the clip scales them


def _ulps(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    def key(x: np.ndarray) -> np.ndarray:
        i = x.view(np.uint16).astype(np.int64)
        return np.where(i >= 0x8000, 0x8000 - i, i)
    return np.abs(key(a) - key(b))


def _model_and_feeds(block: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray], dict[str, np.ndarray]]:
    rng = np.random.default_rng(0)
    params = {"W": (rng.standard_normal(5000) * 0.1).astype(np.float16),
              "V": (rng.standard_normal((30, 40)) * 0.1).astype(np.float16)}
    with onnxblock.empty_base():
        block(([numpy_helper.from_array(a, n) for n, a in params.items()], []))
    model = block.to_model_proto()
    onnx.checker.check_model(model, full_check=True)
    feeds = {"learning_rate": np.array([1e-3], np.float32), "step": np.array([3], np.int64)}
    for n, a in params.items():
        feeds[n] = a
        feeds[f"{n}_grad"] = (rng.standard_normal(a.shape) * 1e-2).astype(np.float16)
        feeds[f"{n}.momentum0"] = (rng.standard_normal(a.shape) * 1e-3).astype(np.float16)
        feeds[f"{n}.momentum1"] = (np.abs(rng.standard_normal(a.shape)) * 1e-5).astype(np.float16)
    return model, {i.name: feeds[i.name] for i in model.graph.input}, params


BLOCKS = {"adamw": lambda: onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(MAX_NORM)),
          "sgd": lambda: onnxblock.optim.SGD(clip_grad=onnxblock.optim.ClipGradNorm(MAX_NORM))}


@pytest.mark.parametrize("name", sorted(BLOCKS))
def test_clipped_half_gradients_round_once_and_onnxruntime_agrees(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    model, feeds, params = _model_and_feeds(BLOCKS[name]())
    outs = [o.name for o in model.graph.output]
    ours = dict(zip(outs, InferenceSession(model.SerializeToString()).run(outs, feeds)))
    theirs = dict(zip(outs, ort.InferenceSession(model.SerializeToString(),
                                                 providers=["CPUExecutionProvider"]).run(outs, feeds)))
    grads = {n: feeds[f"{n}_grad"] for n in params}
    norm = np.float32(np.sqrt(sum(np.sum(g.astype(np.float64) ** 2) for g in grads.values())))
    assert norm > MAX_NORM
    coef = np.minimum(np.float32(MAX_NORM) / (norm + np.float32(1e-6)), np.float32(1))
    for n, g in grads.items():
        got = next(v for k, v in ours.items() if k.startswith(f"{n}_grad"))
        assert got.dtype == np.float16
        want = (g.astype(np.float32) * coef).astype(np.float16)
        assert _ulps(got, want).max() <= 1, n
        assert np.count_nonzero(got.view(np.uint16) != want.view(np.uint16)) <= got.size // 200, n
    apart = 0
    for k in outs:
        assert ours[k].dtype == theirs[k].dtype, k
        d = _ulps(ours[k], theirs[k])
        assert d.max() <= 1, (k, int(d.max()))
        apart += int(np.count_nonzero(d))
    assert apart <= 20, apart  # a few elements where the float32 norms differ by an ulp
