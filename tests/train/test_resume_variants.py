"""Every shipped config and the variants a run can take (accumulation, warm-up schedules, Lamb, mixed
precision, the onnxruntime backend, user .npz data): stopped after a checkpoint at an awkward step and
resumed, a run ends as an uninterrupted one does, bit for bit: weights, running statistics, optimizer
moments and counters, every checkpoint property (step, epoch, position, data-order generator, learning
rate, log window), metrics.jsonl but for samples/s, the records the plot is drawn from and model.onnx."""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import onnx
import pytest

from onnxtrain import zoo
from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.train import Trainer, load_config
from onnxtrain.train import loop as loop_mod
from onnxtrain.train.outputs import list_checkpoints
from tests.tiers import extended
from tests.train.conftest import config_path

# checkpoints at every step, so that a stop can come anywhere; evals and log lines at odd intervals
EVERY = ["training.checkpoint_every=1", "training.eval_every=7", "training.log_every=4",
         "training.keep_checkpoints=0"]
SEQUENCE = ["data.train_size=640", "data.eval_size=64"]  # 10 steps an epoch at batch 64

CASES = {  # name: (config, --set values, the step after whose checkpoint the run stops)
    "mlp mid-epoch": ("digits_mlp", ["training.steps=50"], 13),
    "mlp last step of an epoch": ("digits_mlp", ["training.steps=50"], 44),
    "mlp right after an eval": ("digits_mlp", ["training.steps=30"], 21),
    "mlp accumulation, end of epoch": ("digits_mlp", ["training.steps=20",
                                                      "training.gradient_accumulation_steps=3"], 14),
    "mlp lamb, linear warm-up": ("digits_mlp", ["training.steps=20", "optimizer.name=lamb",
                                                "schedule.kind=linear", "schedule.warmup_steps=10"], 6),
    "mlp mixed precision": ("digits_mlp", ["training.steps=20", "training.mixed_precision=true"], 11),
    "mlp epochs": ("digits_mlp", ["training.epochs=2"], 50),
    "cnn batch norm": ("digits_cnn", ["training.steps=20"], 13),
    "cnn mixed precision, accumulation": ("digits_cnn", ["training.steps=20", "training.mixed_precision=true",
                                                         "training.gradient_accumulation_steps=2"], 11),
    "stn": ("digits_stn", ["training.steps=20"], 13),
    "transformer end of epoch": ("tiny_transformer", ["training.steps=24", *SEQUENCE], 10),
    "transformer mixed precision": ("tiny_transformer", ["training.steps=24", "training.mixed_precision=true",
                                                         *SEQUENCE], 13),
    "mlp onnxruntime": ("digits_mlp", ["training.steps=20", "training.backend=onnxruntime"], 11),
    "cnn onnxruntime, accumulation": ("digits_cnn", ["training.steps=20", "training.backend=onnxruntime",
                                                     "training.gradient_accumulation_steps=2"], 11),
    "transformer onnxruntime": ("tiny_transformer", ["training.steps=24", "training.backend=onnxruntime",
                                                     *SEQUENCE], 13),
    "npz data, end of epoch": ("files", ["training.steps=40"], 16),
}


def _files_config(folder) -> str:
    """A user model and .npz (500 samples, a fifth held out for eval: 16 steps an epoch at batch 24)."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 500)
    x = rng.standard_normal((500, 4)) + np.eye(3, 4)[y] * 2
    np.savez(folder / "blobs.npz", feat=x, lab=y)
    onnx.save(zoo.mlp([4, 16, 3], loss=False), folder / "net.onnx")
    path = folder / "files.yaml"
    path.write_text("model: {path: net.onnx, add_loss: cross_entropy}\n"
                    "data: {source: files, path: blobs.npz, feeds: {x: feat, y: lab}, eval_fraction: 0.2}\n"
                    "optimizer: {name: adam, lr: 0.01}\ntraining: {batch_size: 24}\n")
    return str(path)


def _train(config: str, sets: list[str], out: str, monkeypatch, stop_at: int | None = None,
           resume: bool = False) -> list[list[dict]]:
    """Run; with ``stop_at``, SIGINT right after the checkpoint of that step. Returns the records each plot
    was drawn from."""
    plots: list[list[dict]] = []
    monkeypatch.setattr(loop_mod, "plot_metrics", lambda records, path, title: plots.append(
        [{k: v for k, v in r.items() if k != "samples_per_s"} for r in records]))
    real_save = Trainer.save

    def save(self, st):
        path = real_save(self, st)
        if st.global_step == stop_at:
            signal.raise_signal(signal.SIGINT)
        return path

    monkeypatch.setattr(Trainer, "save", save)
    result = Trainer(load_config(config, sets), out, progress=False).run(resume=resume)
    monkeypatch.undo()
    if stop_at is not None:
        assert result.status == "interrupted" and result.global_step == stop_at
    return plots


def _metrics(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in f]


# the transformer's mixed-precision and onnxruntime cases only in the full suite (tests/tiers.py): those
# options resume in the MLP and CNN cases, the transformer and its sequence data in its end-of-epoch case
EXTENDED = {"transformer mixed precision", "transformer onnxruntime"}


@pytest.mark.parametrize("case", [extended(c, id=c) if c in EXTENDED else c for c in CASES])
def test_a_resumed_run_ends_as_an_uninterrupted_one(tmp_path, monkeypatch, case):
    name, sets, stop = CASES[case]
    if "training.backend=onnxruntime" in sets:
        pytest.importorskip("onnxruntime")
    config = _files_config(tmp_path) if name == "files" else config_path(name)
    sets = [*sets, *EVERY]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    plotted = _train(config, sets, whole, monkeypatch)
    _train(config, sets, halves, monkeypatch, stop_at=stop)
    resumed = _train(config, sets, halves, monkeypatch, resume=True)
    a, b = (load_checkpoint(list_checkpoints(f)[-1][1]) for f in (whole, halves))
    for part in ("trainable", "frozen"):
        x, y = getattr(a, part), getattr(b, part)
        assert x.keys() == y.keys(), part
        for k in x:
            np.testing.assert_array_equal(x[k], y[k], err_msg=f"{case}: {k}")
    assert len(a.optimizer_groups) == len(b.optimizer_groups)
    for ga, gb in zip(a.optimizer_groups, b.optimizer_groups):
        assert ga.step == gb.step and ga.states.keys() == gb.states.keys()
        for w, d in ga.states.items():
            for k, v in d.items():
                np.testing.assert_array_equal(v, gb.states[w][k], err_msg=f"{case}: {w}/{k}")
    assert a.properties == b.properties
    assert _metrics(halves) == _metrics(whole)
    assert resumed == plotted and plotted
    exported = []
    for folder in (whole, halves):
        with open(os.path.join(folder, "model.onnx"), "rb") as f:
            exported.append(f.read())
    assert exported[0] == exported[1]
