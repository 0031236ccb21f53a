"""The numpy engine's two-graph legacy step (``session_halves``: 16 or more small weights merge) over a model
with a Dropout, in runs of which one feeds a trained weight (that run takes the single step graph): each run's
mask, loss and the trained state are those of a session whose every step is the single graph, bit for bit.
The Dropout's draws go on from run to run across the two plans (no mask repeats when the run after the fed
one goes back to the halves), seeded or not (``set_seed`` before each session)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

import onnxtrain
from onnxtrain import session_halves, set_seed
from tests.session.helpers import params
from tests.session.test_flat_legacy_update import _deep_feeds, _deep_mlp

FED_RUN = 2  # the run that feeds W0
FETCH = ["loss", "mask", "dropped"]


def _with_dropout(seed: int | None, outputs: bool = True) -> onnx.ModelProto:
    """The 18-weight deep MLP with Dropout(ratio 0.5, training on) after its fourth ReLU; with ``outputs``,
    the Dropout's output and mask are graph outputs too."""
    m = _deep_mlp(8)
    g = m.graph
    k = next(i for i, n in enumerate(g.node) if n.op_type == "Relu" and n.output[0] == "r3")
    g.node[k + 1].input[0] = "dropped"
    attrs = {} if seed is None else {"seed": seed}
    g.node.insert(k + 1, helper.make_node("Dropout", ["r3", "ratio", "on"], ["dropped", "mask"],
                                          name="drop", **attrs))
    g.initializer.extend([numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                          numpy_helper.from_array(np.array(True), "on")])
    if outputs:
        g.output.extend([helper.make_tensor_value_info("mask", T.BOOL, ["N", 6]),
                         helper.make_tensor_value_info("dropped", T.FLOAT, ["N", 6])])
    onnx.checker.check_model(m, full_check=True)
    return m


def _session(model: onnx.ModelProto) -> onnxtrain.TrainingSession:
    set_seed(11)  # (an unseeded Dropout draws from the session's seed)
    p = params("AdamOptimizer", enable_grad_norm_clip=False)
    return onnxtrain.TrainingSession(model.SerializeToString(), p)


def _runs(sess: onnxtrain.TrainingSession, n: int, fetch: list[str]) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(3)
    out = []
    for i in range(n):
        feeds = _deep_feeds(rng)
        if i == FED_RUN:
            feeds["W0"] = np.full((6, 6), 0.25, np.float32)
        out.append(sess.run(fetch, feeds))
    return out


@pytest.mark.parametrize("seed", [7, None], ids=["seeded", "unseeded"])
def test_halves_with_a_dropout_and_a_fed_weight_run_as_the_single_graph(monkeypatch, seed) -> None:
    model = _with_dropout(seed)
    halves = _session(model)
    assert halves._halves and [len(g.weights) for g in halves._flat.groups] == [18]
    assert "W0" in halves._fed_weights
    got = _runs(halves, 6, FETCH)
    assert "full" in halves._plans and "gradients" in halves._plans  # the fed run took the single graph
    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 1000)
    single = _session(model)
    assert not single._halves
    want = _runs(single, 6, FETCH)
    for i, (a, b) in enumerate(zip(got, want)):
        for name, x, y in zip(["loss", "mask", "dropped"], a, b):
            np.testing.assert_array_equal(x, y, err_msg=f"run {i}: {name}")
    state, ref = halves.get_state(), single.get_state()
    assert state.keys() == ref.keys()
    for k in state:
        np.testing.assert_array_equal(state[k], ref[k], err_msg=k)
    masks = [r[1] for r in got]
    for i in range(len(masks)):  # the draws go on: no run repeats an earlier run's mask
        assert 0.2 < masks[i].mean() < 0.8
        for j in range(i):
            assert not np.array_equal(masks[i], masks[j]), (i, j)
    # the mask's kept values are scaled by 1 / (1 - ratio), the dropped ones 0 (as onnx.reference's)
    for r in got:
        assert np.all(r[2][~r[1]] == 0)


@pytest.mark.parametrize("seed", [7, None], ids=["seeded", "unseeded"])
def test_without_the_mask_as_an_output(monkeypatch, seed) -> None:
    """The model as a user exports it (the loss its only output): the same losses and state."""
    model = _with_dropout(seed, outputs=False)
    halves = _session(model)
    assert halves._halves
    got = _runs(halves, 6, ["loss"])
    monkeypatch.setattr(session_halves, "NUMPY_MIN_MERGED", 1000)
    single = _session(model)
    assert not single._halves
    want = _runs(single, 6, ["loss"])
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a[0], b[0], err_msg=f"run {i}")
    state, ref = halves.get_state(), single.get_state()
    for k in ref:
        np.testing.assert_array_equal(state[k], ref[k], err_msg=k)
