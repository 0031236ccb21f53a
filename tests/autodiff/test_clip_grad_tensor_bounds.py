"""Clip's gradient with respect to tensor min/max (learnable clamp bounds, PACT-style; torch.clamp with tensor
bounds), against torch autograd's clamp backward in float64 and against finite differences: dmin = dY where
X < min (and min < max), dmax = dY where X > max (or max < min), X keeping its own mask; at a tie X == bound
only X gets dY. Constant bounds get no gradient nodes at all (test_clip_grad_constant_bounds.py)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.testing import gradcheck, run_engine

torch = pytest.importorskip("torch")


def _model(x_shape: tuple[int, ...], lo: float | None, hi: float | None, as_init: bool,
           elem: int = T.DOUBLE) -> onnx.ModelProto:
    """loss = sum(Clip(x, lo, hi) * u); a bound given as None is omitted."""
    ins = ["x", "lo" if lo is not None else "", "hi" if hi is not None else ""]
    while not ins[-1]:
        ins.pop()
    nodes = [helper.make_node("Clip", ins, ["y"], name="clip"), helper.make_node("Mul", ["y", "u"], ["yu"]),
             helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)]
    dt = helper.tensor_dtype_to_np_dtype(elem)
    bounds = [(n, v) for n, v in (("lo", lo), ("hi", hi)) if v is not None]
    inputs = [helper.make_tensor_value_info(n, elem, list(x_shape)) for n in ("x", "u")]
    inits = []
    if as_init:
        inits = [numpy_helper.from_array(np.array(v, dt), n) for n, v in bounds]
    else:
        inputs += [helper.make_tensor_value_info(n, elem, []) for n, _ in bounds]
    graph = helper.make_graph(nodes, "clip", inputs, [helper.make_tensor_value_info("loss", elem, [])],
                              initializer=inits)
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    m.ir_version = 8
    return m


def _torch_grads(x: np.ndarray, u: np.ndarray, lo: float | None, hi: float | None) -> dict[str, np.ndarray]:
    xt = torch.tensor(x, requires_grad=True)
    bt = {n: torch.tensor(v, dtype=xt.dtype, requires_grad=True) for n, v in (("lo", lo), ("hi", hi))
          if v is not None}
    (torch.clamp(xt, bt.get("lo"), bt.get("hi")) * torch.tensor(u)).sum().backward()
    return {"x": xt.grad.numpy(), **{n: t.grad.numpy() for n, t in bt.items()}}


def _onnxtrain_grads(m: onnx.ModelProto, feeds: dict[str, np.ndarray],
                     wrt: list[str]) -> dict[str, np.ndarray]:
    gm = build_gradient_model(m, "loss", wrt, zero_unreachable=False)
    onnx.checker.check_model(gm, full_check=True)
    outs = dict(zip([o.name for o in gm.graph.output], run_engine(gm, feeds), strict=True))
    return {n: outs[f"{n}_grad"] for n in wrt}


@pytest.mark.parametrize("lo, hi", [(-1.0, 1.0), (0.0, 6.0), (2.0, 2.0), (1.0, -1.0), (-0.5, None),
                                    (None, 0.5)])
@pytest.mark.parametrize("as_init", [True, False])
def test_bounds_gradient_matches_torch_clamp(lo, hi, as_init) -> None:
    """Ties with either bound, min == max, min > max, NaN and inf inputs, and each bound alone."""
    rng = np.random.default_rng(1)
    x = rng.uniform(-8, 8, (4, 9))
    ties = [b for b in (lo, hi) if b is not None]
    x[0, : len(ties) + 4] = [*ties, -0.0, np.nan, np.inf, -np.inf]
    x[1, :2] = ties[0]  # several elements tie with the bound
    u = rng.standard_normal(x.shape)
    feeds = {"x": x, "u": u}
    if not as_init:
        feeds.update({n: np.array(v) for n, v in (("lo", lo), ("hi", hi)) if v is not None})
    wrt = ["x", *(n for n, v in (("lo", lo), ("hi", hi)) if v is not None)]
    got = _onnxtrain_grads(_model(x.shape, lo, hi, as_init), feeds, wrt)
    want = _torch_grads(x, u, lo, hi)
    for n in wrt:
        assert got[n].shape == want[n].shape, n
        np.testing.assert_allclose(got[n], want[n], rtol=1e-12, atol=1e-12, err_msg=n)
    if lo is not None and (hi is None or lo < hi):  # some x lies below min: the bound's gradient is not 0
        assert got["lo"] != 0


def test_bounds_gradient_matches_finite_differences() -> None:
    """Away from the kinks (no x near a bound), the bounds' gradients are the derivative."""
    rng = np.random.default_rng(2)
    x = rng.uniform(-3, 3, (3, 5))
    x[np.abs(np.abs(x) - 1.0) < 0.05] = 2.5
    m = _model(x.shape, -1.0, 1.0, as_init=True)
    grads = gradcheck(m, "loss", ["x", "lo", "hi"], {"x": x, "u": rng.standard_normal(x.shape)})
    assert grads["lo"] != 0 and grads["hi"] != 0


def test_float32_gradient_graph_runs_in_onnxruntime() -> None:
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(3)
    x = rng.uniform(-2, 2, (2, 3, 4)).astype(np.float32)
    x[0, 0, :2] = [-0.75, 0.5]  # ties
    u = rng.standard_normal(x.shape).astype(np.float32)
    m = _model(x.shape, -0.75, 0.5, as_init=True, elem=T.FLOAT)
    gm = build_gradient_model(m, "loss", ["x", "lo", "hi"])
    onnx.checker.check_model(gm, full_check=True)
    feeds = {"x": x, "u": u}
    mine = run_engine(gm, feeds)
    sess = ort.InferenceSession(gm.SerializeToString(), providers=["CPUExecutionProvider"])
    theirs = sess.run(None, feeds)
    for a, b in zip(mine, theirs, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    want = _torch_grads(x, u, -0.75, 0.5)
    names = [o.name for o in gm.graph.output]
    for n in ("x", "lo", "hi"):
        np.testing.assert_allclose(theirs[names.index(f"{n}_grad")], want[n], rtol=1e-5, atol=1e-6)


def test_constant_bounds_emit_no_bound_gradient() -> None:
    """Only x is differentiated: the backward is the mask of x alone, as before."""
    gm = build_gradient_model(_model((2, 3), -1.0, 1.0, as_init=True), "loss", ["x"])
    backward = {n.op_type for n in gm.graph.node if n.name.startswith("clip_Grad/")}
    assert backward <= {"GreaterOrEqual", "LessOrEqual", "And", "Where", "Constant"}


class _Pact(torch.nn.Module):
    """A learnable clip range (PACT-style), as the TorchScript exporter writes it: Clip(x, Cast(lo), Cast(hi))
    with the parameters as 0-d initializers."""

    def __init__(self) -> None:
        super().__init__()
        self.lo = torch.nn.Parameter(torch.tensor(-0.3, dtype=torch.float64))
        self.hi = torch.nn.Parameter(torch.tensor(0.5, dtype=torch.float64))
        gen = torch.Generator().manual_seed(0)
        self.w = torch.nn.Parameter(torch.randn(3, 4, dtype=torch.float64, generator=gen))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (torch.clamp(x, self.lo, self.hi) * self.w).sum()


def test_torchscript_pact_export_trains_the_bounds() -> None:
    from onnxtrain import GradientGraphBuilder

    x = torch.randn(3, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    mod = _Pact()
    b = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(mod, (x,), b, dynamo=False, opset_version=17, input_names=["x"],
                          output_names=["loss"], do_constant_folding=False)
    m = onnx.load_from_string(b.getvalue())
    assert {"lo", "hi"} <= {t.name for t in m.graph.initializer}
    mod(x).backward()
    got = _onnxtrain_grads(m, {"x": x.numpy()}, ["lo", "hi", "w"])
    for n in ("lo", "hi", "w"):
        np.testing.assert_allclose(got[n], getattr(mod, n).grad.numpy(), rtol=1e-12, atol=1e-12, err_msg=n)
    # the legacy-compatible builder (zero_unreachable=False) no longer says 'hi' "does not reach" the loss
    gb = GradientGraphBuilder(m.SerializeToString(), {"loss"}, {"lo", "hi"}, "loss")
    gb.build()
    built = onnx.load_from_string(gb.get_model())
    outs = dict(zip([o.name for o in built.graph.output], run_engine(built, {"x": x.numpy()}), strict=True))
    np.testing.assert_allclose(outs["hi_grad"], mod.hi.grad.numpy(), rtol=1e-12)
