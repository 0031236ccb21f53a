"""Every public save writes whole files or leaves the old ones: crashes simulated mid-write and mid-rename.

A crash is simulated three ways: a serializer that writes part of its bytes and raises, an ``os.fsync`` or
``os.replace`` that fails on a chosen file, and a process killed (SIGKILL) while it writes. After each, the
old files must hold their old bytes (and still load: onnxruntime-training 1.19.2 reads the checkpoints,
onnxruntime 1.32 runs the models), and no temporary may be left behind.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import onnx
import pytest

from onnxtrain.checkpoint import format as fmt
from onnxtrain.cli import main
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.zoo import mlp
from tests.ortt import PREAMBLE, ensure_ortt, run_script
from tests.train.conftest import config_path

ort = pytest.importorskip("onnxruntime")

CRASH = "simulated crash"


def _snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> bytes)."""
    out = {}
    for root, _, files in os.walk(folder):
        for f in files:
            p = os.path.join(root, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, folder)] = fh.read()
    return out


def _temporaries(folder) -> list[str]:
    return [os.path.join(r, f) for r, _, files in os.walk(folder) for f in files if f.endswith(".tmp")]


def _fail_on(monkeypatch, call: str, names: set[str], after: int = 0) -> None:
    """``os.<call>`` (replace or fsync) raises OSError for paths named in ``names`` (by base name), or, for
    fsync (which gets a descriptor), at the call number ``after`` + 1."""
    real = getattr(os, call)
    count = [0]

    def fake(*args):
        if call == "replace":
            hit = os.path.basename(os.fspath(args[1])) in names
        else:
            count[0] += 1
            hit = count[0] > after
        if hit:
            raise OSError(CRASH)
        return real(*args)

    monkeypatch.setattr(os, call, fake)


def _half_writes(monkeypatch, after: int = 0) -> None:
    """The files opened for writing after the first ``after`` get half of their first write's bytes, then
    the writer dies (a serializer that crashes part way)."""
    real = os.fdopen
    count = [0]

    class Half:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            view = memoryview(data).cast("B")
            self.f.write(view[: len(view) // 2])
            self.f.flush()
            raise OSError(CRASH)

        def __getattr__(self, name):
            return getattr(self.f, name)

    def fake(fd, mode="r", *args, **kwargs):
        f = real(fd, mode, *args, **kwargs)
        if "w" not in mode:
            return f
        count[0] += 1
        return Half(f) if count[0] > after else f

    monkeypatch.setattr(os, "fdopen", fake)


def _x(seed: int = 0, n: int = 6) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((n, 8)).astype(np.float32)


def _labels(seed: int = 0, n: int = 6) -> np.ndarray:
    return np.random.default_rng(seed + 50).integers(0, 4, n).astype(np.int64)


@pytest.fixture
def trained(tmp_path):
    """(artifact folder, state, module, optimizer) of a small MLP, one step trained."""
    folder = tmp_path / "art"
    folder.mkdir()
    model = mlp([8, 64, 4], loss=False)  # two weights of at least 1 KiB (external data), two small biases
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=folder)
    state = CheckpointState.load_checkpoint(str(folder / "checkpoint"))
    module = Module(str(folder / "training_model.onnx"), state, str(folder / "eval_model.onnx"))
    opt = Optimizer(str(folder / "optimizer_model.onnx"), module)
    _step(module, opt, 0)
    return folder, state, module, opt


def _step(module: Module, opt: Optimizer, seed: int) -> None:
    module.train()
    module(_x(seed), _labels(seed))
    opt.step()
    module.lazy_reset_grad()


def _params(state: CheckpointState) -> dict[str, np.ndarray]:
    return {k: np.array(p.data) for k, p in state.parameters}


_ORT_READ = PREAMBLE + r"""
import numpy as np
from onnxruntime.training.api import CheckpointState
state = CheckpointState.load_checkpoint(sys.argv[1])
print(json.dumps({k: np.asarray(p.data).ravel().tolist() for k, p in state.parameters}))
"""


def test_checkpoint_state_save_survives_crashes(trained, tmp_path, monkeypatch):
    """CheckpointState.save_checkpoint, inline and with ``<path>.data``: a serializer that dies half way, a
    failing fsync and a failing rename of the main file (after its ``.data`` side file is ready) all leave
    the previous checkpoint, which onnxruntime-training 1.19.2 still loads with the previous values."""
    for external in (False, True):
        _check_checkpoint_crashes(trained, tmp_path / str(external), monkeypatch, external)
        monkeypatch.undo()


def _check_checkpoint_crashes(trained, tmp_path, monkeypatch, external: bool) -> None:
    _, state, module, opt = trained
    if external:  # every tensor to <path>.data
        monkeypatch.setattr(fmt.save_checkpoint, "__defaults__", (0,))
    out = tmp_path / "ckpts"
    out.mkdir(parents=True)
    path = out / "ckpt"
    CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
    assert sorted(os.listdir(out)) == (["ckpt", "ckpt.data"] if external else ["ckpt"])
    before, old_params = _snapshot(out), _params(state)
    _step(module, opt, 1)
    assert any(not np.array_equal(old_params[k], v) for k, v in _params(state).items())

    crashes = [
        lambda: _half_writes(monkeypatch, after=0),
        lambda: _half_writes(monkeypatch, after=1 if external else 0),
        lambda: _fail_on(monkeypatch, "fsync", set(), after=1 if external else 0),
        lambda: _fail_on(monkeypatch, "replace", {"ckpt"}),
    ]
    for crash in crashes:
        crash()
        with pytest.raises(OSError, match=CRASH):
            CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
        monkeypatch.undo()
        if external:
            monkeypatch.setattr(fmt.save_checkpoint, "__defaults__", (0,))
        assert _snapshot(out) == before
        assert _temporaries(tmp_path) == []
    loaded = _params(CheckpointState.load_checkpoint(str(path)))
    assert all(np.array_equal(loaded[k], old_params[k]) for k in old_params)
    ort_values = run_script(_ORT_READ, str(path))
    for k, v in old_params.items():
        np.testing.assert_array_equal(np.asarray(ort_values[k], np.float32), v.ravel())
    # and a save that goes through replaces both files
    CheckpointState.save_checkpoint(state, str(path), include_optimizer_state=True)
    new = _params(CheckpointState.load_checkpoint(str(path)))
    assert all(np.array_equal(new[k], v) for k, v in _params(state).items())


def _ort_logits(path: str, x: np.ndarray) -> np.ndarray:
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(["logits"], {"x": x})[0]


def test_export_model_for_inferencing_survives_crashes(trained, tmp_path, monkeypatch):
    """Module.export_model_for_inferencing, inline and past the external-data threshold, where the weights
    go to ``<file>.data``, written whole (a second export does not append to the first's file, as onnx's
    own external-data writer does) and renamed with the model: a crash while writing either file, or a
    failed rename of the model after its data file is ready, leaves the previous export, which onnxruntime
    runs to the previous logits."""
    for external in (False, True):
        _check_export_crashes(trained, tmp_path / str(external), monkeypatch, external)
        monkeypatch.undo()


def _check_export_crashes(trained, tmp_path, monkeypatch, external: bool) -> None:
    from onnxtrain.ir import large

    tmp_path.mkdir()
    _, state, module, opt = trained
    if external:
        monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 0)
    out = tmp_path / "exported"
    out.mkdir()
    path = str(out / "model.onnx")
    module.export_model_for_inferencing(path, ["logits"])
    onnx.checker.check_model(path, full_check=True)
    x = _x(7)
    old_logits = _ort_logits(path, x)
    param_bytes = sum(v.nbytes for v in _params(state).values() if v.nbytes >= 1024)  # onnx's threshold
    assert param_bytes == 2048 + 1024
    if external:
        assert sorted(os.listdir(out)) == ["model.onnx", "model.onnx.data"]
        assert os.path.getsize(path + ".data") == param_bytes
        module.export_model_for_inferencing(path, ["logits"])  # again: the same bytes, not twice as many
        assert os.path.getsize(path + ".data") == param_bytes
        assert os.path.getsize(path) < param_bytes
    else:
        assert os.listdir(out) == ["model.onnx"]
    before = _snapshot(out)
    _step(module, opt, 2)

    crashes = [
        lambda: _half_writes(monkeypatch, after=0),  # the first file written (the data file, when external)
        lambda: _half_writes(monkeypatch, after=1 if external else 0),
        lambda: _fail_on(monkeypatch, "fsync", set(), after=1 if external else 0),
        lambda: _fail_on(monkeypatch, "replace", {"model.onnx"}),
    ]
    for crash in crashes:
        crash()
        with pytest.raises(OSError, match=CRASH):
            module.export_model_for_inferencing(path, ["logits"])
        monkeypatch.undo()
        if external:
            monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 0)
        assert _snapshot(out) == before
        assert _temporaries(tmp_path) == []
        np.testing.assert_array_equal(_ort_logits(path, x), old_logits)
    module.export_model_for_inferencing(path, ["logits"])
    onnx.checker.check_model(path, full_check=True)
    module.eval()
    fresh = str(tmp_path / "inline.onnx")
    monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 2**40)
    module.export_model_for_inferencing(fresh, ["logits"])
    np.testing.assert_array_equal(_ort_logits(path, x), _ort_logits(fresh, x))
    assert not np.array_equal(_ort_logits(path, x), old_logits)


def _generate(folder, optimizer: str, nominal: bool, frozen: list[str]) -> None:
    model = mlp([8, 16, 4], loss=False)
    artifacts.generate_artifacts(
        model, requires_grad=[t.name for t in model.graph.initializer if t.name not in frozen],
        frozen_params=frozen, loss=artifacts.LossType.CrossEntropyLoss,
        optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=folder,
        nominal_checkpoint=nominal)


@pytest.mark.parametrize("crash", ["half 1", "half 3", "fsync 1", "fsync 3", "replace checkpoint",
                                   "replace optimizer_model.onnx"])
def test_generate_artifacts_writes_all_files_or_none(tmp_path, monkeypatch, crash):
    """generate_artifacts writes every file to a temporary before renaming any: a crash while writing the
    k-th file, or a failed k-th rename (the renamed ones are put back), leaves the earlier set whole."""
    folder = tmp_path / "art"
    folder.mkdir()
    _generate(folder, "AdamW", True, [])
    before = _snapshot(folder)
    assert sorted(before) == ["checkpoint", "eval_model.onnx", "nominal_checkpoint", "optimizer_model.onnx",
                              "training_model.onnx"]
    kind, arg = crash.split(" ")
    if kind == "half":
        _half_writes(monkeypatch, after=int(arg))
    elif kind == "fsync":
        _fail_on(monkeypatch, "fsync", set(), after=int(arg))
    else:
        _fail_on(monkeypatch, "replace", {arg})
    with pytest.raises(OSError, match=CRASH):
        _generate(folder, "SGD", True, ["fc0.bias"])
    monkeypatch.undo()
    assert _snapshot(folder) == before
    assert _temporaries(tmp_path) == []
    _generate(folder, "SGD", True, ["fc0.bias"])  # and without a crash the files are the new ones
    after = _snapshot(folder)
    assert sorted(after) == sorted(before)
    changed = ["checkpoint", "nominal_checkpoint", "optimizer_model.onnx", "training_model.onnx"]
    assert all(after[n] != before[n] for n in changed)


def test_artifacts_command_writes_all_files_or_none(tmp_path, monkeypatch, capsys):
    """``onnxtrain artifacts`` over an earlier set: a crash at the third file is exit code 1 with the error
    on one line, and the earlier set stays whole, with no temporary left."""
    model = tmp_path / "m.onnx"
    onnx.save(mlp([8, 16, 4], loss=False), str(model))
    out = tmp_path / "art"
    args = ["artifacts", str(model), "-o", str(out), "--loss", "CrossEntropyLoss"]
    assert main([*args, "--optimizer", "AdamW"]) == 0
    before = _snapshot(out)
    _fail_on(monkeypatch, "fsync", set(), after=2)
    assert main([*args, "--optimizer", "SGD", "--frozen", "fc1.bias"]) == 1
    monkeypatch.undo()
    assert CRASH in capsys.readouterr().err
    assert _snapshot(out) == before
    assert _temporaries(tmp_path) == []


# ---- onnxtrain train: checkpoints, model.onnx, config.yaml, metrics.png -----------------------------------

_SETS = ["--set", "training.steps=6", "--set", "training.checkpoint_every=2",
         "--set", "training.eval_every=3", "--set", "training.log_every=1"]


def _train(out: str, *extra: str) -> int:
    return main(["train", config_path("digits_mlp"), "--output-dir", out, "-q", *_SETS, *extra])


def _check_train_crash(out: str, monkeypatch, victim: str) -> None:
    """A resumed run whose write of ``victim`` fails (the rename refused, after the bytes were written)
    stops with exit code 1 and leaves the earlier files as they were, with no temporary; the checkpoint it
    could not write is not there, and the next resume continues from the last one."""
    assert _train(out) == 0
    before = _snapshot(out)
    _fail_on(monkeypatch, "replace", {victim})
    assert _train(out, "--resume", "--set", "training.steps=8") == 1
    monkeypatch.undo()
    assert _temporaries(out) == []
    now = _snapshot(out)
    if victim.endswith(".ckpt"):
        assert sorted(now) == sorted(before)  # no step 8, and (no new checkpoint) none of the old removed
    else:
        assert now[victim] == before[victim]
    assert all(now[n] == before[n] for n in before if n in now and n.startswith("checkpoints"))
    assert _train(out, "--resume", "--set", "training.steps=8") == 0
    assert os.path.isfile(os.path.join(out, "checkpoints", "step_00000008.ckpt"))


_KILLED_WRITER = textwrap.dedent("""
    import sys, time
    from onnxtrain.ir.io import write_atomic

    def write(f):
        f.write(b"partial bytes of a file")
        f.flush()
        print("writing", flush=True)
        time.sleep(600)

    write_atomic(sys.argv[1], write)
""")


def _killed_while_writing(path: str) -> None:
    """Start a process that writes ``path`` atomically and SIGKILL it half way: its temporary stays."""
    proc = subprocess.Popen([sys.executable, "-c", _KILLED_WRITER, path], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)


def test_train_outputs_survive_crashes_and_kills(tmp_path, monkeypatch, capsys):
    """``onnxtrain train``: a failed write of config.yaml, a checkpoint, metrics.png or model.onnx leaves the
    earlier file (:func:`_check_train_crash`); the temporaries of a run killed (SIGKILL) while writing its
    checkpoint, model.onnx, config.yaml, metrics.png or metrics.jsonl are deleted at the next start (with a
    line on stderr), and the files they were for stay as they were until the run replaces them."""
    for victim in ("config.yaml", "step_00000008.ckpt", "metrics.png", "model.onnx"):
        _check_train_crash(str(tmp_path / victim), monkeypatch, victim)
    out = str(tmp_path / "run")
    assert _train(out) == 0
    before = _snapshot(out)
    victims = [os.path.join(out, n) for n in ("model.onnx", "config.yaml", "metrics.png", "metrics.jsonl")]
    victims.append(os.path.join(out, "checkpoints", "step_00000008.ckpt"))
    for v in victims:
        _killed_while_writing(v)
    left = _temporaries(out)
    assert len(left) == len(victims)
    assert {k: v for k, v in _snapshot(out).items() if not k.endswith(".tmp")} == before
    capsys.readouterr()
    t0 = time.time()
    assert _train(out, "--resume", "--set", "training.steps=8") == 0
    err = capsys.readouterr().err
    assert all(f"removed {t}" in err for t in left), err
    assert _temporaries(out) == []
    assert time.time() - t0 < 120
    with open(os.path.join(out, "metrics.jsonl")) as f:
        steps = [json.loads(line)["step"] for line in f]
    assert steps == sorted(steps) and steps[-1] == 8
    ensure_ortt()
    ort_values = run_script(_ORT_READ, os.path.join(out, "checkpoints", "step_00000008.ckpt"))
    assert ort_values  # onnxruntime-training loads the new checkpoint


def test_an_inline_export_removes_the_earlier_external_data(trained, tmp_path, monkeypatch):
    """An export past the threshold writes ``model.onnx.data``; a later inline export of the same path takes
    it away with the renames (it would sit beside a model that never reads it), and the model runs alone."""
    from onnxtrain.ir import large

    _, _, module, _ = trained
    out = tmp_path / "exported"
    out.mkdir()
    path = str(out / "model.onnx")
    monkeypatch.setattr(large, "LARGE_MODEL_BYTES", 0)
    module.export_model_for_inferencing(path, ["logits"])
    assert sorted(os.listdir(out)) == ["model.onnx", "model.onnx.data"]
    external_logits = _ort_logits(path, _x(3))
    monkeypatch.undo()
    module.export_model_for_inferencing(path, ["logits"])
    assert os.listdir(out) == ["model.onnx"]
    np.testing.assert_array_equal(_ort_logits(path, _x(3)), external_logits)


@pytest.mark.parametrize("kind", ["symlink", "no_hard_links"])
def test_a_failed_commit_puts_back_a_symlink_or_a_file_without_hard_links(kind, tmp_path, monkeypatch):
    """StagedFiles keeps what each target was before its rename: a symlink stays that symlink, and where
    hard links are refused the old bytes are kept by a copy (both were left replaced by the new file)."""
    from onnxtrain.ir.io import StagedFiles

    monkeypatch.chdir(tmp_path)
    os.mkdir("real")
    with open("real/a", "w") as f:
        f.write("old")
    if kind == "symlink":
        os.symlink("real/a", "a")
    else:
        os.replace("real/a", "a")

        def refuse(*args, **kwargs):
            raise PermissionError(1, "Operation not permitted")

        monkeypatch.setattr(os, "link", refuse)
    os.mkdir("b")  # a folder in the way of the second rename: the commit fails there
    with pytest.raises(IsADirectoryError), StagedFiles() as files:
        files.write("a", lambda f: f.write(b"new"))
        files.write("b", lambda f: f.write(b"x"))
    assert os.path.islink("a") == (kind == "symlink")
    with open("a") as f:
        assert f.read() == "old"
    assert _temporaries(tmp_path) == []


def test_one_file_staged_under_two_spellings_is_refused(tmp_path, monkeypatch):
    from onnxtrain.ir.io import StagedFiles

    monkeypatch.chdir(tmp_path)
    os.mkdir("a")
    with pytest.raises(ValueError, match="staged twice"), StagedFiles() as files:
        files.write("a/x", lambda f: f.write(b"1"))
        files.write("./a/x", lambda f: f.write(b"2"))
    assert os.listdir("a") == []
