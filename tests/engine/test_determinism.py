"""Determinism: a seeded training run gives the same bits every time.

Fresh processes train the same models (the legacy TrainingSession and the on-device Module + Optimizer: a
helper-built embedding model, three of ``random_models``' cases, and torch exports of the bench's MLP, LeNet,
transformer encoder and GPT decoder at smaller sizes) on the numpy engine at 1 and 2 threads and on the
onnxruntime backend; a second process runs beside a busy process (another core's worth of load, which
changes which thread claims which part of a split kernel). Losses, weights and optimizer moments must be
bitwise equal between the two runs of one setting, and within float32 rounding between 1 and 2 threads.
``onnxtrain train`` of two bundled configs is checked the same way, and two sessions built alike in one
process must give the same bits step by step (pools, kept buffers and donated slots shared between them).

Two run-to-run differences were found and are pinned here against independent oracles:
onnxruntime's CPU ScatterND (the gradient of an embedding's Gather) lost updates when two threads combined
rows of one repeated index (float64 ``np.add.at`` is the oracle), and an InferenceSession's batch split
answered the first run of a batch size from the whole batch and later runs from its halves, whose BLAS
products round differently (onnxruntime is the oracle for the values).

``python -m tests.engine.test_determinism OUT.npz MODELS_DIR`` is the training process the tests start
(its backend from ``DETERMINISM_BACKEND``, its threads from ``ONNXTRAIN_NUM_THREADS``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RANDOM_SEEDS = (1, 8, 11)  # a CNN, an attention block with an embedding, an MLP of varying batch sizes
STEPS = 8


# ---- models ---------------------------------------------------------------------------------------------

def embedding_model(vocab: int = 1000, dim: int = 128, classes: int = 10) -> onnx.ModelProto:
    """tokens [N, S] → Gather of a [vocab, dim] table → mean over S → [dim, classes] → cross entropy ``loss``.
    At N·S = 2048 tokens the table's gradient combines 2048 × 128 update elements: enough for onnxruntime
    to split its ScatterND over threads."""
    rng = np.random.default_rng(5)
    table = numpy_helper.from_array((rng.standard_normal((vocab, dim)) * 0.5).astype(np.float32), "table")
    head = numpy_helper.from_array((rng.standard_normal((dim, classes)) / np.sqrt(dim)).astype(np.float32),
                                   "head")
    nodes = [
        helper.make_node("Gather", ["table", "tokens"], ["rows"]),
        helper.make_node("ReduceMean", ["rows"], ["pooled"], axes=[1], keepdims=0),
        helper.make_node("MatMul", ["pooled", "head"], ["logits"]),
        helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes, "embedding",
        [helper.make_tensor_value_info("tokens", T.INT64, ["N", "S"]),
         helper.make_tensor_value_info("labels", T.INT64, ["N"])],
        [helper.make_tensor_value_info("loss", T.FLOAT, [])], [table, head])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def embedding_feeds(steps: int, vocab: int = 1000, classes: int = 10) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(6)
    return [{"tokens": rng.integers(0, vocab, (32, 64)), "labels": rng.integers(0, classes, 32)}
            for _ in range(steps)]


def export_bench_models(folder: str) -> None:
    """The bench's MLP and LeNet, and its transformer encoder and GPT decoder at smaller sizes, exported by
    torch with their cross entropy (``loss``) into ``folder/<name>.onnx``, a batch in ``<name>.npz``."""
    torch = pytest.importorskip("torch")
    from bench.models import GPT, MLP, FlatCrossEntropy, LeNet, _untie_equal_parameters
    from tests.models import SEED, TransformerEncoder, WithLoss, export_module

    rng = np.random.default_rng(7)
    image = {"x": rng.standard_normal((64, 1, 28, 28), np.float32)}
    tokens = {"tokens": rng.integers(0, 1000, (32, 64))}
    specs = {
        "mlp": (MLP, image, 10),
        "lenet": (LeNet, {"x": image["x"][:32]}, 10),
        "transformer": (lambda: TransformerEncoder(vocab=1000, seq=64, d=64, heads=4, ff=128, layers=2,
                                                   dropout=0.0, classes=10), tokens, 10),
        "gpt": (lambda: GPT(vocab=300, seq=64, d=64, heads=4, layers=2),
                {"tokens": tokens["tokens"][:8] % 300}, 300),
    }
    for name, (build, feeds, classes) in specs.items():
        torch.manual_seed(SEED)
        module = build()
        _untie_equal_parameters(module)
        first = next(iter(feeds.values()))
        labels = rng.integers(0, classes, first.shape[:2] if name == "gpt" else first.shape[:1])
        small = {k: v[:2] for k, v in feeds.items()}
        model = export_module(WithLoss(module, FlatCrossEntropy()), {**small, "labels": labels[:2]}, "loss",
                              training=False, batch_output=False)
        onnx.save(model, os.path.join(folder, f"{name}.onnx"))
        np.savez(os.path.join(folder, f"{name}.npz"), **feeds, labels=labels)


# ---- training (in this process or in the one the tests start) -----------------------------------------

def _options(backend: str) -> Any:
    from onnxtrain import SessionOptions

    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    return so


def train_legacy(model: onnx.ModelProto, feeds: list[dict[str, np.ndarray]], backend: str,
                 optimizer: str = "AdamOptimizer", lr: float = 1e-3) -> dict[str, np.ndarray]:
    """Losses and the session's state (weights, moments) after one update per feed."""
    from onnxtrain import TrainingParameters
    from onnxtrain.session import TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = optimizer
    sess = TrainingSession(model.SerializeToString(), p, _options(backend))
    rate = np.array([lr], np.float32)
    losses = [np.asarray(sess.run(["loss"], {**f, "Learning_Rate": rate})[0]).copy() for f in feeds]
    out = {f"state:{k}": np.array(v) for k, v in sess.get_state().items()}
    out["losses"] = np.array(losses)
    return out


def _random_case(seed: int) -> Any:
    from tests.engine import random_models

    case = random_models.make_case(seed)
    case.feeds = case.feeds[:STEPS + 4]
    return case


def train_random(seed: int, api: str, backend: str) -> dict[str, np.ndarray]:
    """``random_models`` case ``seed`` through the legacy session (Adam) or the on-device API (AdamW)."""
    from tests.engine import random_models

    case = _random_case(seed)
    if api == "legacy":
        result = random_models.run_legacy(case, backend, "AdamOptimizer", 0.01)
    else:
        with tempfile.TemporaryDirectory(prefix="determinism_") as folder:
            random_models.make_artifacts(case, folder, "AdamW", weight_decay=0.01)
            result = random_models.run_ondevice(case, folder, backend, 0.01)
    return {"losses": np.array(result.losses), **{f"state:{k}": np.array(v) for k, v in result.state.items()}}


def train_ondevice_embedding(backend: str, steps: int = STEPS) -> dict[str, np.ndarray]:
    """The embedding model's body (logits) with a cross-entropy block, AdamW, through Module + Optimizer."""
    from onnxtrain.training import api, artifacts, onnxblock

    body = embedding_model()
    del body.graph.node[-1]
    del body.graph.input[-1]
    del body.graph.output[:]
    body.graph.output.append(helper.make_tensor_value_info("logits", T.FLOAT, ["N", 10]))
    with tempfile.TemporaryDirectory(prefix="determinism_") as folder:
        artifacts.generate_artifacts(body, requires_grad=["table", "head"],
                                     loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=onnxblock.optim.AdamW(weight_decay=0.01),
                                     artifact_directory=folder)
        state = api.CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
        module = api.Module(os.path.join(folder, "training_model.onnx"), state,
                            session_options=_options(backend))
        opt = api.Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
        opt.set_learning_rate(1e-2)
        losses = []
        for f in embedding_feeds(steps):
            losses.append(np.asarray(module(f["tokens"], f["labels"])).copy())
            opt.step()
            module.lazy_reset_grad()
        out = {f"state:{n}": np.array(p.data) for n, p in state.parameters}
        for n, moments in state._optimizer_state().moments.items():
            out.update({f"{key}:{n}": np.array(m) for key, m in moments.items()})
    out["losses"] = np.array(losses)
    return out


def train_everything(models_dir: str, backend: str) -> dict[str, np.ndarray]:
    """Every case of the module docstring, keyed ``<case>/<losses | state:... | moment:...>``."""
    import onnxtrain

    onnxtrain.set_default_logger_severity(3)
    results: dict[str, dict[str, np.ndarray]] = {
        "embedding-legacy": train_legacy(embedding_model(), embedding_feeds(STEPS), backend),
        "embedding-ondevice": train_ondevice_embedding(backend),
    }
    for seed in RANDOM_SEEDS:
        for api in ("legacy", "ondevice"):
            results[f"random{seed}-{api}"] = train_random(seed, api, backend)
    for name in ("mlp", "lenet", "transformer", "gpt"):
        model = onnx.load(os.path.join(models_dir, f"{name}.onnx"))
        data = dict(np.load(os.path.join(models_dir, f"{name}.npz")))
        x_name = model.graph.input[0].name
        feeds = [{x_name: data[x_name], "labels": data["labels"]}] * 4
        results[name] = train_legacy(model, feeds, backend)
    return {f"{case}/{key}": v for case, r in results.items() for key, v in r.items()}


def _train_in_a_fresh_process(models_dir: str, backend: str, threads: int, busy: bool = False
                              ) -> dict[str, np.ndarray]:
    env = {**os.environ, "ONNXTRAIN_NUM_THREADS": str(threads), "DETERMINISM_BACKEND": backend}
    load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
    try:
        with tempfile.TemporaryDirectory(prefix="determinism_") as folder:
            out = os.path.join(folder, "result.npz")
            proc = subprocess.run([sys.executable, "-m", "tests.engine.test_determinism", out, models_dir],
                                  cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
            assert proc.returncode == 0, proc.stderr[-3000:]
            return dict(np.load(out))
    finally:
        if load is not None:
            load.kill()
            load.wait()


def _bitwise_differences(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> list[str]:
    assert a.keys() == b.keys()
    return [k for k in a if a[k].dtype != b[k].dtype or a[k].tobytes() != b[k].tobytes()]


# ---- the tests --------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def models_dir():
    with tempfile.TemporaryDirectory(prefix="determinism_models_") as folder:
        export_bench_models(folder)
        yield folder


@pytest.fixture(scope="module")
def runs(models_dir):
    """Results by setting, made once (each is a fresh process)."""
    return {}


def _run(runs: dict, models_dir: str, key: tuple) -> dict[str, np.ndarray]:
    if key not in runs:
        runs[key] = _train_in_a_fresh_process(models_dir, *key)
    return runs[key]


@pytest.mark.parametrize("backend, threads", [("numpy", 2), ("onnxruntime", 2)])
def test_a_second_process_under_load_trains_to_the_same_bits(runs, models_dir, backend, threads) -> None:
    quiet = _run(runs, models_dir, (backend, threads))
    busy = _run(runs, models_dir, (backend, threads, True))
    assert not _bitwise_differences(quiet, busy)
    for key, value in quiet.items():  # and the runs trained: every loss finite
        if key.endswith("/losses"):
            assert np.isfinite(value).all(), key


def test_one_and_two_threads_agree_within_float32_rounding(runs, models_dir) -> None:
    one = _run(runs, models_dir, ("numpy", 1))
    two = _run(runs, models_dir, ("numpy", 2))
    for key in _bitwise_differences(one, two):  # (none on the machine this was written on)
        a, b = one[key].astype(np.float64), two[key].astype(np.float64)
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * max(1.0, float(np.abs(a).max())), err_msg=key)


def test_the_onnxruntime_backend_trains_as_the_numpy_engine(runs, models_dir) -> None:
    """The backend's results are deterministic and right: within float32 rounding of the numpy engine's (the
    embedding's gradient lost updates before, off by whole values)."""
    numpy_run = _run(runs, models_dir, ("numpy", 2))
    ort_run = _run(runs, models_dir, ("onnxruntime", 2))
    for key in ("embedding-legacy/losses", "embedding-legacy/state:table", "embedding-ondevice/state:table",
                "transformer/losses", "gpt/losses"):
        np.testing.assert_allclose(ort_run[key], numpy_run[key], rtol=2e-4, atol=2e-6, err_msg=key)


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_two_sessions_built_alike_step_to_the_same_bits(backend) -> None:
    """Within one process: two legacy sessions of one model, stepped in turn, then a third after them."""
    from onnxtrain import TrainingParameters
    from onnxtrain.session import TrainingSession

    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    model = embedding_model().SerializeToString()
    first, second = (TrainingSession(model, p, _options(backend)) for _ in range(2))
    rate = np.array([1e-2], np.float32)
    for f in embedding_feeds(4):
        a = np.asarray(first.run(["loss"], {**f, "Learning_Rate": rate})[0]).copy()
        b = np.asarray(second.run(["loss"], {**f, "Learning_Rate": rate})[0]).copy()
        assert a.tobytes() == b.tobytes()
    third = train_legacy(embedding_model(), embedding_feeds(4), backend, lr=1e-2)
    for name, value in first.get_state().items():
        assert np.array_equal(value, second.get_state()[name])
        assert np.array_equal(value, third[f"state:{name}"])


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_two_modules_built_alike_step_to_the_same_bits(backend) -> None:
    a = train_random(8, "ondevice", backend)
    b = train_random(8, "ondevice", backend)
    assert not _bitwise_differences(a, b)


def _scatter_model(rows: int | str, dim: int, elem: int) -> onnx.ModelProto:
    node = helper.make_node("ScatterND", ["data", "indices", "updates"], ["out"], reduction="add")
    graph = helper.make_graph(
        [node], "scatter",
        [helper.make_tensor_value_info("data", elem, [1000, dim]),
         helper.make_tensor_value_info("indices", T.INT64, [rows, 1]),
         helper.make_tensor_value_info("updates", elem, [rows, dim])],
        [helper.make_tensor_value_info("out", elem, [1000, dim])])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])


@pytest.mark.parametrize("rows, dtype", [("n", np.float32), (4096, np.float32), ("n", np.float16)])
def test_row_scatter_add_on_the_onnxruntime_backend_keeps_every_update(rows, dtype) -> None:
    """4096 rows of 128 added into 1000 rows (an embedding's gradient), dynamic and static sizes: every run
    within float32 rounding of float64 ``np.add.at``, the same bits each run and as the numpy engine's."""
    from onnxtrain import InferenceSession

    model = _scatter_model(rows, 128, helper.np_dtype_to_tensor_dtype(np.dtype(dtype))).SerializeToString()
    rng = np.random.default_rng(3)
    feeds = {"data": rng.standard_normal((1000, 128)).astype(dtype),
             "indices": rng.integers(-1000, 1000, (4096, 1)),
             "updates": rng.standard_normal((4096, 128)).astype(dtype)}
    want = feeds["data"].astype(np.float64)
    np.add.at(want, feeds["indices"][:, 0], feeds["updates"].astype(np.float64))
    sess = InferenceSession(model, _options("onnxruntime"))
    outs = [sess.run(None, feeds)[0] for _ in range(30)]
    tol = 1e-4 if dtype == np.float32 else 2e-2 * np.abs(want).max()
    for out in outs:
        np.testing.assert_allclose(out.astype(np.float64), want, rtol=1e-4 if dtype == np.float32 else 1e-2,
                                   atol=tol)
        assert out.tobytes() == outs[0].tobytes()
    if dtype == np.float32:  # both add each element's updates in index order
        assert outs[0].tobytes() == InferenceSession(model, _options("numpy")).run(None, feeds)[0].tobytes()


def test_a_row_scatter_in_a_loop_body_keeps_every_update() -> None:
    """The same scatter inside a Loop body (run twice, its data's type unknown there): rewritten behind an If
    in the body, twice the float64 sum, the same bits each run."""
    from onnxtrain import InferenceSession
    from onnxtrain.engine.ort_rewrites import for_onnxruntime
    from tests.engine.test_ort_scatter_nd import loop_scatter_model

    model = loop_scatter_model((1000, 128), 1)
    rewritten = for_onnxruntime(model).graph.node[-1].attribute[0].g
    assert "If" in [n.op_type for n in rewritten.node]
    rng = np.random.default_rng(4)
    feeds = {"data": np.zeros((1000, 128), np.float32), "indices": rng.integers(0, 1000, (4096, 1)),
             "updates": rng.standard_normal((4096, 128)).astype(np.float32)}
    want = np.zeros((1000, 128))
    np.add.at(want, feeds["indices"][:, 0], 2 * feeds["updates"].astype(np.float64))
    sess = InferenceSession(model.SerializeToString(), _options("onnxruntime"))
    outs = [sess.run(None, feeds)[0] for _ in range(20)]
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4)
        assert out.tobytes() == outs[0].tobytes()


def test_a_small_row_scatter_keeps_its_scatter_nd() -> None:
    """Below the size onnxruntime splits, the graph onnxruntime runs keeps the ScatterND (and its speed)."""
    from onnxtrain.engine.ort_rewrites import for_onnxruntime

    small = [n.op_type for n in for_onnxruntime(_scatter_model(1024, 128, T.FLOAT)).graph.node]
    large = [n.op_type for n in for_onnxruntime(_scatter_model(4096, 128, T.FLOAT)).graph.node]
    dynamic = [n.op_type for n in for_onnxruntime(_scatter_model("n", 128, T.FLOAT)).graph.node]
    assert small == ["ScatterND"]  # 131,072 update elements: one thread (two from 210,000)
    assert large.count("ScatterND") == 4  # pieces of 1024 rows
    assert "If" in dynamic


def test_an_inference_session_answers_each_run_of_a_batch_size_with_the_same_bits() -> None:
    """A batch the session runs in two halves at two threads: the first run (which checks the halves) gives
    the bits of the later ones, all within float32 rounding of onnxruntime."""
    from onnxtrain import InferenceSession, SessionOptions
    from onnxtrain.engine.blas import can_pin_blas_threads

    if not can_pin_blas_threads():
        pytest.skip("the batch split needs an OpenBLAS whose threads can be pinned")
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array((rng.standard_normal((784, 512)) / 28).astype(np.float32), "w1")
    w2 = numpy_helper.from_array((rng.standard_normal((512, 10)) / 22).astype(np.float32), "w2")
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w1"], ["h"]), helper.make_node("Tanh", ["h"], ["a"]),
         helper.make_node("MatMul", ["a", "w2"], ["y"])], "mlp",
        [helper.make_tensor_value_info("x", T.FLOAT, ["batch", 784])],
        [helper.make_tensor_value_info("y", T.FLOAT, ["batch", 10])], [w1, w2])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()
    so = SessionOptions()
    so.intra_op_num_threads = 2
    sess = InferenceSession(model, so)
    x = rng.standard_normal((1024, 784)).astype(np.float32)
    outs = [sess.run(None, {"x": x})[0] for _ in range(3)]
    # split or whole, decided once (the halves split only when they give the same bits on BLAS's threads)
    assert sess._splitter is not None and list(sess._splitter.verdicts) == [1024]
    idle = threading.Event()
    other = threading.Thread(target=idle.wait, daemon=True)
    other.start()
    try:  # another Python thread alive: BLAS's threads cannot be pinned, the bits stay
        outs.append(sess.run(None, {"x": x})[0])
    finally:
        idle.set()
        other.join()
    want = ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    for out in outs:
        np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)
        assert out.tobytes() == outs[0].tobytes()


@pytest.mark.parametrize("config, backend", [("digits_mlp", "numpy"), ("tiny_transformer", "onnxruntime")])
def test_onnxtrain_train_twice_gives_the_same_checkpoint(config, backend, tmp_path) -> None:
    """30 steps of a bundled config, the second run beside a busy process: the same checkpoint bytes and
    logged losses."""
    def train(out: str, busy: bool) -> tuple[bytes, list[dict]]:
        load = subprocess.Popen([sys.executable, "-c", "while True: pass"]) if busy else None
        try:
            proc = subprocess.run(
                [sys.executable, "-m", "onnxtrain", "train", f"configs/{config}.yaml", "-q",
                 "--output-dir", out,
                 "--set", "training.steps=30", "--set", "training.eval_every=15", "--set",
                 "training.checkpoint_every=30", "--set", "output.plot=false", "--set", "output.export=false",
                 "--set", f"training.backend={backend}"],
                cwd=ROOT, env={**os.environ, "ONNXTRAIN_NUM_THREADS": "2"}, capture_output=True, text=True,
                timeout=600)
        finally:
            if load is not None:
                load.kill()
                load.wait()
        assert proc.returncode == 0, proc.stderr[-2000:]
        with open(os.path.join(out, "checkpoints", "step_00000030.ckpt"), "rb") as f:
            ckpt = f.read()
        with open(os.path.join(out, "metrics.jsonl")) as f:
            logged = [{k: v for k, v in json.loads(line).items() if k != "samples_per_s"} for line in f]
        return ckpt, logged

    quiet = train(str(tmp_path / "a"), busy=False)
    busy = train(str(tmp_path / "b"), busy=True)
    assert quiet[0] == busy[0]
    assert quiet[1] == busy[1]


if __name__ == "__main__":
    sys.path.insert(0, ROOT)
    np.savez(sys.argv[1], **train_everything(sys.argv[2], os.environ.get("DETERMINISM_BACKEND", "numpy")))
