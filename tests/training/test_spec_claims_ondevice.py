"""Claims of the on-device spec (``../shared/spec/on-device-training.md``) that no other test showed.

Each is checked against an oracle outside onnxtrain:

* §1.1–1.5 and §8.1–2: the file names, graph inputs and outputs, embedded constants, checkpoint contents,
  nominal checkpoint and the Module's names and sizes of the artifacts of the torch MLP for several
  choices of trainable and frozen parameters, losses, optimizers, additional outputs and a prefix, as
  onnxruntime-training 1.19.2's generator and Module give them (the loss output's generated name aside);
* §4.2: LinearLRScheduler's learning rates at the edges (warm-up 0, total equal to warm-up, both 0,
  steps past the total, negative or inconsistent counts), as onnxruntime-training 1.19.2 computes them
  (its Python wrapper takes the counts swapped: called here with the swap undone);
* §5: the C# facade's scheduler (the rate is the initial rate until the first scheduler step), against
  the spec's float32 formula;
* §6.2: an empty batch gives a NaN mean loss (0 for a sum) and zero gradients, as torch's autograd does;
* §2.4: float properties are kept as float32 and int properties as int64.
"""

from __future__ import annotations

import json
import os
import warnings

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer, TrainingSession
from tests.ortt import PREAMBLE, run_script
from tests.training.torch_mlp import export_mlp

torch = pytest.importorskip("torch")

# the same source runs in this process (onnxtrain) and in onnxruntime-training's venv
_DRIVER = r'''
import json, os, tempfile
import numpy as np
import onnx


def _dims(value):
    """A graph input's dims: sizes, or the names of symbolic ones."""
    return [d.dim_param if d.HasField("dim_param") else d.dim_value for d in value.type.tensor_type.shape.dim]


def interfaces(artifacts, CheckpointState, Module, model_path, cases):
    """What each case's generated artifacts hold and what a Module over them reports."""
    model = onnx.load(model_path)
    base_inits = {t.name for t in model.graph.initializer}
    out = []
    for case in cases:
        case = dict(case)
        pre = case.get("prefix", "")
        loss = getattr(artifacts.LossType, case.pop("loss"))
        opt = case.pop("optimizer", None)
        opt = None if opt is None else getattr(artifacts.OptimType, opt)
        d = tempfile.mkdtemp()
        artifacts.generate_artifacts(model, loss=loss, optimizer=opt, artifact_directory=d,
                                     nominal_checkpoint=True, **case)
        path = lambda name: os.path.join(d, pre + name)  # noqa: E731
        tr, ev = onnx.load(path("training_model.onnx")), onnx.load(path("eval_model.onnx"))
        r = {"files": sorted(os.listdir(d)),
             "train_inputs": [v.name for v in tr.graph.input],
             "train_input_types": [[v.type.tensor_type.elem_type, _dims(v)] for v in tr.graph.input],
             "eval_input_types": [[v.type.tensor_type.elem_type, _dims(v)] for v in ev.graph.input],
             "train_outputs": [v.name for v in tr.graph.output][1:],  # the loss's name is generated
             "train_outputs_count": len(tr.graph.output),
             "eval_inputs": [v.name for v in ev.graph.input],
             "eval_outputs": [v.name for v in ev.graph.output][1:],
             "train_constants": sorted(t.name for t in tr.graph.initializer if t.name in base_inits),
             "eval_constants": sorted(t.name for t in ev.graph.initializer if t.name in base_inits)}
        if opt is not None:
            optimizer_model = onnx.load(path("optimizer_model.onnx"))
            r["optimizer_leading_inputs"] = [v.name for v in optimizer_model.graph.input][:2]
        state = CheckpointState.load_checkpoint(path("checkpoint"))
        r["state"] = [[n, bool(p.requires_grad), np.asarray(p.data).tolist()] for n, p in state.parameters]
        nominal = CheckpointState.load_checkpoint(path("nominal_checkpoint"))
        r["nominal_count"] = len(nominal.parameters)
        m = Module(path("training_model.onnx"), state, path("eval_model.onnx"))
        r["train_names"] = [m.input_names(), len(m.output_names())]
        r["sizes"] = [m.get_parameters_size(True), m.get_parameters_size(False)]
        r["contiguous"] = np.asarray(m.get_contiguous_parameters(False).numpy()).tolist()
        m.eval()
        r["eval_names"] = [m.input_names(), len(m.output_names())]
        out.append(r)
    return out


def exports(artifacts, CheckpointState, Module, model_path, folder, lists):
    """Inference models exported after generation (fc2.weight and fc1.bias trained, fc1.weight frozen,
    MSE) for each list of output names ("LOSS": the loss output, whatever its generated name) into folder:
    each one's inputs, outputs and parameter initializers."""
    model = onnx.load(model_path)
    artifacts.generate_artifacts(model, requires_grad=["fc2.weight", "fc1.bias"],
                                 frozen_params=["fc1.weight"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=folder)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    m = Module(os.path.join(folder, "training_model.onnx"), state, os.path.join(folder, "eval_model.onnx"))
    loss = m.output_names()[0]
    out = []
    for i, names in enumerate(lists):
        path = os.path.join(folder, f"exported{i}.onnx")
        m.export_model_for_inferencing(path, [loss if n == "LOSS" else n for n in names])
        e = onnx.load(path)
        out.append({"inputs": [v.name for v in e.graph.input],
                    "outputs": ["LOSS" if v.name == loss else v.name for v in e.graph.output],
                    "parameters": sorted(t.name for t in e.graph.initializer
                                         if not t.name.startswith("onnx::"))})
    return out


def schedules(artifacts, CheckpointState, Module, Optimizer, scheduler, model_path, cases, steps):
    """The learning rate after construction and after each of ``steps`` updates, per (warmup, total)."""
    model = onnx.load(model_path)
    d = tempfile.mkdtemp()
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=d)
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    out = []
    for warmup, total in cases:
        state = CheckpointState.load_checkpoint(os.path.join(d, "checkpoint"))
        m = Module(os.path.join(d, "training_model.onnx"), state)
        o = Optimizer(os.path.join(d, "optimizer_model.onnx"), m)
        s = scheduler(o, warmup, total, 0.1)
        rates = [o.get_learning_rate()]
        for _ in range(steps):
            m(x, y)
            o.step()
            m.lazy_reset_grad()
            s.step()
            rates.append(o.get_learning_rate())
        out.append(rates)
    return out
'''

_NS: dict = {}
exec(compile(_DRIVER, "<driver>", "exec"), _NS)  # noqa: S102 - the same source onnxruntime-training runs

_ORT_SCRIPT = PREAMBLE + _DRIVER + r'''
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, LinearLRScheduler, Module, Optimizer

job = json.loads(sys.argv[1])
enums = {"LossType": {e.name: e.value for e in artifacts.LossType},
         "OptimType": {e.name: e.value for e in artifacts.OptimType}}
# its Python wrapper hands (warmup, total) to a binding that takes (total, warmup): swapped back here
swapped = lambda o, warmup, total, lr: LinearLRScheduler(o, total, warmup, lr)  # noqa: E731
print(json.dumps({
    "enums": enums,
    "interfaces": interfaces(artifacts, CheckpointState, Module, job["model"], job["interfaces"]),
    "schedules": schedules(artifacts, CheckpointState, Module, Optimizer, swapped, job["model"],
                           job["schedules"], job["steps"]),
    "exports": exports(artifacts, CheckpointState, Module, job["model"], job["folder"], job["exports"]),
}))
'''

INTERFACE_CASES = [
    # the spec's observation: only fc2.weight trains, the rest stay constants of both models
    {"loss": "MSELoss", "requires_grad": ["fc2.weight"]},
    # listed out of order, a frozen parameter between trainable ones
    {"loss": "MSELoss", "requires_grad": ["fc2.bias", "fc1.weight"], "frozen_params": ["fc2.weight"],
     "optimizer": "AdamW"},
    {"loss": "CrossEntropyLoss", "requires_grad": ["fc2.weight", "fc2.bias"],
     "frozen_params": ["fc1.bias", "fc1.weight"], "optimizer": "SGD",
     "additional_output_names": ["output", "/relu/Relu_output_0"]},
    {"loss": "L1Loss", "requires_grad": ["fc1.bias"], "frozen_params": ["fc2.bias"], "prefix": "my_"},
    {"loss": "BCEWithLogitsLoss", "requires_grad": ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"],
     "optimizer": "AdamW", "prefix": "p_"},
]
# (warmup, total): warm-up 0, total equal to warm-up, both 0, a one-step total, negative and inconsistent
# counts; 9 updates go past every total
SCHEDULE_CASES = [[0, 5], [5, 5], [3, 3], [0, 0], [0, 1], [1, 1], [-1, 4], [-3, 2], [5, 2], [4, 0], [2, -3],
                  [8, 8]]
STEPS = 9
# output names to export: the model output, intermediates, the loss (its inputs then include the labels)
EXPORT_CASES = [["output"], ["/relu/Relu_output_0"], ["/fc1/Gemm_output_0", "output"], ["LOSS", "output"],
                ["LOSS"], ["output", "/relu/Relu_output_0"]]


@pytest.fixture(scope="module")
def mlp_path(tmp_path_factory) -> str:
    path, _, _ = export_mlp(tmp_path_factory.mktemp("mlp"))
    return path


@pytest.fixture(scope="module")
def reference(mlp_path, tmp_path_factory):
    """onnxruntime-training 1.19.2's answers for every case (one run of its venv); its exported models are
    in ``reference["folder"]``."""
    folder = str(tmp_path_factory.mktemp("ortt_exports"))
    job = {"model": mlp_path, "interfaces": INTERFACE_CASES, "schedules": SCHEDULE_CASES, "steps": STEPS,
           "exports": EXPORT_CASES, "folder": folder}
    return {**run_script(_ORT_SCRIPT, json.dumps(job)), "folder": folder}


def _ours_scheduler(o, warmup, total, lr):
    return LinearLRScheduler(o, warmup, total, lr)


def test_enum_values_are_onnxruntime_trainings(reference):
    """§1.1: scripts that build the enums from their values (LossType(1)) port."""
    assert {e.name: e.value for e in artifacts.LossType} == reference["enums"]["LossType"]
    assert {e.name: e.value for e in artifacts.OptimType} == reference["enums"]["OptimType"]


@pytest.mark.parametrize("i", range(len(INTERFACE_CASES)),
                         ids=[f"{c['loss']}-{'+'.join(c['requires_grad'])}" for c in INTERFACE_CASES])
def test_artifact_interfaces_are_onnxruntime_trainings(mlp_path, reference, i):
    """§1.2–1.5, §3.4, §3.6: the same files, graph inputs (parameters in initializer order, gradient buffers,
    the reset flag) and outputs, constants, checkpoint (values too), nominal checkpoint, Module names,
    sizes and contiguous buffer as onnxruntime-training's generator and Module."""
    ours = _NS["interfaces"](artifacts, CheckpointState, Module, mlp_path, [INTERFACE_CASES[i]])[0]
    theirs = reference["interfaces"][i]
    for key in ("state", "contiguous"):
        np.testing.assert_equal(len(ours[key]), len(theirs[key]), err_msg=key)
    for mine, ref in zip(ours.pop("state"), theirs.pop("state")):
        assert mine[:2] == ref[:2]  # name, trainable
        np.testing.assert_array_equal(np.asarray(mine[2], np.float32), np.asarray(ref[2], np.float32))
    np.testing.assert_array_equal(np.asarray(ours.pop("contiguous"), np.float32),
                                  np.asarray(theirs.pop("contiguous"), np.float32))
    assert ours == theirs


def test_linear_lr_scheduler_edges_are_onnxruntime_trainings(mlp_path, reference):
    """§4.2: warm-up 0 starts at the full rate, total equal to warm-up drops to 0 at the end of the warm-up,
    steps past the total stay at 0, negative and inconsistent counts are taken as onnxruntime-training's
    C++ formula takes them: the same float32 rates (bit for bit) after construction and every update."""
    ours = _NS["schedules"](artifacts, CheckpointState, Module, Optimizer, _ours_scheduler, mlp_path,
                            SCHEDULE_CASES, STEPS)
    for case, got, want in zip(SCHEDULE_CASES, ours, reference["schedules"]):
        assert got == want, f"(warmup, total) = {case}"


def test_exported_models_are_onnxruntime_trainings(mlp_path, reference, tmp_path):
    """§3.5: for each list of output names (intermediates, the loss), the exported model has the inputs,
    outputs and parameter initializers of onnxruntime-training's export, and plain onnxruntime computes the
    same values from both."""
    import onnxruntime as ort

    ours = _NS["exports"](artifacts, CheckpointState, Module, mlp_path, str(tmp_path), EXPORT_CASES)
    assert ours == reference["exports"]
    rng = np.random.default_rng(1)
    feeds = {"input": rng.standard_normal((5, 4)).astype(np.float32),
             "target": rng.standard_normal((5, 3)).astype(np.float32)}
    for i in range(len(EXPORT_CASES)):
        results = []
        for folder in (str(tmp_path), reference["folder"]):
            sess = ort.InferenceSession(os.path.join(folder, f"exported{i}.onnx"),
                                        providers=["CPUExecutionProvider"])
            results.append(sess.run(None, {v.name: feeds[v.name] for v in sess.get_inputs()}))
        for got, want in zip(*results):
            np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)


def _factor(step: int, warmup: int, total: int) -> np.float32:
    """The spec's §4.2 formula, in float32 as onnxruntime's C++ computes it."""
    f32 = np.float32
    if step < warmup:
        return f32(step) / f32(max(1, warmup))
    return max(f32(0), f32(total - step) / f32(max(1, total - warmup)))


@pytest.mark.parametrize("warmup,total", [[0, 5], [5, 5], [0, 0], [2, 4]])
def test_training_session_scheduler_edges_follow_the_c_api(mlp_path, tmp_path, warmup, total):
    """§5: after register_linear_lr_scheduler the rate is the initial rate until the first scheduler step,
    then initial_lr · factor(completed steps), also past the total."""
    model = onnx.load(mlp_path)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    sess = TrainingSession(state, str(tmp_path / "training_model.onnx"), str(tmp_path / "eval_model.onnx"),
                           str(tmp_path / "optimizer_model.onnx"))
    sess.register_linear_lr_scheduler(warmup, total, 0.1)
    assert sess.get_learning_rate() == float(np.float32(0.1))
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    for step in range(total + 3):
        sess.scheduler_step()
        assert sess.get_learning_rate() == float(np.float32(0.1) * _factor(step, warmup, total)), step
        sess.train_step([x, y])
        sess.optimizer_step()
        sess.lazy_reset_grad()


def _loss_block(kind: str, reduction: str):
    return getattr(onnxblock.loss, kind)(reduction=reduction)


def _torch_loss(kind: str, reduction: str, out, target):
    f = torch.nn.functional
    if kind == "MSELoss":
        return f.mse_loss(out, target, reduction=reduction)
    if kind == "L1Loss":
        return f.l1_loss(out, target, reduction=reduction)
    if kind == "BCEWithLogitsLoss":
        return f.binary_cross_entropy_with_logits(out, target, reduction=reduction)
    return f.cross_entropy(out, target, reduction=reduction)


@pytest.mark.parametrize("reduction", ["mean", "sum"])
@pytest.mark.parametrize("kind", ["MSELoss", "L1Loss", "BCEWithLogitsLoss", "CrossEntropyLoss"])
def test_an_empty_batch_gives_torchs_loss_and_zero_gradients(tmp_path, kind, reduction):
    """§6.2: onnxruntime-training fails inside its MSE gradient ("Scale value must not be 0"); here a
    batch of 0 rows gives torch's loss (NaN for a mean, 0 for a sum) in training and eval mode, torch's
    (zero) gradients, and an update with them leaves the parameters as they were."""
    path, model, net = export_mlp(tmp_path)
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in model.graph.initializer],
                                 loss=_loss_block(kind, reduction), optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.1)
    x = np.zeros((0, 4), np.float32)
    target = np.zeros(0, np.int64) if kind == "CrossEntropyLoss" else np.zeros((0, 3), np.float32)

    net.zero_grad()
    want = _torch_loss(kind, reduction, net(torch.from_numpy(x)), torch.from_numpy(target))
    want.backward()
    want_grads = {n: p.grad.numpy() for n, p in net.named_parameters()}

    before = {n: p.data.copy() for n, p in state.parameters}
    loss = module(x, target)
    np.testing.assert_array_equal(loss, want.detach().numpy())  # NaN equals NaN here
    for name, grad in want_grads.items():
        np.testing.assert_array_equal(state.parameters[name].grad, grad)
    opt.step()
    for name, value in before.items():
        np.testing.assert_array_equal(state.parameters[name].data, value)
    module.eval()
    np.testing.assert_array_equal(module(x, target), want.detach().numpy())


def test_property_numbers_keep_float32_and_int64(tmp_path, mlp_path):
    """§2.4: a float property is a float32 (1e300 becomes inf, pi its float32 value), an int one an int64
    (2**63 does not fit and is refused naming the property), through a save and load."""
    model = onnx.load(mlp_path)
    artifacts.generate_artifacts(model, requires_grad=["fc2.bias"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    values = {"huge": 1e300, "pi": np.pi, "tiny": 1e-50, "low": -(2**63), "high": 2**63 - 1}
    for name, value in values.items():
        state.properties[name] = value
    with pytest.raises(ValueError, match="'too_big'"):
        state.properties["too_big"] = 2**63
    assert "too_big" not in state.properties
    CheckpointState.save_checkpoint(state, tmp_path / "props")
    again = CheckpointState.load_checkpoint(tmp_path / "props").properties
    with np.errstate(over="ignore"):
        for name in ("huge", "pi", "tiny"):
            assert again[name] == float(np.float32(values[name])), name
    assert again["low"] == -(2**63) and again["high"] == 2**63 - 1


def test_training_session_takes_the_c_sharp_three_argument_form(tmp_path, mlp_path):
    """§5: C#'s ``new TrainingSession(state, trainModel, optimizerModel)`` ported as
    ``TrainingSession(state, train, optimizer)``: the third model is the optimizer (no eval model). Before,
    it became the eval model (a warning about parameters the checkpoint lacks) and optimizer_step failed.
    The step is SGD's ``p − lr·g`` with torch autograd's gradient."""
    model = onnx.load(mlp_path)
    artifacts.generate_artifacts(model, requires_grad=["fc2.weight", "fc2.bias"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.SGD,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    train, opt = str(tmp_path / "training_model.onnx"), str(tmp_path / "optimizer_model.onnx")
    sess = TrainingSession(state, train, opt)
    assert sess.optimizer is not None and sess.input_names(False) == [] and sess.output_names(False) == []
    rng = np.random.default_rng(0)
    x, y = rng.standard_normal((5, 4)).astype(np.float32), rng.standard_normal((5, 3)).astype(np.float32)
    weights = {t.name: torch.tensor(onnx.numpy_helper.to_array(t), requires_grad=True)
               for t in model.graph.initializer}
    hidden = torch.relu(torch.from_numpy(x) @ weights["fc1.weight"].T + weights["fc1.bias"])
    out = hidden @ weights["fc2.weight"].T + weights["fc2.bias"]
    loss = torch.nn.functional.mse_loss(out, torch.from_numpy(y))
    loss.backward()
    sess.set_learning_rate(0.5)
    got, = sess.train_step([x, y])
    np.testing.assert_allclose(got, loss.item(), rtol=1e-6)
    sess.optimizer_step()
    for name in ("fc2.weight", "fc2.bias"):
        want = weights[name].detach().double().numpy() - 0.5 * weights[name].grad.double().numpy()
        np.testing.assert_allclose(state.parameters[name].data, want, rtol=1e-5, atol=1e-6)
    # the four-argument form with an optimizer model in the eval place is a mistake: refused naming it
    with pytest.raises(ValueError, match="eval_model.*optimizer model"):
        TrainingSession(state, train, opt, opt)
    with pytest.raises(ValueError, match="eval_model_uri.*optimizer model"):
        Module(train, state, opt)
    with pytest.raises(TypeError, match="session_options="):  # C#'s SessionOptions-first form
        TrainingSession(object(), state, train, None, opt)


def test_module_applies_its_session_options_on_the_numpy_engine(tmp_path, mlp_path):
    """§3.1 ``Module(..., session_options)``: ``intra_op_num_threads`` and ``graph_optimization_level =
    ORT_DISABLE_ALL`` reach the numpy plans of the training, eval and optimizer models, as they reach an
    InferenceSession's (before, the Module dropped every option but the backend's without a word);
    profiling and ``optimized_model_filepath`` are applied too (test_module_profiling.py), with no warning
    that they are not."""
    import onnxtrain

    model = onnx.load(mlp_path)
    artifacts.generate_artifacts(model, requires_grad=["fc2.weight", "fc2.bias"],
                                 loss=artifacts.LossType.MSELoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=tmp_path)
    paths = [str(tmp_path / f"{k}_model.onnx") for k in ("training", "eval", "optimizer")]
    so = onnxtrain.SessionOptions()
    so.intra_op_num_threads = 1
    so.graph_optimization_level = onnxtrain.GraphOptimizationLevel.ORT_DISABLE_ALL
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(paths[0], state, paths[1], session_options=so)
    opt = Optimizer(paths[2], module)
    x, y = np.ones((2, 4), np.float32), np.zeros((2, 3), np.float32)
    module(x, y)
    opt.step()
    module(x, y)  # accumulating: the training model's other plan
    plans = [module._overwrite_plan, module._full_plan, module._eval_plan, opt._plan]
    assert [(p.threads, p.fused) for p in plans] == [(1, False)] * len(plans)
    from onnxtrain.engine import fusion
    from onnxtrain.engine.parallel import default_width

    default = Module(paths[0], state, paths[1], session_options=onnxtrain.SessionOptions())._eval_plan
    assert (default.threads, default.fused) == (default_width(), fusion.enabled())  # unset: the defaults
    profiled = onnxtrain.SessionOptions()
    profiled.enable_profiling = True
    profiled.profile_file_prefix = str(tmp_path / "profile")
    profiled.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        Module(paths[0], state, paths[1], session_options=profiled)


@pytest.mark.parametrize("value", ["0", "yes"])
def test_module_refuses_prepacking_as_onnxruntime_training(tmp_path, mlp_path, value):
    """§3.1: a ``session.disable_prepacking`` entry other than "1" is refused, naming it, as
    onnxruntime-training 1.19.2's Module refuses it ("Prepacking is not supported for training
    scenarios"); "1" (and no entry) is accepted. Before, any value was taken without a word."""
    import onnxtrain

    model = onnx.load(mlp_path)
    artifacts.generate_artifacts(model, requires_grad=["fc2.bias"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", value)
    refusal = "Prepacking is not supported for training scenarios.*disable_prepacking"
    with pytest.raises(RuntimeError, match=refusal):
        Module(str(tmp_path / "training_model.onnx"), state, session_options=so)
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("session.disable_prepacking", "1")
    Module(str(tmp_path / "training_model.onnx"), state, session_options=so)


def _torch_mlp_grads(model: onnx.ModelProto, x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """torch autograd's MSE gradients of the MLP's parameters at the model's initial values."""
    w = {t.name: torch.tensor(onnx.numpy_helper.to_array(t), requires_grad=True)
         for t in model.graph.initializer}
    hidden = torch.relu(torch.from_numpy(x) @ w["fc1.weight"].T + w["fc1.bias"])
    out = hidden @ w["fc2.weight"].T + w["fc2.bias"]
    torch.nn.functional.mse_loss(out, torch.from_numpy(y)).backward()
    return {n: t.grad.numpy() for n, t in w.items()}


def test_eval_calls_and_optimizer_steps_leave_the_reset_flag(tmp_path, mlp_path):
    """§3.3: only a training call and lazy_reset_grad() move the accumulate flag. After a reset, an eval call
    does not make the next training call accumulate (it overwrites: that batch's gradient alone); without a
    reset, an optimizer step does not make it overwrite (it adds). SGD at learning rate 0 keeps the weights,
    so every gradient is torch autograd's at the initial values."""
    model = onnx.load(mlp_path)
    names = [t.name for t in model.graph.initializer]
    artifacts.generate_artifacts(model, requires_grad=names, loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.SGD, artifact_directory=tmp_path)
    state = CheckpointState.load_checkpoint(tmp_path / "checkpoint")
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(0.0)
    rng = np.random.default_rng(3)
    batches = [(rng.standard_normal((4, 4)).astype(np.float32),
                rng.standard_normal((4, 3)).astype(np.float32)) for _ in range(3)]
    g = [_torch_mlp_grads(model, *b) for b in batches]

    def grads_are(want: dict[str, np.ndarray]) -> None:
        for n in names:
            np.testing.assert_allclose(state.parameters[n].grad, want[n], rtol=1e-5, atol=1e-6, err_msg=n)

    module.train()(*batches[0])
    module.lazy_reset_grad()
    module.eval()(*batches[1])
    module.train()(*batches[2])
    grads_are(g[2])  # overwritten despite the eval call between
    opt.step()
    module(*batches[0])
    grads_are({n: g[2][n] + g[0][n] for n in names})  # added despite the step between
    module.eval()(*batches[1])
    module.train()(*batches[1])
    grads_are({n: g[2][n] + g[0][n] + g[1][n] for n in names})
