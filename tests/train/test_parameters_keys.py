"""training.parameters: keys that the config sets itself are refused (naming the key to use), wrong types
and bad values are one-line config errors naming the full key path (exit code 2)."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.cli import main
from onnxtrain.train.config import ConfigError, load_config
from onnxtrain.train.model import build_model
from onnxtrain.train.session import training_parameters
from tests.train.conftest import config_path

MLP = {"model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}}, "training": {"steps": 2}}


def _with_parameters(**params) -> dict:
    return {**MLP, "training": {"steps": 2, "parameters": params}}


def _error_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return code, err[0]


@pytest.mark.parametrize("key, value, use", [
    ("gradient_accumulation_steps", 2, "use training.gradient_accumulation_steps"),
    ("gradient_accumulation_mode", "legacy", "training.gradient_accumulation_steps"),
    ("training_optimizer_name", "SGDOptimizer", "use optimizer.name"),
    ("loss_output_name", "loss", "use model.loss"),
    ("lr_params_feed_name", "LR", "optimizer.lr and schedule"),
    ("data_parallel_size", 1, "use training.data_parallel_size"),
    ("enable_grad_norm_clip", True, "use optimizer.clip_grad_norm"),
])
def test_keys_the_config_sets_itself_are_refused(write_config, capsys, tmp_path, key, value, use):
    code, line = _error_line(capsys, ["train", write_config(_with_parameters(**{key: value})), "-q",
                                      "--output-dir", str(tmp_path / "out")])
    assert code == 2
    assert f"training.parameters.{key}: set by the config itself: " in line and use in line, line
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("setting, expected", [
    ("training.parameters.use_mixed_precision=maybe",
     "use_mixed_precision: expected true or false, got 'maybe'"),
    ("training.parameters.use_mixed_precision='false'",
     "use_mixed_precision: expected true or false, got 'false'"),
    ("training.parameters.use_fp16_moments=1", "use_fp16_moments: expected true or false, got 1"),
    ("training.parameters.deepspeed_zero_stage='1'", "deepspeed_zero_stage: expected an int, got '1'"),
    ("training.parameters.deepspeed_zero_stage=true", "deepspeed_zero_stage: expected an int, got True"),
    ("training.parameters.loss_scale=big", "loss_scale: expected a number, got 'big'"),
    ("training.parameters.weights_to_train=3",
     "weights_to_train: TrainingParameters.weights_to_train must be"),
    ("training.parameters.mixed_precision_dtype=float8",
     "mixed_precision_dtype: expected one of 'float16', 'bfloat16', got 'float8'"),
])
def test_wrong_types_name_the_full_key_path(capsys, setting, expected):
    """Through the command line: exit 2, one stderr line, no traceback. The dtype is checked although
    mixed precision is off."""
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--set", setting])
    assert code == 2
    assert f"training.parameters.{expected}" in line, line
    assert "Traceback" not in line


def test_mixed_precision_dtype_named_when_mixed_precision_is_on(capsys):
    code, line = _error_line(capsys, ["train", config_path("digits_mlp"), "-q", "--set",
                                      "training.mixed_precision=true", "--set",
                                      "training.parameters.mixed_precision_dtype=float8"])
    assert code == 2 and "training.parameters.mixed_precision_dtype: expected one of" in line


def test_use_mixed_precision_is_training_mixed_precision(write_config):
    """The documented `training.parameters.use_mixed_precision` is the same switch as
    training.mixed_precision: it is moved there (so config.yaml says what runs); a contradiction is
    refused."""
    cfg = load_config(write_config(_with_parameters(use_mixed_precision=True)))
    assert cfg.training.mixed_precision is True and "use_mixed_precision" not in cfg.training.parameters
    assert cfg.to_dict()["training"]["mixed_precision"] is True
    raw = _with_parameters(use_mixed_precision=False)
    raw["training"]["mixed_precision"] = True
    with pytest.raises(ConfigError, match=r"^training.parameters.use_mixed_precision: false contradicts"):
        load_config(write_config(raw))


def test_optimizer_attributes_the_config_sets_are_refused_others_kept(write_config):
    model = build_model(load_config(write_config(MLP)))
    weights = [t.name for t in model.graph.initializer]
    attrs = {w: {"epsilon": 1e-3} for w in weights}
    key = f"training.parameters.optimizer_attributes_map.{weights[0]}.epsilon"
    with pytest.raises(ConfigError, match=rf"^{key}: set by the config itself: use optimizer.eps"):
        load_config(write_config(_with_parameters(optimizer_attributes_map=attrs)))
    # Lamb's ratio_min has no config key: given with optimizer.eps, both reach the session
    raw = _with_parameters(optimizer_attributes_map={w: {"ratio_min": 0.25} for w in weights})
    raw["optimizer"] = {"name": "lamb", "eps": 1e-4}
    cfg = load_config(write_config(raw))
    p = training_parameters(cfg, build_model(cfg))
    # (read back as float32, as onnxruntime-training's binding stores the map: ad9ea61)
    eps = float(np.float32(1e-4))
    assert p.optimizer_attributes_map == {w: {"ratio_min": 0.25, "epsilon": eps} for w in weights}


def test_data_parallel_size_reaches_the_session_only_when_the_config_sets_it(write_config):
    """Left at its default, training.data_parallel_size is not assigned, so that a run under mpiexec takes
    the world size without the warning an assigned size that differs from it gets."""
    cfg = load_config(write_config(MLP))
    p = training_parameters(cfg, build_model(cfg))
    assert not p.is_set("data_parallel_size")  # (parallel.resolve warns about an assigned one only)
    raw = dict(MLP, training={**MLP.get("training", {}), "data_parallel_size": 2})
    cfg = load_config(write_config(raw))
    p = training_parameters(cfg, build_model(cfg))
    assert p.is_set("data_parallel_size") and p.data_parallel_size == 2


def test_the_weights_to_train_fallback_warns_once_a_run(write_config):
    """training.parameters.weights_to_train naming nothing the model reads trains what discovery finds, with a
    warning (as onnxruntime-training 1.16.3 fell back); with optimizer attributes from the config the CLI
    selected the weights once more to fill the attribute map, and the warning came twice."""
    import warnings

    from onnxtrain.train.session import make_session

    raw = _with_parameters(weights_to_train=["nope"])
    raw["optimizer"] = {"name": "adam", "eps": 1e-4}
    cfg = load_config(write_config(raw))
    model = build_model(cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        make_session(cfg, model, training_parameters(cfg, model))
    fallback = [str(w.message) for w in caught if "have no consumer" in str(w.message)]
    assert len(fallback) == 1, fallback
    assert "'nope'" in fallback[0]
