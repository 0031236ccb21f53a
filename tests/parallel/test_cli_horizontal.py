"""``mpiexec -n 2 onnxtrain train CONFIG --set training.parameters.horizontal_parallel_size=2``: the two ranks
split the MLP's block and take the same batches, and the run is one process's run of the same config (losses,
eval accuracy, checkpoint, exported model); ``--resume`` continues it; its checkpoint loads in one process."""

from __future__ import annotations

import os
import subprocess

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from tests.parallel.test_cli_mpi import CONFIG, LAST, SETS, metrics, mpiexec, rel_err, train_cmd

pytestmark = pytest.mark.mpi

SPLIT = ["--set", "training.parameters.horizontal_parallel_size=2"]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same config trained by one process (no MPI, no split)."""
    from onnxtrain.cli import main

    out = str(tmp_path_factory.mktemp("cli_split_ref") / "run")
    assert main(["train", CONFIG, *SETS, "--output-dir", out, "-q"]) == 0
    return out


def assert_same_run(out: str, reference: str) -> None:
    """``out``'s metrics, last checkpoint and exported model are the reference run's (float32 rounding)."""
    got, want = metrics(out), metrics(reference)
    assert [sorted(m) for m in got] == [sorted(m) for m in want]
    for g, w in zip(got, want):
        assert g["step"] == w["step"]
        for k in ("loss", "eval_loss", "lr"):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5), (g, w)
        if "eval_accuracy" in w:
            assert g["eval_accuracy"] == w["eval_accuracy"], (g, w)
    ckpt, ref = load_checkpoint(os.path.join(out, LAST)), load_checkpoint(os.path.join(reference, LAST))
    assert sorted(ckpt.trainable) == sorted(ref.trainable)  # the whole weights, under one process's names
    for k, v in ref.trainable.items():
        assert ckpt.trainable[k].shape == v.shape, k
        assert rel_err(ckpt.trainable[k], v) <= 1e-5, k
    g, r = ckpt.optimizer_groups[0], ref.optimizer_groups[0]
    assert g.step == r.step == 20 and sorted(g.states) == sorted(r.states)
    for w, d in r.states.items():
        for k, v in d.items():
            assert rel_err(g.states[w][k], v) <= 1e-4, f"{w} {k}"
    mine = {t.name: numpy_helper.to_array(t)
            for t in onnx.load(os.path.join(out, "model.onnx")).graph.initializer}
    theirs = {t.name: numpy_helper.to_array(t)
              for t in onnx.load(os.path.join(reference, "model.onnx")).graph.initializer}
    assert sorted(mine) == sorted(theirs)
    for k, v in theirs.items():
        assert rel_err(mine[k], v) <= 1e-5, k


def exported_logits(folder: str, x: np.ndarray) -> np.ndarray:
    """The logits onnxruntime's inference package computes with the run's ``model.onnx``."""
    import onnxruntime as ort

    sess = ort.InferenceSession(os.path.join(folder, "model.onnx"), providers=["CPUExecutionProvider"])
    return sess.run(None, {sess.get_inputs()[0].name: x})[0]


def test_split_run_is_one_process_run(reference: str, tmp_path) -> None:
    """Before, each rank took half of every batch while the split session summed the ranks' partial
    products of different samples: the run trained wrong without a word (eval accuracy near chance), and the
    eval and export read the untrained initial values of the split weights."""
    pytest.importorskip("onnxruntime")
    out = str(tmp_path / "run")
    r = mpiexec(["-n", "2", *train_cmd(*SPLIT, "--output-dir", out, "-q")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_run(out, reference)
    from onnxtrain.train.config import load_config
    from onnxtrain.train.data import load_data

    x = load_data(load_config(CONFIG)).eval["x"].astype(np.float32)
    a, b = exported_logits(out, x), exported_logits(reference, x)
    assert rel_err(a, b) <= 1e-5
    assert np.array_equal(a.argmax(1), b.argmax(1))
    # one process evaluates the split run's checkpoint as the run's last eval did
    from onnxtrain.train.evaluate import evaluate_checkpoint

    cfg = load_config(CONFIG, [s for s in SETS if s != "--set"])
    last = metrics(out)[-1]
    got = evaluate_checkpoint(cfg, os.path.join(out, LAST))
    assert got["eval_accuracy"] == last["eval_accuracy"]
    assert got["eval_loss"] == pytest.approx(last["eval_loss"], rel=1e-6)


def test_split_run_resumes_as_an_uninterrupted_one(reference: str, tmp_path) -> None:
    """10 steps, then --resume to 20 on the split ranks: one process's uninterrupted run."""
    pytest.importorskip("onnxruntime")
    out = str(tmp_path / "run")
    args = [*SPLIT, "--output-dir", out, "-q"]
    r = mpiexec(["-n", "2", *train_cmd(*args, "--set", "training.steps=10")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "2", *train_cmd(*args, "--resume")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_run(out, reference)


def test_split_size_that_does_not_divide_the_world_names_the_key(tmp_path) -> None:
    r = mpiexec(["-n", "2", *train_cmd("--set", "training.parameters.horizontal_parallel_size=3",
                                       "--output-dir", str(tmp_path / "run"), "-q")], timeout=240)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "training.parameters.horizontal_parallel_size" in r.stderr, r.stderr


def test_split_without_mpiexec_names_the_key(tmp_path) -> None:
    import sys

    r = subprocess.run([sys.executable, "-m", "onnxtrain", "train", CONFIG, *SETS, *SPLIT, "--output-dir",
                        str(tmp_path / "run"), "-q"], capture_output=True, text=True, timeout=240)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "training.parameters.horizontal_parallel_size" in r.stderr, r.stderr


def test_two_replicas_of_a_split_with_zero_are_one_process_run(reference: str, tmp_path) -> None:
    """4 ranks: 2 data-parallel replicas of the 2-way split (each replica half of every batch), ZeRO stage 1
    over the replicas, stopped at step 10 and resumed: one process's run. The replicas the world holds are
    taken without a warning about ``data_parallel_size``."""
    pytest.importorskip("onnxruntime")
    out = str(tmp_path / "run")
    args = [*SPLIT, "--set", "training.parameters.deepspeed_zero_stage=1", "--output-dir", out, "-q"]
    r = mpiexec(["-n", "4", *train_cmd(*args, "--set", "training.steps=10")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "data_parallel_size" not in r.stderr, r.stderr
    r = mpiexec(["-n", "4", *train_cmd(*args, "--resume")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_run(out, reference)


def test_adasum_replicas_of_a_split_resume_each_with_its_own_state(tmp_path) -> None:
    """4 ranks, 2 replicas of the 2-way split combining their updates by Adasum: the checkpoint holds every
    rank's optimizer state (a replica's whole model's), and a run stopped at step 10 and resumed ends with
    the weights, moments and metrics of an uninterrupted one."""
    whole, parted = str(tmp_path / "whole"), str(tmp_path / "parted")
    ada = [*SPLIT, "--set", "training.parameters.enable_adasum=true", "-q"]
    r = mpiexec(["-n", "4", *train_cmd(*ada, "--output-dir", whole)], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "4", *train_cmd(*ada, "--output-dir", parted, "--set", "training.steps=10")],
                timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "4", *train_cmd(*ada, "--output-dir", parted, "--resume")], timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    a, b = load_checkpoint(os.path.join(parted, LAST)), load_checkpoint(os.path.join(whole, LAST))
    assert [g.name for g in b.optimizer_groups] == ["group0", "group0_rank1", "group0_rank2", "group0_rank3"]
    for k, v in b.trainable.items():
        assert np.array_equal(a.trainable[k], v), k
    for ga, gb in zip(a.optimizer_groups, b.optimizer_groups, strict=True):
        for w, d in gb.states.items():
            for k, v in d.items():
                assert np.array_equal(ga.states[w][k], v), f"{gb.name} {w} {k}"
    got, want = metrics(parted), metrics(whole)
    assert [{k: v for k, v in m.items() if k != "samples_per_s"} for m in got] == \
           [{k: v for k, v in m.items() if k != "samples_per_s"} for m in want]


@pytest.mark.parametrize(("extra", "tol"), [
    (["training.mixed_precision=true"], 1e-3),
    (["training.backend=onnxruntime"], 1e-5),
    (["training.gradient_accumulation_steps=2", "optimizer.clip_grad_norm=1.0"], 1e-5),
])
def test_split_run_with_options_is_one_process_run(extra: list[str], tol: float, tmp_path) -> None:
    """Mixed precision (its loss scale fed to both ranks), the onnxruntime backend, and accumulation with
    clipping: the split run's logged losses and evals are one process's run of the same config."""
    pytest.importorskip("onnxruntime")
    from onnxtrain.cli import main

    sets = [a for e in extra for a in ("--set", e)]
    ref, out = str(tmp_path / "one"), str(tmp_path / "two")
    assert main(["train", CONFIG, *SETS, *sets, "--output-dir", ref, "-q"]) == 0
    r = mpiexec(["-n", "2", *train_cmd(*SPLIT, *sets, "--output-dir", out, "-q")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    got, want = metrics(out), metrics(ref)
    assert [m["step"] for m in got] == [m["step"] for m in want]
    for g, w in zip(got, want):
        for k in ("loss", "eval_loss"):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=tol), (g, w)
        if "eval_accuracy" in w:
            assert g["eval_accuracy"] == w["eval_accuracy"], (g, w)


def test_split_run_resumes_one_process_checkpoint(reference: str, tmp_path) -> None:
    """One process trains 10 steps; the 2 split ranks resume its checkpoint (cutting its whole weights into
    shares) and end as one process's uninterrupted run. No changed-config warning: not for the split, which
    changes how the ranks share the work, not the run; nor for training.steps, which under this constant
    schedule trains the run on to an uninterrupted one's weights (0b14ce7e)."""
    from onnxtrain.cli import main

    out = str(tmp_path / "run")
    assert main(["train", CONFIG, *SETS, "--set", "training.steps=10", "--output-dir", out, "-q"]) == 0
    r = mpiexec(["-n", "2", *train_cmd(*SPLIT, "--output-dir", out, "--resume", "-q")], timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "changed config" not in r.stderr and "horizontal_parallel_size" not in r.stderr, r.stderr
    assert_same_run(out, reference)
