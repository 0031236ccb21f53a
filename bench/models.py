"""The benchmark's models (torch modules), their ONNX exports and seeded batches.

Each case is a model and a batch size; ``prepare(case, folder)`` writes, for the peers to load:
``model.onnx`` (logits output, for ``generate_artifacts``), ``model_loss.onnx`` (cross entropy in the
graph, output ``loss``, for the legacy ``TrainingSession``), ``model.pt`` (the torch module's weights),
``params.json`` (the trained initializers of both graphs) and ``batches.npz`` (``x0, y0, x1, y1, ...``).
Everything is exported by torch 2.13 (TorchScript exporter, opset 17, eval mode, dropout 0) with the
weights of a fixed seed, so all peers start equal.

Importing this module needs torch (the workers of the peers other than torch never import it).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from bench.common import add_repo_to_path

add_repo_to_path()
from tests.models import SEED, CausalSelfAttention, TransformerEncoder, WithLoss, export_module  # noqa: E402

N_BATCHES = 4  # distinct batches a worker cycles through


class MLP(nn.Module):
    """784-512-512-10 with ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Flatten(), nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 512), nn.ReLU(), nn.Linear(512, 10)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


class LeNet(nn.Module):
    """LeNet-5 on 28×28: conv5 pad2 (6) → ReLU → maxpool2 → conv5 (16) → ReLU → maxpool2 → 120 → 84 → 10."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 6, 5, padding=2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(6, 16, 5),
            nn.ReLU(),
            nn.MaxPool2d(2),
        )
        self.head = nn.Sequential(
            nn.Flatten(),
            nn.Linear(16 * 5 * 5, 120),
            nn.ReLU(),
            nn.Linear(120, 84),
            nn.ReLU(),
            nn.Linear(84, 10),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x))


def _spread_batch_norms(module: nn.Module) -> None:
    """BatchNorm tensors drawn away from their defaults: the exporter would merge equal ones (all scales of a
    width, and every fresh running variance, are ones), tying layers that torch trains apart."""
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.weight.uniform_(0.8, 1.2)
                m.bias.uniform_(-0.1, 0.1)
                m.running_mean.uniform_(-0.1, 0.1)
                m.running_var.uniform_(0.8, 1.2)


def _untie_equal_parameters(module: nn.Module) -> None:
    """Move each parameter whose values equal an earlier one's (LayerNorm scales left at ones, biases left at
    zeros) off them by a seeded draw of up to ±0.05: torch's exporter merges equal initializers into one, so
    the ONNX peers would train one tensor shared by all those places where torch trains each apart (the
    2-layer transformer lost 9 of its 28 parameters that way, the GPT decoder 8 of 29)."""
    seen: list[torch.Tensor] = []
    gen = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for p in module.parameters():
            if any(q.shape == p.shape and torch.equal(q, p) for q in seen):
                p.add_(torch.empty(p.shape).uniform_(-0.05, 0.05, generator=gen))
            seen.append(p.detach().clone())


class InvertedResidual(nn.Module):
    """MobileNetV2's block: 1×1 expansion, 3×3 depthwise (stride 1 or 2), 1×1 projection, each with
    BatchNorm; ReLU6 after the first two; a residual when the shape is kept."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int = 6) -> None:
        super().__init__()
        mid = cin * expand
        self.residual = stride == 1 and cin == cout
        self.body = nn.Sequential(
            nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, mid, 3, stride, 1, groups=mid, bias=False), nn.BatchNorm2d(mid), nn.ReLU6(),
            nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        return x + y if self.residual else y


class MobileNet(nn.Module):
    """A small MobileNetV2 on 3×64×64: stem 3×3 stride 2 (16), five inverted residual blocks down to
    4×4 (24, 24, 32, 32, 64 channels), 1×1 head (256), global average pool, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        blocks = [InvertedResidual(16, 24, 2), InvertedResidual(24, 24, 1), InvertedResidual(24, 32, 2),
                  InvertedResidual(32, 32, 1), InvertedResidual(32, 64, 2)]
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 2, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU6(), *blocks,
            nn.Conv2d(64, 256, 1, bias=False), nn.BatchNorm2d(256), nn.ReLU6(),
        )
        self.head = nn.Linear(256, 10)
        _spread_batch_norms(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class BasicBlock(nn.Module):
    """ResNet's block: two 3×3 convolutions with BatchNorm and ReLU, a 1×1 projection when the shape
    changes."""

    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(),
            nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout),
        )
        self.skip = nn.Sequential() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.skip(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet on 3×32×32: 3×3 stem (16), three stages of two blocks (16, 32, 64 channels at
    32², 16², 8²), global average pool, 10 classes."""

    def __init__(self) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 16, 3, 1, 1, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
            BasicBlock(16, 16, 1), BasicBlock(16, 16, 1), BasicBlock(16, 32, 2), BasicBlock(32, 32, 1),
            BasicBlock(32, 64, 2), BasicBlock(64, 64, 1),
        )
        self.head = nn.Linear(64, 10)
        _spread_batch_norms(self)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).mean(dim=(2, 3)))


class GPT(nn.Module):
    """GPT-style causal decoder: embeddings, ``layers`` pre-LN blocks (causal attention, tanh-GELU MLP),
    final LayerNorm, vocabulary head; logits flattened to ``[batch·seq, vocab]`` for the loss."""

    def __init__(self, vocab: int = 1000, seq: int = 64, d: int = 128, heads: int = 4, layers: int = 2):
        super().__init__()
        self.vocab = vocab
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads, seq) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok(tokens) + self.pos(self.positions[: tokens.shape[1]])
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h)).reshape(-1, self.vocab)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = CausalSelfAttention(d, heads, seq, 0.0)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.fc_out(nn.functional.gelu(self.fc(self.ln2(h)), approximate="tanh"))


class FlatCrossEntropy(nn.Module):
    """Cross entropy with flattened labels (GPT: ``[batch, seq]`` labels, ``[batch·seq, vocab]`` logits)."""

    def forward(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return nn.functional.cross_entropy(logits, labels.reshape(-1))


@dataclass(frozen=True)
class Case:
    """One benchmark row: a model at a batch size."""

    key: str
    title: str
    batch: int

    def build(self) -> nn.Module:
        """The case's torch module with the bench's seeded weights, no two parameters equal."""
        module = self._build()
        _untie_equal_parameters(module)
        return module

    def _build(self) -> nn.Module:
        torch.manual_seed(SEED)
        if self.key.startswith("mlp"):
            return MLP()
        if self.key.startswith("cnn"):
            return LeNet()
        if self.key.startswith("mobilenet"):
            return MobileNet()
        if self.key.startswith("resnet"):
            return ResNet()
        if self.key.startswith("transformer"):
            return TransformerEncoder(
                vocab=1000, seq=64, d=128, heads=4, ff=512, layers=2, dropout=0.0, classes=10
            )
        return GPT()

    def batches(self, n: int = N_BATCHES, batch: int | None = None) -> dict[str, np.ndarray]:
        """``x{i}``/``y{i}`` for i < n: inputs and integer labels from a seeded generator."""
        b = batch or self.batch
        rng = np.random.default_rng(0)
        out = {}
        for i in range(n):
            if self.key.startswith("mlp") or self.key.startswith("cnn"):
                x = rng.standard_normal((b, 1, 28, 28), np.float32)
                y = rng.integers(0, 10, b)
            elif self.key.startswith("mobilenet"):
                x = rng.standard_normal((b, 3, 64, 64), np.float32)
                y = rng.integers(0, 10, b)
            elif self.key.startswith("resnet"):
                x = rng.standard_normal((b, 3, 32, 32), np.float32)
                y = rng.integers(0, 10, b)
            elif self.key.startswith("transformer"):
                x = rng.integers(0, 1000, (b, 64))
                y = rng.integers(0, 10, b)
            else:
                x = rng.integers(0, 1000, (b, 64))
                y = rng.integers(0, 1000, (b, 64))  # next tokens; flattened for the loss
            out[f"x{i}"] = x
            out[f"y{i}"] = y.astype(np.int64)
        return out

    @property
    def input_name(self) -> str:
        return "tokens" if self.key.startswith(("transformer", "gpt")) else "x"


CASES = [
    Case("mlp64", "MLP 784-512-512-10, batch 64", 64),
    Case("mlp256", "MLP 784-512-512-10, batch 256", 256),
    Case("cnn64", "LeNet-5 CNN 28×28, batch 64", 64),
    Case("transformer32", "Transformer encoder 2×d128 seq64, batch 32", 32),
    Case("gpt16", "GPT decoder 2×d128 seq64 vocab1000, batch 16", 16),
]
QUICK_CASES = [CASES[0], CASES[3]]
# beyond the set, run when named with --models
EXTRA_CASES = [Case("mobilenet16", "MobileNetV2-style CNN 3×64×64 (depthwise), batch 16", 16),
               Case("resnet32", "CIFAR ResNet 3×32×32 (6 basic blocks), batch 32", 32)]
ALL_CASES = CASES + EXTRA_CASES


def prepare(case: Case, folder: str) -> dict[str, str]:
    """Export ``case`` into ``folder`` (see the module docstring); returns the paths by kind."""
    os.makedirs(folder, exist_ok=True)
    paths = {
        k: os.path.join(folder, f)
        for k, f in (
            ("model", "model.onnx"),
            ("loss_model", "model_loss.onnx"),
            ("weights", "model.pt"),
            ("batches", "batches.npz"),
            ("params", "params.json"),
        )
    }
    module = case.build()
    small = case.batches(1, batch=2)
    x, y = small["x0"], small["y0"]
    feeds = {case.input_name: x}
    model = export_module(module, feeds, "logits", training=False)
    with open(paths["model"], "wb") as f:
        f.write(model.SerializeToString())
    with_loss = WithLoss(module, FlatCrossEntropy())
    loss_model = export_module(with_loss, {**feeds, "labels": y}, "loss", training=False, batch_output=False)
    with open(paths["loss_model"], "wb") as f:
        f.write(loss_model.SerializeToString())
    torch.save(module.state_dict(), paths["weights"])
    # trained parameters by graph (buffers such as a causal mask are initializers too, but not trained)
    names = [n for n, _ in module.named_parameters()]
    inits = {t.name for t in model.graph.initializer}
    loss_inits = {t.name for t in loss_model.graph.initializer}
    with open(paths["params"], "w") as f:
        json.dump(
            {
                "model": [n for n in names if n in inits],
                "loss_model": [f"model.{n}" for n in names if f"model.{n}" in loss_inits],
            },
            f,
        )
    np.savez(paths["batches"], **case.batches())
    return paths


def n_params(case: Case) -> int:
    return sum(math.prod(p.shape) for p in case.build().parameters())
