"""generate_artifacts: interfaces, numerics against torch autograd and a float64 reference, errors."""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.checkpoint import load_checkpoint
from onnxtrain.engine import compile_model
from onnxtrain.training import onnxblock
from onnxtrain.training.artifacts import ArtifactError, LossType, OptimType, generate_artifacts
from tests.models import export

BATCH = 5


# ---- helpers -----------------------------------------------------------------------------------------------
def run_engine(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    outs = compile_model(m).run(feeds)
    return dict(zip([o.name for o in m.graph.output], outs))


def run_ort(m: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))


RUNNERS = {"engine": run_engine, "onnxruntime": run_ort}


def load(folder: str, name: str, prefix: str = "") -> onnx.ModelProto:
    return onnx.load(os.path.join(folder, prefix + name))


def assert_standard(m: onnx.ModelProto) -> None:
    """Default domain only, the lowest IR version of its opset, onnx.checker full check."""
    assert [o.domain for o in m.opset_import] == [""]
    assert all(n.domain in ("", "ai.onnx") for n in m.graph.node)
    assert m.ir_version == helper.find_min_ir_version_for(list(m.opset_import))
    onnx.checker.check_model(m, full_check=True)


def close(actual: np.ndarray, expected: np.ndarray, rtol: float = 1e-5) -> None:
    expected = np.asarray(expected)
    atol = rtol * max(float(np.max(np.abs(expected))), 1e-30) if expected.size else 0.0
    np.testing.assert_allclose(actual, expected, rtol=rtol, atol=atol)


@pytest.fixture(scope="module")
def mlp():
    model, feeds, module = export("mlp", training=True, batch=BATCH)
    return model, feeds["x"], module


def targets(loss: LossType, rng: np.random.Generator) -> tuple[str, np.ndarray]:
    if loss is LossType.CrossEntropyLoss:
        return "labels", rng.integers(0, 10, BATCH).astype(np.int64)
    if loss is LossType.BCEWithLogitsLoss:
        return "target", rng.integers(0, 2, (BATCH, 10)).astype(np.float32)
    return "target", rng.standard_normal((BATCH, 10)).astype(np.float32)


def torch_loss(loss: LossType, logits: torch.Tensor, target: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(target)
    fn = {
        LossType.MSELoss: torch.nn.functional.mse_loss,
        LossType.L1Loss: torch.nn.functional.l1_loss,
        LossType.BCEWithLogitsLoss: torch.nn.functional.binary_cross_entropy_with_logits,
        LossType.CrossEntropyLoss: torch.nn.functional.cross_entropy,
    }[loss]
    return fn(logits, t)


def torch_grads(module: torch.nn.Module, x: np.ndarray, loss_fn) -> tuple[float, dict[str, np.ndarray]]:
    module.zero_grad()
    out = loss_fn(module(torch.from_numpy(x)))
    out.backward()
    return out.item(), {n: p.grad.numpy().copy() for n, p in module.named_parameters() if p.grad is not None}


def training_feeds(
    m: onnx.ModelProto,
    user: dict[str, np.ndarray],
    params: dict[str, np.ndarray],
    reset: bool = True,
    buffers: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    feeds = dict(user)
    for v in m.graph.input:
        if v.name in params:
            feeds[v.name] = params[v.name]
        elif v.name.endswith("_grad.accumulation.buffer"):
            p = v.name[: -len("_grad.accumulation.buffer")]
            feeds[v.name] = (buffers or {}).get(p, np.zeros_like(params[p]))
    feeds["lazy_reset_grad"] = np.array([reset])
    return feeds


def initializers(model: onnx.ModelProto) -> dict[str, np.ndarray]:
    return {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}


# ---- training graph per loss: loss and gradients vs torch --------------------------------------------------
@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("loss", list(LossType), ids=lambda lt: lt.name)
def test_training_graph_matches_torch(mlp, tmp_path, loss, runner):
    model, x, module = mlp
    params = initializers(model)
    generate_artifacts(
        model, requires_grad=list(params), loss=loss, optimizer=OptimType.AdamW, artifact_directory=tmp_path
    )
    assert sorted(os.listdir(tmp_path)) == [
        "checkpoint",
        "eval_model.onnx",
        "optimizer_model.onnx",
        "training_model.onnx",
    ]
    tm = load(tmp_path, "training_model.onnx")
    assert_standard(tm)
    tname, target = targets(loss, np.random.default_rng(1))
    names = list(params)
    assert [v.name for v in tm.graph.input] == (
        ["x", tname] + names + [f"{p}_grad.accumulation.buffer" for p in names] + ["lazy_reset_grad"]
    )
    assert [v.name for v in tm.graph.output][1:] == [f"{p}_grad.accumulation.out" for p in names]
    out = RUNNERS[runner](tm, training_feeds(tm, {"x": x, tname: target}, params))
    ref_loss, ref_grads = torch_grads(module, x, lambda y: torch_loss(loss, y, target))
    loss_val = out[tm.graph.output[0].name]
    assert loss_val.shape == () and loss_val.dtype == np.float32
    close(loss_val, ref_loss)
    for p in names:
        close(out[f"{p}_grad.accumulation.out"], ref_grads[p])


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_gradient_accumulation_unless_reset(mlp, tmp_path, runner):
    model, x, _ = mlp
    params = initializers(model)
    generate_artifacts(
        model,
        requires_grad=["net.5.weight", "net.5.bias"],
        loss=LossType.MSELoss,
        artifact_directory=tmp_path,
    )
    tm = load(tmp_path, "training_model.onnx")
    target = np.random.default_rng(2).standard_normal((BATCH, 10)).astype(np.float32)
    g1 = RUNNERS[runner](tm, training_feeds(tm, {"x": x, "target": target}, params))
    bufs = {p: g1[f"{p}_grad.accumulation.out"] for p in ("net.5.weight", "net.5.bias")}
    g2 = RUNNERS[runner](
        tm, training_feeds(tm, {"x": x, "target": target}, params, reset=False, buffers=bufs)
    )
    g3 = RUNNERS[runner](tm, training_feeds(tm, {"x": x, "target": target}, params, reset=True, buffers=bufs))
    for p, b in bufs.items():
        close(g2[f"{p}_grad.accumulation.out"], 2 * b)  # accumulated
        close(g3[f"{p}_grad.accumulation.out"], b)  # overwritten


# ---- eval graph --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("runner", list(RUNNERS))
def test_eval_graph(mlp, tmp_path, runner):
    model, x, module = mlp
    params = initializers(model)
    generate_artifacts(
        model,
        requires_grad=list(params),
        loss=LossType.CrossEntropyLoss,
        additional_output_names=["logits"],
        artifact_directory=tmp_path,
    )
    em = load(tmp_path, "eval_model.onnx")
    assert_standard(em)
    assert [v.name for v in em.graph.input] == ["x", "labels", *params]
    assert [v.name for v in em.graph.output][1:] == ["logits"]
    labels = np.arange(BATCH, dtype=np.int64) % 10
    out = RUNNERS[runner](em, {"x": x, "labels": labels, **params})
    with torch.no_grad():
        logits = module(torch.from_numpy(x))
    close(out["logits"], logits.numpy())
    close(
        out[em.graph.output[0].name],
        torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)).item(),
    )


def test_eval_graph_switches_dropout_and_batchnorm_off(tmp_path):
    model, feeds, module = export("lenet_bn", training=True, batch=3)
    params = initializers(model)
    trainable = [n for n in params if "running" not in n and "num_batches" not in n]
    frozen = [n for n in params if "running" in n]
    generate_artifacts(
        model,
        requires_grad=trainable,
        frozen_params=frozen,
        loss=LossType.CrossEntropyLoss,
        additional_output_names=["logits"],
        artifact_directory=tmp_path,
    )
    em = load(tmp_path, "eval_model.onnx")
    assert_standard(em)
    for n in em.graph.node:
        if n.op_type == "BatchNormalization":
            assert len(n.output) == 1 and helper.get_node_attr_value(n, "training_mode") == 0
        if n.op_type == "Dropout":
            assert len(n.input) < 3 or n.input[2] == ""  # training_mode omitted: inference
    labels = np.array([1, 2, 3], dtype=np.int64)
    module.eval()
    with torch.no_grad():
        ref = module(torch.from_numpy(feeds["x"])).numpy()
    for runner in RUNNERS.values():
        out = runner(em, {"x": feeds["x"], "labels": labels, **params})
        close(out["logits"], ref, rtol=1e-4)
    tm = load(tmp_path, "training_model.onnx")
    assert_standard(tm)


# ---- optimizer graph vs a float64 reference of spec §1.8 ---------------------------------------------------
def adamw_reference(p, g, m, v, lr, t, betas=(0.9, 0.999), eps=1e-6, wd=0.0, bias_correction=True,
                    float32_betas=True):
    """The formula in float64, with the betas onnxruntime-training's AdamW holds for a float32 model: float32
    attributes (its kernel's 1.f - beta is exact for them; 1 - 0.999 in float64 rounds to another float32
    than 1 - 0.999f); a float64 model's update takes them as given."""
    p, g, m, v = (np.asarray(a, np.float64) for a in (p, g, m, v))
    b1, b2 = (float(np.float32(b)) for b in betas) if float32_betas else betas
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t) if bias_correction else lr
    p = p - lr_t * m / (np.sqrt(v) + eps)
    p = p - lr * wd * p
    return p, m, v


def clip_reference(grads, max_norm):
    norm = np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in grads))
    coef = min(max_norm / (norm + 1e-6), 1.0)
    return [np.asarray(g, np.float64) * coef for g in grads]


def optimizer_feeds(
    om: onnx.ModelProto,
    params: dict[str, np.ndarray],
    rng: np.random.Generator,
    lr: float,
    t: int,
    gscale: float = 1.0,
) -> dict[str, np.ndarray]:
    feeds: dict[str, np.ndarray] = {
        "learning_rate": np.array([lr], np.float32),
        "step": np.array([t], np.int64),
    }
    for v in om.graph.input:
        if v.name in params:
            feeds[v.name] = params[v.name]
        elif v.name.endswith("_grad"):
            feeds[v.name] = (gscale * rng.standard_normal(params[v.name[:-5]].shape)).astype(np.float32)
        elif v.name.endswith(".momentum0"):
            feeds[v.name] = (0.1 * rng.standard_normal(params[v.name[:-10]].shape)).astype(np.float32)
        elif v.name.endswith(".momentum1"):
            feeds[v.name] = (0.01 * rng.random(params[v.name[:-10]].shape)).astype(np.float32)
    return feeds


ADAMW_CASES = {
    "defaults": dict(kw={}, ref={}),
    "custom": dict(
        kw=dict(betas=(0.8, 0.95), eps=1e-3, weight_decay=0.1), ref=dict(betas=(0.8, 0.95), eps=1e-3, wd=0.1)
    ),
    "no_bias_correction": dict(
        kw=dict(bias_correction=False, weight_decay=0.01), ref=dict(bias_correction=False, wd=0.01)
    ),
}


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("case", list(ADAMW_CASES))
def test_adamw_step_matches_reference(mlp, tmp_path, case, runner):
    model, _, _ = mlp
    params = initializers(model)
    opt = OptimType.AdamW if case == "defaults" else onnxblock.optim.AdamW(**ADAMW_CASES[case]["kw"])
    generate_artifacts(
        model, requires_grad=list(params), loss=LossType.MSELoss, optimizer=opt, artifact_directory=tmp_path
    )
    om = load(tmp_path, "optimizer_model.onnx")
    assert_standard(om)
    names = list(params)
    assert [v.name for v in om.graph.input] == (
        ["learning_rate", "step"]
        + names
        + [f"{p}_grad" for p in names]
        + [f"{p}.momentum0" for p in names]
        + [f"{p}.momentum1" for p in names]
    )
    assert [v.name for v in om.graph.output] == (
        [f"{p}.out" for p in names]
        + [f"{p}.momentum0.out" for p in names]
        + [f"{p}.momentum1.out" for p in names]
    )
    assert {p.key: p.value for p in om.metadata_props}["onnxtrain.optimizer"] == "AdamW"
    feeds = optimizer_feeds(om, params, np.random.default_rng(3), lr=0.05, t=3)
    out = RUNNERS[runner](om, feeds)
    for p in names:
        rp, rm, rv = adamw_reference(
            feeds[p],
            feeds[f"{p}_grad"],
            feeds[f"{p}.momentum0"],
            feeds[f"{p}.momentum1"],
            0.05,
            3,
            **ADAMW_CASES[case]["ref"],
        )
        close(out[f"{p}.out"], rp, rtol=1e-6)
        close(out[f"{p}.momentum0.out"], rm, rtol=1e-6)
        close(out[f"{p}.momentum1.out"], rv, rtol=1e-6)


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_sgd_step_matches_reference(mlp, tmp_path, runner):
    model, _, _ = mlp
    params = initializers(model)
    generate_artifacts(
        model,
        requires_grad=["net.3.weight", "net.5.bias"],
        loss=LossType.MSELoss,
        optimizer=OptimType.SGD,
        artifact_directory=tmp_path,
    )
    om = load(tmp_path, "optimizer_model.onnx")
    assert_standard(om)
    names = ["net.3.weight", "net.5.bias"]
    assert [v.name for v in om.graph.input] == (
        ["learning_rate", "step"] + names + [f"{p}_grad" for p in names] + [f"{p}.momentum0" for p in names]
    )
    assert [v.name for v in om.graph.output] == [f"{p}.out" for p in names]
    feeds = optimizer_feeds(om, params, np.random.default_rng(4), lr=0.1, t=1)
    out = RUNNERS[runner](om, feeds)
    for p in names:
        close(out[f"{p}.out"], np.float64(feeds[p]) - 0.1 * np.float64(feeds[f"{p}_grad"]), rtol=1e-6)


@pytest.mark.parametrize("runner", list(RUNNERS))
@pytest.mark.parametrize("opt", ["AdamW", "SGD"])
def test_clip_grad_norm(mlp, tmp_path, opt, runner):
    model, _, _ = mlp
    params = initializers(model)
    clip = onnxblock.optim.ClipGradNorm(0.5)
    block = onnxblock.optim.AdamW(clip_grad=clip) if opt == "AdamW" else onnxblock.optim.SGD(clip_grad=clip)
    generate_artifacts(
        model, requires_grad=list(params), loss=LossType.MSELoss, optimizer=block, artifact_directory=tmp_path
    )
    om = load(tmp_path, "optimizer_model.onnx")
    assert_standard(om)
    names = list(params)
    assert [v.name for v in om.graph.output][-len(names) :] == [f"{p}_grad.out" for p in names]
    feeds = optimizer_feeds(om, params, np.random.default_rng(5), lr=0.01, t=2)
    out = RUNNERS[runner](om, feeds)
    clipped = clip_reference([feeds[f"{p}_grad"] for p in names], 0.5)
    for p, g in zip(names, clipped):
        close(out[f"{p}_grad.out"], g, rtol=1e-6)
        if opt == "SGD":
            ref = np.float64(feeds[p]) - 0.01 * g
        else:
            ref = adamw_reference(feeds[p], g, feeds[f"{p}.momentum0"], feeds[f"{p}.momentum1"], 0.01, 2)[0]
        close(out[f"{p}.out"], ref, rtol=1e-6)


def test_names_may_come_in_any_iterable(tmp_path):
    """requires_grad and frozen_params as a set, dict keys or a generator, as onnxruntime-training took them:
    the same artifacts as lists give."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])
    inits = [numpy_helper.from_array(np.ones((3, 2), np.float32), "w"),
             numpy_helper.from_array(np.zeros(2, np.float32), "b")]
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["m"]),
                               helper.make_node("Add", ["m", "b"], ["y"])], "g", [x], [y], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    made = []
    kinds = [(["w"], ["b"]), ({"w"}, {"b": 0}.keys()), ((n for n in ["w"]), iter(["b"]))]
    for k, (req, frozen) in enumerate(kinds):
        folder = tmp_path / str(k)
        folder.mkdir()
        generate_artifacts(model, requires_grad=req, frozen_params=frozen, loss=LossType.MSELoss,
                           optimizer=OptimType.AdamW, artifact_directory=folder)
        made.append(load(folder, "training_model.onnx").SerializeToString())
    assert made[0] == made[1] == made[2]
    with pytest.raises(ArtifactError, match="Expected a list of tensor names"):
        generate_artifacts(model, requires_grad="w", loss=LossType.MSELoss, artifact_directory=tmp_path)


def test_adamw_float64_parameters(tmp_path):
    x = helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["batch", 2])
    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal((3, 2)), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    generate_artifacts(
        model,
        requires_grad=["w"],
        loss=LossType.MSELoss,
        optimizer=OptimType.AdamW,
        artifact_directory=tmp_path,
    )
    om, tm = load(tmp_path, "optimizer_model.onnx"), load(tmp_path, "training_model.onnx")
    assert_standard(om)
    assert_standard(tm)
    feeds = optimizer_feeds(om, {"w": numpy_helper.to_array(w)}, np.random.default_rng(1), lr=0.01, t=5)
    feeds = {
        k: (v.astype(np.float64) if v.dtype == np.float32 and k != "learning_rate" else v)
        for k, v in feeds.items()
    }
    out = run_engine(om, feeds)
    lr = float(np.float32(0.01))  # learning_rate is FLOAT[1]
    rp, _, _ = adamw_reference(feeds["w"], feeds["w_grad"], feeds["w.momentum0"], feeds["w.momentum1"], lr, 5,
                               float32_betas=False)
    assert out["w.out"].dtype == np.float64
    close(out["w.out"], rp, rtol=1e-12)


# ---- checkpoint, frozen parameters, classification ---------------------------------------------------------
def test_frozen_params_and_checkpoint(mlp, tmp_path):
    model, x, module = mlp
    params = initializers(model)
    trainable, frozen = ["net.3.weight", "net.5.weight", "net.5.bias"], ["net.1.weight", "net.1.bias"]
    generate_artifacts(
        model,
        requires_grad=trainable[::-1],
        frozen_params=frozen,
        loss=LossType.MSELoss,
        optimizer=OptimType.SGD,
        artifact_directory=tmp_path,
        prefix="my_",
        nominal_checkpoint=True,
    )
    assert sorted(os.listdir(tmp_path)) == [
        "my_checkpoint",
        "my_eval_model.onnx",
        "my_nominal_checkpoint",
        "my_optimizer_model.onnx",
        "my_training_model.onnx",
    ]
    tm = load(tmp_path, "training_model.onnx", "my_")
    # initializer order, not the order of the lists
    params_in = ["net.1.weight", "net.1.bias", "net.3.weight", "net.5.weight", "net.5.bias"]
    assert [v.name for v in tm.graph.input] == (
        ["x", "target"]
        + params_in
        + [f"{p}_grad.accumulation.buffer" for p in trainable]
        + ["lazy_reset_grad"]
    )
    assert [t.name for t in tm.graph.initializer] == ["net.3.bias"]  # neither list: stays a constant
    ckpt = load_checkpoint(tmp_path / "my_checkpoint")
    assert sorted(ckpt.trainable) == sorted(trainable) and sorted(ckpt.frozen) == sorted(frozen)
    for n, v in {**ckpt.trainable, **ckpt.frozen}.items():
        np.testing.assert_array_equal(v, params[n])
    assert not ckpt.nominal and ckpt.optimizer_groups == [] and ckpt.properties == {}
    nominal = load_checkpoint(tmp_path / "my_nominal_checkpoint")
    assert nominal.nominal and sorted(nominal.trainable) == sorted(trainable)
    target = np.random.default_rng(6).standard_normal((BATCH, 10)).astype(np.float32)
    out = run_engine(tm, training_feeds(tm, {"x": x, "target": target}, params))
    _, ref = torch_grads(module, x, lambda y: torch.nn.functional.mse_loss(y, torch.from_numpy(target)))
    assert [o.name for o in tm.graph.output][1:] == [f"{p}_grad.accumulation.out" for p in trainable]
    for p in trainable:
        close(out[f"{p}_grad.accumulation.out"], ref[p])


def two_output_model() -> onnx.ModelProto:
    """x[batch,4] → hidden = x·W1ᵀ + b1 → out = relu(hidden)·W2ᵀ + b2; outputs (out, hidden)."""
    rng = np.random.default_rng(7)
    inits = [
        numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
        for n, s in [("W1", (8, 4)), ("b1", (8,)), ("W2", (3, 8)), ("b2", (3,))]
    ]
    nodes = [
        helper.make_node("Gemm", ["x", "W1", "b1"], ["hidden"], transB=1),
        helper.make_node("Relu", ["hidden"], ["h"]),
        helper.make_node("Gemm", ["h", "W2", "b2"], ["out"], transB=1),
    ]
    graph = helper.make_graph(
        nodes,
        "two",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 4])],
        [
            helper.make_tensor_value_info("out", TensorProto.FLOAT, ["batch", 3]),
            helper.make_tensor_value_info("hidden", TensorProto.FLOAT, ["batch", 8]),
        ],
        inits,
    )
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def torch_two_output(model: onnx.ModelProto) -> tuple[dict[str, torch.Tensor], callable]:
    w = {n: torch.tensor(v, requires_grad=True) for n, v in initializers(model).items()}

    def fwd(x: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = torch.from_numpy(x) @ w["W1"].T + w["b1"]
        return torch.relu(hidden) @ w["W2"].T + w["b2"], hidden

    return w, fwd


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_loss_input_names_and_additional_outputs(tmp_path, runner):
    model = two_output_model()
    generate_artifacts(
        model,
        requires_grad=["W1", "b1", "W2", "b2"],
        loss=LossType.MSELoss,
        loss_input_names=["out"],
        additional_output_names=["hidden", "h"],
        artifact_directory=tmp_path,
    )
    tm, em = load(tmp_path, "training_model.onnx"), load(tmp_path, "eval_model.onnx")
    assert [v.name for v in tm.graph.input][:2] == ["x", "target"]
    assert [v.name for v in tm.graph.output][1:3] == ["hidden", "h"]
    assert [v.name for v in em.graph.output][1:] == ["hidden", "h"]
    rng = np.random.default_rng(8)
    x = rng.standard_normal((BATCH, 4)).astype(np.float32)
    target = rng.standard_normal((BATCH, 3)).astype(np.float32)
    w, fwd = torch_two_output(model)
    out_t, hidden_t = fwd(x)
    loss_t = torch.nn.functional.mse_loss(out_t, torch.from_numpy(target))
    loss_t.backward()
    out = RUNNERS[runner](tm, training_feeds(tm, {"x": x, "target": target}, initializers(model)))
    close(out[tm.graph.output[0].name], loss_t.item())
    close(out["hidden"], hidden_t.detach().numpy())
    close(out["h"], torch.relu(hidden_t).detach().numpy())
    for n, p in w.items():
        close(out[f"{n}_grad.accumulation.out"], p.grad.numpy())


def test_pass_through_loss(tmp_path):
    """loss=None: the model's first output is already the scalar loss and is differentiated."""
    model, feeds, module = export("mlp", training=True, with_loss=True, batch=BATCH)
    params = initializers(model)
    generate_artifacts(
        model, requires_grad=list(params), optimizer=OptimType.SGD, artifact_directory=tmp_path
    )
    tm = load(tmp_path, "training_model.onnx")
    assert_standard(tm)
    assert tm.graph.output[0].name == "loss"
    out = run_engine(tm, training_feeds(tm, feeds, params))
    module.zero_grad()
    ref = module(*(torch.from_numpy(v) for v in feeds.values()))
    ref.backward()
    close(out["loss"], ref.item())
    for n, p in module.named_parameters():
        close(out[f"{n}_grad.accumulation.out"], p.grad.numpy())


class TwoHeadLoss(onnxblock.Block):
    """MSE on the first output plus 0.5·L1 on the second (the custom loss of spec §1.9)."""

    def __init__(self) -> None:
        super().__init__()
        self.mse = onnxblock.loss.MSELoss()
        self.l1 = onnxblock.loss.L1Loss()
        self.add = onnxblock.blocks.Add()
        self.mul = onnxblock.blocks.Mul()
        self.half = onnxblock.blocks.Constant(0.5)

    def build(self, out_name: str, hidden_name: str) -> str:
        return self.add(
            self.mse(out_name, target_name="target_out"),
            self.mul(self.half(), self.l1(hidden_name, target_name="target_hidden")),
        )


@pytest.mark.parametrize("runner", list(RUNNERS))
def test_custom_block_loss(tmp_path, runner):
    model = two_output_model()
    generate_artifacts(
        model,
        requires_grad=["W1", "b1", "W2", "b2"],
        loss=TwoHeadLoss(),
        optimizer=OptimType.AdamW,
        artifact_directory=tmp_path,
    )
    tm = load(tmp_path, "training_model.onnx")
    assert_standard(tm)
    assert [v.name for v in tm.graph.input][:3] == ["x", "target_out", "target_hidden"]
    assert tm.graph.output[0].name.startswith("onnx::add_output::")
    rng = np.random.default_rng(9)
    x = rng.standard_normal((BATCH, 4)).astype(np.float32)
    t_out = rng.standard_normal((BATCH, 3)).astype(np.float32)
    t_hid = rng.standard_normal((BATCH, 8)).astype(np.float32)
    w, fwd = torch_two_output(model)
    o, h = fwd(x)
    ref = torch.nn.functional.mse_loss(o, torch.from_numpy(t_out)) + 0.5 * torch.nn.functional.l1_loss(
        h, torch.from_numpy(t_hid)
    )
    ref.backward()
    out = RUNNERS[runner](
        tm, training_feeds(tm, {"x": x, "target_out": t_out, "target_hidden": t_hid}, initializers(model))
    )
    loss = out[tm.graph.output[0].name]
    assert loss.shape == ()
    close(loss, ref.item())
    for n, p in w.items():
        close(out[f"{n}_grad.accumulation.out"], p.grad.numpy())


# ---- errors ------------------------------------------------------------------------------------------------
def test_error_optimizer_without_trainable_parameter(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(ArtifactError, match="no parameter requires a gradient"):
        generate_artifacts(
            model, loss=LossType.MSELoss, optimizer=OptimType.AdamW, artifact_directory=tmp_path
        )
    with pytest.raises(ArtifactError, match="no parameter requires a gradient"):
        generate_artifacts(
            model,
            requires_grad=[],
            frozen_params=["net.1.weight"],
            loss=LossType.MSELoss,
            optimizer=OptimType.SGD,
            artifact_directory=tmp_path,
        )
    assert os.listdir(tmp_path) == []


def test_non_scalar_differentiated_output_warns_without_a_loss(mlp, tmp_path):
    """No loss block and a model output of many elements: its sum is differentiated, with a warning; a
    loss block with reduction="none" is differentiated the same way without one (tests/training/
    test_compat_nonscalar_loss.py checks the values against torch)."""
    model, _, _ = mlp
    with pytest.warns(UserWarning, match=r"'logits' has shape \['batch', 10\].*sum of its elements"):
        generate_artifacts(model, requires_grad=["net.5.bias"], artifact_directory=tmp_path)
    generate_artifacts(model, requires_grad=["net.5.bias"], loss=onnxblock.loss.MSELoss(reduction="none"),
                       artifact_directory=tmp_path)
    assert os.path.exists(tmp_path / "training_model.onnx")


def test_error_unreachable_parameter(tmp_path):
    model = two_output_model()
    with pytest.raises(ArtifactError, match=r"partial derivative for 'W2', 'b2' as it's unreachable"):
        generate_artifacts(
            model,
            requires_grad=["W1", "W2", "b2"],
            loss=LossType.MSELoss,
            loss_input_names=["hidden"],
            artifact_directory=tmp_path,
        )


def test_ort_format_writes_ort_copies_and_custom_op_library_is_an_error(mlp, tmp_path, capfd):
    """``ort_format=True``: besides the .onnx artifacts, their .ort copies and required-operator configs by
    onnxruntime's converter, as onnxruntime-training wrote them; onnxruntime (the oracle) runs the .ort eval
    model to the .onnx one's outputs. A custom op library is refused."""
    model, _, _ = mlp
    with pytest.warns(UserWarning, match="onnxruntime-training cannot train the .ort training"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            optimizer=OptimType.AdamW,
            ort_format=True,
            artifact_directory=tmp_path,
        )
    assert "Created config" not in capfd.readouterr().err  # the converter's log lines are silenced
    written = {p.name for p in tmp_path.iterdir()}
    for name in ("training_model", "eval_model", "optimizer_model"):
        assert {f"{name}.onnx", f"{name}.ort", f"{name}.required_operators.config"} <= written, written
        config = (tmp_path / f"{name}.required_operators.config").read_text()
        assert str(tmp_path / f"{name}.ort") in config, config  # the .ort's own path, not a temporary
    cpu = ["CPUExecutionProvider"]
    plain = ort.InferenceSession(str(tmp_path / "eval_model.onnx"), providers=cpu)
    flat = ort.InferenceSession(str(tmp_path / "eval_model.ort"), providers=cpu)
    rng = np.random.default_rng(0)
    feeds = {}
    for i in plain.get_inputs():
        shape = [d if isinstance(d, int) else 3 for d in i.shape]
        feeds[i.name] = rng.standard_normal(shape).astype(np.float32)
    for a, b in zip(plain.run(None, feeds), flat.run(None, feeds)):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    with pytest.raises(ArtifactError, match="custom_op_library=.* is not supported"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            custom_op_library="libcustom.so",
            artifact_directory=tmp_path,
        )


def test_ort_format_files_are_staged_with_the_others(mlp, tmp_path, monkeypatch):
    """The .ort files are renamed into place with the .onnx ones: a converter failing on the second model
    leaves the folder's earlier generation as it was (no new .onnx beside old .ort files); a run that
    succeeds replaces all of them and shows none of the converter's unclosed-file warnings."""
    from onnxruntime.tools import convert_onnx_models_to_ort as converter

    model, _, _ = mlp
    kw = dict(requires_grad=["net.5.bias"], loss=LossType.MSELoss, optimizer=OptimType.AdamW, ort_format=True,
              artifact_directory=tmp_path)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        generate_artifacts(model, **kw)
    assert not [w for w in seen if issubclass(w.category, ResourceWarning)], [str(w.message) for w in seen]
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    real, calls = converter.convert_onnx_models_to_ort, []

    def failing(path, **kwargs):
        calls.append(path)
        if len(calls) == 2:
            raise RuntimeError("converter failed")
        return real(path, **kwargs)

    monkeypatch.setattr(converter, "convert_onnx_models_to_ort", failing)
    with pytest.raises(RuntimeError, match="converter failed"):
        generate_artifacts(model, **{**kw, "requires_grad": ["net.5.bias", "net.5.weight"]})
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before


def test_error_frozen_and_trainable(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(RuntimeError, match=r"cannot be frozen and require gradient.*net.5.bias"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            frozen_params=["net.5.bias"],
            loss=LossType.MSELoss,
            artifact_directory=tmp_path,
        )


def test_error_unknown_parameter_name(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(ArtifactError, match=r"requires_grad names \['nope'\] that are not initializers"):
        generate_artifacts(model, requires_grad=["nope"], loss=LossType.MSELoss, artifact_directory=tmp_path)


def test_error_unknown_loss_and_optimizer_types(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(RuntimeError, match="Unknown loss provided"):
        generate_artifacts(model, requires_grad=["net.5.bias"], loss="mse", artifact_directory=tmp_path)
    with pytest.raises(TypeError, match="Unknown optimizer provided"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            optimizer="adamw",
            artifact_directory=tmp_path,
        )
    with pytest.raises(RuntimeError, match="Unknown model type"):
        generate_artifacts(
            42, requires_grad=["net.5.bias"], loss=LossType.MSELoss, artifact_directory=tmp_path
        )


def test_errors_say_what_to_do_with_torch_exports(mlp, tmp_path):
    """A torch export whose parameters are not found names the exporter options that keep them; torch's
    ONNXProgram is refused with the attribute to pass instead."""
    model, _, _ = mlp
    assert model.producer_name == "pytorch"
    with pytest.raises(RuntimeError, match=r"not initializers of the model.*optimize=False"):
        generate_artifacts(model, requires_grad=["fc1.weight"], loss=LossType.MSELoss,
                           artifact_directory=tmp_path)

    class Program:  # what torch.onnx.export(..., dynamo=True) returns
        model_proto = model

    with pytest.raises(RuntimeError, match=r"Unknown model type Program.*pass its \.model_proto"):
        generate_artifacts(Program(), requires_grad=["net.5.bias"], loss=LossType.MSELoss,
                           artifact_directory=tmp_path)


def test_error_integer_parameter(tmp_path):
    """An integer initializer in requires_grad (a Reshape's shape) is refused by type, not as unreachable."""
    nodes = [helper.make_node("Reshape", ["x", "shape"], ["xr"]),
             helper.make_node("MatMul", ["xr", "W"], ["y"])]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(np.array([2, 4], np.int64), "shape"),
         numpy_helper.from_array(np.ones((4, 3), np.float32), "W")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    with pytest.raises(RuntimeError, match=r"\['shape'\], initializers of type \['INT64'\]: only float"):
        generate_artifacts(model, requires_grad=["W", "shape"], loss=LossType.MSELoss,
                           artifact_directory=tmp_path)


def test_error_additional_output_names(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(RuntimeError, match="Unknown type provided for additional output names"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            additional_output_names="logits",
            artifact_directory=tmp_path,
        )
    with pytest.raises(
        LookupError, match="The provided name nope is not a graph value info or a graph output"
    ):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            additional_output_names=["nope"],
            artifact_directory=tmp_path,
        )
    with pytest.raises(RuntimeError, match=r"additional_output_names repeats \['logits'\]"):
        generate_artifacts(model, requires_grad=["net.5.bias"], loss=LossType.MSELoss,
                           additional_output_names=["logits", "logits"], artifact_directory=tmp_path)


def test_error_missing_directory_and_model_file(mlp, tmp_path):
    model, _, _ = mlp
    with pytest.raises(FileNotFoundError, match="does_not_exist"):
        generate_artifacts(
            model,
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            artifact_directory=tmp_path / "does_not_exist" / "sub",
        )
    with pytest.raises(FileNotFoundError, match="nope.onnx"):
        generate_artifacts(
            str(tmp_path / "nope.onnx"),
            requires_grad=["net.5.bias"],
            loss=LossType.MSELoss,
            artifact_directory=tmp_path,
        )


def test_error_loss_block_arity(tmp_path):
    """A two-argument build() on a one-output model (onnxruntime issue #19008) gets a clear message."""

    class Two(onnxblock.Block):
        def build(self, a, b):
            return a

    model, _, _ = export("mlp", training=True)
    with pytest.raises(ArtifactError, match=r"cannot take the 1 loss input\(s\) \['logits'\]"):
        generate_artifacts(model, requires_grad=["net.5.bias"], loss=Two(), artifact_directory=tmp_path)


def test_model_from_path(mlp, tmp_path):
    model, _, _ = mlp
    onnx.save(model, tmp_path / "mlp.onnx")
    out = tmp_path / "out"
    out.mkdir()
    generate_artifacts(
        str(tmp_path / "mlp.onnx"), requires_grad=["net.5.bias"], loss=LossType.L1Loss, artifact_directory=out
    )
    assert sorted(os.listdir(out)) == ["checkpoint", "eval_model.onnx", "training_model.onnx"]


def test_error_builtin_loss_on_multi_output_model_needs_loss_input_names(tmp_path):
    with pytest.raises(ArtifactError, match=r"2 outputs \['out', 'hidden'\] .* loss_input_names"):
        generate_artifacts(
            two_output_model(), requires_grad=["W1"], loss=LossType.MSELoss, artifact_directory=tmp_path
        )


def test_cross_entropy_on_sequence_logits_matches_torch(tmp_path):
    """[B, T, V] logits with [B, T] labels: CrossEntropyLoss(class_axis=-1) moves the classes to axis 1 for
    SoftmaxCrossEntropyLoss (LossType.CrossEntropyLoss takes them on axis 1, as onnxruntime's kernel)."""
    model, feeds, module = export("gpt_block", training=True, batch=2, dropout=0.0)
    params = initializers(model)
    trainable = [n for n in params if n in dict(module.named_parameters())]
    generate_artifacts(
        model,
        requires_grad=trainable,
        loss=onnxblock.loss.CrossEntropyLoss(class_axis=-1),
        optimizer=OptimType.AdamW,
        artifact_directory=tmp_path,
    )
    tm = load(tmp_path, "training_model.onnx")
    assert_standard(tm)
    labels = np.random.default_rng(10).integers(0, 40, (2, 10)).astype(np.int64)
    ref_loss, ref = torch_grads(
        module,
        feeds["tokens"],
        lambda y: torch.nn.functional.cross_entropy(
            y.reshape(-1, y.shape[-1]), torch.from_numpy(labels).reshape(-1)
        ),
    )
    for runner in RUNNERS.values():
        out = runner(tm, training_feeds(tm, {"tokens": feeds["tokens"], "labels": labels}, params))
        close(out[tm.graph.output[0].name], ref_loss)
        for p in trainable:
            close(out[f"{p}_grad.accumulation.out"], ref[p], rtol=1e-4)


def test_error_parameter_reaching_the_loss_only_through_shape(tmp_path):
    """B is an ancestor of the loss, but only through Shape: no gradient flows, so it is named."""
    inits = [
        numpy_helper.from_array(np.ones((3, 2), np.float32), "W"),
        numpy_helper.from_array(np.ones(4, np.float32), "B"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "W"], ["y"]),
        helper.make_node("ReduceSum", ["y"], ["s"], keepdims=0),
        helper.make_node("Shape", ["B"], ["shape"]),
        helper.make_node("Cast", ["shape"], ["shape_f"], to=TensorProto.FLOAT),
        helper.make_node("ReduceSum", ["shape_f"], ["n"], keepdims=0),
        helper.make_node("Add", ["s", "n"], ["loss"]),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    # the message names the node that cuts the path (here an op without a gradient)
    with pytest.raises(ArtifactError, match=r"derivative for 'B' as it's unreachable.*'shape' \(Shape\)"):
        generate_artifacts(model, requires_grad=["W", "B"], artifact_directory=tmp_path)
    generate_artifacts(model, requires_grad=["W"], frozen_params=["B"], artifact_directory=tmp_path)


def test_files_of_an_earlier_generation_are_named_in_a_warning(tmp_path):
    """A folder generated into twice, the second time without an optimizer: the earlier optimizer model stays
    (as onnxruntime-training leaves it) and does not go with the new training model: a warning names it."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    generate_artifacts(model, requires_grad=["w"], loss=LossType.MSELoss, optimizer=OptimType.AdamW,
                       artifact_directory=tmp_path)
    with pytest.warns(UserWarning, match=r"also holds \['optimizer_model.onnx'\] from an earlier generation"):
        generate_artifacts(model, requires_grad=["w"], loss=LossType.L1Loss, artifact_directory=tmp_path)
    assert (tmp_path / "optimizer_model.onnx").exists()


def test_an_artifact_directory_that_is_a_file_is_named_so(mlp, tmp_path):
    model = mlp[0]
    path = tmp_path / "taken"
    path.write_text("")  # it said "does not exist"
    trained = [t.name for t in model.graph.initializer][:1]
    with pytest.raises(NotADirectoryError, match="artifact_directory is a file, not a folder"):
        generate_artifacts(model, trained, loss=LossType.MSELoss, artifact_directory=str(path))
