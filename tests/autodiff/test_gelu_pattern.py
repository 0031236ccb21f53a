"""The tanh GELU as torch exports it gets its gradient in one piece (onnxtrain/autodiff/patterns.py): the
values must equal torch autograd and finite differences, and a pattern whose inner values are read
elsewhere must fall back to the node-by-node rules."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.ir.builder import make_model
from onnxtrain.testing import gradcheck, run_engine

C1, C2 = 0.044715, float(np.sqrt(2 / np.pi))


def _loss_model(name: str, consts: dict[str, float | np.ndarray], gelu: list, leak: str | None):
    """loss = sum(w · y) around the GELU ``gelu`` (nodes from h = x·s to y), the GELU node for node as
    torch.onnx.export writes it; ``leak``, an inner value that also feeds the loss (no pattern then)."""
    nodes = [helper.make_node("Constant", [], [k], value=numpy_helper.from_array(np.array(v), k))
             for k, v in consts.items()]
    nodes += [helper.make_node("Mul", ["x", "s"], ["h"]), *gelu, helper.make_node("Mul", ["y", "w"], ["yw"])]
    loss_in = "yw"
    if leak:
        nodes.append(helper.make_node("Add", ["yw", leak], ["leak"]))
        loss_in = "leak"
    nodes.append(helper.make_node("ReduceSum", [loss_in], ["loss"], keepdims=0))
    g = helper.make_graph(
        nodes, name,
        [helper.make_tensor_value_info("x", T.DOUBLE, [4, 6])],
        [helper.make_tensor_value_info("loss", T.DOUBLE, [])],
        [numpy_helper.from_array(np.linspace(0.5, 1.5, 6), "s"),
         numpy_helper.from_array(np.random.default_rng(0).standard_normal((4, 6)), "w")],
    )
    return make_model(g, 17)


def gelu_model(leak_inner: bool = False, shapes: dict[str, tuple[int, ...]] | None = None):
    """The tanh GELU, y = 0.5·h·(1 + tanh(c2·(h + c1·h³))); ``shapes``, one-element shapes for constants."""
    consts = {"c1": C1, "c2": C2, "one": 1.0, "half": 0.5}
    return _loss_model("gelu", _shaped(consts, shapes), [
        helper.make_node("Mul", ["h", "h"], ["h2"]),
        helper.make_node("Mul", ["h", "h2"], ["h3"]),
        helper.make_node("Mul", ["c1", "h3"], ["a"]),
        helper.make_node("Add", ["h", "a"], ["b"]),
        helper.make_node("Mul", ["c2", "b"], ["e"]),
        helper.make_node("Tanh", ["e"], ["t"]),
        helper.make_node("Add", ["one", "t"], ["p"]),
        helper.make_node("Mul", ["h", "p"], ["q"]),
        helper.make_node("Mul", ["half", "q"], ["y"]),
    ], "t" if leak_inner else None)


@pytest.mark.parametrize("leak", [False, True], ids=["matched", "inner-value-read-elsewhere"])
def test_tanh_gelu_gradient_matches_finite_differences(leak: bool) -> None:
    m = gelu_model(leak)
    g = build_gradient_model(m, "loss", ["s", "x"])
    # matched: h = x·s gets one gradient term, not a Sum of the four products that read it
    assert ("Sum" in {n.op_type for n in g.graph.node}) == leak
    x = np.random.default_rng(1).standard_normal((4, 6)) * 2
    gradcheck(m, "loss", ["s", "x"], {"x": x})


def backward_reads(g, names: set[str]) -> set[str]:
    """Which of the forward values ``names`` the gradient nodes of ``g`` read."""
    forward = {o for n in g.graph.node if "_Grad" not in n.name for o in n.output}
    return {i for n in g.graph.node if "_Grad" in n.name for i in n.input if i in names and i in forward}


def test_tanh_gelu_gradient_matches_torch_and_keeps_two_forward_values() -> None:
    torch = pytest.importorskip("torch")
    m = gelu_model()
    g = build_gradient_model(m, "loss", ["x"])
    x = np.random.default_rng(2).standard_normal((4, 6)) * 3
    dx = run_engine(g, {"x": x})[-1]
    assert g.graph.output[-1].name == "x_grad"
    tx = torch.tensor(x, requires_grad=True)
    s = torch.tensor(np.linspace(0.5, 1.5, 6))
    w = torch.tensor(np.random.default_rng(0).standard_normal((4, 6)))
    (w * torch.nn.functional.gelu(tx * s, approximate="tanh")).sum().backward()
    np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
    import os

    os.environ["ONNXTRAIN_GELU_GRAD"] = "0"
    try:
        plain = build_gradient_model(m, "loss", ["x"])
    finally:
        del os.environ["ONNXTRAIN_GELU_GRAD"]
    def work(model) -> int:  # nodes that compute (Constants are free)
        return sum(n.op_type != "Constant" for n in model.graph.node)

    assert work(g) < work(plain)
    assert "Sum" not in {n.op_type for n in g.graph.node} and "Sum" in {n.op_type for n in plain.graph.node}
    # of the GELU's inner values only tanh is read again: x² and 1 + tanh are recomputed (same operations)
    assert backward_reads(g, {"h2", "h3", "a", "b", "e", "t", "p", "q"}) == {"t"}


def _shaped(consts: dict[str, float], shapes: dict[str, tuple[int, ...]] | None) -> dict:
    return {k: np.full((shapes or {}).get(k, ()), v) for k, v in consts.items()}


def erf_gelu_model(leak_inner: bool = False, shapes: dict[str, tuple[int, ...]] | None = None):
    """The exact GELU, y = (h·(erf(h/√2) + 1))·0.5: Div, Erf, Add, Mul, Mul."""
    consts = {"r2": float(np.sqrt(2.0)), "one": 1.0, "half": 0.5}
    return _loss_model("gelu_erf", _shaped(consts, shapes), [
        helper.make_node("Div", ["h", "r2"], ["u"]),
        helper.make_node("Erf", ["u"], ["e"]),
        helper.make_node("Add", ["e", "one"], ["p"]),
        helper.make_node("Mul", ["h", "p"], ["q"]),
        helper.make_node("Mul", ["q", "half"], ["y"]),
    ], "e" if leak_inner else None)


@pytest.mark.parametrize("leak", [False, True], ids=["matched", "inner-value-read-elsewhere"])
def test_exact_gelu_gradient_matches_torch_and_finite_differences(leak: bool) -> None:
    torch = pytest.importorskip("torch")
    m = erf_gelu_model(leak)
    g = build_gradient_model(m, "loss", ["s", "x"])
    assert ("Sum" in {n.op_type for n in g.graph.node}) == leak  # matched: h gets one gradient term
    x = np.random.default_rng(3).standard_normal((4, 6)) * 3
    gradcheck(m, "loss", ["s", "x"], {"x": x})
    if not leak:
        dx = run_engine(g, {"x": x})[-1]
        tx = torch.tensor(x, requires_grad=True)
        s = torch.tensor(np.linspace(0.5, 1.5, 6))
        w = torch.tensor(np.random.default_rng(0).standard_normal((4, 6)))
        (w * torch.nn.functional.gelu(tx * s)).sum().backward()
        np.testing.assert_allclose(dx, tx.grad.numpy(), rtol=1e-12, atol=1e-12)
        assert backward_reads(g, {"u", "e", "p", "q"}) == {"p"}  # u = h/√2 is recomputed, 1 + erf kept


@pytest.mark.parametrize("form,const,shape", [
    *[("tanh", c, (1, 1, 1)) for c in ("c1", "c2", "one", "half")],
    *[("erf", c, (1, 1, 1)) for c in ("r2", "one", "half")],
    ("tanh", "half", (1, 1)), ("erf", "r2", (1, 1)), ("erf", "half", (1,)),
])
def test_gelu_with_a_one_element_constant_of_higher_rank(form: str, const: str, shape: tuple) -> None:
    """A one-element constant of higher rank than h (4, 6) broadcasts y to (1, 4, 6): the one-piece
    gradient would have y's shape, so the pattern is refused there (node-by-node rules, which reduce);
    a constant of rank ≤ h's keeps it."""
    m = (gelu_model if form == "tanh" else erf_gelu_model)(shapes={const: shape})
    g = build_gradient_model(m, "loss", ["s", "x"])
    onnx.checker.check_model(g, full_check=True)
    assert ("Sum" in {n.op_type for n in g.graph.node}) == (len(shape) > 2)
    x = np.random.default_rng(4).standard_normal((4, 6)) * 2
    gradcheck(m, "loss", ["s", "x"], {"x": x})
