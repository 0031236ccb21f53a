"""torchvision's model families trained through the on-device API, against torch.

Each model is built with ``weights=None`` under a fixed seed, at a small input (batch 2, 64×64 images,
10 classes), every dropout and stochastic depth at p = 0 so that both sides compute the same function. It
is exported in training mode (BatchNorm on batch statistics) by torch's TorchScript exporter or, for a
few, by its default (dynamo) exporter; then:

1. ``generate_artifacts`` (CrossEntropyLoss, SGD or AdamW) and two ``Module`` + ``Optimizer`` steps,
   against two steps of torch on the same module: the losses, every updated weight and the BatchNorm
   running statistics. torch's running variance takes the unbiased batch variance where ONNX takes the
   biased one, so the expected statistics are formed from the batch variance a hook measures in torch's
   forward (float64). onnxtrain's AdamW is the Hugging Face variant (eps added to the uncorrected
   ``sqrt(v)``), which the torch side computes by its formula in torch.
2. ``export_model_for_inferencing`` run by onnxtrain's InferenceSession and by onnxruntime, against the
   torch module in eval mode holding onnxtrain's trained weights and statistics.
3. ``onnx.checker.check_model(full_check=True)`` on the training, eval, optimizer and inference models.
4. For a few models, the same two steps on onnxtrain's onnxruntime backend.

Tolerances. A weight's error is taken against the size of its two-step update (max|a − b| / max|b − w0|
≤ 2e-3 in float32); weights that torch barely moves (under 1e-3 of the model's largest update: their
gradient is zero but for rounding, e.g. a BatchNorm bias feeding another batch-statistics BatchNorm)
against the model's largest update; running means against the layer's running standard deviation. Many of
these models are chaotic at batch 2 (BatchNorms over 8 values or fewer): torch's own float32 run differs
from its float64 run by up to twice an update in some tensors. So each float32 tolerance is widened to 30×
that difference of torch's where it is larger, and the models where it matters are run again in float64
(full tier), where the two sides agree to 1e-6 of an update and 1e-9 of the loss, and torch moves by up to
2e-7 of an update against itself on an input changed by 1e-15. The float64 runs use learning rates exact
in float32 (the optimizer model takes a float32 rate), and the float32 values of the normalizations'
epsilon and momentum and of the HardSwish/HardSigmoid slope 1/6, which ONNX holds as float32 attributes.

torchvision's PyPI wheel is built against torch's CUDA libraries; with torch's CPU build its C extension
(detection ops: nms, roi_align) does not load and the package then fails at import, registering a fake
kernel for the missing ``torchvision::nms``. The models tested here use none of those ops, so when the
extension does not load the two schemas are declared first (``_import_torchvision``).
"""

from __future__ import annotations

import copy
import dataclasses
import importlib.util
import os
import warnings
from collections.abc import Callable
from typing import Any

import numpy as np
import onnx
import pytest

from onnxtrain.training import artifacts
from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.tiers import extended

torch = pytest.importorskip("torch")
if importlib.util.find_spec("torchvision") is None:
    pytest.skip("torchvision is not installed", allow_module_level=True)

BATCH, SIZE, CLASSES = 2, 64, 10
LR = {"SGD": 2.0 ** -8, "AdamW": 2.0 ** -12}  # exact in float32 (the optimizer model takes a float32 rate)
RTOL = {np.float32: 2e-3, np.float64: 1e-6}  # × max|update| of each weight
STATS_RTOL = {np.float32: 2e-3, np.float64: 1e-8}
STILL = {np.float32: 1e-3, np.float64: 1e-9}  # × the model's largest update: a weight that stays put
LOSS_RTOL = {np.float32: 1e-4, np.float64: 1e-9}
FLOOR = 30  # × torch's own float32-against-float64 error: the widest a float32 difference may be


def _import_torchvision() -> Any:
    """torchvision, importable with torch's CPU build (its CUDA-built C extension declared away)."""
    folder = importlib.util.find_spec("torchvision").submodule_search_locations[0]
    libs = [f for f in os.listdir(folder) if f.startswith("_C") and f.endswith(".so")]
    try:
        torch.ops.load_library(os.path.join(folder, libs[0]))
    except (OSError, IndexError):
        if not hasattr(torch.ops.torchvision, "nms"):
            lib = torch.library.Library("torchvision", "DEF")
            lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
            _import_torchvision.library = lib  # kept alive: dropping it removes the schemas
    import torchvision

    return torchvision


tv = _import_torchvision()


class _Segmenter(torch.nn.Module):
    """A torchvision segmentation model's ``out`` map (its forward returns a dict)."""

    def __init__(self, net: torch.nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x):
        return self.net(x)["out"]


@dataclasses.dataclass(frozen=True)
class Case:
    """One model: its builder, optimizer, exporter and input shape."""

    build: Callable[[], torch.nn.Module]
    optimizer: str = "SGD"
    dynamo: bool = False
    shape: tuple[int, ...] = (BATCH, 3, SIZE, SIZE)
    dense: bool = False  # a per-pixel classifier: labels [N, H, W]


def _cls(name: str, **kw: Any) -> Callable[[], torch.nn.Module]:
    return lambda: getattr(tv.models, name)(weights=None, num_classes=CLASSES, **kw)


def _seg(name: str) -> Callable[[], torch.nn.Module]:
    return lambda: _Segmenter(getattr(tv.models.segmentation, name)(
        weights=None, weights_backbone=None, num_classes=CLASSES))


CASES: dict[str, Case] = {
    "resnet18": Case(_cls("resnet18")),
    "resnet18_dynamo": Case(_cls("resnet18"), dynamo=True),
    "mobilenet_v3_small_dynamo": Case(_cls("mobilenet_v3_small"), "AdamW", dynamo=True),
    "resnet50": Case(_cls("resnet50")),
    "mobilenet_v2": Case(_cls("mobilenet_v2")),
    "mobilenet_v3_small": Case(_cls("mobilenet_v3_small"), "AdamW"),
    "efficientnet_b0": Case(_cls("efficientnet_b0"), "AdamW"),
    "squeezenet1_1": Case(_cls("squeezenet1_1"), dynamo=True),
    "shufflenet_v2_x0_5": Case(_cls("shufflenet_v2_x0_5")),
    "mnasnet0_5": Case(_cls("mnasnet0_5")),
    "regnet_y_400mf": Case(_cls("regnet_y_400mf"), "AdamW"),
    "densenet121": Case(_cls("densenet121")),
    "googlenet": Case(_cls("googlenet", aux_logits=False, init_weights=True)),
    "inception_v3": Case(_cls("inception_v3", aux_logits=False, init_weights=True), shape=(BATCH, 3, 80, 80)),
    "convnext_tiny": Case(_cls("convnext_tiny"), "AdamW"),
    "swin_t": Case(lambda: tv.models.SwinTransformer(
        patch_size=[4, 4], embed_dim=32, depths=[2, 2], num_heads=[2, 4], window_size=[4, 4],
        num_classes=CLASSES), "AdamW"),
    "vit_b_16": Case(lambda: tv.models.VisionTransformer(
        image_size=SIZE, patch_size=16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64,
        num_classes=CLASSES), "AdamW", dynamo=True),
    "maxvit": Case(lambda: tv.models.MaxVit(
        input_size=(SIZE, SIZE), stem_channels=16, partition_size=2, block_channels=[16, 32],
        block_layers=[1, 1], head_dim=16, stochastic_depth_prob=0.0, num_classes=CLASSES), "AdamW"),
    "r3d_18": Case(lambda: tv.models.video.r3d_18(weights=None, num_classes=CLASSES),
                   shape=(BATCH, 3, 4, 32, 32)),
    "deeplabv3_mobilenet_v3_large": Case(_seg("deeplabv3_mobilenet_v3_large"), dense=True),
    "lraspp_mobilenet_v3_large": Case(_seg("lraspp_mobilenet_v3_large"), dense=True),
}
DEFAULT = ("squeezenet1_1", "mobilenet_v3_small", "resnet18")
ON_ORT = ("squeezenet1_1", "mobilenet_v3_small", "resnet18")
# the float64 runs: every model whose float32 run rounding alone moves far (batch-2 BatchNorms), and a few
# others; inception_v3 is chaotic at this size even in float64 (torch against itself on an input changed
# by 1e-15: 6e-6 of the loss, 2e-3 of an update)
FLOAT64 = ("resnet18", "mobilenet_v3_small", "shufflenet_v2_x0_5", "mobilenet_v2", "efficientnet_b0",
           "mnasnet0_5", "regnet_y_400mf", "googlenet", "resnet50", "densenet121", "swin_t", "vit_b_16",
           "deeplabv3_mobilenet_v3_large", "r3d_18")


def _deterministic(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` with every dropout and stochastic depth at p = 0, and its normalizations' epsilon and
    momentum the float32 values ONNX's attributes hold (so that a float64 run computes the same function on
    both sides)."""
    for m in net.modules():
        if isinstance(m, (torch.nn.modules.batchnorm._BatchNorm, torch.nn.LayerNorm, torch.nn.GroupNorm)):
            m.eps = float(np.float32(m.eps))
        if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.momentum is not None:
            m.momentum = 1 - float(np.float32(1 - m.momentum))
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) or type(m).__name__ == "StochasticDepth":
            m.p = 0.0
        if isinstance(m, torch.nn.MultiheadAttention):
            m.dropout = 0.0
        if hasattr(m, "attention_dropout") and isinstance(m.attention_dropout, float):
            m.attention_dropout = 0.0
    return net


_SIXTH = float(np.float32(1 / 6))  # the HardSwish / HardSigmoid slope of ONNX (a float32 attribute)


class _HardSigmoid(torch.nn.Module):
    """torch's Hardsigmoid with ONNX's float32 slope."""

    def forward(self, x):
        return torch.clamp(x * _SIXTH + 0.5, 0, 1)


class _HardSwish(_HardSigmoid):
    """torch's Hardswish with ONNX's float32 slope."""

    def forward(self, x):
        return x * super().forward(x)


def _onnx_slopes(net: torch.nn.Module) -> torch.nn.Module:
    """``net`` with its Hardswish and Hardsigmoid modules taking ONNX's float32 slope, as a float64 run needs
    to compute the function the export holds."""
    for m in list(net.modules()):
        for child_name, child in list(m.named_children()):
            if isinstance(child, torch.nn.Hardswish):
                setattr(m, child_name, _HardSwish())
            elif isinstance(child, torch.nn.Hardsigmoid):
                setattr(m, child_name, _HardSigmoid())
    return net


def build(name: str, dtype: type = np.float32) -> torch.nn.Module:
    """Model ``name`` with fresh seeded weights, deterministic, in ``dtype``, in training mode."""
    torch.manual_seed(0)
    net = _deterministic(CASES[name].build())
    if dtype == np.float64:
        _onnx_slopes(net)
    return net.to(torch.float64 if dtype == np.float64 else torch.float32).train()


def batches(name: str, dtype: type = np.float32) -> list[tuple[np.ndarray, np.ndarray]]:
    """Two training batches for model ``name``."""
    case = CASES[name]
    rng = np.random.default_rng(7)
    labels = (case.shape[0], *case.shape[2:]) if case.dense else (case.shape[0],)
    return [((rng.standard_normal(case.shape) * 1.5 + 0.2).astype(dtype), rng.integers(0, CLASSES, labels))
            for _ in range(2)]


def export(net: torch.nn.Module, x: np.ndarray, dynamo: bool = False) -> onnx.ModelProto:
    """``net`` exported in training mode (output ``logits``) by torch's TorchScript exporter at opset 17 (by
    dynamo if ``dynamo``), its initializers holding the values from before the export (tracing in training
    mode moves the running statistics)."""
    before = copy.deepcopy(net.state_dict())
    with warnings.catch_warnings():  # the exporters' notes are expected here
        warnings.simplefilter("ignore")
        if dynamo:
            program = torch.onnx.export(net, (torch.from_numpy(x),), dynamo=True, optimize=False,
                                        input_names=["input"], output_names=["logits"], verbose=False)
            model = program.model_proto
        else:
            import io

            buf = io.BytesIO()
            torch.onnx.export(net, (torch.from_numpy(x),), buf, dynamo=False, opset_version=17,
                              input_names=["input"], output_names=["logits"],
                              training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False)
            model = onnx.load_from_string(buf.getvalue())
    net.load_state_dict(before)
    net.train()
    for t in model.graph.initializer:
        if t.name in before:
            t.CopyFrom(onnx.numpy_helper.from_array(before[t.name].numpy(), t.name))
    return model


def _norms(net: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {n: m for n, m in net.named_modules()
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.track_running_stats}


@dataclasses.dataclass
class Run:
    """What a two-step run leaves: losses, weights, running statistics (by torch name)."""

    losses: list[float]
    weights: dict[str, np.ndarray]
    stats: dict[str, np.ndarray]


def torch_steps(name: str, net: torch.nn.Module, data: list, optimizer: str) -> Run:
    """Two steps of torch on ``net`` (changed in place). The running variances are those ONNX defines
    (biased batch variance), from the batch statistics measured by a forward hook."""
    norms = _norms(net)
    stats = {f"{n}.{s}": getattr(m, s).detach().double().clone()
             for n, m in norms.items() for s in ("running_mean", "running_var")}

    def hook(bn_name: str) -> Callable:
        def record(m, args):
            x = args[0].detach().double()
            axes = [0, *range(2, x.dim())]
            mom = m.momentum
            for s, v in (("running_mean", x.mean(axes)), ("running_var", x.var(axes, unbiased=False))):
                key = f"{bn_name}.{s}"
                stats[key] = (1 - mom) * stats[key] + mom * v
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in norms.items()]
    params = dict(net.named_parameters())
    moments = {p: (torch.zeros_like(w), torch.zeros_like(w)) for p, w in params.items()}
    losses = []
    lr = LR[optimizer]
    try:
        for step, (x, y) in enumerate(data, 1):
            net.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x)), torch.from_numpy(y))
            loss.backward()
            losses.append(float(loss.detach()))
            with torch.no_grad():
                for p, w in params.items():
                    if w.grad is None:
                        continue
                    if optimizer == "SGD":
                        w -= lr * w.grad
                        continue
                    # Hugging Face AdamW (betas 0.9, 0.999, eps 1e-6, no weight decay)
                    m, v = moments[p]
                    m.mul_(0.9).add_(w.grad, alpha=0.1)
                    v.mul_(0.999).addcmul_(w.grad, w.grad, value=0.001)
                    lr_t = lr * np.sqrt(1 - 0.999 ** step) / (1 - 0.9 ** step)
                    w -= lr_t * m / (v.sqrt() + 1e-6)
    finally:
        for h in handles:
            h.remove()
    return Run(losses, {p: w.detach().numpy().copy() for p, w in params.items()},
               {k: v.numpy() for k, v in stats.items()})


def make_artifacts(model: onnx.ModelProto, net: torch.nn.Module, optimizer: str, folder: str) -> list[str]:
    """The training artifacts of ``model`` in ``folder`` (torch's parameters trained, running statistics
    frozen); each model passes the full check. The trained parameter names."""
    inits = {t.name for t in model.graph.initializer}
    params = [p for p, _ in net.named_parameters()]
    assert not set(params) - inits, f"torch parameters the export lacks: {sorted(set(params) - inits)}"
    stats = [n for n in inits if n.endswith(("running_mean", "running_var"))]
    artifacts.generate_artifacts(model, requires_grad=params, frozen_params=stats,
                                 loss=artifacts.LossType.CrossEntropyLoss,
                                 optimizer=getattr(artifacts.OptimType, optimizer), artifact_directory=folder)
    for f in ("training_model.onnx", "eval_model.onnx", "optimizer_model.onnx"):
        onnx.checker.check_model(os.path.join(folder, f), full_check=True)
    return params


def module_steps(folder: str, data: list, lr: float,
                 backend: str = "numpy") -> tuple[list[float], dict[str, np.ndarray], Module]:
    """One Module + Optimizer step per batch of ``data`` (input tuples, or dicts by input name) on the
    artifacts in ``folder``: the losses, the parameters after, the module."""
    from onnxtrain import SessionOptions

    so = SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"), session_options=so)
    opt = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module)
    opt.set_learning_rate(lr)
    losses = []
    for feeds in data:
        out = module(*([feeds[n] for n in module.input_names()] if isinstance(feeds, dict) else feeds))
        losses.append(float(out[0] if isinstance(out, tuple) else out))
        opt.step()
        module.lazy_reset_grad()
    return losses, {n: np.array(p.data) for n, p in state.parameters}, module


def onnxtrain_steps(folder: str, data: list, optimizer: str, backend: str = "numpy") -> tuple[Run, Module]:
    """Two Module + Optimizer steps on the artifacts in ``folder``."""
    losses, values, module = module_steps(folder, data, LR[optimizer], backend)
    stats = {n: v for n, v in values.items() if n.endswith(("running_mean", "running_var"))}
    return Run(losses, {n: v for n, v in values.items() if n not in stats}, stats), module


def worst(got: Run, want: Run, start: dict[str, np.ndarray], dtype: type) -> dict[str, tuple[float, str]]:
    """The largest error of each kind, as a fraction of its scale, with the tensor it is in: ``loss``
    (relative), ``weight`` (max|a − b| / max|b − w0|, over weights whose update is more than ``STILL`` of
    the model's largest), ``still`` (those others, max|a − b| / the model's largest update: their
    gradients are mostly zero but for rounding, e.g. a BatchNorm bias feeding another batch-statistics
    BatchNorm), ``stats`` (running statistics, against max|b| plus the layer's running standard deviation,
    since a mean of a zero-mean channel is rounding)."""
    loss = np.abs(np.subtract(got.losses, want.losses)) / np.abs(want.losses)
    out = {"loss": (float(np.max(loss)), "loss")}
    largest = max(float(np.abs(b - start[p]).max()) for p, b in want.weights.items())
    weight, still = [(0.0, "")], [(0.0, "")]
    for p, b in want.weights.items():
        update = float(np.abs(b - start[p]).max())
        err = float(np.abs(got.weights[p] - b).max())
        if update > STILL[dtype] * largest:
            weight.append((err / update, p))
        else:
            still.append((err / largest, p))
    out["weight"], out["still"] = max(weight), max(still)
    assert set(got.stats) == set(want.stats), "running statistics differ in names"
    stats = [(0.0, "")]
    for s, b in want.stats.items():
        spread = np.sqrt(np.abs(want.stats[s.replace("running_mean", "running_var")]).max())
        stats.append((float(np.abs(got.stats[s] - b).max() / (np.abs(b).max() + spread)), s))
    out["stats"] = max(stats)
    return out


def compare(name: str, got: Run, want: Run, start: dict[str, np.ndarray], dtype: type,
            rounding: dict[str, tuple[float, str]] | None = None) -> None:
    """``got`` (onnxtrain) against ``want`` (torch) within the tolerances of ``dtype``, widened to
    ``FLOOR`` times ``rounding`` (torch's own float32 run against its float64 one, by kind) where that is
    larger: a model whose batch-2 BatchNorms magnify float32 rounding past the fixed tolerances is held to
    what rounding does to torch itself."""
    errors = worst(got, want, start, dtype)
    limits = {"loss": LOSS_RTOL[dtype], "weight": RTOL[dtype], "still": 2 * STILL[dtype],
              "stats": STATS_RTOL[dtype]}
    for kind, (value, _) in (rounding or {}).items():
        limits[kind] = max(limits[kind], FLOOR * value)
    bad = {k: v for k, v in errors.items() if v[0] > limits[k]}
    assert not bad, f"{name}: off torch's by more than {limits}: {bad}"


def torch_rounding(name: str, data: list, start: dict[str, np.ndarray],
                   want: Run) -> dict[str, tuple[float, str]]:
    """How far torch's own float32 run (``want``) is from its float64 run of the same model and data."""
    exact = torch_steps(name, build(name, np.float64),
                        [(x.astype(np.float64), y) for x, y in data], CASES[name].optimizer)
    return worst(want, exact, start, np.float32)


def check_inference(name: str, module: Module, net: torch.nn.Module, run: Run, x: np.ndarray,
                    folder: str) -> None:
    """The exported inference model on onnxtrain and onnxruntime against torch eval mode holding
    onnxtrain's trained weights and statistics."""
    import onnxruntime as ort

    from onnxtrain import InferenceSession

    path = os.path.join(folder, "inference.onnx")
    module.export_model_for_inferencing(path, ["logits"])
    onnx.checker.check_model(path, full_check=True)
    held = copy.deepcopy(net).eval()
    with torch.no_grad():
        sd = held.state_dict()
        for k, v in {**run.weights, **run.stats}.items():
            sd[k].copy_(torch.from_numpy(v))
        want = held(torch.from_numpy(x)).numpy()
    ours = InferenceSession(path).run(["logits"], {"input": x})[0]
    theirs = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(["logits"], {"input": x})[0]
    scale = np.abs(want).max()
    tol = 1e-4 * scale if x.dtype == np.float32 else 1e-10 * scale
    np.testing.assert_allclose(ours, want, rtol=0, atol=tol, err_msg=f"{name}: onnxtrain inference")
    np.testing.assert_allclose(theirs, want, rtol=0, atol=tol, err_msg=f"{name}: onnxruntime inference")


def run_case(name: str, folder: str, dtype: type = np.float32, backend: str = "numpy",
             inference: bool = True) -> None:
    """Export, artifacts, two steps on both sides and the inference export for model ``name``."""
    case = CASES[name]
    net = build(name, dtype)
    data = batches(name, dtype)
    model = export(net, data[0][0], CASES[name].dynamo)
    make_artifacts(model, net, case.optimizer, folder)
    start = {p: w.detach().numpy().copy() for p, w in net.named_parameters()}
    got, module = onnxtrain_steps(folder, data, case.optimizer, backend)
    want = torch_steps(name, net, data, case.optimizer)
    rounding = torch_rounding(name, data, start, want) if dtype == np.float32 else None
    compare(name, got, want, start, dtype, rounding)
    if inference:
        check_inference(name, module, net, got, data[1][0], folder)


MODELS = [n if n in DEFAULT else extended(n, id=n) for n in CASES]


@pytest.mark.parametrize("name", MODELS)
def test_two_steps_match_torch(name, tmp_path):
    """Two training steps of the model's artifacts give torch's losses, weights and running statistics; the
    exported inference model gives torch eval mode's logits on onnxtrain and onnxruntime."""
    run_case(name, str(tmp_path))


@pytest.mark.parametrize("name", [extended(n, id=n) for n in ON_ORT])
def test_two_steps_on_onnxruntime_backend(name, tmp_path):
    """The same steps with the onnxtrain.backend = onnxruntime session option."""
    run_case(name, str(tmp_path), backend="onnxruntime", inference=False)


@pytest.mark.parametrize("name", [extended(n, id=n) for n in FLOAT64])
def test_two_steps_match_torch_float64(name, tmp_path):
    """In float64 the two sides agree to 1e-6 of each update (rounding that the model's batch-2 BatchNorms
    magnify: torch against itself moves up to 2e-7 of an update on an input changed by 1e-15)."""
    run_case(name, str(tmp_path), dtype=np.float64, inference=False)
