"""More of onnxruntime-training's private operators, met in the artifacts of common layers.

onnxruntime-training 1.19.2 (its own virtual environment, tests/ortt.py) generates the artifacts of small
torch models built to produce them: SiLU (its QuickGelu fusion), LeakyReLU, slicing and concatenation,
a division, top-k, average pooling, LSTM and GRU layers, and (written with onnx.helper) softmaxes
before opset 13 and a GatherND. Where it can train them on CPU, onnxtrain must
reach its losses and weights; where it cannot (its ResizeGrad and ConvTransposeGrad run only on CUDA, its
LSTMGrad only one way), onnxtrain trains the translated files with plain SGD and must reach the losses of
the same torch model trained by torch.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.ort_artifacts import translate_training_model
from tests.ortt import PREAMBLE, ensure_ortt

torch = pytest.importorskip("torch")
nn, F = torch.nn, torch.nn.functional

STEPS = 6


class ActMix(nn.Module):
    """SiLU, LeakyReLU, a slice, a concatenation, a division and top-k."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 16)

    def forward(self, x):
        h = F.leaky_relu(self.b(F.silu(self.a(x))), 0.1)
        h = torch.cat([h[:, 2:10], x], -1)
        h = h / h.norm(dim=-1, keepdim=True)
        return h.topk(4, -1)[0]


class PoolNet(nn.Module):
    """Average pooling with and without padding."""

    def __init__(self) -> None:
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 6, 3), nn.Conv2d(6, 4, 3)

    def forward(self, x):
        return F.avg_pool2d(self.c2(F.avg_pool2d(self.c1(x), 3, 2, 1)), 2)


class Recurrent(nn.Module):
    """An LSTM or GRU layer (either direction or both) and a linear head."""

    def __init__(self, kind: str, bidirectional: bool = False) -> None:
        super().__init__()
        cls = nn.LSTM if kind == "lstm" else nn.GRU
        self.rnn = cls(8, 12, batch_first=True, bidirectional=bidirectional)
        self.head = nn.Linear(24 if bidirectional else 12, 3)

    def forward(self, x):
        return self.head(self.rnn(x)[0])


def new_gelu(h):
    """The tanh GELU written out, as GPT-2 code does (nanoGPT's NewGELU)."""
    return 0.5 * h * (1 + torch.tanh(0.7978845608 * (h + 0.044715 * h**3)))


class RMSNormGelu(nn.Module):
    """RMS normalisation and the tanh GELU written out, as GPT-style code does (its fusions of them)."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, 16))

    def forward(self, x):
        h = self.a(x)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6) * self.scale
        h = new_gelu(h)
        return self.b(h)


class LinearTanhGelu(nn.Module):
    """GPT-2's tanh GELU written out after a linear layer (nanoGPT's NewGELU): onnxruntime-training fuses
    the bias into its FastGelu and writes BiasFastGeluGrad_dX."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        h = self.a(x)
        return self.b(new_gelu(h))


class TanhGeluOp(nn.Module):
    """torch's tanh GELU, exported at opset 20 as ONNX's Gelu(approximate="tanh"): onnxruntime-training
    writes its exact (erf) GeluGrad for it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(12, 16), nn.Linear(16, 5)

    def forward(self, x):
        return self.b(F.gelu(self.a(x), approximate="tanh"))


class UpNet(nn.Module):
    """A transposed convolution, nearest and bilinear upsampling."""

    def __init__(self) -> None:
        super().__init__()
        self.t, self.c = nn.ConvTranspose2d(3, 5, 3, stride=2), nn.Conv2d(5, 2, 3)

    def forward(self, x):
        h = F.interpolate(self.t(x), scale_factor=2, mode="nearest")
        return F.interpolate(self.c(h), scale_factor=2, mode="bilinear")


def softmax_gather_nd(opset: int, gather: bool | None = None) -> onnx.ModelProto:
    """A Softmax over axis 1 (before opset 13, over axes 1 and 2 together: onnxruntime-training then writes
    its pre-13 SoftmaxGrad and LogSoftmaxGrad), a LogSoftmax over the last axis and, from opset 16, a
    GatherND of (row, column) pairs (``gather``: with it or not whatever the opset)."""
    rng = np.random.default_rng(3)
    inits = [
        onnx.numpy_helper.from_array((rng.standard_normal((6, 8)) * 0.4).astype(np.float32), "W"),
        onnx.numpy_helper.from_array((rng.standard_normal(8) * 0.1).astype(np.float32), "b"),
        onnx.numpy_helper.from_array(np.array([[0, 1], [2, 0], [1, 3], [2, 0]], np.int64), "pairs"),
    ]
    gather = opset >= 16 if gather is None else gather
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["xw"]),
        helper.make_node("Add", ["xw", "b"], ["h"]),
        helper.make_node("Softmax", ["h"], ["s"], axis=1),
        helper.make_node("LogSoftmax", ["h"], ["ls"], axis=2),
        helper.make_node("Add", ["s", "ls"], ["a" if gather else "y"]),
    ]
    if gather:  # (2, 0) twice: the gradient adds both
        nodes.append(helper.make_node("GatherND", ["a", "pairs"], ["y"]))
    graph = helper.make_graph(
        nodes,
        f"opset{opset}",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [3, 4, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8] if gather else [3, 4, 8])],
        inits if gather else inits[:2],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])


def product_then(op: str) -> onnx.ModelProto:
    """x [4, 8] times a trained W, then ``op``: "qdq" (QuantizeLinear → DequantizeLinear, scale 0.05 as a
    Constant node: onnxruntime-training fuses the pair into its FakeQuant) or "trilu" (the upper triangle,
    k = 1 fed as a constant: the gradient is its Trilu)."""
    w = (np.random.default_rng(4).standard_normal((8, 8)) * 0.5).astype(np.float32)
    if op == "qdq":
        scale = onnx.numpy_helper.from_array(np.array(0.05, np.float32))
        tail = [
            helper.make_node("Constant", [], ["scale"], value=scale),
            helper.make_node("QuantizeLinear", ["a", "scale"], ["q"]),
            helper.make_node("DequantizeLinear", ["q", "scale"], ["y"]),
        ]
    else:
        one = onnx.numpy_helper.from_array(np.array(1, np.int64))
        tail = [
            helper.make_node("Constant", [], ["k"], value=one),
            helper.make_node("Trilu", ["a", "k"], ["y"]),
        ]
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["a"]), *tail],
        op,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 8])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 8])],
        [onnx.numpy_helper.from_array(w, "W")],
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


class DynamicAttention(nn.Module):
    """Pre-LN multi-head self-attention (one fused QKV product) with a residual, exported with dynamic batch
    and sequence axes: the gradients' broadcasts are undone by shapes known only at run time
    (``BroadcastGradientArgs``, and before opset 13 ``ReduceSumTraining``). ``causal``: the longest
    sequence of a causal mask (0: none)."""

    def __init__(self, d: int = 8, heads: int = 2, causal: int = 0) -> None:
        super().__init__()
        self.heads, self.ln, self.qkv, self.out = heads, nn.LayerNorm(d), nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.causal = causal
        if causal:  # boolean, so that it is not among the trained float initializers
            mask = torch.tril(torch.ones(causal, causal, dtype=torch.bool))
            self.register_buffer("mask", mask.view(1, 1, causal, causal))

    def forward(self, x):
        b, t, c = x.size()
        h = self.heads
        q, k, v = (z.view(b, t, h, c // h).transpose(1, 2) for z in self.qkv(self.ln(x)).split(c, 2))
        att = (q @ k.transpose(-2, -1)) * (c // h) ** -0.5
        if self.causal:
            att = att.masked_fill(~self.mask[:, :, :t, :t], float("-inf"))
        att = F.softmax(att, dim=-1)
        return x + self.out((att @ v).transpose(1, 2).contiguous().view(b, t, c))


class CausalBlock(nn.Module):
    """A nanoGPT-style block on float inputs: causal ``DynamicAttention``, then LayerNorm, the tanh GELU
    written out (NewGELU) between two linear layers, and a residual; exported with dynamic axes."""

    def __init__(self, d: int = 8, heads: int = 2, most: int = 16) -> None:
        super().__init__()
        self.attn, self.ln = DynamicAttention(d, heads, causal=most), nn.LayerNorm(d)
        self.fc, self.out = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        x = self.attn(x)
        return x + self.out(new_gelu(self.fc(self.ln(x))))


_DYNAMIC = {0: "batch", 1: "time"}
# case: (module or ONNX model, input shape, trained by onnxruntime-training (else by torch, with SGD)[,
# export options: the opset (default 17), dynamic axes of x and y])
CASES = {
    "act_mix": (ActMix, (4, 12), True),
    "pool": (PoolNet, (2, 3, 13, 13), True),
    "rms_gelu": (RMSNormGelu, (3, 4, 12), True),
    "linear_tanh_gelu": (LinearTanhGelu, (3, 4, 12), True),
    "gelu_op_tanh": (TanhGeluOp, (3, 4, 12), True, {"opset": 20}),
    "lstm": (lambda: Recurrent("lstm"), (2, 5, 8), True),
    "gru": (lambda: Recurrent("gru"), (2, 5, 8), True),
    "upsample": (UpNet, (2, 3, 5, 5), False),
    "lstm_bidirectional": (lambda: Recurrent("lstm", True), (2, 5, 8), False),
    "opset12_softmax": (lambda: softmax_gather_nd(12), (3, 4, 6), True),
    "gather_nd": (lambda: softmax_gather_nd(17), (3, 4, 6), True),
    # onnxruntime-training's GatherNDGrad in an opset-14 model: the translation moves it to opset 16
    "gather_nd_opset14": (lambda: softmax_gather_nd(14, gather=True), (3, 4, 6), True),
    # shapes known only at run time: BroadcastGradientArgs (opset 14), with ReduceSumTraining (opset 12)
    "dynamic_attention": (DynamicAttention, (3, 4, 8), True, {"opset": 14, "dynamic": _DYNAMIC}),
    "dynamic_attention_opset12": (DynamicAttention, (3, 4, 8), True, {"opset": 12, "dynamic": _DYNAMIC}),
    "causal_block": (CausalBlock, (3, 5, 8), True, {"opset": 14, "dynamic": _DYNAMIC}),
    # quantisation-aware training (its FakeQuant and FakeQuantGrad), and its own Trilu as a gradient
    "fake_quant": (lambda: product_then("qdq"), (4, 8), True),
    "trilu": (lambda: product_then("trilu"), (4, 8), True),
}
LR = {True: 1e-2, False: 0.1}

_ORT_SCRIPT = PREAMBLE + r"""
import numpy as np
from onnxruntime.training import artifacts

res = {}
for name, (base, folder, data, train, lr, steps) in json.loads(sys.argv[1]).items():
    model = onnx.load(base)
    model.ir_version = 10
    floats = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    artifacts.generate_artifacts(model, requires_grad=floats,
                                 loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW if train else artifacts.OptimType.SGD,
                                 artifact_directory=folder)
    if not train:
        continue
    batch = np.load(data)
    state, m, o = open_artifacts(folder, lr)
    losses = []
    for i in range(steps):
        losses.append(float(m(batch["x"], batch["target"]))); o.step(); m.lazy_reset_grad()
    np.savez(folder + "/final.npz", **{k: p.data for k, p in state.parameters})
    res[name] = losses
print(json.dumps(res))
"""


def _torch_losses(module, batch: dict[str, np.ndarray]) -> list[float]:
    """The losses of ``module`` trained by torch with plain SGD on the MSE loss."""
    opt = torch.optim.SGD(module.parameters(), lr=LR[False])
    x, target = torch.from_numpy(batch["x"]), torch.from_numpy(batch["target"])
    losses = []
    for _ in range(STEPS):
        opt.zero_grad()
        loss = F.mse_loss(module(x), target)
        loss.backward()
        opt.step()
        losses.append(float(loss))
    return losses


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, tuple[str, dict[str, np.ndarray], list[float]]]:
    """Each case's artifact folder (generated by onnxruntime-training), its batch and the reference
    losses: onnxruntime-training's own, or torch's."""
    python = ensure_ortt()
    root = tmp_path_factory.mktemp("ort_layers")
    cases, batches, modules = {}, {}, {}
    for name, (make, shape, train, *options) in CASES.items():
        export = options[0] if options else {}
        torch.manual_seed(0)
        made = make()
        x = torch.from_numpy(np.random.default_rng(1).standard_normal(shape).astype(np.float32))
        folder = root / name
        (folder / "artifacts").mkdir(parents=True)
        base = str(folder / "base.onnx")
        if isinstance(made, onnx.ModelProto):  # written by hand: its output shape from its declaration
            dims = [d.dim_value for d in made.graph.output[0].type.tensor_type.shape.dim]
            target = np.random.default_rng(2).standard_normal(dims).astype(np.float32)
            onnx.save(made, base)
        else:
            module = made.train()
            with torch.no_grad():
                target = np.random.default_rng(2).standard_normal(module(x).shape).astype(np.float32)
            torch.onnx.export(
                module,
                (x,),
                base,
                dynamo=False,
                opset_version=export.get("opset", 17),
                input_names=["x"],
                output_names=["y"],
                dynamic_axes={v: export["dynamic"] for v in ("x", "y")} if "dynamic" in export else None,
                training=torch.onnx.TrainingMode.TRAINING,
                do_constant_folding=False,
            )
            modules[name] = module
        batches[name] = {"x": x.numpy(), "target": target}
        np.savez(folder / "batch.npz", **batches[name])
        cases[name] = (base, str(folder / "artifacts"), str(folder / "batch.npz"), train, LR[train], STEPS)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [python, "-c", _ORT_SCRIPT, json.dumps(cases)], capture_output=True, text=True, env=env, timeout=900
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    theirs = json.loads(proc.stdout.strip().splitlines()[-1])
    return {
        name: (
            cases[name][1],
            batches[name],
            theirs[name] if CASES[name][2] else _torch_losses(modules[name], batches[name]),
        )
        for name in CASES
    }


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_layer_artifacts_train_like_the_reference(runs, name):
    folder, batch, want = runs[name]
    translated = translate_training_model(onnx.load(os.path.join(folder, "training_model.onnx")))
    onnx.checker.check_model(translated, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in translated.graph.node)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR[CASES[name][2]])
    got = []
    for _ in range(STEPS):
        got.append(float(np.asarray(module(batch["x"], batch["target"])).reshape(-1)[0]))
        opt.step()
        module.lazy_reset_grad()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
    assert got[-1] < got[0]
    if CASES[name][2]:
        final = np.load(os.path.join(folder, "final.npz"))
        for k, p in state.parameters:
            np.testing.assert_allclose(p.data, final[k], atol=1e-4, rtol=1e-3, err_msg=k)


def test_gather_nd_gradient_of_an_opset_14_model_moves_to_opset_16(runs):
    """onnxruntime-training keeps the model's opset 14 and writes GatherNDGrad; the translation is at 16 (the
    case trains like onnxruntime-training above)."""
    model = onnx.load(os.path.join(runs["gather_nd_opset14"][0], "training_model.onnx"))
    assert [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")] == [14]
    assert "GatherNDGrad" in {n.op_type for n in model.graph.node}
    translated = translate_training_model(model)
    assert [o.version for o in translated.opset_import if o.domain in ("", "ai.onnx")] == [16]


def test_tanh_gelu_op_gets_the_exact_gelu_gradient(runs):
    """onnxruntime-training differentiates Gelu(approximate="tanh") with its exact (erf) GeluGrad; the
    translation follows it (the case above trains as onnxruntime-training trains it)."""
    model = onnx.load(os.path.join(runs["gelu_op_tanh"][0], "training_model.onnx"))
    gelu = [n for n in model.graph.node if n.op_type == "Gelu"]
    assert [helper.get_attribute_value(a) for n in gelu for a in n.attribute] == [b"tanh"]
    assert [n.op_type for n in model.graph.node if n.domain == "com.microsoft" and "Gelu" in n.op_type] == [
        "GeluGrad"
    ]


@pytest.mark.slow
def test_the_layers_produce_the_newly_translated_operators(runs):
    seen = set()
    for folder, _, _ in runs.values():
        model = onnx.load(os.path.join(folder, "training_model.onnx"))
        seen |= {
            n.op_type for n in model.graph.node if n.domain == "com.microsoft" or not onnx.defs.has(n.op_type)
        }
    assert {
        "AveragePoolGrad",
        "BiasFastGeluGrad_dX",
        "BroadcastGradientArgs",
        "ConvTransposeGrad",
        "DivGrad",
        "FastGelu",
        "FakeQuant",
        "FakeQuantGrad",
        "FastGeluGrad",
        "GatherElementsGrad",
        "GatherNDGrad",
        "GRUGrad",
        "GRUTraining",
        "LeakyReluGrad",
        "LogSoftmaxGrad",
        "LSTMGrad",
        "LSTMTraining",
        "QuickGelu",
        "QuickGeluGrad",
        "ReduceSumTraining",
        "ResizeGrad",
        "SimplifiedLayerNormalization",
        "SimplifiedLayerNormalizationGrad",
        "SliceGrad",
        "SoftmaxGrad",
        "SplitTraining",
        "Trilu",
    } <= seen


# shape pairs of a broadcasting op's operands: trailing and leading axes missing, size-1 axes on either side
_SHAPE_PAIRS = [
    ([2, 3, 4], [4]),
    ([4], [2, 3, 4]),
    ([2, 1, 4], [2, 3, 1]),
    ([1, 1], [1]),
    ([3, 1], [1, 1]),
    ([2, 3], [2, 3]),
    ([1], [2, 3]),
    ([5, 1, 1], [1, 1]),
    ([], [2, 3]),
    ([1, 3], [3]),
    ([2, 1, 3, 1], [4, 1, 5]),
]
MS = "com.microsoft"
_ONE_NODE_SCRIPT = PREAMBLE + r"""
import numpy as np, onnxruntime as ort
folder, count = sys.argv[1], int(sys.argv[2])
s = ort.InferenceSession(folder + "/model.onnx", providers=["CPUExecutionProvider"])
for i in range(count):
    feeds = dict(np.load(f"{folder}/feeds{i}.npz"))
    np.savez(f"{folder}/outputs{i}.npz", *s.run(None, feeds))
"""


def _onnxruntime_training_outputs(
    model: onnx.ModelProto, feeds: list[dict], folder
) -> list[list[np.ndarray]]:
    """The outputs of ``model`` (onnxruntime-training's own kernels) on each of ``feeds``, run in its venv."""
    onnx.save(model, folder / "model.onnx")
    for i, f in enumerate(feeds):
        np.savez(folder / f"feeds{i}.npz", **f)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run(
        [ensure_ortt(), "-c", _ONE_NODE_SCRIPT, str(folder), str(len(feeds))],
        capture_output=True, text=True, env=env, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = []
    for i in range(len(feeds)):
        got = np.load(folder / f"outputs{i}.npz")
        out.append([got[f"arr_{k}"] for k in range(len(got.files))])
    return out


def _broadcast_gradient_args_model() -> onnx.ModelProto:
    names = ("a", "b", "a_axes", "b_axes")
    vector = [helper.make_tensor_value_info(n, TensorProto.INT64, [None]) for n in names]
    node = helper.make_node("BroadcastGradientArgs", ["a", "b"], ["a_axes", "b_axes"], domain="com.microsoft")
    graph = helper.make_graph([node], "broadcast_gradient_args", vector[:2], vector[2:])
    opsets = [helper.make_opsetid("", 14), helper.make_opsetid("com.microsoft", 1)]
    return helper.make_model(graph, opset_imports=opsets, ir_version=8)


def test_broadcast_gradient_args_against_onnxruntime_training(tmp_path):
    """The translation of BroadcastGradientArgs gives onnxruntime-training's own kernel's axes, in its order
    (last axis first), for every shape pair; run by onnx.reference."""
    from onnx.reference import ReferenceEvaluator

    model = _broadcast_gradient_args_model()
    feeds = [{"a": np.array(a, np.int64), "b": np.array(b, np.int64)} for a, b in _SHAPE_PAIRS]
    theirs = _onnxruntime_training_outputs(model, feeds, tmp_path)
    translated = translate_training_model(model)
    onnx.checker.check_model(translated, full_check=True)
    ours = ReferenceEvaluator(translated)
    for f, want in zip(feeds, theirs):
        got = ours.run(None, f)
        assert [g.tolist() for g in got] == [w.tolist() for w in want], f
    assert any(w[0].size for w in theirs) and any(w[1].size for w in theirs)


def test_fake_quant_against_onnxruntime_training(tmp_path):
    """The translations of FakeQuant (values on rounding ties, at and beyond both ends of the range; the
    default range and a signed one; a nonzero zero point) and FakeQuantGrad give onnxruntime-training's own
    kernels' outputs, bit for bit."""
    from onnx.reference import ReferenceEvaluator

    ties = [-129.5, -128.5, -0.5, 0.5, 1.5, 2.5, 126.5, 127.5, 254.5, 255.5]
    x = np.array([-200, -10, 3.49, 300, *ties], np.float32)
    cases = [({}, 0.0), ({"quant_min": -128, "quant_max": 127}, 0.0), ({}, 3.0)]
    dy = np.linspace(-1, 1, x.size).astype(np.float32)
    feeds = [{"x": x * 0.5, "scale": np.array(0.5, np.float32), "zero": np.array(z, np.float32), "dy": dy}
             for _, z in cases]
    for (attrs, _), f in zip(cases, feeds):
        nodes = [
            helper.make_node("FakeQuant", ["x", "scale", "zero"], ["y", "mask"], domain=MS, **attrs),
            helper.make_node("FakeQuantGrad", ["dy", "mask"], ["dx"], domain=MS),
        ]
        vec = [None]
        graph = helper.make_graph(
            nodes,
            "fake_quant",
            [helper.make_tensor_value_info("x", TensorProto.FLOAT, vec),
             helper.make_tensor_value_info("scale", TensorProto.FLOAT, []),
             helper.make_tensor_value_info("zero", TensorProto.FLOAT, []),
             helper.make_tensor_value_info("dy", TensorProto.FLOAT, vec)],
            [helper.make_tensor_value_info("y", TensorProto.FLOAT, vec),
             helper.make_tensor_value_info("mask", TensorProto.BOOL, vec),
             helper.make_tensor_value_info("dx", TensorProto.FLOAT, vec)],
        )
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]
        model = helper.make_model(graph, opset_imports=opsets, ir_version=8)
        folder = tmp_path / f"fq{len(attrs)}{int(f['zero'])}"
        folder.mkdir()
        (want,) = _onnxruntime_training_outputs(model, [f], folder)
        translated = translate_training_model(model)
        onnx.checker.check_model(translated, full_check=True)
        got = ReferenceEvaluator(translated).run(None, f)
        for g, w, name in zip(got, want, ("y", "mask", "dx")):
            np.testing.assert_array_equal(g, w, err_msg=f"{attrs} zero {f['zero']}: {name}")
        assert not want[1].all() and want[1].any()


_ALPHA = float(np.float32(1.702))  # QuickGelu's default α, a float attribute
_A = np.sqrt(2 / np.pi)
_BIAS = np.linspace(-0.5, 0.5, 4)
GELUS = {
    # forward op, its gradient op, extra inputs, attributes, the function of x
    "QuickGelu": (
        "QuickGelu",
        "QuickGeluGrad",
        [],
        {"alpha": 1.702},
        lambda v: v / (1 + np.exp(-_ALPHA * v)),
    ),
    "FastGelu_bias": (
        "FastGelu",
        "FastGeluGrad",
        [_BIAS],
        {},
        lambda v: 0.5 * (v + _BIAS) * (1 + np.tanh(_A * ((v + _BIAS) + 0.044715 * (v + _BIAS) ** 3))),
    ),
    "BiasFastGeluGrad_dX": (  # the gradient its bias fusion writes: (dY, X, bias)
        "FastGelu",
        "BiasFastGeluGrad_dX",
        [_BIAS],
        {},
        lambda v: 0.5 * (v + _BIAS) * (1 + np.tanh(_A * ((v + _BIAS) + 0.044715 * (v + _BIAS) ** 3))),
    ),
}


@pytest.mark.parametrize("case", list(GELUS))
def test_gelu_fusions_against_their_definitions(case):
    """The forward fusions against their formulas, their gradients against finite differences."""
    from onnxtrain.engine import compile_model

    op, grad_op, extra, attrs, f = GELUS[case]
    rng = np.random.default_rng(3)
    x, dy = rng.standard_normal((3, 4)), rng.standard_normal((3, 4))

    def run(op_type: str, feeds: dict[str, np.ndarray]) -> np.ndarray:
        vis = [helper.make_tensor_value_info(n, TensorProto.DOUBLE, list(v.shape)) for n, v in feeds.items()]
        node = helper.make_node(op_type, list(feeds), ["out"], name="g", domain="com.microsoft", **attrs)
        model = helper.make_model(
            helper.make_graph(
                [node], "g", vis, [helper.make_tensor_value_info("out", TensorProto.DOUBLE, [3, 4])]
            ),
            opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)],
        )
        translated = translate_training_model(model)
        onnx.checker.check_model(translated, full_check=True)
        return compile_model(translated).run(feeds)[0]

    bias = {"bias": extra[0]} if extra else {}
    np.testing.assert_allclose(run(op, {"x": x, **bias}), f(x), rtol=1e-12)
    h = 1e-6
    np.testing.assert_allclose(
        run(grad_op, {"dy": dy, "x": x, **bias}), dy * (f(x + h) - f(x - h)) / (2 * h), rtol=1e-7, atol=1e-9
    )


def test_gather_nd_gradient_before_opset_16_moves_the_model_to_opset_16():
    """Its standard form is a ScatterND that adds (opset 16): an older model's standard nodes go through
    ONNX's version converter first. The translated gradient adds dY's rows at the gathered positions (a
    repeated pair twice), as numpy's ``np.add.at`` does; every node passes the full checker."""
    from onnx.reference import ReferenceEvaluator

    from onnxtrain.engine import compile_model

    node = helper.make_node(
        "GatherNDGrad", ["shape", "idx", "dy"], ["dx"], name="gnd_grad", domain="com.microsoft"
    )
    ins = [
        helper.make_tensor_value_info("shape", TensorProto.INT64, [3]),
        helper.make_tensor_value_info("idx", TensorProto.INT64, [4, 2]),
        helper.make_tensor_value_info("dy", TensorProto.FLOAT, [4, 8]),
    ]
    nodes = [
        helper.make_node("Relu", ["dy0"], ["dy"]),  # a standard node of opset 12, converted
        node,
    ]
    ins[2].name = "dy0"
    out = helper.make_tensor_value_info("dx", TensorProto.FLOAT, [3, 6, 8])
    model = helper.make_model(
        helper.make_graph(nodes, "g", ins, [out]),
        opset_imports=[helper.make_opsetid("", 12), helper.make_opsetid("com.microsoft", 1)],
    )
    translated = translate_training_model(model)
    assert [o.version for o in translated.opset_import if o.domain == ""] == [16]
    onnx.checker.check_model(translated, full_check=True)
    rng = np.random.default_rng(0)
    idx = np.array([[0, 1], [2, 5], [1, 3], [2, 5]], np.int64)
    dy = rng.standard_normal((4, 8)).astype(np.float32)
    shape = np.array([3, 6, 8], np.int64)
    want = np.zeros((3, 6, 8), np.float32)
    np.add.at(want, (idx[:, 0], idx[:, 1]), np.maximum(dy, 0))
    feeds = {"shape": shape, "idx": idx, "dy0": dy}
    np.testing.assert_array_equal(compile_model(translated).run(feeds)[0], want)
    np.testing.assert_array_equal(ReferenceEvaluator(translated).run(None, feeds)[0], want)
