"""A run killed (SIGKILL) inside a checkpoint's commit, between the renames of its files (review H): the
new ``step_<N>.ckpt`` is in place, its ``.sha256`` not yet, and the commit's journal says to put the folder
back as it was before that save. ``--resume`` must then continue from the checkpoint before it and end as an
uninterrupted run (the oracle: that run's final checkpoint and metrics.jsonl, compared exactly). It listed the
checkpoints before it cleared up after the killed save, so it tried to load the step the clean-up had just
removed: 'Checkpoint file not found' (exit 1), though a whole checkpoint was there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.cli import main
from onnxtrain.train import Trainer, load_config
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import REPO, config_path

SETS = ["training.steps=8", "training.checkpoint_every=2", "training.log_every=3", "training.eval_every=5",
        "training.keep_checkpoints=0", "output.plot=false", "model.args.sizes=[64,16,10]"]
KILLED_AT = 6  # the step whose checkpoint's commit is killed after its first rename

# the run, in a child that kills itself right after the first rename of step KILLED_AT's commit
_CHILD = """
import os, signal, sys
from onnxtrain.train import Trainer, load_config
out, config, step, *sets = sys.argv[1:]
real = os.replace
def replace(src, dst, *a, **k):
    real(src, dst, *a, **k)
    if os.path.basename(os.fspath(dst)) == f"step_{int(step):08d}.ckpt":
        os.kill(os.getpid(), signal.SIGKILL)
os.replace = replace
Trainer(load_config(config, sets), out, progress=False).run()
"""


def _metrics(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in f]


def test_resume_after_a_kill_between_a_checkpoints_renames(tmp_path, capsys):
    whole, killed = str(tmp_path / "whole"), str(tmp_path / "killed")
    Trainer(load_config(config_path("digits_mlp"), SETS), whole, progress=False).run()
    proc = subprocess.run([sys.executable, "-c", _CHILD, killed, config_path("digits_mlp"), str(KILLED_AT),
                           *SETS], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr
    folder = os.path.join(killed, "checkpoints")
    names = os.listdir(folder)
    # the killed commit: the new checkpoint renamed into place, its sums still a temporary, the journal there
    assert f"step_{KILLED_AT:08d}.ckpt" in names and f"step_{KILLED_AT:08d}.ckpt.sha256" not in names, names
    assert any(n.endswith(".journal.tmp") for n in names), names
    capsys.readouterr()
    code = main(["train", config_path("digits_mlp"), "-q", "--output-dir", killed, "--resume",
                 *[a for s in SETS for a in ("--set", s)]])
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"put back {os.path.join(folder, f'step_{KILLED_AT:08d}.ckpt')}" in err, err
    a, b = (load_checkpoint(list_checkpoints(f)[-1][1]) for f in (whole, killed))
    assert list_checkpoints(killed)[-1][0] == 8
    for part in ("trainable", "frozen"):
        x, y = getattr(a, part), getattr(b, part)
        assert x.keys() == y.keys()
        for k in x:
            np.testing.assert_array_equal(y[k], x[k], err_msg=k)
    for ga, gb in zip(a.optimizer_groups, b.optimizer_groups, strict=True):
        assert ga.step == gb.step
        for w, d in ga.states.items():
            for k, v in d.items():
                np.testing.assert_array_equal(gb.states[w][k], v, err_msg=f"{w}/{k}")
    assert a.properties == b.properties
    assert _metrics(killed) == _metrics(whole)
