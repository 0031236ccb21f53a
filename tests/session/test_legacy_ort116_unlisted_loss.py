"""A loss that the model computes but does not list among its outputs (``loss_output_name`` names an inner
value): onnxruntime-training 1.16.3's legacy session kept it inside the training graph, so its
``get_outputs()`` and ``run(None)`` hold the model's own outputs and the ones the session adds
(``global_gradient_norm``, ``<w>_grad``), not the loss. A script that unpacks ``run(None)`` by position must
get the same list here. onnxtrain still lets a run fetch the loss by name (1.16.3 refused that: "Invalid
Output Name:loss"), an extension that changes no position.
"""

from __future__ import annotations

import json
import os
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


# ---- the sessions that cut the model (pipeline stages over mpiexec) ----------------------------------
STEPS = 3


def cut_parameters(ort):
    """SGD in two pipeline stages, cut after the MatMul (``a``)."""
    p = ort.TrainingParameters()
    for k, v in _params("SGDOptimizer").items():
        setattr(p, k, v)
    p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, "a"
    return p


def run_steps(ort, p, steps: int) -> dict:
    """The session's class and output names; per step run(None)'s values, then run(["loss", "yo"])'s."""
    s = ort.TrainingSession(_model().SerializeToString(), p)
    runs = []
    for k in range(steps):
        f = _feeds(k, True)
        runs.append([[np.asarray(v).tolist() for v in s.run(None, f)],
                     [np.asarray(v).tolist() for v in s.run(["loss", "yo"], f)]])
    return {"class": type(s).__name__, "outputs": [o.name for o in s.get_outputs()], "runs": runs}


def test_pipeline_stages_list_the_outputs_of_one_process() -> None:
    """The two-stage pipeline session gives get_outputs(), run(None) and the loss fetched by name as the
    single-process session (checked against 1.16.3 above) gives them; it listed the loss too before."""
    import shutil

    import onnxtrain
    from tests.parallel.conftest import run_mpi

    if shutil.which("mpiexec") is None:
        pytest.skip("no mpiexec")
    worker = os.path.join(os.path.dirname(os.path.abspath(__file__)), "unlisted_loss_cut_worker.py")
    r = run_mpi(n=2, worker=worker)
    assert r.returncode == 0, r.stderr[-3000:]
    cut = json.loads(r.stdout.strip().splitlines()[-1])
    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer").items():
        setattr(p, k, v)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        one = run_steps(onnxtrain, p, STEPS)
    assert cut["class"] == "PipelineTrainingSession"
    assert cut["outputs"] == one["outputs"] == ["yo", "global_gradient_norm"], (cut, one["outputs"])
    for k, (c, o) in enumerate(zip(cut["runs"], one["runs"])):
        for which in range(2):
            assert len(c[which]) == len(o[which]), (k, which)
            for a, b in zip(c[which], o[which]):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"step {k}")


_DUMPS = ("model_after_graph_transforms_path", "model_with_gradient_graph_path",
          "model_with_training_graph_path")
_PEER_DUMPS = "names = " + repr(_DUMPS) + r"""
import json, sys
import onnx, onnxruntime as ort
ort.set_default_logger_severity(3)
model, folder = sys.argv[1], sys.argv[2]
p = ort.TrainingParameters()
p.loss_output_name, p.training_optimizer_name = "loss", "SGDOptimizer"
p.optimizer_attributes_map = {"W": {}, "G": {}}
p.optimizer_int_attributes_map = {"W": {}, "G": {}}
for k in names:
    setattr(p, k, folder + "/peer_" + k + ".onnx")
ort.TrainingSession(model, p, None, ["CPUExecutionProvider"])
outputs = {k: [o.name for o in onnx.load(folder + "/peer_" + k + ".onnx").graph.output] for k in names}
print(json.dumps(outputs))
"""


def test_dumped_training_graph_leads_with_the_session_outputs(tmp_path) -> None:
    """The three dumps: 1.16.3's outputs (it writes no loss the model does not list) are onnxtrain's outputs
    that the session lists, in order, and the training graph's dump begins with the session's outputs (as for
    a listed loss, test_legacy_ort116_surface.test_dumped_graphs); the loss the engine computes comes last."""
    import onnxtrain
    from tests.ortt import ensure_ort_legacy, run_script

    path = str(tmp_path / "m.onnx")
    onnx.save(_model(), path)
    peer = run_script(_PEER_DUMPS, path, str(tmp_path), python=ensure_ort_legacy())
    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer").items():
        setattr(p, k, v)
    for k in _DUMPS:
        setattr(p, k, str(tmp_path / f"ours_{k}.onnx"))
    s = onnxtrain.TrainingSession(path, p)
    listed = [o.name for o in s.get_outputs()]
    for k in _DUMPS:
        ours = [o.name for o in onnx.load(str(tmp_path / f"ours_{k}.onnx")).graph.output]
        assert [n for n in peer[k] if not n.endswith("_grad")] == [n for n in ours if n in listed], (k, ours)
        assert "loss" not in ours[:-1], (k, ours)  # (the transformed model has none)
    ours = [o.name for o in onnx.load(str(tmp_path / f"ours_{_DUMPS[2]}.onnx")).graph.output]
    assert ours[:len(listed)] == listed == peer[_DUMPS[2]], (ours, listed, peer)


def test_a_bad_output_name_beside_the_loss_is_named_in_the_callers_list() -> None:
    """run(["loss", 3]) is refused as run(["yo", 3]) is (InvalidFeedType), naming the list the caller gave,
    not the list with the loss taken out."""
    import onnxtrain
    from onnxtrain.errors import InvalidFeedType

    p = onnxtrain.TrainingParameters()
    for k, v in _params("SGDOptimizer").items():
        setattr(p, k, v)
    s = onnxtrain.TrainingSession(_model().SerializeToString(), p, None, ["CPUExecutionProvider"])
    f = _feeds(0, True)
    with pytest.raises(InvalidFeedType, match=r"in \['yo', 3\]"):  # (the listed output: the base class's)
        s.run(["yo", 3], f)
    with pytest.raises(InvalidFeedType, match=r"got int 3 in \['loss', 3\]"):
        s.run(["loss", 3], f)
    np.testing.assert_array_equal(s.get_state()["W"], numpy_helper.to_array(_model().graph.initializer[0]))
