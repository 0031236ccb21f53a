"""onnxruntime-training's own onnxblock and generate_artifacts tests (orttraining_test_onnxblock.py and
orttraining_test_ort_apis_onnxblock.py), rewritten for onnxtrain.

Their scenario: a two-layer torch net (fc1, relu, fc2) exported in training mode at opset 14 with dynamic
axes, its input "input-0" and output "output-0". Where the originals only check that nothing raises,
these also check the values: losses and gradients against torch autograd (the models are plain ONNX, so
onnxruntime's inference package runs them, and so does onnxtrain's engine), optimizer steps against
torch.optim, and the names of the models and parameters against onnxruntime-training 1.19.2.
"""

from __future__ import annotations

import copy
import io
import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto

from onnxtrain.engine import compile_model
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.onnxblock import BlockError
from tests.ortt import PREAMBLE, run_script

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

BATCH, IN, HIDDEN, OUT = 4, 16, 12, 10
PARAMS = ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]


class SimpleNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = torch.nn.Linear(IN, HIDDEN)
        self.relu = torch.nn.ReLU()
        self.fc2 = torch.nn.Linear(HIDDEN, OUT)

    def forward(self, x):
        return self.fc2(self.relu(self.fc1(x)))


def export(net: torch.nn.Module, inputs: tuple) -> onnx.ModelProto:
    """``net`` exported as the originals export it: training mode, opset 14, every axis dynamic, inputs
    input-<i>, outputs output-<i>."""
    outs = net(*inputs)
    outs = [outs] if isinstance(outs, torch.Tensor) else list(outs)
    names_in = [f"input-{i}" for i in range(len(inputs))]
    names_out = [f"output-{i}" for i in range(len(outs))]
    axes = {n: {d: f"{n}_dim{d}" for d in range(t.dim())}
            for n, t in zip(names_in + names_out, [*inputs, *outs])}
    f = io.BytesIO()
    torch.onnx.export(net, inputs, f, input_names=names_in, output_names=names_out, opset_version=14,
                      do_constant_folding=False, training=torch.onnx.TrainingMode.TRAINING,
                      dynamic_axes=axes, dynamo=False)
    return onnx.load_model_from_string(f.getvalue())


@pytest.fixture(scope="module")
def simple():
    """(torch net, its exported model)."""
    torch.manual_seed(0)
    net = SimpleNet()
    return net, export(net, (torch.randn(BATCH, IN),))


def run_both(model: onnx.ModelProto, feeds: dict[str, np.ndarray], names: list[str]) -> list[np.ndarray]:
    """``names`` computed by onnxruntime's inference session; onnxtrain's engine must agree."""
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(names, feeds)
    got = dict(zip([o.name for o in model.graph.output], compile_model(model).run(feeds)))
    for n, t in zip(names, theirs):
        np.testing.assert_allclose(got[n], t, rtol=1e-5, atol=1e-6, err_msg=n)
    return theirs


def training_feeds(net: torch.nn.Module, names: list[str]) -> dict[str, np.ndarray]:
    """The parameters, zero gradient buffers and a reset flag for the training model of ``names``."""
    feeds: dict[str, np.ndarray] = {}
    params = dict(net.named_parameters())
    for n in names:
        feeds[n] = params[n].detach().numpy()
        feeds[f"{n}_grad.accumulation.buffer"] = np.zeros(params[n].shape, np.float32)
    feeds["lazy_reset_grad"] = np.full(1, True)
    return feeds


LOSSES = {
    "MSELoss": (onnxblock.loss.MSELoss, torch.nn.MSELoss()),
    "L1Loss": (onnxblock.loss.L1Loss, torch.nn.L1Loss()),
    "CrossEntropyLoss": (onnxblock.loss.CrossEntropyLoss, torch.nn.CrossEntropyLoss()),
    "BCEWithLogitsLoss": (onnxblock.loss.BCEWithLogitsLoss, torch.nn.BCEWithLogitsLoss()),
}


def loss_block(kind: type, loss_cls: type) -> onnxblock.Block:
    class OneLoss(kind):
        def __init__(self) -> None:
            super().__init__()
            self.loss = loss_cls()

        def build(self, output_name: str) -> str:
            return self.loss(output_name)

    return OneLoss()


def target_for(loss: str, gen: torch.Generator) -> torch.Tensor:
    if loss == "CrossEntropyLoss":
        return torch.randint(0, OUT, (BATCH,), generator=gen)
    return torch.randn(BATCH, OUT, generator=gen)


def built(block: onnxblock.Block, model: onnx.ModelProto, *outputs: str) -> onnx.ModelProto:
    """The block called on a copy of ``model``: the forward model, or a TrainingBlock's training model."""
    m = copy.deepcopy(model)
    with onnxblock.base(m):
        block(*outputs)
    out = block.to_model_proto()
    return out[0] if isinstance(out, tuple) else out


@pytest.mark.parametrize("kind", [onnxblock.ForwardBlock, onnxblock.TrainingBlock], ids=lambda k: k.__name__)
@pytest.mark.parametrize("loss", list(LOSSES))
def test_loss_blocks_on_the_exported_net_match_torch(simple, loss, kind):
    """test_loss_composition, test_mse_loss_execution (MSE, L1), test_crossentropy_loss_execution,
    test_bcewithlogits_loss_execution and the *_loss_training_graph_execution tests: the forward and
    training models of each loss block, run by onnxruntime and onnxtrain, give torch's loss and gradients."""
    net, model = simple
    block_cls, torch_loss = LOSSES[loss]
    block = loss_block(kind, block_cls)
    training = kind is onnxblock.TrainingBlock
    if training:
        for n in PARAMS:
            block.requires_grad(n)
    m = built(block, model, "output-0")
    gen = torch.Generator().manual_seed(1)
    x, target = torch.randn(BATCH, IN, generator=gen), target_for(loss, gen)
    label = "labels" if loss == "CrossEntropyLoss" else "target"
    assert [i.name for i in m.graph.input][:2] == ["input-0", label]
    assert m.graph.input[1].type.tensor_type.elem_type == (
        TensorProto.INT64 if loss == "CrossEntropyLoss" else TensorProto.FLOAT)
    feeds = {"input-0": x.numpy(), label: target.numpy(), **(training_feeds(net, PARAMS) if training else {})}
    grads = [f"{n}_grad.accumulation.out" for n in PARAMS] if training else []
    got = run_both(m, feeds, [m.graph.output[0].name, *grads])
    net.zero_grad()
    expected = torch_loss(net(x), target)
    expected.backward()
    np.testing.assert_allclose(got[0], expected.item(), rtol=1e-5, atol=1e-7)
    for g, p in zip(got[1:], net.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6)


def mse_training_block(model: onnx.ModelProto) -> onnxblock.TrainingBlock:
    block = loss_block(onnxblock.TrainingBlock, onnxblock.loss.MSELoss)
    for n in PARAMS:
        block.requires_grad(n)
    built(block, model, "output-0")
    return block


@pytest.mark.parametrize("clip", [None, 0.05])
@pytest.mark.parametrize("optimizer", ["AdamW", "SGD"])
def test_optimizer_model_from_block_parameters_steps_as_torch(simple, optimizer, clip):
    """test_adamw_optimizer_composition, test_adamw_optimizer_execution, test_sgd_optimizer_composition,
    test_sgd_optimizer_execution and test_grad_clipping_execution: an optimizer block called with a
    TrainingBlock's parameters() in empty_base() gives the optimizer model; one step of it (with
    ClipGradNorm or not) moves the parameters as torch's optimizer after clip_grad_norm_."""
    net, model = simple
    block = mse_training_block(model)
    clip_block = None if clip is None else onnxblock.optim.ClipGradNorm(clip)
    opt = onnxblock.optim.AdamW(clip_grad=clip_block) if optimizer == "AdamW" else \
        onnxblock.optim.SGD(clip_grad=clip_block)
    with onnxblock.empty_base() as acc:
        outputs = opt(block.parameters())
        opt_model = acc.model
    assert opt.to_model_proto().SerializeToString() == opt_model.SerializeToString()
    assert outputs[:4] == [f"{n}.out" for n in PARAMS]

    gen = torch.Generator().manual_seed(2)
    x, target = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, OUT, generator=gen)
    torch_net = copy.deepcopy(net)
    torch_net.zero_grad()
    torch.nn.MSELoss()(torch_net(x), target).backward()
    lr = 0.01
    feeds = {"learning_rate": np.full(1, lr, np.float32), "step": np.full(1, 1, np.int64)}
    for n, p in torch_net.named_parameters():
        feeds[n] = p.detach().numpy().copy()
        feeds[f"{n}_grad"] = p.grad.numpy().copy()
        for state in opt.state_names:
            feeds[f"{n}.{state}"] = np.zeros(p.shape, np.float32)
    got = run_both(opt_model, feeds, outputs[:4])
    if clip is not None:
        norm = torch.nn.utils.clip_grad_norm_(torch_net.parameters(), clip)
        assert norm > clip  # the clipping acts
    if optimizer == "AdamW":
        # onnxruntime's AdamW adds eps to sqrt(v) before the bias correction, torch after it: at step 1,
        # torch's eps / sqrt(1 - beta2) is the same update
        step = torch.optim.AdamW(torch_net.parameters(), lr=lr, betas=(0.9, 0.999),
                                 eps=1e-6 / np.sqrt(1 - 0.999), weight_decay=0.0)
    else:
        step = torch.optim.SGD(torch_net.parameters(), lr=lr)
    step.step()
    for g, p in zip(got, torch_net.parameters()):
        np.testing.assert_allclose(g, p.detach().numpy(), rtol=1e-5, atol=1e-6)


_ORT_NAMES = PREAMBLE + r"""
import copy
import onnxruntime.training.onnxblock as onnxblock

base = onnx.load(sys.argv[1])


class MSE(onnxblock.TrainingBlock):
    def __init__(self):
        super().__init__()
        self.loss = onnxblock.loss.MSELoss()

    def build(self, output_name):
        return self.loss(output_name)


out = {}
for case, marks in json.loads(sys.argv[2]).items():
    block = MSE()
    for name, value in marks:
        block.requires_grad(name, value)
    with onnxblock.base(copy.deepcopy(base)):
        block("output-0")
    training, evaluation = block.to_model_proto()
    out[case] = {"parameters": [[t.name for t in ts] for ts in block.parameters()],
                 "values": [[onnx.numpy_helper.to_array(t).ravel()[:3].tolist() for t in ts]
                            for ts in block.parameters()],
                 **{f"{k}_{io}": [v.name for v in getattr(m.graph, io)]
                    for k, m in (("training", training), ("eval", evaluation)) for io in ("input", "output")}}
print(json.dumps(out))
"""

REQUIRES_GRAD_CASES = {
    "all": [[n, True] for n in PARAMS],
    "none": [],
    "two_frozen": [["fc2.weight", False], ["fc1.bias", False]],
    "mixed": [["fc2.weight", True], ["fc1.weight", False], ["fc1.bias", True]],
    "input": [["input-0", True]],
}


def _generated(names: list[str]) -> list[str]:
    return ["onnx::*" if n.startswith("onnx::") else n for n in names]


def test_parameters_and_model_names_follow_requires_grad_as_onnxruntime_training(simple, tmp_path):
    """test_retrieve_parameters, test_set_requires_grad_on_parameters and test_set_requires_grad_on_inputs:
    parameters() (trainable, frozen) and the training and eval models' inputs and outputs, for
    requires_grad on all, none, some parameters (True and False) and on the graph input, as
    onnxruntime-training 1.19.2 gives them (but for the model inputs with nothing marked, see below); the
    parameter values are torch's."""
    net, model = simple
    path = str(tmp_path / "base.onnx")
    onnx.save(model, path)
    theirs = run_script(_ORT_NAMES, path, json.dumps(REQUIRES_GRAD_CASES))
    torch_values = {n: p.detach().numpy() for n, p in net.named_parameters()}
    for case, marks in REQUIRES_GRAD_CASES.items():
        block = loss_block(onnxblock.TrainingBlock, onnxblock.loss.MSELoss)
        for name, value in marks:
            block.requires_grad(name, value)
        built(block, model, "output-0")
        training, evaluation = block.to_model_proto()
        ours = {"parameters": [[t.name for t in ts] for ts in block.parameters()],
                **{f"{k}_{io}": [v.name for v in getattr(m.graph, io)]
                   for k, m in (("training", training), ("eval", evaluation)) for io in ("input", "output")}}
        assert ours.pop("parameters") == theirs[case]["parameters"], case
        # (with nothing marked, onnxruntime-training turns every initializer into a graph input, its own
        # loss constant too, and checkpoints none: models its Module cannot feed; onnxtrain keeps them)
        for key, value in ours.items() if case != "none" else ():
            assert _generated(value) == _generated(theirs[case][key]), (case, key)
        for ts in block.parameters():
            for t in ts:
                np.testing.assert_array_equal(onnx.numpy_helper.to_array(t), torch_values[t.name])
    assert theirs["all"]["parameters"] == [PARAMS, []]


def test_checkpoint_of_block_parameters_loads_into_a_zeroed_model(simple, tmp_path):
    """test_save_checkpoint and test_load_checkpoint: the parameters of a TrainingBlock saved with
    onnxblock.save_checkpoint and loaded into the same net exported with zero weights give that net
    torch's values back."""
    net, model = simple
    block = mse_training_block(model)
    path = tmp_path / "checkpoint"
    onnxblock.save_checkpoint(block.parameters(), path)
    assert path.exists()
    zeroed = copy.deepcopy(net)
    with torch.no_grad():
        for p in zeroed.parameters():
            p.zero_()
    zero_model = export(zeroed, (torch.randn(BATCH, IN),))
    assert all(not onnx.numpy_helper.to_array(t).any() for t in zero_model.graph.initializer)
    onnxblock.load_checkpoint_to_model(path, zero_model)
    loaded = {t.name: onnx.numpy_helper.to_array(t) for t in zero_model.graph.initializer}
    for n, p in net.named_parameters():
        np.testing.assert_array_equal(loaded[n], p.detach().numpy())


class TwoOutputNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.first, self.second = SimpleNet(), SimpleNet()

    def forward(self, x1, x2):
        return self.first(x1), self.second(x2)


@pytest.mark.parametrize("kind", [onnxblock.ForwardBlock, onnxblock.TrainingBlock], ids=lambda k: k.__name__)
def test_weighted_average_of_two_losses_matches_torch(kind):
    """test_weighted_average_model_composition: w1·CE(output-0, labels1) + w2·CE(output-1, labels2) from
    Constant, Mul and Add blocks, its value (and gradients) as torch's."""
    torch.manual_seed(3)
    net = TwoOutputNet()
    gen = torch.Generator().manual_seed(4)
    x1, x2 = torch.randn(BATCH, IN, generator=gen), torch.randn(BATCH, IN, generator=gen)
    model = export(net, (x1, x2))
    w1, w2 = 0.3, 0.8

    class WeightedAverage(kind):
        def __init__(self) -> None:
            super().__init__()
            self.loss1, self.loss2 = onnxblock.loss.CrossEntropyLoss(), onnxblock.loss.CrossEntropyLoss()
            self.w1, self.w2 = onnxblock.blocks.Constant(w1), onnxblock.blocks.Constant(w2)
            self.mul, self.add = onnxblock.blocks.Mul(), onnxblock.blocks.Add()

        def build(self, name1: str, name2: str) -> str:
            return self.add(self.mul(self.w1(), self.loss1(name1, labels_name="labels1")),
                            self.mul(self.w2(), self.loss2(name2, labels_name="labels2")))

    block = WeightedAverage()
    names = [n for n, _ in net.named_parameters()]
    training = kind is onnxblock.TrainingBlock
    if training:
        for n in names:
            block.requires_grad(n)
    m = built(block, model, "output-0", "output-1")
    l1, l2 = (torch.randint(0, OUT, (BATCH,), generator=gen) for _ in range(2))
    feeds = {"input-0": x1.numpy(), "input-1": x2.numpy(), "labels1": l1.numpy(), "labels2": l2.numpy(),
             **(training_feeds(net, names) if training else {})}
    grads = [f"{n}_grad.accumulation.out" for n in names] if training else []
    got = run_both(m, feeds, [m.graph.output[0].name, *grads])
    ce = torch.nn.functional.cross_entropy
    o1, o2 = net(x1, x2)
    expected = w1 * ce(o1, l1) + w2 * ce(o2, l2)
    expected.backward()
    np.testing.assert_allclose(got[0], expected.item(), rtol=1e-5)
    for g, p in zip(got[1:], net.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6)


class EncodedLabelsLoss:
    """The loss block of test_label_encoder_composition: CrossEntropyLoss of labels mapped by a
    LabelEncoder, the labels input added to ``self.base`` by the block itself (here mapping class k to
    9 - k)."""

    @staticmethod
    def of(kind: type) -> onnxblock.Block:
        class Encoded(kind):
            def __init__(self) -> None:
                super().__init__()
                self._loss = onnxblock.loss.CrossEntropyLoss()

            def build(self, output_name: str) -> str:
                labels = copy.deepcopy(self.base.graph.output[0])
                labels.name = "labels"
                labels.type.tensor_type.elem_type = TensorProto.INT64
                del labels.type.tensor_type.shape.dim[1]
                self.base.graph.input.append(labels)
                encoder = onnxblock.blocks.LabelEncoder(default_int64=0, keys_int64s=list(range(OUT)),
                                                        values_int64s=list(range(OUT - 1, -1, -1)))
                return self._loss(output_name, encoder("labels"))

        return Encoded()


@pytest.mark.parametrize("kind", [onnxblock.ForwardBlock, onnxblock.TrainingBlock], ids=lambda k: k.__name__)
def test_label_encoder_composed_into_a_loss_block(simple, kind):
    """test_label_encoder_composition: a loss block adds a labels graph input through self.base and maps
    it with LabelEncoder before CrossEntropyLoss; the model computes torch's loss (and gradients) of the
    mapped labels. (A TrainingBlock's self.base was the caller's model, not the one being built: the
    input went nowhere and onnx's shape inference crashed the process on the dangling LabelEncoder.)"""
    net, model = simple
    block = EncodedLabelsLoss.of(kind)
    training = kind is onnxblock.TrainingBlock
    if training:
        for n in PARAMS:
            block.requires_grad(n)
    m = built(block, model, "output-0")
    assert "LabelEncoder" not in [n.op_type for n in model.graph.node]
    assert "LabelEncoder" in [n.op_type for n in m.graph.node]
    assert [i.name for i in m.graph.input][:2] == ["input-0", "labels"]
    gen = torch.Generator().manual_seed(5)
    x, labels = torch.randn(BATCH, IN, generator=gen), torch.randint(0, OUT, (BATCH,), generator=gen)
    feeds = {"input-0": x.numpy(), "labels": labels.numpy(),
             **(training_feeds(net, PARAMS) if training else {})}
    grads = [f"{n}_grad.accumulation.out" for n in PARAMS] if training else []
    got = run_both(m, feeds, [m.graph.output[0].name, *grads])
    net.zero_grad()
    expected = torch.nn.functional.cross_entropy(net(x), OUT - 1 - labels)
    expected.backward()
    np.testing.assert_allclose(got[0], expected.item(), rtol=1e-5)
    for g, p in zip(got[1:], net.parameters()):
        np.testing.assert_allclose(g, p.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_label_encoder_output_feeds_the_next_block():
    """(After test_label_encoder_composition) a block taking the LabelEncoder's output: MSELoss of mapped
    float values, its value as torch's. The LabelEncoder block left the base's cached value types stale,
    so the next block found no type for its output."""
    keys = np.array([3, 1, 7, 2], np.int64)
    keys_input = onnx.helper.make_tensor_value_info("keys", TensorProto.INT64, [4])
    model = onnx.helper.make_model(onnx.helper.make_graph([], "g", [keys_input], []),
                                   opset_imports=[onnx.helper.make_opsetid("", 17)])
    with onnxblock.base(model) as acc:
        assert acc.shape("keys") == [4]  # the types are known (cached) before the encoder is added
        encoded = onnxblock.blocks.LabelEncoder(keys_int64s=[1, 2, 3], values_floats=[0.5, 1.5, 2.5],
                                                default_float=-1.0)("keys")
        loss = onnxblock.loss.MSELoss()(encoded, "target")
    m = acc.model
    m.graph.output.append(onnx.helper.make_tensor_value_info(loss, TensorProto.FLOAT, []))
    target = np.array([1.0, 0.0, 0.5, 2.0], np.float32)
    (got,) = run_both(m, {"keys": keys, "target": target}, [loss])
    mapped = torch.tensor([2.5, 0.5, -1.0, 1.5])
    np.testing.assert_allclose(got, torch.nn.functional.mse_loss(mapped, torch.from_numpy(target)).item(),
                               rtol=1e-6)


def test_label_encoder_of_a_missing_input_is_an_error(simple, tmp_path):
    """A LabelEncoder of a name the model does not have is refused naming it, in generate_artifacts' loss
    too (where no checker runs after each block: onnx's shape inference, which the next block ran,
    crashed the process on such a node)."""

    class Encoded(onnxblock.Block):
        def __init__(self) -> None:
            super().__init__()
            self._loss = onnxblock.loss.CrossEntropyLoss()

        def build(self, output_name: str) -> str:
            encoder = onnxblock.blocks.LabelEncoder(keys_int64s=[0], values_int64s=[1])
            return self._loss(output_name, encoder("labels"))

    _, model = simple
    with pytest.raises(BlockError, match="LabelEncoder.*'labels'"):
        artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=Encoded(), artifact_directory=tmp_path)


class TwoRanks(torch.nn.Module):
    """Two outputs of different ranks, no parameter (the constants are plain tensors)."""

    def __init__(self) -> None:
        super().__init__()
        gen = torch.Generator().manual_seed(6)
        self.a, self.b = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(4, 3, 6, generator=gen)

    def forward(self, x, y):
        return self.a + x, self.b + y


def test_custom_loss_block_without_base_init_over_outputs_of_two_ranks(tmp_path):
    """test_custom_loss_function: generate_artifacts with a Block subclass whose __init__ does not call
    Block.__init__, summing MSELoss and BCEWithLogitsLoss of a rank-4 and a rank-3 output (targets
    target1, target2); the eval and training models compute torch's loss."""

    class CustomLoss(onnxblock.Block):
        def __init__(self) -> None:  # no super().__init__(), as the original
            self._loss1 = onnxblock.loss.MSELoss()
            self._loss2 = onnxblock.loss.BCEWithLogitsLoss()
            self._add = onnxblock.blocks.Add()

        def build(self, input1: str, input2: str) -> str:
            return self._add(self._loss1(input1, target_name="target1"),
                             self._loss2(input2, target_name="target2"))

    net = TwoRanks()
    gen = torch.Generator().manual_seed(7)
    x, y = torch.randn(2, 3, 4, 5, generator=gen), torch.randn(4, 3, 6, generator=gen)
    t1, t2 = torch.randn(2, 3, 4, 5, generator=gen), torch.rand(4, 3, 6, generator=gen)
    artifacts.generate_artifacts(export(net, (x, y)), loss=CustomLoss(), artifact_directory=tmp_path)
    expected = (torch.nn.functional.mse_loss(net.a + x, t1)
                + torch.nn.functional.binary_cross_entropy_with_logits(net.b + y, t2)).item()
    feeds = {"input-0": x.numpy(), "input-1": y.numpy(), "target1": t1.numpy(), "target2": t2.numpy()}
    reset = {"lazy_reset_grad": np.full(1, True)}
    for name, extra in (("eval_model.onnx", {}), ("training_model.onnx", reset)):
        m = onnx.load(tmp_path / name)
        (got,) = run_both(m, {**feeds, **extra}, [m.graph.output[0].name])
        np.testing.assert_allclose(got, expected, rtol=1e-5, err_msg=name)


class DropoutNet(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.dropout = torch.nn.Dropout(p=0.5)

    def forward(self, x):
        return self.dropout(x)


def test_additional_output_names_regenerated_into_the_same_directory(tmp_path):
    """test_additional_output_names and test_eval_model_has_no_training_mode_dropout: artifacts of a
    Dropout net with CrossEntropyLoss have the loss as the eval model's only output; generated again into
    the same directory with additional_output_names=["output-0"], two, the second the input itself (the
    eval model's Dropout is inactive: its training_mode slot empty)."""
    x = torch.randn(1, 3, 8, 8, generator=torch.Generator().manual_seed(8))
    model = export(DropoutNet(), (x,))
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path)
    assert len(onnx.load(tmp_path / "eval_model.onnx").graph.output) == 1
    artifacts.generate_artifacts(model, loss=artifacts.LossType.CrossEntropyLoss, artifact_directory=tmp_path,
                                 additional_output_names=["output-0"])
    evaluation = onnx.load(tmp_path / "eval_model.onnx")
    assert [o.name for o in evaluation.graph.output][1:] == ["output-0"]
    dropouts = [n for n in evaluation.graph.node if n.op_type == "Dropout"]
    assert dropouts and all(len(n.input) < 3 or not n.input[2] for n in dropouts)
    labels = torch.randint(0, 3, (1, 8, 8), generator=torch.Generator().manual_seed(9))
    loss, out = run_both(evaluation, {"input-0": x.numpy(), "labels": labels.numpy()},
                         [o.name for o in evaluation.graph.output])
    np.testing.assert_array_equal(out, x.numpy())
    np.testing.assert_allclose(loss, torch.nn.functional.cross_entropy(x, labels).item(), rtol=1e-5)


def test_ort_format_and_nominal_checkpoint(simple, tmp_path):
    """test_save_ort_format and test_save_nominal_checkpoint: ort_format=True writes an .ort copy of each
    model beside the .onnx one, which onnxruntime loads and runs alike; the three models share one
    default-domain opset (onnxruntime-training keeps the base's 14, onnxtrain moves models before 17 to 17,
    as the README says); nominal_checkpoint=True writes a nominal checkpoint smaller than the checkpoint."""
    from onnxtrain.training.api import CheckpointState

    net, model = simple
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=tmp_path,
                                 ort_format=True, nominal_checkpoint=True)
    opsets = set()
    for kind in ("training", "eval", "optimizer"):
        assert (tmp_path / f"{kind}_model.onnx").exists() and (tmp_path / f"{kind}_model.ort").exists()
        opsets.add(next(o.version for o in onnx.load(tmp_path / f"{kind}_model.onnx").opset_import
                        if o.domain in ("", "ai.onnx")))
    assert opsets == {17}
    gen = torch.Generator().manual_seed(10)
    x, labels = torch.randn(BATCH, IN, generator=gen), torch.randint(0, OUT, (BATCH,), generator=gen)
    feeds = {"input-0": x.numpy(), "labels": labels.numpy(),
             **{n: p.detach().numpy() for n, p in net.named_parameters()}}
    from_ort = ort.InferenceSession(str(tmp_path / "eval_model.ort"), providers=["CPUExecutionProvider"])
    from_onnx = run_both(onnx.load(tmp_path / "eval_model.onnx"), feeds, [from_ort.get_outputs()[0].name])
    np.testing.assert_allclose(from_ort.run(None, feeds)[0], from_onnx[0], rtol=1e-6)
    np.testing.assert_allclose(from_onnx[0], torch.nn.functional.cross_entropy(net(x), labels).item(),
                               rtol=1e-5)
    checkpoint, nominal = tmp_path / "checkpoint", tmp_path / "nominal_checkpoint"
    assert os.path.getsize(checkpoint) > os.path.getsize(nominal)
    assert CheckpointState.load_checkpoint(nominal).is_nominal
    assert not CheckpointState.load_checkpoint(checkpoint).is_nominal


_ORT_WEIGHT_DECAY = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts, onnxblock

base, folder, data, wd, lr = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), float(sys.argv[5])
artifacts.generate_artifacts(onnx.load(base), requires_grad=json.loads(sys.argv[6]),
                             loss=artifacts.LossType.CrossEntropyLoss,
                             optimizer=onnxblock.optim.AdamW(weight_decay=wd), artifact_directory=folder)
decays = [a.f for n in onnx.load(folder + "/optimizer_model.onnx").graph.node if "AdamW" in n.op_type
          for a in n.attribute if a.name == "weight_decay"]
state, m, o = open_artifacts(folder, lr)
batches = np.load(data)
for i in range(2):
    m(batches[f"x{i}"], batches[f"labels{i}"]); o.step(); m.lazy_reset_grad()
print(json.dumps({"decays": decays, **{k: p.data.ravel().tolist() for k, p in state.parameters}}))
"""


def test_custom_optimizer_block_weight_decay_steps_as_onnxruntime_training(simple, tmp_path):
    """test_custom_optimizer_block: generate_artifacts with optimizer=onnxblock.optim.AdamW(weight_decay=123)
    (onnxruntime-training writes the value into its AdamW node); two steps move the parameters as those of
    onnxruntime-training 1.19.2's artifacts for the same block."""
    from onnxtrain.training.api import CheckpointState, Module, Optimizer

    net, model = simple
    weight_decay, lr = 123.0, 1e-3
    base = str(tmp_path / "base.onnx")
    onnx.save(model, base)
    gen = torch.Generator().manual_seed(11)
    data = {}
    for i in range(2):
        data[f"x{i}"] = torch.randn(BATCH, IN, generator=gen).numpy()
        data[f"labels{i}"] = torch.randint(0, OUT, (BATCH,), generator=gen).numpy()
    np.savez(tmp_path / "data.npz", **data)
    (tmp_path / "theirs").mkdir()
    theirs = run_script(_ORT_WEIGHT_DECAY, base, str(tmp_path / "theirs"), str(tmp_path / "data.npz"),
                        str(weight_decay), str(lr), json.dumps(PARAMS))
    assert theirs.pop("decays") == [weight_decay]

    ours_dir = tmp_path / "ours"
    ours_dir.mkdir()
    artifacts.generate_artifacts(model, requires_grad=PARAMS, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=onnxblock.optim.AdamW(weight_decay=weight_decay),
                                 artifact_directory=ours_dir)
    state = CheckpointState.load_checkpoint(ours_dir / "checkpoint")
    module = Module(str(ours_dir / "training_model.onnx"), state)
    opt = Optimizer(str(ours_dir / "optimizer_model.onnx"), module)
    opt.set_learning_rate(lr)
    for i in range(2):
        module(data[f"x{i}"], data[f"labels{i}"])
        opt.step()
        module.lazy_reset_grad()
    start = {n: p.detach().numpy() for n, p in net.named_parameters()}
    for n in PARAMS:
        ours = state.parameters[n].data
        assert not np.allclose(ours, start[n])  # the decay moved them
        np.testing.assert_allclose(ours.ravel(), theirs[n], rtol=1e-5, atol=1e-6, err_msg=n)
