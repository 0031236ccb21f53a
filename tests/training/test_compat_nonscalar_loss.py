"""A loss of more than one element (``reduction="none"``, a custom block, no loss at all) trains with the
gradient of the sum of its elements, and the Module returns the loss with its shape.

onnxruntime-training 1.19.2 seeds the backward pass of any loss with a 0-d 1.0. For elementwise losses
that broadcasts to the gradient of the sum (a custom squared-error block: same loss and gradients as
onnxtrain, checked below). Its ``SoftmaxCrossEntropyLossGrad`` with ``reduction="none"`` however reads
that seed as per-sample weights, so its CrossEntropyLoss(reduction="none") gradient is the first sample's
or garbage, depending on the memory after the seed (a bug, not compared); and its MSE/L1/BCE losses
refuse ``reduction="none"`` at construction (a TypeError from a wrong ``keepdims`` argument, another
bug). onnxtrain gives all of them the gradient of the sum, the oracle being torch's
``loss.sum().backward()`` in float64.
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")
F = torch.nn.functional

PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


def mlp() -> onnx.ModelProto:
    """input-0 [batch, 8] -> Gemm(6) -> Relu -> Gemm(4) = output-0, float32 (torch's Linear layout)."""
    rng = np.random.default_rng(0)
    shapes = {"fc1.weight": (6, 8), "fc1.bias": (6,), "fc2.weight": (4, 6), "fc2.bias": (4,)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in shapes.items()]
    nodes = [helper.make_node("Gemm", ["input-0", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["output-0"], transB=1)]
    x = helper.make_tensor_value_info("input-0", TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("output-0", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph(nodes, "mlp", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1)
    return {"x": rng.standard_normal((5, 8)).astype(np.float32),
            "labels": np.array([0, 3, 1, 3, 2], np.int64),
            "target": rng.standard_normal((5, 4)).astype(np.float32),
            "binary": (rng.random((5, 4)) > 0.5).astype(np.float32)}


class SquaredError(onnxblock.Block):
    """``(output - target)²`` per element: a custom loss with no reduction."""

    def __init__(self) -> None:
        super().__init__()
        self.sub, self.mul = onnxblock.blocks.Sub(), onnxblock.blocks.Mul()
        self.target = onnxblock.blocks.InputLike("output-0")

    def build(self, output_name: str) -> str:
        d = self.sub(output_name, self.target("target"))
        return self.mul(d, d)


# name: (loss block, target key, torch loss of (output, target))
CASES = {
    "ce_none": (lambda: onnxblock.loss.CrossEntropyLoss(reduction="none"), "labels",
                lambda o, t: F.cross_entropy(o, t, reduction="none")),
    "mse_none": (lambda: onnxblock.loss.MSELoss(reduction="none"), "target", lambda o, t: (o - t) ** 2),
    "l1_none": (lambda: onnxblock.loss.L1Loss(reduction="none"), "target", lambda o, t: (o - t).abs()),
    "bce_none": (lambda: onnxblock.loss.BCEWithLogitsLoss(reduction="none"), "binary",
                 lambda o, t: F.binary_cross_entropy_with_logits(o, t, reduction="none")),
    "custom": (SquaredError, "target", lambda o, t: (o - t) ** 2),
    "no_loss": (lambda: None, None, lambda o, t: o),
}


def torch_reference(case: str) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """(the loss per element, the gradients of its sum) in float64."""
    w = {i.name: torch.tensor(numpy_helper.to_array(i), dtype=torch.float64, requires_grad=True)
         for i in mlp().graph.initializer}
    d = data()
    h = torch.relu(torch.tensor(d["x"], dtype=torch.float64) @ w["fc1.weight"].T + w["fc1.bias"])
    out = h @ w["fc2.weight"].T + w["fc2.bias"]
    key = CASES[case][1]
    t = None if key is None else torch.tensor(d[key], dtype=torch.int64 if key == "labels" else torch.float64)
    loss = CASES[case][2](out, t)
    loss.sum().backward()
    return loss.detach().numpy(), {n: v.grad.numpy() for n, v in w.items()}


def train_once(case: str, folder) -> tuple[np.ndarray, np.ndarray, CheckpointState]:
    """Generate the case's artifacts in ``folder``; (training loss, eval loss, state after one step)."""
    artifacts.generate_artifacts(mlp(), requires_grad=PARAMS, loss=CASES[case][0](),
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"))
    d, key = data(), CASES[case][1]
    inputs = [d["x"]] if key is None else [d["x"], d[key]]
    loss = module(*inputs)
    return loss, module.eval()(*inputs), state


@pytest.mark.parametrize("case", [c for c in CASES if c != "no_loss"])
def test_nonscalar_loss_trains_with_gradient_of_its_sum(case, tmp_path):
    loss, eval_loss, state = train_once(case, str(tmp_path))
    ref_loss, ref_grads = torch_reference(case)
    assert loss.shape == eval_loss.shape == ref_loss.shape  # the Module returns the loss unreduced
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(eval_loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p in PARAMS:
        np.testing.assert_allclose(state.parameters[p].grad, ref_grads[p], rtol=1e-5, atol=1e-6, err_msg=p)


def test_model_output_without_loss_warns_and_trains_with_gradient_of_its_sum(tmp_path):
    with pytest.warns(UserWarning, match=r"'output-0' has shape \['batch', 4\].*sum of its elements"):
        loss, _, state = train_once("no_loss", str(tmp_path))
    ref_loss, ref_grads = torch_reference("no_loss")
    np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-6)
    for p in PARAMS:
        np.testing.assert_allclose(state.parameters[p].grad, ref_grads[p], rtol=1e-5, atol=1e-6, err_msg=p)


def test_training_block_with_nonscalar_loss():
    class Block(onnxblock.TrainingBlock):
        def __init__(self) -> None:
            super().__init__()
            self.loss = onnxblock.loss.CrossEntropyLoss(reduction="none")

        def build(self, output_name: str) -> str:
            return self.loss(output_name)

    block = Block()
    for p in PARAMS:
        block.requires_grad(p)
    with onnxblock.base(mlp()):
        block("output-0")
    training, _ = block.to_model_proto()
    loss = training.graph.output[0]
    assert [d.dim_param or d.dim_value for d in loss.type.tensor_type.shape.dim] == ["batch"]
    assert [o.name for o in training.graph.output[1:]] == [p + "_grad.accumulation.out" for p in PARAMS]


_ORT_SCRIPT = PREAMBLE + r"""
import copy, os
import numpy as np
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState, Module

base, folder, data = sys.argv[1:4]
net = onnx.load(base)
net.ir_version = 10
d = np.load(data)
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]

class SquaredError(onnxblock.Block):
    def __init__(self):
        super().__init__()
        self.sub, self.mul = onnxblock.blocks.Sub(), onnxblock.blocks.Mul()
        self.target = onnxblock.blocks.InputLike("output-0")
    def build(self, output_name):
        t = self.target("target")
        return self.mul(self.sub(output_name, t), self.sub(output_name, t))

res = {}
for name, loss, key in (("custom", SquaredError(), "target"),
                        ("ce_none", onnxblock.loss.CrossEntropyLoss(reduction="none"), "labels")):
    out = os.path.join(folder, name)
    os.makedirs(out)
    artifacts.generate_artifacts(copy.deepcopy(net), requires_grad=PARAMS, loss=loss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=out)
    state = CheckpointState.load_checkpoint(os.path.join(out, "checkpoint"))
    m = Module(os.path.join(out, "training_model.onnx"), state, os.path.join(out, "eval_model.onnx"))
    loss_value = np.asarray(m(d["x"], d[key]))
    eval_value = np.asarray(m.eval()(d["x"], d[key]))
    res[name] = {"loss": loss_value.tolist(), "shape": list(loss_value.shape),
                 "eval_shape": list(eval_value.shape),
                 "grads": {p: state.parameters[p].grad.tolist() for p in PARAMS}}
res["refused"] = {}
for cls in (onnxblock.loss.MSELoss, onnxblock.loss.L1Loss, onnxblock.loss.BCEWithLogitsLoss):
    try:
        cls(reduction="none")
        res["refused"][cls.__name__] = None
    except Exception as e:
        res["refused"][cls.__name__] = f"{type(e).__name__}: {e}"
print(json.dumps(res))
"""


@pytest.mark.slow
def test_nonscalar_loss_like_onnxruntime_training(tmp_path):
    python = ensure_ortt()
    base, npz = str(tmp_path / "mlp.onnx"), str(tmp_path / "data.npz")
    onnx.save(mlp(), base)
    np.savez(npz, **data())
    ref = run_script(_ORT_SCRIPT, base, str(tmp_path), npz, python=python)

    for case in ("custom", "ce_none"):
        folder = tmp_path / f"ours_{case}"
        folder.mkdir()
        loss, eval_loss, state = train_once(case, str(folder))
        theirs = ref[case]
        assert list(loss.shape) == theirs["shape"] and list(eval_loss.shape) == theirs["eval_shape"]
        np.testing.assert_allclose(loss, np.array(theirs["loss"], np.float32), rtol=1e-5, atol=1e-6)
        if case == "custom":  # an elementwise loss: onnxruntime-training's gradient is that of the sum too
            for p in PARAMS:
                np.testing.assert_allclose(state.parameters[p].grad, np.array(theirs["grads"][p], np.float32),
                                           rtol=1e-5, atol=1e-6, err_msg=p)
    # onnxruntime-training's CrossEntropyLoss(reduction="none") gradient is not compared: its kernel reads the
    # 0-d seed as per-sample weights, so the first sample's gradient comes back when the memory after the
    # seed happens to hold zeros, and values of 1e14 when it does not (seen in a full-suite run)
    # its MSE/L1/BCE losses refuse reduction="none" through a wrong keyword argument (onnxtrain builds them)
    assert all(v is not None and "keepdims" in v for v in ref["refused"].values()), ref["refused"]
