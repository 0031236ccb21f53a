"""A run whose loss becomes NaN says so: one warning line at the first non-finite loss, the metrics file keeps
valid JSON (null where the value is not a number: a bare NaN was written, which JSON readers refuse), and
the command exits 1 when the final metrics are not finite (it reported success)."""

from __future__ import annotations

import json
import os

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
