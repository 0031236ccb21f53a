"""onnxtrain against torch's OpInfo database (``op_db``): forward values and float64 gradients of each op's
sample calls, exported by the TorchScript exporter (``tests/autodiff/opinfo_exports.py`` builds and classifies
the cases).

Forward: ``onnxtrain.InferenceSession`` on the export, against torch's outputs, in float32 and float64 and
in int64 and bool where the op takes them. Gradients: the gradient graph (``GradientGraphBuilder``) of
Σᵢ sum(outᵢ·wᵢ) for fixed random weights wᵢ, against ``torch.autograd.grad`` in float64 (rtol 1e-7, atol 1e-9
times the gradient's magnitude); the graph also passes ``onnx.checker``'s full check and runs on onnxruntime.

A case whose export fails, is not valid ONNX, or computes something else than torch (onnxruntime, or
onnx.reference where onnxruntime has no kernel, agrees with onnxtrain and not with torch: a scalar argument
exported as float32, an attribute the exporter drops) is skipped with the reason: it is torch's exporter's
fault, not onnxtrain's. So is a difference the README lists under Limits (``documented``: Resize with
align_corners at a fractional scaled length, a ReduceMean over nothing). A refusal by onnxtrain must be listed
in ``REFUSED``; anything else that disagrees fails.

The default suite runs the first sample of the ops in ``DEFAULT`` (a few at opset 18 too); with
``ONNXTRAIN_FULL_TESTS=1`` every sample of every deterministic op (random ops, dropout and ops returning
uninitialized memory are left out).
"""

from __future__ import annotations

import pytest

from tests import tiers

torch = pytest.importorskip("torch")
pytest.importorskip("expecttest")  # torch's op_db imports it
opinfo = pytest.importorskip("tests.autodiff.opinfo_exports")

# the first sample of each runs by default: elementwise math, reductions, shapes and indexing, convolutions
# and pools, normalizations, activations, losses, comparisons and casts
DEFAULT = (
    "abs", "acos", "asin", "atan", "cos", "exp", "log", "log1p", "sin", "tan", "tanh", "sigmoid", "sqrt",
    "rsqrt", "reciprocal", "square", "erf", "logit", "neg", "clamp", "clamp_min", "clamp_max", "lerp",
    "addcmul", "nan_to_num", "where", "masked_fill", "cumsum", "cross", "roll", "flip", "tril", "triu",
    "dot", "mv", "mm", "bmm", "baddbmm", "matmul", "einsum", "tensordot", "outer",
    "sum", "mean", "prod", "amax", "amin", "max.reduction_with_dim", "min.reduction_no_dim", "norm",
    "linalg.norm", "logdet", "topk", "sort",
    "reshape", "permute", "transpose", "squeeze", "unsqueeze", "flatten", "unflatten", "expand", "tile",
    "cat", "stack", "split", "chunk", "unbind", "narrow", "select", "gather", "scatter", "scatter_add",
    "index_put", "take", "masked_select", "masked_scatter", "__getitem__", "repeat_interleave",
    "nn.functional.linear", "nn.functional.conv1d", "nn.functional.conv2d", "nn.functional.conv_transpose2d",
    "nn.functional.max_pool2d", "nn.functional.avg_pool1d", "nn.functional.adaptive_max_pool3d",
    "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.local_response_norm",
    "nn.functional.normalize", "nn.functional.pad.reflect", "nn.functional.pad.circular",
    "nn.functional.interpolate.bilinear", "nn.functional.interpolate.bicubic",
    "nn.functional.pixel_shuffle", "nn.functional.embedding", "nn.functional.embedding_bag",
    "nn.functional.scaled_dot_product_attention",
    "nn.functional.relu", "nn.functional.gelu", "nn.functional.silu", "nn.functional.mish",
    "nn.functional.elu", "nn.functional.prelu", "nn.functional.glu", "nn.functional.hardtanh",
    "nn.functional.softshrink", "nn.functional.logsigmoid", "softmax", "log_softmax",
    "nn.functional.cross_entropy", "nn.functional.nll_loss", "nn.functional.kl_div",
    "nn.functional.gaussian_nll_loss", "nn.functional.cosine_similarity",
    "eq", "lt", "logical_and", "isnan", "argmax", "argsort", "nonzero", "unique", "bucketize", "long",
    "linspace", "ones_like",
)
# also exported at opset 18, where reductions take their axes and Pad and Split more as inputs
OPSET_18 = ("sum", "amax", "mean", "nn.functional.pad.reflect", "split", "nn.functional.interpolate.bilinear",
            "nn.functional.layer_norm", "norm")

# ops onnxtrain refuses with an error naming what it does not support: op key → the reason
REFUSED = {
    "tensordot": "an Einsum operand with a static 1 where the other has 4 on one letter (a broadcast ONNX's "
                 "shape inference does not follow; README Limits): refused by name",
}

FORWARD_DTYPES = ("float32", "float64", "int64", "bool")


def _cases() -> list[object]:
    cases: list[object] = [pytest.param(k, 0, 17, id=f"{k}-0") for k in DEFAULT]
    cases += [pytest.param(k, 0, 18, id=f"{k}-0-opset18") for k in OPSET_18]
    if not tiers.full():
        return cases
    for key in opinfo.deterministic_keys():
        for index in range(_sample_count(key)):
            if not (index == 0 and key in DEFAULT):
                cases.append(tiers.extended(key, index, 17, id=f"{key}-{index}"))
    return cases


def _sample_count(key: str) -> int:
    info = opinfo.op_db()[key]
    for dtype in (torch.float64, torch.float32, torch.int64, torch.bool):
        if info.supports_dtype(dtype, "cpu"):
            try:
                return len(opinfo.samples(key, dtype))
            except Exception:  # noqa: BLE001 - torch cannot make the op's samples: nothing to test
                return 0
    return 0


def _judge(key: str, outcomes: dict[str, object]) -> None:
    """Fail on a disagreement or an unlisted refusal; skip when every case is the exporter's fault."""
    faults = [f"{what}: {o.detail}" for what, o in outcomes.items()
              if o.kind == "disagrees" or (o.kind == "refused" and key not in REFUSED)]
    assert not faults, f"{key}:\n  " + "\n  ".join(faults)
    if outcomes and all(o.kind in ("export", "documented") for o in outcomes.values()):
        pytest.skip("; ".join(f"{what}: {o.detail}"[:200] for what, o in outcomes.items()))


@pytest.mark.parametrize(("key", "index", "opset"), _cases())
def test_forward(key: str, index: int, opset: int) -> None:
    """The sample's outputs on onnxtrain equal torch's, in each dtype the op takes."""
    info = opinfo.op_db()[key]
    outcomes = {}
    for name in FORWARD_DTYPES:
        dtype = getattr(torch, name)
        if not info.supports_dtype(dtype, "cpu") or opinfo.sample(key, dtype, index) is None:
            continue
        outcomes[name] = opinfo.check_forward(key, dtype, index, opset)
    if not outcomes:
        pytest.skip(f"{key} has no sample {index} in {FORWARD_DTYPES}")
    _judge(key, outcomes)


@pytest.mark.parametrize(("key", "index", "opset"), _cases())
def test_gradients(key: str, index: int, opset: int) -> None:
    """onnxtrain's float64 gradient graph of the sample gives torch.autograd's gradients."""
    info = opinfo.op_db()[key]
    if not opinfo.differentiable(key) or not info.supports_dtype(torch.float64, "cpu"):
        pytest.skip(f"{key}: torch gives it no float64 gradient")
    if opinfo.sample(key, torch.float64, index, True) is None:
        pytest.skip(f"{key} has no differentiable sample {index}")
    _judge(key, {"gradients": opinfo.check_gradients(key, index, opset)})
