"""Gradient graphs of whole torch-exported models (loss inside the graph) against torch autograd.

Every model of ``tests/models.py`` is exported by torch's TorchScript exporter (opset 17,
TrainingMode.TRAINING, no constant folding, dropout 0 so both sides compute the same function). We
differentiate the loss w.r.t. every torch parameter (all are initializers under their torch names; the
LSTM/GRU weights stay whole, sliced and concatenated inside the graph), run the gradient graph on
our engine and compare with ``loss.backward()`` on the same module and inputs, in float32.

Tolerance. Per parameter, the tensor-wise relative error ‖a − b‖ / ‖b‖ must be ≤ 1e-4, and every element
must satisfy |a − b| ≤ 1e-4·|b| + 1e-6·max|b|. A purely elementwise 1e-4 relative test is too strict: a
few elements per model are sums that cancel to ~1e-7 of the tensor's scale, where float32 summation
order alone changes them by more than 1e-4 relative. Gradients that are analytically zero (a conv bias
followed by training-mode BatchNormalization, which subtracts the batch mean) are float32 roundoff on
both sides (|g| ~ 1e-7): they are checked to be below 1e-5 of the model's largest gradient instead.

The same gradient graphs pass ``onnx.checker.check_model(full_check=True)`` and give the same gradients
on onnx.reference and onnxruntime (InferenceSession). onnxruntime runs with its ``ConstantSharing``
optimizer disabled: it merges equal initializers (a fresh BatchNorm's scale = running_var = ones, bias =
running_mean = zeros), and its training-mode BatchNormalization kernel then overwrites scale/bias with
the running statistics before computing Y (microsoft/onnxruntime#29790, wrong Y in the forward pass
already; fix pending in PR #29878).
"""

from __future__ import annotations

import copy

import numpy as np
import onnx
import pytest

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import compile_model

torch = pytest.importorskip("torch")
models = pytest.importorskip("tests.models")

NAMES = ("mlp", "lenet_bn", "resnet_block", "transformer_encoder", "gpt_block", "lstm_cls", "gru_cls",
         "rnn_relu_cls", "recommender", "spatial_transformer", "fake_quant_mlp", "spectrogram_cls")
RTOL = 1e-4
ELEM_ATOL = 1e-6  # × max|torch gradient| of the tensor
# parameters whose exact gradient is 0 but torch's is roundoff: conv biases feeding a training-mode
# BatchNormalization. (Gradients torch gives as exact zeros, e.g. the reverse-direction W_hh of the RNNs'
# second layer, whose only step read by the classifier starts from h0 = 0, get the same check.)
EXACT_ZERO = {"lenet_bn": {"model.features.0.bias", "model.features.4.bias"}}
ZERO_TOL = 1e-5  # × the model's largest gradient element


# models onnx.reference cannot run (onnxruntime is their second oracle)
NO_REFERENCE = {
    "rnn_relu_cls": "onnx.reference's RNN knows only the default activations",
    "spatial_transformer": "onnx.reference's GridSample does not know opset 16's mode name 'bilinear'",
    "fake_quant_mlp": "onnx.reference has DequantizeLinear from opset 19 only",
    "spectrogram_cls": "onnx.reference's STFT takes rank-3 signals only (torch exports [batch, length])",
}


def _rnn_rules_present() -> bool:
    from onnxtrain.autodiff.registry import find_rule

    return find_rule("LSTM", 17) is not None and find_rule("GRU", 17) is not None


def _params(name: str, model: onnx.ModelProto, module: torch.nn.Module) -> list[str]:
    """The torch parameter names, each checked to be a float initializer of the graph (same name)."""
    inits = {t.name: t for t in model.graph.initializer}
    params = [n for n, _ in module.named_parameters()]
    missing = [p for p in params if p not in inits]
    assert not missing, f"{name}: torch parameters without an initializer of that name: {missing}"
    assert all(inits[p].data_type == onnx.TensorProto.FLOAT for p in params)
    return params


def _setup(name: str, dropout: float = 0.0):
    model, feeds, module = models.export(name, training=True, with_loss=True, dropout=dropout)
    wrt = _params(name, model, module)
    gmodel = build_gradient_model(model, "loss", wrt)
    return model, gmodel, feeds, module, wrt


def _run(gmodel: onnx.ModelProto, feeds: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    return dict(zip([o.name for o in gmodel.graph.output], compile_model(gmodel).run(feeds)))


def _torch_grads(module: torch.nn.Module,
                 feeds: dict[str, np.ndarray]) -> tuple[float, dict[str, np.ndarray]]:
    module.train(True)
    module.zero_grad(set_to_none=True)
    loss = module(*(torch.from_numpy(v) for v in feeds.values()))
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in module.named_parameters()}


def _assert_close(name: str, ours: dict[str, np.ndarray], ref: dict[str, np.ndarray], what: str) -> None:
    """Every gradient of ``ref`` matched by ``ours`` (see the module docstring for the tolerance)."""
    scale = max(float(np.abs(b).max()) for b in ref.values())
    errors = []
    for p, b in ref.items():
        a = ours[f"{p}_grad"]
        if a.shape != b.shape:
            errors.append(f"{p}: shape {a.shape} vs {b.shape}")
            continue
        if p in EXACT_ZERO.get(name, ()) or not np.any(b):
            worst = max(float(np.abs(a).max()), float(np.abs(b).max()))
            if worst > ZERO_TOL * scale:
                errors.append(f"{p}: exact gradient is 0, got max |g| {worst:.3g} (scale {scale:.3g})")
            continue
        rel = float(np.linalg.norm(a - b) / np.linalg.norm(b))
        bad = np.abs(a - b) > RTOL * np.abs(b) + ELEM_ATOL * float(np.abs(b).max())
        if rel > RTOL or bad.any():
            errors.append(f"{p}: tensor-wise rel {rel:.3g}, {int(bad.sum())}/{b.size} elements off, "
                          f"max abs diff {float(np.abs(a - b).max()):.3g}")
    assert not errors, f"{name} ({what}):\n  " + "\n  ".join(errors)


def _marks(name: str) -> list:
    if name in ("lstm_cls", "gru_cls") and not _rnn_rules_present():
        return [pytest.mark.xfail(reason="LSTM/GRU gradient rules (autodiff/rules/rnn.py) not written yet",
                                  strict=False)]
    return []


CASES = [pytest.param(n, marks=_marks(n), id=n) for n in NAMES]


@pytest.mark.parametrize("name", CASES)
def test_gradients_match_torch(name: str) -> None:
    model, gmodel, feeds, module, wrt = _setup(name)
    onnx.checker.check_model(gmodel, full_check=True)
    assert [o.name for o in gmodel.graph.output] == ["loss", *(f"{p}_grad" for p in wrt)]
    ours = _run(gmodel, feeds)
    loss, theirs = _torch_grads(module, feeds)
    np.testing.assert_allclose(ours["loss"], loss, rtol=1e-5, err_msg=f"{name}: loss")
    _assert_close(name, ours, theirs, "engine vs torch autograd")


# torch's default exporter (dynamo) writes the RNNs' W and R from Slices of the stacked weights whose ends
# it reads at run time, so shape inference leaves their sizes unknown (and, for a second layer, X's too)
DYNAMO_NAMES = ("mlp", "lstm_cls", "gru_cls", "transformer_encoder")


@pytest.mark.parametrize("name", DYNAMO_NAMES)
def test_dynamo_export_gradients_match_torch(name: str) -> None:
    pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
    model, module = models.export_dynamo(name)
    module = copy.deepcopy(module)
    wrt = _params(name, model, module)
    gmodel = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(gmodel, full_check=True)
    feeds = models.example_inputs(name, 2, with_loss=True, seed=1)
    ours = _run(gmodel, feeds)
    loss, theirs = _torch_grads(module, feeds)
    np.testing.assert_allclose(ours["loss"], loss, rtol=1e-5, err_msg=f"{name}: loss")
    _assert_close(name, ours, theirs, "dynamo export, engine vs torch autograd")


@pytest.mark.parametrize("name", CASES)
def test_gradient_graph_portable(name: str) -> None:
    from onnx.reference import ReferenceEvaluator

    ort = pytest.importorskip("onnxruntime")
    _, gmodel, feeds, _, wrt = _setup(name)
    ours = _run(gmodel, feeds)
    ours_grads = {p: ours[f"{p}_grad"] for p in wrt}
    names = [o.name for o in gmodel.graph.output]
    ref = None
    if name not in NO_REFERENCE:
        ref = dict(zip(names, ReferenceEvaluator(gmodel).run(None, feeds)))
        _assert_close(name, ref, ours_grads, "onnx.reference vs engine")
    # ConstantSharing: see the module docstring (onnxruntime#29790)
    sess = ort.InferenceSession(gmodel.SerializeToString(), providers=["CPUExecutionProvider"],
                                disabled_optimizers=["ConstantSharing"])
    got = dict(zip(names, sess.run(None, feeds)))
    _assert_close(name, got, ours_grads, "onnxruntime vs engine")
    np.testing.assert_allclose(got["loss"], ours["loss"], rtol=1e-5)
    if ref is not None:
        np.testing.assert_allclose(ref["loss"], ours["loss"], rtol=1e-5)


def test_batchnorm_running_stats_not_differentiated() -> None:
    """Float initializers that are buffers (running stats, masks) are not in wrt and get no gradient input."""
    model, gmodel, _, module, wrt = _setup("resnet_block")
    buffers = {n for n, _ in module.named_buffers()}
    floats = {t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT}
    assert floats - set(wrt) == floats & buffers and floats & buffers
    assert not any(o.name.startswith(tuple(buffers)) for o in gmodel.graph.output)


def test_dropout_reuses_forward_mask() -> None:
    """With ratio 0.25 the backward pass uses the mask the forward pass drew: dX = dY·mask/(1 − p).

    The Dropout's input X and output Y are also differentiated (``wrt`` may name intermediate values), so
    the graph outputs dX and dY next to the forward's X, Y and mask; torch, given that same mask in place
    of its dropout, must then give the same parameter gradients (gradients of the conv stages flow through
    the dropout).
    """
    p = 0.25
    model0, feeds, module = models.export("lenet_bn", training=True, with_loss=True, dropout=p)
    model = onnx.ModelProto()
    model.CopyFrom(model0)
    (drop,) = [n for n in model.graph.node if n.op_type == "Dropout"]
    while len(drop.output) < 2:
        drop.output.append("")
    if not drop.output[1]:
        drop.output[1] = "dropout_mask"
    x, y, mask_name = drop.input[0], drop.output[0], drop.output[1]
    wrt = _params("lenet_bn", model, module)
    gmodel = build_gradient_model(model, "loss", [*wrt, x, y], extra_outputs=[mask_name, x, y])
    onnx.checker.check_model(gmodel, full_check=True)
    out = _run(gmodel, feeds)
    mask = out[mask_name]
    assert mask.dtype == np.bool_ and 0.5 < mask.mean() < 0.95, mask.mean()  # a real draw, not all ones
    np.testing.assert_allclose(out[y], out[x] * mask / (1 - p), rtol=1e-6, atol=0)
    np.testing.assert_allclose(out[f"{x}_grad"], out[f"{y}_grad"] * mask / (1 - p), rtol=1e-6, atol=0)
    assert np.all(out[f"{x}_grad"][~mask] == 0) and np.any(out[f"{y}_grad"][~mask] != 0)

    keep = torch.from_numpy(mask)

    class FixedMaskDropout(torch.nn.Module):
        def forward(self, t: torch.Tensor) -> torch.Tensor:
            return t * keep / (1 - p)

    module.model.drop = FixedMaskDropout()
    loss, theirs = _torch_grads(module, feeds)
    np.testing.assert_allclose(out["loss"], loss, rtol=1e-5)
    _assert_close("lenet_bn", out, theirs, "dropout 0.25, torch given the engine's mask")
