"""A run whose loss becomes NaN says so: one warning line at the first non-finite loss, the metrics file keeps
valid JSON (null where the value is not a number: a bare NaN was written, which JSON readers refuse), and
the command exits 1 when the final metrics are not finite (it reported success)."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from onnxtrain.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_a_diverging_run_warns_writes_json_and_fails(tmp_path, capsys) -> None:
    out = tmp_path / "run"
    code = main(["train", os.path.join(ROOT, "configs", "digits_mlp.yaml"), "-q", "--output-dir", str(out),
                 "--set", "optimizer.name=sgd", "--set", "optimizer.lr=1e30", "--set", "training.steps=20"])
    err = capsys.readouterr().err
    assert code == 1 and "training diverged: the final eval_loss is not a finite number" in err, err
    assert err.count("training diverges") == 1, err
    lines = (out / "metrics.jsonl").read_text().splitlines()
    def strict(constant: str) -> None:  # NaN, Infinity: not JSON
        raise ValueError(constant)

    records = [json.loads(line, parse_constant=strict) for line in lines]
    assert records[-1]["eval_loss"] is None and records[-1]["eval_accuracy"] >= 0
    # resuming the finished run reads the nulls back: the same verdict (a format error on None before)
    code = main(["train", os.path.join(ROOT, "configs", "digits_mlp.yaml"), "-q", "--output-dir", str(out),
                 "--set", "optimizer.name=sgd", "--set", "optimizer.lr=1e30", "--set", "training.steps=20",
                 "--resume"])
    captured = capsys.readouterr()
    assert code == 1 and "training diverged: the final eval_loss is not a finite" in captured.err, captured
    assert "eval_loss nan" in captured.out, captured.out
    checkpoint = sorted((out / "checkpoints").glob("step_*.ckpt"))[-1]
    assert main(["eval", os.path.join(ROOT, "configs", "digits_mlp.yaml"), "--checkpoint", str(checkpoint),
                 "--json"]) == 0
    scores = json.loads(capsys.readouterr().out, parse_constant=strict)
    assert None in scores.values(), scores


def test_the_plot_takes_metrics_read_back_with_nulls(tmp_path) -> None:
    """A resumed run plots the records it reads back from metrics.jsonl, nulls included (a gap in the line;
    the y-scale test on them raised a TypeError)."""
    from onnxtrain.train.outputs import plot_metrics

    records = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": None},
               {"step": 2, "eval_loss": None, "eval_accuracy": 0.1}]
    plot_metrics(records, str(tmp_path / "m.png"), "diverged")
    assert (tmp_path / "m.png").stat().st_size > 0


@pytest.mark.parametrize("losses", [np.linspace(2.5, 2.2, 30), np.geomspace(2.3, 0.2, 30)])
def test_the_plots_log_axis_labels_plain_numbers(tmp_path, monkeypatch, losses):
    """A run's loss axis is logarithmic; over less than a decade (any short run) matplotlib's labels read
    2.45×10⁰, 2.5×10⁰, ... and 2×10⁻¹ over a few. They are now the numbers as written, 2.45, 0.2, at the
    ticks matplotlib chose to label."""
    import matplotlib.figure

    from onnxtrain.train.outputs import plot_metrics

    seen = {}

    def savefig(fig, *args, **kwargs):
        fig.canvas.draw()
        ax = fig.axes[0]
        seen["labels"] = [(t.get_text(), v) for minor in (False, True)
                          for t, v in zip(ax.get_yticklabels(minor=minor), ax.get_yticks(minor=minor))
                          if t.get_text()]

    monkeypatch.setattr(matplotlib.figure.Figure, "savefig", savefig)
    records = [{"step": i + 1, "loss": float(v)} for i, v in enumerate(losses)]
    records += [{"step": 30, "eval_loss": float(losses[-1]), "eval_accuracy": 0.5}]
    plot_metrics(records, str(tmp_path / "m.png"), "run")
    labels = seen["labels"]
    assert len(labels) >= 3, labels
    low, high = losses.min(), losses.max()
    assert any(low <= v <= high for _, v in labels), labels  # (a label within the data's range)
    for text, value in labels:
        assert float(text.replace("\N{MINUS SIGN}", "-")) == pytest.approx(value, rel=1e-9), (text, value)
