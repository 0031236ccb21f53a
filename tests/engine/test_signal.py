"""Signal kernels and rules on cases the op table does not reach.

The op table feeds dft_length, axis, frame_step and frame_length as graph inputs; here they are
initializers, so the gradient rules take their build-time paths (constant weights, Slice/Pad sizes,
frame positions); float64 central differences and onnxruntime are the oracles. Float32 windows are
compared with torch (onnx.reference computes some of them in float32), MelWeightMatrix with
onnxruntime's implementation and STFT with torch.stft.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, random_loss_model, run_engine


def _model(op: str, x: np.ndarray, fixed: list[Any], opset: int, feed_window: bool = False,
           **attrs: Any) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """One ``op`` node on graph input x0; the other inputs are initializers (None: omitted), except
    a fed STFT window."""
    names, inits, g_in = ["x0"], [], [helper.make_tensor_value_info("x0", TensorProto.DOUBLE, x.shape)]
    feeds = {"x0": x}
    for i, v in enumerate(fixed, start=1):
        name = f"x{i}" if v is not None else ""
        names.append(name)
        if v is None:
            continue
        if feed_window and i == 2:
            g_in.append(helper.make_tensor_value_info(name, TensorProto.DOUBLE, v.shape))
            feeds[name] = v
        else:
            inits.append(numpy_helper.from_array(np.asarray(v), name))
    node = helper.make_node(op, names, ["y0"], **attrs)
    graph = helper.make_graph([node], op, g_in, [helper.make_empty_tensor_value_info("y0")], inits)
    return make_model(graph, opset), feeds


def _check_gradient(model: onnx.ModelProto, feeds: dict[str, np.ndarray], wrt: list[str]) -> onnx.ModelProto:
    """Finite differences, then the same gradient graph on onnxruntime; returns the gradient graph."""
    out = run_engine(model, feeds)[0]
    lmodel = random_loss_model(model, [out.shape], [0])
    gradcheck(lmodel, "loss", wrt, feeds, rtol=1e-5, atol=1e-7)
    gmodel = build_gradient_model(lmodel, "loss", wrt)
    onnx.checker.check_model(gmodel, full_check=True)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"])
    for o, a, b in zip(gmodel.graph.output, run_engine(gmodel, feeds), sess.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-7, atol=1e-10, err_msg=o.name)
    return gmodel


def _i64(v: int) -> np.ndarray:
    return np.array(v, dtype=np.int64)


# (opset, input shape, dft_length, axis, attributes)
_DFT_FIXED = [
    (17, (2, 5, 1), 8, 1, {"onesided": 1}),  # Slice+Pad over all axes (Pad without axes)
    (17, (2, 6, 2), 4, 1, {"inverse": 1}),
    (17, (3, 4, 2, 2), 7, 1, {"inverse": 1, "onesided": 1}),  # constant IRFFT weights, non-last axis
    (17, (2, 3, 4, 1), None, -2, {}),
    (20, (3, 5, 4, 2), 3, 1, {}),
    (20, (2, 4, 2), None, -2, {"inverse": 1, "onesided": 1}),
    (20, (2, 5, 1), 8, 1, {"onesided": 1}),  # Pad with axes
]


@pytest.mark.parametrize("case", _DFT_FIXED, ids=lambda c: f"v{c[0]}-{c[1]}-{c[2]}-{c[4]}")
def test_dft_gradient_with_fixed_sizes(case) -> None:
    opset, shape, length, axis, attrs = case
    x = np.random.default_rng(0).uniform(-2, 2, shape)
    fixed = [None if length is None else _i64(length)]
    if opset >= 20:
        fixed.append(_i64(axis))
    else:
        attrs = {**attrs, "axis": axis}
    model, feeds = _model("DFT", x, fixed, opset, **attrs)
    gmodel = _check_gradient(model, feeds, ["x0"])
    # every size was fixed: the gradient graph computes none (no Shape-derived Gather, no CumSum)
    ops = {n.op_type for n in gmodel.graph.node}
    assert not ops & {"CumSum", "Gather", "Max"}, ops


@pytest.mark.parametrize("complex_signal", [False, True], ids=["real", "complex"])
def test_stft_gradient_with_fixed_sizes(complex_signal: bool) -> None:
    rng = np.random.default_rng(1)
    x = rng.uniform(-2, 2, (2, 13, 2 if complex_signal else 1))
    window = rng.uniform(0.5, 1.5, 5)
    model, feeds = _model("STFT", x, [_i64(3), window, _i64(5)], 17, feed_window=True,
                          onesided=0 if complex_signal else 1)
    gmodel = _check_gradient(model, feeds, ["x0", "x2"])
    assert "Range" not in {n.op_type for n in gmodel.graph.node}  # frame positions are a constant


def test_stft_of_a_rank_2_signal_is_a_real_signal() -> None:
    """torch exports ``torch.stft`` with a [batch, length] signal, which onnxruntime reads as real: the same
    values as the [batch, length, 1] form, and a gradient of that shape (central differences)."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-2, 2, (2, 13))
    window = rng.uniform(0.5, 1.5, 5)
    # onesided given: onnx's shape inference reads a missing one as 0, against its schema's default of 1
    flat, feeds = _model("STFT", x, [_i64(3), window, _i64(5)], 17, feed_window=True, onesided=1)
    real, feeds3 = _model("STFT", x[..., None], [_i64(3), window, _i64(5)], 17, feed_window=True, onesided=1)
    np.testing.assert_array_equal(run_engine(flat, feeds)[0], run_engine(real, feeds3)[0])
    _check_gradient(flat, feeds, ["x0", "x2"])
    x32, w32 = x.astype(np.float32), window.astype(np.float32)
    np.testing.assert_allclose(_run_op("STFT", [x32, _i64(3), w32], "ours"),
                               _run_op("STFT", [x32, _i64(3), w32], "onnxruntime"), rtol=1e-5, atol=1e-5)


def _run_op(op: str, inputs: list[np.ndarray], runner: str, **attrs: Any) -> np.ndarray:
    names = [f"x{i}" for i in range(len(inputs))]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs)]
    graph = helper.make_graph([helper.make_node(op, names, ["y"], **attrs)], op, g_in,
                              [helper.make_empty_tensor_value_info("y")])
    model = make_model(graph, 17)
    feeds = dict(zip(names, inputs))
    if runner == "ours":
        return run_engine(model, feeds)[0]
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)[0]


@pytest.mark.parametrize("periodic", [1, 0])
@pytest.mark.parametrize("size", [1, 6, 11])
def test_float32_windows_match_torch(size: int, periodic: int) -> None:
    # a periodic window of n points is the symmetric one of n + 1 without its last point (torch's periodic
    # windows are too, except that torch makes a one-point window 1 where the formula gives w(0))
    torch = pytest.importorskip("torch")
    n = size + periodic
    expected = {
        "HannWindow": torch.hann_window(n, periodic=False, dtype=torch.float64),
        "HammingWindow": torch.hamming_window(n, periodic=False, alpha=25 / 46, beta=21 / 46,
                                              dtype=torch.float64),
        "BlackmanWindow": torch.blackman_window(n, periodic=False, dtype=torch.float64),
    }
    for op, want in expected.items():
        got = _run_op(op, [_i64(size)], "ours", periodic=periodic)
        assert got.dtype == np.float32 and got.shape == (size,), op
        np.testing.assert_allclose(got, want.numpy()[:size], rtol=0, atol=1e-7, err_msg=op)


@pytest.mark.parametrize("config", [(8, 16, 8192, 0.0, 4096.0), (13, 400, 16000, 60.0, 7600.0),
                                    (5, 128, 44100, 300.0, 12000.0)], ids=str)
def test_mel_weight_matrix_matches_onnxruntime(config) -> None:
    n_mel, length, rate, lo, hi = config
    inputs = [_i64(n_mel), _i64(length), _i64(rate), np.array(lo, np.float32), np.array(hi, np.float32)]
    got = _run_op("MelWeightMatrix", inputs, "ours")
    want = _run_op("MelWeightMatrix", inputs, "ort")
    assert got.shape == want.shape == (length // 2 + 1, n_mel)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)


@pytest.mark.parametrize("onesided", [1, 0])
def test_stft_matches_torch(onesided: int) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(2)
    x, window = rng.uniform(-1, 1, (3, 40)), rng.uniform(0.5, 1.5, 12)
    got = _run_op("STFT", [x[..., None], _i64(5), window], "ours", onesided=onesided)
    spec = torch.stft(torch.from_numpy(x), n_fft=12, hop_length=5, window=torch.from_numpy(window),
                      center=False, onesided=bool(onesided), return_complex=True).transpose(1, 2).numpy()
    np.testing.assert_allclose(got, np.stack([spec.real, spec.imag], axis=-1), rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("op", ["HannWindow", "HammingWindow", "BlackmanWindow"])
@pytest.mark.parametrize("size, periodic", [(2, 1), (7, 0), (9, 0), (8, 1)])
def test_integer_windows_keep_their_peak(op: str, size: int, periodic: int) -> None:
    # the peak is exactly 1; computed as 1 - 1e-16 (Blackman), the cast to an integer type must not make it 0
    inputs = [_i64(size)]
    attrs = {"periodic": periodic, "output_datatype": TensorProto.INT32}
    got = _run_op(op, inputs, "ours", **attrs)
    want = _run_op(op, inputs, "onnxruntime", **attrs)
    assert got.dtype == want.dtype == np.int32
    np.testing.assert_array_equal(got, want)
