"""Training-mode BatchNormalization of opsets 9-13 (five outputs, as torch's training exports write them)
trains in a legacy session as torch trains the module, running statistics included."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain import TrainingParameters, TrainingSession
from onnxtrain.autodiff.builder import GradientError

torch = pytest.importorskip("torch")

LR = 0.1


class Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = torch.nn.Linear(4, 3)
        self.bn = torch.nn.BatchNorm1d(3)

    def forward(self, x, y):
        return ((self.bn(self.fc(x)) - y) ** 2).mean()


def _export(net: torch.nn.Module, opset: int) -> bytes:
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(net, (torch.randn(5, 4), torch.randn(5, 3)), f, input_names=["x", "y"],
                          output_names=["loss"], opset_version=opset, dynamo=False,
                          training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
    return f.getvalue()


@pytest.mark.parametrize("opset", [9, 12, 13])
def test_five_output_batchnorm_trains_as_torch(opset: int) -> None:
    torch.manual_seed(0)
    net = Net().train()
    data = _export(net, opset)
    model = onnx.load_from_string(data)
    bn = [n for n in model.graph.node if n.op_type == "BatchNormalization"]
    assert len(bn) == 1 and len(bn[0].output) == 5  # the form the converter refuses
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "SGDOptimizer"
    sess = TrainingSession(data, p)
    opt = torch.optim.SGD(net.parameters(), lr=LR)
    rng = np.random.default_rng(opset)
    # ONNX's update uses the batch's biased variance, torch's the unbiased one (from the exported value: the
    # export's trace ran the module once in training mode)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    running_var = init["bn.running_var"].astype(np.float64)
    for _ in range(4):
        x = rng.standard_normal((5, 4)).astype(np.float32)
        y = rng.standard_normal((5, 3)).astype(np.float32)
        ours = sess.run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([LR], np.float32)})[0]
        with torch.no_grad():
            z = net.fc(torch.from_numpy(x)).double().numpy()
        running_var = 0.9 * running_var + 0.1 * z.var(axis=0)
        opt.zero_grad()
        theirs = net(torch.from_numpy(x), torch.from_numpy(y))
        theirs.backward()
        opt.step()
        np.testing.assert_allclose(ours, theirs.item(), rtol=1e-5)
    state = sess.get_state()
    for name, value in net.state_dict().items():
        if name not in ("bn.num_batches_tracked", "bn.running_var"):
            np.testing.assert_allclose(state[name], value.numpy(), rtol=1e-5, atol=1e-6, err_msg=name)
    np.testing.assert_allclose(state["bn.running_var"], running_var, rtol=1e-5)
    assert np.any(state["bn.running_mean"] != 0)


def test_saved_statistics_that_are_read_are_an_error_naming_the_node() -> None:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])
    outs = [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
            helper.make_tensor_value_info("saved", TensorProto.FLOAT, [3])]
    inits = [numpy_helper.from_array(np.full(3, v, np.float32), n)
             for n, v in (("s", 1.0), ("b", 0.0), ("m", 0.0), ("v", 1.0))]
    nodes = [helper.make_node("BatchNormalization", ["x", "s", "b", "m", "v"], ["y", "m2", "v2", "sm", "sv"],
                              name="bn0"),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0),
             helper.make_node("Identity", ["sm"], ["saved"])]
    model = helper.make_model(helper.make_graph(nodes, "g", [x], outs, inits),
                              opset_imports=[helper.make_opsetid("", 12)])
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.weights_to_train = {"s", "b"}
    with pytest.raises(GradientError, match="'bn0'.*saved statistics"):
        TrainingSession(model.SerializeToString(), p)


@pytest.mark.parametrize("opset", [11, 13])
def test_gradient_graph_of_a_five_output_batchnorm_is_in_training_mode(opset: int) -> None:
    """build_gradient_model (GradientGraphBuilder's core) on the same exports: the upgraded node keeps the
    training mode its statistics outputs meant (training_mode=1), so the graph passes the checker and
    normalises with the batch's statistics, as torch's module in training mode."""
    from onnxtrain.autodiff import build_gradient_model
    from onnxtrain.engine import compile_model

    torch.manual_seed(1)
    net = Net().train()
    before = {k: v.clone() for k, v in net.state_dict().items()}
    data = _export(net, opset)
    net.load_state_dict(before)  # the export's trace updated the running statistics
    g = build_gradient_model(onnx.load_from_string(data), "loss", ["bn.weight", "fc.weight", "x"])
    onnx.checker.check_model(g, full_check=True)
    bn = [n for n in g.graph.node if n.op_type == "BatchNormalization"]
    assert [a.i for n in bn for a in n.attribute if a.name == "training_mode"] == [1]
    rng = np.random.default_rng(opset)
    x = rng.standard_normal((5, 4)).astype(np.float32)
    y = rng.standard_normal((5, 3)).astype(np.float32)
    out = dict(zip([o.name for o in g.graph.output], compile_model(g).run({"x": x, "y": y})))
    xt = torch.from_numpy(x).requires_grad_(True)
    loss = net(xt, torch.from_numpy(y))
    loss.backward()
    np.testing.assert_allclose(out["loss"], loss.item(), rtol=1e-5)
    for name, want in (("bn.weight", net.bn.weight.grad), ("fc.weight", net.fc.weight.grad), ("x", xt.grad)):
        np.testing.assert_allclose(out[f"{name}_grad"], want.numpy(), rtol=1e-4, atol=1e-6, err_msg=name)
