"""onnxtrain.training.api on hand-built artifacts (the graph interface of training/artifacts.py, by hand).

Model: ``y = (x @ W + b) * s`` with ``W``, ``b`` trainable and ``s`` frozen; loss ``mean((y - target)^2)``;
the training and eval models also output ``y``. The gradient graph is written out by hand, so these
tests check the runtime (state, accumulation, optimizer wiring, scheduler, export, misuse) on their own.
"""

from __future__ import annotations

import os
import re
import threading

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.checkpoint import Checkpoint, load_checkpoint, save_checkpoint
from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer, TrainingSession
from onnxtrain.training.api.checkpoint_state import LEARNING_RATE_PROPERTY
from tests.lock_watch import first_set, watched_lock

F = TensorProto.FLOAT
TRAINABLE = ("W", "b")
SHAPES = {"W": [4, 3], "b": [3], "s": [3]}
BETAS, EPS, WD = (0.9, 0.999), 1e-6, 0.01


def _vi(name: str, dims: list, elem: int = F) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, elem, dims)


def _model(nodes: list, inputs: list, outputs: list, inits: list | None = None,
           meta: dict | None = None) -> onnx.ModelProto:
    g = helper.make_graph(nodes, "g", inputs, outputs, inits or [])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    for k, v in (meta or {}).items():
        m.metadata_props.add(key=k, value=v)
    onnx.checker.check_model(m, full_check=True)
    return m


def _forward_nodes() -> list:
    return [helper.make_node("MatMul", ["x", "W"], ["xw"]), helper.make_node("Add", ["xw", "b"], ["z"]),
            helper.make_node("Mul", ["z", "s"], ["y"]), helper.make_node("Sub", ["y", "target"], ["d"]),
            helper.make_node("Mul", ["d", "d"], ["d2"]),
            helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]


def _io_inputs() -> list:
    return [_vi("x", ["batch", 4]), _vi("target", ["batch", 3])] + [_vi(p, SHAPES[p]) for p in SHAPES]


def training_model() -> onnx.ModelProto:
    nodes = _forward_nodes() + [
        helper.make_node("Size", ["d"], ["n_i"]), helper.make_node("Cast", ["n_i"], ["n"], to=F),
        helper.make_node("Constant", [], ["two"], value=numpy_helper.from_array(np.array(2.0, np.float32))),
        helper.make_node("Mul", ["d", "two"], ["d_2"]), helper.make_node("Div", ["d_2", "n"], ["dy"]),
        helper.make_node("Mul", ["dy", "s"], ["dz"]), helper.make_node("Transpose", ["x"], ["xt"]),
        helper.make_node("MatMul", ["xt", "dz"], ["W_grad"]),
        helper.make_node("Constant", [], ["ax0"], value=numpy_helper.from_array(np.array([0], np.int64))),
        helper.make_node("ReduceSum", ["dz", "ax0"], ["b_grad"], keepdims=0)]
    for p in TRAINABLE:
        nodes += [helper.make_node("Add", [f"{p}_grad.accumulation.buffer", f"{p}_grad"], [f"{p}_acc"]),
                  helper.make_node("Where", ["lazy_reset_grad", f"{p}_grad", f"{p}_acc"],
                                   [f"{p}_grad.accumulation.out"])]
    inputs = _io_inputs() + [_vi(f"{p}_grad.accumulation.buffer", SHAPES[p]) for p in TRAINABLE]
    inputs.append(_vi("lazy_reset_grad", [1], TensorProto.BOOL))
    outputs = [_vi("loss", []), _vi("y", ["batch", 3])] + [_vi(f"{p}_grad.accumulation.out", SHAPES[p])
                                                           for p in TRAINABLE]
    return _model(nodes, inputs, outputs)


def eval_model() -> onnx.ModelProto:
    return _model(_forward_nodes(), _io_inputs(), [_vi("loss", []), _vi("y", ["batch", 3])])


def _optimizer_inputs(moments: list[str]) -> list:
    inputs = [_vi("learning_rate", [1]), _vi("step", [1], TensorProto.INT64)]
    for suffix in ["", "_grad"] + ["." + m for m in moments]:
        inputs += [_vi(p + suffix, SHAPES[p]) for p in TRAINABLE]
    return inputs


def sgd_model() -> onnx.ModelProto:
    nodes, outs = [], []
    for p in TRAINABLE:
        nodes += [helper.make_node("Mul", ["learning_rate", f"{p}_grad"], [f"{p}_upd"]),
                  helper.make_node("Sub", [p, f"{p}_upd"], [f"{p}.out"])]
        outs.append(_vi(f"{p}.out", SHAPES[p]))
    return _model(nodes, _optimizer_inputs(["momentum0"]), outs, meta={"onnxtrain.optimizer": "SGD"})


def adamw_model() -> onnx.ModelProto:
    b1, b2 = BETAS
    c = {"b1": b1, "b2": b2, "nb1": 1 - b1, "nb2": 1 - b2, "eps": EPS, "wd": WD, "one": 1.0}
    inits = [numpy_helper.from_array(np.array([v], np.float32), k) for k, v in c.items()]
    nodes = [helper.make_node("Cast", ["step"], ["t"], to=F),
             helper.make_node("Pow", ["b1", "t"], ["b1t"]), helper.make_node("Pow", ["b2", "t"], ["b2t"]),
             helper.make_node("Sub", ["one", "b1t"], ["c1"]), helper.make_node("Sub", ["one", "b2t"], ["c2"]),
             helper.make_node("Sqrt", ["c2"], ["sc2"]),
             helper.make_node("Mul", ["learning_rate", "sc2"], ["lr_a"]),
             helper.make_node("Div", ["lr_a", "c1"], ["lr_t"]),
             helper.make_node("Mul", ["learning_rate", "wd"], ["lr_wd"])]
    for p in TRAINABLE:
        g, m, v = f"{p}_grad", f"{p}.momentum0", f"{p}.momentum1"
        nodes += [helper.make_node("Mul", ["b1", m], [f"{p}_m1"]),
                  helper.make_node("Mul", ["nb1", g], [f"{p}_m2"]),
                  helper.make_node("Add", [f"{p}_m1", f"{p}_m2"], [f"{m}.out"]),
                  helper.make_node("Mul", ["b2", v], [f"{p}_v1"]),
                  helper.make_node("Mul", [g, g], [f"{p}_gg"]),
                  helper.make_node("Mul", ["nb2", f"{p}_gg"], [f"{p}_v2"]),
                  helper.make_node("Add", [f"{p}_v1", f"{p}_v2"], [f"{v}.out"]),
                  helper.make_node("Sqrt", [f"{v}.out"], [f"{p}_sv"]),
                  helper.make_node("Add", [f"{p}_sv", "eps"], [f"{p}_den"]),
                  helper.make_node("Div", [f"{m}.out", f"{p}_den"], [f"{p}_r"]),
                  helper.make_node("Mul", ["lr_t", f"{p}_r"], [f"{p}_u"]),
                  helper.make_node("Sub", [p, f"{p}_u"], [f"{p}_p1"]),
                  helper.make_node("Mul", ["lr_wd", f"{p}_p1"], [f"{p}_dec"]),
                  helper.make_node("Sub", [f"{p}_p1", f"{p}_dec"], [f"{p}.out"])]
    suffixes = (".out", ".momentum0.out", ".momentum1.out")
    outs = [_vi(p + suffix, SHAPES[p]) for suffix in suffixes for p in TRAINABLE]
    return _model(nodes, _optimizer_inputs(["momentum0", "momentum1"]), outs, inits,
                  meta={"onnxtrain.optimizer": "AdamW"})


def initial_params() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {"W": rng.standard_normal((4, 3)).astype(np.float32),
            "b": rng.standard_normal(3).astype(np.float32),
            "s": np.array([1.0, 0.5, 2.0], np.float32)}


def batch(seed: int = 0, n: int = 5) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(100 + seed)
    return rng.standard_normal((n, 4)).astype(np.float32), rng.standard_normal((n, 3)).astype(np.float32)


@pytest.fixture
def art(tmp_path):
    """Paths of hand-built artifacts: training, eval, sgd, adamw models, checkpoint and nominal checkpoint."""
    paths = {k: str(tmp_path / f"{k}.onnx") for k in ("training", "eval", "sgd", "adamw")}
    builders = {"training": training_model, "eval": eval_model, "sgd": sgd_model, "adamw": adamw_model}
    for k, fn in builders.items():
        onnx.save(fn(), paths[k])
    p = initial_params()
    paths["checkpoint"] = str(tmp_path / "checkpoint")
    save_checkpoint(Checkpoint({"W": p["W"], "b": p["b"]}, {"s": p["s"]}), paths["checkpoint"])
    paths["nominal"] = str(tmp_path / "nominal_checkpoint")
    save_checkpoint(Checkpoint({"W": p["W"], "b": p["b"]}, {"s": p["s"]}, nominal=True), paths["nominal"])
    paths["dir"] = str(tmp_path)
    return paths


def numpy_grads(params: dict[str, np.ndarray], x: np.ndarray, t: np.ndarray) -> dict[str, np.ndarray]:
    y = (x @ params["W"] + params["b"]) * params["s"]
    dz = 2 * (y - t) / y.size * params["s"]
    return {"W": x.T @ dz, "b": dz.sum(0)}


def setup(art, optimizer: str | None = "sgd", eval_: bool = True):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    module = Module(art["training"], state, art["eval"] if eval_ else None)
    opt = Optimizer(art[optimizer], module) if optimizer else None
    return state, module, opt


# ---------------------------------------------------------------- CheckpointState
def test_parameters_view(art):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    p0 = initial_params()
    assert len(state.parameters) == 3 and "W" in state.parameters and "nope" not in state.parameters
    assert [n for n, _ in state.parameters] == ["W", "b", "s"]
    w = state.parameters["W"]
    assert w.name == "W" and w.requires_grad and not state.parameters["s"].requires_grad
    assert repr(w) == "Parameter(name=W, requires_grad=True)"
    np.testing.assert_array_equal(w.data, p0["W"])
    assert w.grad is None  # no Module yet
    w.data[0, 0] = 99.0  # .data aliases the live array
    assert state.parameters["W"].data[0, 0] == 99.0
    with pytest.raises(KeyError, match="Parameter nope not found"):
        state.parameters["nope"]
    with pytest.raises(AttributeError):
        w.grad = np.zeros((4, 3), np.float32)
    assert isinstance(repr(state.parameters), str) and isinstance(repr(state), str)


def test_edit_parameters_before_module(art, tmp_path):
    """The reference segfaults here (spec §2.3); editing before a Module exists is allowed."""
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    state.parameters["b"] = np.array([1, 2, 3], np.float32)
    state.parameters["s"].data = np.full(3, 2.0, np.float32)
    with pytest.raises(ValueError, match="shape mismatch"):
        state.parameters["b"] = np.zeros(4, np.float32)
    with pytest.raises(TypeError, match="type mismatch"):
        state.parameters["b"] = np.zeros(3, np.float64)
    with pytest.raises(KeyError):
        state.parameters["nope"] = np.zeros(3, np.float32)
    module = Module(art["training"], state, art["eval"])
    module.eval()
    x, t = batch()
    p = {**initial_params(), "b": np.array([1, 2, 3], np.float32), "s": np.full(3, 2.0, np.float32)}
    y = (x @ p["W"] + p["b"]) * p["s"]
    np.testing.assert_allclose(module(x, t)[1], y, rtol=1e-6)
    CheckpointState.save_checkpoint(state, tmp_path / "edited")
    again = CheckpointState.load_checkpoint(tmp_path / "edited")
    np.testing.assert_array_equal(again.parameters["b"].data, p["b"])


def test_properties(art, tmp_path):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    props = state.properties
    props["epoch"] = 2**40
    props["pi"] = 3.141592653589793
    props["name"] = "run-1"
    props["flag"] = True
    props["raw"] = b"bytes"
    props["np_float"] = np.float32(1.5)  # the reference truncates this to int 1; we keep a float
    props["np_int"] = np.int64(7)
    # a 0-d array, such as the loss a Module call returns, is its scalar (the reference truncates 0.75 to 0)
    props["last_loss"] = np.array(0.75, np.float32)
    props["count"] = np.array(3, np.int32)
    assert props["pi"] == float(np.float32(np.pi)) and props["flag"] == 1 and props["raw"] == "bytes"
    assert props["np_float"] == 1.5 and isinstance(props["np_int"], int)
    assert props["last_loss"] == 0.75 and isinstance(props["last_loss"], float)
    assert props["count"] == 3 and isinstance(props["count"], int)
    props["name"] = 5  # type may change
    assert "epoch" in props and len(props) == 9
    assert [k for k, _ in props] == sorted(k for k, _ in props)
    with pytest.raises(KeyError, match="Property missing not found"):
        props["missing"]
    for bad in (None, [1, 2], {"a": 1}, np.array([1.0]), np.array("text")):
        with pytest.raises(TypeError):
            props["bad"] = bad
    with pytest.raises(ValueError, match="reserved"):
        props[LEARNING_RATE_PROPERTY] = 0.1
    CheckpointState.save_checkpoint(state, tmp_path / "props")
    again = CheckpointState.load_checkpoint(tmp_path / "props")
    assert dict(again.properties) == dict(props)


def test_checkpoint_files_misuse(art, tmp_path):
    with pytest.raises(TypeError, match="Invalid argument for CheckpointState"):
        CheckpointState(None)
    with pytest.raises(FileNotFoundError):
        CheckpointState.load_checkpoint(tmp_path / "missing")
    with pytest.raises(IsADirectoryError):
        CheckpointState.load_checkpoint(tmp_path)
    with pytest.raises(ValueError):
        CheckpointState.load_checkpoint(art["training"])  # an ONNX file, not a checkpoint
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    with pytest.raises(FileNotFoundError):
        CheckpointState.save_checkpoint(state, tmp_path / "no" / "dir" / "ckpt")
    with pytest.raises(IsADirectoryError):
        CheckpointState.save_checkpoint(state, tmp_path)
    with pytest.raises(TypeError):
        CheckpointState.save_checkpoint("not a state", tmp_path / "x")


# ---------------------------------------------------------------- Module
def test_module_train_gradients_and_accumulation(art):
    state, module, _ = setup(art, None)
    assert module.training
    assert module.input_names() == ["x", "target"] and module.output_names() == ["loss", "y"]
    for p in TRAINABLE:
        np.testing.assert_array_equal(state.parameters[p].grad, 0)
    assert state.parameters["s"].grad is None
    x, t = batch()
    loss, y = module(x, t)
    assert loss.shape == () and loss.dtype == np.float32
    g = numpy_grads(initial_params(), x, t)
    for p in TRAINABLE:
        np.testing.assert_allclose(state.parameters[p].grad, g[p], rtol=1e-5, atol=1e-7)
    module(x, t)  # no reset: accumulates
    for p in TRAINABLE:
        np.testing.assert_allclose(state.parameters[p].grad, 2 * g[p], rtol=1e-5, atol=1e-7)
    module.lazy_reset_grad()
    module.lazy_reset_grad()  # twice is once
    np.testing.assert_allclose(state.parameters["b"].grad, 2 * g["b"], rtol=1e-5)  # still readable
    x2, t2 = batch(1)
    module(x2, t2)  # overwrites
    g2 = numpy_grads(initial_params(), x2, t2)
    np.testing.assert_allclose(state.parameters["b"].grad, g2["b"], rtol=1e-5, atol=1e-7)
    before = state.parameters["b"].grad.copy()
    assert module.eval() is module and not module.training
    assert module.input_names() == ["x", "target"] and module.output_names() == ["loss", "y"]
    e1, e2 = module(x, t)[0], module(x, t)[0]
    assert e1 == e2
    np.testing.assert_array_equal(state.parameters["b"].grad, before)  # eval leaves gradients alone
    assert module.train() is module and module.training


def test_module_accepts_lists_and_ortvalues(art):
    from onnxtrain import OrtValue

    _, module, _ = setup(art, None)
    x, t = batch()
    ref = module(x, t)[0]
    module.lazy_reset_grad()
    assert module(x.tolist(), OrtValue.ortvalue_from_numpy(t))[0] == ref
    module.lazy_reset_grad()
    assert module(np.asfortranarray(x), t)[0] == ref


def test_module_returns_ortvalues_of_the_inputs_class_when_every_input_is_one(art):
    """onnxruntime-training's Module returns OrtValues when all inputs are OrtValues (numpy otherwise), in
    train and eval mode; the values are those of the numpy call."""
    import onnxruntime

    from onnxtrain import OrtValue

    _, module, _ = setup(art, None)
    x, t = batch()
    ref = module(x, t)
    for cls in (OrtValue, onnxruntime.OrtValue):
        for mode in (module.train, module.eval):
            mode()
            want = module(x, t)
            module.lazy_reset_grad()
            got = module(cls.ortvalue_from_numpy(x), cls.ortvalue_from_numpy(t))
            module.lazy_reset_grad()
            assert isinstance(got, tuple) and len(got) == len(ref)
            assert all(type(v) is cls for v in got)
            for a, b in zip(got, want):
                np.testing.assert_array_equal(a.numpy(), b)
    module.train()
    mixed = module(OrtValue.ortvalue_from_numpy(x), t)  # one numpy input: numpy out
    assert all(isinstance(v, np.ndarray) for v in mixed)


def test_module_input_misuse(art):
    _, module, _ = setup(art, None)
    x, t = batch()
    with pytest.raises(ValueError, match=r"expects 2 input\(s\) \['x', 'target'\], got 1"):
        module(x)
    with pytest.raises(ValueError, match="got 3"):
        module(x, t, t)
    with pytest.raises(TypeError, match="'x'.*float64.*float32"):
        module(x.astype(np.float64), t)
    with pytest.raises(TypeError, match="'x'.*int64"):
        module(x.astype(np.int64), t)
    with pytest.raises(ValueError, match="'x': invalid dimension at index 1. Got: 7, Expected: 4"):
        module(np.zeros((5, 7), np.float32), t)
    with pytest.raises(ValueError, match="'x': invalid rank. Got: 3"):
        module(np.zeros((5, 4, 1), np.float32), t)
    module.eval()
    with pytest.raises(ValueError, match="'target': invalid dimension"):
        module(x, np.zeros((5, 2), np.float32))


def test_eval_without_eval_model_raises(art):
    """The reference segfaults (spec §3.2)."""
    _, module, _ = setup(art, None, eval_=False)
    module.eval()
    assert module.input_names() == [] and module.output_names() == []
    with pytest.raises(RuntimeError, match="Evaluation session not initialized"):
        module(*batch())
    with pytest.raises(RuntimeError, match="Eval model was not provided"):
        module.export_model_for_inferencing(os.path.join(art["dir"], "inf.onnx"), ["y"])


def test_module_construction_misuse(art, tmp_path):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        Module(str(tmp_path / "nope.onnx"), state)
    with pytest.raises(FileNotFoundError, match="nope_eval.onnx"):
        Module(art["training"], state, str(tmp_path / "nope_eval.onnx"))
    with pytest.raises(ValueError, match="Unsupported device"):
        Module(art["training"], state, device="cuda")
    with pytest.raises(TypeError):
        Module(art["training"], "not a state")
    (tmp_path / "garbage.onnx").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid ONNX model"):
        Module(str(tmp_path / "garbage.onnx"), state)
    with pytest.raises(ValueError, match="ORT-format"):
        Module(str(tmp_path / "model.ort"), state)
    assert Module(art["training"], state, device="cpu:0").training


def test_contiguous_parameters(art):
    from onnxtrain import OrtValue

    state, module, _ = setup(art, None)
    p0 = initial_params()
    assert module.get_parameters_size() == 15 and module.get_parameters_size(False) == 18
    full = module.get_contiguous_parameters()  # default trainable_only=False (the defaults differ)
    assert full.shape == (18,) and full.dtype == np.float32
    np.testing.assert_array_equal(full.numpy(), np.concatenate([p0[n].ravel() for n in ("W", "b", "s")]))
    train = module.get_contiguous_parameters(trainable_only=True)
    np.testing.assert_array_equal(train, np.concatenate([p0["W"].ravel(), p0["b"]]))
    module.copy_buffer_to_parameters(np.arange(15, dtype=np.float32))
    np.testing.assert_array_equal(state.parameters["W"].data, np.arange(12).reshape(4, 3))
    np.testing.assert_array_equal(state.parameters["s"].data, p0["s"])
    module.copy_buffer_to_parameters(OrtValue.ortvalue_from_numpy(np.ones((1, 18), np.float32)), False)
    np.testing.assert_array_equal(state.parameters["s"].data, 1)
    with pytest.raises(ValueError, match="Expected: 15, Actual: 16"):
        module.copy_buffer_to_parameters(np.zeros(16, np.float32))
    with pytest.raises(TypeError, match="type mismatch"):
        module.copy_buffer_to_parameters(np.zeros(15, np.float64))
    with pytest.raises(TypeError):
        module.copy_buffer_to_parameters([0.0] * 15)


def test_nominal_checkpoint(art, tmp_path):
    """Each refusal is a RuntimeError (as onnxruntime-training's) and a ValueError (as onnxtrain's were),
    whose message holds the substring onnxruntime-training's tests match."""
    state = CheckpointState.load_checkpoint(art["nominal"])
    assert state.is_nominal and len(state.parameters) == 3 and "W" in state.parameters
    assert "Parameter(name=W" in repr(state.parameters)
    get = "Please load the parameter states first"
    with pytest.raises(RuntimeError, match=get):
        state.parameters["W"]
    with pytest.raises(RuntimeError, match=get):
        list(state.parameters)
    with pytest.raises(ValueError, match="Please load all the parameter states first"):
        state.parameters["b"] = np.zeros(3, np.float32)
    module = Module(art["training"], state, art["eval"])
    opt = Optimizer(art["sgd"], module)  # allowed before the parameters are loaded
    assert module.get_parameters_size() == 15 and module.get_parameters_size(False) == 18
    x, t = batch()
    load = re.escape("Please load the model parameters first.")
    with pytest.raises(RuntimeError, match="Cannot perform TrainStep with a nominal state. " + load):
        module(x, t)
    with pytest.raises(RuntimeError, match="Cannot perform EvalStep with a nominal state. " + load):
        module.eval()(x, t)
    module.train()
    with pytest.raises(RuntimeError, match="Cannot copy parameters from a nominal checkpoint state. " + load):
        module.get_contiguous_parameters()
    with pytest.raises(ValueError, match=re.escape("all parameters need to be loaded into the model "
                                                   "(trainable_only = false)")):
        module.copy_buffer_to_parameters(np.zeros(15, np.float32))
    with pytest.raises(RuntimeError, match="Cannot export the model with a nominal state. " + load):
        module.export_model_for_inferencing(tmp_path / "inf.onnx", ["y"])
    with pytest.raises(ValueError, match=load):
        opt.step()
    full_state, full_module, _ = setup(art, None)
    module.copy_buffer_to_parameters(full_module.get_contiguous_parameters(), trainable_only=False)
    assert not state.is_nominal
    for _, p in state.parameters:  # plain arrays, not views of the ContiguousBuffer subclass
        assert type(p.data) is np.ndarray and (p.grad is None or type(p.grad) is np.ndarray)
    assert module(x, t)[0] == full_module(x, t)[0]
    opt.step()
    CheckpointState.save_checkpoint(state, tmp_path / "complete")
    assert not load_checkpoint(tmp_path / "complete").nominal


# ---------------------------------------------------------------- Optimizer
def test_sgd_step_and_gradients_kept(art):
    state, module, opt = setup(art, "sgd")
    assert opt.get_learning_rate() == float(np.float32(0.001))  # 0.0010000000474974513, as the reference
    opt.set_learning_rate(0.1)
    assert opt.get_learning_rate() == float(np.float32(0.1))
    opt.step()  # before any train call: zero gradients, nothing moves
    np.testing.assert_array_equal(state.parameters["W"].data, initial_params()["W"])
    x, t = batch()
    module(x, t)
    grads = {p: state.parameters[p].grad.copy() for p in TRAINABLE}
    before = {p: state.parameters[p].data.copy() for p in TRAINABLE}
    opt.step()
    for p in TRAINABLE:
        np.testing.assert_array_equal(state.parameters[p].grad, grads[p])  # step never clears gradients
        np.testing.assert_array_equal(state.parameters[p].data, before[p] - np.float32(0.1) * grads[p])
    np.testing.assert_array_equal(state.parameters["s"].data, initial_params()["s"])
    assert opt.step_count == 2
    opt.set_learning_rate(-1)  # negative and int accepted
    with pytest.raises(TypeError):
        opt.set_learning_rate("0.1")


def test_modules_over_one_state_share_its_gradients(art):
    """A second Module over a trained state leaves the gradients as they are: the first Module's Optimizer
    still steps with them (zeroing them in place made that step nothing); after lazy_reset_grad() the new
    Module's first training call overwrites them. onnxruntime-training gives each Module buffers of its own
    (README)."""
    state, module, opt = setup(art, "sgd")
    opt.set_learning_rate(0.1)
    module(*batch())
    grads = {p: state.parameters[p].grad.copy() for p in TRAINABLE}
    assert np.abs(grads["W"]).max() > 0
    second = Module(art["training"], state, art["eval"])
    before = {p: state.parameters[p].data.copy() for p in TRAINABLE}
    opt.step()  # the first Module's Optimizer, after the second Module was built
    for p in TRAINABLE:
        np.testing.assert_array_equal(state.parameters[p].data, before[p] - np.float32(0.1) * grads[p])
    second.lazy_reset_grad()  # the second Module's first training call then overwrites the gradients
    after = {p: state.parameters[p].data.copy() for p in TRAINABLE}
    x, t = batch(1)
    second(x, t)
    for p, g in numpy_grads({**after, "s": initial_params()["s"]}, x, t).items():
        np.testing.assert_allclose(state.parameters[p].grad, g, rtol=1e-5, atol=1e-6)


def test_optimizer_misuse(art, tmp_path):
    state, module, _ = setup(art, None)
    with pytest.raises(FileNotFoundError, match="nope_opt.onnx"):
        Optimizer(str(tmp_path / "nope_opt.onnx"), module)
    with pytest.raises(ValueError, match="not an optimizer model"):
        Optimizer(art["training"], module)
    with pytest.raises(TypeError):
        Optimizer(art["sgd"], "module")


def test_adamw_matches_float64_reference(art):
    state, module, opt = setup(art, "adamw")
    opt.set_learning_rate(0.05)
    lr = float(np.float32(0.05))
    b1, b2 = BETAS
    p = {k: v.astype(np.float64) for k, v in initial_params().items()}
    m = {k: np.zeros_like(p[k]) for k in TRAINABLE}
    v = {k: np.zeros_like(p[k]) for k in TRAINABLE}
    for step in range(1, 6):
        x, t = batch(step)
        module(x, t)
        grads = {k: state.parameters[k].grad.astype(np.float64) for k in TRAINABLE}
        opt.step()
        module.lazy_reset_grad()
        for k in TRAINABLE:
            m[k] = b1 * m[k] + (1 - b1) * grads[k]
            v[k] = b2 * v[k] + (1 - b2) * grads[k] ** 2
            lr_t = lr * np.sqrt(1 - b2**step) / (1 - b1**step)
            p[k] = p[k] - lr_t * m[k] / (np.sqrt(v[k]) + EPS)
            p[k] = p[k] - lr * WD * p[k]
            np.testing.assert_allclose(state.parameters[k].data, p[k], atol=1e-6)
            p[k] = state.parameters[k].data.astype(np.float64)  # follow the float32 trajectory


def _run(module, opt, steps: range) -> list[float]:
    losses = []
    for i in steps:
        losses.append(float(module(*batch(i))[0]))
        opt.step()
        module.lazy_reset_grad()
    return losses


def test_a_learning_rate_saved_at_another_step_is_not_used(art, tmp_path):
    """onnxruntime-training keeps onnxtrain's learning-rate property when it trains on a file and saves it
    again: the rate then belongs to an older step, and onnxruntime's default is used, as there."""
    state, module, opt = setup(art, "adamw")
    opt.set_learning_rate(0.03)
    _run(module, opt, range(2))
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)
    assert Optimizer(art["adamw"], Module(art["training"], CheckpointState.load_checkpoint(
        tmp_path / "ckpt"))).get_learning_rate() == float(np.float32(0.03))
    raw = load_checkpoint(tmp_path / "ckpt")
    raw.optimizer_groups[0].step += 5  # trained further elsewhere, the property left as it was
    save_checkpoint(raw, tmp_path / "later")
    later = CheckpointState.load_checkpoint(tmp_path / "later")
    opt2 = Optimizer(art["adamw"], Module(art["training"], later))
    assert opt2.get_learning_rate() == float(np.float32(0.001)) and opt2.step_count == 7
    # trained elsewhere from a fresh optimizer for as many steps (onnxruntime-training, saving every N steps):
    # the same step, other parameters
    raw.optimizer_groups[0].step -= 5
    raw.trainable["W"] = raw.trainable["W"] + np.float32(0.5)
    save_checkpoint(raw, tmp_path / "same_step")
    same_step = CheckpointState.load_checkpoint(tmp_path / "same_step")
    opt4 = Optimizer(art["adamw"], Module(art["training"], same_step))
    assert opt4.get_learning_rate() == float(np.float32(0.001)) and opt4.step_count == 2
    rate, _, _ = raw.properties[LEARNING_RATE_PROPERTY].partition("#")
    raw.properties[LEARNING_RATE_PROPERTY] = rate  # an onnxtrain before the checksum was recorded: step only
    save_checkpoint(raw, tmp_path / "undigested")
    undigested = CheckpointState.load_checkpoint(tmp_path / "undigested")
    assert Optimizer(art["adamw"], Module(art["training"], undigested)).get_learning_rate() == float(
        np.float32(0.03))
    raw.properties[LEARNING_RATE_PROPERTY] = 0.02  # an onnxtrain before the step was recorded: a number
    save_checkpoint(raw, tmp_path / "older")
    older = CheckpointState.load_checkpoint(tmp_path / "older")
    opt3 = Optimizer(art["adamw"], Module(art["training"], older))
    assert opt3.get_learning_rate() == float(np.float32(0.02))


@pytest.mark.parametrize("value", [3, "nan@2", "inf", "abc", float("nan")])
def test_a_learning_rate_property_onnxtrain_did_not_write_is_ignored(art, tmp_path, value):
    """A property of that name that is not a finite rate (an int, NaN, text; onnxruntime-training lets a
    user set it) was taken as the rate: a first step of lr 3, or NaN weights; now the default, with a
    warning."""
    state, module, opt = setup(art, "adamw")
    _run(module, opt, range(2))
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=True)
    raw = load_checkpoint(tmp_path / "ckpt")
    raw.properties[LEARNING_RATE_PROPERTY] = value
    save_checkpoint(raw, tmp_path / "odd")
    with pytest.warns(UserWarning, match="not a learning rate onnxtrain wrote"):
        odd = CheckpointState.load_checkpoint(tmp_path / "odd")
    opt2 = Optimizer(art["adamw"], Module(art["training"], odd))
    assert opt2.get_learning_rate() == float(np.float32(0.001))


@pytest.mark.parametrize("include", [True, False])
def test_resume_with_and_without_optimizer_state(art, tmp_path, include):
    state, module, opt = setup(art, "adamw")
    opt.set_learning_rate(0.02)
    state.properties["epoch"] = 3
    _run(module, opt, range(3))
    CheckpointState.save_checkpoint(state, tmp_path / "ckpt", include_optimizer_state=include)
    uninterrupted = _run(module, opt, range(3, 6))
    final = {p: state.parameters[p].data.copy() for p in TRAINABLE}

    state2 = CheckpointState.load_checkpoint(tmp_path / "ckpt")
    assert LEARNING_RATE_PROPERTY not in state2.properties and state2.properties["epoch"] == 3
    module2 = Module(art["training"], state2, art["eval"])
    opt2 = Optimizer(art["adamw"], module2)
    if include:
        assert opt2.get_learning_rate() == float(np.float32(0.02)) and opt2.step_count == 3
        assert _run(module2, opt2, range(3, 6)) == uninterrupted
        for p in TRAINABLE:
            np.testing.assert_array_equal(state2.parameters[p].data, final[p])
    else:
        assert opt2.get_learning_rate() == float(np.float32(0.001)) and opt2.step_count == 0
        raw = load_checkpoint(tmp_path / "ckpt")
        assert raw.optimizer_groups == [] and LEARNING_RATE_PROPERTY not in raw.properties


def test_optimizer_state_saved_only_with_flag_and_strict_on_load(art, tmp_path):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    # no optimizer yet: nothing to write
    CheckpointState.save_checkpoint(state, tmp_path / "fresh", include_optimizer_state=True)
    assert load_checkpoint(tmp_path / "fresh").optimizer_groups == []
    state, module, opt = setup(art, "sgd")
    _run(module, opt, range(2))
    CheckpointState.save_checkpoint(state, tmp_path / "sgd", include_optimizer_state=True)
    raw = load_checkpoint(tmp_path / "sgd")
    g = raw.optimizer_groups[0]
    assert g.name == "group0" and g.step == 2 and sorted(g.states) == ["W", "b"]
    assert sorted(g.states["W"]) == ["momentum0"]
    rate, digest = raw.properties[LEARNING_RATE_PROPERTY].split("#")  # rate @ step # parameters' checksum
    assert rate == f"{float(np.float32(0.001))!r}@2" and len(digest) == 8
    # an SGD optimizer state has no second moments: an AdamW optimizer refuses it
    state2 = CheckpointState.load_checkpoint(tmp_path / "sgd")
    with pytest.raises(ValueError, match="momentum1"):
        Optimizer(art["adamw"], Module(art["training"], state2))
    # a saved state that lacks a parameter is refused, as by onnxruntime
    del raw.optimizer_groups[0].states["b"]
    save_checkpoint(raw, tmp_path / "partial")
    state3 = CheckpointState.load_checkpoint(tmp_path / "partial")
    with pytest.raises(ValueError, match="Parameter b not found in the source optimizer checkpoint states"):
        Optimizer(art["sgd"], Module(art["training"], state3))


# ---------------------------------------------------------------- LinearLRScheduler
TABLE_INTENDED = [0.0, 0.05, 0.1, 0.0875, 0.075, 0.0625, 0.05, 0.0375, 0.025, 0.0125, 0.0, 0.0, 0.0]
TABLE_SWAPPED = [0.0, 0.01, 0.02, 0.03, 0.04, 0.05, 0.06, 0.07, 0.08, 0.09, 0.0, 0.0, 0.0]
TABLE_5_2 = [0.0, 0.5, 1.0, 0.666667, 0.333333, 0.0, 0.0, 0.0]


def _schedule(art, *args, n: int, **kw) -> list[float]:
    _, module, opt = setup(art, "sgd")
    sched = LinearLRScheduler(opt, *args, **kw)
    lrs = [opt.get_learning_rate()]
    for i in range(n - 1):
        module(*batch(i))
        opt.step()
        module.lazy_reset_grad()
        sched.step()
        lrs.append(opt.get_learning_rate())
    return lrs


def test_linear_lr_scheduler_tables(art):
    """Spec §4.2: (warmup, total) in the documented order; the swap flag reproduces the 1.19.2 wrapper."""
    np.testing.assert_allclose(_schedule(art, 2, 10, 0.1, n=13), TABLE_INTENDED, rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_schedule(art, 10, 2, 0.1, n=13, swap_warmup_and_total=True), TABLE_INTENDED,
                               rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_schedule(art, 2, 10, 0.1, n=13, swap_warmup_and_total=True), TABLE_SWAPPED,
                               rtol=1e-6, atol=1e-9)
    np.testing.assert_allclose(_schedule(art, 2, 5, 1.0, n=8), TABLE_5_2, atol=1e-6)  # table has 6 digits
    swapped = _schedule(art, 5, 2, 1.0, n=8, swap_warmup_and_total=True)
    np.testing.assert_allclose(swapped, TABLE_5_2, atol=1e-6)
    np.testing.assert_allclose(_schedule(art, warmup_step_count=2, total_step_count=5, initial_lr=1.0, n=8),
                               TABLE_5_2, atol=1e-6)


def test_linear_lr_scheduler_behaviour(art, tmp_path):
    state, module, opt = setup(art, "sgd")
    sched = LinearLRScheduler(opt, 2, 10, 0.1)
    for _ in range(3):  # advances nothing by itself
        sched.step()
        assert opt.get_learning_rate() == 0.0
    opt.set_learning_rate(0.7)
    sched.step()
    assert opt.get_learning_rate() == 0.0  # overwritten at the next scheduler step
    for bad in ((2.0, 10), (2, "10")):
        with pytest.raises(TypeError):
            LinearLRScheduler(opt, *bad, 0.1)
    with pytest.raises(TypeError):
        LinearLRScheduler(module, 2, 10, 0.1)
    LinearLRScheduler(opt, -1, 10, 0.1)  # inconsistent counts accepted silently, as the reference
    LinearLRScheduler(opt, 5, 2, 0.1)
    # a scheduler created after a reload continues from the restored step
    _run(module, opt, range(1))
    CheckpointState.save_checkpoint(state, tmp_path / "c", include_optimizer_state=True)
    state2 = CheckpointState.load_checkpoint(tmp_path / "c")
    opt2 = Optimizer(art["sgd"], Module(art["training"], state2))
    LinearLRScheduler(opt2, 10, 2, 0.1, swap_warmup_and_total=True)
    assert opt2.get_learning_rate() == pytest.approx(0.05)


# ---------------------------------------------------------------- export
def test_export_model_for_inferencing(art, tmp_path):
    ort = pytest.importorskip("onnxruntime")
    state, module, opt = setup(art, "sgd")
    opt.set_learning_rate(0.1)
    _run(module, opt, range(3))
    module.eval()
    x, t = batch(9)
    loss, y = module(x, t)
    out = tmp_path / "inference.onnx"
    module.export_model_for_inferencing(out, ["y"])
    m = onnx.load(out)
    onnx.checker.check_model(m, full_check=True)
    assert [v.name for v in m.graph.input] == ["x"] and [v.name for v in m.graph.output] == ["y"]
    assert sorted(t.name for t in m.graph.initializer) == ["W", "b", "s"]
    assert [n.op_type for n in m.graph.node] == ["MatMul", "Add", "Mul"]
    sess = ort.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    np.testing.assert_allclose(sess.run(None, {"x": x})[0], y, atol=1e-5)
    module.export_model_for_inferencing(str(tmp_path / "both.onnx"), ["loss", "y"])
    m2 = onnx.load(tmp_path / "both.onnx")
    assert [v.name for v in m2.graph.input] == ["x", "target"]
    got = ort.InferenceSession(str(tmp_path / "both.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "target": t})
    np.testing.assert_allclose(got[0], loss, atol=1e-5)
    module.export_model_for_inferencing(tmp_path / "inter.onnx", ["xw"])  # an intermediate
    m3 = onnx.load(tmp_path / "inter.onnx")
    assert [t.name for t in m3.graph.initializer] == ["W"]
    assert [n.op_type for n in m3.graph.node] == ["MatMul"]


def test_export_misuse(art, tmp_path):
    _, module, _ = setup(art, None)
    with pytest.raises(ValueError, match="non empty"):
        module.export_model_for_inferencing(tmp_path / "a.onnx", [])
    with pytest.raises(ValueError, match=r"nonexistent could not be found.*any value it computes may be"):
        module.export_model_for_inferencing(tmp_path / "a.onnx", ["nonexistent"])
    with pytest.raises(TypeError):
        module.export_model_for_inferencing(tmp_path / "a.onnx", "y")
    with pytest.raises(FileNotFoundError):
        module.export_model_for_inferencing(tmp_path / "no" / "a.onnx", ["y"])
    with pytest.raises(IsADirectoryError):
        module.export_model_for_inferencing(tmp_path, ["y"])


# ---------------------------------------------------------------- TrainingSession
def test_training_session_flow(art, tmp_path):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    sess = TrainingSession(state, art["training"], art["eval"], art["sgd"])
    assert sess.input_names(True) == ["x", "target"] and sess.output_names(False) == ["loss", "y"]
    ref_state, ref_module, ref_opt = setup(art, "sgd")
    ref_opt.set_learning_rate(0.1)
    sess.set_learning_rate(0.1)
    for i in range(3):
        x, t = batch(i)
        loss, y = sess.train_step([x, t])
        assert loss == ref_module(x, t)[0]
        sess.optimizer_step()
        ref_opt.step()
        sess.lazy_reset_grad()
        ref_module.lazy_reset_grad()
    x, t = batch(5)
    loss_buf, y_buf = np.zeros((), np.float32), np.zeros((5, 3), np.float32)
    res = sess.eval_step({"target": t, "x": x}, [loss_buf, y_buf])
    assert res[0] is loss_buf and loss_buf == ref_module.eval()(x, t)[0]
    with pytest.raises(ValueError, match="output buffer"):
        sess.eval_step([x, t], [loss_buf])
    with pytest.raises(ValueError, match="missing"):
        sess.train_step({"x": x})
    with pytest.raises(TypeError):
        sess.train_step(x)
    np.testing.assert_array_equal(sess.to_buffer(True), ref_module.get_contiguous_parameters(True))
    assert sess.to_buffer(False).shape == (18,)
    sess.from_buffer(np.zeros(15, np.float32))
    np.testing.assert_array_equal(state.parameters["W"].data, 0)
    assert state.parameters["s"].data[0] == 1.0
    sess.from_buffer(np.ones(18, np.float32))
    np.testing.assert_array_equal(state.parameters["s"].data, 1)
    with pytest.raises(ValueError, match="15.*18"):
        sess.from_buffer(np.zeros(16, np.float32))
    with pytest.raises(ValueError, match="1-D"):
        sess.from_buffer(np.zeros((1, 15), np.float32))
    sess.export_model_for_inferencing(tmp_path / "inf.onnx", ["y"])
    assert os.path.exists(tmp_path / "inf.onnx")


def test_training_session_scheduler(art):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    sess = TrainingSession(state, art["training"], art["eval"], art["sgd"])
    with pytest.raises(RuntimeError, match="No learning-rate scheduler"):
        sess.scheduler_step()
    sess.register_linear_lr_scheduler(2, 10, 0.1)
    assert sess.get_learning_rate() == pytest.approx(0.1)  # C API: initial lr until the first scheduler step
    with pytest.raises(RuntimeError, match="already registered"):
        sess.register_linear_lr_scheduler(2, 10, 0.1)
    with pytest.raises(RuntimeError, match="scheduler is registered"):
        sess.set_learning_rate(0.5)
    lrs = []
    for i in range(12):
        sess.scheduler_step()
        lrs.append(sess.get_learning_rate())
        sess.train_step(list(batch(i)))
        sess.optimizer_step()
        sess.lazy_reset_grad()
    np.testing.assert_allclose(lrs, TABLE_INTENDED[:12], rtol=1e-6, atol=1e-9)


def test_training_session_without_optimizer_or_eval(art):
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    sess = TrainingSession(state, art["training"])
    sess.train_step(list(batch()))
    for call in (sess.optimizer_step, sess.get_learning_rate, lambda: sess.set_learning_rate(0.1),
                 lambda: sess.register_linear_lr_scheduler(1, 2, 0.1)):
        with pytest.raises(RuntimeError, match="optimizer model"):
            call()
    with pytest.raises(RuntimeError, match="Evaluation session not initialized"):
        sess.eval_step(list(batch()))
    assert sess.input_names(False) == []


def test_training_session_steps_are_module_calls(art, monkeypatch):
    """The facade's train_step holds the state as a Module call does (another thread cannot take it while
    the step runs), and its errors are those of a Module call: onnxruntime's RuntimeError classes."""
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    sess = TrainingSession(state, art["training"], art["eval"], art["sgd"])
    taken_meanwhile = []
    real = sess.module._train_step

    def step(inputs):
        def other():
            got = state._lock.acquire(blocking=False)
            taken_meanwhile.append(got)
            if got:
                state._lock.release()

        t = threading.Thread(target=other)
        t.start()
        t.join()
        return real(inputs)

    monkeypatch.setattr(sess.module, "_train_step", step)
    sess.train_step(list(batch()))
    sess.module(*batch())
    assert taken_meanwhile == [False, False]
    x, t = batch()
    for call in (lambda: sess.module(x, t[:3]), lambda: sess.train_step([x, t[:3]]),
                 lambda: sess.eval_step([x, t[:3]]), lambda: sess.from_buffer(np.zeros(16, np.float32))):
        with pytest.raises(RuntimeError) as e:
            call()
        assert isinstance(e.value, ValueError)  # still a ValueError for code written for onnxtrain


def test_a_property_string_without_utf8_form_is_refused_when_set(art, tmp_path) -> None:
    """A lone surrogate (``os.fsdecode`` of undecodable bytes) in a property's value or name is a TypeError
    when set, as onnxruntime-training refuses it; it was taken, and every later save_checkpoint failed."""
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    for name, value in (("note", "bad \ud800 text"), ("bad \udc80 name", "ok")):
        with pytest.raises(TypeError, match="not valid UTF-8"):
            state.properties[name] = value
        assert name not in state.properties
    state.properties["note"] = "ünïcode ✓"
    CheckpointState.save_checkpoint(state, str(tmp_path / "again"))
    assert CheckpointState.load_checkpoint(str(tmp_path / "again")).properties["note"] == "ünïcode ✓"


@pytest.mark.parametrize("reader", ["get_contiguous_parameters", "copy_buffer_to_parameters",
                                    "export_model_for_inferencing", "eval"])
def test_module_readers_wait_for_an_optimizer_step_in_another_thread(art, tmp_path, monkeypatch, reader):
    """Module calls that read or write the parameters take turns with an Optimizer.step running in another
    thread, as onnxruntime-training's do: they ran during it and returned (or exported, or evaluated with)
    parameters of no whole step (some tensors updated, others not), which the update, writing in place,
    could also overwrite halfway. The reader, started while the step runs, finishes only after it."""
    state = CheckpointState.load_checkpoint(art["checkpoint"])
    module = Module(art["training"], state, art["eval"])
    opt = Optimizer(art["sgd"], module)
    module(*batch())
    buf = module.get_contiguous_parameters(trainable_only=True)
    calls = {
        "get_contiguous_parameters": lambda: module.get_contiguous_parameters(),
        "copy_buffer_to_parameters": lambda: module.copy_buffer_to_parameters(buf),
        "export_model_for_inferencing":
            lambda: module.export_model_for_inferencing(tmp_path / "inf.onnx", ["y"]),
        "eval": lambda: module._run_step(list(batch()), training=False),
    }
    order: list[str] = []
    real = opt._step

    def step() -> None:
        read = threading.Event()
        t = threading.Thread(target=lambda: (calls[reader](), order.append("reader"), read.set()))
        t.start()
        # the reader waits for the state's lock that the step holds, or (taking none) is done: seen, not
        # timed (a fixed 0.3 s could pass before a loaded host had begun the reader)
        assert first_set(watched.waiting, read), "the reader neither waited for the lock nor ended"
        order.append("step")
        real()
        watch.append(t)

    watch: list[threading.Thread] = []
    monkeypatch.setattr(opt, "_step", step)
    with watched_lock(state, "_lock") as watched:
        opt.step()
        watch[0].join(60)
    assert order == ["step", "reader"]
