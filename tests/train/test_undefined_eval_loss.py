"""An eval set whose labels are all the loss's ``ignore_index``: its mean loss is 0/0. torch's
``CrossEntropyLoss(ignore_index=...)`` gives NaN there, and Hugging Face's Trainer reports that NaN as
``eval_loss`` (its mean of the batches' losses, which are NaN); onnxtrain reported 0.0, a perfect score."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import yaml

from onnxtrain.cli import main
from tests.train.test_main_job_audit import _ignore_index_run, _records


def _all_ignored_run(tmp_path, **training) -> str:
    """The linear classifier of ``_ignore_index_run`` (ignore_index -1), its eval file's labels all -1."""
    config = _ignore_index_run(tmp_path, 7, weighted=False)
    data = np.load(tmp_path / "eval.npz")
    np.savez(tmp_path / "eval.npz", x=data["x"], y=np.full_like(data["y"], -1))
    with open(config) as f:
        raw = yaml.safe_load(f)
    raw["training"].update(eval_every=2, **training)
    raw["output"]["plot"] = True
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    return config


def _torch_eval_loss(tmp_path, out: str) -> float:
    """torch's cross_entropy(ignore_index=-1) over the eval set, from onnxruntime's logits of the export."""
    torch = pytest.importorskip("torch")
    from tests.train.test_main_job_audit import _ort_logits

    data = np.load(tmp_path / "eval.npz")
    logits = _ort_logits(os.path.join(out, "model.onnx"), data["x"])
    return torch.nn.functional.cross_entropy(torch.tensor(logits), torch.tensor(data["y"]),
                                             ignore_index=-1).item()


def test_an_eval_set_of_ignored_labels_only_has_a_nan_loss_not_a_divergence(tmp_path, capsys):
    """eval_loss is NaN (null in metrics.jsonl, in `eval --json` too) as torch's is, with one warning
    saying why; the run exits 0 (its training loss is finite), with no "diverges" warning, and plots."""
    config = _all_ignored_run(tmp_path)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q"]) == 0
    captured = capsys.readouterr()
    expected = _torch_eval_loss(tmp_path, out)
    assert math.isnan(expected)  # the oracle: torch's 0/0
    evals = [r for r in _records(out) if "eval_loss" in r]
    assert [r["step"] for r in evals] == [2, 4, 5]
    assert all(r["eval_loss"] is None and "eval_accuracy" not in r for r in evals), evals
    losses = [r["loss"] for r in _records(out) if "loss" in r]
    assert losses and all(isinstance(v, float) and math.isfinite(v) for v in losses)
    assert "diverge" not in captured.err, captured.err
    warned = [line for line in captured.err.splitlines() if "eval_loss" in line]
    assert len(warned) == 1 and "not defined" in warned[0] and "ignore_index (-1)" in warned[0], captured.err
    assert "eval_loss nan" in captured.out
    assert os.path.getsize(os.path.join(out, "metrics.png")) > 0
    assert main(["eval", config, "--checkpoint", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"eval_loss": None}


def test_an_undefined_eval_loss_leaves_the_verdict_to_the_training_loss(tmp_path, capsys):
    """With the eval undefined, a training loss that went to NaN or inf (SGD at a rate of 1e38) is what says
    that the run diverged: exit 1, naming the training loss."""
    config = _all_ignored_run(tmp_path)
    with open(config) as f:
        raw = yaml.safe_load(f)
    raw["optimizer"]["lr"] = 1e38
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q"]) == 1
    err = capsys.readouterr().err
    last = [r["loss"] for r in _records(out) if "loss" in r][-1]
    assert last is None  # (not finite: null)
    assert "training diverged: the final training loss is not a finite number" in err, err
