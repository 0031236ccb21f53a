"""Models for the graph-transform tests: torch exports (GPT-style pre-LN stack, BERT-style post-LN encoder)
and a hand-built MLP, each with its loss inside the graph (output ``loss``)."""

from __future__ import annotations

import functools
import itertools

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

models = pytest.importorskip("tests.models")
torch = pytest.importorskip("torch")
nn = torch.nn


class GPT(nn.Module):
    """Embeddings, ``layers`` pre-LN blocks (causal attention, tanh-GELU MLP), final LN, vocab head."""

    def __init__(self, layers: int = 4, vocab: int = 50, seq: int = 16, d: int = 32, heads: int = 4,
                 dropout: float = 0.0):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(seq, d)
        self.blocks = nn.ModuleList(_Block(d, heads, seq, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.register_buffer("positions", torch.arange(seq), persistent=False)

    def forward(self, tokens):
        h = self.tok(tokens) + self.pos(self.positions[: tokens.shape[1]])
        for b in self.blocks:
            h = b(h)
        return self.head(self.ln_f(h))


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, seq: int, dropout: float):
        super().__init__()
        self.ln1 = nn.LayerNorm(d)
        self.attn = models.CausalSelfAttention(d, heads, seq, dropout)
        self.ln2 = nn.LayerNorm(d)
        self.fc = nn.Linear(d, 4 * d)
        self.fc_out = nn.Linear(4 * d, d)
        self.drop = nn.Dropout(dropout)

    def forward(self, h):
        h = h + self.attn(self.ln1(h))
        return h + self.drop(self.fc_out(nn.functional.gelu(self.fc(self.ln2(h)), approximate="tanh")))


@functools.cache
def _gpt(layers: int, dropout: float, seq: int, d: int) -> onnx.ModelProto:
    torch.manual_seed(0)
    module = models.WithLoss(GPT(layers, seq=seq, d=d, dropout=dropout), models._SeqCE())
    feeds = gpt_feeds(2, seq)
    return models.export_module(module, feeds, "loss", training=True, batch_output=False)


def gpt(layers: int = 4, dropout: float = 0.0, seq: int = 16, d: int = 32) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(_gpt(layers, dropout, seq, d))
    return m


def gpt_feeds(batch: int, seq: int = 16, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 50, (batch, seq)).astype(np.int64),
            "labels": rng.integers(0, 50, (batch, seq)).astype(np.int64)}


@functools.cache
def _bert(layers: int, dropout: float) -> onnx.ModelProto:
    torch.manual_seed(0)
    module = models.WithLoss(models.TransformerEncoder(layers=layers, dropout=dropout), nn.CrossEntropyLoss())
    return models.export_module(module, bert_feeds(2), "loss", training=True, batch_output=False)


def bert(layers: int = 3, dropout: float = 0.0) -> onnx.ModelProto:
    m = onnx.ModelProto()
    m.CopyFrom(_bert(layers, dropout))
    return m


def bert_feeds(batch: int, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"tokens": rng.integers(0, 50, (batch, 12)).astype(np.int64),
            "labels": rng.integers(0, 5, batch).astype(np.int64)}


def mlp(dims: tuple[int, ...] = (784, 256, 256, 10), seed: int = 0) -> onnx.ModelProto:
    """x → (MatMul, Add, Relu)* → MatMul, Add → SoftmaxCrossEntropyLoss(labels) = loss."""
    rng = np.random.default_rng(seed)
    nodes, inits = [], []
    h = "x"
    for k, (a, b) in enumerate(itertools.pairwise(dims)):
        w = (rng.standard_normal((a, b)) / np.sqrt(a)).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{k}"))
        inits.append(numpy_helper.from_array(np.full(b, 0.01, np.float32), f"b{k}"))
        nodes.append(helper.make_node("MatMul", [h, f"w{k}"], [f"mm{k}"]))
        nodes.append(helper.make_node("Add", [f"mm{k}", f"b{k}"], [f"pre{k}"]))
        if k < len(dims) - 2:
            nodes.append(helper.make_node("Relu", [f"pre{k}"], [f"h{k}"]))
            h = f"h{k}"
    nodes.append(helper.make_node("SoftmaxCrossEntropyLoss", [f"pre{len(dims) - 2}", "labels"], ["loss"],
                                  reduction="mean"))
    inputs = [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", dims[0]]),
              helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"])]
    loss = helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])
    graph = helper.make_graph(nodes, "mlp", inputs, [loss], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def mlp_feeds(batch: int, dim: int = 784, classes: int = 10, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, dim)).astype(np.float32),
            "labels": rng.integers(0, classes, batch).astype(np.int64)}


def trained(model: onnx.ModelProto) -> list[str]:
    """Float32 initializers except buffers such as the causal mask."""
    return [t.name for t in model.graph.initializer
            if t.data_type == TensorProto.FLOAT and "mask" not in t.name]
