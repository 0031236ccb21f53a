"""``requires_grad`` on a graph input of the base model (not an initializer), as onnxruntime-training 1.19.2.

Its training model then also returns that input's gradient through an accumulation buffer
(``<input>_grad.accumulation.buffer`` input, ``<input>_grad.accumulation.out`` output), listed before the
parameters' (graph input order); the input stays a user input, is no parameter of ``block.parameters()``
and not in the checkpoint. Oracles: torch autograd in float64, and onnxruntime-training 1.19.2 building
the same block and generating the same artifacts (tests/ortt.py; skipped without its venv).
"""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.engine import compile_model
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module
from tests.ortt import PREAMBLE, ensure_ortt, run_script

torch = pytest.importorskip("torch")

X = "input-0"
BUF, OUT = "_grad.accumulation.buffer", "_grad.accumulation.out"


def mlp() -> onnx.ModelProto:
    """input-0 [batch, 8] -> Gemm(6) -> Relu -> Gemm(4) = output-0, float32 (torch's Linear layout)."""
    rng = np.random.default_rng(0)
    shapes = {"fc1.weight": (6, 8), "fc1.bias": (6,), "fc2.weight": (4, 6), "fc2.bias": (4,)}
    inits = [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in shapes.items()]
    nodes = [helper.make_node("Gemm", [X, "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "fc2.weight", "fc2.bias"], ["output-0"], transB=1)]
    x = helper.make_tensor_value_info(X, TensorProto.FLOAT, ["batch", 8])
    y = helper.make_tensor_value_info("output-0", TensorProto.FLOAT, ["batch", 4])
    graph = helper.make_graph(nodes, "mlp", [x], [y], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def data() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(1)
    return rng.standard_normal((5, 8)).astype(np.float32), rng.standard_normal((5, 4)).astype(np.float32)


def torch_grads(model: onnx.ModelProto, x: np.ndarray, t: np.ndarray) -> dict[str, np.ndarray]:
    """Gradients of mean((mlp(x) - t)²) with respect to x and every parameter, float64."""
    w = {i.name: torch.tensor(numpy_helper.to_array(i), dtype=torch.float64, requires_grad=True)
         for i in model.graph.initializer}
    xt = torch.tensor(x, dtype=torch.float64, requires_grad=True)
    h = torch.relu(xt @ w["fc1.weight"].T + w["fc1.bias"])
    loss = ((h @ w["fc2.weight"].T + w["fc2.bias"] - torch.tensor(t, dtype=torch.float64)) ** 2).mean()
    loss.backward()
    return {X: xt.grad.numpy(), **{n: v.grad.numpy() for n, v in w.items()}, "loss": loss.detach().numpy()}


class MSEBlock(onnxblock.TrainingBlock):
    def __init__(self) -> None:
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()

    def build(self, output_name: str) -> str:
        return self.loss(output_name)


def block_models(*requires_grad: str) -> tuple[onnx.ModelProto, onnx.ModelProto, MSEBlock]:
    block = MSEBlock()
    for n in requires_grad:
        block.requires_grad(n)
    with onnxblock.base(mlp()):
        block("output-0")
    training, evaluation = block.to_model_proto()
    return training, evaluation, block


def run_training(model: onnx.ModelProto, params: dict[str, np.ndarray], buffers: dict[str, np.ndarray],
                 reset: bool) -> dict[str, np.ndarray]:
    """One run of a training model (numpy engine): its outputs by name."""
    x, t = data()
    feeds = {X: x, "target": t, **params, **{n + BUF: b for n, b in buffers.items()},
             "lazy_reset_grad": np.array([reset])}
    names = [o.name for o in model.graph.output]
    return dict(zip(names, compile_model(model).run(feeds, names)))


def names(values: list[str]) -> list[str]:
    """Names with the generated ``onnx::...`` ones (the loss) made comparable."""
    return ["onnx::*" if n.startswith("onnx::") else n for n in values]


def io_names(model: onnx.ModelProto) -> tuple[list[str], list[str]]:
    return names([v.name for v in model.graph.input]), names([v.name for v in model.graph.output])


def test_training_block_outputs_input_gradient_like_torch():
    training, evaluation, block = block_models(X, "fc2.bias")
    assert io_names(training) == (
        [X, "target", "fc2.bias", X + BUF, "fc2.bias" + BUF, "lazy_reset_grad"],
        ["onnx::*", X + OUT, "fc2.bias" + OUT])
    assert io_names(evaluation) == ([X, "target", "fc2.bias"], ["onnx::*"])
    trainable, frozen = block.parameters()
    assert [p.name for p in trainable] == ["fc2.bias"] and frozen == []  # the input is no parameter
    params = {p.name: numpy_helper.to_array(p) for p in trainable}
    ref = torch_grads(mlp(), *data())
    stale = {X: np.full((5, 8), 7.0, np.float32), "fc2.bias": np.ones(4, np.float32)}  # reset: ignored
    first = run_training(training, params, stale, True)
    np.testing.assert_allclose(first[X + OUT], ref[X], rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(first["fc2.bias" + OUT], ref["fc2.bias"], rtol=1e-5, atol=1e-7)
    again = run_training(training, params, {X: first[X + OUT], "fc2.bias": first["fc2.bias" + OUT]}, False)
    np.testing.assert_allclose(again[X + OUT], 2 * ref[X], rtol=1e-5, atol=1e-7)  # accumulated


def test_input_gradient_alone_and_order_independent_of_requires_grad_order():
    training, _, block = block_models(X)
    assert io_names(training) == ([X, "target", X + BUF, "lazy_reset_grad"], ["onnx::*", X + OUT])
    assert block.parameters() == ([], [])
    out = run_training(training, {}, {X: np.zeros((5, 8), np.float32)}, True)
    np.testing.assert_allclose(out[X + OUT], torch_grads(mlp(), *data())[X], rtol=1e-5, atol=1e-7)
    swapped, _, _ = block_models("fc2.bias", X)
    assert io_names(swapped) == io_names(block_models(X, "fc2.bias")[0])


def test_generate_artifacts_with_input_gradient(tmp_path):
    artifacts.generate_artifacts(mlp(), requires_grad=[X], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    training = onnx.load(str(tmp_path / "training_model.onnx"))
    assert io_names(training) == ([X, "target", X + BUF, "lazy_reset_grad"], ["onnx::*", X + OUT])
    assert list(CheckpointState.load_checkpoint(str(tmp_path / "checkpoint")).parameters.keys()) == []
    assert sorted(os.listdir(tmp_path)) == ["checkpoint", "eval_model.onnx", "training_model.onnx"]

    refused = tmp_path / "refused"
    refused.mkdir()
    with pytest.raises(artifacts.ArtifactError, match=r"no parameter requires a gradient.*\['input-0'\] are "
                                                      "graph inputs"):
        artifacts.generate_artifacts(mlp(), requires_grad=[X], loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.SGD, artifact_directory=refused)
    assert os.listdir(refused) == []  # (as onnxruntime-training, which fails on it with an IndexError)

    folder = tmp_path / "opt"
    folder.mkdir()
    artifacts.generate_artifacts(mlp(), requires_grad=[X, "fc2.bias"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=folder)
    optimizer = onnx.load(str(folder / "optimizer_model.onnx"))
    assert [v.name for v in optimizer.graph.input if X in v.name] == []
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    assert list(state.parameters.keys()) == ["fc2.bias"]
    with pytest.warns(UserWarning, match=r"trains parameter\(s\) \['input-0'\].*keeps its place"):
        module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    assert module.input_names() == [X, "target"]
    ref = torch_grads(mlp(), *data())
    np.testing.assert_allclose(module(*data()), ref["loss"], rtol=1e-6)
    np.testing.assert_allclose(state.parameters["fc2.bias"].grad, ref["fc2.bias"], rtol=1e-5, atol=1e-7)


def test_input_gradient_errors(tmp_path):
    ce = artifacts.LossType.CrossEntropyLoss
    with pytest.raises(artifacts.ArtifactError, match=r"\['labels'\], graph inputs of type \['INT64'\]"):
        artifacts.generate_artifacts(mlp(), requires_grad=["labels"], loss=ce, artifact_directory=tmp_path)
    with pytest.raises(artifacts.ArtifactError, match=r"\['nope'\] that are not initializers of the model "
                                                      "nor graph inputs"):
        artifacts.generate_artifacts(mlp(), requires_grad=["nope"], loss=ce, artifact_directory=tmp_path)
    # a frozen name that is no initializer is left out, as onnxruntime-training left it, with a warning
    frozen = tmp_path / "frozen"
    frozen.mkdir()
    with pytest.warns(UserWarning, match=r"frozen_params names \['input-0'\] that are not initializers"):
        artifacts.generate_artifacts(mlp(), frozen_params=[X], loss=ce, artifact_directory=frozen)
    with pytest.raises(artifacts.ArtifactError, match=r"mixed_precision .* graph input\(s\) \['input-0'\]"):
        artifacts.generate_artifacts(mlp(), requires_grad=[X, "fc2.bias"], loss=artifacts.LossType.MSELoss,
                                     artifact_directory=tmp_path, mixed_precision="float16")
    assert os.listdir(tmp_path) == ["frozen"]


_ORT_SCRIPT = PREAMBLE + r"""
import copy, os
import numpy as np
import onnxruntime as ort
from onnxruntime.training import artifacts, onnxblock
from onnxruntime.training.api import CheckpointState

base, folder, data = sys.argv[1:4]
net = onnx.load(base)
net.ir_version = 10
d = np.load(data)
x, t = d["x"], d["t"]

class MSEBlock(onnxblock.TrainingBlock):
    def __init__(self):
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()
    def build(self, o):
        return self.loss(o)

def io(m):
    return [v.name for v in m.graph.input], [v.name for v in m.graph.output]

res = {}
block = MSEBlock()
block.requires_grad("input-0")
block.requires_grad("fc2.bias")
with onnxblock.base(copy.deepcopy(net)):
    block("output-0")
training, evaluation = block.to_model_proto()
res["block"] = [io(training), io(evaluation), [[p.name for p in ps] for ps in block.parameters()]]
training.ir_version = 10
path = os.path.join(folder, "block_training.onnx")
onnx.save(training, path)
# the gradients, read from the buffers the accumulators update in place (reset flag set)
sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
bind = sess.io_binding()
bias = [onnx.numpy_helper.to_array(i) for i in net.graph.initializer if i.name == "fc2.bias"][0]
bufs = {n: ort.OrtValue.ortvalue_from_numpy(np.zeros_like(v))
        for n, v in (("input-0", x), ("fc2.bias", bias))}
for n, v in (("input-0", x), ("target", t), ("fc2.bias", bias), ("lazy_reset_grad", np.array([True]))):
    bind.bind_cpu_input(n, v)
for n, b in bufs.items():
    bind.bind_ortvalue_input(n + "_grad.accumulation.buffer", b)
for o in sess.get_outputs():
    bind.bind_output(o.name)
sess.run_with_iobinding(bind)
res["grads"] = {n: b.numpy().tolist() for n, b in bufs.items()}

out = os.path.join(folder, "ga")
os.makedirs(out)
artifacts.generate_artifacts(copy.deepcopy(net), requires_grad=["input-0"], loss=artifacts.LossType.MSELoss,
                             artifact_directory=out)
res["ga"] = [io(onnx.load(os.path.join(out, "training_model.onnx"))),
             [k for k, _ in CheckpointState.load_checkpoint(os.path.join(out, "checkpoint")).parameters]]
print(json.dumps(res))
"""


@pytest.mark.slow
def test_input_gradient_like_onnxruntime_training(tmp_path):
    python = ensure_ortt()
    base, npz = str(tmp_path / "mlp.onnx"), str(tmp_path / "data.npz")
    onnx.save(mlp(), base)
    x, t = data()
    np.savez(npz, x=x, t=t)
    ref = run_script(_ORT_SCRIPT, base, str(tmp_path), npz, python=python)

    training, evaluation, block = block_models(X, "fc2.bias")
    (t_in, t_out), (e_in, e_out), params = ref["block"]
    assert io_names(training) == (names(t_in), names(t_out))
    assert io_names(evaluation) == (names(e_in), names(e_out))
    assert [[p.name for p in ps] for ps in block.parameters()] == params
    ours = run_training(training, {"fc2.bias": numpy_helper.to_array(block.parameters()[0][0])},
                        {X: np.zeros_like(x), "fc2.bias": np.zeros(4, np.float32)}, True)
    for n in (X, "fc2.bias"):
        np.testing.assert_allclose(ours[n + OUT], np.array(ref["grads"][n], np.float32), rtol=1e-5, atol=1e-7)

    folder = tmp_path / "ours"
    folder.mkdir()
    artifacts.generate_artifacts(mlp(), requires_grad=[X], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=folder)
    (g_in, g_out), ckpt = ref["ga"]
    assert io_names(onnx.load(str(folder / "training_model.onnx"))) == (names(g_in), names(g_out))
    assert list(CheckpointState.load_checkpoint(str(folder / "checkpoint")).parameters.keys()) == ckpt == []
