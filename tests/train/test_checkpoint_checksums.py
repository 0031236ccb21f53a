"""SHA-256 sums beside a run's checkpoints (``step_<N>.ckpt.sha256``): a checkpoint of the right length with
flipped bytes in its weights loaded as if whole (onnxruntime-training's format has no checksum). Now
``--resume``, ``eval`` and ``export`` check it first: a run folder's damaged latest gives way to the one
before it with a warning naming it, a damaged file named on its own is refused; checkpoints written
without sums still load."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess

import numpy as np
import pytest

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.cli import main
from tests.train.test_main_job_audit import _files, assert_same_run, kill_setup  # noqa: F401 - a fixture


def _ckpt(folder: str, step: int) -> str:
    return os.path.join(folder, "checkpoints", f"step_{step:08d}.ckpt")


def _flip_in_a_weight(path: str) -> tuple[str, int]:
    """Flip one byte in the middle of the largest trained weight's bytes in the checkpoint file at ``path``
    (the file keeps its length, and still parses); the weight's name and the byte's offset."""
    ckpt = load_checkpoint(path)
    name, arr = max(ckpt.trainable.items(), key=lambda kv: kv[1].nbytes)
    with open(path, "rb") as f:
        data = bytearray(f.read())
    at = data.find(arr.tobytes())
    assert at >= 0 and data.find(arr.tobytes(), at + 1) < 0
    at += arr.nbytes // 2
    data[at] ^= 0x5A
    with open(path, "wb") as f:
        f.write(data)
    damaged = load_checkpoint(path)  # what the checkpoint's own format says: nothing wrong
    assert not np.array_equal(damaged.trainable[name], arr)
    return name, at


def _eval(capsys, config: str, checkpoint: str) -> tuple[int, dict | None, str]:
    capsys.readouterr()
    code = main(["eval", config, "--checkpoint", checkpoint, "--json"])
    out = capsys.readouterr()
    return code, json.loads(out.out) if code == 0 else None, out.err


def test_the_sums_are_sha256sums_of_the_files(kill_setup):  # noqa: F811
    """Each checkpoint has its .sha256, which coreutils' sha256sum -c accepts in the checkpoints folder."""
    _, _, whole = kill_setup
    folder = os.path.join(whole, "checkpoints")
    names = sorted(os.listdir(folder))
    assert names == ["step_00000065.ckpt", "step_00000065.ckpt.sha256", "step_00000066.ckpt",
                     "step_00000066.ckpt.sha256"], names
    if shutil.which("sha256sum") is None:
        pytest.skip("no sha256sum here")
    for name in names[1::2]:
        r = subprocess.run(["sha256sum", "--strict", "-c", name], cwd=folder, capture_output=True, text=True)
        assert r.returncode == 0 and r.stdout == f"{name[:-len('.sha256')]}: OK\n", r.stdout + r.stderr


def test_flipped_bytes_in_the_weights_are_caught_by_eval_export_and_resume(kill_setup, tmp_path, capsys):  # noqa: F811
    """One byte flipped in the middle of a weight of the latest checkpoint (step 66): eval of that file
    exits 1 naming it (it scored the damaged weights); eval and export of the run folder use step 65, as
    eval and export of step 65's file do; --resume continues from step 65 to the uninterrupted run's files,
    byte for byte."""
    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    older, latest = _ckpt(out, 65), _ckpt(out, 66)
    _flip_in_a_weight(latest)
    code, _, err = _eval(capsys, config, latest)
    assert code == 1, err
    assert f"checkpoint {latest} is damaged: its SHA-256 is" in err, err
    code, from_folder, err = _eval(capsys, config, out)
    assert code == 0, err
    assert f"checkpoint {latest} is damaged" in err and f"using the checkpoint before it, {older}" in err, err
    assert from_folder == _eval(capsys, config, older)[1]
    assert main(["export", config, "--checkpoint", out, "-o", str(tmp_path / "a.onnx")]) == 0
    assert main(["export", config, "--checkpoint", older, "-o", str(tmp_path / "b.onnx")]) == 0
    assert (tmp_path / "a.onnx").read_bytes() == (tmp_path / "b.onnx").read_bytes()
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q", "--resume"]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"onnxtrain: warning: checkpoint {latest} is damaged"), line
    assert line.endswith(f"resuming from the checkpoint before it, {older}"), line
    assert_same_run(out, whole)


def test_a_damaged_sums_file_and_every_checkpoint_damaged(kill_setup, tmp_path, capsys):  # noqa: F811
    """A sums file that is not sha256sum's format makes its checkpoint count as damaged (it cannot be
    checked); with every checkpoint damaged, --resume and eval of the folder exit 1 naming the latest."""
    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    older, latest = _ckpt(out, 65), _ckpt(out, 66)
    with open(latest + ".sha256", "w") as f:
        f.write("not a sum\n")
    _flip_in_a_weight(older)
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q", "--resume"]) == 1
    err = capsys.readouterr().err
    assert f"its checksum file {latest}.sha256 is damaged" in err, err
    assert "no checkpoint in" in err and "to resume from is whole" in err, err
    code, _, err = _eval(capsys, config, out)
    assert code == 1 and f"checkpoint {older} is damaged" in err, err


def test_checkpoints_without_sums_still_load_and_resume(kill_setup, tmp_path, capsys):  # noqa: F811
    """A run folder written before the sums (none beside its checkpoints): eval reads its latest and
    --resume goes on from it (step 66 removed: it trains step 66 again) to the uninterrupted run's
    checkpoint, which gets its sums."""
    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    for name in os.listdir(os.path.join(out, "checkpoints")):
        if name.endswith(".sha256"):
            os.unlink(os.path.join(out, "checkpoints", name))
    code, metrics, err = _eval(capsys, config, out)
    assert code == 0 and metrics == _eval(capsys, config, _ckpt(whole, 66))[1], err
    os.unlink(_ckpt(out, 66))
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q", "--resume"]) == 0
    assert capsys.readouterr().err == ""
    for name in ("step_00000066.ckpt", "step_00000066.ckpt.sha256"):
        with open(os.path.join(out, "checkpoints", name), "rb") as a, \
                open(os.path.join(whole, "checkpoints", name), "rb") as b:
            assert a.read() == b.read(), name


def test_the_sums_cover_a_checkpoints_external_data(tmp_path):
    """A checkpoint whose tensors went to ``.data`` (large models): the sums name both files (checked by
    hashlib over the files as written), and a byte flipped in the middle of ``.data``'s weights is found,
    naming that file, where the checkpoint itself still loads."""
    from onnxtrain.checkpoint import Checkpoint
    from onnxtrain.train.checksums import checksum_problem, save_with_checksum

    w = np.random.default_rng(0).normal(size=(64, 32)).astype(np.float32)
    path = str(tmp_path / "step_00000001.ckpt")
    save_with_checksum(Checkpoint(trainable={"w": w}, frozen={"b": np.ones(3, np.float32)}), path,
                       external_threshold=0)
    sums = {}
    for name in ("step_00000001.ckpt", "step_00000001.ckpt.data"):
        with open(tmp_path / name, "rb") as f:
            sums[name] = hashlib.sha256(f.read()).hexdigest()
    assert (tmp_path / "step_00000001.ckpt.sha256").read_text() == "".join(
        f"{d}  {n}\n" for n, d in sorted(sums.items()))
    assert checksum_problem(path) is None
    data = bytearray((tmp_path / "step_00000001.ckpt.data").read_bytes())
    at = data.find(w.tobytes()) + w.nbytes // 2
    data[at] ^= 0x01
    (tmp_path / "step_00000001.ckpt.data").write_bytes(bytes(data))
    assert not np.array_equal(load_checkpoint(path).trainable["w"], w)  # loads, damaged
    problem = checksum_problem(path)
    assert problem is not None and problem.startswith(f"checkpoint {path}.data is damaged"), problem


def test_export_refuses_to_write_over_the_older_checkpoint_it_falls_back_to(kill_setup, tmp_path, capsys):  # noqa: F811
    """export of a run folder whose latest is damaged reads the one before it: -o naming that one is
    refused as -o naming the latest is (it was written over with the ONNX model, exit 0: the checkpoint
    that --resume would have fallen back to was gone)."""
    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    older, latest = _ckpt(out, 65), _ckpt(out, 66)
    _flip_in_a_weight(latest)
    with open(older, "rb") as f:
        before = f.read()
    capsys.readouterr()
    assert main(["export", config, "--checkpoint", out, "-o", older]) == 2
    err = capsys.readouterr().err
    assert f"-o/--output: {older} is the file of an older checkpoint of that run folder" in err, err
    with open(older, "rb") as f:
        assert f.read() == before
    from onnxtrain.train.checksums import checksum_problem

    assert checksum_problem(older) is None


def test_a_run_resumed_before_damaged_checkpoints_keeps_its_own(kill_setup, tmp_path, capsys):  # noqa: F811
    """Checkpoints 60, 65 and 66 (keep_checkpoints 3), the last two damaged; resumed with keep_checkpoints 1
    and training.steps 63: the run restores 60, trains to 63 and keeps step 63's checkpoint (pruning took
    the latest by step, the damaged 66: it deleted 63 as it was written, and nothing whole was left)."""
    config, _, _ = kill_setup
    out = str(tmp_path / "run")
    assert main(["train", config, "--output-dir", out, "-q", "--set", "training.keep_checkpoints=3"]) == 0
    assert [os.path.basename(p) for p in (_ckpt(out, 60), _ckpt(out, 65), _ckpt(out, 66))] == sorted(
        n for n in os.listdir(os.path.join(out, "checkpoints")) if n.endswith(".ckpt"))
    for step in (65, 66):
        _flip_in_a_weight(_ckpt(out, step))
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q", "--resume", "--set",
                 "training.keep_checkpoints=1", "--set", "training.steps=63"]) == 0
    err = capsys.readouterr().err
    assert f"resuming from the checkpoint before it, {_ckpt(out, 60)}" in err, err
    assert os.path.exists(_ckpt(out, 63)) and not os.path.exists(_ckpt(out, 60))
    code, metrics, err = _eval(capsys, config, out)
    assert code == 0 and f"using the checkpoint before it, {_ckpt(out, 63)}" in err, err
