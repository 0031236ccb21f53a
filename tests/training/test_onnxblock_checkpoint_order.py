"""onnxblock.save_checkpoint writes the parameters in the order of its two lists, as onnxruntime-training
1.19.2's ``onnxblock.save_checkpoint`` does (it sorts nothing; CheckpointState.save_checkpoint sorts).

Oracle: onnxruntime-training's onnxblock.save_checkpoint on the same TensorProtos (tests/ortt.py); both
files are read with onnxtrain's reader, which keeps the stored order.
"""

from __future__ import annotations

import json
import os
import subprocess

import numpy as np
import onnx
from onnx import numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.training import onnxblock
from tests.ortt import PREAMBLE, ensure_ortt

TRAINABLE = ["zeta.weight", "alpha.weight", "mid.bias", "beta"]  # far from the alphabetical order
FROZEN = ["z.running_var", "a.running_mean", "m"]

_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import onnxblock
trainable, frozen, folder = json.loads(sys.argv[1])
load = lambda names: [onnx.load_tensor(f"{folder}/{n}.pb") for n in names]
for nominal in (False, True):
    onnxblock.save_checkpoint((load(trainable), load(frozen)), f"{folder}/ort_{int(nominal)}.ckpt",
                              nominal_checkpoint=nominal)
"""


def _tensors(names: list[str], start: int) -> list[onnx.TensorProto]:
    return [numpy_helper.from_array(np.full((2, 3), start + i, np.float32), n) for i, n in enumerate(names)]


def test_onnxblock_save_checkpoint_keeps_list_order(tmp_path):
    python = ensure_ortt()
    trainable, frozen = _tensors(TRAINABLE, 0), _tensors(FROZEN, 10)
    for t in trainable + frozen:
        onnx.save_tensor(t, str(tmp_path / f"{t.name}.pb"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python, "-c", _ORT_SCRIPT, json.dumps([TRAINABLE, FROZEN, str(tmp_path)])],
                          capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for nominal in (False, True):
        ours = str(tmp_path / f"ot_{int(nominal)}.ckpt")
        onnxblock.save_checkpoint((trainable, frozen), ours, nominal_checkpoint=nominal)
        want, got = load_checkpoint(str(tmp_path / f"ort_{int(nominal)}.ckpt")), load_checkpoint(ours)
        assert list(want.trainable) == TRAINABLE and list(want.frozen) == FROZEN, nominal
        assert list(got.trainable) == list(want.trainable), nominal
        assert list(got.frozen) == list(want.frozen), nominal
        assert got.nominal == want.nominal == nominal
        if not nominal:
            for name in TRAINABLE:
                np.testing.assert_array_equal(got.trainable[name], want.trainable[name])
            for name in FROZEN:
                np.testing.assert_array_equal(got.frozen[name], want.frozen[name])
