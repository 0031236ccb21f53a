"""Every peer of `python -m bench` trains with the optimizer settings of bench/worker.py (LR, WEIGHT_DECAY,
EPS) in the AdamW form the bench documents: onnxruntime-training's and onnxtrain's peers the Hugging Face form
(onnxruntime's AdamW ``adam_mode`` 1, the legacy Adam's ``weight_decay_mode`` 1), torch eager torch's own.

Each peer's weights after three steps of the bench's MLP are set against float64 references: gradients by
torch autograd in float64, the two AdamW forms written out in numpy. The settings are drawn far from the
bench's (lr 0.01, weight decay 0.5, eps 1e-3) so that a peer that drops one of them, or runs the other form,
lands far from its reference: with the bench's eps of 1e-8 the forms differ only where a gradient is below
about 1e-6, and torch's default eps equals the bench's.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from bench import models, worker  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LR, WEIGHT_DECAY, EPS = 0.01, 0.5, 1e-3
BETAS = (0.9, 0.999)  # torch's and onnxruntime-training's defaults, which every peer keeps
STEPS = 3
FORM = {"legacy": "hf", "api": "hf", "ort": "hf", "torch": "torch"}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("peers") / "mlp64")  # the torch peer finds its model by this name
    models.prepare(next(c for c in models.CASES if c.key == "mlp64"), out)
    return out


def _reference(folder: str, form: str) -> dict[str, np.ndarray]:
    """Weights after STEPS steps of AdamW in ``form`` ("hf": eps on the uncorrected root, decay of the updated
    weight; "torch": torch.optim.AdamW's), in float64."""
    case = next(c for c in models.CASES if c.key == "mlp64")
    module = case.build().double()
    module.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    w = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    m1 = {n: np.zeros_like(v) for n, v in w.items()}
    m2 = {n: np.zeros_like(v) for n, v in w.items()}
    b1, b2 = BETAS
    for t, (x, y) in enumerate(worker._batches(folder)[:STEPS], start=1):
        with torch.no_grad():
            for n, p in module.named_parameters():
                p.copy_(torch.from_numpy(w[n]))
        module.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(torch.from_numpy(x).double()), torch.from_numpy(y))
        loss.backward()
        c1, c2 = 1 - b1**t, 1 - b2**t
        for n, p in module.named_parameters():
            g = p.grad.numpy()
            m1[n] = b1 * m1[n] + (1 - b1) * g
            m2[n] = b2 * m2[n] + (1 - b2) * g * g
            if form == "hf":
                w[n] = w[n] - LR * np.sqrt(c2) / c1 * m1[n] / (np.sqrt(m2[n]) + EPS)
                w[n] = w[n] * (1 - LR * WEIGHT_DECAY)
            else:
                w[n] = w[n] * (1 - LR * WEIGHT_DECAY) - LR * (m1[n] / c1) / (np.sqrt(m2[n] / c2) + EPS)
    return w


def _distance(got: dict[str, np.ndarray], want: dict[str, np.ndarray]) -> float:
    assert sorted(got) == sorted(want)
    return max(float(np.abs(got[n] - want[n]).max()) for n in want)


@pytest.fixture(scope="module")
def references(folder: str) -> dict[str, dict[str, np.ndarray]]:
    refs = {form: _reference(folder, form) for form in ("hf", "torch")}
    assert _distance(refs["hf"], refs["torch"]) > 5e-3  # the two forms are told apart at these settings
    return refs


def _check(peer: str, got: dict[str, np.ndarray], references) -> None:
    want, other = references[FORM[peer]], references["torch" if FORM[peer] == "hf" else "hf"]
    near, far = _distance(got, want), _distance(got, other)
    assert near < 2e-5, (f"{peer}: {near:.2e} from its float64 AdamW ({FORM[peer]} form), "
                         f"{far:.2e} from the other form's")


@pytest.mark.parametrize("peer", ["legacy", "api", "torch"])
def test_peer_runs_the_documented_adamw(peer: str, folder: str, references, monkeypatch) -> None:
    monkeypatch.setattr(worker, "LR", LR)
    monkeypatch.setattr(worker, "WEIGHT_DECAY", WEIGHT_DECAY)
    monkeypatch.setattr(worker, "EPS", EPS)
    monkeypatch.chdir(folder)
    step, _ = worker.PEERS[peer](folder)
    for x, y in worker._batches(folder)[:STEPS]:
        step(x, y)
    _check(peer, step.weights(), references)


ORT_SCRIPT = """
import sys
import numpy as np
sys.path.insert(0, {bench!r})
import worker
worker.LR, worker.WEIGHT_DECAY, worker.EPS = {lr!r}, {wd!r}, {eps!r}
step, _ = worker.ort_peer({folder!r})
for x, y in worker._batches({folder!r})[:{steps}]:
    step(x, y)
np.savez({out!r}, **step.weights())
"""


def test_onnxruntime_training_peer_runs_the_documented_adamw(folder: str, references, tmp_path) -> None:
    python = os.environ.get("ORTT_PYTHON", "/tmp/ortt/bin/python")
    if not os.path.exists(python):
        pytest.skip(f"no onnxruntime-training environment at {python}")
    out = str(tmp_path / "ort_weights.npz")
    script = ORT_SCRIPT.format(bench=os.path.join(REPO, "bench"), lr=LR, wd=WEIGHT_DECAY, eps=EPS,
                               folder=folder, steps=STEPS, out=out)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python, "-c", script], capture_output=True, text=True, timeout=300, cwd=folder,
                          env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with np.load(out) as f:
        got = {n: f[n] for n in f.files}
    with open(os.path.join(folder, "params.json")) as f:
        assert sorted(got) == sorted(json.load(f)["model"])
    _check("ort", got, references)

