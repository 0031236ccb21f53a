"""Recompute (spec §9): bit-identical gradients, lower peak live bytes, composability, onnxruntime."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model
from onnxtrain.engine.kernels.loss import set_dropout_seed
from onnxtrain.graph_transforms.mixed_precision import mixed_precision
from onnxtrain.graph_transforms.recompute import (
    attn_dropout_recompute,
    checkpoint_recompute,
    find_transformer_layers,
    gelu_recompute,
    recompute,
    transformer_layer_recompute,
)
from tests.graph_transforms import nets
from tests.tiers import covering

STRATEGIES = {
    "gelu": dict(gelu=True),
    "attn_dropout": dict(attn_dropout=True),
    "transformer_layer": dict(transformer_layer=True),
    "all_three": dict(gelu=True, attn_dropout=True, transformer_layer=True),
}


def _run(model: onnx.ModelProto, feeds: dict) -> tuple[list[np.ndarray], int]:
    set_dropout_seed(7)  # the same masks in both runs
    plan = compile_model(model)
    out = plan.run(feeds)
    return out, plan.peak_bytes


def _grad(model: onnx.ModelProto) -> onnx.ModelProto:
    return build_gradient_model(model, "loss", nets.trained(model))


def _assert_recomputed(before: onnx.ModelProto, after: onnx.ModelProto) -> None:
    onnx.checker.check_model(after, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in after.graph.node)
    assert [o.name for o in after.graph.output] == [o.name for o in before.graph.output]
    assert any(o.endswith("_recompute") for n in after.graph.node for o in n.output)


# by default each strategy once, on the two models in turn; on both with ONNXTRAIN_FULL_TESTS=1
# (tests/tiers.py)
@pytest.mark.parametrize("strategy,name", covering(list(STRATEGIES), ["gpt", "bert"], strength=1))
def test_bit_identical_and_smaller(name: str, strategy: str) -> None:
    model, feeds = (nets.gpt(3, dropout=0.1), nets.gpt_feeds(8)) if name == "gpt" else (
        nets.bert(3, dropout=0.1), nets.bert_feeds(16))
    grad = _grad(model)
    ref, peak0 = _run(grad, feeds)
    out = recompute(grad, "loss", **STRATEGIES[strategy])
    _assert_recomputed(grad, out)
    got, peak = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    print(f"\n{name} {strategy}: peak live bytes ratio {peak / peak0:.3f}")
    assert peak < peak0


def test_transformer_layer_recompute_memory() -> None:
    """A 4-layer GPT: all layers but the last recomputed; the training step's peak drops by >= 30 %."""
    model, feeds = nets.gpt(4, seq=32, d=64), nets.gpt_feeds(16, 32)
    grad = _grad(model)
    layers = find_transformer_layers(grad, "loss")
    assert len(layers) == 4
    assert all(end == nxt for (_, end, _), (nxt, _, _) in zip(layers, layers[1:]))
    ref, peak0 = _run(grad, feeds)
    out = transformer_layer_recompute(grad, "loss")
    got, peak = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    print(f"\ngpt x4 transformer_layer_recompute: peak live bytes {peak} / {peak0} = {peak / peak0:.3f}")
    assert peak < 0.7 * peak0
    one = transformer_layer_recompute(grad, "loss", number_recompute_layers=1)
    _, peak1 = _run(one, feeds)
    assert peak <= peak1 < peak0
    with pytest.warns(UserWarning, match="number_recompute_layers"):
        clipped = transformer_layer_recompute(grad, "loss", number_recompute_layers=9)
    assert len(clipped.graph.node) == len(out.graph.node)


def test_each_pass_composes() -> None:
    model, feeds = nets.gpt(2, dropout=0.1), nets.gpt_feeds(8)
    grad = _grad(model)
    ref, _ = _run(grad, feeds)
    out = attn_dropout_recompute(gelu_recompute(grad, "loss"), "loss")
    _assert_recomputed(grad, out)
    got, _ = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


def test_checkpoints_generic() -> None:
    """Our option: recompute every activation between given checkpoints (here each layer's input)."""
    model, feeds = nets.gpt(3), nets.gpt_feeds(8)
    grad = _grad(model)
    cps = [start for start, _, _ in find_transformer_layers(grad, "loss")]
    ref, peak0 = _run(grad, feeds)
    out = checkpoint_recompute(grad, "loss", cps)
    _assert_recomputed(grad, out)
    got, peak = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    print(f"\ngpt x3 checkpoints at layer inputs: peak live bytes ratio {peak / peak0:.3f}")
    assert peak < 0.8 * peak0
    with pytest.raises(ValueError, match="not values"):
        checkpoint_recompute(grad, "loss", ["nope"])
    mlp = _grad(nets.mlp())
    with pytest.warns(UserWarning, match="rebuilt as the backward pass starts"):  # (an MLP's two layers)
        out = checkpoint_recompute(mlp, "loss", ["h0"])
    got = compile_model(out).run(nets.mlp_feeds(32))
    for a, b in zip(compile_model(mlp).run(nets.mlp_feeds(32)), got):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("which", ["layer inputs", "layer norms", "graph input"])
def test_checkpoints_that_save_nothing_warn(which: str) -> None:
    """Checkpoints that leave the residual stream out make the backward pass rebuild nearly everything as it
    starts: the pass says so, and the engine's peak live bytes confirm it (they do not drop); checkpoints
    at the layers' inputs keep quiet and lower the peak."""
    model, feeds = nets.gpt(3), nets.gpt_feeds(8)
    grad = _grad(model)
    _, peak0 = _run(grad, feeds)
    cps = {"layer inputs": [start for start, _, _ in find_transformer_layers(grad, "loss")],
           "layer norms": [n.output[0] for n in grad.graph.node if n.op_type == "LayerNormalization"][:7],
           "graph input": [grad.graph.input[0].name]}[which]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = checkpoint_recompute(grad, "loss", cps)
    notes = [str(w.message) for w in caught if "recompute" in str(w.message)]
    _, peak = _run(out, feeds)
    if which == "layer inputs":
        assert not notes, notes
        assert peak < 0.8 * peak0
    else:
        assert len(notes) == 1 and "rebuilt as the backward pass starts" in notes[0], notes
        assert peak >= 0.95 * peak0


def test_fed_training_mode() -> None:
    """Dropouts driven by a fed training_mode (as the session wires them): rebuilt right in both modes."""
    model = nets.gpt(2, dropout=0.1)
    for n in model.graph.node:
        if n.op_type == "Dropout" and len(n.input) > 2:
            n.input[2] = "training_mode"
    model.graph.input.append(helper.make_tensor_value_info("training_mode", TensorProto.BOOL, []))
    grad = _grad(model)
    out = recompute(grad, "loss", attn_dropout=True, transformer_layer=True)
    _assert_recomputed(grad, out)
    for mode in (True, False):
        feeds = {**nets.gpt_feeds(4), "training_mode": np.array(mode)}
        ref, _ = _run(grad, feeds)
        got, _ = _run(out, feeds)
        for a, b in zip(ref, got):
            np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mixed_precision_then_recompute(dtype: str) -> None:
    """Bit-identical in both half types (bfloat16's Dropout scales in float32 and rounds once, as its
    rebuild now does: the rebuild rounded the scale 1/0.9 to bfloat16, 1.109375, and the gradients
    moved)."""
    model = nets.gpt(3, dropout=0.1)
    feeds = {**nets.gpt_feeds(8), "loss_scale": np.array([256.0], np.float32)}
    mp = mixed_precision(model, "loss", dtype)
    grad = build_gradient_model(mp, "scaled_loss", nets.trained(model), outputs=["loss"])
    ref, peak0 = _run(grad, feeds)
    out = recompute(grad, "scaled_loss", gelu=True, attn_dropout=True, transformer_layer=True)
    _assert_recomputed(grad, out)
    got, peak = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    print(f"\ngpt x3 {dtype} + recompute: peak live bytes ratio {peak / peak0:.3f}")
    assert peak < peak0


def test_not_a_transformer() -> None:
    grad = _grad(nets.mlp())
    with pytest.warns(UserWarning, match="no transformer layer"):
        out = transformer_layer_recompute(grad, "loss")
    assert out.graph.node == grad.graph.node
    assert recompute(grad, "loss", gelu=True, attn_dropout=True) is grad


@pytest.mark.parametrize("name", ["gpt", "bert"])
def test_onnxruntime_runs_recomputed_graph(name: str) -> None:
    ort = pytest.importorskip("onnxruntime")
    model, feeds = (nets.gpt(2), nets.gpt_feeds(4)) if name == "gpt" else (nets.bert(2), nets.bert_feeds(8))
    grad = _grad(model)
    out = recompute(grad, "loss", gelu=True, attn_dropout=True, transformer_layer=True)
    ours, _ = _run(out, feeds)
    res = []
    for m in (grad, out):
        sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
        res.append(sess.run(None, feeds))
    for a, b, c in zip(res[0], res[1], ours):
        np.testing.assert_allclose(b, a, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(c, b, rtol=1e-4, atol=1e-6)


def _masked_encoder() -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """A post-LN encoder (3 layers) whose attention scores add BERT's mask bias (1 − mask)·−10000, made
    from an input alone and read by every layer."""
    torch = pytest.importorskip("torch")
    from tests import models

    nn, d = torch.nn, 16

    class Layer(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q, self.k, self.v, self.o = (nn.Linear(d, d) for _ in range(4))
            self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
            self.i, self.f = nn.Linear(d, 32), nn.Linear(32, d)

        def forward(self, x, bias):
            scores = torch.matmul(self.q(x), self.k(x).transpose(-1, -2)) / 4.0 + bias
            a = self.ln1(self.o(torch.matmul(torch.softmax(scores, -1), self.v(x))) + x)
            return self.ln2(self.f(nn.functional.gelu(self.i(a))) + a)

    class Encoder(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb, self.ln = nn.Embedding(20, d), nn.LayerNorm(d)
            self.layers, self.head = nn.ModuleList(Layer() for _ in range(3)), nn.Linear(d, 3)

        def forward(self, tokens, mask, labels):
            x = self.ln(self.emb(tokens))
            bias = (1.0 - mask.unsqueeze(1).float()) * -10000.0
            for layer in self.layers:
                x = layer(x, bias)
            return nn.functional.cross_entropy(self.head(x[:, 0]), labels)

    torch.manual_seed(0)
    rng = np.random.default_rng(0)
    feeds = {"tokens": rng.integers(0, 20, (2, 6)).astype(np.int64),
             "mask": np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], np.int64),
             "labels": np.array([0, 2], np.int64)}
    return models.export_module(Encoder(), feeds, "loss", training=True, batch_output=False), feeds


def test_transformer_layers_are_found_past_an_attention_mask() -> None:
    """The mask bias joins every layer from the side: counted as an activation, no layer output dominated
    the loss, no layer was found and nothing was recomputed (a warning only) on BERT's usual inputs. Values
    no weight feeds are left out of the analysis now: the three layers are found, the results equal."""
    model, feeds = _masked_encoder()
    grad = _grad(model)
    assert len(find_transformer_layers(grad, "loss")) == 3
    out = transformer_layer_recompute(grad, "loss")
    _assert_recomputed(grad, out)
    ref, _ = _run(grad, feeds)
    got, _ = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)


def _gelu_mlp(form: str) -> onnx.ModelProto:
    """x @ W1 → GELU → @ W2, twice, loss = ReduceSumSquare; the GELU spelt as ``form``:
    ``x*(1+erf)*0.5``, ``x*0.5*(1+erf)`` (HuggingFace, Megatron) or ``0.5*x*(1+tanh)`` (nanoGPT's NewGELU)."""
    rng = np.random.default_rng(0)
    nodes, inits, cur = [], [], "x"

    def c(name: str, v: float) -> str:
        inits.append(onnx.numpy_helper.from_array(np.array(v, np.float32), name))
        return name

    def n(op: str, ins: list[str], out: str) -> str:
        nodes.append(helper.make_node(op, ins, [out]))
        return out

    for k in range(2):
        for name, shape in ((f"W1_{k}", (64, 256)), (f"W2_{k}", (256, 64))):
            w = (rng.standard_normal(shape) * 0.1).astype(np.float32)
            inits.append(onnx.numpy_helper.from_array(w, name))
        h = n("MatMul", [cur, f"W1_{k}"], f"h{k}")
        if form == "newgelu":
            cube = n("Mul", [n("Mul", [h, h], f"sq{k}"), h], f"cube{k}")
            inner = n("Add", [h, n("Mul", [cube, c(f"k{k}", 0.044715)], f"kc{k}")], f"in{k}")
            t = n("Tanh", [n("Mul", [inner, c(f"s{k}", float(np.sqrt(2 / np.pi)))], f"si{k}")], f"t{k}")
            one = n("Add", [t, c(f"one{k}", 1.0)], f"op{k}")
            g = n("Mul", [n("Mul", [c(f"half{k}", 0.5), h], f"hh{k}"), one], f"g{k}")
        else:
            e = n("Erf", [n("Mul", [h, c(f"r{k}", float(1 / np.sqrt(2)))], f"hs{k}")], f"e{k}")
            one = n("Add", [e, c(f"one{k}", 1.0)], f"op{k}")
            if form == "half_first":
                g = n("Mul", [n("Mul", [h, c(f"half{k}", 0.5)], f"hh{k}"), one], f"g{k}")
            else:
                g = n("Mul", [n("Mul", [h, one], f"ho{k}"), c(f"half{k}", 0.5)], f"g{k}")
        cur = n("MatMul", [g, f"W2_{k}"], f"o{k}")
    nodes.append(helper.make_node("ReduceSumSquare", [cur], ["loss"], keepdims=0))
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [256, 64])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("form", ["last_half", "half_first", "newgelu"])
def test_gelu_recompute_finds_each_spelling(form: str) -> None:
    """The GELU with ½·x computed first (HuggingFace's, Megatron's, nanoGPT's NewGELU) was not found when its
    output fed a MatMul: nothing was recomputed and a warning said nothing was kept."""
    model = _gelu_mlp(form)
    grad = build_gradient_model(model, "loss", ["W1_0", "W2_0", "W1_1", "W2_1"])
    feeds = {"x": np.random.default_rng(1).standard_normal((256, 64)).astype(np.float32)}
    ref, peak0 = _run(grad, feeds)
    out = gelu_recompute(grad, "loss")
    _assert_recomputed(grad, out)
    got, peak = _run(out, feeds)
    for a, b in zip(ref, got):
        np.testing.assert_array_equal(a, b)
    assert peak < peak0
