"""Forward values and gradients at the edges (kinks, ties, zeros, ±inf, saturation, large magnitudes), node by
node in float64 (float32/float16 where the op or torch computes so) and through torch's exporters, against
torch 2.x autograd: the same numbers, nan where torch gives nan and finite where torch is finite.

Deliberate differences, where torch's choice is arbitrary and the ONNX graph has a clear meaning, are tested
as such (``test_documented_differences``)."""

from __future__ import annotations

import io
import math
from collections.abc import Callable

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import run_engine

torch = pytest.importorskip("torch")
F = torch.nn.functional
INF = math.inf


def _a(*v: float, dtype: type = np.float64) -> np.ndarray:
    return np.array(v, dtype)


def _ints(*v: int) -> np.ndarray:
    return np.array(v, np.int64)


def _node(
    op: str,
    inputs: dict[str, np.ndarray],
    wrt: list[str],
    opset: int = 18,
    consts: tuple[str, ...] = (),
    n_out: int = 1,
    **attrs,
) -> tuple[onnx.ModelProto, dict[str, np.ndarray], np.ndarray]:
    """One ``op`` node (``n_out`` outputs, the loss Σ y0·r reads the first, r fixed, positive); the gradient
    graph (checked), its outputs on the engine, and r. ``consts``: inputs given as initializers."""
    dt = next(v.dtype for v in inputs.values() if v.dtype.kind == "f")
    et = helper.np_dtype_to_tensor_dtype(dt)
    nodes = [
        helper.make_node(op, list(inputs), [f"y{i}" for i in range(n_out)], **attrs),
        helper.make_node("Mul", ["y0", "r"], ["yr"]),
        helper.make_node("ReduceSum", ["yr"], ["loss"], keepdims=0),
    ]
    given = {n: v for n, v in inputs.items() if n not in consts}
    model = make_model(
        helper.make_graph(
            nodes,
            op,
            [
                helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
                for n, v in given.items()
            ],
            [helper.make_tensor_value_info("loss", et, [])],
            [numpy_helper.from_array(inputs[n], n) for n in consts],
        ),
        opset,
    )
    y_shape = onnx.shape_inference.infer_shapes(model).graph.value_info
    shapes = {v.name: [d.dim_value for d in v.type.tensor_type.shape.dim] for v in y_shape}
    shape = shapes.get("y0", next(iter(inputs.values())).shape)  # a function op's output: X's shape
    r = np.random.default_rng(3).uniform(0.5, 1.5, shape).astype(dt)
    model.graph.initializer.append(numpy_helper.from_array(r, "r"))
    grads = build_gradient_model(model, "loss", wrt)
    onnx.checker.check_model(grads, full_check=True)
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, given)))
    return grads, got, r


def _close(got: np.ndarray, want: np.ndarray, tol: float) -> None:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))  # nan exactly where torch has nan
    np.testing.assert_allclose(got, want, rtol=tol, atol=tol, equal_nan=True)


def _vs_torch(
    op: str,
    inputs: dict[str, np.ndarray],
    wrt: list[str],
    ref: Callable,
    opset: int = 18,
    consts: tuple[str, ...] = (),
    tol: float | None = None,
    n_out: int = 1,
    **attrs,
) -> dict[str, np.ndarray]:
    """``op``'s loss and the gradients of ``wrt`` equal torch's (``ref`` maps the inputs as torch tensors, in
    order, to y0); float16 inputs go to ``ref`` as float32 and its result back to float16."""
    _, got, r = _node(op, inputs, wrt, opset, consts, n_out, **attrs)
    half = any(v.dtype == np.float16 for v in inputs.values())
    ts = {n: torch.tensor(v, requires_grad=n in wrt) for n, v in inputs.items()}
    y = ref(*[t.float() if half and t.is_floating_point() else t for t in ts.values()])
    if half:
        y = y.half()
    loss = (y * torch.from_numpy(r)).sum()
    loss.backward()
    tol = tol or {np.float64: 1e-6, np.float32: 2e-5, np.float16: 2e-3}[r.dtype.type]
    _close(got["loss"], loss.detach().numpy(), tol)
    for n in wrt:
        _close(got[f"{n}_grad"], ts[n].grad.numpy(), tol)
    return got


class _Fn(torch.nn.Module):
    def __init__(self, fn: Callable):
        super().__init__()
        self.fn = fn

    def forward(self, *args):  # noqa: ANN002, ANN201
        return self.fn(*args)


def _export(fn: Callable, args: tuple, dynamo: bool) -> onnx.ModelProto:
    if dynamo:
        return torch.onnx.export(_Fn(fn), args, dynamo=True, optimize=False, verbose=False).model_proto
    f = io.BytesIO()
    torch.onnx.export(
        _Fn(fn), args, f, dynamo=False, training=torch.onnx.TrainingMode.TRAINING, do_constant_folding=False
    )
    return onnx.load_from_string(f.getvalue())


def _export_vs_torch(
    fn: Callable, args: tuple, wrt: tuple[int, ...], dynamo: bool, tol: float = 1e-5
) -> None:
    """A float32 scalar ``fn`` exported by torch: its value and the gradients of the inputs ``wrt`` equal
    torch's."""
    model = _export(fn, args, dynamo)
    names = [i.name for i in model.graph.input]
    loss = model.graph.output[0].name
    grads = build_gradient_model(model, loss, [names[i] for i in wrt])
    onnx.checker.check_model(grads, full_check=True)
    got = dict(
        zip(
            [o.name for o in grads.graph.output],
            run_engine(grads, {n: a.numpy() for n, a in zip(names, args)}),
        )
    )
    ts = [a.clone().requires_grad_(i in wrt) for i, a in enumerate(args)]
    y = fn(*ts)
    y.backward()
    _close(got[loss], y.detach().numpy(), tol)
    for i in wrt:
        _close(got[f"{names[i]}_grad"], ts[i].grad.numpy(), tol)


# ---- fixed here: each failed before -------------------------------------------------------------------

SCORES = np.array([[1e4, -1e4, 0.0], [-1e4, 1e4, 5.0], [0.0, 0.0, 0.0], [3.0, -1e4, 1e4]])


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("weighted", [False, True])
def test_mean_loss_with_every_sample_ignored_has_a_zero_gradient(op: str, weighted: bool) -> None:
    # the loss is 0/0 = nan, as torch's; the gradient was nan (dL·w_i / Σw with Σw = 0), torch's is 0
    inputs = {"x": SCORES, "t": _ints(-1, -1, -1, -1)}
    if weighted:
        inputs["w"] = _a(0.5, 2.0, 1.0)
    torch_fn = F.cross_entropy if op == "SoftmaxCrossEntropyLoss" else F.nll_loss

    def vs_torch() -> dict:
        return _vs_torch(op, inputs, ["x"], lambda x, t, w=None: torch_fn(x, t, w, ignore_index=-1),
                         consts=tuple(inputs)[1:], reduction="mean", ignore_index=-1)

    got = vs_torch()
    assert np.isnan(got["loss"]) and not got["x_grad"].any()
    # some samples kept: unchanged, the weighted mean over them
    inputs["t"] = _ints(0, -1, 2, 1)
    vs_torch()


@pytest.mark.parametrize("p", [2, 3])
def test_lp_pool_of_a_zero_window_has_a_zero_gradient(p: int) -> None:
    # Y = 0: x·|x|^(p−2) · dY / Y^(p−1) was 0·inf = nan; torch's lp_pool2d (and its norms) give 0
    x = np.array([[[[0.0, 0, 1, 2], [0, 0, 0.5, 3]], [[0, 0, 0, 0], [0, 0, 0, 0]]]])
    _vs_torch(
        "LpPool", {"x": x}, ["x"], lambda x: F.lp_pool2d(x, p, 2), kernel_shape=[2, 2], strides=[2, 2], p=p
    )
    _vs_torch(
        "GlobalLpPool", {"x": x}, ["x"], lambda x: torch.linalg.vector_norm(x, p, (2, 3), keepdim=True), p=p
    )


def test_max_min_with_a_constant_bound_pass_the_gradient_at_the_bound() -> None:
    # Max(x, c) ≡ Clip(x, c): x == c gets all of dY, as torch.clamp (it got half: the constant took a share)
    x = _a(-1, 0, 2)
    _vs_torch("Max", {"x": x, "c": _a(0)}, ["x"], lambda x, c: x.clamp(min=0.0), consts=("c",))
    _vs_torch("Min", {"x": x, "c": _a(0)}, ["x"], lambda x, c: x.clamp(max=0.0), consts=("c",))
    # two that vary tie: split evenly, as torch.maximum; the constant still takes none
    _vs_torch(
        "Max",
        {"x": _a(1, 2, 0, -1), "y": _a(1, 1, 0, -1), "c": _a(0)},
        ["x", "y"],
        lambda x, y, c: torch.maximum(x, y).clamp(min=0.0),
        consts=("c",),
    )
    _vs_torch("Max", {"x": _a(1, 2, 3), "y": _a(1, 1, 3)}, ["x", "y"], torch.maximum)


def test_dynamo_clamp_export_at_its_bounds() -> None:
    # torch's dynamo exporter writes x.clamp(lo, hi) as Min(Max(x, CastLike(lo)), CastLike(hi))
    x = torch.tensor([-4.0, -1, 0, 3, 5])
    w = torch.tensor([1.0, 2, 3, 4, 5])
    _export_vs_torch(lambda x: (x.clamp(-1, 3) * w).sum(), (x,), (0,), dynamo=True)


def test_binary_cross_entropy_of_a_saturated_sigmoid_dynamo() -> None:
    # torch's dynamo exporter writes F.binary_cross_entropy as Max(Log(p), −100) and Max(Log(1 − p), −100):
    # at p = 0 or 1 the clamp wins, its gradient is 0 and Log's 0/0 was nan (x = ±20 already in float32)
    # (the TorchScript exporter does not export binary_cross_entropy)
    x = torch.tensor([-200.0, -100, -20, -1, 0, 1, 20, 100, 200])
    for y in (torch.zeros(9), torch.ones(9), torch.tensor([0.0, 1, 0, 1, 0.5, 0, 1, 0, 1])):
        _export_vs_torch(lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), y), (x, y), (0,), dynamo=True)
    # a deliberate difference: for 27 < |x| < 88 and the far label (log p above the clamp), the graph's exact
    # derivative −(1 − p)/N ≈ −1/N; torch's backward divides by max(p·(1 − p), 1e-12) and gives ≈ 0
    x, y = torch.tensor([-50.0, 0]), torch.ones(2)
    model = _export(lambda x, y: F.binary_cross_entropy(torch.sigmoid(x), y), (x, y), dynamo=True)
    names = [i.name for i in model.graph.input]
    grads = build_gradient_model(model, model.graph.output[0].name, [names[0]])
    got = run_engine(grads, {names[0]: x.numpy(), names[1]: y.numpy()})
    np.testing.assert_allclose(got[1], [-0.5, -0.25], rtol=1e-6)


def test_tanh_gelu_float16_beyond_256() -> None:
    # X² overflows float16 from |X| = 256: the derivative's (1 − t²)·(c + 3ck·X²) was 0·inf = nan; torch
    # (computing a half GELU in float32) gives 0 there
    x = _a(-6e4, -6e3, -300, -100, -10, 0, 10, 100, 300, 6e4, dtype=np.float16)
    _vs_torch("Gelu", {"x": x}, ["x"], lambda x: F.gelu(x, approximate="tanh"), opset=20, approximate="tanh")


def test_attention_with_a_fully_masked_row_torchscript() -> None:
    # the TorchScript exporter writes SDPA's mask as Where(IsNaN(Softmax), 0, Softmax): a fully masked row
    # attends to nothing, as in torch; its gradient was nan (the Softmax backward read the nan Y)
    q = torch.randn(1, 2, 3, 4, generator=torch.Generator().manual_seed(0))
    mask = torch.tensor([[True, False, True], [False, False, False], [True, True, True]]).reshape(1, 1, 3, 3)
    _export_vs_torch(
        lambda q, k, v: (F.scaled_dot_product_attention(q, k, v, attn_mask=mask) * 1.5).sum(),
        (q, q + 1, q * 2),
        (0, 1, 2),
        dynamo=False,
    )


# ---- conventions that already held (kinks, ties, zeros, saturation) -------------------------------------

X = _a(-3, -1, 0, 1e-300, 1, 3, -2.5, 2.5, 6, -6)
ROWS = np.array([[1.0, 3, 3, 2], [5, 5, 5, 5], [0, 0, 0, 0]])
MASKED = np.array([[0, -INF, 1, 2], [-INF, -INF, -INF, -INF], [1e4, 1e4, -1e4, 0], [-INF, 3, -INF, -INF]])
CONST = np.array([[[2.0, 2, 2, 2], [1, 2, 3, 4]], [[0, 0, 0, 0], [-1, -1, -1, -1]]])
SCALE, BIAS = _a(1.5, 0.5, 2, 1), _a(0.1, 0.2, 0.3, 0.4)
PLANES = np.array([[[[3.0, 3], [3, 3]], [[1, 2], [3, 4]]], [[[3.0, 3], [3, 3]], [[0, 0], [0, 0]]]])

def _reduce_over_rows(op: str, x: np.ndarray, ref, *lead: int) -> tuple:
    """A CASES entry: opset-18 ``op`` over axis 1 of ``x`` (the axes a constant input), keepdims, against
    torch's ``ref(x, *lead, 1, keepdim=True)``."""
    return op, {"x": x, "a": _ints(1)}, ["x"], lambda x, a: ref(x, *lead, 1, keepdim=True), {}, 18, ("a",)


CASES: dict[str, tuple] = {  # name → (op, inputs, wrt, torch reference, attributes[, opset, consts])
    "Relu": ("Relu", {"x": X}, ["x"], F.relu, {}),
    "LeakyRelu": ("LeakyRelu", {"x": X}, ["x"], lambda x: F.leaky_relu(x, 0.1), {"alpha": 0.1}),
    "PRelu": ("PRelu", {"x": X, "s": _a(0.25)}, ["x", "s"], F.prelu, {}),
    "Elu": ("Elu", {"x": X}, ["x"], lambda x: F.elu(x, 0.7), {"alpha": 0.7}),
    "Selu": ("Selu", {"x": X}, ["x"], F.selu, {}),
    "Celu_f32": ("Celu", {"x": X.astype(np.float32)}, ["x"], lambda x: F.celu(x, 0.5), {"alpha": 0.5}),
    "HardSigmoid_at_±3": (
        "HardSigmoid",
        {"x": _a(-3, 3, -3.0000001, 0, 2.9999999)},
        ["x"],
        F.hardsigmoid,
        {"alpha": 1 / 6, "beta": 0.5},
    ),
    "HardSwish_at_±3": ("HardSwish", {"x": X}, ["x"], F.hardswish, {}),
    "Softplus": ("Softplus", {"x": _a(-1e3, -50, 0, 20, 30, 50, 1e3)}, ["x"], F.softplus, {}),
    "Softsign": ("Softsign", {"x": _a(-1e300, 0, 1e300, 1)}, ["x"], F.softsign, {}),
    "Mish": ("Mish", {"x": _a(-1e3, -50, 0, 20, 50, 1e3)}, ["x"], F.mish, {}),
    "Abs_at_0": ("Abs", {"x": X}, ["x"], torch.abs, {}),
    "Sign_at_0": ("Sign", {"x": X}, ["x"], torch.sign, {}),
    "ThresholdedRelu": (
        "ThresholdedRelu",
        {"x": _a(-1, 0, 1, 1.5)},
        ["x"],
        lambda x: F.threshold(x, 1.0, 0.0),
        {"alpha": 1.0},
    ),
    "Shrink_soft": (
        "Shrink",
        {"x": _a(-1, -0.5, 0, 0.5, 1)},
        ["x"],
        lambda x: F.softshrink(x, 0.5),
        {"lambd": 0.5, "bias": 0.5},
    ),
    "Shrink_hard": (
        "Shrink",
        {"x": _a(-1, -0.5, 0, 0.5, 1)},
        ["x"],
        lambda x: F.hardshrink(x, 0.5),
        {"lambd": 0.5},
    ),
    "Gelu": ("Gelu", {"x": _a(-1e4, -30, 0, 30, 1e4)}, ["x"], F.gelu, {}, 20),
    "Clip_at_bounds": (
        "Clip",
        {"x": _a(-1, -0.5, 0, 0.5, 1), "lo": _a(-0.5), "hi": _a(0.5)},
        ["x", "lo", "hi"],
        torch.clamp,
        {},
    ),
    "Clip_lo_above_hi": (
        "Clip",
        {"x": _a(-1, 0, 1), "lo": _a(0.5), "hi": _a(-0.5)},
        ["x"],
        torch.clamp,
        {},
        18,
        ("lo", "hi"),
    ),
    "Min_tie": ("Min", {"x": _a(1, 2, 3), "y": _a(1, 1, 3)}, ["x", "y"], torch.minimum, {}),
    "Tanh_saturated": ("Tanh", {"x": _a(-1e4, -30, 0, 30, 1e4)}, ["x"], torch.tanh, {}),
    "Sigmoid_saturated": ("Sigmoid", {"x": _a(-1e4, -800, -30, 0, 30, 800, 1e4)}, ["x"], torch.sigmoid, {}),
    "Erf_saturated": ("Erf", {"x": _a(-1e4, -30, 0, 30, 1e4)}, ["x"], torch.erf, {}),
    "Atan_huge": ("Atan", {"x": _a(-1e300, -1, 0, 1, 1e300)}, ["x"], torch.atan, {}),
    "Asin_±1": ("Asin", {"x": _a(-1, 0, 1)}, ["x"], torch.asin, {}),
    "Acos_±1": ("Acos", {"x": _a(-1, 0, 1)}, ["x"], torch.acos, {}),
    "Sqrt_at_0": ("Sqrt", {"x": _a(0, 1, 4)}, ["x"], torch.sqrt, {}),
    "Log_at_0": ("Log", {"x": _a(0, 1, 4)}, ["x"], torch.log, {}),
    "Reciprocal_at_±0": ("Reciprocal", {"x": _a(0, -0.0, 1, 4)}, ["x"], torch.reciprocal, {}),
    "Div_by_0": ("Div", {"x": _a(1, 0, -1, 2), "y": _a(0, 0, 0, 2)}, ["x", "y"], torch.div, {}),
    "Pow_base_0": ("Pow", {"x": _a(0, 0, 0, 0), "y": _a(2, 0.5, 0, 1)}, ["x", "y"], torch.pow, {}),
    "Pow_base_0_negative_exponent": ("Pow", {"x": _a(0, 0, 0, 2), "y": _a(-1, -0.5, 3, -1)}, ["x", "y"],
                                     torch.pow, {}),
    "Pow_base_0_opset_11": ("Pow", {"x": _a(0, 0, 1), "y": _a(-2, 0, -2)}, ["x", "y"], torch.pow, {}, 11),
    "Pow_y2_const": ("Pow", {"x": _a(0, -2, 3), "y": _a(2)}, ["x"], torch.pow, {}, 18, ("y",)),
    "Pow_y0_const": ("Pow", {"x": _a(0, -2, 3), "y": _a(0)}, ["x"], torch.pow, {}, 18, ("y",)),
    "Pow_y.5_const": ("Pow", {"x": _a(0, 2, 3), "y": _a(0.5)}, ["x"], torch.pow, {}, 18, ("y",)),
    "Pow_y3_negative_base": ("Pow", {"x": _a(-2, -1, 0, 2), "y": _a(3)}, ["x"], torch.pow, {}, 18, ("y",)),
    "ReduceMax_ties_as_amax": _reduce_over_rows("ReduceMax", ROWS, torch.amax),
    "ReduceMin_ties_as_amin": _reduce_over_rows("ReduceMin", ROWS, torch.amin),
    "ReduceL2_zero_row": _reduce_over_rows("ReduceL2", ROWS, torch.linalg.vector_norm, 2),
    "ReduceL1_zero_row": _reduce_over_rows("ReduceL1", ROWS, torch.linalg.vector_norm, 1),
    "ReduceLogSumExp_-inf": _reduce_over_rows("ReduceLogSumExp", MASKED, torch.logsumexp),
    "Softmax_masked": ("Softmax", {"x": MASKED}, ["x"], lambda x: torch.softmax(x, -1), {"axis": -1}),
    "Softmax_masked_axis0": (
        "Softmax",
        {"x": MASKED.T.copy()},
        ["x"],
        lambda x: torch.softmax(x, 0),
        {"axis": 0},
    ),
    "LogSoftmax_masked": (
        "LogSoftmax",
        {"x": MASKED},
        ["x"],
        lambda x: torch.log_softmax(x, -1),
        {"axis": -1},
    ),
    "SCE_1e4_ignored": (
        "SoftmaxCrossEntropyLoss",
        {"x": SCORES, "t": _ints(0, -100, 2, 1)},
        ["x"],
        lambda x, t: F.cross_entropy(x, t, reduction="none"),
        {"reduction": "none", "ignore_index": -100},
        18,
        ("t",),
    ),
    "SCE_-inf_logit": (
        "SoftmaxCrossEntropyLoss",
        {"x": np.array([[0, -INF, 1.0], [-INF, 2, 3]]), "t": _ints(0, 2)},
        ["x"],
        F.cross_entropy,
        {},
        18,
        ("t",),
    ),
    "NLL_1e4": (
        "NegativeLogLikelihoodLoss",
        {"x": np.array([[-1e4, 0, -5.0], [-1, -2, -3]]), "t": _ints(0, 1)},
        ["x"],
        F.nll_loss,
        {},
        18,
        ("t",),
    ),
    "LayerNorm_constant_row": (
        "LayerNormalization",
        {"x": CONST, "s": SCALE, "b": BIAS},
        ["x", "s", "b"],
        lambda x, s, b: F.layer_norm(x, (4,), s, b, 1e-5),
        {"epsilon": 1e-5},
    ),
    "RMSNorm_zero_row": (
        "RMSNormalization",
        {"x": CONST, "s": SCALE},
        ["x", "s"],
        lambda x, s: F.rms_norm(x, (4,), s, 1e-5),
        {"epsilon": 1e-5},
        23,
    ),
    "InstanceNorm_constant": (
        "InstanceNormalization",
        {"x": PLANES, "s": _a(1.5, 0.5), "b": _a(0.1, 0.2)},
        ["x", "s", "b"],
        lambda x, s, b: F.instance_norm(x, weight=s, bias=b),
        {},
    ),
    "GroupNorm_constant": (
        "GroupNormalization",
        {"x": PLANES, "s": _a(1.5, 0.5), "b": _a(0.1, 0.2)},
        ["x", "s", "b"],
        lambda x, s, b: F.group_norm(x, 2, s, b),
        {"num_groups": 2},
        21,
    ),
    "MaxPool_ties": (
        "MaxPool",
        {"x": np.array([[[[1.0, 3, 3], [3, 2, 0], [3, 3, 3]]]])},
        ["x"],
        lambda x: F.max_pool2d(x, 2, 1),
        {"kernel_shape": [2, 2]},
    ),
    "GlobalMaxPool_ties": ("GlobalMaxPool", {"x": PLANES}, ["x"], lambda x: F.adaptive_max_pool2d(x, 1), {}),
    "Where_-inf_other": (
        "Where",
        {"c": np.array([True, False, True]), "x": _a(1, 2, 3), "y": _a(-INF)},
        ["x"],
        torch.where,
        {},
        18,
        ("c", "y"),
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_edge_values_match_torch(case: str) -> None:
    op, inputs, wrt, ref, attrs, *rest = CASES[case]
    opset = rest[0] if rest else 18
    consts = rest[1] if len(rest) > 1 else ()
    _vs_torch(op, inputs, wrt, ref, opset, consts, **attrs)


def test_batch_norm_training_on_a_constant_channel() -> None:
    x = np.full((2, 1, 1, 2), 3.0)
    _vs_torch(
        "BatchNormalization",
        {"x": x, "s": _a(1.5), "b": _a(0.1), "m": _a(0), "v": _a(1)},
        ["x", "s", "b"],
        lambda x, s, b, m, v: F.batch_norm(x, None, None, s, b, True),
        consts=("m", "v"),
        n_out=3,
        training_mode=1,
        epsilon=1e-5,
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
def test_low_precision_large_magnitudes(dtype: type) -> None:
    big = 1e4 if dtype == np.float32 else 6e4
    x = _a(-big, -100, -20, 0, 20, 100, big, dtype=dtype)
    for op, fn in [
        ("Softplus", F.softplus),
        ("Mish", F.mish),
        ("Sigmoid", torch.sigmoid),
        ("Tanh", torch.tanh),
        ("Erf", torch.erf),
        ("Elu", F.elu),
        ("HardSwish", F.hardswish),
    ]:
        _vs_torch(op, {"x": x}, ["x"], fn)
    rows = np.array([[big, -big, 0, big - 1], [-INF, 0, 1, -INF], [-INF] * 4], dtype)
    _vs_torch("Softmax", {"x": rows}, ["x"], lambda x: torch.softmax(x, -1), axis=-1)
    _vs_torch("LogSoftmax", {"x": rows}, ["x"], lambda x: torch.log_softmax(x, -1), axis=-1)
    _vs_torch(
        "LayerNormalization",
        {
            "x": np.array([[2, 2, 2, 2], [1, 2, 3, 4]], dtype),
            "s": _a(1, 2, 3, 4, dtype=dtype),
            "b": _a(0, 0, 1, 1, dtype=dtype),
        },
        ["x", "s", "b"],
        lambda x, s, b: F.layer_norm(x, (4,), s, b),
    )
    _vs_torch(
        "SoftmaxCrossEntropyLoss",
        {"x": SCORES.astype(dtype), "t": _ints(0, 0, 2, -1)},
        ["x"],
        lambda x, t: F.cross_entropy(x, t, ignore_index=-1),
        consts=("t",),
        ignore_index=-1,
    )


@pytest.mark.parametrize("dynamo", [False, True])
def test_exported_losses_at_large_logits(dynamo: bool) -> None:
    x = torch.tensor(SCORES, dtype=torch.float32)
    _export_vs_torch(
        lambda x, t: F.cross_entropy(x, t, ignore_index=-100),
        (x, torch.tensor([0, -100, 2, 1])),
        (0,),
        dynamo,
    )
    _export_vs_torch(
        lambda x, t: F.cross_entropy(x, t, ignore_index=-100), (x, torch.tensor([-100] * 4)), (0,), dynamo
    )
    rows = torch.tensor([[1.0, 3, 3, 2], [5, 5, 5, 5], [0, 0, 0, 0]])
    _export_vs_torch(
        lambda x: (torch.linalg.vector_norm(x, dim=1) * torch.tensor([1.0, 2, 3])).sum(),
        (rows,),
        (0,),
        dynamo,
    )
    _export_vs_torch(
        lambda x: (F.layer_norm(x, (4,)) * torch.tensor([1.0, 2, 3, 4])).sum(), (rows,), (0,), dynamo
    )


# ---- deliberate differences -------------------------------------------------------------------------------


def test_documented_differences() -> None:
    # Pow's exponent gradient where the base is negative: 0 (log undefined); torch's is nan
    got = _node("Pow", {"x": _a(-2, 2), "y": _a(3)}, ["y"])[1]
    assert np.isfinite(got["y_grad"]).all()
    # ReduceMax splits a tie evenly (torch.amax); torch.max(x, dim), exported as the same ReduceMax, gives
    # all of it to one element
    _, got, r = _node(
        "ReduceMax", {"x": _a(5, 5, 1).reshape(1, 3), "a": _ints(1)}, ["x"], consts=("a",), keepdims=0
    )
    np.testing.assert_allclose(got["x_grad"], [[r[0] / 2, r[0] / 2, 0]])
    # Clip at a bound passes the gradient (torch.clamp); F.relu6 and F.hardtanh, exported as the same Clip,
    # give 0 there
    _, got, r = _node("Clip", {"x": _a(0, 3, 6), "lo": _a(0), "hi": _a(6)}, ["x"], consts=("lo", "hi"))
    np.testing.assert_allclose(got["x_grad"], r)
    # TopK's ties: the lower index first (the ONNX spec); torch's order among ties is unspecified
    _, got, r = _node("TopK", {"x": _a(5, 5, 5, 5), "k": _ints(2)}, ["x"], consts=("k",), n_out=2)
    np.testing.assert_allclose(got["x_grad"], [r[0], r[1], 0, 0])
    # Max among several varying inputs splits a tie evenly (1/3 each); torch.maximum(torch.maximum(x, y), z)
    # gives 1/4, 1/4, 1/2
    _, got, r = _node("Max", {"x": _a(1), "y": _a(1), "z": _a(1)}, ["x", "y", "z"])
    np.testing.assert_allclose([got["x_grad"], got["y_grad"], got["z_grad"]], [r / 3] * 3)


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_extremum_with_a_trained_initializer_gets_its_gradient(op: str) -> None:
    """An initializer differentiated by build_gradient_model (its wrt) is no constant bound: Max(X, W) gives
    W its share as torch.maximum does, ties split (it got zeros when initializers counted as bounds)."""
    w = np.array([1.0, -1.0, 0.0, 2.0])
    x = np.array([0.0, 0.0, 0.0, 3.0])
    model = helper.make_model(
        helper.make_graph([helper.make_node(op, ["X", "W"], ["m"]),
                           helper.make_node("ReduceSum", ["m"], ["y"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("X", TensorProto.DOUBLE, [4])],
                          [helper.make_tensor_value_info("y", TensorProto.DOUBLE, [])],
                          [numpy_helper.from_array(w, "W")]),
        opset_imports=[helper.make_opsetid("", 17)])
    grads = build_gradient_model(model, "y", ["W", "X"])
    onnx.checker.check_model(grads, full_check=True)
    got = dict(zip([o.name for o in grads.graph.output], run_engine(grads, {"X": x})))
    tw, tx = torch.tensor(w, requires_grad=True), torch.tensor(x, requires_grad=True)
    (torch.maximum if op == "Max" else torch.minimum)(tx, tw).sum().backward()
    np.testing.assert_array_equal(got["W_grad"], tw.grad.numpy())
    np.testing.assert_array_equal(got["X_grad"], tx.grad.numpy())


@pytest.mark.parametrize("op", ["Max", "Min"])
def test_max_min_at_a_masked_nan_give_it_no_gradient(op: str) -> None:
    """A NaN input masked out after Max/Min: its tie count is 0 there, so dY/0 made NaN for both inputs,
    where torch.maximum/minimum give 0 at the masked position."""
    x = np.array([1, math.nan, 2, 5], np.float32)
    y = np.array([0, 1, 3, 4], np.float32)
    mask = np.array([True, False, True, True])
    nodes = [helper.make_node(op, ["x", "y"], ["m"]), helper.make_node("Where", ["mask", "m", "zero"], ["w"]),
             helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info(n, TensorProto.FLOAT, [4]) for n in "xy"]
                          + [helper.make_tensor_value_info("mask", TensorProto.BOOL, [4])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                          [numpy_helper.from_array(np.zeros((), np.float32), "zero")])
    gm = build_gradient_model(make_model(g, 17), "loss", ["x", "y"])
    outs = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x, "y": y, "mask": mask})))
    tx, ty = torch.tensor(x, requires_grad=True), torch.tensor(y, requires_grad=True)
    f = torch.maximum if op == "Max" else torch.minimum
    torch.where(torch.from_numpy(mask), f(tx, ty), torch.zeros(())).sum().backward()
    np.testing.assert_array_equal(outs["x_grad"], tx.grad.numpy())
    np.testing.assert_array_equal(outs["y_grad"], ty.grad.numpy())


_NAN_OPS = {  # op → (attributes, torch's function)
    "Abs": ({}, torch.abs),
    "Elu": ({"alpha": 0.7}, lambda t: F.elu(t, 0.7)),
    "Selu": ({}, F.selu),
    "Celu": ({"alpha": 1.5}, lambda t: F.celu(t, 1.5)),
}


@pytest.mark.parametrize("opset", [11, 18])
@pytest.mark.parametrize("op", list(_NAN_OPS))
def test_a_nan_input_gets_torchs_gradient_masked_or_not(op: str, opset: int) -> None:
    """A NaN input of Abs/Elu/Selu/Celu: masked out downstream (dY = 0) its gradient is 0, not NaN (which
    reached every gradient upstream), and with a gradient torch's (Abs 0, the others gamma·dY)."""
    if op == "Celu" and opset < 12:
        pytest.skip("Celu is from opset 12")
    attrs, ref = _NAN_OPS[op]
    dt = np.float32 if op == "Celu" else np.float64  # (Celu is float32 only)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dt))
    x = np.array([math.nan, math.nan, -1.5, 0.0, 2.0], dt)
    mask = np.array([False, True, True, True, True])
    nodes = [helper.make_node(op, ["x"], ["a"], **attrs),
             helper.make_node("Where", ["mask", "a", "zero"], ["w"]),
             helper.make_node("ReduceSum", ["w"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", et, [5]),
                                       helper.make_tensor_value_info("mask", TensorProto.BOOL, [5])],
                          [helper.make_tensor_value_info("loss", et, [])],
                          [numpy_helper.from_array(np.zeros((), dt), "zero")])
    gm = build_gradient_model(make_model(g, opset), "loss", ["x"])
    onnx.checker.check_model(gm, full_check=True)
    with np.errstate(invalid="ignore"):
        got = dict(zip([o.name for o in gm.graph.output], run_engine(gm, {"x": x, "mask": mask})))
    tx = torch.tensor(x, requires_grad=True)
    torch.where(torch.from_numpy(mask), ref(tx), torch.zeros((), dtype=tx.dtype)).sum().backward()
    np.testing.assert_allclose(got["x_grad"], tx.grad.numpy(), rtol=2e-7)  # (float32 attributes)
