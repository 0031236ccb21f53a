"""User data files, held-out splits, schedules, and the session ↔ checkpoint mapping for each optimizer."""

from __future__ import annotations

import math

import numpy as np
import onnx
import pytest

from onnxtrain.checkpoint import checkpoint_from_bytes, checkpoint_to_bytes
from onnxtrain.train import ConfigError, Trainer, config_from_dict
from onnxtrain.train.data import load_data, rng_from_str, rng_state_to_str, sequence_task
from onnxtrain.train.schedule import learning_rate
from onnxtrain.train.state import checkpoint_to_state, session_to_checkpoint
from onnxtrain.zoo import mlp


def _blobs(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    y = rng.integers(0, 3, n)
    x = rng.standard_normal((n, 4)) * 0.5 + np.eye(3, 4)[y] * 3.0  # float64: the trainer casts to float32
    return x, y


def test_npz_with_held_out_split_and_user_model(tmp_path):
    x, y = _blobs(400)
    np.savez(tmp_path / "blobs.npz", features=x, target=y)
    onnx.save(mlp([4, 16, 3], loss=False), tmp_path / "net.onnx")  # an inference model: the loss is appended
    raw = {"model": {"path": "net.onnx", "add_loss": "cross_entropy", "labels": "target"},
           "data": {"source": "files", "path": "blobs.npz", "feeds": {"x": "features", "target": "target"},
                    "eval_fraction": 0.25},
           "optimizer": {"name": "sgd", "lr": 0.1}, "training": {"epochs": 5, "batch_size": 16}}
    cfg = config_from_dict(raw, base_dir=str(tmp_path))
    ds = load_data(cfg)
    assert len(ds.eval["x"]) == 100 and len(ds.train["x"]) == 300
    again = load_data(cfg)
    np.testing.assert_array_equal(ds.eval["target"], again.eval["target"])  # the split follows the seed
    result = Trainer(cfg, str(tmp_path / "out"), progress=False).run()
    assert result.metrics["eval_accuracy"] > 0.95
    exported = onnx.load(result.exported)
    assert [i.name for i in exported.graph.input] == ["x"]


def test_npy_feeds_and_mse(tmp_path):
    rng = np.random.default_rng(1)
    x = rng.standard_normal((256, 4)).astype(np.float32)
    y = (x @ rng.standard_normal((4, 2))).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    np.save(tmp_path / "y.npy", y)
    onnx.save(mlp([4, 2], loss=False), tmp_path / "lin.onnx")
    raw = {"model": {"path": "lin.onnx", "add_loss": "mse"},
           "data": {"source": "files", "feeds": {"x": "x.npy", "y": "y.npy"}},
           "optimizer": {"name": "adam", "lr": 0.05}, "training": {"epochs": 30, "batch_size": 32}}
    cfg = config_from_dict(raw, base_dir=str(tmp_path))
    result = Trainer(cfg, str(tmp_path / "out"), progress=False).run()
    assert "eval_accuracy" not in result.metrics and result.metrics["eval_loss"] < 1e-2


def test_data_errors_name_their_key(tmp_path):
    x, y = _blobs(50)
    np.savez(tmp_path / "d.npz", features=x, target=y)
    base = {"model": {"builder": "mlp", "args": {"sizes": [4, 3]}}, "training": {"epochs": 1}}
    def files(**data) -> dict:
        return {**base, "data": {"source": "files", **data}}

    here = str(tmp_path)
    cfg = config_from_dict(files(path="d.npz", feeds={"x": "features", "y": "labels"}), base_dir=here)
    with pytest.raises(ConfigError, match=r"^data.feeds.y: no array 'labels' in .*d.npz"):
        load_data(cfg)
    cfg = config_from_dict(files(path="d.npz", feeds={"x": "features", "z": "target"}), base_dir=here)
    with pytest.raises(ConfigError, match=r"^data.feeds.z: 'z' is not an input of the model"):
        Trainer(cfg, str(tmp_path / "o"), progress=False)
    with pytest.raises(ConfigError, match=r"^data.feeds.x: 'features' is an array name but data.path"):
        config_from_dict(files(feeds={"x": "features"}), base_dir=str(tmp_path))
    cfg = config_from_dict({**base, "model": {"builder": "mlp", "args": {"sizes": [64, 10]},
                                              "logits": "probs"}})
    with pytest.raises(ConfigError, match=r"^model.logits: 'probs' is not a value of the model"):
        Trainer(cfg, str(tmp_path / "o"), progress=False)


def test_sequence_tasks_and_rng_round_trip():
    rng = np.random.default_rng(0)
    d = sequence_task("sort", 5, 6, 10, rng)
    np.testing.assert_array_equal(d["y"], np.sort(d["x"], axis=1))
    d = sequence_task("reverse", 5, 6, 10, rng)
    np.testing.assert_array_equal(d["y"], d["x"][:, ::-1])
    text = rng_state_to_str(rng)
    a = rng.permutation(100)
    np.testing.assert_array_equal(rng_from_str(text).permutation(100), a)


def test_schedules():
    assert learning_rate(0, 100, 1.0, "constant", warmup_steps=10) == pytest.approx(0.1)
    assert learning_rate(9, 100, 1.0, "constant", warmup_steps=10) == 1.0
    assert learning_rate(50, 100, 1.0, "constant") == 1.0
    assert learning_rate(0, 101, 1.0, "linear") == 1.0
    assert learning_rate(100, 101, 1.0, "linear", final_lr_ratio=0.1) == pytest.approx(0.1)
    assert learning_rate(50, 101, 1.0, "linear") == pytest.approx(0.5)
    assert learning_rate(10, 111, 2.0, "cosine", warmup_steps=10) == pytest.approx(2.0)
    assert learning_rate(60, 111, 2.0, "cosine", warmup_steps=10) == pytest.approx(1.0)
    assert learning_rate(110, 111, 2.0, "cosine", warmup_steps=10) == pytest.approx(0.0, abs=1e-12)
    assert learning_rate(35, 111, 2.0, "cosine", warmup_steps=10) == pytest.approx(1 + math.cos(math.pi / 4))


@pytest.mark.parametrize("optimizer, builder, args", [
    ("adam", "mlp", {"sizes": [64, 16, 10]}),
    ("lamb", "mlp", {"sizes": [64, 16, 10]}),
    ("sgd", "mlp", {"sizes": [64, 16, 10]}),
    ("adam", "cnn", {"channels": [4], "batch_norm": True}),
])
def test_checkpoint_round_trip_restores_every_state_tensor(tmp_path, optimizer, builder, args):
    raw = {"model": {"builder": builder, "args": args},
           "data": {"source": "digits", "images": builder == "cnn"},
           "optimizer": {"name": optimizer, "lr": 0.01}, "training": {"steps": 5, "batch_size": 16}}
    cfg = config_from_dict(raw)
    tr = Trainer(cfg, str(tmp_path), progress=False)
    tr.run()
    before = tr.sess.get_state()
    saved = session_to_checkpoint(tr.sess, tr.model, 0.01, 5, {"a": 1})
    ckpt = checkpoint_from_bytes(checkpoint_to_bytes(saved))
    assert ckpt.optimizer_groups[0].step == 5
    if optimizer != "sgd":
        moments = ckpt.optimizer_groups[0].states["fc.weight" if builder == "cnn" else "fc0.weight"]
        assert set(moments) == {"momentum0", "momentum1"}
    if builder == "cnn":
        assert "bn0.running_mean" in ckpt.frozen and "bn0.weight" in ckpt.trainable
        assert not np.array_equal(ckpt.frozen["bn0.running_mean"], 0)  # the session's updated statistics
    fresh = Trainer(cfg, str(tmp_path / "fresh"), progress=False)
    fresh.sess.load_state(checkpoint_to_state(ckpt, fresh.sess), strict=True)
    after = fresh.sess.get_state()
    assert before.keys() == after.keys()
    for k in before:
        np.testing.assert_array_equal(before[k], after[k], err_msg=k)


def test_appended_loss_of_a_float64_model_is_float64(tmp_path):
    """``model.add_loss`` on a float64 model declares the loss float64 (it was declared float32, which the
    node check refuses as onnxruntime does); the run trains and learns."""
    from onnxtrain.testing import to_float64

    x, y = _blobs(400)
    np.savez(tmp_path / "blobs.npz", features=x, target=y)
    onnx.save(to_float64(mlp([4, 16, 3], loss=False)), tmp_path / "net64.onnx")
    for loss in ("cross_entropy", "mse"):
        feeds = {"x": "features", "target": "target"} if loss == "cross_entropy" else {"x": "features"}
        raw = {"model": {"path": "net64.onnx", "add_loss": loss, "labels": "target"},
               "data": {"source": "files", "path": "blobs.npz", "feeds": feeds, "eval_fraction": 0.25},
               "optimizer": {"name": "sgd", "lr": 0.1}, "training": {"epochs": 5, "batch_size": 16}}
        if loss == "mse":
            np.savez(tmp_path / "blobs.npz", features=x, target=np.eye(3)[y])
            raw["data"]["feeds"] = {"x": "features", "target": "target"}
        cfg = config_from_dict(raw, base_dir=str(tmp_path))
        result = Trainer(cfg, str(tmp_path / f"out_{loss}"), progress=False).run()
        assert np.isfinite(result.metrics["eval_loss"])
        if loss == "cross_entropy":
            assert result.metrics["eval_accuracy"] > 0.95


def test_resuming_with_a_checkpoint_of_another_dtype_names_resume(tmp_path):
    """A float64 run's checkpoint resumed with the float32 model: a ConfigError naming --resume (the CLI's
    exit 2), not a TypeError escaping the loop."""
    from onnxtrain.testing import to_float64
    from onnxtrain.train.config import ConfigError

    x, y = _blobs(200)
    np.savez(tmp_path / "blobs.npz", features=x, target=y)
    onnx.save(to_float64(mlp([4, 16, 3], loss=False)), tmp_path / "net64.onnx")
    onnx.save(mlp([4, 16, 3], loss=False), tmp_path / "net32.onnx")

    def cfg(path: str, epochs: int):
        raw = {"model": {"path": path, "add_loss": "cross_entropy", "labels": "target"},
               "data": {"source": "files", "path": "blobs.npz", "eval_fraction": 0.25,
                        "feeds": {"x": "features", "target": "target"}},
               "optimizer": {"name": "sgd", "lr": 0.1}, "training": {"epochs": epochs, "batch_size": 16}}
        return config_from_dict(raw, base_dir=str(tmp_path))

    Trainer(cfg("net64.onnx", 1), str(tmp_path / "out"), progress=False).run()
    with pytest.raises(ConfigError, match=r"--resume.*expected dtype float32, got float64"):
        Trainer(cfg("net32.onnx", 2), str(tmp_path / "out"), progress=False).run(resume=True)
