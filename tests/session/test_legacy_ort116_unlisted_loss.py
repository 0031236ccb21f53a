"""A loss that the model computes but does not list among its outputs (``loss_output_name`` names an inner
value): onnxruntime-training 1.16.3's legacy session kept it inside the training graph, so its
``get_outputs()`` and ``run(None)`` hold the model's own outputs and the ones the session adds
(``global_gradient_norm``, ``<w>_grad``), not the loss. A script that unpacks ``run(None)`` by position must
get the same list here. onnxtrain still lets a run fetch the loss by name (1.16.3 refused that: "Invalid
Output Name:loss"), an extension that changes no position.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.session.legacy_peer import Case, Step, run_cases

N, D = 3, 12
LR = 0.1


def _model() -> onnx.ModelProto:
    """x[N, D] → MatMul W → Add G = y; outputs: yo = Identity(y) only; loss = mean((y - t)^2), not an
    output. W and G have more than 8 values (1.16.3's ConstantSharing renames smaller ones)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((D, D)) * 0.3).astype(np.float32), "W"),
             numpy_helper.from_array((rng.standard_normal(D) * 0.3).astype(np.float32), "G")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["a"]), helper.make_node("Add", ["a", "G"], ["y"]),
             helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0),
             helper.make_node("Identity", ["y"], ["yo"])]
    g = helper.make_graph(nodes, "unlisted_loss",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [N, D]),
                           helper.make_tensor_value_info("t", TensorProto.FLOAT, [N, D])],
                          [helper.make_tensor_value_info("yo", TensorProto.FLOAT, [N, D])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    return m


def _feeds(k: int, lr: bool) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(10 + k)
    f = {n: rng.standard_normal((N, D)).astype(np.float32) for n in ("x", "t")}
    if lr:
        f["Learning_Rate"] = np.array([LR], np.float32)
    return f


def _params(opt: str, **kw) -> dict:
    p = {"loss_output_name": "loss", "training_optimizer_name": opt}
    if opt:
        p["optimizer_attributes_map"] = {"W": {}, "G": {}}
        p["optimizer_int_attributes_map"] = {"W": {}, "G": {}}
    p.update(kw)
    return p


CASES = {
    "sgd": ("SGDOptimizer", {}),
    "adam": ("AdamOptimizer", {}),
    "sgd_no_norm": ("SGDOptimizer", {"enable_grad_norm_clip": False}),
    "sgd_gradients_out": ("SGDOptimizer", {"set_gradients_as_graph_outputs": True}),
    "no_optimizer_gradients_out": ("", {"set_gradients_as_graph_outputs": True}),
}


@pytest.fixture(scope="module")
def traces():
    cases = []
    for opt, kw in CASES.values():
        ours = {"legacy_cpu_adam": True} if opt == "AdamOptimizer" else {}
        steps = [Step(_feeds(k, bool(opt))) for k in range(3)]
        cases.append(Case(_model(), _params(opt, **kw), steps, ours=ours))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        peer, ours = run_cases(cases)
    return dict(zip(CASES, zip(peer, ours)))


def _order(names: list[str]) -> tuple[list[str], set[str]]:
    """Names but the gradients, in order, and the gradients as a set (1.16.3 lists them in a C++
    unordered_set's order, onnxtrain sorted: README)."""
    return [n for n in names if not n.endswith("_grad")], {n for n in names if n.endswith("_grad")}


@pytest.mark.parametrize("name", list(CASES))
def test_outputs_leave_out_an_unlisted_loss_as_116_does(traces, name: str) -> None:
    peer, ours = traces[name]
    assert peer.error is None, peer.error
    assert ours.error is None, ours.error
    assert "loss" not in peer.output_names, peer.output_names
    assert _order(ours.output_names) == _order(peer.output_names), (ours.output_names, peer.output_names)
    for k in range(len(peer.outputs)):  # (every output fetched by name, then the trained state)
        assert set(ours.outputs[k]) == set(peer.outputs[k])
        for n, v in peer.outputs[k].items():
            np.testing.assert_allclose(ours.outputs[k][n], v, rtol=2e-5, atol=2e-6, err_msg=f"step {k} {n}")
        for n, v in peer.state[k].items():
            np.testing.assert_allclose(ours.state[k][n], v, rtol=2e-5, atol=2e-6, err_msg=f"step {k} {n}")


def _loss64(w: np.ndarray, g: np.ndarray, f: dict[str, np.ndarray]) -> float:
    y = f["x"].astype(np.float64) @ w.astype(np.float64) + g.astype(np.float64)
    return float(np.mean((y - f["t"].astype(np.float64)) ** 2))


def test_run_none_unpacks_by_position_and_the_loss_is_still_fetched_by_name() -> None:
    """``run(None)`` gives get_outputs()' values in their order (yo, global_gradient_norm); ``run(["loss"])``
    gives the loss of the weights before the step (float64 numpy)."""
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer").items():
        setattr(p, k, v)
    s = onnxtrain.TrainingSession(_model().SerializeToString(), p, None, ["CPUExecutionProvider"])
    assert [o.name for o in s.get_outputs()] == ["yo", "global_gradient_norm"]
    f = _feeds(0, True)
    st = s.get_state()
    yo, norm = s.run(None, f)  # the unpacking a 1.16.3 script does
    np.testing.assert_allclose(yo, f["x"] @ st["W"] + st["G"], rtol=1e-5, atol=1e-6)
    assert np.ndim(norm) == 0
    st = s.get_state()
    (loss,) = s.run(["loss"], f)
    np.testing.assert_allclose(float(loss), _loss64(st["W"], st["G"], f), rtol=1e-5)
    assert len(s.run([], f)) == 2  # (an empty list: every listed output, as None)
