"""Review R5 (of e823065a/3fcca018, the learning rate past float32's range): the main job's
``optimizer.lr`` is checked as a float64 (finite and positive), so 1e39 passed the config check, then the
loop's float32 rate feed (onnxtrain/train/loop.py, ``lr_feed[0] = lr``) made it +inf with numpy's
'overflow encountered in cast' RuntimeWarning printed as an onnxtrain warning on every step, naming no
config key; the run trained with an infinite rate and diverged. The API takes such a rate silently as
onnxruntime-training 1.19.2 does; the main job now refuses it as a config error naming ``optimizer.lr``."""

from __future__ import annotations

import yaml

from onnxtrain.cli import main

CONFIG = {
    "model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}},
    "data": {"source": "digits"},
    "optimizer": {"name": "sgd", "lr": 1e39},
    "training": {"batch_size": 64, "steps": 2, "eval_every": 1000, "checkpoint_every": 1000},
    "output": {"plot": False, "export": False},
}


def test_an_optimizer_lr_past_float32_is_refused_or_fed_without_a_numpy_warning(tmp_path, capsys) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    code = main(["train", str(config), "-q", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "overflow encountered" not in err, err
    assert code == 2 and "optimizer.lr" in err and "float32" in err, (code, err)


def test_an_optimizer_lr_at_float32s_largest_trains_without_a_numpy_warning(tmp_path, capsys) -> None:
    """3.4e38 rounds to float32's largest finite value: no overflow, no warning (the training diverges)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**CONFIG, "optimizer": {"name": "sgd", "lr": 3.4e38}}))
    main(["train", str(config), "-q", "--output-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert "overflow encountered" not in err, err
