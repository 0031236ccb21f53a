"""configs/tiny_transformer.yaml (a pre-LN transformer encoder, Adam with gradient clipping at norm 1, cosine
with warm-up, generated sequence data), shortened, against a float64 torch reimplementation of the same run
(review H): the same initial weights and sequences, the data order README gives, the global-norm clip of the
gradients before Adam; every logged loss and rate and the final weights."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
from onnx import numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.train import Trainer, load_config
from onnxtrain.train import data as data_mod
from onnxtrain.train.model import build_model
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import config_path

torch = pytest.importorskip("torch")
F = torch.nn.functional

STEPS, WARMUP, BATCH, LR, FINAL, CLIP = 12, 3, 64, 3e-3, 0.1, 1.0
SETS = [f"training.steps={STEPS}", f"schedule.warmup_steps={WARMUP}", "data.train_size=640",
        "data.eval_size=64", "training.log_every=1", "training.eval_every=1000",
        "training.checkpoint_every=1000", "output.plot=false", "output.export=false"]

# the key projection's bias adds q·b to every score of a query's row, which the softmax takes away: its
# gradient is 0 but for rounding, which Adam's m / (sqrt(v) + 1e-8) turns into steps of up to lr in float32
# (torch's float32 too), where float64's rounding stays far below eps
NOISE = "layer0.attn.k.bias"


def _lr(step: int) -> float:
    """Warm-up to LR over WARMUP steps, then cosine to LR × FINAL at the last step."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = min((step - WARMUP) / max(STEPS - WARMUP - 1, 1), 1.0)
    return LR * FINAL + (LR - LR * FINAL) * 0.5 * (1.0 + math.cos(math.pi * frac))


def _forward(w: dict, x: torch.Tensor, heads: int = 4) -> torch.Tensor:
    """zoo.transformer's logits [N, vocab, T] (one layer, exact GELU), from its ONNX graph's description."""
    n, t = x.shape
    dim = w["tok_emb.weight"].shape[1]
    dh = dim // heads

    def ln(h, p):
        return F.layer_norm(h, (dim,), w[f"{p}.weight"], w[f"{p}.bias"], eps=1e-5)

    def lin(h, p):
        return h @ w[f"{p}.weight"] + w[f"{p}.bias"]  # weights stored [in, out]

    h = w["tok_emb.weight"][x] + w["pos_emb.weight"][torch.arange(t)]
    a = ln(h, "layer0.ln1")
    q, k, v = (lin(a, f"layer0.attn.{c}").reshape(n, t, heads, dh).transpose(1, 2) for c in "qkv")
    att = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(dh), dim=-1)
    h = h + lin((att @ v).transpose(1, 2).reshape(n, t, dim), "layer0.attn.out")
    u = lin(ln(h, "layer0.ln2"), "layer0.fc1")
    h = h + lin(0.5 * u * (1 + torch.erf(u / math.sqrt(2.0))), "layer0.fc2")
    return lin(ln(h, "ln_f"), "head").transpose(1, 2)


def _torch_run(init: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in init.items()
         if v.dtype == np.float32}
    m1 = {k: torch.zeros_like(v) for k, v in w.items()}
    m2 = {k: torch.zeros_like(v) for k, v in w.items()}
    xt, yt = torch.tensor(x), torch.tensor(y)
    rng = np.random.default_rng([0, data_mod._ORDER_STREAM])  # training.seed 0's order stream
    perm, pos, log = rng.permutation(len(y)), 0, []
    for step in range(STEPS):
        lr = _lr(step)
        idx = torch.tensor(perm[pos:pos + BATCH])
        pos += BATCH
        if pos + BATCH > len(y):
            perm, pos = rng.permutation(len(y)), 0
        loss = F.cross_entropy(_forward(w, xt[idx]), yt[idx])
        grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
        log.append((step + 1, lr, loss.item()))
        with torch.no_grad():
            norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
            if norm > CLIP:
                grads = {k: g * (CLIP / norm) for k, g in grads.items()}
            for k, p in w.items():
                g = grads[k]
                m1[k] = 0.9 * m1[k] + 0.1 * g
                m2[k] = 0.999 * m2[k] + 0.001 * g * g
                c1, c2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
                p -= lr * (m1[k] / c1) / (torch.sqrt(m2[k] / c2) + 1e-8)
    return {k: v.detach().numpy() for k, v in w.items()}, log


def test_tiny_transformer_losses_and_weights_match_float64_torch(tmp_path):
    cfg = load_config(config_path("tiny_transformer"), SETS)
    init = {i.name: numpy_helper.to_array(i) for i in build_model(cfg).graph.initializer}
    train = data_mod.load_data(cfg).train
    want, log = _torch_run(init, train["x"], train["y"])
    assert log[0][2] > log[-1][2]  # (the run learns: the comparison is not of a run standing still)
    out = str(tmp_path / "run")
    Trainer(cfg, out, progress=False).run()
    with open(os.path.join(out, "metrics.jsonl")) as f:
        logged = [(r["step"], r["lr"], r["loss"]) for r in map(json.loads, f) if "loss" in r]
    assert [s for s, _, _ in logged] == [s for s, _, _ in log] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r for _, r, _ in logged], [r for _, r, _ in log], rtol=1e-6)
    np.testing.assert_allclose([v for _, _, v in logged], [v for _, _, v in log], rtol=5e-5)
    final = load_checkpoint(list_checkpoints(out)[-1][1]).trainable
    assert final.keys() == want.keys()
    for k in want:
        if k != NOISE:
            np.testing.assert_allclose(final[k], want[k], rtol=1e-3, atol=2e-5, err_msg=k)
    assert np.abs(want[NOISE]).max() < 1e-9 and np.abs(final[NOISE]).max() < STEPS * LR
