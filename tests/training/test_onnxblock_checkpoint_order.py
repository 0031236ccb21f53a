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
import pytest
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


_ORT_DUPLICATE = PREAMBLE + r"""
from onnxruntime.training import onnxblock
folder = sys.argv[1]
t = onnx.load_tensor(f"{folder}/dup.pb")
try:
    onnxblock.save_checkpoint(([t, t], []), f"{folder}/ort_dup.ckpt")
    print("saved")
except RuntimeError as e:
    print("refused:", e)
"""


def test_a_name_twice_in_one_list_is_refused_as_onnxruntime_training(tmp_path):
    """Two tensors of one name in a list: onnxruntime-training refuses them; onnxtrain kept the last one
    silently (a checkpoint without the first tensor's values)."""
    python = ensure_ortt()
    a = numpy_helper.from_array(np.ones(2, np.float32), "dup")
    b = numpy_helper.from_array(np.zeros(2, np.float32), "dup")
    onnx.save_tensor(a, str(tmp_path / "dup.pb"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    proc = subprocess.run([python, "-c", _ORT_DUPLICATE, str(tmp_path)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("refused:") and "Duplicated tensor proto named dup" in proc.stdout
    for lists in (([a, b], []), ([], [a, b])):
        with pytest.raises(RuntimeError, match="Duplicated tensor proto named 'dup'"):
            onnxblock.save_checkpoint(lists, str(tmp_path / "ours.ckpt"))
        assert not os.path.exists(tmp_path / "ours.ckpt")


def test_checkpoint_state_takes_a_bytes_path_as_onnxruntime_training(tmp_path):
    """onnxruntime-training's wrappers pass ``os.fspath``'s bytes to its loader and writer; onnxtrain
    refused them with a TypeError."""
    from onnxtrain.training.api import CheckpointState

    path = str(tmp_path / "c.ckpt")
    onnxblock.save_checkpoint((_tensors(["w"], 3), []), path)
    state = CheckpointState.load_checkpoint(os.fsencode(path))
    CheckpointState.save_checkpoint(state, os.fsencode(str(tmp_path / "again.ckpt")))
    again = CheckpointState.load_checkpoint(str(tmp_path / "again.ckpt"))
    np.testing.assert_array_equal(again.parameters["w"].data, np.full((2, 3), 3, np.float32))
    with pytest.raises(TypeError, match="checkpoint_uri must be a path, got int"):
        CheckpointState.load_checkpoint(3)
