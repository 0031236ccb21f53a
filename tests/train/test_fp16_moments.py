"""``use_fp16_moments`` on the digits MLP: second moments of small gradients rounded to 0 in float16 while
the first moments did not, and the Adam step m / (√v + ε) was a million times too large (the run diverged:
train loss 7,796 at step 4, eval accuracy 0.10). They are now kept at least float16's smallest positive
value; the run trains as with float32 moments."""

from __future__ import annotations

import json
import os

from onnxtrain.cli import main

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _last_eval(out) -> dict:
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if "eval_loss" in r][-1]


def test_fp16_moments_train_the_digits_mlp_as_float32_moments_do(tmp_path) -> None:
    config = os.path.join(ROOT, "configs", "digits_mlp.yaml")
    runs = {}
    for name, extra in (("fp16", ["--set", "training.parameters.use_fp16_moments=true"]), ("fp32", [])):
        out = tmp_path / name
        assert main(["train", config, "-q", "--output-dir", str(out), "--set", "training.steps=120",
                     *extra]) == 0
        runs[name] = _last_eval(out)
    assert runs["fp16"]["eval_accuracy"] > 0.9
    assert abs(runs["fp16"]["eval_loss"] - runs["fp32"]["eval_loss"]) < 0.05
