"""An Einsum whose named subscript has size 1 in one operand and more in another ("bij,bjk" of (1, 3, 4) and
(2, 4, 5), as torch.einsum takes them): onnxruntime and the engine run it, but ONNX's shape inference gives
the output the first operand's size, which the gradient's other rules read, and the gradients came out of
the wrong shapes and values. The gradient graph is now refused naming the node and the way out; the same
product with the operand expanded first differentiates to torch's gradients (the oracle, float64)."""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.autodiff import GradientError, build_gradient_model
from onnxtrain.engine import compile_model

torch = pytest.importorskip("torch")
D = TensorProto.DOUBLE
RNG = np.random.default_rng(0)
A, B, R = RNG.standard_normal((1, 3, 4)), RNG.standard_normal((2, 4, 5)), RNG.standard_normal((2, 3, 5))


def _model(expand: bool):
    nodes = [helper.make_node("Expand", ["a", "shape"], ["ae"])] if expand else []
    nodes += [helper.make_node("Einsum", ["ae" if expand else "a", "b"], ["e"], equation="bij,bjk->bik",
                               name="product"),
              helper.make_node("Mul", ["e", "r"], ["m"]),
              helper.make_node("ReduceSum", ["m"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("a", D, [1, 3, 4]),
                                       helper.make_tensor_value_info("b", D, [2, 4, 5])],
                          [helper.make_tensor_value_info("loss", D, [])],
                          [numpy_helper.from_array(R, "r"),
                           numpy_helper.from_array(np.array([2, 3, 4]), "shape")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def test_a_broadcast_named_subscript_is_refused_and_the_expanded_form_matches_torch() -> None:
    with pytest.raises(GradientError, match=r"node 'product' \(Einsum\): Einsum subscript 'b' has size 1"):
        build_gradient_model(_model(expand=False), "loss", ["a", "b"])
    got = compile_model(build_gradient_model(_model(expand=True), "loss", ["a", "b"])).run({"a": A, "b": B})
    ta, tb = (torch.tensor(v, requires_grad=True) for v in (A, B))
    (torch.einsum("bij,bjk->bik", ta, tb) * torch.tensor(R)).sum().backward()
    np.testing.assert_allclose(got[1], ta.grad.numpy(), rtol=1e-10)
    np.testing.assert_allclose(got[2], tb.grad.numpy(), rtol=1e-10)


ELLIPSIS_CASES = [  # '...' after named subscripts, broadcast inside it; static and symbolic dims
    ("i...,...->...", [(1, 3), (3,)], False), ("b...d,...d->b...", [(1, 3, 4), (3, 4)], False),
    ("b...,b...->b...", [(2, 1, 3), (2, 4, 3)], False), ("b...i,b...i->b...", [(2, 1, 4), (2, 3, 4)], False),
    ("b...ij,b...jk->b...ik", [(2, 1, 3, 4), (2, 6, 4, 5)], False),
    ("i...j,j->i...", [(2, 1, 3), (3,)], False),
    ("...ij,...jk->...ik", [(1, 3, 4), (5, 4, 2)], True), ("...i,...i->...", [(2, 1, 4), (3, 4)], True),
    ("ij,ij->ij", [(2, 1), (2, 3)], True), ("b...ij,b...jk->b...ik", [(2, 1, 3, 4), (2, 6, 4, 5)], True),
    # diagonals of a symbolic size: the identity is made at run time (they were refused)
    ("ii->i", [(3, 3)], True), ("bii->bi", [(2, 3, 3)], True), ("iij->j", [(3, 3, 2)], True),
    ("ii,i->i", [(3, 3), (3,)], True),
    # the larger operand's gradient, summed over the letter the other broadcasts, expanded back
    ("ij,ij->", [(2, 4), (1, 4)], True), ("ij,j->i", [(2, 4), (1,)], True),
    ("...j,...j->", [(2, 4), (1, 4)], True),
    ("i...j,i...j->i", [(2, 3, 4), (2, 1, 4)], True),
]


def _matches_torch(equation: str, shapes: list[tuple], dims: list[list], seed: int) -> None:
    """The Einsum's gradients, with its inputs declared ``dims`` (ints static, strs symbolic) and fed arrays
    of ``shapes``, equal torch's (float64)."""
    rng = np.random.default_rng(seed)
    xs = [rng.standard_normal(s) for s in shapes]
    names = [f"x{i}" for i in range(len(xs))]
    ts = [torch.tensor(x, requires_grad=True) for x in xs]
    y = torch.einsum(equation, *ts)
    u = rng.uniform(0.5, 1.5, tuple(y.shape))
    (y * torch.tensor(u)).sum().backward()
    g = helper.make_graph([helper.make_node("Einsum", names, ["y"], equation=equation),
                           helper.make_node("Mul", ["y", "u"], ["yu"]),
                           helper.make_node("ReduceSum", ["yu"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info(n, D, d) for n, d in zip(names, dims)],
                          [helper.make_tensor_value_info("loss", D, [])], [numpy_helper.from_array(u, "u")])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    gm = build_gradient_model(model, "loss", names)
    got = dict(zip([o.name for o in gm.graph.output], compile_model(gm).run(dict(zip(names, xs)))))
    for n, t in zip(names, ts):
        assert got[f"{n}_grad"].shape == t.grad.shape
        np.testing.assert_allclose(got[f"{n}_grad"], t.grad.numpy(), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("equation,shapes,symbolic", ELLIPSIS_CASES)
def test_broadcasts_in_the_ellipsis_and_over_symbolic_dims_match_torch(equation, shapes, symbolic) -> None:
    """The ellipsis's axes are those between the named ones (they were taken from the front: wrong
    gradients, or a refusal naming a generated letter), and an axis of unknown size matched to another
    operand's is summed at run time where it is a broadcast 1 (the gradient kept the broadcast size)."""
    dims = [[f"x{i}_{k}" for k in range(len(s))] if symbolic else list(s) for i, s in enumerate(shapes)]
    _matches_torch(equation, shapes, dims, seed=1)


MIXED_CASES = [  # (equation, shapes fed, dims declared: an int static, a str symbolic)
    ("ij,ij->", [(2, 4), (1, 4)], [[2, 4], ["n", 4]]),
    ("ij,jk,kl->il", [(2, 1), (3, 4), (4, 5)], [["a", 1], ["b", 4], [4, 5]]),
    ("ii,i->i", [(3, 3), (1,)], [["n", "n"], [1]]),
    ("ij,ij->ij", [(2, 3), (1, 3)], [["a", 3], [1, 3]]),
]


@pytest.mark.parametrize("equation,shapes,dims", MIXED_CASES)
def test_static_and_symbolic_sizes_of_one_letter_match_torch(equation, shapes, dims) -> None:
    """One operand's size static, the other's symbolic: the gradient was summed or expanded only when the
    operand's own size was symbolic, and came out of the other's shape without an error."""
    _matches_torch(equation, shapes, dims, seed=2)


def test_a_static_1_first_against_a_symbolic_size_in_the_output_is_refused() -> None:
    """ONNX's inference gives the output the first operand's static 1, which the gradient's other rules
    would read: refused by name, as a static broadcast is."""
    g = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], equation="ij,ij->ij", name="e"),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("a", D, [2, 1]),
                           helper.make_tensor_value_info("b", D, ["n", "m"])],
                          [helper.make_tensor_value_info("loss", D, [])])
    with pytest.raises(GradientError, match=r"subscript 'j' has size 1 in its first operand"):
        build_gradient_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "loss",
                             ["a", "b"])
    # the same broadcast inside '...' (a latent query (1, 3, 8) against keys (B, 5, 8)): gradients of the
    # wrong values and shapes before, refused now
    g = helper.make_graph([helper.make_node("Einsum", ["a", "b"], ["y"], equation="...qd,...kd->...qk"),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("a", D, [1, 3, 8]),
                           helper.make_tensor_value_info("b", D, ["B", 5, 8])],
                          [helper.make_tensor_value_info("loss", D, [])])
    with pytest.raises(GradientError, match=r"'\.\.\.' axis -1 has size 1 in its first operand.*\.expand"):
        build_gradient_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), "loss",
                             ["a", "b"])
