"""MaxUnpool with its optional output_shape input (onnxtrain/engine/kernels/pool.py), after the MaxPool whose
indices it reads.

With output_shape, Y takes that shape and the indices address it (pads ignored), as the ONNX spec and
onnxruntime read it. onnx.reference scatters into the size the attributes give and pads at the end, which
agrees only when output_shape adds trailing batches (the flat positions are then the same), so it is the
oracle there and onnxruntime elsewhere (ONNX's node case test_maxunpool_export_with_output_shape follows
onnx.reference; onnxruntime skips it: onnx/onnx#2398, microsoft/onnxruntime#2193). Gradients: finite
differences in float64 (engine) and the gradient graph run in onnxruntime (float32).
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.engine.plan import EngineError
from onnxtrain.testing import gradcheck

# (x shape, MaxPool attributes, output_shape): MaxPool drops a border that output_shape restores
CASES = [
    ((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 2, 5, 5]),
    ((2, 3, 7, 6), {"kernel_shape": [3, 2], "strides": [3, 2]}, [2, 3, 7, 6]),
    ((1, 2, 6, 6), {"kernel_shape": [2, 2], "strides": [2, 2], "pads": [1, 1, 1, 1]}, [1, 2, 6, 6]),
    ((2, 2, 9), {"kernel_shape": [2], "strides": [2]}, [2, 2, 9]),
    ((1, 1, 5, 4, 5), {"kernel_shape": [2, 2, 2], "strides": [2, 2, 2]}, [1, 1, 5, 4, 5]),
    ((1, 2, 6, 5), {"kernel_shape": [3, 3], "strides": [2, 2]}, [1, 2, 6, 5]),  # overlapping windows
    ((1, 2, 4, 4), {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 2, 6, 6]),  # larger than the input
]
IDS = ["2d-border", "2d-rect", "2d-pads", "1d", "3d", "2d-overlap", "2d-grow"]


def _distinct(shape: tuple[int, ...], dtype: Any, seed: int = 0) -> np.ndarray:
    """Values without ties (so MaxPool's indices and gradients are well defined)."""
    n = int(np.prod(shape))
    return (np.random.default_rng(seed).permutation(n).reshape(shape) * (4.0 / n) - 2.0).astype(dtype)


def _pool_unpool(xs: tuple[int, ...], attrs: dict, out_shape: list[int], dtype: int) -> onnx.ModelProto:
    """loss = sum(w · MaxUnpool(MaxPool(x), output_shape)), and z, the unpooled tensor."""
    dt = helper.tensor_dtype_to_np_dtype(dtype)
    w = np.random.default_rng(1).standard_normal(out_shape).astype(dt)
    g = helper.make_graph(
        [helper.make_node("MaxPool", ["x"], ["y", "i"], **attrs),
         helper.make_node("MaxUnpool", ["y", "i", "os"], ["z"], **attrs),
         helper.make_node("Mul", ["z", "w"], ["zw"]),
         helper.make_node("ReduceSum", ["zw"], ["loss"], keepdims=0)],
        "pool_unpool",
        [helper.make_tensor_value_info("x", dtype, list(xs))],
        [helper.make_tensor_value_info("loss", dtype, []),
         helper.make_tensor_value_info("z", dtype, out_shape)],
        [numpy_helper.from_array(np.array(out_shape, np.int64), "os"), numpy_helper.from_array(w, "w")],
    )
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _ort_session(model: onnx.ModelProto):
    ort = pytest.importorskip("onnxruntime")
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("xs,attrs,out_shape", CASES, ids=IDS)
def test_max_unpool_output_shape_matches_onnxruntime(xs, attrs, out_shape) -> None:
    m = _pool_unpool(xs, attrs, out_shape, T.FLOAT)
    onnx.checker.check_model(m, full_check=True)
    x = _distinct(xs, np.float32)
    loss, z = compile_model(m).run({"x": x})
    ref_loss, ref_z = _ort_session(m).run(None, {"x": x})
    assert z.shape == tuple(out_shape)
    np.testing.assert_array_equal(z, ref_z)
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-6)


def test_max_unpool_output_shape_with_more_batches_matches_onnx_reference() -> None:
    from onnx.reference import ReferenceEvaluator

    rng = np.random.default_rng(2)
    x = rng.standard_normal((2, 2, 2, 3))
    hi = np.arange(2)[:, None] * 2 + rng.integers(0, 2, x.shape)
    wi = np.arange(3)[None, :] * 2 + rng.integers(0, 2, x.shape)
    idx = (((np.arange(4).reshape(2, 2, 1, 1) * 4 + hi) * 6) + wi).astype(np.int64)
    g = helper.make_graph(
        [helper.make_node("MaxUnpool", ["x", "i", "os"], ["z"], kernel_shape=[2, 2], strides=[2, 2])],
        "unpool",
        [helper.make_tensor_value_info("x", T.DOUBLE, x.shape),
         helper.make_tensor_value_info("i", T.INT64, x.shape),
         helper.make_tensor_value_info("os", T.INT64, [4])],
        [helper.make_tensor_value_info("z", T.DOUBLE, None)])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for os_ in ([2, 2, 4, 6], [3, 2, 4, 6]):
        feeds = {"x": x, "i": idx, "os": np.array(os_, np.int64)}
        (ours,) = compile_model(m).run(feeds)
        (ref,) = ReferenceEvaluator(m).run(None, feeds)
        assert ours.shape == tuple(os_)
        np.testing.assert_array_equal(ours, ref)


@pytest.mark.parametrize("xs,attrs,out_shape", CASES, ids=IDS)
def test_max_unpool_output_shape_gradient(xs, attrs, out_shape) -> None:
    # float64, the engine against finite differences
    gradcheck(_pool_unpool(xs, attrs, out_shape, T.DOUBLE), "loss", ["x"], {"x": _distinct(xs, np.float64)})
    # float32, the same gradient graph in onnxruntime
    m = _pool_unpool(xs, attrs, out_shape, T.FLOAT)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gm = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    x = _distinct(xs, np.float32)
    ours = compile_model(gm).run({"x": x})[-1]
    ref = _ort_session(gm).run(None, {"x": x})[-1]
    assert ours.shape == xs
    np.testing.assert_allclose(ours, ref, rtol=1e-6, atol=1e-6)


def test_max_unpool_output_shape_errors() -> None:
    m = _pool_unpool((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 2, 3, 3], T.FLOAT)
    with pytest.raises(EngineError, match="smaller than the inferred shape"):
        compile_model(m).run({"x": _distinct((1, 2, 5, 5), np.float32)})
    m = _pool_unpool((1, 2, 5, 5), {"kernel_shape": [2, 2], "strides": [2, 2]}, [1, 1, 5, 7], T.FLOAT)
    with pytest.raises(EngineError, match=r"index out of range \[0, 35\)"):  # channel 1's rows 2-3: ≥ 35
        compile_model(m).run({"x": _distinct((1, 2, 5, 5), np.float32)})


@pytest.mark.parametrize("x", [[0.1, 0.2, 3.0, 0.4, 0.5], [5.0, 0.2, 0.3, 0.4, 0.5, 0.1, 0.7]])
def test_an_index_written_twice_passes_the_gradient_once(x: list[float]) -> None:
    """Overlapping MaxPool windows (kernel 3, stride 2) whose maximum is the shared element give its index
    twice; MaxUnpool writes it twice and Y holds the later write, so only that one gets dY: the gradient was
    counted once per write (x[2]: 0.42 against 0.21 by finite differences)."""
    xs = (1, 1, len(x))
    attrs = {"kernel_shape": [3], "strides": [2]}
    out = [1, 1, len(x)]
    feeds = {"x": np.array(x, np.float64).reshape(xs)}
    grads = gradcheck(_pool_unpool(xs, attrs, out, T.DOUBLE), "loss", ["x"], feeds)
    if len(x) == 5:  # both windows' maximum is x[2]: its gradient is w[2] once (the other case: no repeat)
        want = np.zeros(xs)
        want.flat[2] = np.random.default_rng(1).standard_normal(out).flat[2]
        np.testing.assert_array_equal(grads["x"], want)
    m = _pool_unpool(xs, attrs, out, T.FLOAT)
    gm = build_gradient_model(m, "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    f = {"x": np.array(x, np.float32).reshape(xs)}
    np.testing.assert_allclose(compile_model(gm).run(f)[-1], _ort_session(gm).run(None, f)[-1], rtol=1e-6)
