"""Review F: the inference session's surface against onnxruntime 1.32's, under awkward use (session options
that change what a run computes, runs while other threads are alive)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain

F = TensorProto.FLOAT


def _product_model() -> bytes:
    """c = a · b, elementwise, of three floats."""
    g = helper.make_graph([helper.make_node("Mul", ["a", "b"], ["c"])], "g",
                          [helper.make_tensor_value_info("a", F, [3]),
                           helper.make_tensor_value_info("b", F, [3])],
                          [helper.make_tensor_value_info("c", F, [3])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


# subnormal float32 results: 1e-39 · 1, 1e-20 · 1e-20 (1e-40), 1 · 1e-39
_A = [1e-39, 1e-20, 1.0]
_B = [1.0, 1e-20, 1e-39]

_ORT_FLUSHES = textwrap.dedent("""
    import sys, numpy as np, onnxruntime as ort
    so = ort.SessionOptions()
    so.add_session_config_entry("session.set_denormal_as_zero", "1")
    s = ort.InferenceSession(sys.stdin.buffer.read(), so, providers=["CPUExecutionProvider"])
    c, = s.run(None, {"a": np.array(%r, np.float32), "b": np.array(%r, np.float32)})
    print(c.tolist())
""") % (_A, _B)


def test_set_denormal_as_zero_is_not_silently_ignored() -> None:
    """onnxruntime's session config entry ``session.set_denormal_as_zero = "1"`` flushes subnormal floats to
    zero (the oracle, in a process of its own: it sets the calling thread's FTZ/DAZ flags, which would reach
    the other tests' numpy); the numpy engine keeps them, as IEEE does. The session took the entry without a
    word and returned other values than onnxruntime's: it now warns, naming the entry."""
    model = _product_model()
    ort_out = subprocess.run([sys.executable, "-c", _ORT_FLUSHES], input=model, capture_output=True,
                             check=True, timeout=60).stdout.decode()
    assert eval(ort_out) == [0.0, 0.0, 0.0]  # noqa: S307 - a list of floats printed by the oracle
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "1")
    with pytest.warns(UserWarning, match=r"session\.set_denormal_as_zero"):
        sess = onnxtrain.InferenceSession(model, options)
    c, = sess.run(None, {"a": np.array(_A, np.float32), "b": np.array(_B, np.float32)})
    np.testing.assert_array_equal(c, np.array(_A, np.float32) * np.array(_B, np.float32))
    assert (c > 0).all()  # the subnormals kept: what the warning says
    # "0" (onnxruntime's default) asks for nothing: no warning
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("session.set_denormal_as_zero", "0")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        onnxtrain.InferenceSession(model, options)


def _wide_product_model(width: int) -> bytes:
    """y = (tanh(x) · x) @ W of x [batch, width], W [width, 2]: the batch split's kind of model (activations
    well above its 1 MiB and twice the weights at batch 2), whose product of one row (each half's) rounds
    otherwise than the product of two."""
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((width, 2)).astype(np.float32), "W")
    g = helper.make_graph(
        [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "x"], ["u"]),
         helper.make_node("MatMul", ["u", "W"], ["y"])], "g",
        [helper.make_tensor_value_info("x", F, ["batch", width])],
        [helper.make_tensor_value_info("y", F, ["batch", 2])], [w])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


@pytest.mark.xfail(strict=True, reason=(
    "onnxtrain/engine/batch_split.py: BatchSplitter.run answers a batch size whose halves were checked with "
    "the halves (their bits), but runs the whole batch instead whenever can_pin_blas_threads() is False, "
    "i.e. whenever any other Python thread is alive (a second thread calling run, a logger's, a server's): "
    "the same feeds then give other bits (here about 4e-3 on values of about 800). Fix: answer a checked "
    "size with its halves whatever the threads (one after the other on the caller's thread when BLAS cannot "
    "be pinned), or never split a size whose halves' bits differ from the whole run's"))
def test_a_split_batch_gives_the_same_bits_while_another_thread_is_alive() -> None:
    """onnxruntime gives the same bits for the same feeds, whatever other threads the process runs (and its
    sessions allow concurrent runs). The batch split gives the halves' bits, or the whole batch's when
    another Python thread is alive: two runs of one session on one feed differ."""
    model = _wide_product_model(1 << 18)
    sess = onnxtrain.InferenceSession(model)
    if sess._splitter is None:
        pytest.skip("the batch split is off here (one thread, or no OpenBLAS)")
    x = np.random.default_rng(1).standard_normal((2, 1 << 18)).astype(np.float32)
    split, = sess.run(None, {"x": x})  # (the first run checks the halves and answers with them)
    again, = sess.run(None, {"x": x})
    if not sess._splitter.split_runs:
        pytest.skip("the halves of this batch were not taken here")
    options = onnxtrain.SessionOptions()
    options.add_session_config_entry("onnxtrain.batch_split", "0")
    whole, = onnxtrain.InferenceSession(model, options).run(None, {"x": x})
    if np.array_equal(whole, split):
        pytest.skip("the halves round as the whole batch here: nothing to tell apart")
    np.testing.assert_array_equal(again, split)
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:
        meanwhile, = sess.run(None, {"x": x})
    finally:
        idle.set()
        other.join()
    np.testing.assert_allclose(meanwhile, split, rtol=1e-4, atol=1e-4 * float(np.abs(split).max()))
    np.testing.assert_array_equal(meanwhile, split)
