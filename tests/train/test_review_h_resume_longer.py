"""Training a run for longer (README: ``--resume --set training.steps=N``), review H. Under a constant
schedule (with or without its warm-up) the rate of a step does not depend on the run's length, so the resumed
run ends bit for bit as an uninterrupted run of N steps (the oracle: that run), and ``--resume`` must not warn
that it will not match one. Under a decaying schedule the length moves every rate after the warm-up: the
warning is right there, and the weights differ from the uninterrupted run's."""

from __future__ import annotations

import numpy as np
import pytest

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.train import Trainer, load_config
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import config_path

SETS = ["training.checkpoint_every=3", "training.log_every=2", "training.eval_every=4",
        "output.plot=false", "output.export=false", "model.args.sizes=[64,16,10]"]


def _final(folder: str) -> dict[str, np.ndarray]:
    c = load_checkpoint(list_checkpoints(folder)[-1][1])
    return {**c.trainable, **{f"{w}/{k}": v for g in c.optimizer_groups for w, d in g.states.items()
                              for k, v in d.items()}}


@pytest.mark.parametrize("length,longer", [("training.steps=6", "training.steps=10"),
                                           ("training.epochs=1", "training.epochs=2")])
@pytest.mark.parametrize("schedule", [["schedule.kind=constant", "schedule.final_lr_ratio=0"],
                                      ["schedule.kind=constant", "schedule.final_lr_ratio=0",
                                       "schedule.warmup_steps=4", "optimizer.name=sgd", "optimizer.lr=0.05",
                                       "optimizer.clip_grad_norm=null"]],
                         ids=["adam", "sgd-warmup"])
def test_a_constant_schedule_trained_for_longer_is_not_warned(tmp_path, capsys, schedule, length, longer):
    sets = [*SETS, *schedule, "training.steps=null"]
    whole, more = str(tmp_path / "whole"), str(tmp_path / "more")
    Trainer(load_config(config_path("digits_mlp"), [*sets, longer]), whole, progress=False).run()
    Trainer(load_config(config_path("digits_mlp"), [*sets, length]), more, progress=False).run()
    capsys.readouterr()
    Trainer(load_config(config_path("digits_mlp"), [*sets, longer]), more, progress=False).run(resume=True)
    err = capsys.readouterr().err
    a, b = _final(whole), _final(more)
    assert a.keys() == b.keys()
    for k in a:  # the oracle: the uninterrupted run of the longer config
        np.testing.assert_array_equal(b[k], a[k], err_msg=k)
    assert "changed config" not in err, err


def test_a_decaying_schedule_trained_for_longer_is_still_warned(tmp_path, capsys):
    sets = [*SETS, "schedule.kind=cosine", "schedule.warmup_steps=2"]
    whole, more = str(tmp_path / "whole"), str(tmp_path / "more")
    Trainer(load_config(config_path("digits_mlp"), [*sets, "training.steps=10"]), whole, progress=False).run()
    Trainer(load_config(config_path("digits_mlp"), [*sets, "training.steps=6"]), more, progress=False).run()
    capsys.readouterr()
    Trainer(load_config(config_path("digits_mlp"), [*sets, "training.steps=10"]), more, progress=False
            ).run(resume=True)
    assert "resuming with a changed config (training.steps)" in capsys.readouterr().err
    a, b = _final(whole), _final(more)
    assert max(float(np.abs(a[k] - b[k]).max()) for k in a) > 1e-4  # the warning is right
