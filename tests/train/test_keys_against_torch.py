"""Each training key of a config changes a run as README.md says: the trainer's weights, logged learning
rates and losses against a float64 torch reimplementation of the same training (the MLP on the digits,
its data order drawn as README says: one permutation per epoch, a short last batch dropped)."""

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

torch = pytest.importorskip("torch")

BASE = {
    "model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}},
    "data": {"source": "digits"},
    "optimizer": {"name": "adam", "lr": 0.01},
    "training": {"batch_size": 32, "steps": 12, "eval_every": 1000, "log_every": 1,
                 "checkpoint_every": 1000},
    "output": {"plot": False, "export": False},
}


def _merge(base: dict, change: dict) -> dict:
    out = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()}
    for section, values in change.items():
        out[section] = {**out.get(section, {}), **values}
    return out


def _lr(step: int, total: int, lr: float, kind: str, warmup: int, final: float) -> float:
    """README's schedule, written out: linear warm-up to lr over ``warmup`` steps, then constant, or a
    linear or cosine decay that reaches lr × final at the last step."""
    if step < warmup:
        return lr * (step + 1) / warmup
    if kind == "constant":
        return lr
    frac = min((step - warmup) / max(total - warmup - 1, 1), 1.0)
    shape = 1.0 - frac if kind == "linear" else 0.5 * (1.0 + math.cos(math.pi * frac))
    return lr * final + (lr - lr * final) * shape


def _torch_run(raw: dict, init: dict[str, np.ndarray], train: dict[str, np.ndarray]):
    """(final weights, [(step, lr, mean loss)]) of the run ``raw`` describes, in float64 torch."""
    o, s, t = raw["optimizer"], raw.get("schedule", {}), raw["training"]
    name = o.get("name", "adam")
    b1, b2 = o.get("betas") or (0.9, 0.999)
    eps = o.get("eps", 1e-8 if name == "adam" else 1e-6)
    lam, clip = o.get("weight_decay") or 0.0, o.get("clip_grad_norm")
    micro, batch = t.get("gradient_accumulation_steps", 1), t["batch_size"]
    w = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in init.items()}
    m1 = {k: torch.zeros_like(v) for k, v in w.items()}
    m2 = {k: torch.zeros_like(v) for k, v in w.items()}
    x, y = torch.tensor(train["x"], dtype=torch.float64), torch.tensor(train["y"])
    n = len(y)
    rng = np.random.default_rng([t.get("seed", 0), data_mod._ORDER_STREAM])  # the trainer's order stream
    perm, pos, log = rng.permutation(n), 0, []
    for step in range(t["steps"]):
        lr = _lr(step, t["steps"], o["lr"], s.get("kind", "constant"), s.get("warmup_steps", 0),
                 s.get("final_lr_ratio", 0.0))
        grads = {k: torch.zeros_like(v) for k, v in w.items()}
        losses = []
        for _ in range(micro):
            idx = torch.tensor(perm[pos:pos + batch])
            pos += batch
            h = torch.relu(x[idx] @ w["fc0.weight"].T + w["fc0.bias"])
            loss = torch.nn.functional.cross_entropy(h @ w["fc1.weight"].T + w["fc1.bias"], y[idx])
            for k, g in zip(w, torch.autograd.grad(loss, list(w.values()))):
                grads[k] += g / micro
            losses.append(loss.item())
        if pos + batch * micro > n:
            perm, pos = rng.permutation(n), 0
        log.append((step + 1, lr, sum(losses) / len(losses)))
        with torch.no_grad():
            if clip is not None:
                norm = math.sqrt(sum(float((g * g).sum()) for g in grads.values()))
                if norm > clip:
                    grads = {k: g * (clip / norm) for k, g in grads.items()}
            for k, p in w.items():
                g = grads[k]
                if name == "sgd":
                    p -= lr * g
                    continue
                m1[k] = b1 * m1[k] + (1 - b1) * g
                m2[k] = b2 * m2[k] + (1 - b2) * g * g
                if name == "adam":  # decoupled weight decay, as torch's AdamW
                    c1, c2 = 1 - b1 ** (step + 1), 1 - b2 ** (step + 1)
                    p.mul_(1 - lr * lam)
                    p -= lr * (m1[k] / c1) / (torch.sqrt(m2[k] / c2) + eps)
                else:  # lamb (no bias correction, its default): trust ratio ‖w‖ / ‖d‖
                    d = m1[k] / (torch.sqrt(m2[k]) + eps) + lam * p
                    wn, dn = float(p.norm()), float(d.norm())
                    p -= lr * (wn / dn if wn > 0 and dn > 0 else 1.0) * d
    return {k: v.detach().numpy() for k, v in w.items()}, log


def _run(tmp_path, write_config, change: dict):
    raw = _merge(BASE, change)
    cfg = load_config(write_config(raw))
    init = {i.name: numpy_helper.to_array(i) for i in build_model(cfg).graph.initializer}
    out = str(tmp_path / "run")
    Trainer(cfg, out, progress=False).run()
    final = load_checkpoint(list_checkpoints(out)[-1][1]).trainable
    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f]
    logged = [(r["step"], r["lr"], r["loss"]) for r in records if "loss" in r]
    evals = [r for r in records if "eval_loss" in r]
    ds = data_mod.load_data(cfg)
    return raw, init, final, logged, evals, ds


def _torch_eval(w: dict[str, np.ndarray], arrays: dict[str, np.ndarray]) -> tuple[float, float]:
    """(mean cross-entropy, accuracy) of the MLP with weights ``w`` on ``arrays``."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in w.items()}
    h = torch.relu(torch.tensor(arrays["x"], dtype=torch.float64) @ t["fc0.weight"].T + t["fc0.bias"])
    logits, y = h @ t["fc1.weight"].T + t["fc1.bias"], torch.tensor(arrays["y"])
    loss = torch.nn.functional.cross_entropy(logits, y).item()
    return loss, (logits.argmax(1) == y).double().mean().item()


CASES = {
    "defaults": {},
    "optimizer.lr": {"optimizer": {"lr": 0.03}},
    "optimizer.name sgd": {"optimizer": {"name": "sgd", "lr": 0.3}},
    "optimizer.name lamb": {"optimizer": {"name": "lamb"}},
    "optimizer.betas": {"optimizer": {"betas": [0.5, 0.9]}},
    "optimizer.eps": {"optimizer": {"eps": 0.05}},
    "optimizer.weight_decay adam": {"optimizer": {"weight_decay": 5.0}},
    "optimizer.weight_decay lamb": {"optimizer": {"name": "lamb", "weight_decay": 0.5}},
    "optimizer.clip_grad_norm": {"optimizer": {"clip_grad_norm": 0.2}},
    "optimizer.clip_grad_norm lamb": {"optimizer": {"name": "lamb", "clip_grad_norm": 0.2}},
    "schedule linear warmup": {"schedule": {"kind": "linear", "warmup_steps": 4, "final_lr_ratio": 0.1}},
    "schedule cosine": {"schedule": {"kind": "cosine", "final_lr_ratio": 0.2}},
    "schedule constant warmup": {"schedule": {"kind": "constant", "warmup_steps": 5}},
    "training.batch_size": {"training": {"batch_size": 200}},  # 7 steps an epoch: crosses into epoch 2
    "training.gradient_accumulation_steps": {"training": {"gradient_accumulation_steps": 3,
                                                          "batch_size": 40}},  # 11 steps an epoch
    "training.seed": {"training": {"seed": 7}},
    "clipping the accumulated gradients": {"optimizer": {"clip_grad_norm": 0.2},
                                           "training": {"gradient_accumulation_steps": 2, "batch_size": 40}},
    "lamb, decay, accumulation, cosine warm-up": {
        "optimizer": {"name": "lamb", "weight_decay": 0.1, "betas": [0.8, 0.99]},
        "schedule": {"kind": "cosine", "warmup_steps": 3, "final_lr_ratio": 0.1},
        "training": {"gradient_accumulation_steps": 2, "batch_size": 64}},
}


@pytest.mark.parametrize("case", list(CASES))
def test_training_keys_match_a_torch_reimplementation(tmp_path, write_config, case):
    raw, init, final, logged, evals, ds = _run(tmp_path, write_config, CASES[case])
    train = ds.train
    want, log = _torch_run(raw, init, train)
    for k in want:
        np.testing.assert_allclose(final[k], want[k], rtol=1e-4, atol=2e-5, err_msg=f"{case}: {k}")
    assert [s for s, _, _ in logged] == [s for s, _, _ in log]
    np.testing.assert_allclose([r for _, r, _ in logged], [r for _, r, _ in log], rtol=1e-6, err_msg=case)
    np.testing.assert_allclose([v for _, _, v in logged], [v for _, _, v in log], rtol=1e-4, err_msg=case)
    # the run's one eval (its last step): the final weights on the digits' test split
    assert [r["step"] for r in evals] == [raw["training"]["steps"]]
    loss, accuracy = _torch_eval(want, ds.eval)
    assert evals[0]["eval_loss"] == pytest.approx(loss, rel=1e-4)
    assert evals[0]["eval_accuracy"] == pytest.approx(accuracy, abs=1.5 / len(ds.eval["y"]))
    if case != "defaults":  # the key moved the weights much further than the oracle's tolerance
        default, _ = _torch_run(_merge(BASE, {}), init, train)
        assert max(float(np.abs(want[k] - default[k]).max()) for k in want) > 1e-3, case
