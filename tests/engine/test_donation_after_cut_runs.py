"""A training step whose end an exception cuts (one a signal handler raises: a SIGALRM-based timeout, say)
can leave the thread's donated slots set: the block that names them for the run never got to undo it (a
loop of steps under a SIGALRM handler that raises left them set 15 times in 100,000 interrupts). No later
run may take them for its own: they are slot numbers of another plan, and a run that did wrote its fused
elementwise results into the caller's input arrays."""

from __future__ import annotations

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import InferenceSession, TrainingSession
from onnxtrain.engine import donation
from tests.session.helpers import batches, mlp_model, params


class _Cut(Exception):
    """Stands for the exception of a signal handler that ran as a donating block was being left."""


def _elementwise_model(n: int = 6):
    """y<i> = tanh(2·x<i> + 1) − 1 for inputs x0 … x<n−1> of [512, 512] (past the size from which a fused
    step writes into a donated array): fused elementwise steps, each of which may write into its input, so
    the plan's low slot numbers are inputs it may reuse."""
    nodes = []
    for i in range(n):
        nodes += [helper.make_node("Mul", [f"x{i}", "two"], [f"a{i}"]),
                  helper.make_node("Add", [f"a{i}", "one"], [f"b{i}"]),
                  helper.make_node("Tanh", [f"b{i}"], [f"c{i}"]),
                  helper.make_node("Sub", [f"c{i}", "one"], [f"y{i}"])]
    consts = [numpy_helper.from_array(np.array(2, np.float32), "two"),
              numpy_helper.from_array(np.array(1, np.float32), "one")]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info(f"x{i}", TensorProto.FLOAT, [512, 512]) for i in range(n)],
        [helper.make_tensor_value_info(f"y{i}", TensorProto.FLOAT, [512, 512]) for i in range(n)], consts)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_run_after_a_cut_donating_step_leaves_its_inputs_alone(monkeypatch) -> None:
    real = donation.donating

    class CutOnExit:
        """The donating block, cut as it is left: the exception comes before the slots are set back."""

        def __init__(self, slots):
            self.inner = real(slots)

        def __enter__(self):
            return self.inner.__enter__()

        def __exit__(self, *exc):
            raise _Cut

    monkeypatch.setattr("onnxtrain.engine.plan.donating", CutOnExit)
    x, y = batches(1, 16)[0]
    sess = TrainingSession(mlp_model().SerializeToString(), params("AdamOptimizer"))
    cut = False
    try:
        sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    except Exception as e:  # noqa: BLE001 - the engine may wrap it
        cut = isinstance(e, _Cut) or isinstance(e.__cause__, _Cut)
    assert cut
    monkeypatch.setattr("onnxtrain.engine.plan.donating", real)

    left = donation.donated_now()
    assert left  # (what the cut leaves: the training plan's slots)

    inference = InferenceSession(_elementwise_model().SerializeToString())
    assert inference._plan._reusable & left  # (slots the stale set would hand it)
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": rng.standard_normal((512, 512)).astype(np.float32) for i in range(6)}
    kept = {k: v.copy() for k, v in feeds.items()}
    got = inference.run(None, feeds)
    for i, out in enumerate(got):
        np.testing.assert_array_equal(feeds[f"x{i}"], kept[f"x{i}"], err_msg=f"x{i}")
        want = np.tanh(kept[f"x{i}"].astype(np.float64) * 2 + 1) - 1
        np.testing.assert_allclose(out, want, rtol=1e-6, atol=1e-6)
