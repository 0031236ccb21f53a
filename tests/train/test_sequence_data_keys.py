"""The keys of ``data: {source: sequence}`` (task, vocab, length, train_size, eval_size) and training.seed
shape the generated token data as README.md says: checked against numpy's own reverse, sort and copy."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.train import load_config
from onnxtrain.train.data import load_data
from tests.train.conftest import config_path

TARGETS = {"reverse": lambda x: x[:, ::-1], "sort": lambda x: np.sort(x, axis=1), "copy": lambda x: x}


@pytest.mark.parametrize("task", list(TARGETS))
def test_sequence_keys_shape_the_data(task):
    sets = [f"data.task={task}", "data.vocab=5", "data.length=6", "data.train_size=300", "data.eval_size=40",
            "model.args.vocab=5", "model.args.length=6"]
    ds = load_data(load_config(config_path("tiny_transformer"), sets))
    for split, n in (("train", 300), ("eval", 40)):
        arrays = getattr(ds, split)
        x, y = arrays["x"], arrays["y"]
        assert x.shape == y.shape == (n, 6) and x.dtype == y.dtype == np.int64, split
        assert set(np.unique(x).tolist()) == set(range(5)), split  # every token of the vocabulary, no other
        np.testing.assert_array_equal(y, TARGETS[task](x), err_msg=split)
    assert not np.array_equal(ds.train["x"][:40], ds.eval["x"])  # eval is drawn apart from train
    again = load_data(load_config(config_path("tiny_transformer"), sets))
    np.testing.assert_array_equal(again.train["x"], ds.train["x"])  # the seed decides the data
    other = load_data(load_config(config_path("tiny_transformer"), [*sets, "training.seed=1"]))
    assert not np.array_equal(other.train["x"], ds.train["x"])
