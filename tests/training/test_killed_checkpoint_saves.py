"""Checkpoint saves killed with SIGKILL part way: the files saved before stay whole and loadable, and the
half-written temporary a kill leaves is deleted by the next save into that folder, whatever file that save
writes (a training script saving ``epoch_<n>.ckpt`` never writes the killed save's name again)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from onnxtrain.ir.io import StagedFiles
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState
from tests.session.helpers import mlp_model

NAMES = ("W1", "b1", "W2", "b2")

# saves epoch_1.ckpt whole, then hangs in the fsync of epoch_2.ckpt's temporary (its bytes written) until
# the test kills it
_CHILD = textwrap.dedent(r"""
    import os, sys, time
    from onnxtrain.training.api import CheckpointState
    folder, out = sys.argv[1], sys.argv[2]
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    for k in ("W1", "b1", "W2", "b2"):
        state.parameters[k].data[...] += 1.0
    CheckpointState.save_checkpoint(state, os.path.join(out, "epoch_1.ckpt"))
    real_fsync = os.fsync
    def hang(fd):
        real_fsync(fd)
        print("writing", flush=True)
        time.sleep(60)
    os.fsync = hang
    for k in ("W1", "b1", "W2", "b2"):
        state.parameters[k].data[...] += 1.0
    CheckpointState.save_checkpoint(state, os.path.join(out, "epoch_2.ckpt"))
""")


@pytest.fixture
def art(tmp_path):
    folder = tmp_path / "art"
    folder.mkdir()
    artifacts.generate_artifacts(mlp_model(), requires_grad=list(NAMES), loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(folder))
    return folder


def _kill_mid_save(art, out) -> None:
    """Run the child above and SIGKILL it while its second save's temporary is on disk."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")])}
    child = subprocess.Popen([sys.executable, "-c", _CHILD, str(art), str(out)], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = child.stdout.readline()
        assert line.strip() == "writing", child.stderr.read()[-2000:]
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    assert child.returncode == -signal.SIGKILL


def _temporaries(folder) -> list[str]:
    return sorted(f for f in os.listdir(folder) if f.endswith(".tmp") or f.endswith(".new"))


def test_a_save_under_another_name_deletes_a_killed_saves_temporary(art, tmp_path) -> None:
    out = tmp_path / "ckpts"
    out.mkdir()
    start = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    expected = {k: start.parameters[k].data + np.float32(1.0) for k in NAMES}  # what epoch_1 holds

    _kill_mid_save(art, out)
    assert sorted(f for f in os.listdir(out) if f.endswith(".ckpt")) == ["epoch_1.ckpt"]
    left = _temporaries(out)
    assert len(left) == 1 and left[0].startswith("epoch_2.ckpt."), left  # the kill's leftover
    saved = CheckpointState.load_checkpoint(str(out / "epoch_1.ckpt"))
    for k in NAMES:
        np.testing.assert_array_equal(saved.parameters[k].data, expected[k], err_msg=k)

    CheckpointState.save_checkpoint(start, str(out / "epoch_3.ckpt"))
    assert _temporaries(out) == []
    assert sorted(os.listdir(out)) == ["epoch_1.ckpt", "epoch_3.ckpt"]
    again = CheckpointState.load_checkpoint(str(out / "epoch_3.ckpt"))
    for k in NAMES:
        np.testing.assert_array_equal(again.parameters[k].data, start.parameters[k].data, err_msg=k)


def test_a_live_writers_temporary_of_another_file_is_kept(art, tmp_path) -> None:
    """A save in flight (its temporary locked) is not taken for a killed one by a save of another file."""
    out = tmp_path / "ckpts"
    out.mkdir()
    state = CheckpointState.load_checkpoint(str(art / "checkpoint"))
    with StagedFiles() as other:
        other.write(out / "other.bin", lambda f: f.write(b"in flight"))
        CheckpointState.save_checkpoint(state, str(out / "epoch_1.ckpt"))
        assert len(_temporaries(out)) == 1
    assert _temporaries(out) == []
    assert (out / "other.bin").read_bytes() == b"in flight"
