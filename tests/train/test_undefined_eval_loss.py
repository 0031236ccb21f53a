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


@pytest.mark.parametrize("ignore_index", [True, False])
def test_an_eval_set_of_zero_weight_classes_is_named_as_such(tmp_path, capsys, ignore_index):
    """Class weights that are 0 for every label of the eval set (the loss's ignore_index aside) make its mean
    loss 0/0 too, as torch's cross_entropy(weight=...) gives. The warning said every label was the
    ignore_index ("(None)" without one), and without an ignore_index the run then exited 1, "training
    diverged"; it now names the class weights and the verdict goes by the training loss, as for ignored
    labels."""
    import onnx
    from onnx import numpy_helper

    torch = pytest.importorskip("torch")
    from tests.train.test_main_job_audit import _ort_logits

    config = _ignore_index_run(tmp_path, 7, weighted=True)
    model = onnx.load(tmp_path / "m.onnx")
    weights = np.array([0.0, 2.0, 1.25], np.float32)
    cw = next(t for t in model.graph.initializer if t.name == "cw")
    cw.CopyFrom(numpy_helper.from_array(weights, "cw"))
    if not ignore_index:
        loss = next(n for n in model.graph.node if n.op_type == "SoftmaxCrossEntropyLoss")
        loss.ClearField("attribute")
        train = np.load(tmp_path / "train.npz")
        np.savez(tmp_path / "train.npz", x=train["x"], y=np.where(train["y"] < 0, 1, train["y"]))
    onnx.save(model, tmp_path / "m.onnx")
    data = np.load(tmp_path / "eval.npz")
    y = np.zeros_like(data["y"])  # class 0, of weight 0 ...
    if ignore_index:
        y[::3] = -1  # ... or ignored
    np.savez(tmp_path / "eval.npz", x=data["x"], y=y)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q"]) == 0
    captured = capsys.readouterr()
    logits = _ort_logits(os.path.join(out, "model.onnx"), data["x"])
    expected = torch.nn.functional.cross_entropy(
        torch.tensor(logits), torch.tensor(y), weight=torch.tensor(weights, dtype=torch.float64),
        ignore_index=-1 if ignore_index else -100).item()
    assert math.isnan(expected)  # the oracle: torch's 0/0
    last = [r for r in _records(out) if "eval_loss" in r][-1]
    assert last["eval_loss"] is None
    kept = y != -1
    assert last["eval_accuracy"] == (logits.argmax(axis=1) == y)[kept].mean()
    assert "diverge" not in captured.err, captured.err
    warned = [line for line in captured.err.splitlines() if "eval_loss" in line]
    assert len(warned) == 1 and "not defined" in warned[0], captured.err
    assert "class weights ('cw') are 0" in warned[0] and "(None)" not in warned[0], warned[0]
    assert ("ignore_index (-1)" in warned[0]) == ignore_index, warned[0]


@pytest.mark.parametrize("case,key", [
    ("fraction_none", "data.eval_fraction"), ("fraction_all", "data.eval_fraction"),
    ("empty_file", "data.eval_path"), ("sequence", "data.eval_size")])
def test_an_eval_set_of_no_rows_is_refused_at_start_naming_the_key(tmp_path, capsys, case, key):
    """An eval set with no rows has no eval_loss at all (not the 0/0 of ignored labels): a config mistake,
    refused before anything is trained or written (exit 2, one line naming the key, no output folder)."""
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(3, 64)).astype(np.float32), np.arange(3, dtype=np.int64)
    np.savez(tmp_path / "d.npz", x=x, y=y)
    np.savez(tmp_path / "e.npz", x=x[:0], y=y[:0])
    files = {"source": "files", "path": "d.npz", "feeds": {"x": "x", "y": "y"}}
    data = {"fraction_none": {**files, "eval_fraction": 0.1},  # round(0.3) = 0 of 3 rows held out
            "fraction_all": {**files, "eval_fraction": 0.9},  # round(2.7) = all 3
            "empty_file": {**files, "eval_path": "e.npz"},
            "sequence": {"source": "sequence", "vocab": 10, "length": 8, "eval_size": 0}}[case]
    args = {"vocab": 10, "length": 8, "dim": 8, "heads": 2, "layers": 1}
    model = {"builder": "transformer", "args": args} if case == "sequence" else {
        "builder": "mlp", "args": {"sizes": [64, 8, 10]}}
    config = tmp_path / "run.yaml"
    training = {"batch_size": 1, "steps": 1}
    config.write_text(yaml.safe_dump({"model": model, "data": data, "training": training}))
    out = tmp_path / "out"
    capsys.readouterr()
    assert main(["train", str(config), "--output-dir", str(out), "-q"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert f" {key}: " in line and "Traceback" not in line, line
    if case.startswith("fraction"):
        held = round(3 * data["eval_fraction"])
        assert f"holds out {held} of 3 samples" in line, line
    assert not out.exists()
