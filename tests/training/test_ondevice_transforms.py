"""Issue 7 item 4: mixed precision (loss scaling), recompute and clipping from the on-device API.

``generate_artifacts(..., mixed_precision=..., recompute=...)`` → Module/Optimizer: float16 and bfloat16
training within 2 % of float32, a forced overflow skips the step, clipping in the loss-scaled domain,
recompute bit-identical with a lower peak, and every graph checked by onnx.checker and run by
onnxruntime (or onnx.reference where onnxruntime's CPU provider has no bfloat16 kernels).
"""

from __future__ import annotations

import os
import warnings

import numpy as np
import onnx
import onnx.reference
import pytest

from onnxtrain.engine.plan import compile_model
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler, LossScaler
from onnxtrain.training import artifacts, onnxblock
from onnxtrain.training.api import CheckpointState, Module, Optimizer, TrainingSession

torch = pytest.importorskip("torch")
from tests.models import TransformerEncoder, export, export_module  # noqa: E402

HALF = ["float16", "bfloat16"]
TOL = {"float16": 1e-2, "bfloat16": 5e-2}  # relative, on a loss of order 1


# ---- helpers ---------------------------------------------------------------------------------------------
def mlp_model() -> onnx.ModelProto:
    model, _, _ = export("mlp", training=False)
    return model


def generate(folder: str, model: onnx.ModelProto, optimizer: object = artifacts.OptimType.AdamW,
             **extensions: object) -> str:
    params = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    os.makedirs(folder, exist_ok=True)
    artifacts.generate_artifacts(model, requires_grad=params, loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=optimizer, artifact_directory=folder, **extensions)
    return folder


def open_set(folder: str, **module_kw: object) -> tuple[CheckpointState, Module, Optimizer]:
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"), **module_kw)
    return state, module, Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)


def mlp_batch(i: int, n: int = 32) -> tuple[np.ndarray, np.ndarray]:
    """Batch ``i`` of 16 (labels: argmax of the first ten pixels, a quarter of them random)."""
    rng = np.random.default_rng(500 + i % 16)
    x = rng.standard_normal((n, 1, 28, 28), np.float32)
    y = x.reshape(n, -1)[:, :10].argmax(1)
    noisy = rng.random(n) < 0.25
    y[noisy] = rng.integers(0, 10, int(noisy.sum()))
    return x, y.astype(np.int64)


def train(module: Module, opt: Optimizer, steps: int, batch=mlp_batch) -> tuple[list[float], list[bool]]:
    losses, flags = [], []
    for i in range(steps):
        losses.append(float(module(*batch(i))))  # one output: the loss
        opt.step()
        module.lazy_reset_grad()
        flags.append(opt.last_step_finite)
    return losses, flags


def moments(state: CheckpointState) -> dict[str, np.ndarray]:
    opt = state._optimizer_state()
    return {f"{p}.{k}": v.copy() for p, d in opt.moments.items() for k, v in d.items()}


def check_all(folder: str) -> None:
    for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(onnx.load(os.path.join(folder, f)), full_check=True)


@pytest.fixture(scope="module")
def mlp_sets(tmp_path_factory) -> dict[str | None, str]:
    model = mlp_model()
    root = tmp_path_factory.mktemp("mp")
    return {dt: generate(str(root / str(dt)), model, mixed_precision=dt) for dt in [None, *HALF]}


# ---- defaults and interface ---------------------------------------------------------------------------
def test_defaults_are_unchanged(tmp_path, mlp_sets):
    """Passing the extensions as None writes exactly the files written without them."""
    folder = generate(str(tmp_path / "none"), mlp_model(), mixed_precision=None, recompute=None)
    for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx", "checkpoint"):
        with open(os.path.join(folder, f), "rb") as a, open(os.path.join(mlp_sets[None], f), "rb") as b:
            assert a.read() == b.read(), f
    m = onnx.load(os.path.join(folder, "training_model.onnx"))
    assert "loss_scale" not in {i.name for i in m.graph.input}
    assert not any(p.key.startswith("onnxtrain.") for p in m.metadata_props)


@pytest.mark.parametrize("dtype", HALF)
def test_mixed_precision_interface(mlp_sets, dtype):
    folder = mlp_sets[dtype]
    check_all(folder)
    train_m = onnx.load(os.path.join(folder, "training_model.onnx"))
    opt_m = onnx.load(os.path.join(folder, "optimizer_model.onnx"))
    ins = [i.name for i in train_m.graph.input]
    assert ins[-1] == "lazy_reset_grad" and "loss_scale" in ins
    params = [n for n in ins if n.startswith("net.") and "_grad" not in n]
    assert ins.index("loss_scale") == ins.index(params[-1]) + 1  # right after the parameters
    outs = train_m.graph.output
    assert outs[0].type.tensor_type.elem_type == onnx.TensorProto.FLOAT  # the unscaled float32 loss
    assert all(o.type.tensor_type.elem_type == onnx.TensorProto.FLOAT for o in outs)  # float32 gradients
    half = onnx.TensorProto.FLOAT16 if dtype == "float16" else onnx.TensorProto.BFLOAT16
    assert any(n.op_type == "Gemm" for n in train_m.graph.node)
    assert any(n.op_type == "Cast" and n.attribute[0].i == half for n in train_m.graph.node)
    assert [i.name for i in opt_m.graph.input][:3] == ["learning_rate", "step", "loss_scale"]
    assert opt_m.graph.output[-1].name == "all_gradients_finite"
    meta = {p.key for p in train_m.metadata_props} & {p.key for p in opt_m.metadata_props}
    assert "onnxtrain.loss_scaling" in meta
    # the eval model stays float32
    eval_m = onnx.load(os.path.join(folder, "eval_model.onnx"))
    assert not any(n.op_type == "Cast" for n in eval_m.graph.node)

    state, module, opt = open_set(folder)
    assert isinstance(module.loss_scaler, DynamicLossScaler) and module.loss_scaler.loss_scale == 2.0 ** 16
    assert module.input_names() == ["x", "labels"]
    sess = TrainingSession(state, *(os.path.join(folder, f"{k}_model.onnx") for k in ("training", "eval",
                                                                                    "optimizer")))
    assert sess.input_names(True) == ["x", "labels"]
    sess.train_step(list(mlp_batch(0)))
    sess.optimizer_step()
    assert sess.optimizer.last_step_finite is True and sess.optimizer.step_count == 1


def test_gradients_are_loss_scaled_and_accumulate_at_one_scale(mlp_sets):
    _, ref, _ = open_set(mlp_sets[None])
    state, module, opt = open_set(mlp_sets["float16"], loss_scaler=LossScaler(1024.0))
    x, y = mlp_batch(0)
    ref(x[:16], y[:16]), ref(x[16:], y[16:])
    module(x[:16], y[:16])
    module.loss_scaler.loss_scale = 4096.0  # ignored until the next accumulation starts
    module(x[16:], y[16:])
    for name, p in state.parameters:
        g32 = ref.state.parameters[name].grad
        assert np.abs(p.grad / 1024.0 - g32).max() <= 2e-2 * np.abs(g32).max() + 1e-6, name
    module.lazy_reset_grad()
    module(x, y)
    assert float(module._grad_loss_scale[0]) == 4096.0


# ---- training ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", HALF)
def test_200_adamw_steps_within_2_percent(mlp_sets, dtype):
    _, ref_m, ref_o = open_set(mlp_sets[None])
    ref_o.set_learning_rate(1e-3)
    ref, _ = train(ref_m, ref_o, 200)
    _, module, opt = open_set(mlp_sets[dtype])
    opt.set_learning_rate(1e-3)
    got, flags = train(module, opt, 200)
    last_ref, last = np.mean(ref[-10:]), np.mean(got[-10:])
    print(f"\nmlp {dtype}: loss {ref[0]:.4f} -> {last_ref:.4f} (float32), {last:.4f} (mixed, "
          f"{abs(last - last_ref) / last_ref:.2%} off); skipped {flags.count(False)}, "
          f"scale {module.loss_scaler.loss_scale}")
    assert last_ref < 0.8 * ref[0]
    assert abs(last - last_ref) <= 0.02 * last_ref
    assert opt.step_count == flags.count(True)


@pytest.mark.filterwarnings("error::RuntimeWarning")  # the overflow is silent: an inf, as in onnxruntime
@pytest.mark.parametrize("dtype", HALF)
@pytest.mark.parametrize("clip", [False, True])
def test_forced_overflow_skips_the_step(tmp_path, dtype, clip):
    """A huge loss scale: all_gradients_finite is false, parameters, moments, gradients and step_count keep
    their values, and the scaler halves; the next sane step goes through."""
    optimizer = onnxblock.optim.AdamW(clip_grad=onnxblock.optim.ClipGradNorm(1.0)) if clip else \
        artifacts.OptimType.AdamW
    folder = generate(str(tmp_path / "a"), mlp_model(), optimizer, mixed_precision=dtype)
    scaler = DynamicLossScaler(loss_scale=1024.0, up_scale_window=2)
    state, module, opt = open_set(folder, loss_scaler=scaler)
    train(module, opt, 3)  # moments are non-zero; the scale doubled once
    assert opt.step_count == 3 and scaler.loss_scale == 2048.0 and scaler.stable_steps == 1
    huge = 2.0 ** 127
    scaler.loss_scale = huge
    before = {n: p.data.copy() for n, p in state.parameters}
    m_before = moments(state)
    loss = module(*mlp_batch(3))
    assert np.isfinite(loss)  # the loss output is unscaled
    grads = {n: p.grad.copy() for n, p in state.parameters}
    opt.step()
    assert opt.last_step_finite is False
    assert opt.step_count == 3
    assert scaler.loss_scale == huge / 2 and scaler.stable_steps == 0
    for n, p in state.parameters:
        np.testing.assert_array_equal(p.data, before[n], err_msg=n)
        np.testing.assert_array_equal(p.grad, grads[n], err_msg=n)
    for k, v in moments(state).items():
        np.testing.assert_array_equal(v, m_before[k], err_msg=k)
    module.lazy_reset_grad()
    scaler.loss_scale = 1024.0
    module(*mlp_batch(4))
    opt.step()
    assert opt.last_step_finite is True and opt.step_count == 4
    assert any(not np.array_equal(p.data, before[n]) for n, p in state.parameters)
    # automatic_update=False: the optimizer leaves the scale to the caller, even after an overflow
    scaler.automatic_update = False
    scaler.loss_scale = huge
    module.lazy_reset_grad()
    module(*mlp_batch(5))
    opt.step()
    assert opt.last_step_finite is False and scaler.loss_scale == huge


@pytest.mark.parametrize("loss_scale", [1.0, 2.0 ** 12])
@pytest.mark.parametrize("grad_size", [1e-3, 10.0])  # under and over max_norm
def test_clipping_in_the_loss_scaled_domain(loss_scale, grad_size):
    """The mixed-precision optimizer model fed L·g and L equals the float32 one (ClipGradNorm) fed g."""
    from onnxtrain.engine import compile_model

    rng = np.random.default_rng(3)
    shapes = {"w": (5, 4), "b": (4,)}
    params = [(n, onnx.helper.make_tensor_type_proto(onnx.TensorProto.FLOAT, s)) for n, s in shapes.items()]
    models = {mp: artifacts.build_optimizer_model(
        onnxblock.optim.AdamW(weight_decay=0.01, clip_grad=onnxblock.optim.ClipGradNorm(0.5)), params, 17,
        mixed_precision=mp) for mp in (None, "float16")}
    for m in models.values():
        onnx.checker.check_model(m, full_check=True)
    feeds = {"learning_rate": np.array([0.1], np.float32), "step": np.array([3], np.int64)}
    for n, s in shapes.items():
        feeds[n] = rng.standard_normal(s).astype(np.float32)
        feeds[f"{n}_grad"] = (grad_size * rng.standard_normal(s)).astype(np.float32)
        feeds[f"{n}.momentum0"] = 0.1 * rng.standard_normal(s).astype(np.float32)
        feeds[f"{n}.momentum1"] = 0.1 * rng.random(s).astype(np.float32)
    ref = dict(zip([o.name for o in models[None].graph.output], compile_model(models[None]).run(feeds)))
    scaled = dict(feeds, loss_scale=np.array([loss_scale], np.float32))
    for n in shapes:
        scaled[f"{n}_grad"] = feeds[f"{n}_grad"] * np.float32(loss_scale)  # exact: a power of two
    mp = models["float16"]
    got = dict(zip([o.name for o in mp.graph.output], compile_model(mp).run(scaled)))
    assert bool(got.pop("all_gradients_finite"))
    for k, v in ref.items():
        want = v * np.float32(loss_scale) if k.endswith("_grad.out") else v  # clipped gradients stay scaled
        np.testing.assert_allclose(got[k], want, rtol=1e-6, atol=1e-7, err_msg=k)
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(mp.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, scaled)))
    assert bool(theirs.pop("all_gradients_finite"))
    for k, v in got.items():
        np.testing.assert_allclose(theirs[k], v, rtol=1e-6, atol=1e-7, err_msg=k)


def test_sgd_mixed_precision_unscales(tmp_path):
    """SGD under mixed precision divides by the loss scale: one step equals the float32 one closely."""
    model = mlp_model()
    f32 = generate(str(tmp_path / "f32"), model, artifacts.OptimType.SGD)
    f16 = generate(str(tmp_path / "f16"), model, artifacts.OptimType.SGD, mixed_precision="float16")
    runs = []
    for folder in (f32, f16):
        state, module, opt = open_set(folder)
        before = {n: p.data.copy() for n, p in state.parameters}
        opt.set_learning_rate(0.1)
        module(*mlp_batch(0))
        opt.step()
        runs.append({n: p.data - before[n] for n, p in state.parameters})
    for n, d in runs[0].items():
        assert np.abs(runs[1][n] - d).max() <= 2e-2 * np.abs(d).max(), n


# ---- onnxruntime / onnx.reference --------------------------------------------------------------------------
def _feeds(module: Module, x: np.ndarray, y: np.ndarray, loss_scale: float | None) -> dict[str, np.ndarray]:
    params = module.state._params
    feeds = {"x": x, "labels": y, "lazy_reset_grad": np.array([True])}
    for p in module._param_order:
        feeds[p] = params[p].data
    for p, buf in module._buffers.items():
        feeds[buf] = np.zeros_like(params[p].data)
    if loss_scale is not None:
        feeds["loss_scale"] = np.array([loss_scale], np.float32)
    return feeds


@pytest.mark.parametrize("dtype", [None, *HALF])
def test_other_runtimes_agree(mlp_sets, dtype):
    ort = pytest.importorskip("onnxruntime")
    folder = mlp_sets[dtype]
    check_all(folder)
    state, module, opt = open_set(folder)
    x, y = mlp_batch(0)
    scale = None if dtype is None else 256.0
    feeds = _feeds(module, x, y, scale)
    train_path = os.path.join(folder, "training_model.onnx")
    names = [o.name for o in onnx.load(train_path).graph.output]
    ours = dict(zip(names, module._train_plan.run(feeds, names)))
    if dtype == "bfloat16":
        # onnxruntime's CPU provider has no bfloat16 Gemm: onnx.reference is the second opinion
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = dict(zip(names, onnx.reference.ReferenceEvaluator(train_path).run(names, feeds)))
    else:
        sess = ort.InferenceSession(train_path, providers=["CPUExecutionProvider"])
        theirs = dict(zip(names, sess.run(names, feeds)))
    tol = 1e-5 if dtype is None else TOL[dtype]
    for k, v in ours.items():
        scale_k = max(float(np.abs(v).max()), 1e-3)
        assert np.abs(theirs[k].astype(np.float32) - v).max() <= tol * scale_k, k
    # the optimizer model (float32 arithmetic in every case) after one step's gradients
    opt_path = os.path.join(folder, "optimizer_model.onnx")
    opt_model = onnx.load(opt_path)
    module(x, y)
    ofeeds = {"learning_rate": np.array([1e-3], np.float32), "step": np.array([1], np.int64)}
    if dtype is not None:
        ofeeds["loss_scale"] = np.array([module._grad_loss_scale[0]], np.float32)
    for p in module.trainable_parameter_names:
        prm = state.parameters[p]
        ofeeds.update({p: prm.data, f"{p}_grad": prm.grad, f"{p}.momentum0": np.zeros_like(prm.data),
                       f"{p}.momentum1": np.zeros_like(prm.data)})
    onames = [o.name for o in opt_model.graph.output]
    ours = compile_model(opt_model).run(ofeeds, onames)  # the model as it is (opt may run a flat variant)
    sess = ort.InferenceSession(opt_path, providers=["CPUExecutionProvider"])
    for k, a, b in zip(onames, ours, sess.run(onames, ofeeds)):
        np.testing.assert_allclose(b, a, rtol=1e-5, atol=1e-7, err_msg=k)


# ---- recompute --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def transformer() -> onnx.ModelProto:
    torch.manual_seed(0)
    net = TransformerEncoder(layers=3, dropout=0.0)
    tokens = np.random.default_rng(0).integers(0, 50, (2, 12)).astype(np.int64)
    return export_module(net, {"tokens": tokens}, "logits", training=False)


def tokens_batch(i: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(i)
    return rng.integers(0, 50, (16, 12)).astype(np.int64), rng.integers(0, 5, 16).astype(np.int64)


def _train_peak(folder: str, steps: int) -> tuple[CheckpointState, int]:
    state, module, opt = open_set(folder)
    opt.set_learning_rate(1e-3)
    peak = 0
    for i in range(steps):
        module(*tokens_batch(i))
        peak = max(peak, module._step_plan.peak_bytes)
        opt.step()
        module.lazy_reset_grad()
    return state, peak


@pytest.mark.parametrize("options", [{"transformer_layer": True}, {"gelu": True},
                                     {"transformer_layer": True, "number_recompute_layers": 1}])
def test_recompute_bit_identical_and_lower_peak(tmp_path, transformer, options):
    ref_dir = generate(str(tmp_path / "ref"), transformer)
    rc_dir = generate(str(tmp_path / "rc"), transformer, recompute=options)
    check_all(rc_dir)
    rc_model = onnx.load(os.path.join(rc_dir, "training_model.onnx"))
    assert any(o.endswith("_recompute") for n in rc_model.graph.node for o in n.output)
    assert {p.key for p in rc_model.metadata_props} == {"onnxtrain.recompute"}
    ref_io = onnx.load(os.path.join(ref_dir, "training_model.onnx")).graph
    assert [v.name for v in ref_io.input] == [v.name for v in rc_model.graph.input]
    assert [v.name for v in ref_io.output] == [v.name for v in rc_model.graph.output]
    ref, peak0 = _train_peak(ref_dir, 20)
    got, peak = _train_peak(rc_dir, 20)
    for n, p in ref.parameters:
        np.testing.assert_array_equal(got.parameters[n].data, p.data, err_msg=n)
    print(f"\ntransformer x3 {options}: training peak live bytes {peak} / {peak0} = {peak / peak0:.3f}")
    assert peak < 0.95 * peak0
    if options == {"transformer_layer": True}:
        assert peak < 0.7 * peak0


def test_recompute_runs_in_onnxruntime(tmp_path, transformer):
    ort = pytest.importorskip("onnxruntime")
    folder = generate(str(tmp_path / "rc"), transformer, recompute={"transformer_layer": True, "gelu": True})
    state, module, _ = open_set(folder)
    tokens, labels = tokens_batch(0)
    params = state._params
    feeds = {"tokens": tokens, "labels": labels, "lazy_reset_grad": np.array([True])}
    feeds.update({p: params[p].data for p in module._param_order})
    feeds.update({buf: np.zeros_like(params[p].data) for p, buf in module._buffers.items()})
    path = os.path.join(folder, "training_model.onnx")
    names = [o.name for o in onnx.load(path).graph.output]
    ours = module._train_plan.run(feeds, names)
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(names, feeds)
    for k, a, b in zip(names, ours, theirs):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-6, err_msg=k)


@pytest.mark.parametrize("dtype", HALF)
def test_recompute_with_mixed_precision(tmp_path, transformer, dtype):
    """Both extensions together: the clones are half precision too; same results as mixed precision alone."""
    mp_dir = generate(str(tmp_path / "mp"), transformer, mixed_precision=dtype)
    both = generate(str(tmp_path / "both"), transformer, mixed_precision=dtype,
                    recompute={"transformer_layer": True})
    check_all(both)
    ref, _ = _train_peak(mp_dir, 5)
    got, _ = _train_peak(both, 5)
    for n, p in ref.parameters:
        np.testing.assert_array_equal(got.parameters[n].data, p.data, err_msg=n)


def test_recompute_checkpoints(tmp_path, transformer):
    """The generic strategy: every activation except the named checkpoints is recomputed."""
    names = [n.output[0] for n in transformer.graph.node if n.op_type == "LayerNormalization"]
    ref_dir = generate(str(tmp_path / "ref"), transformer)
    rc_dir = generate(str(tmp_path / "rc"), transformer, recompute={"checkpoints": names})
    ref, peak0 = _train_peak(ref_dir, 3)
    got, peak = _train_peak(rc_dir, 3)
    for n, p in ref.parameters:
        np.testing.assert_array_equal(got.parameters[n].data, p.data, err_msg=n)
    assert peak < peak0


# ---- misuse -----------------------------------------------------------------------------------------------
def test_errors(tmp_path, mlp_sets):
    model = mlp_model()
    with pytest.raises(artifacts.ArtifactError, match="mixed_precision must be"):
        generate(str(tmp_path / "a"), model, mixed_precision="float8")
    with pytest.raises(artifacts.ArtifactError, match="unknown key"):
        generate(str(tmp_path / "b"), model, recompute={"gelu": True, "layers": 2})
    with pytest.raises(artifacts.ArtifactError, match="number_recompute_layers"):
        generate(str(tmp_path / "c"), model, recompute={"number_recompute_layers": -1})
    with pytest.raises(TypeError):
        artifacts.generate_artifacts(model, [], None, None, None, str(tmp_path), "", False, None, None, False,
                                     None, "float16")  # keyword-only
    state = CheckpointState.load_checkpoint(os.path.join(mlp_sets[None], "checkpoint"))
    with pytest.raises(ValueError, match="takes no loss scale"):
        Module(os.path.join(mlp_sets[None], "training_model.onnx"), state, loss_scaler=DynamicLossScaler())
    state = CheckpointState.load_checkpoint(os.path.join(mlp_sets["float16"], "checkpoint"))
    module = Module(os.path.join(mlp_sets["float16"], "training_model.onnx"), state)
    with pytest.raises(ValueError, match="takes no loss_scale"):
        Optimizer(os.path.join(mlp_sets[None], "optimizer_model.onnx"), module)
    state = CheckpointState.load_checkpoint(os.path.join(mlp_sets[None], "checkpoint"))
    module = Module(os.path.join(mlp_sets[None], "training_model.onnx"), state)
    with pytest.raises(ValueError, match="expects loss-scaled gradients"):
        Optimizer(os.path.join(mlp_sets["float16"], "optimizer_model.onnx"), module)
