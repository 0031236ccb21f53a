"""generate_artifacts' graphs of torch.nn layers in series, stepped in onnxruntime with the state fed by hand
(review I).

tests/graphs/test_emitted_models.py runs each artifact once in onnxruntime on random feeds, over the zoo's
models. Here the models of ``tests/autodiff/test_review_i_layers_in_ort.py`` (grouped/dilated/padded
convolutions, transposed ones, BatchNorm in training mode with its running statistics as frozen
parameters, GroupNorm, LayerNorm, InstanceNorm, Embedding with padding_idx, MultiheadAttention, LSTM, GRU,
pools, resizes, pads), exported by TorchScript and dynamo, get artifacts with each built-in loss and
onnxblock's loss options, SGD or AdamW. Every graph must pass the full check and import the default domain
only. Then three training steps run twice: by the on-device ``Module``/``Optimizer`` on the numpy engine,
and in onnxruntime's inference package, the training model (with its BatchNormalizations' running
statistics added as outputs) and the optimizer model fed the parameters, gradient buffers, moments,
learning rate and step as a user of plain onnxruntime would hold them. Losses and parameters must agree
after every step, and with torch's own SGD steps (losses, weights and BatchNorm running means) where the
optimizer is SGD; then the eval model and the exported inference model in onnxruntime against the Module's
eval mode, the engine and torch's eval mode with the trained weights.

Adam turns a gradient that is rounding noise (a bias before a normalization, the first step of a reverse
LSTM) into a step of the learning rate's size either way, so with AdamW a weight may differ by up to
that step (as in tests/graphs/emitted.py).
"""

from __future__ import annotations

import copy
import warnings

import numpy as np
import onnx
import pytest

from tests.tiers import extended

torch = pytest.importorskip("torch")
ort = pytest.importorskip("onnxruntime")
nn = torch.nn

from onnxtrain import InferenceSession  # noqa: E402
from onnxtrain.training import artifacts, onnxblock  # noqa: E402
from onnxtrain.training.api import CheckpointState, Module, Optimizer  # noqa: E402
from tests.autodiff.test_review_i_layers_in_ort import (  # noqa: E402
    MODELS,
    WITH_BATCH_NORM,
    export,
    make,
    ort_session,
    standard_only,
)

pytestmark = [pytest.mark.filterwarnings("ignore::UserWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::FutureWarning")]

LR = 0.05
STEPS = 3
ADAM_STEP = 2 * LR * 0.1 / np.sqrt(0.001)  # the most an AdamW step moves a weight whose gradient is noise
LossType, OptimType = artifacts.LossType, artifacts.OptimType


def _loss_block(loss: str, classes: int):  # noqa: ANN202
    ob = onnxblock.loss
    weights = np.linspace(0.5, 1.5, classes).astype(np.float32)
    positive = np.linspace(2, 0.5, classes).astype(np.float32)
    return {"ce": lambda: LossType.CrossEntropyLoss, "mse": lambda: LossType.MSELoss,
            "l1": lambda: LossType.L1Loss, "bce": lambda: LossType.BCEWithLogitsLoss,
            "ce_weighted_sum": lambda: ob.CrossEntropyLoss(weight=weights, reduction="sum", ignore_index=1),
            "bce_pos_weight": lambda: ob.BCEWithLogitsLoss(pos_weight=positive, reduction="sum"),
            "mse_sum": lambda: ob.MSELoss(reduction="sum")}[loss]()


def _labels(loss: str, y: torch.Tensor) -> np.ndarray:
    g = torch.Generator().manual_seed(3)
    if loss.startswith("ce"):
        return torch.randint(0, y.shape[1], (y.shape[0],), generator=g).numpy()
    if loss.startswith("bce"):
        return torch.rand(y.shape, generator=g).round().to(y.dtype).numpy()
    return torch.randn(y.shape, generator=g, dtype=y.dtype).numpy()


def _torch_loss(loss: str, y: torch.Tensor, labels: np.ndarray) -> torch.Tensor:
    t = torch.from_numpy(labels)
    fn = torch.nn.functional
    c = y.shape[-1]
    bce = fn.binary_cross_entropy_with_logits
    return {"ce": lambda: fn.cross_entropy(y, t), "mse": lambda: fn.mse_loss(y, t),
            "l1": lambda: fn.l1_loss(y, t), "bce": lambda: bce(y, t),
            "ce_weighted_sum": lambda: fn.cross_entropy(y, t, weight=torch.linspace(0.5, 1.5, c),
                                                        reduction="sum", ignore_index=1),
            "bce_pos_weight": lambda: bce(y, t, pos_weight=torch.linspace(2, 0.5, c), reduction="sum"),
            "mse_sum": lambda: fn.mse_loss(y, t, reduction="sum")}[loss]()


def _with_running_statistics(model: onnx.ModelProto) -> tuple[onnx.ModelProto, dict[str, str]]:
    """A copy of the training model whose training-mode BatchNormalizations output their new running mean
    and variance as graph outputs; {running statistic input: that output}."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    found: dict[str, str] = {}
    for k, n in enumerate(m.graph.node):
        if n.op_type == "BatchNormalization" and any(a.name == "training_mode" and a.i for a in n.attribute):
            while len(n.output) < 3:
                n.output.append("")
            for out, inp in ((1, 3), (2, 4)):
                if not n.output[out]:
                    n.output[out] = f"review_i_running_{k}_{out}"
                found[n.input[inp]] = n.output[out]
    have = {o.name for o in m.graph.output}
    for out in found.values():
        if out not in have:
            m.graph.output.add().name = out
    return m, found


def _close(got: np.ndarray, want: np.ndarray, what: str, rtol: float, step: float = 0.0) -> None:
    a, b = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-6 * np.sqrt(max(b.size, 1)))
    if err > rtol and step:
        assert np.max(np.abs(a - b)) <= step, (what, err, float(np.max(np.abs(a - b))))
        return
    assert err <= rtol, (what, err)


def check_artifacts(name: str, exporter: str, opset: int, loss: str, optim: str, tmp_path) -> None:
    body, args = make(name)
    model = export(body, args, exporter, opset)
    with torch.no_grad():
        y = copy.deepcopy(body)(*args)
    inits = {t.name for t in model.graph.initializer}
    params = [n for n, _ in body.named_parameters() if n in inits]
    stats = [n for n, _ in body.named_buffers() if n in inits and "running_" in n]
    label = f"{name} {exporter} {opset} {loss} {optim}"
    artifacts.generate_artifacts(model, requires_grad=params, frozen_params=stats or None,
                                 loss=_loss_block(loss, y.shape[-1]), optimizer=getattr(OptimType, optim),
                                 artifact_directory=str(tmp_path))
    graphs = {f: onnx.load(str(tmp_path / f"{f}.onnx"))
              for f in ("training_model", "eval_model", "optimizer_model")}
    for f, g in graphs.items():
        standard_only(g, f"{label} {f}")
    inputs = [i.name for i in model.graph.input if i.name not in inits]
    x = {n: a.numpy() for n, a in zip(inputs, args)}
    labels = _labels(loss, y)

    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    opt = Optimizer(str(tmp_path / "optimizer_model.onnx"), module)
    opt.set_learning_rate(LR)

    held = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))  # what the onnxruntime user holds
    values = {k: np.array(p.data) for k, p in held.parameters}
    trained = [k for k, p in held.parameters if p.requires_grad]
    training, running = _with_running_statistics(graphs["training_model"])
    t_sess, o_sess, e_sess = (ort_session(training), ort_session(graphs["optimizer_model"]),
                              ort_session(graphs["eval_model"]))
    t_out = [o.name for o in t_sess.get_outputs()]
    t_in = {i.name for i in t_sess.get_inputs()}
    buffers = {n for n in t_in if n.endswith(".buffer")}
    (label_input,) = t_in - set(x) - set(values) - {"lazy_reset_grad"} - buffers
    o_in, o_out = [i.name for i in o_sess.get_inputs()], [o.name for o in o_sess.get_outputs()]
    moments: dict[str, np.ndarray] = {}

    ref = copy.deepcopy(body)  # torch's SGD oracle
    for sub in ref.modules():  # an exported embedding's padding_idx row trains (a plain Gather: README)
        if isinstance(sub, nn.Embedding):
            sub.padding_idx = None
    buffers = dict(ref.named_buffers())
    with torch.no_grad():  # the statistics the export holds (a TorchScript training export ran a forward)
        for k in stats:
            buffers[k].copy_(torch.from_numpy(np.array(values[k])))
    sgd = torch.optim.SGD(ref.parameters(), lr=LR) if optim == "SGD" else None
    step_tol = ADAM_STEP if optim == "AdamW" else 0.0
    for s in range(STEPS):
        ours = module(*x.values(), labels)
        opt.step()
        module.lazy_reset_grad()
        feeds = {**x, label_input: labels, **{k: values[k] for k in t_in & set(values)},
                 **{f"{p}_grad.accumulation.buffer": np.zeros_like(values[p]) for p in trained},
                 "lazy_reset_grad": np.array([True])}
        got = dict(zip(t_out, t_sess.run(None, feeds)))
        _close(got[t_out[0]], ours, f"{label} step {s} loss: onnxruntime vs Module", 1e-5)
        grads = {p: got[f"{p}_grad.accumulation.out"] for p in trained}
        for stat, out in running.items():
            if stat in values:
                values[stat] = got[out]
        o_feeds = {"learning_rate": np.array([LR], np.float32), "step": np.array([s + 1], np.int64)}
        for n in o_in:
            if n in o_feeds:
                continue
            if n in values:
                o_feeds[n] = values[n]
            elif n.endswith("_grad") and n[:-5] in grads:
                o_feeds[n] = grads[n[:-5]]
            else:  # a moment, zeros before the first step
                o_feeds[n] = moments.get(n, np.zeros_like(values[n.rsplit(".", 1)[0]]))
        for n, v in zip(o_out, o_sess.run(None, o_feeds)):
            base = n[: -len(".out")]
            if base in values:
                values[base] = v
            else:
                moments[base] = v
        for k, p in state.parameters:  # (a running mean follows the bias before it under AdamW)
            _close(values[k], p.data, f"{label} step {s} {k}: onnxruntime vs Optimizer", 1e-4, step_tol)
        if sgd is not None:
            sgd.zero_grad()
            lt = _torch_loss(loss, ref(*args), labels)
            lt.backward()
            sgd.step()
            _close(got[t_out[0]], lt.detach().numpy(), f"{label} step {s} loss: onnxruntime vs torch", 1e-5)
            for k, p in ref.named_parameters():
                if k in values:
                    _close(values[k], p.detach().numpy(), f"{label} step {s} {k}: onnxruntime vs torch SGD",
                           1e-4)
            for k in stats:  # (ONNX's running variance is the biased one, torch's the unbiased)
                if k.endswith("running_mean"):
                    _close(values[k], buffers[k].numpy(), f"{label} step {s} {k}: onnxruntime vs torch", 1e-5)

    # the eval model in onnxruntime, fed the on-device state (what the Module's eval mode reads)
    e_in = {i.name for i in e_sess.get_inputs()}
    mine = {k: np.array(p.data) for k, p in state.parameters}
    e_feeds = {k: v for k, v in {**x, label_input: labels, **mine}.items() if k in e_in}
    (evaluated, *_) = e_sess.run(None, e_feeds)
    module.eval()
    _close(evaluated, module(*x.values(), labels), f"{label} eval model: onnxruntime vs Module.eval", 1e-5)

    path = str(tmp_path / "inference.onnx")
    module.export_model_for_inferencing(path, [o.name for o in model.graph.output])
    inference = onnx.load(path)
    standard_only(inference, f"{label} inference")
    i_sess = ort_session(inference)
    (logits,) = i_sess.run(None, {k: v for k, v in x.items() if k in {i.name for i in i_sess.get_inputs()}})
    (engine,) = InferenceSession(path).run(None, x)
    _close(logits, engine, f"{label} inference model: onnxruntime vs engine", 1e-5)
    if name not in WITH_BATCH_NORM:  # (ONNX's running variance is the biased one, torch's the unbiased)
        trained_body = copy.deepcopy(body)
        with torch.no_grad():
            for k, p in trained_body.named_parameters():
                p.copy_(torch.from_numpy(np.array(state.parameters[k].data)))
        with torch.no_grad():
            want = trained_body.eval()(*args).numpy()
        _close(logits, want, f"{label} inference model: onnxruntime vs torch eval", 1e-4)


LOSSES = ("ce", "mse", "l1", "bce", "ce_weighted_sum", "bce_pos_weight", "mse_sum")
DEFAULT = [("conv2d", "torchscript", 17, "ce", "SGD"),
           ("emb_mha_gru", "dynamo", 18, "bce_pos_weight", "AdamW"),
           ("bilstm", "torchscript", 20, "ce_weighted_sum", "SGD"), ("conv3d", "dynamo", 18, "mse", "AdamW")]
CASES = [*DEFAULT,
         *(extended(n, e, o, loss, opt)
           for k, n in enumerate(MODELS)
           for e, o in (("torchscript", 17), ("dynamo", 18), ("dynamo", 23))
           for loss, opt in ((LOSSES[k % len(LOSSES)], "SGD"), (LOSSES[(k + 3) % len(LOSSES)], "AdamW"))
           if not (n == "pads" and e == "torchscript") and (n, e, o, loss, opt) not in DEFAULT)]


@pytest.mark.parametrize(("name", "exporter", "opset", "loss", "optim"), CASES)
def test_artifacts_step_in_onnxruntime_as_on_device(name: str, exporter: str, opset: int, loss: str,
                                                   optim: str, tmp_path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        check_artifacts(name, exporter, opset, loss, optim, tmp_path)
