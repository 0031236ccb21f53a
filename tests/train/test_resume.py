"""Ctrl-C and --resume: an interrupted and resumed run ends with the weights of an uninterrupted one."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import onnx
import pytest
import yaml

from onnxtrain import zoo
from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.cli import main
from onnxtrain.engine.seeds import set_random_seed
from onnxtrain.train import Trainer, load_config
from onnxtrain.train.config import ConfigError
from onnxtrain.train.outputs import list_checkpoints
from tests.train.conftest import REPO, config_path, save_dropout_mlp

# long enough that SIGINT lands mid-run; checkpoints often, so the first one comes early
SETS = ["training.epochs=25", "training.checkpoint_every=15", "training.eval_every=150",
        "training.keep_checkpoints=0"]


def _final(folder: str):
    return load_checkpoint(list_checkpoints(folder)[-1][1])


def _assert_same_state(a, b) -> None:
    assert a.trainable.keys() == b.trainable.keys()
    for k in a.trainable:
        np.testing.assert_array_equal(a.trainable[k], b.trainable[k], err_msg=k)
    for k in a.frozen:
        np.testing.assert_array_equal(a.frozen[k], b.frozen[k], err_msg=k)
    ga, gb = a.optimizer_groups[0], b.optimizer_groups[0]
    assert ga.step == gb.step
    for w, d in ga.states.items():
        for k, v in d.items():
            np.testing.assert_array_equal(v, gb.states[w][k], err_msg=f"{w}/{k}")
    for k in ("global_step", "epoch", "epoch_position", "data_order_rng", "samples_seen"):
        assert a.properties[k] == b.properties[k], k


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    out = str(tmp_path_factory.mktemp("uninterrupted"))
    cfg = load_config(config_path("digits_mlp"), SETS)
    Trainer(cfg, out, progress=False).run()
    return out


@pytest.mark.parametrize("signum,code,how", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "stopped by SIGTERM")],
                         ids=["SIGINT", "SIGTERM"])
def test_sigint_then_resume_matches_uninterrupted(tmp_path, uninterrupted, signum, code, how):
    """SIGINT (Ctrl-C), or SIGTERM (what Slurm, Kubernetes and systemd send before SIGKILL; it ended the run
    at once, exit -15), from outside mid-run: the run saves where it stops and exits 128 + the signal's
    number, and --resume ends with the uninterrupted run's state."""
    out = str(tmp_path)
    argv = [sys.executable, "-m", "onnxtrain", "train", config_path("digits_mlp"), "--output-dir", out, "-q"]
    for s in SETS:
        argv += ["--set", s]
    proc = subprocess.Popen(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    first = os.path.join(out, "checkpoints", "step_00000015.ckpt")
    deadline = time.monotonic() + 120
    while not os.path.exists(first):
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "no checkpoint within 120 s"
        time.sleep(0.005)
    proc.send_signal(signum)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == code, err
    assert f"{how} at step" in err and "--resume" in err
    stopped = list_checkpoints(out)
    total = _final(uninterrupted).properties["global_step"]
    assert stopped and stopped[-1][0] < total, "the run finished before SIGINT arrived"
    assert not [f for f in os.listdir(os.path.join(out, "checkpoints")) if f.endswith(".tmp")]
    load_checkpoint(stopped[-1][1])  # the last checkpoint is whole
    sets = [a for s in SETS for a in ("--set", s)]
    assert main(["train", config_path("digits_mlp"), "--output-dir", out, "-q", "--resume", *sets]) == 0
    _assert_same_state(_final(out), _final(uninterrupted))
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f if '"loss"' in line]
    assert steps == sorted(steps) and len(steps) == len(set(steps))  # no entries repeated by the resume


def test_resume_mid_epoch_in_process(tmp_path, monkeypatch, uninterrupted):
    """SIGINT raised right after the second checkpoint (step 30, mid-epoch), then resume."""
    out = str(tmp_path)
    cfg = load_config(config_path("digits_mlp"), SETS)
    saves = []
    real_save = Trainer.save

    def save_then_interrupt(self, st):
        path = real_save(self, st)
        saves.append(path)
        if len(saves) == 2:
            signal.raise_signal(signal.SIGINT)
        return path

    monkeypatch.setattr(Trainer, "save", save_then_interrupt)
    result = Trainer(cfg, out, progress=False).run()
    assert result.status == "interrupted" and result.global_step == 30
    monkeypatch.undo()
    result = Trainer(load_config(config_path("digits_mlp"), SETS), out, progress=False).run(resume=True)
    assert result.status == "finished"
    _assert_same_state(_final(out), _final(uninterrupted))


def test_resume_without_checkpoint_fails(tmp_path, capsys):
    assert main(["train", config_path("digits_mlp"), "--output-dir", str(tmp_path), "-q", "--resume"]) == 2
    assert "--resume: no checkpoint" in capsys.readouterr().err


def test_resume_with_fp16_moments(tmp_path):
    """Float16 moments (use_fp16_moments) go into the checkpoint as float16 and come back bit for bit."""
    sets = ["training.steps=40", "training.checkpoint_every=20", "training.eval_every=1000",
            "optimizer.eps=1.0e-4", "training.parameters.use_fp16_moments=true"]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    Trainer(load_config(config_path("digits_mlp"), sets), whole, progress=False).run()
    first = [s if s != "training.steps=40" else "training.steps=20" for s in sets]
    Trainer(load_config(config_path("digits_mlp"), first), halves, progress=False).run()
    Trainer(load_config(config_path("digits_mlp"), sets), halves, progress=False).run(resume=True)
    a, b = _final(halves), _final(whole)
    states = a.optimizer_groups[0].states.values()
    moments = [v for d in states for k, v in d.items() if k.startswith("momentum")]
    assert moments and all(np.asarray(v).dtype == np.float16 for v in moments)
    _assert_same_state(a, b)


def test_resume_mid_log_window_matches_uninterrupted_metrics_and_weights(tmp_path, monkeypatch):
    """A checkpoint between two metrics.jsonl entries (step 15 of log_every 10), with gradient accumulation:
    the resumed run writes the same records (but samples/s) and ends with the same weights."""
    sets = ["training.steps=40", "training.gradient_accumulation_steps=2", "training.checkpoint_every=15",
            "training.log_every=10", "training.eval_every=20", "training.keep_checkpoints=0"]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    Trainer(load_config(config_path("digits_mlp"), sets), whole, progress=False).run()
    _interrupt_after_first_save(monkeypatch)
    first = Trainer(load_config(config_path("digits_mlp"), sets), halves, progress=False).run()
    assert first.status == "interrupted" and first.global_step == 15
    monkeypatch.undo()
    Trainer(load_config(config_path("digits_mlp"), sets), halves, progress=False).run(resume=True)
    _assert_same_state(_final(halves), _final(whole))

    def records(folder):
        with open(os.path.join(folder, "metrics.jsonl")) as f:
            return [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in f]

    assert [r["step"] for r in records(whole) if "loss" in r] == [10, 20, 30, 40]
    assert records(halves) == records(whole)


def test_resume_warns_only_about_keys_that_change_the_weights(tmp_path, capsys):
    out = str(tmp_path)
    sets = ["training.steps=6", "training.checkpoint_every=3"]
    Trainer(load_config(config_path("digits_mlp"), sets), out, progress=False).run()
    capsys.readouterr()
    neutral = sets + ["training.keep_checkpoints=1", "training.log_every=2", "training.eval_every=2",
                      "training.checkpoint_every=2", "training.eval_batch_size=100", "output.plot=false"]
    Trainer(load_config(config_path("digits_mlp"), neutral), out, progress=False).run(resume=True)
    assert "warning" not in capsys.readouterr().err
    Trainer(load_config(config_path("digits_mlp"), [*sets, "optimizer.lr=0.01"]), out,
            progress=False).run(resume=True)
    err = capsys.readouterr().err
    assert "warning: resuming with a changed config (optimizer.lr)" in err, err


def test_fresh_run_refuses_a_folder_with_checkpoints(tmp_path, capsys):
    """Without --resume, a folder holding checkpoints is refused (exit 2) instead of emptied; --overwrite
    starts over."""
    out = str(tmp_path)
    argv = ["train", config_path("digits_mlp"), "--output-dir", out, "-q", "--set", "training.steps=4",
            "--set", "training.checkpoint_every=2", "--set", "training.keep_checkpoints=0"]
    assert main(argv) == 0
    before = list_checkpoints(out)
    assert [s for s, _ in before] == [2, 4]
    capsys.readouterr()
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "already holds checkpoints" in err[0]
    assert "--resume" in err[0] and "--overwrite" in err[0] and "--output-dir" in err[0]
    assert list_checkpoints(out) == before
    with pytest.raises(ConfigError, match="already holds checkpoints"):
        Trainer(load_config(config_path("digits_mlp"), ["training.steps=4"]), out, progress=False).run(
            overwrite=False)
    argv[argv.index("training.steps=4")] = "training.steps=2"
    assert main([*argv, "--overwrite"]) == 0
    assert [s for s, _ in list_checkpoints(out)] == [2]
    with pytest.raises(SystemExit) as e:
        main([*argv, "--overwrite", "--resume"])
    assert e.value.code == 2


def test_overwrite_leaves_nothing_of_the_old_run(tmp_path, capsys):
    """--overwrite removes the old run's plot and model too (a run without them must not show the old ones),
    and the summary lists only what the run wrote."""
    out = str(tmp_path)
    argv = ["train", config_path("digits_mlp"), "--output-dir", out, "-q", "--set", "training.steps=2"]
    assert main(argv) == 0
    ends = [os.path.join(out, f) for f in ("metrics.png", "model.onnx")]
    assert all(os.path.isfile(f) for f in ends)
    capsys.readouterr()
    assert main([*argv, "--overwrite", "--set", "output.plot=false", "--set", "output.export=false"]) == 0
    assert not any(os.path.exists(f) for f in ends)
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert "metrics.png" not in summary and "model.onnx" not in summary, summary


def test_resume_removes_partial_checkpoints_and_names_a_misfit(tmp_path, capsys):
    """A checkpoint temporary left by a killed write is deleted on the next start; a checkpoint that does not
    fit the config's model is an error naming it and the changed keys."""
    out = str(tmp_path)
    sets = ["training.steps=2", "training.checkpoint_every=1"]
    Trainer(load_config(config_path("digits_mlp"), sets), out, progress=False).run()
    stale = os.path.join(out, "checkpoints", "step_00000003.ckpt.k2j4x9ab.onnxtrain.tmp")
    with open(stale, "wb") as f:
        f.write(b"half a checkpoint")
    capsys.readouterr()
    Trainer(load_config(config_path("digits_mlp"), ["training.steps=3", "training.checkpoint_every=1"]), out,
            progress=False).run(resume=True)
    assert not os.path.exists(stale) and "removed" in capsys.readouterr().err
    with open(os.path.join(out, "config.yaml"), encoding="utf-8") as f:
        assert f"dir: {out}" in f.read()  # where the run's files went
    changed = ["training.steps=3", "model.args.sizes=[64,32,10]"]
    with pytest.raises(ValueError) as e:
        Trainer(load_config(config_path("digits_mlp"), changed), out, progress=False).run(resume=True)
    msg = str(e.value)
    assert "step_00000003.ckpt does not fit" in msg and "model.args.sizes" in msg, msg


def _interrupt_after_first_save(monkeypatch) -> None:
    real_save = Trainer.save

    def save_then_interrupt(self, st):
        path = real_save(self, st)
        signal.raise_signal(signal.SIGINT)
        return path

    monkeypatch.setattr(Trainer, "save", save_then_interrupt)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_dropout_runs_repeat_and_resume_bit_for_bit(tmp_path, monkeypatch, write_config, backend):
    """A Dropout without a seed attribute draws from training.seed: two runs give the same weights, and a
    run stopped at a checkpoint and resumed gives those of an uninterrupted one (on the onnxruntime backend
    too, whose Dropout draws from onnxruntime's generator: the step's seed reaches it)."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    save_dropout_mlp(str(tmp_path / "drop.onnx"))
    cfg = write_config({"model": {"path": "drop.onnx"}, "training": {
        "steps": 30, "checkpoint_every": 15, "eval_every": 1000, "keep_checkpoints": 0, "backend": backend}})
    runs = [str(tmp_path / name) for name in ("a", "b", "halves")]
    for out in runs[:2]:
        Trainer(load_config(cfg), out, progress=False).run()
    _assert_same_state(_final(runs[0]), _final(runs[1]))
    _interrupt_after_first_save(monkeypatch)
    first = Trainer(load_config(cfg), runs[2], progress=False).run()
    assert first.status == "interrupted" and first.global_step == 15
    monkeypatch.undo()
    Trainer(load_config(cfg), runs[2], progress=False).run(resume=True)
    _assert_same_state(_final(runs[2]), _final(runs[0]))
    other = str(tmp_path / "other_masks")  # the masks do change the weights: the check above has teeth
    monkeypatch.setattr(Trainer, "reseed", lambda self, step: set_random_seed(step + 1))
    Trainer(load_config(cfg), other, progress=False).run()
    monkeypatch.undo()
    assert not np.array_equal(_final(other).trainable["fc0.weight"], _final(runs[0]).trainable["fc0.weight"])


def test_mixed_precision_checkpoint_holds_no_half_twins(tmp_path, monkeypatch):
    """The float16 twins (``<w>_fp16``) are derived from the float32 masters: the checkpoint leaves them out
    (onnxruntime-training cannot load float16 parameters), and resume still matches an uninterrupted run."""
    sets = ["training.steps=30", "training.checkpoint_every=15", "training.eval_every=1000",
            "training.mixed_precision=true"]
    whole, halves = str(tmp_path / "whole"), str(tmp_path / "halves")
    Trainer(load_config(config_path("digits_mlp"), sets), whole, progress=False).run()
    ckpt = _final(whole)
    assert not [k for k in ckpt.frozen if k.endswith("_fp16")], sorted(ckpt.frozen)
    assert all(np.asarray(v).dtype != np.float16 for v in [*ckpt.frozen.values(), *ckpt.trainable.values()])
    _interrupt_after_first_save(monkeypatch)
    first = Trainer(load_config(config_path("digits_mlp"), sets), halves, progress=False).run()
    assert first.status == "interrupted" and first.global_step == 15
    monkeypatch.undo()
    Trainer(load_config(config_path("digits_mlp"), sets), halves, progress=False).run(resume=True)
    _assert_same_state(_final(halves), ckpt)
    assert _final(halves).properties["loss_scale"] == ckpt.properties["loss_scale"]


def _md5(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.md5(f.read()).hexdigest()


@pytest.mark.parametrize("option", [[], ["--overwrite"], ["--resume"]])
def test_a_run_never_replaces_its_own_inputs(tmp_path, capsys, option):
    """The config's model.path, or the config file itself, being a file the run writes (model.onnx,
    config.yaml in the output folder): refused with any option, naming the file and --output-dir."""
    model = str(tmp_path / "model.onnx")
    onnx.save(zoo.mlp([64, 16, 10]), model)
    (tmp_path / "cfg.yaml").write_text("model: {path: model.onnx}\noutput: {dir: .}\ntraining: {steps: 2}\n")
    shutil.copy(config_path("digits_mlp"), tmp_path / "config.yaml")
    before = {f: _md5(str(tmp_path / f)) for f in ("model.onnx", "cfg.yaml", "config.yaml")}
    cases = [([str(tmp_path / "cfg.yaml"), "--output-dir", str(tmp_path)], f"model.path {model} is one of"),
             ([str(tmp_path / "config.yaml"), "--output-dir", str(tmp_path)], "the config file")]
    for args, words in cases:
        assert main(["train", *args, "-q", "--set", "training.steps=2", *option]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and words in err[0] and "--output-dir" in err[0], err
    assert {f: _md5(str(tmp_path / f)) for f in before} == before
    assert sorted(os.listdir(tmp_path)) == ["cfg.yaml", "config.yaml", "model.onnx"]


def test_a_run_folder_config_yaml_runs_again_unchanged(tmp_path, capsys):
    """The config.yaml a run saved can run again in its folder (the run rewrites it as it is)."""
    out = str(tmp_path / "run")
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--set",
                 "training.steps=2"]) == 0
    saved = os.path.join(out, "config.yaml")
    before = _md5(saved)
    assert main(["train", saved, "-q", "--resume"]) == 0
    assert main(["train", saved, "-q", "--overwrite"]) == 0
    assert _md5(saved) == before


def test_a_run_folder_config_yaml_resumes_with_set_values(tmp_path, capsys):
    """`onnxtrain train RUN/config.yaml --resume --set training.steps=N`, the way to train a finished run
    for longer, was refused (the run would rewrite its own config.yaml) with advice to choose another
    --output-dir, where there is nothing to resume. The file a run wrote is now rewritten with the --set
    values, and the run ends with the weights of an uninterrupted run of that length; a config.yaml that
    no run wrote (the user's, with comments) is still never replaced."""
    sets = ["--set", "schedule.kind=constant", "--set", "schedule.warmup_steps=0", "--set",
            "schedule.final_lr_ratio=0"]
    whole, out = str(tmp_path / "whole"), str(tmp_path / "run")
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", whole, *sets, "--set",
                 "training.steps=3"]) == 0
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, *sets, "--set",
                 "training.steps=2"]) == 0
    saved = os.path.join(out, "config.yaml")
    capsys.readouterr()
    assert main(["train", saved, "-q", "--resume", "--set", "training.steps=3"]) == 0, capsys.readouterr().err
    with open(saved) as f:
        assert yaml.safe_load(f)["training"]["steps"] == 3
    with open(os.path.join(whole, "model.onnx"), "rb") as a, open(os.path.join(out, "model.onnx"), "rb") as b:
        assert a.read() == b.read()
    # the last checkpoints' weights and Adam moments (their saved configs differ in output.dir only)
    a, b = (load_checkpoint(list_checkpoints(f)[-1][1]) for f in (whole, out))
    assert a.trainable.keys() == b.trainable.keys()
    assert all(np.array_equal(a.trainable[k], b.trainable[k]) for k in a.trainable)
    (ga,), (gb,) = a.optimizer_groups, b.optimizer_groups
    assert (ga.step, ga.initial_lr) == (gb.step, gb.initial_lr) == (3, np.float32(2e-3))
    assert {k: v.keys() for k, v in ga.states.items()} == {k: v.keys() for k, v in gb.states.items()}
    assert all(np.array_equal(v, gb.states[k][m]) for k, d in ga.states.items() for m, v in d.items())
    # the user's own config.yaml in the folder (comments: no run wrote it) stays refused, and unchanged
    shutil.copy(config_path("digits_mlp"), saved)
    before = _md5(saved)
    capsys.readouterr()
    assert main(["train", saved, "-q", "--resume", "--output-dir", out, *sets,
                 "--set", "training.steps=4"]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert "the config file" in line and "copy" in line, line
    assert _md5(saved) == before


def test_a_new_run_refuses_a_folder_with_files_no_run_wrote(tmp_path, capsys):
    """A folder that is not a run's (no metrics.jsonl, no checkpoints) but holds a model.onnx or config.yaml:
    a new run would replace them, so it is refused (exit 2), --overwrite too; a run's own folder is not."""
    (tmp_path / "model.onnx").write_bytes(b"the user's model")
    (tmp_path / "config.yaml").write_text("# the user's notes\n")
    argv = ["train", config_path("digits_mlp"), "--output-dir", str(tmp_path), "-q", "--set",
            "training.steps=2"]
    for extra in ([], ["--overwrite"]):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "holds config.yaml, model.onnx" in err[0] and "--output-dir" in err[0], err
    assert (tmp_path / "model.onnx").read_bytes() == b"the user's model"
    assert sorted(os.listdir(tmp_path)) == ["config.yaml", "model.onnx"]
    run = tmp_path / "run"  # a run killed before its first checkpoint left metrics.jsonl: a run folder
    run.mkdir()
    for f in ("metrics.jsonl", "model.onnx", "config.yaml"):
        (run / f).write_text("")
    assert main(["train", config_path("digits_mlp"), "--output-dir", str(run), "-q", "--set",
                 "training.steps=2"]) == 0
    assert onnx.load(str(run / "model.onnx")).graph.output[0].name == "logits"


def test_a_log_window_saved_by_another_number_of_ranks_is_kept(tmp_path):
    """The losses since the last logged step, kept per rank in the checkpoint, were dropped when the run
    resumed on another number of ranks (the next logged loss averaged fewer steps than the uninterrupted
    run's); each rank now takes the saved ranks' mean, as the logged loss averages the ranks' means."""
    sets = ["training.steps=6", "training.log_every=4", "training.checkpoint_every=3",
            "schedule.kind=constant"]
    out = str(tmp_path / "run")
    Trainer(load_config(config_path("digits_mlp"), sets), out, progress=False).run()
    ckpt = load_checkpoint(list_checkpoints(out)[0][1])  # step 3: three losses in the window
    (loss, n), = json.loads(ckpt.properties["log_windows"])
    assert n == 3
    ckpt.properties["log_windows"] = json.dumps([[loss - 0.5, n], [loss + 1.5, n]])  # as two ranks saved it
    tr = Trainer(load_config(config_path("digits_mlp"), sets), str(tmp_path / "other"), progress=False)
    st = tr.restore(ckpt)
    assert st.window_n == 3 and st.window_loss == pytest.approx(loss + 0.5, rel=1e-12)


def test_a_repeated_sigterm_is_one_stop_request_a_later_one_a_second(monkeypatch):
    """A SIGTERM repeating the first within SIGTERM_REPEAT_S is the same request delivered twice (a
    cgroup-wide kill reaches a rank directly and again from mpiexec: it aborted the job without the stop's
    checkpoint); a SIGTERM after that, or a SIGINT, is a second request and raises at once."""
    from onnxtrain.train import stop_signals

    def deliver(signum: int) -> None:
        os.kill(os.getpid(), signum)
        time.sleep(0.01)  # (the handler runs between bytecodes of this thread)

    with stop_signals.StopSignals() as stop:
        deliver(signal.SIGTERM)
        try:
            deliver(signal.SIGTERM)
        except stop_signals.Terminated:  # (a KeyboardInterrupt: pytest would stop the session on it)
            pytest.fail("a SIGTERM 10 ms after the first was taken as a second stop request")
        assert (stop.hit, stop.signum) == (True, signal.SIGTERM)
        with pytest.raises(KeyboardInterrupt) as e:
            deliver(signal.SIGINT)
        assert not isinstance(e.value, stop_signals.Terminated)
        monkeypatch.setattr(stop_signals, "SIGTERM_REPEAT_S", 0.0)
        with pytest.raises(stop_signals.Terminated) as e:
            deliver(signal.SIGTERM)
        assert e.value.signum == signal.SIGTERM
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL


_REPEAT_AFTER_THE_STOP = """
import os, signal, sys, time
from onnxtrain.train import stop_signals

def deliver(signum):
    os.kill(os.getpid(), signum)
    time.sleep(0.01)

seen = []
if sys.argv[1] == "handler":
    signal.signal(signal.SIGTERM, lambda s, f: seen.append(s))
with stop_signals.StopSignals() as stop:
    deliver(signal.SIGTERM)
deliver(signal.SIGTERM)  # the same request again, once the run has stopped: passed over
print("alive", seen, flush=True)
time.sleep(stop_signals.SIGTERM_REPEAT_S)
deliver(signal.SIGTERM)  # a later one gets the handler that was there before the run
print("after the window", seen, flush=True)
"""


@pytest.mark.parametrize("before", ["default", "handler"])
def test_a_repeated_sigterm_after_the_run_stopped_is_still_passed_over(before):
    """A cgroup-wide SIGTERM reaches a rank twice, some milliseconds apart. When the second came after the
    run had stopped on the first (its handlers put back, the CLI not yet ignoring SIGTERM), the default
    action ended the rank: exit 15 and mpiexec's "bad termination" instead of the stop's 143 (seen in
    CI). A repeat within SIGTERM_REPEAT_S of the stop is now passed over there too; a later SIGTERM gets
    the handler that was there before the run (the default action, or the program's own)."""
    proc = subprocess.run([sys.executable, "-c", _REPEAT_AFTER_THE_STOP, before], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert "alive []" in proc.stdout, (proc.returncode, proc.stderr[-2000:])
    if before == "default":
        assert proc.returncode == -signal.SIGTERM and "after the window" not in proc.stdout, proc.stdout
    else:
        assert proc.returncode == 0 and f"after the window [{int(signal.SIGTERM)}]" in proc.stdout, proc


def test_a_resumed_run_without_export_or_plot_says_the_old_ones_are_stale(tmp_path, capsys):
    """A finished run resumed for more steps with output.export and output.plot false left the model.onnx
    and metrics.png of its first part beside checkpoints of later steps, unmentioned (the summary just
    left them out). It now warns that they are of an earlier step; the model's weights are indeed the first
    part's last checkpoint's, not the final one's."""
    out = str(tmp_path / "run")
    sets = ["--set", "training.keep_checkpoints=0", "--set", "training.checkpoint_every=1000"]
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, *sets, "--set",
                 "training.steps=3"]) == 0
    capsys.readouterr()
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--resume", *sets, "--set",
                 "training.steps=5", "--set", "output.export=false", "--set", "output.plot=false"]) == 0
    err = capsys.readouterr().err
    for name, key in (("model.onnx", "output.export"), ("metrics.png", "output.plot")):
        (line,) = [x for x in err.splitlines() if name in x]
        assert "warning" in line and "earlier step" in line and key in line and "step 5" in line, line
    model = onnx.load(os.path.join(out, "model.onnx"))
    weights = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    (s3, p3), (s5, p5) = list_checkpoints(out)
    assert (s3, s5) == (3, 5)
    at3, at5 = load_checkpoint(p3).trainable, load_checkpoint(p5).trainable
    assert all(np.array_equal(weights[k], at3[k]) for k in at3)
    assert not all(np.array_equal(weights[k], at5[k]) for k in at5)
    # resumed again with nothing left to train: the files are those of the final weights, no warning
    capsys.readouterr()
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--resume", *sets, "--set",
                 "training.steps=5"]) == 0
    assert main(["train", config_path("digits_mlp"), "-q", "--output-dir", out, "--resume", *sets, "--set",
                 "training.steps=5", "--set", "output.export=false", "--set", "output.plot=false"]) == 0
    assert "earlier step" not in capsys.readouterr().err
