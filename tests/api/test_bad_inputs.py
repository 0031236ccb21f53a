"""Bad input at the public entry points: every refusal names what is at fault, and nothing is taken silently.

A seeded table of bad feeds, options and files for ``InferenceSession.run``, the legacy ``TrainingSession``
(its ``TrainingParameters`` and ``run``), the on-device API (``CheckpointState``, ``Module``, ``Optimizer``,
``LinearLRScheduler``, ``generate_artifacts``, the C#-style ``TrainingSession``) and ``GradientGraphBuilder``.
Oracles: onnxruntime 1.32's ``InferenceSession`` refuses the same feeds with an exception of a class ours
is also an instance of; a refused training call leaves the weights as they were, so the next good step
equals one SGD step computed with torch autograd (float64) from the initial weights.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.capi import _pybind_state
from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer, TrainingSession
from tests.session.helpers import params

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")

RNG_SEED = 20261206
F = TensorProto.FLOAT


def _linear(loss: bool) -> onnx.ModelProto:
    """``y = x @ W + B`` (and with ``loss``, ``loss = mean((y - t)^2)``), seeded weights."""
    rng = np.random.default_rng(RNG_SEED)
    inits = [numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(rng.standard_normal(3).astype(np.float32), "B")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["m"]), helper.make_node("Add", ["m", "B"], ["y"])]
    inputs = [helper.make_tensor_value_info("x", F, ["N", 4])]
    outputs = [helper.make_tensor_value_info("y", F, ["N", 3])]
    if loss:
        nodes += [helper.make_node("Sub", ["y", "t"], ["d"]), helper.make_node("Mul", ["d", "d"], ["sq"]),
                  helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
        inputs.append(helper.make_tensor_value_info("t", F, ["N", 3]))
        outputs.insert(0, helper.make_tensor_value_info("loss", F, []))
    g = helper.make_graph(nodes, "linear", inputs, outputs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def _batch(seed: int, n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(RNG_SEED + seed)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


def _torch_sgd_step(w: np.ndarray, b: np.ndarray, x: np.ndarray, t: np.ndarray,
                    lr: float) -> tuple[np.ndarray, np.ndarray]:
    """One SGD step on ``mean((x @ w + b - t)^2)``, the gradient by torch autograd in float64."""
    tw = torch.tensor(w, dtype=torch.float64, requires_grad=True)
    tb = torch.tensor(b, dtype=torch.float64, requires_grad=True)
    x64, t64 = torch.tensor(x, dtype=torch.float64), torch.tensor(t, dtype=torch.float64)
    loss = ((x64 @ tw + tb - t64) ** 2).mean()
    loss.backward()
    return (tw - lr * tw.grad).detach().numpy(), (tb - lr * tb.grad).detach().numpy()


# ---------------------------------------------------------------- InferenceSession.run vs onnxruntime 1.32
def _inference_cases(rng: np.random.Generator) -> list[tuple[str, dict]]:
    """(label, feeds) that onnxruntime refuses, with sizes drawn from ``rng``."""
    n = int(rng.integers(1, 6))
    x, t = rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)
    wide = int(rng.integers(5, 9))
    return [
        ("x float64", {"x": x.astype(np.float64), "t": t}),
        ("x float16", {"x": x.astype(np.float16), "t": t}),
        ("x int32", {"x": x.astype(np.int32), "t": t}),
        ("x bool", {"x": x > 0, "t": t}),
        ("x object", {"x": x.astype(object), "t": t}),
        ("x str", {"x": np.full((n, 4), "a"), "t": t}),
        ("x rank 3", {"x": x[None], "t": t}),
        ("x rank 1", {"x": x[0], "t": t}),
        ("x 0-d", {"x": np.float32(1.0), "t": t}),
        ("x wide", {"x": np.ones((n, wide), np.float32), "t": t}),
        ("x ragged list", {"x": [[1.0] * 4, [1.0] * 3], "t": t}),
        ("x tuple", {"x": tuple(map(tuple, x.tolist())), "t": t}),
        ("t missing", {"x": x}),
        ("extra name", {"x": x, "t": t, "zzz": x}),
    ]


def _culprit(label: str) -> str:
    return {"t missing": "t", "extra name": "zzz"}.get(label, "x")


def test_inference_run_refuses_what_onnxruntime_refuses_naming_the_input():
    model = _linear(loss=True).SerializeToString()
    ours, theirs = onnxtrain.InferenceSession(model), ort.InferenceSession(model)
    for label, feeds in _inference_cases(np.random.default_rng(RNG_SEED)):
        with pytest.raises(Exception) as ref:
            theirs.run(None, feeds)
        with pytest.raises(Exception) as got:
            ours.run(None, feeds)
        # the same class as onnxruntime's (its InvalidArgument as onnxtrain's, which is a RuntimeError)
        want = getattr(_pybind_state, type(ref.value).__name__, type(ref.value))
        assert isinstance(got.value, want), (label, type(got.value), type(ref.value))
        assert repr(_culprit(label)) in str(got.value), (label, str(got.value))


def test_inference_run_bad_output_names_and_feed_containers():
    model = _linear(loss=True).SerializeToString()
    ours, theirs = onnxtrain.InferenceSession(model), ort.InferenceSession(model)
    x, t = _batch(0)
    for outs in (["zzz"], "loss", [1]):
        with pytest.raises(Exception) as ref:
            theirs.run(outs, {"x": x, "t": t})
        with pytest.raises(Exception) as got:
            ours.run(outs, {"x": x, "t": t})
        want = getattr(_pybind_state, type(ref.value).__name__, type(ref.value))
        assert isinstance(got.value, want), (outs, type(got.value), type(ref.value))
        assert ("zzz" if outs == ["zzz"] else "output") in str(got.value)
    for feeds in ([("x", x)], None):  # onnxruntime: AttributeError (no .keys)
        with pytest.raises(AttributeError):
            theirs.run(None, feeds)
        with pytest.raises(AttributeError):
            ours.run(None, feeds)


# ---------------------------------------------------------------- legacy TrainingSession
@pytest.mark.parametrize("options, error, named", [
    ({"training_optimizer_name": "Foo"}, ValueError, "Foo"),
    ({"loss_output_name": "nope"}, ValueError, "nope"),
    ({"loss_output_name": "x"}, ValueError, "'x'"),
    ({"loss_output_name": ""}, ValueError, "loss_output_name"),
    ({"weights_to_train": {"x"}}, ValueError, "'x'"),
    ({"gradient_accumulation_steps": 0}, ValueError, "gradient_accumulation_steps"),
    ({"gradient_accumulation_steps": -1}, ValueError, "gradient_accumulation_steps"),
    ({"world_size": 0}, ValueError, "world_size"),
    ({"data_parallel_size": 0}, ValueError, "data_parallel_size"),
    ({"deepspeed_zero_stage": 5}, NotImplementedError, "deepspeed_zero_stage"),
    ({"gradient_accumulation_mode": "Auto"}, ValueError, "gradient_accumulation_mode"),
    ({"lr_params_feed_name": ""}, ValueError, "lr_params_feed_name"),
    ({"lr_params_feed_name": "W"}, ValueError, "lr_params_feed_name"),
    ({"recompute_checkpoints": ["zzz"]}, ValueError, "zzz"),
    ({"use_mixed_precision": True, "mixed_precision_dtype": "int8"}, ValueError, "int8"),
    ({"training_optimizer_name": "AdamOptimizer", "optimizer_attributes_map": {"W": {"alpha": 2.0}, "B": {}}},
     ValueError, "alpha"),
    ({"training_optimizer_name": "AdamOptimizer",
      "optimizer_attributes_map": {"W": {"epsilon": -1.0}, "B": {}}}, ValueError, "epsilon"),
    ({"training_optimizer_name": "AdamOptimizer", "optimizer_attributes_map": {"B": {}}}, ValueError, "'W'"),
    ({"training_optimizer_name": "AdamOptimizer",
      "optimizer_int_attributes_map": {"W": {"weight_decay_mode": 9}, "B": {}}},
     ValueError, "weight_decay_mode"),
])
def test_training_session_construction_names_the_bad_option(tmp_path, options, error, named):
    path = str(tmp_path / "m.onnx")
    onnx.save(_linear(loss=True), path)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with pytest.raises(error, match=named) as e:
            onnxtrain.TrainingSession(path, params(**options))
    assert isinstance(e.value, RuntimeError)  # onnxruntime's binding raised RuntimeErrors (Fail)


@pytest.mark.parametrize("name, value, error", [
    ("gradient_accumulation_steps", "2", TypeError), ("gradient_accumulation_steps", 1.5, TypeError),
    ("enable_grad_norm_clip", "False", TypeError), ("loss_scale", "1", TypeError),
    ("weights_to_train", "W", TypeError), ("weights_to_train", {1}, TypeError),
    ("optimizer_attributes_map", {"W": {"alpha": "0.9"}}, TypeError),
    ("optimizer_int_attributes_map", {"W": {"do_bias_correction": 0.5}}, TypeError),
    ("immutable_weights", {"Div": [(1, "a")]}, TypeError), ("loss_output_name", 3, TypeError),
    ("no_such_option", 1, AttributeError),
])
def test_training_parameters_refuse_values_of_another_type_naming_the_option(name, value, error):
    with pytest.raises(error, match=name):
        setattr(onnxtrain.TrainingParameters(), name, value)


def test_training_session_run_refuses_bad_feeds_and_trains_nothing():
    """Each bad feed (drawn as for InferenceSession, plus the learning rate's) is refused naming the input,
    and the weights stay as they were: the next good run is one SGD step from the initial weights."""
    sess = onnxtrain.TrainingSession(_linear(loss=True).SerializeToString(), params())
    w0, b0 = (sess.get_state()[k].copy() for k in ("W", "B"))
    lr = np.array([0.1], np.float32)
    cases = [(label, {**feeds, "Learning_Rate": lr}) for label, feeds in
             _inference_cases(np.random.default_rng(RNG_SEED + 1)) if label not in ("x tuple", "x 0-d")]
    cases += [("lr float64", {"Learning_Rate": lr.astype(np.float64)}),
              ("lr [2]", {"Learning_Rate": np.array([0.1, 0.2], np.float32)}),
              ("lr [1, 1]", {"Learning_Rate": lr[None]}), ("lr missing", {})]
    x, t = _batch(1)
    for label, feeds in cases:
        feeds = {"x": x, "t": t, **feeds} if label.startswith("lr") else feeds
        if label == "lr missing":
            feeds.pop("Learning_Rate", None)
        with pytest.raises(RuntimeError) as e:  # onnxruntime's InvalidArgument / Fail
            sess.run(["loss"], feeds)
        culprit = "Learning_Rate" if label.startswith("lr") else _culprit(label)
        assert repr(culprit) in str(e.value), (label, str(e.value))
    for outs in (["zzz"], "loss", [1]):
        with pytest.raises((RuntimeError, TypeError)):
            sess.run(outs, {"x": x, "t": t, "Learning_Rate": lr})
    state = sess.get_state()
    np.testing.assert_array_equal(state["W"], w0)
    np.testing.assert_array_equal(state["B"], b0)
    sess.run(["loss"], {"x": x, "t": t, "Learning_Rate": lr})
    w1, b1 = _torch_sgd_step(w0, b0, x, t, 0.1)
    np.testing.assert_allclose(sess.get_state()["W"], w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(sess.get_state()["B"], b1, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- on-device API
@pytest.fixture
def sgd_artifacts(tmp_path):
    """generate_artifacts of the linear model (MSE loss, SGD) in tmp_path/art."""
    folder = tmp_path / "art"
    folder.mkdir()
    artifacts.generate_artifacts(_linear(loss=False), requires_grad=["W", "B"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=str(folder))
    files = {"checkpoint": "checkpoint", "training": "training_model.onnx", "eval": "eval_model.onnx",
             "optimizer": "optimizer_model.onnx"}
    return {k: str(folder / f) for k, f in files.items()}


def _bad_buffers(loss: str) -> list[tuple[str, list, type, str]]:
    """(label, output buffers, error class, text the message holds) for a train step whose one output is the
    float32 scalar ``loss``."""
    f32 = np.zeros((), np.float32)
    return [
        ("float16 buffer", [np.zeros((), np.float16)], TypeError, "float16"),
        ("float64 buffer", [np.zeros((), np.float64)], TypeError, "float64"),
        ("int32 buffer", [np.zeros((), np.int32)], TypeError, "int32"),
        ("list buffer", [[0.0]], TypeError, loss),
        ("read-only buffer", [np.broadcast_to(f32, ())], ValueError, loss),
        ("wrong shape", [np.zeros((2,), np.float32)], ValueError, loss),
        ("two buffers", [f32, f32.copy()], ValueError, "2 output buffer"),
        ("no buffer", [], ValueError, "0 output buffer"),
    ]


def test_training_session_output_buffers_are_checked_before_the_step(sgd_artifacts):
    """A pre-allocated output of another type, shape or count is refused naming the output, before the step
    (its gradients would otherwise be added to the next step's): the good step after the refusals is one
    SGD step from the initial weights (torch autograd)."""
    state = CheckpointState.load_checkpoint(sgd_artifacts["checkpoint"])
    art = sgd_artifacts
    sess = TrainingSession(state, art["training"], art["eval"], art["optimizer"])
    sess.set_learning_rate(0.1)
    w0, b0 = state.parameters["W"].data.copy(), state.parameters["B"].data.copy()
    loss_name = sess.output_names(True)[0]
    x, t = _batch(2)
    for label, buffers, error, text in _bad_buffers(loss_name):
        with pytest.raises(error) as e:
            sess.train_step([x, t], buffers)
        assert text in str(e.value), (label, str(e.value))
        assert isinstance(e.value, RuntimeError), label  # onnxruntime's Fail
    buf = np.full((), np.nan, np.float32)
    out = sess.train_step([x, t], [buf])
    assert out[0] is buf
    w1, b1 = _torch_sgd_step(w0, b0, x, t, 0.1)
    ref = float(np.mean((x.astype(np.float64) @ w0 + b0 - t) ** 2))
    np.testing.assert_allclose(buf, ref, rtol=1e-5)
    sess.optimizer_step()
    np.testing.assert_allclose(state.parameters["W"].data, w1, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state.parameters["B"].data, b1, rtol=1e-5, atol=1e-6)
    # the eval step's buffers are checked the same way
    for label, buffers, error, text in _bad_buffers(loss_name):
        with pytest.raises(error) as e:
            sess.eval_step([x, t], buffers)
        assert text in str(e.value), (label, str(e.value))


def test_a_property_of_bytes_that_are_no_utf8_is_refused_naming_it(sgd_artifacts):
    """onnxruntime-training stores such bytes and then fails to read them back (UnicodeDecodeError on every
    get, also after a save and load); refused when set instead, as a str with a lone surrogate is."""
    state = CheckpointState.load_checkpoint(sgd_artifacts["checkpoint"])
    with pytest.raises(UnicodeDecodeError):
        b"\xff\xfe".decode("utf-8")  # the oracle: no UTF-8 text
    with pytest.raises(TypeError, match="'note'.*UTF-8"):
        state.properties["note"] = b"\xff\xfe"
    assert "note" not in state.properties
    state.properties["note"] = b"ok"
    assert state.properties["note"] == "ok"


def test_on_device_refusals_name_the_argument(sgd_artifacts, tmp_path):
    art = sgd_artifacts
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(np.random.default_rng(RNG_SEED).bytes(64))
    with pytest.raises(FileNotFoundError, match="nope.ckpt"):
        CheckpointState.load_checkpoint(str(tmp_path / "nope.ckpt"))
    with pytest.raises(RuntimeError, match="garbage.ckpt"):
        CheckpointState.load_checkpoint(str(garbage))
    with pytest.raises(TypeError, match="checkpoint_uri"):
        CheckpointState.load_checkpoint(3)
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    for value in ([1, 2], None, np.array([1, 2]), {"a": 1}, 1 + 2j):
        with pytest.raises(TypeError, match="'p'"):
            state.properties["p"] = value
    with pytest.raises(TypeError, match="module"):
        Optimizer(art["optimizer"], "not a module")
    with pytest.raises(TypeError, match="state"):
        Module(art["training"], "checkpoint")
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        Module(str(tmp_path / "nope.onnx"), state)
    module = Module(art["training"], state, art["eval"])
    x, t = _batch(3)
    for args, named in (((x.astype(np.float64), t), "'x'"), ((x[None], t), "'x'"), ((x,), "2 input"),
                        ((x, t, t), "2 input"), ((np.float32(1), t), "'x'")):
        with pytest.raises(RuntimeError, match=named):
            module(*args)
    opt = Optimizer(art["optimizer"], module)
    for bad in ("a", np.array([0.1, 0.2])):
        with pytest.raises(TypeError, match="learning rate"):
            opt.set_learning_rate(bad)
    with pytest.raises(TypeError, match="warmup_step_count"):
        LinearLRScheduler(opt, "a", 10, 0.1)
    with pytest.raises(TypeError, match="optimizer"):
        LinearLRScheduler("opt", 1, 10, 0.1)
    model = _linear(loss=False)
    for kwargs, named in (({"requires_grad": ["W", "zzz"]}, "zzz"), ({"requires_grad": "W"}, "requires_grad"),
                          ({"requires_grad": ["W"], "loss": "MSELoss"}, "MSELoss"),
                          ({"requires_grad": ["W"], "optimizer": "AdamW"}, "AdamW"),
                          ({"requires_grad": ["W"], "frozen_params": ["W"]}, "W"),
                          ({"requires_grad": ["W"], "additional_output_names": ["zzz"]}, "zzz")):
        kwargs = {"loss": artifacts.LossType.MSELoss, "optimizer": artifacts.OptimType.SGD, **kwargs}
        with pytest.raises(Exception, match=named):
            artifacts.generate_artifacts(model, artifact_directory=str(tmp_path), **kwargs)


def test_gradient_graph_builder_refusals_name_the_argument():
    model = _linear(loss=True).SerializeToString()
    for ys, xs, loss, error, named in (({"loss"}, {"W", "zzz"}, "loss", RuntimeError, "zzz"),
                                       ({"zzz"}, {"W"}, "loss", RuntimeError, "zzz"),
                                       ({"loss"}, "W", "loss", TypeError, "x_node_arg_names"),
                                       ("loss", {"W"}, "loss", TypeError, "y_node_arg_names"),
                                       ({"loss"}, {"W"}, None, TypeError, "loss_node_arg_name"),
                                       (set(), {"W"}, "loss", RuntimeError, "y_node_arg_names")):
        with pytest.raises(error, match=named):
            onnxtrain.GradientGraphBuilder(model, ys, xs, loss).build()
    with pytest.raises(RuntimeError, match="parse"):
        onnxtrain.GradientGraphBuilder(b"garbage", {"loss"}, {"W"}, "loss")
