"""configs/digits_cnn.yaml (Conv → BatchNormalization in training mode → Relu → MaxPool, twice; Adam; cosine
with warm-up), shortened, against a float64 torch reimplementation of the same run (review H): the same
initial weights, the data order README gives (one permutation per epoch from the seed's order stream, a short
last batch dropped), gradient accumulation (the mean of the micro-batches' gradients), the schedule; every
logged loss and rate, the final weights and the BatchNormalization running statistics (ONNX's update:
``running · momentum + batch · (1 − momentum)``, the batch's variance without Bessel's correction, as onnx's
reference implementation computes it). The same run stopped by SIGINT after step 5's checkpoint and resumed
logs the same losses."""

from __future__ import annotations

import json
import math
import os
import signal

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

STEPS, WARMUP, BATCH, MICRO, LR = 10, 3, 16, 2, 3e-3
# The convolutions' biases come right before a BatchNormalization, which subtracts their mean: their gradient
# is 0 but for rounding, which Adam's m / (sqrt(v) + eps) turns into steps of about lr in float32 with the
# default eps (1e-8; in torch's float32 too), and the running means follow those biases. An eps of 1e-3
# keeps such steps below 1e-8 and still weighs on the others' (gradients of 1e-3 to 1e-1).
EPS = 1e-3
SETS = [f"training.steps={STEPS}", f"schedule.warmup_steps={WARMUP}", f"training.batch_size={BATCH}",
        f"training.gradient_accumulation_steps={MICRO}", "training.log_every=1", "training.eval_every=1000",
        "training.checkpoint_every=5", "training.keep_checkpoints=0", "output.plot=false",
        "output.export=false", f"optimizer.eps={EPS}"]


def _lr(step: int) -> float:
    """Warm-up to LR over WARMUP steps, then cosine to 0 at the last step (digits_cnn's schedule)."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    frac = min((step - WARMUP) / max(STEPS - WARMUP - 1, 1), 1.0)
    return LR * 0.5 * (1.0 + math.cos(math.pi * frac))


def _torch_run(init: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray):
    """(weights and running statistics after STEPS steps, [(step, lr, mean loss)]), in float64."""
    stat = ("running_mean", "running_var")
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=not k.endswith(stat)) for k, v in init.items()}
    stats = {k: v.detach().clone() for k, v in w.items() if not v.requires_grad}
    params = {k: v for k, v in w.items() if v.requires_grad}
    m1 = {k: torch.zeros_like(v) for k, v in params.items()}
    m2 = {k: torch.zeros_like(v) for k, v in params.items()}
    xt, yt = torch.tensor(x, dtype=torch.float64), torch.tensor(y)
    rng = np.random.default_rng([0, data_mod._ORDER_STREAM])  # training.seed 0's order stream
    perm, pos, log = rng.permutation(len(y)), 0, []

    def forward(batch):
        h = batch
        for k in range(2):
            h = F.conv2d(h, params[f"conv{k}.weight"], params[f"conv{k}.bias"], padding=1)
            mean, var = h.mean(dim=(0, 2, 3)), h.var(dim=(0, 2, 3), unbiased=False)
            for name, value in (("running_mean", mean), ("running_var", var)):
                key = f"bn{k}.{name}"
                stats[key] = stats[key] * 0.9 + value.detach() * 0.1
            h = (h - mean[None, :, None, None]) / torch.sqrt(var[None, :, None, None] + 1e-5)
            h = h * params[f"bn{k}.weight"][None, :, None, None] + params[f"bn{k}.bias"][None, :, None, None]
            h = F.max_pool2d(torch.relu(h), 2)
        return h.flatten(1) @ params["fc.weight"].T + params["fc.bias"]

    for step in range(STEPS):
        lr = _lr(step)
        grads = {k: torch.zeros_like(v) for k, v in params.items()}
        losses = []
        for _ in range(MICRO):
            idx = torch.tensor(perm[pos:pos + BATCH])
            pos += BATCH
            loss = F.cross_entropy(forward(xt[idx]), yt[idx])
            for k, g in zip(params, torch.autograd.grad(loss, list(params.values()))):
                grads[k] += g / MICRO
            losses.append(loss.item())
        if pos + BATCH * MICRO > len(y):
            perm, pos = rng.permutation(len(y)), 0
        log.append((step + 1, lr, sum(losses) / MICRO))
        with torch.no_grad():
            for k, p in params.items():
                g = grads[k]
                m1[k] = 0.9 * m1[k] + 0.1 * g
                m2[k] = 0.999 * m2[k] + 0.001 * g * g
                c1, c2 = 1 - 0.9 ** (step + 1), 1 - 0.999 ** (step + 1)
                p -= lr * (m1[k] / c1) / (torch.sqrt(m2[k] / c2) + EPS)
    out = {k: v.detach().numpy() for k, v in params.items()}
    out.update({k: v.numpy() for k, v in stats.items()})
    return out, log


def _logged(folder: str) -> list[tuple[int, float, float]]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [(r["step"], r["lr"], r["loss"]) for r in map(json.loads, f) if "loss" in r]


@pytest.fixture(scope="module")
def oracle():
    cfg = load_config(config_path("digits_cnn"), SETS)
    init = {i.name: numpy_helper.to_array(i) for i in build_model(cfg).graph.initializer}
    train = data_mod.load_data(cfg).train
    return _torch_run(init, train["x"], train["y"])


def test_digits_cnn_losses_weights_and_statistics_match_float64_torch(tmp_path, oracle):
    want, log = oracle
    out = str(tmp_path / "run")
    Trainer(load_config(config_path("digits_cnn"), SETS), out, progress=False).run()
    logged = _logged(out)
    assert [s for s, _, _ in logged] == [s for s, _, _ in log] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([r for _, r, _ in logged], [r for _, r, _ in log], rtol=1e-6)
    np.testing.assert_allclose([v for _, _, v in logged], [v for _, _, v in log], rtol=2e-5)
    final = load_checkpoint(list_checkpoints(out)[-1][1])
    got = {**final.trainable, **final.frozen}
    assert got.keys() == want.keys()
    for k in want:
        np.testing.assert_allclose(got[k], want[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_digits_cnn_stopped_and_resumed_logs_the_oracles_losses(tmp_path, monkeypatch, oracle):
    want, log = oracle
    out = str(tmp_path / "run")
    real_save = Trainer.save

    def save(self, st):
        path = real_save(self, st)
        if st.global_step == 5:
            signal.raise_signal(signal.SIGINT)
        return path

    monkeypatch.setattr(Trainer, "save", save)
    first = Trainer(load_config(config_path("digits_cnn"), SETS), out, progress=False).run()
    assert first.status == "interrupted" and first.global_step == 5
    monkeypatch.undo()
    Trainer(load_config(config_path("digits_cnn"), SETS), out, progress=False).run(resume=True)
    logged = _logged(out)
    assert [s for s, _, _ in logged] == list(range(1, STEPS + 1))
    np.testing.assert_allclose([v for _, _, v in logged], [v for _, _, v in log], rtol=2e-5)
    final = load_checkpoint(list_checkpoints(out)[-1][1])
    for k, v in {**final.trainable, **final.frozen}.items():
        np.testing.assert_allclose(v, want[k], rtol=1e-4, atol=1e-5, err_msg=k)
