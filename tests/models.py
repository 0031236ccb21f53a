"""A zoo of small torch models, exported to ONNX once per test session.

``export(name, training=..., with_loss=..., batch=...)`` returns ``(ModelProto, example feeds,
torch module)``. Every model is built under a fixed seed, so its weights are the same in every process;
the exported graph
has a dynamic batch axis on every input. With ``with_loss=True`` the module wraps model and loss (cross
entropy on integer labels, or BCE-with-logits for the recommender), takes the labels as a second input and
the graph's single output is named ``loss``; otherwise it is named ``logits``.

Importing this module needs torch (tests only; the package never imports torch).
"""

from __future__ import annotations

import copy
import functools
import io
import itertools
import math
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import onnx
import torch
from onnx import numpy_helper
from torch import nn

SEED = 1234
OPSET = 17


# ---- models ------------------------------------------------------------------------------------------
class MLP(nn.Module):
    """Flatten → Linear/ReLU stack → classes."""

    def __init__(self, dims: tuple[int, ...] = (784, 64, 32, 10)):
        super().__init__()
        layers: list[nn.Module] = [nn.Flatten()]
        for k, (a, b) in enumerate(itertools.pairwise(dims)):
            layers.append(nn.Linear(a, b))
            if k < len(dims) - 2:
                layers.append(nn.ReLU())
        self.net = nn.Sequential(*layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNetBN(nn.Module):
    """Two (conv5 pad2 → BatchNorm → ReLU → maxpool2) stages, then dropout and a linear classifier."""

    def __init__(self, dropout: float = 0.25, classes: int = 10, size: int = 16):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.BatchNorm2d(6),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 12, 5, padding=2),
            nn.BatchNorm2d(12),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(12 * (size // 4) ** 2, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.drop(torch.flatten(self.features(x), 1)))


class TransformerEncoder(nn.Module):
    """Token + position embeddings, ``layers`` TransformerEncoderLayers (GELU), mean pool, classifier."""

    def __init__(
        self,
        vocab: int = 50,
        seq: int = 12,
        d: int = 32,
        heads: int = 4,
        ff: int = 64,
        layers: int = 1,
        dropout: float = 0.1,
        classes: int = 5,
    ):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, ff, dropout=dropout, activation="gelu", batch_first=True)
            for _ in range(layers)
        )
        self.head = nn.Linear(d, classes)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(self.positions[: tokens.shape[1]])
        for layer in self.layers:
            h = layer(h)
        return self.head(h.mean(dim=1))


class CausalSelfAttention(nn.Module):
    """GPT-style attention: fused qkv projection, causal mask from a tril buffer, output projection."""

    def __init__(self, d: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.attn_drop = nn.Dropout(dropout)
        self.resid_drop = nn.Dropout(dropout)
        self.register_buffer("mask", torch.tril(torch.ones(seq, seq)).view(1, 1, seq, seq))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        hd = c // self.heads
        q = q.view(b, t, self.heads, hd).transpose(1, 2)
        k = k.view(b, t, self.heads, hd).transpose(1, 2)
        v = v.view(b, t, self.heads, hd).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(hd))
        att = att.masked_fill(self.mask[:, :, :t, :t] == 0, float("-inf"))
        att = self.attn_drop(torch.softmax(att, dim=-1))
        y = (att @ v).transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_drop(self.proj(y))


class GPTBlock(nn.Module):
    """Embeddings, one pre-LN transformer block (causal attention, tanh-GELU MLP), final LN, vocab head."""

    def __init__(self, vocab: int = 40, seq: int = 10, d: int = 32, heads: int = 4, dropout: float = 0.1):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.drop = nn.Dropout(dropout)
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.mlp_drop = nn.Dropout(dropout)
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        t = tokens.shape[1]
        h = self.drop(self.tok(tokens) + self.pos(self.positions[:t]))
        h = h + self.attn(self.ln1(h))
        h = h + self.mlp_drop(self.fc_out(nn.functional.gelu(self.fc(self.ln2(h)), approximate="tanh")))
        return self.head(self.ln_f(h))


class ResNetBlock(nn.Module):
    """A stem conv, one basic block (conv-BN-ReLU-conv-BN + identity skip, ReLU), global pool, classifier."""

    def __init__(self, channels: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(
            nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()
        )
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        y = torch.relu(self.bn1(self.conv1(h)))
        y = self.bn2(self.conv2(y))
        h = torch.relu(y + h)
        return self.fc(torch.flatten(self.pool(h), 1))


class RNNClassifier(nn.Module):
    """Embedding → 2-layer bidirectional batch-first LSTM, GRU or ReLU RNN → last time step → Linear."""

    def __init__(self, cell: str = "lstm", vocab: int = 30, d: int = 16, hidden: int = 12, classes: int = 4):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        if cell == "rnn_relu":  # exported as an ONNX RNN with activations ["Relu", "Relu"]
            self.rnn = nn.RNN(d, hidden, num_layers=2, bidirectional=True, batch_first=True,
                              nonlinearity="relu")
        else:
            rnn = nn.LSTM if cell == "lstm" else nn.GRU
            self.rnn = rnn(d, hidden, num_layers=2, bidirectional=True, batch_first=True)
        self.fc = nn.Linear(2 * hidden, classes)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(tokens))
        return self.fc(out[:, -1])


class Recommender(nn.Module):
    """User and item embeddings + dense features → concat → MLP → one logit per row."""

    def __init__(self, users: int = 20, items: int = 30, d: int = 8, dense: int = 4, hidden: int = 16):
        super().__init__()
        self.user = nn.Embedding(users, d)
        self.item = nn.Embedding(items, d)
        self.mlp = nn.Sequential(nn.Linear(2 * d + dense, hidden), nn.ReLU(), nn.Linear(hidden, 1))

    def forward(self, user: torch.Tensor, item: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
        h = torch.cat([self.user(user), self.item(item), dense], dim=1)
        return self.mlp(h).squeeze(1)


class SpatialTransformer(nn.Module):
    """A localisation net predicts an affine theta per image; the sampling grid is the base grid times
    thetaᵀ; ``grid_sample`` (ONNX GridSample) resamples the image for a small conv classifier."""

    def __init__(self, size: int = 10, classes: int = 5):
        super().__init__()
        self.loc = nn.Sequential(nn.Conv2d(1, 4, 3), nn.ReLU(), nn.Flatten(),
                                 nn.Linear(4 * (size - 2) ** 2, 6))
        ys, xs = torch.meshgrid(torch.linspace(-1, 1, size), torch.linspace(-1, 1, size), indexing="ij")
        self.register_buffer("base", torch.stack([xs, ys, torch.ones_like(xs)], -1).reshape(-1, 3))
        self.head = nn.Sequential(nn.Conv2d(1, 6, 3, padding=1), nn.ReLU(), nn.Flatten(),
                                  nn.Linear(6 * size * size, classes))
        self.size = size

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        theta = self.loc(x).reshape(-1, 2, 3)
        grid = (self.base @ theta.transpose(1, 2)).reshape(-1, self.size, self.size, 2)
        return self.head(nn.functional.grid_sample(x, grid, align_corners=False))


class FakeQuantMLP(nn.Module):
    """Quantization-aware training as torch exports it: fake-quantized input (int8), first-layer weight
    (int8, per output channel) and hidden activation (uint8), each a QuantizeLinear → DequantizeLinear
    pair in ONNX."""

    def __init__(self, d_in: int = 16, hidden: int = 12, classes: int = 4):
        super().__init__()
        self.fc1 = nn.Linear(d_in, hidden)
        self.fc2 = nn.Linear(hidden, classes)
        self.register_buffer("w_scale", torch.full((hidden,), 0.02))
        self.register_buffer("w_zero", torch.zeros(hidden, dtype=torch.int32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.fake_quantize_per_tensor_affine(x, 0.05, 0, -128, 127)
        w = torch.fake_quantize_per_channel_affine(self.fc1.weight, self.w_scale, self.w_zero, 0, -128, 127)
        h = nn.functional.relu(nn.functional.linear(x, w, self.fc1.bias))
        return self.fc2(torch.fake_quantize_per_tensor_affine(h, 0.05, 0, 0, 255))


class SpectrogramClassifier(nn.Module):
    """A learnable filter on the waveform (Conv1d), then ``torch.stft`` (ONNX STFT) with a Hann window,
    log power, and a linear classifier: the gradient reaches the filter through STFT."""

    def __init__(self, samples: int = 80, n_fft: int = 16, hop: int = 8, classes: int = 3):
        super().__init__()
        self.filt = nn.Conv1d(1, 1, 5, padding=2)
        self.register_buffer("window", torch.hann_window(n_fft))
        frames = (samples - n_fft) // hop + 1
        self.fc = nn.Linear((n_fft // 2 + 1) * frames, classes)
        self.n_fft, self.hop = n_fft, hop

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = self.filt(x.unsqueeze(1)).squeeze(1)
        s = torch.stft(w, n_fft=self.n_fft, hop_length=self.hop, window=self.window, center=False,
                       return_complex=False, onesided=True)
        return self.fc(torch.log((s ** 2).sum(-1) + 1e-3).flatten(1))


class WithLoss(nn.Module):
    """``model`` followed by its loss; the labels are the last forward argument."""

    def __init__(self, model: nn.Module, loss: nn.Module):
        super().__init__()
        self.model = model
        self.loss = loss

    def forward(self, *args: torch.Tensor) -> torch.Tensor:
        return self.loss(self.model(*args[:-1]), args[-1])


# ---- registry ----------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Spec:
    """How to build one model and its example inputs."""

    build: Callable[[float], nn.Module]  # dropout → module
    inputs: Callable[[np.random.Generator, int], dict[str, np.ndarray]]  # (rng, batch) → feeds
    labels: Callable[[np.random.Generator, int], np.ndarray]
    loss: Callable[[], nn.Module]
    dropout: float = 0.1


def _tokens(vocab: int, seq: int) -> Callable[[np.random.Generator, int], dict[str, np.ndarray]]:
    return lambda rng, b: {"tokens": rng.integers(0, vocab, (b, seq)).astype(np.int64)}


def _images(channels: int, size: int) -> Callable[[np.random.Generator, int], dict[str, np.ndarray]]:
    return lambda rng, b: {"x": rng.standard_normal((b, channels, size, size), np.float32)}


def _classes(n: int) -> Callable[[np.random.Generator, int], np.ndarray]:
    return lambda rng, b: rng.integers(0, n, b).astype(np.int64)


def _ce_seq() -> nn.Module:
    return _SeqCE()


class _SeqCE(nn.Module):
    """Cross entropy over (batch, seq, vocab) logits and (batch, seq) labels."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1))


MODELS: dict[str, Spec] = {
    "mlp": Spec(lambda p: MLP(), _images(1, 28), _classes(10), nn.CrossEntropyLoss, dropout=0.0),
    "lenet_bn": Spec(lambda p: LeNetBN(p), _images(1, 16), _classes(10), nn.CrossEntropyLoss, dropout=0.25),
    "transformer_encoder": Spec(
        lambda p: TransformerEncoder(dropout=p), _tokens(50, 12), _classes(5), nn.CrossEntropyLoss
    ),
    "gpt_block": Spec(
        lambda p: GPTBlock(dropout=p),
        _tokens(40, 10),
        lambda rng, b: rng.integers(0, 40, (b, 10)).astype(np.int64),
        _ce_seq,
    ),
    "resnet_block": Spec(
        lambda p: ResNetBlock(), _images(3, 8), _classes(10), nn.CrossEntropyLoss, dropout=0.0
    ),
    "lstm_cls": Spec(lambda p: RNNClassifier("lstm"), _tokens(30, 7), _classes(4), nn.CrossEntropyLoss, 0.0),
    "gru_cls": Spec(lambda p: RNNClassifier("gru"), _tokens(30, 7), _classes(4), nn.CrossEntropyLoss, 0.0),
    "rnn_relu_cls": Spec(lambda p: RNNClassifier("rnn_relu"), _tokens(30, 7), _classes(4),
                         nn.CrossEntropyLoss, 0.0),
    "spatial_transformer": Spec(lambda p: SpatialTransformer(), _images(1, 10), _classes(5),
                                nn.CrossEntropyLoss, 0.0),
    "fake_quant_mlp": Spec(lambda p: FakeQuantMLP(),
                           lambda rng, b: {"x": rng.standard_normal((b, 16), np.float32)}, _classes(4),
                           nn.CrossEntropyLoss, 0.0),
    "spectrogram_cls": Spec(lambda p: SpectrogramClassifier(),
                            lambda rng, b: {"x": rng.standard_normal((b, 80), np.float32)}, _classes(3),
                            nn.CrossEntropyLoss, 0.0),
    "recommender": Spec(
        lambda p: Recommender(),
        lambda rng, b: {
            "user": rng.integers(0, 20, b).astype(np.int64),
            "item": rng.integers(0, 30, b).astype(np.int64),
            "dense": rng.standard_normal((b, 4), np.float32),
        },
        lambda rng, b: rng.integers(0, 2, b).astype(np.float32),
        nn.BCEWithLogitsLoss,
        dropout=0.0,
    ),
}

NAMES = tuple(MODELS)


def build(name: str, dropout: float | None = None, with_loss: bool = False) -> nn.Module:
    """The torch module ``name`` with seeded weights (the same on every call), optionally with its loss."""
    spec = MODELS[name]
    torch.manual_seed(SEED)
    m = spec.build(spec.dropout if dropout is None else dropout)
    return WithLoss(m, spec.loss()) if with_loss else m


def example_inputs(
    name: str, batch: int = 4, with_loss: bool = False, seed: int = 0
) -> dict[str, np.ndarray]:
    """Feeds for ``name`` (with ``labels`` when ``with_loss``), from a seeded generator."""
    spec = MODELS[name]
    rng = np.random.default_rng(seed)
    feeds = spec.inputs(rng, batch)
    if with_loss:
        feeds["labels"] = spec.labels(rng, batch)
    return feeds


def export(
    name: str, training: bool = True, with_loss: bool = False, batch: int = 4, dropout: float | None = None
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], nn.Module]:
    """Export model ``name`` to ONNX (opset 17, dynamic batch); returns ``(model, feeds, torch module)``.

    The export is cached per process: callers must not mutate the returned ModelProto (copy it first);
    the module is a fresh copy on every call, in the mode asked for, with the graph's initializer values.
    ``training`` picks TrainingMode.TRAINING (BatchNorm/Dropout as training ops) or EVAL;
    ``dropout`` overrides the model's dropout probability (e.g. 0.0 for a deterministic training graph).
    """
    model, module = _export(name, training, with_loss, dropout)
    return model, example_inputs(name, batch, with_loss), copy.deepcopy(module)


@functools.cache
def _export(
    name: str, training: bool, with_loss: bool, dropout: float | None
) -> tuple[onnx.ModelProto, nn.Module]:
    module = build(name, dropout, with_loss)
    model = export_module(
        module,
        example_inputs(name, 2, with_loss),
        "loss" if with_loss else "logits",
        training,
        batch_output=not with_loss,
    )
    return model, module


def export_module(
    module: nn.Module, feeds: dict[str, np.ndarray], output: str, training: bool, batch_output: bool = True
) -> onnx.ModelProto:
    """Export ``module`` called on ``feeds`` (in order) with axis 0 of every input named ``batch``.

    The module is left in the mode asked for and with the weights it had (tracing in training mode would
    update BatchNorm running statistics; the graph's initializers get the values from before).
    """
    module.train(training)
    names = list(feeds)
    args = tuple(torch.from_numpy(v) for v in feeds.values())
    dynamic: dict[str, Any] = {n: {0: "batch"} for n in names}
    if batch_output:
        dynamic[output] = {0: "batch"}
    buf = io.BytesIO()
    before = {k: v.clone() for k, v in module.state_dict().items()}
    # not under no_grad: it would pick TransformerEncoderLayer's fused fast path, which has no ONNX export
    with warnings.catch_warnings():  # tracer and BatchNorm-mutation notes are expected here
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            args,
            buf,
            dynamo=False,
            opset_version=OPSET,
            input_names=names,
            output_names=[output],
            training=torch.onnx.TrainingMode.TRAINING if training else torch.onnx.TrainingMode.EVAL,
            do_constant_folding=False,
            dynamic_axes=dynamic,
        )
    module.load_state_dict(before)
    module.train(training)  # export may flip the mode back; leave it as asked
    model = onnx.load_from_string(buf.getvalue())
    for t in model.graph.initializer:
        if t.name in before:
            t.CopyFrom(numpy_helper.from_array(before[t.name].numpy(), t.name))
    return model


@functools.cache
def export_dynamo(name: str) -> tuple[onnx.ModelProto, nn.Module]:
    """Model ``name`` with its loss, in training mode, exported by torch's default (dynamo) exporter at its
    default opset, with dropout 0. ``optimize=False`` keeps every parameter an initializer under its torch
    name (the exporter's optimizer folds and merges them). Cached: copy before mutating."""
    module = build(name, 0.0, with_loss=True)
    module.train(True)
    feeds = example_inputs(name, 2, with_loss=True)
    before = copy.deepcopy(module.state_dict())
    with warnings.catch_warnings():  # the exporter's notes (torchvision missing, ...) are expected here
        warnings.simplefilter("ignore")
        program = torch.onnx.export(module, tuple(torch.from_numpy(v) for v in feeds.values()), dynamo=True,
                                    optimize=False, input_names=list(feeds), output_names=["loss"],
                                    verbose=False)
    module.load_state_dict(before)
    return program.model_proto, module


def export_torchscript(module: nn.Module, args: tuple, inputs: list[str], outputs: list[str], dynamic: dict,
                       script: bool = False, training: bool = False) -> onnx.ModelProto:
    """Export ``module`` with torch's TorchScript exporter, the one that writes control flow: ``script``
    compiles it first (an ``if`` or ``for`` on data becomes an If or a Loop); ``training`` keeps training
    mode and skips constant folding, for a model to train."""
    buf = io.BytesIO()
    extra: dict[str, Any] = (
        {"training": torch.onnx.TrainingMode.TRAINING, "do_constant_folding": False} if training else {}
    )
    with warnings.catch_warnings():  # TorchScript's deprecation and tracer notes are expected here
        warnings.simplefilter("ignore")
        torch.onnx.export(torch.jit.script(module) if script else module, args, buf, dynamo=False,
                          opset_version=OPSET, input_names=inputs, output_names=outputs, dynamic_axes=dynamic,
                          **extra)
    return onnx.load_from_string(buf.getvalue())


def torch_forward(module: nn.Module, feeds: dict[str, np.ndarray]) -> np.ndarray:
    """Run ``module`` on numpy feeds (in feed order) and return a numpy result."""
    with torch.no_grad():
        return module(*(torch.from_numpy(v) for v in feeds.values())).numpy()
