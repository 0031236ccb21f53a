"""onnxruntime-training's offline graph-building API: ``onnxblock.TrainingBlock`` (training and eval models,
``parameters()``), an optimizer block called with those parameters (the optimizer model), ``ForwardBlock``,
``custom_op_library`` and ``onnxtrain.set_seed``. The models must train exactly as the artifacts
``generate_artifacts`` writes for the same loss and parameters (themselves checked against torch elsewhere),
and the forward block's output against numpy."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.engine import compile_model
from onnxtrain.ir.builder import make_model
from onnxtrain.training import api, artifacts, onnxblock

RNG = np.random.default_rng(5)
W1 = (RNG.standard_normal((16, 8)) * 0.3).astype(np.float32)
B1 = (RNG.standard_normal(16) * 0.1).astype(np.float32)
W2 = (RNG.standard_normal((4, 16)) * 0.3).astype(np.float32)
B2 = (RNG.standard_normal(4) * 0.1).astype(np.float32)


def forward_model() -> onnx.ModelProto:
    """x[N, 8] → Gemm → Relu → Gemm → logits[N, 4] (no loss)."""
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("Gemm", ["r", "W2", "b2"], ["logits"], transB=1)]
    inits = [numpy_helper.from_array(v, n) for n, v in (("W1", W1), ("b1", B1), ("W2", W2), ("b2", B2))]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 8])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 4])], inits)
    return make_model(g, 17)


class CrossEntropyBlock(onnxblock.TrainingBlock):
    def __init__(self) -> None:
        super().__init__()
        self.loss = onnxblock.loss.CrossEntropyLoss()

    def build(self, output_name: str) -> str:
        return self.loss(output_name)


def offline_artifacts(folder: str, trainable: list[str], frozen: list[str]) -> CrossEntropyBlock:
    """The onnxruntime-training offline flow, written to ``folder`` under the artifact file names."""
    model = forward_model()
    block = CrossEntropyBlock()
    for n in trainable:
        block.requires_grad(n)
    for n in frozen:
        block.requires_grad(n, False)
    with onnxblock.base(model):
        loss = block(*[o.name for o in model.graph.output])
        training, evaluation = block.to_model_proto()
    assert isinstance(loss, str) and training.graph.output[0].name == loss
    optimizer = onnxblock.optim.AdamW(weight_decay=0.01)
    with onnxblock.empty_base():
        optimizer(block.parameters())
        optimizer_model = optimizer.to_model_proto()
    onnx.save(training, os.path.join(folder, "training_model.onnx"))
    onnx.save(evaluation, os.path.join(folder, "eval_model.onnx"))
    onnx.save(optimizer_model, os.path.join(folder, "optimizer_model.onnx"))
    onnxblock.save_checkpoint(block.parameters(), os.path.join(folder, "checkpoint"))
    return block


def train(folder: str, steps: int = 6) -> tuple[list[float], np.ndarray, float]:
    state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = api.Module(os.path.join(folder, "training_model.onnx"), state,
                        os.path.join(folder, "eval_model.onnx"))
    opt = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.05)
    rng = np.random.default_rng(9)
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rng.integers(0, 4, 5).astype(np.int64)
    losses = []
    for _ in range(steps):  # one batch: the loss must come down
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    module.eval()
    x = rng.standard_normal((5, 8)).astype(np.float32)
    y = rng.integers(0, 4, 5).astype(np.int64)
    return losses, module.get_contiguous_parameters(trainable_only=False), float(module(x, y))


def test_training_block_trains_as_generate_artifacts(tmp_path) -> None:
    off, gen = tmp_path / "offline", tmp_path / "generated"
    off.mkdir()
    gen.mkdir()
    block = offline_artifacts(str(off), ["W1", "b1", "W2"], ["b2"])
    trainable, frozen = block.parameters()
    assert [t.name for t in trainable] == ["W1", "b1", "W2"] and [t.name for t in frozen] == ["b2"]
    np.testing.assert_array_equal(numpy_helper.to_array(trainable[0]), W1)
    artifacts.generate_artifacts(forward_model(), requires_grad=["W1", "b1", "W2"], frozen_params=["b2"],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=onnxblock.optim.AdamW(weight_decay=0.01),
                                 artifact_directory=str(gen))
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(str(off / name)), full_check=True)
    a, b = train(str(off)), train(str(gen))
    assert a[0] == b[0] and a[2] == b[2]  # the same losses, step by step, and the same eval loss
    np.testing.assert_array_equal(a[1], b[1])
    assert a[0][-1] < a[0][0]


def test_the_base_becomes_the_training_model_and_unmarked_initializers_stay_constants() -> None:
    model = forward_model()
    block = CrossEntropyBlock()
    block.requires_grad("W2")
    block.requires_grad("b2")
    block.requires_grad("b2", False)  # changed its mind: frozen
    before = model.SerializeToString()
    with onnxblock.base(model) as acc:
        block("logits")
    training, _ = block.to_model_proto()
    assert acc.model.SerializeToString() == training.SerializeToString()
    assert model.SerializeToString() == before  # onnxblock.base edits a copy, as onnxruntime-training's
    assert "W2_grad.accumulation.out" in {o.name for o in training.graph.output}
    inputs = {i.name for i in training.graph.input}
    assert {"W2", "b2"} <= inputs and not {"W1", "b1"} & inputs
    assert {"W1", "b1"} <= {t.name for t in training.graph.initializer}
    assert [[t.name for t in g] for g in block.parameters()] == [["W2"], ["b2"]]


def test_two_blocks_built_on_one_loaded_model_give_the_same_training_model() -> None:
    """The caller's model is not edited, so a second block on it starts from the same forward model."""
    model = forward_model()
    built = []
    for _ in range(2):
        block = CrossEntropyBlock()
        block.requires_grad("W2")
        with onnxblock.base(model):
            block("logits")
        built.append(block.to_model_proto()[0].SerializeToString())
    assert built[0] == built[1]


def test_models_and_parameters_before_the_call_are_errors() -> None:
    block = CrossEntropyBlock()
    with pytest.raises(RuntimeError, match="build the training model first"):
        block.parameters()
    with pytest.raises(RuntimeError, match="build the training and eval models first"):
        block.to_model_proto()
    with pytest.raises(RuntimeError, match="build the forward models first"):
        onnxblock.optim.AdamW().to_model_proto()
    block.requires_grad("nope")
    with pytest.raises(ValueError, match="nope"), onnxblock.base(forward_model()):
        block("logits")


class SquaredError(onnxblock.ForwardBlock):
    def __init__(self) -> None:
        super().__init__()
        self.loss = onnxblock.loss.MSELoss(reduction="sum")

    def build(self, output_name: str) -> str:
        return self.loss(output_name)


def test_forward_block_registers_its_output() -> None:
    model = forward_model()
    block = SquaredError()
    with onnxblock.base(model):
        name = block("logits")
    m = block.to_model_proto()
    assert [o.name for o in m.graph.output] == [name]  # the base's outputs replaced, as onnxruntime's
    assert [o.name for o in model.graph.output] == ["logits"]
    onnx.checker.check_model(m, full_check=True)
    x = RNG.standard_normal((3, 8)).astype(np.float32)
    target = RNG.standard_normal((3, 4)).astype(np.float32)
    target_name = next(i.name for i in m.graph.input if i.name != "x")
    got = compile_model(m).run({"x": x, target_name: target}, [name])[0]
    logits = np.maximum(x @ W1.T + B1, 0) @ W2.T + B2
    np.testing.assert_allclose(got, ((logits - target) ** 2).sum(), rtol=1e-5)


def test_custom_op_library_is_refused_by_name(tmp_path) -> None:
    missing = tmp_path / "x.so"
    with pytest.raises(FileNotFoundError, match="does not exist"), onnxblock.custom_op_library(missing):
        pass
    lib = tmp_path / "ops.so"
    lib.write_bytes(b"")
    with pytest.raises(RuntimeError, match="not supported"), onnxblock.custom_op_library(lib):
        pass


def dropout_model() -> onnx.ModelProto:
    nodes = [helper.make_node("Dropout", ["x", "ratio", "training"], ["y"])]
    g = helper.make_graph(nodes, "d", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [64])],
                          [numpy_helper.from_array(np.array(0.5, np.float32), "ratio"),
                           numpy_helper.from_array(np.array(True), "training")])
    return make_model(g, 17)


def test_set_seed_makes_unseeded_dropout_reproducible() -> None:
    x = np.ones(64, np.float32)
    plan = compile_model(dropout_model())
    onnxtrain.set_seed(5)
    first = [plan.run({"x": x})[0] for _ in range(2)]
    onnxtrain.set_seed(5)
    again = [compile_model(dropout_model()).run({"x": x})[0] for _ in range(1)] + [plan.run({"x": x})[0]]
    np.testing.assert_array_equal(first[0], again[0])
    assert not np.array_equal(first[0], first[1])  # the sequence goes on from run to run
    onnxtrain.set_seed(6)
    assert not np.array_equal(compile_model(dropout_model()).run({"x": x})[0], first[0])
    with pytest.raises(TypeError, match="int"):
        onnxtrain.set_seed(1.5)
    onnxtrain.set_seed(-1)  # any int64, as onnxruntime takes them, a bool too
    onnxtrain.set_seed(True)
    with pytest.raises(TypeError, match="int64"):
        onnxtrain.set_seed(2**63)
