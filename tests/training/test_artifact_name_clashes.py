"""Parameter and value names that equal names the generated artifacts use themselves.

(a) Parameters called ``learning_rate``/``step``, ``W`` beside ``W.momentum0`` or ``W.out``, ``loss_scale``
(mixed precision): the optimizer model names the clashing inputs and outputs otherwise and records what
each one is (``onnxtrain.optimizer_io``); the Optimizer binds by the record, onnxruntime-training's own
artifacts of such models (sequence inputs, bound by position there) included.
(b) A model value named like a temporary of the training model's accumulators (``W_grad.accumulation.sum``,
``lazy_reset_grad.scalar``) or a node named like one of its nodes: the temporaries get fresh names.

The oracle: the same model with ordinary names (``W``, ``b``, ``h``) trains to the same losses and
weights; onnxruntime-training 1.19.2 (/tmp/ortt, when present) generates and trains the clashing models.
"""

from __future__ import annotations

import json
import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from onnxtrain.training.onnxblock import optim

LR = 0.05
STEPS = 3


def _model(pname: str = "W", bname: str = "b", hname: str = "h", node_name: str = "") -> onnx.ModelProto:
    """logits = x @ <pname> + <bname>, the product called ``hname`` (its node ``node_name``)."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3)) * 0.5).astype(np.float32), pname),
             numpy_helper.from_array(np.full(3, 0.1, np.float32), bname)]
    nodes = [helper.make_node("MatMul", ["x", pname], [hname], name=node_name),
             helper.make_node("Add", [hname, bname], ["logits"])]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=10)


def _batches() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(1)
    return [(rng.standard_normal((6, 4)).astype(np.float32), rng.standard_normal((6, 3)).astype(np.float32))
            for _ in range(STEPS)]


def _generate(m: onnx.ModelProto, folder: str, optimizer=artifacts.OptimType.AdamW, **kw) -> str:
    params = [t.name for t in m.graph.initializer]
    os.makedirs(folder, exist_ok=True)
    artifacts.generate_artifacts(m, requires_grad=params, loss=artifacts.LossType.MSELoss,
                                 optimizer=optimizer, artifact_directory=folder, **kw)
    for name in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(os.path.join(folder, name)), full_check=True)
    return folder


def _train(folder: str) -> tuple[list[float], list[np.ndarray]]:
    """Losses of STEPS steps (forward, step, reset) and the final parameters (initializer order)."""
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)
    losses = []
    for x, y in _batches():
        losses.append(float(module(x, y)))
        opt.step()
        module.lazy_reset_grad()
    return losses, [p.data.copy() for _, p in state.parameters]


def _same_training(folder: str, reference: str) -> None:
    losses, weights = _train(folder)
    ref_losses, ref_weights = _train(reference)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6, atol=0)
    assert losses[-1] < losses[0]
    assert len(weights) == len(ref_weights)
    for w, r in zip(sorted(weights, key=np.size), sorted(ref_weights, key=np.size)):
        np.testing.assert_allclose(w, r, rtol=1e-6, atol=1e-7)


CLASHING_PARAMS = {
    "learning_rate-step": dict(pname="learning_rate", bname="step"),
    "W-W.momentum0": dict(bname="W.momentum0"),
    "W-W.out": dict(bname="W.out"),
    "W-W.momentum1": dict(bname="W.momentum1"),
}
OPTIMIZERS = {
    "adamw": lambda: artifacts.OptimType.AdamW,
    "sgd-clip": lambda: optim.SGD(clip_grad=optim.ClipGradNorm(0.5)),
    "adamw-clip": lambda: optim.AdamW(clip_grad=optim.ClipGradNorm(0.5)),
}


@pytest.mark.parametrize("opt_name", list(OPTIMIZERS))
@pytest.mark.parametrize("case", list(CLASHING_PARAMS))
def test_clashing_parameter_names_train_as_ordinary_ones(tmp_path, case, opt_name):
    ours = _generate(_model(**CLASHING_PARAMS[case]), str(tmp_path / "a"), OPTIMIZERS[opt_name]())
    ref = _generate(_model(), str(tmp_path / "ref"), OPTIMIZERS[opt_name]())
    _same_training(ours, ref)


def test_clashing_names_are_recorded(tmp_path):
    m = onnx.load(_generate(_model(bname="W.out"), str(tmp_path)) + "/optimizer_model.onnx")
    names = [v.name for v in m.graph.input] + [v.name for v in m.graph.output]
    assert len(set(names)) == len(names)
    record = json.loads(next(p.value for p in m.metadata_props if p.key == "onnxtrain.optimizer_io"))
    assert record["inputs"]["W"] == ["W", "param"] and record["inputs"]["W.out"] == ["W.out", "param"]
    # W's new value may not be called 'W.out' (the other parameter's input): a fresh name, recorded
    assert record["outputs"]["W.out.out"] == "W.out"
    assert [o for o, x in record["outputs"].items() if x == "W"] == ["W.out_1"]


def test_loss_scale_parameter_mixed_precision(tmp_path):
    ours = _generate(_model(bname="loss_scale"), str(tmp_path / "a"), mixed_precision="float16")
    ref = _generate(_model(), str(tmp_path / "ref"), mixed_precision="float16")
    _same_training(ours, ref)


def test_ordinary_names_keep_the_interface(tmp_path):
    """Models without clashes: the interface note's names, no record (the files are as before)."""
    folder = _generate(_model(), str(tmp_path), optim.AdamW(clip_grad=optim.ClipGradNorm(1.0)))
    m = onnx.load(folder + "/optimizer_model.onnx")
    assert [v.name for v in m.graph.input] == ["learning_rate", "step", "W", "b", "W_grad", "b_grad",
                                               "W.momentum0", "b.momentum0", "W.momentum1", "b.momentum1"]
    assert [v.name for v in m.graph.output] == [
        "W.out", "b.out", "W.momentum0.out", "b.momentum0.out", "W.momentum1.out", "b.momentum1.out",
        "W_grad.out", "b_grad.out"]
    assert "onnxtrain.optimizer_io" not in {p.key for p in m.metadata_props}
    t = onnx.load(folder + "/training_model.onnx")
    names = {n.name for n in t.graph.node}
    assert {"lazy_reset_grad_Squeeze", "GradientAccumulator0", "GradientAccumulator1_Add"} <= names
    values = {o for n in t.graph.node for o in n.output}
    assert {"lazy_reset_grad.scalar", "W_grad.accumulation.sum"} <= values


CLASHING_VALUES = {
    "W_grad.accumulation.sum": dict(hname="W_grad.accumulation.sum"),
    "b_grad.accumulation.sum": dict(hname="b_grad.accumulation.sum"),
    "lazy_reset_grad.scalar": dict(hname="lazy_reset_grad.scalar"),
}


@pytest.mark.parametrize("case", list(CLASHING_VALUES))
def test_values_named_like_accumulator_temporaries(tmp_path, case):
    ours = _generate(_model(**CLASHING_VALUES[case]), str(tmp_path / "a"))
    ref = _generate(_model(), str(tmp_path / "ref"))
    _same_training(ours, ref)


def test_nodes_named_like_accumulator_nodes(tmp_path):
    folder = _generate(_model(node_name="GradientAccumulator0"), str(tmp_path / "a"))
    t = onnx.load(folder + "/training_model.onnx")
    names = [n.name for n in t.graph.node if n.name]
    assert len(set(names)) == len(names), sorted(n for n in names if names.count(n) > 1)
    _same_training(folder, _generate(_model(), str(tmp_path / "ref")))


@pytest.mark.parametrize("name", ["lazy_reset_grad", "W_grad.accumulation.buffer", "b_grad.accumulation.out"])
def test_value_with_an_interface_name_is_refused(tmp_path, name):
    with pytest.raises(artifacts.ArtifactError, match=f"the model has value\\(s\\) \\['{name}'\\].*rename"):
        _generate(_model(hname=name), str(tmp_path))


# ---- onnxruntime-training's own artifacts of such models ---------------------------------------------
ORTT_PYTHON = os.path.join(os.environ.get("ONNXTRAIN_ORTT_DIR", "/tmp/ortt"), "bin", "python")

_ORT_SCRIPT = r"""
from onnxruntime.training import artifacts
import numpy as np
jobs = json.loads(sys.argv[1]); lr, steps = float(sys.argv[2]), int(sys.argv[3])
out = {}
for case, (model_path, folder) in jobs.items():
    m = onnx.load(model_path)
    artifacts.generate_artifacts(m, requires_grad=[t.name for t in m.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=folder)
    state, module, opt = open_artifacts(folder, lr)
    rng = np.random.default_rng(1)
    losses = []
    for _ in range(steps):
        x = rng.standard_normal((6, 4)).astype(np.float32); y = rng.standard_normal((6, 3)).astype(np.float32)
        losses.append(float(module(x, y))); opt.step(); module.lazy_reset_grad()
    out[case] = losses
print(json.dumps(out))
"""

ORT_CASES = {**CLASHING_PARAMS, **CLASHING_VALUES}


@pytest.fixture(scope="module")
def ort_artifacts(tmp_path_factory):
    """case -> (folder of onnxruntime-training's artifacts, the losses it trained them to)."""
    if not os.path.exists(ORTT_PYTHON):
        pytest.skip(f"onnxruntime-training 1.19.2 is not installed at {ORTT_PYTHON}")
    from tests.ortt import PREAMBLE, run_script

    root = tmp_path_factory.mktemp("ortt_clashes")
    jobs = {}
    for case, kw in ORT_CASES.items():
        (root / case).mkdir()
        onnx.save(_model(**kw), str(root / f"{case}.onnx"))
        jobs[case] = (str(root / f"{case}.onnx"), str(root / case))
    losses = run_script(PREAMBLE + _ORT_SCRIPT, json.dumps(jobs), str(LR), str(STEPS), python=ORTT_PYTHON)
    return {case: (jobs[case][1], losses[case]) for case in ORT_CASES}


@pytest.mark.parametrize("case", list(ORT_CASES))
def test_onnxruntime_training_artifacts_train(ort_artifacts, tmp_path, case):
    folder, ort_losses = ort_artifacts[case]
    losses, _ = _train(folder)
    np.testing.assert_allclose(losses, ort_losses, rtol=1e-5)
    ref_losses, _ = _train(_generate(_model(), str(tmp_path)))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)


# ---- (c) a model value named like the built-in loss's labels input -------------------------------------
def test_a_hidden_value_named_target_is_not_taken_for_the_labels(tmp_path) -> None:
    """The product called ``target``: MSELoss took it for its labels (the training model had no labels
    input; onnxruntime-training does the same, silently); the labels input is ``target_1`` now, with a
    warning, and trains as the model whose product has another name."""
    with pytest.warns(UserWarning, match=r"value named 'target' that is not a graph input.*'target_1'"):
        got = _generate(_model(hname="target"), str(tmp_path / "clash"))
    inputs = [v.name for v in onnx.load(os.path.join(got, "training_model.onnx")).graph.input]
    assert inputs[:2] == ["x", "target_1"], inputs
    _same_training(got, _generate(_model(), str(tmp_path / "plain")))


def test_a_graph_input_named_target_is_the_labels(tmp_path) -> None:
    """A graph input of the labels' name is taken for them, as onnxruntime-training takes it (no warning)."""
    m = _model()
    m.graph.input.append(helper.make_tensor_value_info("target", TensorProto.FLOAT, ["N", 3]))
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        folder = _generate(m, str(tmp_path / "in"))
    inputs = [v.name for v in onnx.load(os.path.join(folder, "training_model.onnx")).graph.input]
    assert inputs[:2] == ["x", "target"], inputs
    _same_training(folder, _generate(_model(), str(tmp_path / "plain")))
