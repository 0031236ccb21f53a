"""One BatchNorm layer applied twice in a forward (a shared encoder): torch updates its running statistics
once per application, the second from the first's result. torch's dynamo export writes the second
application reading the initial statistics through Identity nodes; onnxtrain gave each application a copy
of its own and wrote none back (the state kept its initial statistics). Now the applications are chained
and the last one's statistics are the layer's, in the on-device Module and the legacy TrainingSession.
Oracle: torch's nn.BatchNorm1d applied twice (its running mean; the variance in ONNX's biased form)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer

torch = pytest.importorskip("torch")
F = TensorProto.FLOAT
RNG = np.random.default_rng(0)
A = RNG.standard_normal((8, 3)).astype(np.float32)
B = (RNG.standard_normal((8, 3)) * 3 + 2).astype(np.float32)


def _model() -> onnx.ModelProto:
    """loss = Σ (BN(a) − BN(b))², one BN (momentum 0.9: torch's 0.1) read as the dynamo export writes it."""
    inits = [numpy_helper.from_array(np.ones(3, np.float32), "bn.weight"),
             numpy_helper.from_array(np.zeros(3, np.float32), "bn.bias"),
             numpy_helper.from_array(np.zeros(3, np.float32), "bn.running_mean"),
             numpy_helper.from_array(np.ones(3, np.float32), "bn.running_var")]
    nodes = [helper.make_node("BatchNormalization", ["a", "bn.weight", "bn.bias", "bn.running_mean",
                                                     "bn.running_var"], ["na"], momentum=0.9),
             helper.make_node("Identity", ["bn.running_mean"], ["getitem_3"]),
             helper.make_node("Identity", ["bn.running_var"], ["getitem_4"]),
             helper.make_node("BatchNormalization", ["b", "bn.weight", "bn.bias", "getitem_3", "getitem_4"],
                              ["nb"], momentum=0.9),
             helper.make_node("Sub", ["na", "nb"], ["d"]), helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceSum", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, F, ["N", 3]) for n in ("a", "b")],
                          [helper.make_tensor_value_info("loss", F, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def _torch_statistics(steps: int) -> tuple[np.ndarray, np.ndarray]:
    bn = torch.nn.BatchNorm1d(3, momentum=0.1).train()
    var = np.ones(3)
    for _ in range(steps):
        for x in (A, B):
            bn(torch.tensor(x))
            var = 0.9 * var + 0.1 * x.astype(np.float64).var(axis=0)  # ONNX's biased batch variance
    return bn.running_mean.numpy(), var


def test_a_layer_applied_twice_updates_its_statistics_twice_on_device(tmp_path) -> None:
    artifacts.generate_artifacts(_model(), requires_grad=["bn.weight", "bn.bias"],
                                 frozen_params=["bn.running_mean", "bn.running_var"],
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    onnx.checker.check_model(onnx.load(tmp_path / "training_model.onnx"), full_check=True)
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.0)
    for _ in range(3):
        module(A, B)
        opt.step()
        module.lazy_reset_grad()
    mean, var = _torch_statistics(3)
    np.testing.assert_allclose(state.parameters["bn.running_mean"].data, mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.parameters["bn.running_var"].data, var, rtol=1e-5)


def test_a_layer_applied_twice_updates_its_statistics_twice_in_a_legacy_session() -> None:
    p = onnxtrain.TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = onnxtrain.TrainingSession(_model().SerializeToString(), p)
    for _ in range(2):
        sess.run(["loss"], {"a": A, "b": B, "Learning_Rate": np.array([0.0], np.float32)})
    mean, var = _torch_statistics(2)
    state = sess.get_state()
    np.testing.assert_allclose(state["bn.running_mean"], mean, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state["bn.running_var"], var, rtol=1e-5)
