"""``mpiexec -n 2 onnxtrain train CONFIG``: the same weights as one process, only rank 0 prints the progress
bar and writes files, ZeRO stage 1 checkpoints hold the whole state and resume, a bad config ends the job."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
import time

import numpy as np
import pytest

from onnxtrain.checkpoint import load_checkpoint

pytestmark = pytest.mark.mpi

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CONFIG = os.path.join(REPO, "configs", "digits_mlp.yaml")
# short; a constant schedule (with its warm-up) so that a run resumed with more steps equals a whole run
SETS = ["--set", "training.steps=20", "--set", "schedule.kind=constant", "--set", "training.eval_every=10",
        "--set", "training.checkpoint_every=10", "--set", "training.log_every=5"]
LAST = os.path.join("checkpoints", "step_00000020.ckpt")


def train_cmd(*extra: str) -> list[str]:
    return [sys.executable, "-m", "onnxtrain", "train", CONFIG, *SETS, *extra]


def mpiexec(args: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    clean["PYTHONPATH"] = REPO + os.pathsep + clean.get("PYTHONPATH", "")
    t0 = time.perf_counter()
    r = subprocess.run(["mpiexec", *args], capture_output=True, text=True, timeout=timeout, env=clean)
    print(f"mpiexec {' '.join(args[:3])} ...: {time.perf_counter() - t0:.1f} s, exit {r.returncode}")
    return r


def hydra() -> bool:
    """MPICH's launcher (the mpich wheel's): ``-wdir`` per rank and ``-prepend-rank`` are used below."""
    r = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=30)
    return "HYDRA" in r.stdout + r.stderr


def by_rank(text: str) -> dict[int, str]:
    """Output of ``mpiexec -prepend-rank``, split by the rank that wrote each chunk."""
    out: dict[int, str] = {}
    for m in re.finditer(r"\[(\d+)\] (.*?)(?=\[\d+\] |\Z)", text, re.S):
        out[int(m.group(1))] = out.get(int(m.group(1)), "") + m.group(2)
    return out


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def metrics(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def assert_same_checkpoint(path: str, ref_path: str) -> None:
    got, ref = load_checkpoint(path), load_checkpoint(ref_path)
    assert sorted(got.trainable) == sorted(ref.trainable)
    for k, v in ref.trainable.items():
        err = rel_err(got.trainable[k], v)
        assert err <= 1e-6, f"{k}: relative error {err:.3g}"
    g, r = got.optimizer_groups[0], ref.optimizer_groups[0]
    assert g.step == r.step == 20
    assert sorted(g.states) == sorted(r.states)
    for w, d in r.states.items():
        assert sorted(g.states[w]) == sorted(d)
        for k, v in d.items():
            assert rel_err(g.states[w][k], v) <= 1e-5, f"{w} {k}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> str:
    """The same config trained by one process (no MPI)."""
    from onnxtrain.cli import main

    out = str(tmp_path_factory.mktemp("cli_ref") / "run")
    assert main(["train", CONFIG, *SETS, "--output-dir", out, "-q"]) == 0
    return out


def test_two_ranks_equal_one_process_and_only_rank0_writes(reference: str, tmp_path) -> None:
    if not hydra():
        pytest.skip("needs MPICH's mpiexec (hydra) for -wdir per rank and -prepend-rank")
    # each rank in its own working directory, the same relative --output-dir: what rank 1 would write
    # lands in its own folder
    wd = [tmp_path / "rank0", tmp_path / "rank1"]
    for d in wd:
        d.mkdir()
    cmd = train_cmd("--output-dir", "run")
    r = mpiexec(["-prepend-rank", "-n", "1", "-wdir", str(wd[0]), *cmd, ":", "-n", "1", "-wdir", str(wd[1]),
                 *cmd])
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.listdir(wd[1]) == [], "rank 1 wrote files"
    out = str(wd[0] / "run")

    def files(folder: str) -> list[str]:
        return sorted(os.path.relpath(os.path.join(d, f), folder) for d, _, fs in os.walk(folder) for f in fs)

    assert files(out) == files(reference)
    assert_same_checkpoint(os.path.join(out, LAST), os.path.join(reference, LAST))
    got, want = metrics(out), metrics(reference)
    # one record per logged step and per eval: no duplicates from a second writer
    assert [sorted(m) for m in got] == [sorted(m) for m in want]
    for g, w in zip(got, want):
        assert g["step"] == w["step"]
        for k in ("loss", "eval_loss", "eval_accuracy", "lr"):
            if k in w:
                assert g[k] == pytest.approx(w[k], rel=1e-5), (g, w)
    stdout, stderr = by_rank(r.stdout), by_rank(r.stderr)
    assert list(stdout) == [0] and stdout[0].count("trained digits_mlp for 20 steps") == 1, r.stdout
    assert "20/20" in stderr.get(0, ""), r.stderr  # the progress bar, on rank 0 only
    assert "step/s" not in stderr.get(1, ""), r.stderr
    assert "data_parallel_size" not in r.stderr, r.stderr  # the config's default is not an assigned size


def test_zero_stage1_checkpoint_holds_the_whole_state_and_resumes(reference: str, tmp_path) -> None:
    out = str(tmp_path / "run")
    zero = ["--set", "training.parameters.deepspeed_zero_stage=1", "--output-dir", out, "-q"]
    r = mpiexec(["-n", "2", *train_cmd(*zero, "--set", "training.steps=10")])
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "2", *train_cmd(*zero, "--resume")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert_same_checkpoint(os.path.join(out, LAST), os.path.join(reference, LAST))
    assert [m["step"] for m in metrics(out)] == [m["step"] for m in metrics(reference)]
    # the checkpoint of two ZeRO ranks loads into one process
    from onnxtrain.train import Trainer, load_config
    from onnxtrain.train.state import trainable_names

    cfg = load_config(CONFIG, [s for s in SETS if s != "--set"])
    tr = Trainer(cfg, str(tmp_path / "one"), progress=False)
    assert tr.restore(load_checkpoint(os.path.join(out, LAST))).global_step == 20
    ref = load_checkpoint(os.path.join(reference, LAST))
    state = tr.sess.get_state()
    for w in trainable_names(tr.sess):
        assert rel_err(state[w], ref.trainable[w]) <= 1e-6


def test_adasum_resume_gives_each_rank_its_own_optimizer_state(tmp_path) -> None:
    """Under Adasum each rank keeps optimizer state of its own: the checkpoint holds every rank's (rank 0's
    as ``group0``, which other readers take), and a run resumed from step 10 ends bit for bit as an
    uninterrupted one, weights and both ranks' moments."""
    adasum = ["--set", "training.parameters.enable_adasum=true", "-q"]
    whole, cut = str(tmp_path / "whole"), str(tmp_path / "cut")
    r = mpiexec(["-n", "2", *train_cmd(*adasum, "--output-dir", whole)])
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "2", *train_cmd(*adasum, "--output-dir", cut, "--set", "training.steps=10")])
    assert r.returncode == 0, r.stdout + r.stderr
    r = mpiexec(["-n", "2", *train_cmd(*adasum, "--output-dir", cut, "--resume")])
    assert r.returncode == 0, r.stdout + r.stderr
    assert "Adasum" not in r.stderr, r.stderr
    want, got = load_checkpoint(os.path.join(whole, LAST)), load_checkpoint(os.path.join(cut, LAST))
    assert [g.name for g in want.optimizer_groups] == ["group0", "group0_rank1"]
    assert want.properties["adasum_ranks"] == 2
    for k, v in want.trainable.items():
        np.testing.assert_array_equal(got.trainable[k], v, err_msg=k)
    for g, w in zip(got.optimizer_groups, want.optimizer_groups, strict=True):
        assert (g.name, g.step) == (w.name, w.step)
        for p, moments in w.states.items():
            for k, v in moments.items():
                np.testing.assert_array_equal(g.states[p][k], v, err_msg=f"{w.name} {p} {k}")
    r0, r1 = want.optimizer_groups
    assert any(not np.array_equal(r0.states[p][k], r1.states[p][k]) for p in r0.states for k in r0.states[p])
    def losses(folder: str) -> list[float]:
        return [m["loss"] for m in metrics(folder) if "loss" in m]

    assert losses(cut) == losses(whole)


def _adasum_resumed(tmp_path, edit) -> tuple[str, subprocess.CompletedProcess]:
    """A 2-rank Adasum run of 10 steps whose last checkpoint ``edit`` changes, resumed at 2 ranks: the
    output folder and the resumed run."""
    from onnxtrain.checkpoint import save_checkpoint

    out = str(tmp_path / "run")
    adasum = ["--set", "training.parameters.enable_adasum=true", "--output-dir", out, "-q"]
    r = mpiexec(["-n", "2", *train_cmd(*adasum, "--set", "training.steps=10")])
    assert r.returncode == 0, r.stdout + r.stderr
    path = os.path.join(out, "checkpoints", "step_00000010.ckpt")
    ckpt = load_checkpoint(path)
    edit(ckpt)
    save_checkpoint(ckpt, path)
    os.unlink(path + ".sha256")  # (its SHA-256 sums no longer match: as one written before they were)
    r = mpiexec(["-n", "2", *train_cmd(*adasum, "--resume")])
    assert r.returncode == 0, r.stdout + r.stderr
    return out, r


def test_adasum_resume_from_rank0_state_only_warns(tmp_path) -> None:
    """A checkpoint that holds rank 0's optimizer state only (an earlier version's, or another number of
    ranks') still resumes every rank, from rank 0's state, and says once that the run is then close to,
    not the same as, an uninterrupted one."""

    def rank0_only(ckpt) -> None:
        ckpt.optimizer_groups = ckpt.optimizer_groups[:1]
        del ckpt.properties["adasum_ranks"]

    out, r = _adasum_resumed(tmp_path, rank0_only)
    assert r.stderr.count("under Adasum each rank keeps optimizer state of its own") == 1, r.stderr
    assert "holds rank 0's only (written without Adasum or by an earlier version)" in r.stderr
    assert load_checkpoint(os.path.join(out, LAST)).properties["adasum_ranks"] == 2


def test_adasum_resume_at_another_number_of_ranks_says_how_many_wrote_it(tmp_path) -> None:
    """A checkpoint of another number of ranks' Adasum states (a 2-rank one marked as written by 4, as a
    4-rank run writes it) resumed at 2 ranks: the warning says how many ranks wrote it (it said the
    checkpoint held rank 0's state only, which it does not)."""
    _, r = _adasum_resumed(tmp_path, lambda ckpt: ckpt.properties.__setitem__("adasum_ranks", 4))
    assert "holds those of 4 ranks, and this run has 2: every rank continues from rank 0's" in r.stderr, \
        r.stderr


def test_adasum_ignored_under_zero_keeps_one_optimizer_group(tmp_path) -> None:
    """enable_adasum with deepspeed_zero_stage 1: the session uses ZeRO (Adasum ignored, with a warning), the
    ranks' optimizer state is one, gathered: the checkpoint holds it once, not once per rank, and claims no
    Adasum ranks."""
    out = str(tmp_path / "run")
    both = ["--set", "training.parameters.enable_adasum=true",
            "--set", "training.parameters.deepspeed_zero_stage=1"]
    r = mpiexec(["-n", "2", *train_cmd(*both, "--set", "training.steps=10", "--output-dir", out, "-q")])
    assert r.returncode == 0, r.stdout + r.stderr
    ckpt = load_checkpoint(os.path.join(out, "checkpoints", "step_00000010.ckpt"))
    assert [g.name for g in ckpt.optimizer_groups] == ["group0"]
    assert "adasum_ranks" not in ckpt.properties


def test_run_eval_of_batchnorm_model_equals_eval_of_its_checkpoint(tmp_path) -> None:
    """Each rank updates its BatchNormalization running statistics from its own half batches; the run's
    evals score with rank 0's (which the checkpoint holds), so the last eval equals ``onnxtrain eval`` of
    the checkpoint (before: rank 1's shard used rank 1's statistics, 6e-5 off)."""
    out = str(tmp_path / "run")
    cnn = os.path.join(REPO, "configs", "digits_cnn.yaml")
    cmd = [sys.executable, "-m", "onnxtrain", "train", cnn, "--set", "training.steps=30", "--output-dir", out,
           "-q"]
    r = mpiexec(["-n", "2", *cmd])
    assert r.returncode == 0, r.stdout + r.stderr
    from onnxtrain.cli import main

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        assert main(["eval", cnn, "--checkpoint", out, "--json"]) == 0
    want = json.loads(buf.getvalue())
    got = metrics(out)[-1]
    assert got["step"] == 30
    assert got["eval_loss"] == pytest.approx(want["eval_loss"], rel=1e-6)
    assert got["eval_accuracy"] == want["eval_accuracy"]


def test_bad_config_ends_every_rank_with_the_message(tmp_path) -> None:
    t0 = time.perf_counter()
    r = mpiexec(["-n", "2", *train_cmd("--set", "training.batch_size=33", "--output-dir", str(tmp_path / "x"),
                                       "-q")], timeout=60)
    assert r.returncode != 0
    assert "training.batch_size: 33 does not split evenly over the 2 ranks" in r.stderr, r.stderr
    assert time.perf_counter() - t0 < 30
    assert not os.path.exists(tmp_path / "x" / "checkpoints")


def test_eval_and_export_under_mpiexec_print_and_write_once(reference: str, tmp_path) -> None:
    """``mpiexec -n 2 onnxtrain eval|export``: each rank evaluates alike; rank 0 alone prints and writes
    (both ranks printed, and wrote the same file)."""
    if not hydra():
        pytest.skip("needs MPICH's mpiexec (hydra) for -prepend-rank")
    r = mpiexec(["-prepend-rank", "-n", "2", sys.executable, "-m", "onnxtrain", "eval", CONFIG,
                 "--checkpoint", reference, "--json"])
    assert r.returncode == 0, r.stdout + r.stderr
    out = by_rank(r.stdout)
    assert list(out) == [0] and out[0].count("eval_loss") == 1, r.stdout
    wd = [tmp_path / "rank0", tmp_path / "rank1"]
    for d in wd:
        d.mkdir()
    cmd = [sys.executable, "-m", "onnxtrain", "export", CONFIG, "--checkpoint", reference, "-o", "m.onnx"]
    r = mpiexec(["-prepend-rank", "-n", "1", "-wdir", str(wd[0]), *cmd, ":", "-n", "1", "-wdir", str(wd[1]),
                 *cmd])
    assert r.returncode == 0, r.stdout + r.stderr
    assert os.listdir(wd[0]) == ["m.onnx"] and os.listdir(wd[1]) == []
    assert list(by_rank(r.stdout)) == [0], r.stdout
