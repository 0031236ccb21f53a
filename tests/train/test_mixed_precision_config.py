"""Mixed precision and recompute from a config: `training.parameters` reaches the session and the loop
feeds a dynamic loss scale, which survives --resume."""

from __future__ import annotations

import json
import os

import numpy as np

from onnxtrain.cli import main


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

    ckpts = sorted(os.listdir(tmp_path / "checkpoints"))
    props = load_checkpoint(str(tmp_path / "checkpoints" / ckpts[-1])).properties
    assert props["loss_scale"] >= 1.0 and "loss_scale_stable_steps" in props
