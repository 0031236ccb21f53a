"""``onnxtrain train`` used as a PyTorch / Lightning / Hugging Face user would: runs killed with SIGKILL at
chosen points and resumed, eval metrics recomputed from the exported model with onnxruntime and numpy,
config mistakes located in the file, a damaged checkpoint named."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime
import pytest
import yaml
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _records(folder: str) -> list[dict]:
    with open(os.path.join(folder, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def _ort_logits(model: str, x: np.ndarray) -> np.ndarray:
    sess = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0].astype(np.float64)


# ---- eval metrics of a loss with an ignore_index ------------------------------------------------

CLASS_WEIGHTS = np.array([0.5, 2.0, 1.25], np.float32)


def _ignore_index_run(tmp_path, eval_batch: int, weighted: bool) -> str:
    """A linear classifier whose SoftmaxCrossEntropyLoss has ignore_index -1 (and CLASS_WEIGHTS when
    ``weighted``), trained on files whose labels are -1 in places (the eval file's first 10 rows all -1);
    returns the config path."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b")]
    if weighted:
        inits.append(numpy_helper.from_array(CLASS_WEIGHTS, "cw"))
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "W", "b"], ["logits"]),
         helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y", *(["cw"] if weighted else [])], ["loss"],
                          ignore_index=-1)],
        "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4]),
                   helper.make_tensor_value_info("y", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")

    def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        r = np.random.default_rng(seed)
        x = r.normal(size=(n, 4)).astype(np.float32)
        y = (x[:, 0] > 0).astype(np.int64) + (x[:, 1] > 0.5)
        y[r.random(n) < 0.4] = -1
        return x, y

    x, y = arrays(200, 1)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    x, y = arrays(50, 2)
    y[:10] = -1  # a whole eval batch of ignored labels
    np.savez(tmp_path / "eval.npz", x=x, y=y)
    cfg = {"model": {"path": "m.onnx"},
           "data": {"source": "files", "path": "train.npz", "eval_path": "eval.npz",
                    "feeds": {"x": "x", "y": "y"}},
           "optimizer": {"name": "sgd", "lr": 0.1},
           "training": {"batch_size": 20, "steps": 5, "eval_batch_size": eval_batch},
           "output": {"plot": False}}
    if weighted:  # (the class weights are constants of the loss, not trained)
        cfg["training"]["parameters"] = {"weights_not_to_train": ["cw"]}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.parametrize("eval_batch,weighted", [(10, False), (7, False), (1024, False), (7, True)])
def test_eval_leaves_out_labels_the_loss_ignores(tmp_path, capsys, eval_batch, weighted):
    """torch's CrossEntropyLoss(ignore_index=...) and the ONNX loss average over the labels that are not
    ignored; the eval did that per batch and then weighted the batches by rows (a batch of only ignored
    labels gave NaN: "training diverged", exit 1), and counted ignored labels as wrong predictions. Now
    both metrics are those of the whole eval set, whatever training.eval_batch_size, as numpy computes them
    from onnxruntime's logits of the exported model (torch's cross_entropy for the loss with class
    weights)."""
    config = _ignore_index_run(tmp_path, eval_batch, weighted)
    out = str(tmp_path / "out")
    assert main(["train", config, "--output-dir", out, "-q"]) == 0, capsys.readouterr().err
    data = np.load(tmp_path / "eval.npz")
    x, y = data["x"], data["y"]
    logits = _ort_logits(os.path.join(out, "model.onnx"), x)
    kept = y != -1
    top = logits.max(axis=1)
    picked = logits[np.arange(len(y)), np.where(kept, y, 0)]
    nll = np.log(np.exp(logits - top[:, None]).sum(axis=1)) + top - picked
    expected = nll[kept].mean()
    if weighted:
        torch = pytest.importorskip("torch")
        expected = torch.nn.functional.cross_entropy(
            torch.tensor(logits), torch.tensor(y), weight=torch.tensor(CLASS_WEIGHTS, dtype=torch.float64),
            ignore_index=-1).item()
    last = [r for r in _records(out) if "eval_loss" in r][-1]
    assert last["eval_loss"] == pytest.approx(expected, rel=1e-6)
    assert last["eval_accuracy"] == (logits.argmax(axis=1) == y)[kept].mean()
    capsys.readouterr()
    assert main(["eval", config, "--checkpoint", out, "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == {k: last[k] for k in ("eval_loss", "eval_accuracy")}


def test_eval_finds_the_ignore_index_of_labels_reshaped_on_their_way_to_the_loss(tmp_path, capsys):
    """A sequence model's export flattens its labels before the loss (torch's ``y.view(-1)``): the eval found
    the loss's ignore_index only where the loss read the labels input itself, so here ignored labels counted
    as wrong predictions and the eval set's first batch, all ignored, made eval_loss NaN ("training
    diverged", exit 1). Both metrics are now those of the whole set, as numpy computes them from
    onnxruntime's logits of the exported model."""
    rng = np.random.default_rng(0)
    flat = helper.make_tensor("flat", TensorProto.INT64, [2], [-1, 3])
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["scores"]),  # (N, T, 3)
         helper.make_node("Transpose", ["scores"], ["logits"], perm=[0, 2, 1]),  # class axis 1, for accuracy
         helper.make_node("Reshape", ["scores", "flat"], ["rows"]),
         helper.make_node("Flatten", ["y"], ["y2"], axis=0),  # (1, N·T): two reshapes on the labels' way
         helper.make_node("Squeeze", ["y2", "zero"], ["y_rows"]),
         helper.make_node("SoftmaxCrossEntropyLoss", ["rows", "y_rows"], ["loss"], ignore_index=-1)],
        "sequence", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4]),
                     helper.make_tensor_value_info("y", TensorProto.INT64, ["N", 2])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, []),
         helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3, 2])],
        [numpy_helper.from_array(rng.normal(size=(4, 3)).astype(np.float32), "W"), flat,
         numpy_helper.from_array(np.zeros(1, np.int64), "zero")])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), tmp_path / "m.onnx")

    def arrays(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
        r = np.random.default_rng(seed)
        x = r.normal(size=(n, 2, 4)).astype(np.float32)
        y = (x[..., 0] > 0).astype(np.int64) + (x[..., 1] > 0.5)
        y[r.random((n, 2)) < 0.4] = -1
        return x, y

    x, y = arrays(100, 1)
    np.savez(tmp_path / "train.npz", x=x, y=y)
    x, y = arrays(30, 2)
    y[:10] = -1  # the eval's first batch: ignored labels only
    np.savez(tmp_path / "eval.npz", x=x, y=y)
    cfg = {"model": {"path": "m.onnx"},
           "data": {"source": "files", "path": "train.npz", "eval_path": "eval.npz",
                    "feeds": {"x": "x", "y": "y"}},
           "optimizer": {"name": "sgd", "lr": 0.1},
           "training": {"batch_size": 20, "steps": 5, "eval_batch_size": 10},
           "output": {"plot": False}}
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg))
    out = str(tmp_path / "out")
    assert main(["train", str(config), "--output-dir", out, "-q"]) == 0, capsys.readouterr().err
    logits = _ort_logits(os.path.join(out, "model.onnx"), x)  # (N, 3, T)
    rows, labels = np.moveaxis(logits, 1, -1).reshape(-1, 3).astype(np.float64), y.reshape(-1)
    kept = labels != -1
    top = rows.max(axis=1)
    nll = np.log(np.exp(rows - top[:, None]).sum(axis=1)) + top - rows[np.arange(len(labels)),
                                                                       np.where(kept, labels, 0)]
    last = [r for r in _records(out) if "eval_loss" in r][-1]
    assert last["eval_loss"] == pytest.approx(nll[kept].mean(), rel=1e-6)
    assert last["eval_accuracy"] == (rows.argmax(axis=1) == labels)[kept].mean()


# ---- config errors located in the file -------------------------------------------------------------

_LOCATED = """\
model:
  builder: mlp
  args:
    sizes:
      - 64
      - 16.5
      - 10
  logits: {logits}
data: {{source: digits}}
training:
  epochs: 1
  batch_size: 32
  {extra}
output: {{plot: false, export: false{output}}}
"""


def _error(capsys, config: str, *args: str) -> str:
    capsys.readouterr()
    assert main(["train", config, "-q", *args]) == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    return line


def _line_of(path: str, text: str) -> int:
    """The 1-based line of ``path`` that holds ``text`` (once)."""
    with open(path, encoding="utf-8") as f:
        found = [i + 1 for i, line in enumerate(f) if text in line]
    assert len(found) == 1, found
    return found[0]


def test_config_errors_name_the_line_of_the_key(tmp_path, capsys):
    """A mistyped key, a value of the wrong type (in a list), a key a later check refuses and a cross-key
    error are reported as ``file:line: key: ...`` at the line the file writes the key (or its enclosing
    key); a value from --set names no line of the file."""
    path = str(tmp_path / "run.yaml")
    out = ["--output-dir", str(tmp_path / "out")]

    def write(logits: str = "logits", extra: str = "seed: 0", output: str = "") -> None:
        with open(path, "w", encoding="utf-8") as f:
            f.write(_LOCATED.format(logits=logits, extra=extra, output=output))

    write(extra="batchsize: 64")
    line = _error(capsys, path, *out)
    assert line.startswith(f"onnxtrain train: {path}:{_line_of(path, 'batchsize')}: training.batchsize: "
                           "unknown key (did you mean 'batch_size'?)"), line
    write()
    line = _error(capsys, path, *out)
    assert line.startswith(f"onnxtrain train: {path}:{_line_of(path, '16.5')}: model.args.sizes[1]: "
                           "expected an int"), line
    line = _error(capsys, path, *out, "--set", "model.args.sizes=[64,16.5,10]")
    assert line.startswith(f"onnxtrain train: {path}: model.args.sizes[1]: expected an int"), line
    write(logits="nope")
    line = _error(capsys, path, *out, "--set", "model.args.sizes=[64,16,10]")
    assert line.startswith(f"onnxtrain train: {path}:{_line_of(path, 'logits: nope')}: model.logits: 'nope' "
                           "is not a value of the model"), line
    write(extra="steps: 0")
    line = _error(capsys, path, *out, "--set", "model.args.sizes=[64,16,10]")
    assert line.startswith(f"onnxtrain train: {path}:{_line_of(path, 'steps: 0')}: training.steps: "), line
    write(output=", dir: elsewhere")  # --output-dir at fault, not the file's output.dir
    (tmp_path / "a_file").write_text("")
    line = _error(capsys, path, "--output-dir", str(tmp_path / "a_file"), "--set",
                  "model.args.sizes=[64,16,10]")
    assert line.startswith(f"onnxtrain train: {path}: output.dir: output folder "), line
    write()  # builder and path: a cross-key error, at the section's line
    line = _error(capsys, path, *out, "--set", "model.path=m.onnx")
    assert line.startswith(f"onnxtrain train: {path}:{_line_of(path, 'model:')}: model: give exactly one of "
                           "builder"), line


# ---- kill -9 at chosen points, then --resume --------------------------------------------------------

KILL_CONFIG = {
    "model": {"builder": "mlp", "args": {"sizes": [64, 16, 10]}},
    "data": {"source": "digits"},
    "optimizer": {"name": "adam", "lr": 0.01},
    "schedule": {"kind": "cosine", "warmup_steps": 5, "final_lr_ratio": 0.1},
    "training": {"batch_size": 64, "epochs": 3, "eval_every": 7, "checkpoint_every": 5, "log_every": 3,
                 "keep_checkpoints": 2},
    "output": {"plot": False, "export": True},
}

# runs `onnxtrain train ARGS` and SIGKILLs itself at the point argv[1] names, the argv[2]-th time there
_KILLER = textwrap.dedent("""
    import os, signal, sys
    point, nth, args = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
    seen = [0]

    def reached():
        seen[0] += 1
        return seen[0] == nth

    def die():
        os.kill(os.getpid(), signal.SIGKILL)

    from onnxtrain.session import TrainingSession
    from onnxtrain.train import loop

    if point == "step":  # in a training step, between checkpoints
        run = TrainingSession.run
        def killing_run(self, *a, **k):
            if reached():
                die()
            return run(self, *a, **k)
        TrainingSession.run = killing_run
    elif point == "checkpoint":  # the checkpoint's bytes written to its temporary, not yet renamed
        save = loop.save_with_checksum
        def killing_save(*a, **k):
            if reached():
                fsync = os.fsync
                def killing_fsync(fd):
                    fsync(fd)
                    die()
                os.fsync = killing_fsync
            return save(*a, **k)
        loop.save_with_checksum = killing_save
    elif point == "prune":  # a new checkpoint saved, the oldest not yet deleted
        remove = loop.remove_checkpoint
        def killing_remove(path):
            if reached():
                die()
            return remove(path)
        loop.remove_checkpoint = killing_remove
    elif point == "metrics":  # half of a metrics.jsonl line written
        line = loop.json_line
        log = loop.Trainer._log
        def killing_log(self, records, fh, record, *rest):
            if fh is not None and reached():
                fh.write(line(record)[:20])
                fh.flush()
                die()
            return log(self, records, fh, record, *rest)
        loop.Trainer._log = killing_log
    elif point == "export":  # after the last checkpoint, while model.onnx is written
        export = loop.export_model
        def killing_export(model, cfg, weights, path):
            fsync = os.fsync
            def killing_fsync(fd):
                fsync(fd)
                die()
            os.fsync = killing_fsync
            return export(model, cfg, weights, path)
        loop.export_model = killing_export
    from onnxtrain.cli import main
    sys.exit(main(["train", *args]))
""")


@pytest.fixture(scope="module")
def kill_setup(tmp_path_factory):
    """(config path, driver path, folder of an uninterrupted run of it)."""
    folder = tmp_path_factory.mktemp("killed")
    config = folder / "run.yaml"
    config.write_text(yaml.safe_dump(KILL_CONFIG))
    driver = folder / "killer.py"
    driver.write_text(_KILLER)
    whole = str(folder / "whole")
    assert main(["train", str(config), "--output-dir", whole, "-q"]) == 0
    return str(config), str(driver), whole


def _files(folder: str) -> dict[str, bytes]:
    out = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, folder)] = f.read()
    return out


def _without_speed(folder: str) -> list[dict]:
    return [{k: v for k, v in r.items() if k != "samples_per_s"} for r in _records(folder)]


def assert_same_run(out: str, whole: str) -> None:
    """Run folder ``out`` holds the files of the uninterrupted run ``whole``: the same names, the checkpoints
    and model.onnx byte for byte, the same metrics records but for samples_per_s."""
    got, expected = _files(out), _files(whole)
    assert sorted(got) == sorted(expected)
    for name in expected:
        if name.startswith("checkpoints") or name == "model.onnx":
            assert got[name] == expected[name], name
    assert _without_speed(out) == _without_speed(whole)


@pytest.mark.parametrize("kills", [
    [("step", 23)], [("checkpoint", 3)], [("prune", 2)], [("metrics", 9)], [("export", 1)],
    [("step", 12), ("checkpoint", 4)],  # the resumed run killed too
])
def test_resume_after_kill_9_ends_as_an_uninterrupted_run(kill_setup, tmp_path, kills):
    """A run SIGKILLed in a step, mid-checkpoint write, between a save and the pruning of the oldest
    checkpoint, mid metrics line or mid export (and its resumed run killed again), then resumed with
    --resume, leaves the files of an uninterrupted run: the checkpoints and model.onnx byte for byte, the
    same metrics.jsonl records (but samples_per_s), no temporaries."""
    config, driver, whole = kill_setup
    out = str(tmp_path / "run")
    args = [config, "--output-dir", out, "-q"]
    for i, (point, nth) in enumerate(kills):
        proc = subprocess.run([sys.executable, driver, point, str(nth), *args, *(["--resume"] if i else [])],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
        if point in ("checkpoint", "export"):  # killed with the file half written: its temporary is there
            assert any(n.endswith(".onnxtrain.tmp") for n in _files(out)), sorted(_files(out))
    proc = subprocess.run([sys.executable, "-m", "onnxtrain", "train", *args, "--resume"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert_same_run(out, whole)


# ---- --resume with another batch size, the run's length in epochs ----------------------------------

@pytest.mark.parametrize("epochs", [1, 2])
def test_resume_with_another_batch_size_trains_the_configs_epochs(tmp_path, capsys, epochs):
    """A run stopped after 10 steps of 64 samples, resumed with training.batch_size 32 and
    ``training.epochs``: it ends where that many passes over the 1,438 digits end (the rest of epoch 0 in
    full batches of 32, then 44 steps an epoch). It ran ``epochs`` × 44 steps of any size instead: 10 steps
    into a second pass with epochs: 1."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**KILL_CONFIG, "output": {"plot": False, "export": False}}))
    out = str(tmp_path / "run")
    common = [str(config), "--output-dir", out, "-q", "--set", "training.checkpoint_every=1000"]
    assert main(["train", *common, "--set", "training.steps=10"]) == 0
    assert main(["train", *common, "--resume", "--set", "training.steps=null", "--set",
                 f"training.epochs={epochs}", "--set", "training.batch_size=32"]) == 0
    n, first = 1438, 10 * 64
    rest = (n - first) // 32  # full batches of 32 left in epoch 0
    steps = 10 + rest + (epochs - 1) * (n // 32)
    assert f"for {steps} steps" in capsys.readouterr().out
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.train.outputs import list_checkpoints

    ((step, path),) = list_checkpoints(out)[-1:]
    props = load_checkpoint(path).properties
    assert (step, props["epoch"], props["epoch_samples"]) == (steps, epochs, 0)
    assert props["samples_seen"] == first + rest * 32 + (epochs - 1) * (n // 32) * 32


def test_once_an_epoch_means_at_each_epochs_end_after_a_batch_size_change(tmp_path):
    """eval_every and checkpoint_every null ("once an epoch") after --resume with another batch size: the
    evals and checkpoints come where each pass over the data ends (step 34 for the rest of epoch 0 in
    batches of 32, then 44 steps later), not at multiples of the new steps an epoch (44, 88)."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**KILL_CONFIG, "output": {"plot": False, "export": False}}))
    out = str(tmp_path / "run")
    common = [str(config), "--output-dir", out, "-q", "--set", "training.eval_every=null", "--set",
              "training.checkpoint_every=null", "--set", "training.keep_checkpoints=0"]
    assert main(["train", *common, "--set", "training.steps=10"]) == 0
    assert main(["train", *common, "--resume", "--set", "training.steps=null", "--set", "training.epochs=3",
                 "--set", "training.batch_size=32"]) == 0
    from onnxtrain.train.outputs import list_checkpoints

    ends = [10 + (1438 - 640) // 32 + k * (1438 // 32) for k in range(3)]  # 34, 78, 122
    assert [r["step"] for r in _records(out) if "eval_loss" in r] == [10, *ends]
    assert [step for step, _ in list_checkpoints(out)] == [10, *ends]


# ---- Ctrl-C -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("signum,code,how", [(signal.SIGINT, 130, "interrupted"),
                                             (signal.SIGTERM, 143, "stopped by SIGTERM")],
                         ids=["SIGINT", "SIGTERM"])
def test_ctrl_c_saves_a_checkpoint_where_it_stops(tmp_path, capsys, monkeypatch, signum, code, how):
    """Ctrl-C at step 23 of a run that checkpoints every 1000 steps: the run saves a checkpoint of step 23
    before it exits 130 (it left none, so --resume started over, the 23 steps lost), and --resume from it
    ends with the uninterrupted run's checkpoint and model.onnx, byte for byte, and its metrics. SIGTERM
    (a scheduler's stop, before its SIGKILL) does the same and exits 143: it ended the run at once, with no
    checkpoint of the steps since the last one."""
    from onnxtrain.session import TrainingSession

    config = tmp_path / "run.yaml"
    raw = {**KILL_CONFIG, "training": {**KILL_CONFIG["training"], "checkpoint_every": 1000}}
    config.write_text(yaml.safe_dump(raw))
    whole, out = str(tmp_path / "whole"), str(tmp_path / "run")
    assert main(["train", str(config), "--output-dir", whole, "-q"]) == 0
    calls = [0]
    run = TrainingSession.run

    def interrupted_run(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == 23:  # Ctrl-C during step 23: the loop stops after it
            signal.raise_signal(signum)
        return run(self, *args, **kwargs)

    def unhandled(*_):  # (SIGTERM's default action would end pytest itself)
        raise AssertionError("the signal reached the handler the run found in place")

    monkeypatch.setattr(TrainingSession, "run", interrupted_run)
    capsys.readouterr()
    before = signal.signal(signum, unhandled)
    try:
        assert main(["train", str(config), "--output-dir", out, "-q"]) == code
    finally:
        signal.signal(signum, before)
    err = capsys.readouterr().err
    saved = os.path.join(out, "checkpoints", "step_00000023.ckpt")
    assert f"{how} at step 23; the last checkpoint is {saved}; continue with --resume" in err, err
    monkeypatch.undo()
    assert main(["train", str(config), "--output-dir", out, "-q", "--resume"]) == 0
    got, expected = _files(out), _files(whole)
    for name in ("checkpoints/step_00000066.ckpt", "model.onnx"):
        assert got[name] == expected[name], name
    assert _without_speed(out) == _without_speed(whole)


@pytest.mark.parametrize("keep", [b"", 3000])
def test_resume_from_a_damaged_checkpoint_names_it_and_the_one_before(kill_setup, tmp_path, capsys, keep):
    """The latest checkpoint emptied or cut short (a disk that filled, a copy that stopped): --resume
    names the damaged file in a warning and continues from the checkpoint before it (it exited 1, to be
    resumed once the file was moved away), to the uninterrupted run's files, byte for byte (the steps
    after that checkpoint are trained again: the same weights)."""
    import shutil

    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    older, latest = (os.path.join(out, "checkpoints", f"step_000000{s}.ckpt") for s in (65, 66))
    with open(latest, "rb") as f:
        data = f.read()
    with open(latest, "wb") as f:
        f.write(keep if isinstance(keep, bytes) else data[:keep])
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q", "--resume"]) == 0
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line.startswith(f"onnxtrain: warning: checkpoint {latest} is damaged"), line
    assert line.endswith(f"resuming from the checkpoint before it, {older}"), line
    assert_same_run(out, whole)


def test_a_batch_of_ignored_labels_only_leaves_the_logged_loss_finite(tmp_path, capsys):
    """Batches of 2 from 40 samples of which 30 have the ignored label -1, every other batch none but those:
    such a batch has no loss (0/0, as torch's), and the logged loss of its log window was null with a
    "training diverges" warning. The window now averages the batches that have labels. Oracle:
    torch's cross_entropy(ignore_index=-1) of each batch in the trainer's documented data order, under an
    SGD rate too small to move a float32 weight."""
    torch = pytest.importorskip("torch")
    from onnxtrain.train import data as data_mod

    config = _ignore_index_run(tmp_path, 1024, weighted=False)
    x = np.load(tmp_path / "train.npz")["x"][:40]
    order = data_mod.order_rng(0).permutation(40)  # the first epoch's order (README: seeded, one an epoch)
    y = np.full(40, -1, np.int64)
    y[order[::4]] = [0, 1, 2, 1, 0, 2, 2, 1, 0, 1]  # every other batch of 2 holds one counted label
    np.savez(tmp_path / "train.npz", x=x, y=y)
    with open(config) as f:
        raw = yaml.safe_load(f)
    raw["optimizer"]["lr"] = 1e-30
    raw["training"].update(batch_size=2, steps=20, log_every=5)
    with open(config, "w") as f:
        yaml.safe_dump(raw, f)
    out = str(tmp_path / "out")
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "-q"]) == 0
    assert "diverges" not in capsys.readouterr().err
    model = onnx.load(tmp_path / "m.onnx")
    w = {t.name: torch.tensor(numpy_helper.to_array(t), dtype=torch.float64) for t in model.graph.initializer}
    expected = []
    for first in range(0, 20, 5):
        losses = []
        for step in range(first, first + 5):
            idx = order[2 * step:2 * step + 2]
            if (y[idx] != -1).any():
                logits = torch.tensor(x[idx], dtype=torch.float64) @ w["W"] + w["b"]
                losses.append(torch.nn.functional.cross_entropy(logits, torch.tensor(y[idx]),
                                                                ignore_index=-1).item())
        expected.append(sum(losses) / len(losses))
    logged = [r["loss"] for r in _records(out) if "loss" in r]
    np.testing.assert_allclose(logged, expected, rtol=1e-6)


# ---- the terminal ------------------------------------------------------------------------------------

@pytest.mark.skipif(not hasattr(os, "openpty"), reason="no pseudo-terminals here")
def test_a_terminal_run_with_no_color_writes_no_colour_codes(kill_setup, tmp_path):
    """On a terminal (a pseudo-terminal here) with NO_COLOR set, the progress bar, eval lines and summary
    carry no ANSI colour or style codes (SGR, ``ESC [ ... m``), and the bar redraws in place (carriage
    returns) rather than printing a line per update."""
    import re

    config, _, _ = kill_setup
    leader, follower = os.openpty()
    env = {**os.environ, "NO_COLOR": "1", "TERM": "xterm-256color"}
    argv = [sys.executable, "-m", "onnxtrain", "train", config, "--output-dir", str(tmp_path / "run")]
    proc = subprocess.Popen(argv, stdin=follower, stdout=follower, stderr=follower, env=env)
    os.close(follower)
    text = b""
    while True:
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        text += chunk
    os.close(leader)
    assert proc.wait(timeout=120) == 0, text[-2000:]
    assert b"trained run for 66 steps" in text
    assert not re.findall(rb"\x1b\[[0-9;]*m", text), text[-2000:]
    lines = text.replace(b"\r\n", b"\n").split(b"\n")
    assert len(lines) < 20, len(lines)  # 10 eval lines, the summary: the bar itself adds no lines


@pytest.mark.parametrize("vocab", [2**63 + 1, 10**20])
def test_a_sequence_vocab_past_int64_is_refused_naming_the_key(tmp_path, capsys, vocab):
    """data.vocab draws int64 token ids below it: one past 2**63 failed while the data was drawn, as
    "high is out of bounds for int64" (exit 1, no key named)."""
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {{builder: transformer}}\ndata: {{source: sequence, vocab: {vocab}}}\n"
                      "training: {steps: 1}\n")
    line = _error(capsys, str(config), "--output-dir", str(tmp_path / "out"))
    assert f"data.vocab: expected an int from 1 to 2**63 (the token ids are int64), got {vocab}" in line, line


def test_resume_says_where_it_resumes_unless_quiet(kill_setup, tmp_path, capsys):
    """--resume printed nothing about the checkpoint it took (a CI log showed the run go on at step 66 of
    66 with no word of it), as Lightning's "Restoring states from the checkpoint path" does; now one
    line on stderr names it and its step, left out with -q as the progress is."""
    import shutil

    config, _, whole = kill_setup
    out = str(tmp_path / "run")
    shutil.copytree(whole, out)
    os.remove(os.path.join(out, "checkpoints", "step_00000066.ckpt"))
    latest = os.path.join(out, "checkpoints", "step_00000065.ckpt")
    capsys.readouterr()
    assert main(["train", config, "--output-dir", out, "--resume", "-q"]) == 0
    assert "resuming" not in capsys.readouterr().err
    shutil.rmtree(out)
    shutil.copytree(whole, out)
    os.remove(os.path.join(out, "checkpoints", "step_00000066.ckpt"))
    assert main(["train", config, "--output-dir", out, "--resume"]) == 0
    assert f"onnxtrain: resuming from {latest} (step 65 of 66)\n" in capsys.readouterr().err


def test_a_model_with_a_fixed_batch_size_names_training_batch_size(tmp_path, capsys):
    """A model exported without a dynamic batch axis (inputs [32, 64] and [32]) and training.batch_size
    64: the first step failed as a runtime error (exit 1, "dimension 0 must be 32") naming no key; it is now
    refused at load naming training.batch_size and its line. With batch_size 32 the model trains, and its
    eval (359 rows at once) and export work."""
    from onnxtrain import zoo

    model = zoo.mlp([64, 16, 10])
    for v in [*model.graph.input, *model.graph.output]:
        dims = v.type.tensor_type.shape.dim
        if len(dims) and dims[0].dim_param:
            dims[0].dim_value = 32
    onnx.save(model, tmp_path / "m.onnx")
    config = tmp_path / "run.yaml"
    config.write_text("model: {path: m.onnx}\ntraining:\n  steps: 3\n  batch_size: 64\n"
                      "output: {plot: false}\n")
    line = _error(capsys, str(config), "--output-dir", str(tmp_path / "out"))
    assert line.startswith(f"onnxtrain train: {config}:4: training.batch_size: 64, but the model input 'x' "
                           "has a fixed batch size, 32"), line
    assert main(["train", str(config), "--output-dir", str(tmp_path / "out"), "-q", "--set",
                 "training.batch_size=32"]) == 0


@pytest.mark.parametrize("size", [0, -2])
def test_a_horizontal_split_of_no_ranks_is_refused_naming_the_key(tmp_path, capsys, size):
    """training.parameters.horizontal_parallel_size 0 ended in a ZeroDivisionError traceback (the trainer
    divides the world's ranks by it before the session checks it); now one line naming the key, exit 2."""
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({**KILL_CONFIG, "training": {
        "steps": 1, "parameters": {"horizontal_parallel_size": size}}}))
    line = _error(capsys, str(config), "--output-dir", str(tmp_path / "out"))
    key = "training.parameters.horizontal_parallel_size"
    assert f"{key}: expected an int >= 1 (a number of ranks), got {size}" in line, line


def test_resume_on_fewer_training_rows_than_the_epoch_had_used(tmp_path, capsys):
    """--resume after 12 steps of 20 rows (240 of a 300-row file used in epoch 0) with data.path a file of
    150 rows: nothing is left of epoch 0 in the new data, so a 2-epoch run ends after one full pass over
    it, 12 + 150 // 20 steps. The length was counted with the rows left in epoch 0 as a negative number of
    steps ((150 - 240) // 20 = -5): the run stopped 5 steps short, two steps into epoch 1."""
    rng = np.random.default_rng(3)
    for name, rows in (("big", 300), ("small", 150), ("eval", 40)):
        np.savez(tmp_path / f"{name}.npz", x=rng.normal(size=(rows, 64)).astype(np.float32),
                 y=rng.integers(0, 10, rows))
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump({
        "model": {"builder": "mlp", "args": {"sizes": [64, 8, 10]}},
        "data": {"source": "files", "path": "big.npz", "eval_path": "eval.npz",
                 "feeds": {"x": "x", "y": "y"}},
        "optimizer": {"name": "sgd", "lr": 0.01},
        "training": {"batch_size": 20, "epochs": 2, "checkpoint_every": 1000},
        "output": {"plot": False, "export": False}}))
    out = str(tmp_path / "run")
    common = [str(config), "--output-dir", out, "-q"]
    assert main(["train", *common, "--set", "training.steps=12"]) == 0
    assert main(["train", *common, "--resume", "--set", "training.steps=null", "--set",
                 "data.path=small.npz"]) == 0
    from onnxtrain.checkpoint import load_checkpoint
    from onnxtrain.train.outputs import list_checkpoints

    steps = 12 + 150 // 20
    ((step, path),) = list_checkpoints(out)[-1:]
    props = load_checkpoint(path).properties
    assert (step, props["epoch"], props["epoch_samples"]) == (steps, 2, 0)
    assert props["samples_seen"] == 12 * 20 + (150 // 20) * 20
