"""The README's Python examples run as written, given the names they assume (a model, its data)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.session.helpers import mlp_model

README = Path(__file__).resolve().parents[2] / "README.md"


def block(marker: str) -> str:
    """The ```python block of the README that contains ``marker``."""
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README python blocks contain {marker!r}"
    return found[0]


def inference_model() -> onnx.ModelProto:
    """The test MLP without its loss: x → logits."""
    model = mlp_model()
    del model.graph.node[-1]
    del model.graph.input[1]
    del model.graph.output[0]
    return model


def batch(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    return rng.standard_normal((6, 8)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int64)


def run_example(marker: str, files: dict[str, onnx.ModelProto] | None = None, **names) -> dict:
    """Save ``files`` in the working directory, run the README block holding ``marker`` with ``names``
    defined, and return its namespace."""
    for path, model in (files or {}).items():
        onnx.save(model, path)
    env = dict(names)
    exec(block(marker), env)  # noqa: S102 - the README's own code
    return env


LEGACY = 'ort.TrainingSession("model_with_loss.onnx", p)'


def test_legacy_session_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    x, y = batch(np.random.default_rng(0))
    env = run_example(LEGACY, {"model_with_loss.onnx": mlp_model()}, x=x, y=y)
    assert np.isfinite(env["loss"])
    # "weights and optimizer state by name": the weights and Adam's moments and step counts, after one step
    assert {"W1", "Moment_1_W1", "Moment_2_W1", "Update_Count_W1"} <= set(env["state"])
    assert int(np.asarray(env["state"]["Update_Count_W1"]).reshape(-1)[0]) == 2  # from 1, as in onnxruntime


def test_gradient_graph_builder_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 4)).astype(np.float32), "fc1.weight"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "fc1.bias")]
    nodes = [helper.make_node("Gemm", ["x", "fc1.weight", "fc1.bias"], ["h"], transB=1),
             helper.make_node("ReduceSum", ["h"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "fc", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    run_example("GradientGraphBuilder(model_bytes", model_bytes=model.SerializeToString())
    outputs = [o.name for o in onnx.load("model_with_grads.onnx").graph.output]
    assert outputs == ["loss", "fc1.bias_grad", "fc1.weight_grad"]  # the model's outputs, then the set sorted


def test_on_device_example(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(2)
    env = run_example("artifacts.generate_artifacts(model", model=inference_model(),
                      params=["W1", "b1", "W2", "b2"], batches=[batch(rng) for _ in range(3)])
    assert np.ndim(env["loss"]) == 0 and np.isfinite(env["loss"])
    assert os.path.exists("model.onnx") and os.path.exists("ckpt")
    assert [o.name for o in onnx.load("model.onnx").graph.output] == ["logits"]


@pytest.mark.parametrize("marker", ["from onnxtrain import TrainingParameters, TrainingSession, RunOptions"])
def test_migration_imports_resolve(marker: str) -> None:
    exec(block(marker).replace("from onnxruntime import", "# from onnxruntime import"), {})  # noqa: S102


def test_mixed_precision_example(tmp_path, monkeypatch) -> None:
    """The mixed-precision block continues the legacy session's (``ort``, ``p``, ``lr`` from there)."""
    monkeypatch.chdir(tmp_path)
    x, y = batch(np.random.default_rng(3))
    env = run_example(LEGACY, {"model_with_loss.onnx": mlp_model()}, x=x, y=y,
                      model_bytes=mlp_model().SerializeToString())
    exec(block("p.use_mixed_precision = True"), env)  # noqa: S102 - the README's code
    assert np.isfinite(env["loss"]) and bool(env["finite"])


def test_onnxruntime_backend_example() -> None:
    pytest.importorskip("onnxruntime")
    import onnxtrain
    from tests.session.helpers import params

    env = run_example('add_session_config_entry("onnxtrain.backend", "onnxruntime")', onnxtrain=onnxtrain,
                      model_bytes=mlp_model().SerializeToString(), p=params())
    x, y = batch(np.random.default_rng(4))
    (loss,) = env["sess"].run(["loss"], {"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)})
    assert np.isfinite(loss)


def test_inference_example(tmp_path, monkeypatch) -> None:
    import onnxtrain

    monkeypatch.chdir(tmp_path)
    x, _ = batch(np.random.default_rng(5))
    env = run_example('onnxtrain.InferenceSession("model.onnx"', {"model.onnx": inference_model()},
                      onnxtrain=onnxtrain, x=x)
    assert env["logits"].shape == (6, 4) and env["sess"].peak_bytes > 0


def test_batch_split_process_example(tmp_path, monkeypatch) -> None:
    """The child-process batch split: the README's block runs as written, and its outputs are an unsplit
    session's (to the split's tolerance; where the process cannot fork, the halves run on threads)."""
    import onnxtrain

    monkeypatch.chdir(tmp_path)
    rng = np.random.default_rng(6)
    inits = [numpy_helper.from_array(rng.standard_normal((64, 256)).astype(np.float32), "W1"),
             numpy_helper.from_array(rng.standard_normal((256, 10)).astype(np.float32), "W2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["a"]), helper.make_node("Tanh", ["a"], ["h"]),
             helper.make_node("MatMul", ["h", "W2"], ["y"])]
    x_info = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 64])
    y_info = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 10])
    g = helper.make_graph(nodes, "encoder", [x_info], [y_info], inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    env = run_example('"onnxtrain.batch_split", "process"', {"encoder.onnx": model}, onnxtrain=onnxtrain)
    x = rng.standard_normal((4096, 64)).astype(np.float32)  # 4 MiB of activations: large enough to split
    whole = onnxtrain.SessionOptions()
    whole.add_session_config_entry("onnxtrain.batch_split", "0")
    (want,) = onnxtrain.InferenceSession("encoder.onnx", whole).run(None, {"x": x})
    for _ in range(2):  # the first run of a batch size checks the halves against the whole run
        (got,) = env["sess"].run(None, {"x": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_sklearn_zipmap_example(tmp_path, monkeypatch) -> None:
    """The ai.onnx.ml block on a skl2onnx classifier with its default ZipMap (a fixture): the labels and the
    list of per-row dicts onnxruntime gives."""
    import shutil

    import onnxtrain

    ort = pytest.importorskip("onnxruntime")
    fixture = README.parent / "tests" / "data" / "sklearn_pipelines" / "gaussian_nb_3c.onnx"
    shutil.copy(fixture, tmp_path / "rf.onnx")
    monkeypatch.chdir(tmp_path)
    x = np.load(fixture.with_suffix(".npz"))["in_X"][:5]
    env = run_example('onnxtrain.InferenceSession("rf.onnx")', onnxtrain=onnxtrain, x=x)
    want_label, want_proba = ort.InferenceSession(str(fixture), providers=["CPUExecutionProvider"]).run(
        None, {"X": x})
    np.testing.assert_array_equal(env["label"], want_label)
    assert isinstance(env["proba"], list) and len(env["proba"]) == len(x)
    for got, want in zip(env["proba"], want_proba):
        assert list(got) == list(want)  # class labels, ascending
        np.testing.assert_allclose([got[k] for k in got], [want[k] for k in want], rtol=1e-5, atol=1e-7)


def bash_lines(marker: str) -> list[str]:
    """The commands of the README's ```bash block holding ``marker``, comments dropped."""
    blocks = re.findall(r"```bash\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    found = [b for b in blocks if marker in b]
    assert len(found) == 1, f"{len(found)} README bash blocks contain {marker!r}"
    lines = [line.split("#", 1)[0].strip() for line in found[0].splitlines()]
    return [line for line in lines if line]


def test_main_job_commands(tmp_path, monkeypatch, capsys) -> None:
    """Every command of "The main job" block as written (the configs read from the repository), in a scratch
    folder: each exits 0, the accuracies its comments give hold, --resume of a finished run changes no
    metric, and export writes an inference model that onnxruntime scores as eval does."""
    import json
    import shlex

    from onnxtrain.cli import main
    from onnxtrain.data import load_digits

    ort = pytest.importorskip("onnxruntime")
    monkeypatch.chdir(tmp_path)
    (tmp_path / "configs").symlink_to(README.parent / "configs")
    lines = bash_lines("onnxtrain train configs/digits_mlp.yaml --resume")
    assert len(lines) == 8, lines

    def final(run: str) -> dict:
        with open(f"runs/{run}/metrics.jsonl", encoding="utf-8") as f:
            return [r for r in map(json.loads, f) if "eval_accuracy" in r][-1]

    finals = {}
    for line in lines:
        argv = shlex.split(line)
        assert argv[0] == "onnxtrain", line
        assert main([*argv[1:], "-q"] if argv[1] == "train" else argv[1:]) == 0, line
        if argv[1] == "train":
            run = os.path.splitext(os.path.basename(argv[2]))[0]
            if "--resume" in argv:
                assert final(run) == finals[run]  # nothing left to train: the same metrics
            finals[run] = final(run)
    assert finals["digits_mlp"]["eval_accuracy"] >= 0.965  # "≈ 97 %"
    assert finals["digits_stn"]["eval_accuracy"] >= 0.955  # "≈ 97 %"
    assert finals["tiny_transformer"]["eval_accuracy"] == 1.0  # "100 % tokens"
    assert os.path.exists("runs/digits_mlp/checkpoints/step_00000660.ckpt")  # the README's example name
    _, test = load_digits()
    sess = ort.InferenceSession("digits.onnx", providers=["CPUExecutionProvider"])
    accuracy = float(np.mean(sess.run(None, {"x": test.x})[0].argmax(1) == test.y))
    assert accuracy == finals["digits_mlp"]["eval_accuracy"]
    assert "eval_accuracy" in capsys.readouterr().out


def readme_batch(case: str) -> tuple[np.ndarray, np.ndarray]:
    """The global batch the MPI examples feed on every rank."""
    rng = np.random.default_rng(7)
    if case == "pipeline":
        return rng.standard_normal((8, 8)).astype(np.float32), rng.integers(0, 4, 8).astype(np.int64)
    tokens = rng.integers(0, 10, (4, 8)).astype(np.int64)
    return tokens, tokens[:, ::-1].copy()


def staged_split_model() -> onnx.ModelProto:
    """A two-layer transformer whose first layer's output is ``layer0.res2``, without Dropout."""
    from tests.parallel.pipeline_worker import transformer_model

    return transformer_model(2, dropout=False)


@pytest.mark.parametrize("case, ranks, model, micro", [
    ("pipeline", 2, lambda: mlp_model(), 4),
    ("staged_split", 4, staged_split_model, 2),
])
def test_mpi_examples(case, ranks, model, micro, tmp_path) -> None:
    """The pipeline block and the block of stages whose blocks are split, run as the README says (every rank
    the same script and feeds): the session is a pipeline on every rank, and the first run returns, on every
    rank, the last micro-batch's loss before any update, which onnxruntime computes from the model."""
    from tests.parallel.conftest import mpi_missing, run_mpi

    if mpi_missing():
        pytest.skip(mpi_missing())
    ort = pytest.importorskip("onnxruntime")
    worker = str(Path(__file__).with_name("readme_mpi_worker.py"))
    out = str(tmp_path / case)
    r = run_mpi(case, out, n=ranks, worker=worker, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    x, y = readme_batch(case)
    rows = len(x) // micro
    sess = ort.InferenceSession(model().SerializeToString(), providers=["CPUExecutionProvider"])
    want = sess.run(["loss"], {"x": x[-rows:], "y": y[-rows:]})[0]
    stages = []
    for rank in range(ranks):
        got = np.load(f"{out}.rank{rank}.npz")
        assert str(got["kind"]) != "TrainingSession", str(got["kind"])
        stages.append(int(got["stage"]))
        np.testing.assert_allclose(got["loss"], want, rtol=1e-5, err_msg=f"rank {rank}")
    assert sorted(set(stages)) == [0, 1]
