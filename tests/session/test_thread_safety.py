"""Sessions and training state used from several threads at once: every result of a shared
InferenceSession's concurrent runs equals a single-threaded run of the same feed, training in one thread
leaves inference in another (and the numpy / OpenBLAS settings other threads see) alone, and a parameter
written while another thread steps the optimizer lands between whole steps."""

from __future__ import annotations

import os
import threading

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto as T
from onnx import helper

import onnxtrain
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.lock_watch import first_set, watched_lock
from tests.session.helpers import backend_options, batches, in_threads, mlp_model, params

BACKENDS = ["numpy", "onnxruntime"]


def _session(model: bytes, backend: str) -> onnxtrain.InferenceSession:
    return onnxtrain.InferenceSession(model, backend_options(backend))


def _conv_model() -> bytes:
    """x[N,3,12,12] → Conv 3x3 → Relu → MaxPool → Flatten → Gemm → Dropout (inference) → Softmax."""
    rng = np.random.default_rng(3)
    w = rng.standard_normal((8, 3, 3, 3)).astype(np.float32) * 0.3
    fc = rng.standard_normal((5, 8 * 5 * 5)).astype(np.float32) * 0.1
    nodes = [
        helper.make_node("Conv", ["x", "w"], ["c"], pads=[0, 0, 0, 0]),
        helper.make_node("Relu", ["c"], ["r"]),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Flatten", ["p"], ["f"]),
        helper.make_node("Gemm", ["f", "fc"], ["g"], transB=1),
        helper.make_node("Dropout", ["g"], ["d"]),
        helper.make_node("Softmax", ["d"], ["y"], axis=-1),
    ]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 3, 12, 12])],
                          [helper.make_tensor_value_info("y", T.FLOAT, ["N", 5])],
                          [helper.make_tensor("w", T.FLOAT, w.shape, w.ravel()),
                           helper.make_tensor("fc", T.FLOAT, fc.shape, fc.ravel())])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _if_loop_model() -> bytes:
    """x[N,6]: an If on sum(x) > 0 choosing Tanh or Sigmoid, then a Loop adding a weight row k times (k
    fed)."""
    w = np.linspace(-1, 1, 6, dtype=np.float32)
    then = helper.make_graph([helper.make_node("Tanh", ["x"], ["t"])], "then", [],
                             [helper.make_tensor_value_info("t", T.FLOAT, ["N", 6])])
    other = helper.make_graph([helper.make_node("Sigmoid", ["x"], ["s"])], "else", [],
                              [helper.make_tensor_value_info("s", T.FLOAT, ["N", 6])])
    body = helper.make_graph(
        [helper.make_node("Identity", ["cond"], ["cond_out"]),
         helper.make_node("Add", ["acc", "w"], ["acc_out"]),
         helper.make_node("Mul", ["acc_out", "acc_out"], ["sq"])],
        "body",
        [helper.make_tensor_value_info("i", T.INT64, []), helper.make_tensor_value_info("cond", T.BOOL, []),
         helper.make_tensor_value_info("acc", T.FLOAT, ["N", 6])],
        [helper.make_tensor_value_info("cond_out", T.BOOL, []),
         helper.make_tensor_value_info("acc_out", T.FLOAT, ["N", 6]),
         helper.make_tensor_value_info("sq", T.FLOAT, ["N", 6])])
    nodes = [
        helper.make_node("ReduceSum", ["x"], ["total"], keepdims=0),
        helper.make_node("Greater", ["total", "zero"], ["positive"]),
        helper.make_node("If", ["positive"], ["chosen"], then_branch=then, else_branch=other),
        helper.make_node("Loop", ["k", "true", "chosen"], ["acc", "squares"], body=body),
    ]
    g = helper.make_graph(
        nodes, "flow",
        [helper.make_tensor_value_info("x", T.FLOAT, ["N", 6]),
         helper.make_tensor_value_info("k", T.INT64, [])],
        [helper.make_tensor_value_info("acc", T.FLOAT, ["N", 6]),
         helper.make_tensor_value_info("squares", T.FLOAT, None)],
        [helper.make_tensor("w", T.FLOAT, [6], w), helper.make_tensor("zero", T.FLOAT, [], [0.0]),
         helper.make_tensor("true", T.BOOL, [], [True])])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]).SerializeToString()


def _conv_feeds(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"x": rng.standard_normal((n, 3, 12, 12)).astype(np.float32)} for n in (1, 2, 5, 16, 33)]


def _flow_feeds(rng: np.random.Generator) -> list[dict[str, np.ndarray]]:
    return [{"x": rng.standard_normal((n, 6)).astype(np.float32) + shift, "k": np.array(k, np.int64)}
            for n, shift, k in ((1, 0.5, 3), (4, -0.5, 1), (7, 0.0, 5), (2, 1.0, 4), (9, -1.0, 2))]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["conv", "flow"])
def test_shared_inference_session_runs_from_threads_match_onnxruntime(backend: str, case: str) -> None:
    model, feeds = ((_conv_model(), _conv_feeds(np.random.default_rng(0))) if case == "conv"
                    else (_if_loop_model(), _flow_feeds(np.random.default_rng(1))))
    want = [ort.InferenceSession(model, providers=["CPUExecutionProvider"]).run(None, f) for f in feeds]
    sess = _session(model, backend)
    wrong: list[tuple[int, int]] = []

    def work(i: int) -> None:
        order = np.random.default_rng(10 + i).integers(0, len(feeds), 150)
        for k in order:
            got = sess.run(None, feeds[k])
            if not all(g.shape == w.shape and np.allclose(g, w, rtol=1e-5, atol=1e-6)
                       for g, w in zip(got, want[k])):
                wrong.append((i, int(k)))

    assert in_threads(4, work) == []
    assert wrong == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_training_in_one_thread_leaves_inference_and_settings_of_others_alone(backend: str) -> None:
    from onnxtrain.engine.blas import _thread_count_functions

    model = mlp_model(din=8, dh=256).SerializeToString()
    data = batches(4, 64)
    lr = np.array([0.01], np.float32)

    def train() -> dict[str, np.ndarray]:
        s = onnxtrain.TrainingSession(model, params("AdamOptimizer"), backend_options(backend))
        for k in range(30):
            x, y = data[k % len(data)]
            s.run(["loss"], {"x": x, "y": y, "Learning_Rate": lr})
        return {n: np.array(v) for n, v in s.get_state().items()}

    alone = train()
    conv = _conv_model()
    feeds = _conv_feeds(np.random.default_rng(2))
    want = [ort.InferenceSession(conv, providers=["CPUExecutionProvider"]).run(None, f)[0] for f in feeds]
    inference = _session(conv, backend)
    blas = _thread_count_functions()
    count = blas[1]() if blas is not None else None
    np_state = np.geterr()
    seen: dict[str, set] = {"err": set(), "blas": set()}
    trained: dict[str, dict[str, np.ndarray]] = {}
    wrong: list[int] = []
    stop = threading.Event()

    def work(i: int) -> None:
        if i == 0:
            trained["state"] = train()
        elif i == 1:
            for k in range(200):
                if not np.allclose(inference.run(None, feeds[k % len(feeds)])[0], want[k % len(feeds)],
                                   rtol=1e-5, atol=1e-6):
                    wrong.append(k)
        else:  # user code: the settings it sees while onnxtrain runs in the other threads
            while not stop.is_set():
                seen["err"].add(tuple(sorted(np.geterr().items())))
                if blas is not None:
                    seen["blas"].add(blas[1]())

    watcher = threading.Thread(target=work, args=(2,))
    watcher.start()
    try:
        assert in_threads(2, work) == []
    finally:
        stop.set()
        watcher.join()
    assert wrong == []
    for name, value in alone.items():  # the same steps as alone, to the bit (same batches, same order)
        np.testing.assert_array_equal(trained["state"][name], value, err_msg=name)
    assert seen["err"] == {tuple(sorted(np_state.items()))}
    assert np.geterr() == np_state
    if blas is not None:
        assert seen["blas"] == {count} and blas[1]() == count


def test_sessions_of_two_models_in_two_threads() -> None:
    conv, flow = _conv_model(), _if_loop_model()
    cases = [(conv, _conv_feeds(np.random.default_rng(4))), (flow, _flow_feeds(np.random.default_rng(5)))]
    wants = [[ort.InferenceSession(m, providers=["CPUExecutionProvider"]).run(None, f) for f in fs]
             for m, fs in cases]
    wrong: list[int] = []

    def work(i: int) -> None:
        model, feeds = cases[i]
        sess = _session(model, "numpy")
        for k in range(150):
            got = sess.run(None, feeds[k % len(feeds)])
            want = wants[i][k % len(feeds)]
            if not all(np.allclose(g, w, rtol=1e-5, atol=1e-6) for g, w in zip(got, want)):
                wrong.append(i)

    assert in_threads(2, work) == []
    assert wrong == []


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_parameter_set_during_optimizer_steps_lands_between_whole_steps(tmp_path, backend: str) -> None:
    # state.parameters[name] = value copied into the weight while an Optimizer.step in another thread
    # updated it in place: on the onnxruntime backend 6-8 of 10 trials, on the numpy engine 0-5, ended with a
    # weight that no whole number of SGD steps from the value set gives (part of it stepped from the old
    # weight, part from the new)
    artifacts.generate_artifacts(mlp_model(din=512, dh=2048), requires_grad=["W1", "b1", "W2", "b2"],
                                 loss=None, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
    module = Module(os.path.join(tmp_path, "training_model.onnx"), state,
                    session_options=backend_options(backend))
    opt = Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)
    rng = np.random.default_rng(0)
    module(rng.standard_normal((32, 512)).astype(np.float32), rng.integers(0, 4, 32))
    grad = state.parameters["W1"].grad.copy()
    lr = np.float32(opt.get_learning_rate())
    zero = np.zeros_like(grad)
    whole_steps = [zero]  # the weight after k SGD steps from zero, in float32 as the step computes it
    for _ in range(40):
        whole_steps.append((whole_steps[-1] - lr * grad).astype(np.float32))
    torn = 0
    for _ in range(16):
        state.parameters["W1"] = zero

        def work(i: int) -> None:
            for _ in range(40):
                if i == 0:
                    opt.step()
                else:
                    state.parameters["W1"] = zero

        assert in_threads(2, work) == []
        w = state.parameters["W1"].data
        torn += not any(np.array_equal(w, s) for s in whole_steps)
    assert torn == 0


def test_setting_a_parameter_waits_for_a_running_step() -> None:
    from onnxtrain.checkpoint import Checkpoint

    state = CheckpointState(Checkpoint(trainable={"w": np.ones(3, np.float32)}))
    held, release, done = threading.Event(), threading.Event(), threading.Event()

    def hold() -> None:  # as a Module's training call or an Optimizer.step holds it
        with state._lock:
            held.set()
            release.wait(60)

    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert held.wait(60)
        with watched_lock(state, "_lock") as watched:  # (the setter waiting for the lock is seen, not timed)
            setter = threading.Thread(
                target=lambda: (state.parameters.__setitem__("w", np.zeros(3, np.float32)), done.set()))
            setter.start()
            assert first_set(watched.waiting, done), "the setter neither waited for the lock nor ended"
            assert not done.is_set(), "a parameter was written while a step held the state"
            release.set()
            setter.join(60)
    finally:
        release.set()
        holder.join()
    assert done.is_set()
    np.testing.assert_array_equal(state.parameters["w"].data, np.zeros(3, np.float32))


def _torch_grads(model, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The gradients of mlp_model's mean cross-entropy on one batch, by torch autograd."""
    import torch

    from tests.session.helpers import weights_of

    w = {k: torch.tensor(v, requires_grad=True) for k, v in weights_of(model).items()}
    h = torch.relu(torch.tensor(x) @ w["W1"].T + w["b1"])
    torch.nn.functional.cross_entropy(h @ w["W2"].T + w["b2"], torch.tensor(y)).backward()
    return {k: v.grad.numpy() for k, v in w.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_lazy_reset_grad_during_a_training_call_applies_to_the_next(tmp_path, backend: str) -> None:
    # lazy_reset_grad() from another thread while a training call ran was undone when that call ended (it
    # set the accumulate flag back): the next call added its gradients to the two before instead of
    # replacing them (W1's gradient off by the sum of two batches' gradients)
    pytest.importorskip("torch")
    model = mlp_model(din=8, dh=32)
    artifacts.generate_artifacts(model, requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
    module = Module(os.path.join(tmp_path, "training_model.onnx"), state,
                    session_options=backend_options(backend))
    data = batches(3, 16)
    module(*data[0])
    plan = module._train_plan  # the accumulating plan the second call runs
    inside, go = threading.Event(), threading.Event()
    run = plan.run

    def held_run(*args, **kwargs):
        inside.set()
        go.wait(60)
        return run(*args, **kwargs)

    plan.run = held_run
    try:
        call = threading.Thread(target=module, args=data[1])
        call.start()
        assert inside.wait(60)
        with watched_lock(state, "_lock") as watched:
            reset_done = threading.Event()
            reset = threading.Thread(target=lambda: (module.lazy_reset_grad(), reset_done.set()))
            reset.start()
            # the reset, asked for while the call runs, waits for the call's lock (or, taking none, is done)
            # before the call goes on: a fixed 0.2 s could pass before a loaded host had begun it
            assert first_set(watched.waiting, reset_done), "the reset neither waited for the lock nor ended"
            go.set()
            call.join(60)
            reset.join(60)
    finally:
        go.set()
        plan.run = run
    module(*data[2])  # after the reset: this batch's gradients alone
    want = _torch_grads(model, *data[2])
    for name in ("W1", "b1", "W2", "b2"):
        np.testing.assert_allclose(state.parameters[name].grad, want[name], rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_a_checkpoint_saved_while_an_optimizer_is_made_has_whole_moments(tmp_path) -> None:
    # an Optimizer made its moments in the state without its lock: a checkpoint saved meanwhile by another
    # thread held a parameter with none or one of AdamW's two moments (3 of 10 trials of a save loop), and
    # no Optimizer could be made over it once loaded ("moment 'momentum1' not found in the source optimizer
    # checkpoint states")
    artifacts.generate_artifacts(mlp_model(din=8, dh=32), requires_grad=["W1", "b1", "W2", "b2"], loss=None,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(os.path.join(tmp_path, "checkpoint"))
    module = Module(os.path.join(tmp_path, "training_model.onnx"), state)
    inside, saved = threading.Event(), threading.Event()

    class Slot(dict):  # a parameter's moments: after the first is made, a save in another thread may run
        def __setitem__(self, key, value) -> None:
            super().__setitem__(key, value)
            if not inside.is_set():
                inside.set()
                # the save in the other thread runs now, or waits for the state's lock (seen, not timed: a
                # fixed 0.5 s could pass before a loaded host had begun the save)
                assert first_set(saved, watched.waiting), "the save neither waited for the lock nor ended"

    class Moments(dict):
        def setdefault(self, key, default=None):
            return super().setdefault(key, Slot())

    state._optimizer_state().moments = Moments()
    path = str(tmp_path / "during.ckpt")

    def save() -> None:
        inside.wait(60)
        CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
        saved.set()

    with watched_lock(state, "_lock") as watched:
        saver = threading.Thread(target=save)
        saver.start()
        Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"), module)
        saver.join(60)
    assert inside.is_set() and saved.is_set()
    loaded = CheckpointState.load_checkpoint(path)
    moments = loaded._optimizer.moments
    assert sorted(moments) == ["W1", "W2", "b1", "b2"]
    for name, slot in moments.items():  # AdamW's moments before any step: zeros of the parameter's shape
        assert sorted(slot) == ["momentum0", "momentum1"]
        for m in slot.values():
            np.testing.assert_array_equal(m, np.zeros_like(state.parameters[name].data))
    Optimizer(os.path.join(tmp_path, "optimizer_model.onnx"),
              Module(os.path.join(tmp_path, "training_model.onnx"), loaded))
