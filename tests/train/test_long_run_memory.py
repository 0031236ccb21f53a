"""A long ``onnxtrain train`` run holds no more memory per step: the metrics it logs go to ``metrics.jsonl``
and are not also kept in a list for the whole run (the final plot reads them back from the file). Before,
every logged step and eval stayed in memory as a dict until the run ended (about 370 bytes each: 0.36 MB
per 1,000 steps at ``log_every: 1``, growing for as long as the run lasted).

Measured in a fresh process: Python's allocated blocks (``sys.getallocatedblocks``, after a collection)
at two logged steps 1,000 steps apart, with evals and checkpoints every 50 steps; and the final outputs
(the plot's points, the last eval, the checkpoints kept) are checked against the metrics file."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.train.conftest import config_path

_SCRIPT = r"""
import gc, json, sys
from onnxtrain.cli import main
from onnxtrain.train import loop

out, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
blocks = {}
log = loop.Trainer._log

def counting_log(self, *args):
    log(self, *args)
    record = args[2]  # (records, fh, record, undefined)
    step = record.get("step")
    if step in (first, last) and "loss" in record:
        gc.collect()
        blocks[step] = sys.getallocatedblocks()

loop.Trainer._log = counting_log
plotted = []
loop.plot_metrics = lambda records, path, title: plotted.extend(records)
rc = main(["train", sys.argv[4], "-q", "--set", f"training.steps={last}", "--set", "training.log_every=1",
           "--set", "training.eval_every=50", "--set", "training.checkpoint_every=50", "--set",
           f"output.dir={out}", "--set", "output.export=false"])
print(json.dumps({"rc": rc, "blocks": blocks[last] - blocks[first], "plotted": plotted}))
"""


@pytest.mark.skipif(not hasattr(sys, "getallocatedblocks"), reason="counts the interpreter's blocks")
def test_logged_metrics_are_not_held_for_the_whole_run(tmp_path) -> None:
    out = tmp_path / "run"
    env = {**os.environ, "OPENBLAS_NUM_THREADS": "1"}
    done = subprocess.run([sys.executable, "-c", _SCRIPT, str(out), "500", "1500", config_path("digits_mlp")],
                          capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0, done.stderr[-2000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["rc"] == 0
    # 1,000 logged steps and 20 evals: about 6 blocks each when every record stayed (6,000+ before)
    assert got["blocks"] < 1000, got["blocks"]
    with open(out / "metrics.jsonl", encoding="utf-8") as f:
        written = [json.loads(line) for line in f]
    assert got["plotted"] == written  # the plot still gets every record, read back from the file
    assert len([r for r in written if "loss" in r]) == 1500
    assert [r["step"] for r in written if "eval_loss" in r] == list(range(50, 1501, 50))
    assert sorted(os.listdir(out / "checkpoints")) == [f"step_{s:08d}.ckpt{x}" for s in (1400, 1450, 1500)
                                                       for x in ("", ".sha256")]
