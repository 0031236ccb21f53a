"""--resume with another training.batch_size (or accumulation count) continues the epoch's order from the
first sample not yet seen, in full batches only; the oracle is the data-order permutation itself."""

from __future__ import annotations

import json
import math
import os
import shutil

import numpy as np
import pytest

from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
from onnxtrain.train import Trainer, load_config
from onnxtrain.train import data as data_mod
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import config_path

FIRST = 30  # steps of 32 before the stop: 960 of the 1,438 samples of epoch 0
BASE = ["training.epochs=null", "training.log_every=1", "training.eval_every=1000",
        "training.keep_checkpoints=0", "output.plot=false", "output.export=false"]


class _Recorder(np.ndarray):
    """A training array that records the sample indices each batch takes from it."""

    taken: list[np.ndarray]

    def __getitem__(self, key):
        if isinstance(key, np.ndarray) and key.dtype.kind in "iu":
            self.taken.append(np.array(key))
        return np.asarray(super().__getitem__(key))


def _train(out: str, sets: list[str], resume: bool) -> tuple[list[np.ndarray], int]:
    """Run in ``out``; the index array of every micro-batch, and the run's training-set size."""
    trainer = Trainer(load_config(config_path("digits_mlp"), [*BASE, *sets]), out, progress=False)
    first = next(iter(trainer.data.train))
    rec = trainer.data.train[first].view(_Recorder)
    rec.taken = []
    trainer.data.train = {**trainer.data.train, first: rec}
    result = trainer.run(resume=resume)
    assert result.status == "finished"
    return rec.taken, trainer.data.n_train


@pytest.fixture(scope="module")
def stopped(tmp_path_factory) -> tuple[str, list[np.ndarray]]:
    """A run folder holding one checkpoint at step 30 (batch size 32), and the batches it took."""
    out = str(tmp_path_factory.mktemp("stopped"))
    taken, _ = _train(out, [f"training.steps={FIRST}", f"training.checkpoint_every={FIRST}"], False)
    return out, taken


def _drop_samples_property(folder: str) -> None:
    """Make the checkpoint look written before the position was kept in samples."""
    path = list_checkpoints(folder)[-1][1]
    ckpt = load_checkpoint(path)
    del ckpt.properties["epoch_samples"]
    save_checkpoint(ckpt, path)
    os.unlink(path + ".sha256")  # (nor its SHA-256 sums, which came later; they would not match it now)


@pytest.mark.parametrize("batch, micro, old_format", [
    (64, 1, False), (16, 1, False), (16, 3, False), (64, 1, True), (24, 1, True)])
def test_resume_with_another_batch_size_sees_each_sample_once(tmp_path, stopped, batch, micro, old_format):
    out = str(tmp_path / "run")
    shutil.copytree(stopped[0], out)
    if old_format:
        _drop_samples_property(out)
    n = 1438
    step = batch * micro
    left = n - FIRST * 32
    rest = left // step  # the full steps left in epoch 0; then two steps of epoch 1
    sets = [f"training.steps={FIRST + rest + 2}", f"training.batch_size={batch}",
            f"training.gradient_accumulation_steps={micro}", "training.checkpoint_every=1000"]
    taken, n_train = _train(out, sets, True)
    assert n_train == n

    rng = data_mod.order_rng(0)  # the oracle: the permutations the data order draws, one an epoch
    perm0, perm1 = rng.permutation(n), rng.permutation(n)
    first = stopped[1]
    assert all(len(b) == 32 for b in first) and len(first) == FIRST
    assert len(taken) == (rest + 2) * micro
    assert all(len(b) == batch for b in taken), [len(b) for b in taken]  # full batches only
    epoch0 = np.concatenate([*first, *taken[:rest * micro]])
    np.testing.assert_array_equal(epoch0, perm0[:len(epoch0)])  # the order, from the first unseen sample
    assert len(np.unique(epoch0)) == len(epoch0)  # each sample of the epoch once
    assert n - len(epoch0) < step  # only a tail shorter than a step is dropped
    np.testing.assert_array_equal(np.concatenate(taken[rest * micro:]), perm1[:2 * step])

    with open(os.path.join(out, "metrics.jsonl")) as f:
        records = [json.loads(line) for line in f if '"loss"' in line]
    assert [r["step"] for r in records] == list(range(1, FIRST + rest + 3))
    assert all(r["loss"] is not None and math.isfinite(r["loss"]) for r in records)
    assert [r["epoch"] for r in records[FIRST:]] == [0] * (rest - 1) + [1] * 3
    props = load_checkpoint(list_checkpoints(out)[-1][1]).properties
    assert props["epoch"] == 1 and props["epoch_samples"] == 2 * step
    assert props["samples_seen"] == FIRST * 32 + (rest + 2) * step


def test_resume_past_the_epochs_end_starts_the_next(tmp_path, stopped):
    """A batch larger than what is left of the epoch: the resumed run starts the next epoch at once."""
    out = str(tmp_path / "run")
    shutil.copytree(stopped[0], out)
    taken, n = _train(out, [f"training.steps={FIRST + 1}", "training.batch_size=512",
                            "training.checkpoint_every=1000"], True)
    rng = data_mod.order_rng(0)
    rng.permutation(n)
    assert len(taken) == 1
    np.testing.assert_array_equal(taken[0], rng.permutation(n)[:512])
