"""The legacy session on models exported by torch 2.13 (loss in the graph): 20 steps equal torch's."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain import TrainingParameters, TrainingSession

torch = pytest.importorskip("torch")
models = pytest.importorskip("tests.models")

LR = 0.05


def _rel(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.mark.parametrize("name", ["mlp", "lenet_bn"])
@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_twenty_steps_match_torch(name: str, opt: str) -> None:
    model, _, module = models.export(name, training=True, with_loss=True, dropout=0.0)
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = opt
    p.enable_grad_norm_clip = False
    sess = TrainingSession(model.SerializeToString(), p)
    params = dict(module.named_parameters())
    assert sorted(sess.get_model_state()["full_precision"]) == sorted(params)
    topt = torch.optim.SGD(module.parameters(), lr=LR) if opt == "SGDOptimizer" else \
        torch.optim.Adam(module.parameters(), lr=LR / 10)
    lr = np.array([LR if opt == "SGDOptimizer" else LR / 10], np.float32)
    module.train()
    flat: set[str] = set()  # parameters whose true gradient is 0 (a conv bias before BatchNorm)
    for step in range(20):
        feeds = models.example_inputs(name, batch=8, with_loss=True, seed=step)
        ours = sess.run(["loss"], {**feeds, "Learning_Rate": lr})[0]
        topt.zero_grad()
        theirs = module(*(torch.from_numpy(v) for v in feeds.values()))
        theirs.backward()
        if step == 0:
            flat = {k for k, v in params.items() if float(v.grad.norm()) < 1e-6}
        topt.step()
        assert _rel(ours, theirs.item()) < 1e-5, (step, ours, theirs.item())
    state = sess.get_state()
    # Adam turns the float noise of a zero gradient into full-size steps, so those weights are
    # compared only for SGD (where noise stays noise-sized)
    assert len(flat) <= (2 if name == "lenet_bn" else 0), flat
    for k, v in params.items():
        if opt == "AdamOptimizer" and k in flat:
            continue
        assert _rel(state[k], v.detach().numpy()) < 1e-5, k
    if name == "lenet_bn":  # running statistics were written back (ONNX uses the biased variance)
        bn_means = [k for k in state if k.endswith("running_mean")]
        assert bn_means and all(np.any(state[k] != 0) for k in bn_means)
