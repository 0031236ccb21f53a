"""Saves that cannot write: the error names the file and is onnxruntime's RuntimeError too; saves through a
symbolic link; a missing folder; a checkpoint read while a save over it changes its layout; the
temporaries a killed save can leave. Oracles: onnxruntime-training 1.19.2's and onnxruntime 1.32's own
behaviour (quoted per test), and the old file's bytes."""

from __future__ import annotations

import errno
import os
import threading

import numpy as np
import onnx
import pytest

from onnxtrain import GradientGraphBuilder, SessionOptions
from onnxtrain.errors import Fail
from onnxtrain.ir.io import TMP_SUFFIX
from onnxtrain.training import onnxblock
from onnxtrain.training.api import CheckpointState
from onnxtrain.zoo import mlp


def _state(folder) -> CheckpointState:
    m = mlp([4, 8, 2], loss=False)
    path = os.path.join(folder, "src.ckpt")
    onnxblock.save_checkpoint((list(m.graph.initializer), []), path)
    return CheckpointState.load_checkpoint(path)


def _full_disk(monkeypatch) -> None:
    """fsync of a staged file fails as on a full disk (ENOSPC): an OSError with no file name."""
    real = os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(TMP_SUFFIX):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


def _builder() -> GradientGraphBuilder:
    m = mlp([4, 8, 2])
    b = GradientGraphBuilder(m.SerializeToString(), {"loss"}, {t.name for t in m.graph.initializer}, "loss")
    b.build()
    return b


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads fds' paths from /proc")
@pytest.mark.parametrize("saver", ["CheckpointState.save_checkpoint", "onnxblock.save_checkpoint",
                                   "GradientGraphBuilder.save"])
def test_a_full_disk_names_the_file_and_keeps_the_old_one(saver, tmp_path, monkeypatch):
    """A failure writing the bytes (ENOSPC here; EFBIG under a file size limit) raised a bare OSError with
    no file name, which a ported `except RuntimeError` missed (onnxruntime-training: "RuntimeError ...
    Failed to save checkpoint to file: <path>"). It names the file now, is a Fail (a RuntimeError), and
    the old file keeps its bytes."""
    src = tmp_path / "src"
    src.mkdir()
    state, builder = _state(str(src)), _builder()
    path = tmp_path / "out"
    path.write_bytes(b"old bytes")
    tensors = (list(mlp([4, 8, 2], loss=False).graph.initializer), [])
    save = {"CheckpointState.save_checkpoint": lambda: CheckpointState.save_checkpoint(state, str(path)),
            "onnxblock.save_checkpoint": lambda: onnxblock.save_checkpoint(tensors, path),
            "GradientGraphBuilder.save": lambda: builder.save(str(path))}[saver]
    _full_disk(monkeypatch)
    with pytest.raises(OSError) as e:
        save()
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(path)
    assert isinstance(e.value, Fail) and isinstance(e.value, RuntimeError)
    assert path.read_bytes() == b"old bytes"
    assert sorted(os.listdir(tmp_path)) == ["out", "src"]


def test_a_save_through_a_symbolic_link_keeps_the_link(tmp_path):
    """A model saved to a symbolic link (GradientGraphBuilder.save, an optimized_model_filepath) replaced
    the link with a file and left its target old; onnx.save and onnxruntime 1.32 write the target and keep
    the link, as onnxtrain's checkpoints already did."""
    from onnxtrain import InferenceSession

    target, link = tmp_path / "real.onnx", tmp_path / "link.onnx"
    target.write_bytes(b"old")
    link.symlink_to(target)
    b = _builder()
    b.save(str(link))
    assert link.is_symlink() and onnx.load(str(target)).graph.output[-1].name.endswith("_grad")
    target.write_bytes(b"old")
    so = SessionOptions()
    so.optimized_model_filepath = str(link)
    InferenceSession(mlp([4, 8, 2], loss=False).SerializeToString(), so)
    assert link.is_symlink() and len(onnx.load(str(target)).graph.node) > 0
    assert sorted(os.listdir(tmp_path)) == ["link.onnx", "real.onnx"]


def test_a_missing_folder_is_an_error_as_in_onnxruntime(tmp_path):
    """optimized_model_filepath and GradientGraphBuilder.save into a folder that does not exist created
    it (a typo made folders); onnxruntime 1.32 refuses (InvalidArgument SystemError 2), onnx.save raises a
    FileNotFoundError. Both name the path, and nothing is made."""
    from onnxtrain import InferenceSession

    missing = tmp_path / "typo" / "deeper" / "out.onnx"
    with pytest.raises(FileNotFoundError, match="out.onnx"):
        _builder().save(str(missing))
    so = SessionOptions()
    so.optimized_model_filepath = str(missing)
    with pytest.raises(FileNotFoundError, match="out.onnx"):
        InferenceSession(mlp([4, 8, 2], loss=False).SerializeToString(), so)
    assert os.listdir(tmp_path) == []



def test_which_dump_a_missing_folder_makes_an_invalid_argument(tmp_path):
    """onnxruntime refuses optimized_model_filepath in a missing folder with InvalidArgument (here: its
    class, by name, among onnxtrain's error's); a TrainingParameters dump path, which only the legacy session
    has (1.16.3 writes nothing there and says nothing), is a FileNotFoundError and NoSuchFile, not that."""
    ort = pytest.importorskip("onnxruntime")
    from onnxtrain import InferenceSession, TrainingParameters, TrainingSession
    from onnxtrain.capi import onnxruntime_pybind11_state as C

    model = mlp([4, 8, 2], loss=False).SerializeToString()
    missing = str(tmp_path / "typo" / "out.onnx")
    caught = []
    for module in (ort, None):
        so = (ort.SessionOptions if module else SessionOptions)()
        so.optimized_model_filepath = missing
        try:
            if module:
                ort.InferenceSession(model, so, providers=["CPUExecutionProvider"])
            else:
                InferenceSession(model, so)
        except Exception as e:  # noqa: BLE001 - the classes are compared
            caught.append([c.__name__ for c in type(e).__mro__])
    theirs, ours = caught
    assert theirs[0] == "InvalidArgument" and {"InvalidArgument", "FileNotFoundError"} <= set(ours), caught
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.model_with_training_graph_path = missing
    with pytest.raises(C.NoSuchFile, match="model_with_training_graph_path") as e:
        TrainingSession(mlp([4, 8, 2]).SerializeToString(), p)
    assert isinstance(e.value, FileNotFoundError) and not isinstance(e.value, C.InvalidArgument)
    assert os.listdir(tmp_path) == []

def test_a_load_while_a_save_drops_the_external_data(tmp_path):
    """A checkpoint saved with external data (.data) and then over itself without (inline): a load that read
    the old main file then found its .data deleted by the new save's commit and failed (19 of 3,237 loads);
    it reads again, as for the other saves over a path it catches in between."""
    from onnxtrain.checkpoint import format as fmt

    path = str(tmp_path / "c.ckpt")
    rng = np.random.default_rng(0)
    big = {"w": rng.standard_normal(4096).astype(np.float32)}
    state = fmt.Checkpoint(trainable=big)
    fmt.save_checkpoint(state, path, external_threshold=1024)
    stop, failures, loads = threading.Event(), [], [0]

    def reader() -> None:
        while not stop.is_set():
            try:
                got = fmt.load_checkpoint(path)
                np.testing.assert_array_equal(got.trainable["w"], big["w"])
                loads[0] += 1
            except Exception as e:  # noqa: BLE001
                failures.append(repr(e))

    t = threading.Thread(target=reader)
    t.start()
    try:
        for k in range(300):
            fmt.save_checkpoint(state, path, external_threshold=1024 if k % 2 else 1 << 30)
    finally:
        stop.set()
        t.join()
    assert loads[0] > 0
    assert failures == []


def test_the_cli_start_up_removes_a_killed_saves_fresh_temporary(tmp_path):
    """A save killed in the moment before its temporary is locked leaves `<name>.<8>.onnxtrain.new` (an
    auditor's SIGKILLs left one in 30): the CLI's start-up clean-up matched only `.onnxtrain.tmp`, so it
    stayed in the run folder for good; so did the .data of a checkpoint a prune deleted the main file of
    before it was killed."""
    from onnxtrain.train.outputs import remove_stale_temporaries

    ckpts = tmp_path / "checkpoints"
    ckpts.mkdir()
    left = [ckpts / "step_00000005.ckpt.a1b2c3d4.onnxtrain.new",
            tmp_path / "model.onnx.zz9_ab12.onnxtrain.new",
            ckpts / "step_00000003.ckpt.data"]  # a prune killed between its two deletes
    kept = [ckpts / "step_00000005.ckpt", ckpts / "step_00000005.ckpt.data", tmp_path / "notes.onnxtrain.new"]
    for f in left + kept:
        f.write_bytes(b"")
    removed = remove_stale_temporaries(str(tmp_path))
    assert sorted(removed) == sorted(map(str, left))
    assert all(f.exists() for f in kept) and not any(f.exists() for f in left)
