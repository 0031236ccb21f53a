"""Mixed precision and recompute from a config: `training.parameters` reaches the session and the loop
feeds a dynamic loss scale, which survives --resume."""

from __future__ import annotations

import json
import os

import numpy as np

from onnxtrain.cli import main
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler


def _run(tmp_path, *extra: str) -> int:
    return main(
        [
            "train",
            os.path.join(os.path.dirname(__file__), "..", "..", "configs", "digits_mlp.yaml"),
            "--output-dir",
            str(tmp_path),
            "--set",
            "training.epochs=3",
            "--set",
            "training.eval_every=40",
            "--set",
            "training.checkpoint_every=40",
            "--set",
            "training.parameters.use_mixed_precision=true",
            *extra,
        ]
    )


def test_digits_mlp_in_float16(tmp_path) -> None:
    assert _run(tmp_path) == 0
    with open(tmp_path / "metrics.jsonl") as f:
        records = [json.loads(line) for line in f]
    evals = [r for r in records if "eval_accuracy" in r]
    assert evals[-1]["eval_accuracy"] > 0.9
    assert all(np.isfinite(r["loss"]) for r in records if "loss" in r)
    from onnxtrain.checkpoint import load_checkpoint

    ckpts = sorted(f for f in os.listdir(tmp_path / "checkpoints") if f.endswith(".ckpt"))
    props = load_checkpoint(str(tmp_path / "checkpoints" / ckpts[-1])).properties
    assert props["loss_scale"] >= 1.0 and "loss_scale_stable_steps" in props


def _lrs_and_flags(tmp_path, monkeypatch, name: str, sets: list[str], resume: bool = False
                   ) -> tuple[list[float], list[bool]]:
    """Run the digits MLP under mixed precision with a dynamic scaler starting at 2^30 (its first updates
    overflow float16 and are skipped); returns the learning rate fed to each update and their finite flags."""
    from onnxtrain.graph_transforms import loss_scaler
    from onnxtrain.session import TrainingSession
    from onnxtrain.train import Trainer, load_config
    from tests.train.conftest import config_path

    class HighStart(DynamicLossScaler):
        def __init__(self) -> None:
            super().__init__(loss_scale=2.0**30)

    lrs: list[float] = []
    flags: list[bool] = []
    real_run = TrainingSession.run

    def run(self, outputs, feeds, *a, **k):
        res = real_run(self, outputs, feeds, *a, **k)
        if "all_gradients_finite" in outputs:
            lrs.append(float(feeds["Learning_Rate"][0]))
            flags.append(bool(np.asarray(res[outputs.index("all_gradients_finite")]).reshape(-1)[0]))
        return res

    with monkeypatch.context() as mp:
        mp.setattr(loss_scaler, "DynamicLossScaler", HighStart)
        mp.setattr(TrainingSession, "run", run)
        Trainer(load_config(config_path("digits_mlp"), sets), str(tmp_path / name), progress=False).run(
            resume=resume)
    return lrs, flags


def test_skipped_updates_do_not_advance_the_schedule(tmp_path, monkeypatch) -> None:
    """A skipped update (its gradients overflowed float16) changes no weight, and, as onnxruntime-training's
    ORTTrainer counted its schedule's steps (``optimization_step``, advanced only by updates that applied),
    leaves the learning rate where it was: the warm-up starts with the first update that applies. The count
    of skipped updates survives --resume."""

    from tests.train.test_resume import _interrupt_after_first_save

    base, warm = 2.0e-3, 20
    sets = ["training.steps=40", "training.checkpoint_every=10", "training.eval_every=1000",
            "training.mixed_precision=true", "schedule.kind=constant", f"schedule.warmup_steps={warm}",
            f"optimizer.lr={base}"]
    lrs, flags = _lrs_and_flags(tmp_path, monkeypatch, "whole", sets)
    skipped = flags.index(True)
    assert 5 <= skipped <= 20 and all(flags[skipped:]), flags
    applied = np.cumsum([0] + flags[:-1])  # updates applied before each one
    want = [base * min(a + 1, warm) / warm for a in applied]
    np.testing.assert_allclose(lrs, want, rtol=1e-6)
    # interrupted after the first checkpoint (step 10, within the skipped updates), then resumed
    _interrupt_after_first_save(monkeypatch)
    first, _ = _lrs_and_flags(tmp_path, monkeypatch, "halves", sets)
    monkeypatch.undo()
    rest, _ = _lrs_and_flags(tmp_path, monkeypatch, "halves", sets, resume=True)
    assert len(first) == 10
    np.testing.assert_allclose(first + rest, lrs, rtol=1e-6)


def test_checkpoint_step_counts_applied_updates_for_sgd(tmp_path, monkeypatch) -> None:
    """The checkpoint's optimizer step is the number of updates that applied: Adam's comes from its
    Update_Count (which a skipped update leaves), and SGD's, which keeps no counter, now from the loop's count
    less the skipped updates (it was the count of optimizer runs)."""
    from onnxtrain.checkpoint import load_checkpoint

    sets = ["training.steps=30", "training.checkpoint_every=30", "training.eval_every=1000",
            "training.mixed_precision=true", "optimizer.name=sgd", "optimizer.lr=0.05"]
    _, flags = _lrs_and_flags(tmp_path, monkeypatch, "sgd", sets)
    assert 5 <= flags.count(False) < 30
    ckpt = load_checkpoint(str(tmp_path / "sgd" / "checkpoints" / "step_00000030.ckpt"))
    assert ckpt.optimizer_groups[0].step == flags.count(True)
    assert ckpt.properties["skipped_steps"] == flags.count(False)
