"""``Where(IsNaN(x), a, b)`` fused (engine/fusion/nan_select.py): torch's export of masked
``scaled_dot_product_attention`` zeroes a fully masked row's NaN this way, and its gradient selects by the
same mask. Values against onnx.reference and onnxruntime, gradients against torch autograd."""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper
from onnx.reference import ReferenceEvaluator

from onnxtrain.engine.plan import Plan

F = TensorProto.FLOAT


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def attention_tail(dtype: int = F, b_shape: list[int] | None = None, mask_out: bool = False,
                   zero_shape: tuple[int, ...] = ()) -> onnx.ModelProto:
    """p = Softmax(s + m); y = Where(IsNaN(p), 0, b) (b = p unless ``b_shape`` makes it an input)."""
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    b = "p" if b_shape is None else "b"
    nodes = [helper.make_node("Constant", [], ["zero"],
                              value=numpy_helper.from_array(np.zeros(zero_shape, np_dt), "zero")),
             helper.make_node("Add", ["s", "m"], ["sm"]),
             helper.make_node("Softmax", ["sm"], ["p"], axis=-1),
             helper.make_node("IsNaN", ["p"], ["nan"]),
             helper.make_node("Where", ["nan", "zero", b], ["y"])]
    ins = [helper.make_tensor_value_info("s", dtype, [2, 3, 4, 4]),
           helper.make_tensor_value_info("m", dtype, [2, 1, 4, 4])]
    if b_shape is not None:
        ins.append(helper.make_tensor_value_info("b", dtype, b_shape))
    y_shape = list(np.broadcast_shapes((2, 3, 4, 4), zero_shape, tuple(b_shape or ())))
    outs = [helper.make_tensor_value_info("y", dtype, y_shape)]
    if mask_out:
        outs.append(helper.make_tensor_value_info("nan", TensorProto.BOOL, [2, 3, 4, 4]))
    g = helper.make_graph(nodes, "g", ins, outs)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def feeds(np_dt, fully_masked: bool, rng: np.random.Generator) -> dict[str, np.ndarray]:
    m = np.where(rng.random((2, 1, 4, 4)) < 0.3, -np.inf, 0.0).astype(np_dt)
    m[..., 0] = 0.0  # every row keeps a score ...
    if fully_masked:
        m[1, 0, 2, :] = -np.inf  # ... but this one: its softmax is 0/0
    return {"s": rng.standard_normal((2, 3, 4, 4)).astype(np_dt), "m": m}


@pytest.mark.parametrize("dtype", [TensorProto.FLOAT16, F, TensorProto.DOUBLE])
@pytest.mark.parametrize("fully_masked", [False, True])
def test_select_is_one_step_equal_to_the_reference(dtype: int, fully_masked: bool) -> None:
    np_dt = helper.tensor_dtype_to_np_dtype(dtype)
    model = attention_tail(dtype)
    onnx.checker.check_model(model, full_check=True)
    fused, plain = Plan(model), Plan(model, fuse=False)
    assert "IsNaN" not in ops(fused) and ops(fused).count("NanSelect") == 1
    assert "IsNaN" in ops(plain)
    f = feeds(np_dt, fully_masked, np.random.default_rng(dtype))
    with np.errstate(invalid="ignore"):
        got, want = fused.run(f)[0], plain.run(f)[0]
        ref = ReferenceEvaluator(model).run(None, f)[0]
    assert got.dtype == np_dt and got.shape == (2, 3, 4, 4)
    np.testing.assert_array_equal(got, want)
    assert not np.isnan(got).any()
    if fully_masked:
        assert (got[1, :, 2] == 0).all()
    tol = {np.float16: 2e-3, np.float32: 1e-6, np.float64: 1e-14}[np_dt.type]
    np.testing.assert_allclose(got, ref, rtol=tol, atol=tol)


def test_select_broadcasting_its_branches_runs_the_original_steps() -> None:
    """A ``b`` that broadcasts up to the select's shape, or a zero of higher rank than ``b``, is not
    returned as it is: the IsNaN and the Where run, as unfused."""
    rng = np.random.default_rng(5)
    for model, extra in [(attention_tail(b_shape=[4]), {"b": np.arange(4, dtype=np.float32)}),
                         (attention_tail(zero_shape=(1, 1, 1, 1, 1)), {})]:
        fused, plain = Plan(model), Plan(model, fuse=False)
        assert "NanSelect" in ops(fused)
        for fully in (False, True):
            f = {**feeds(np.float32, fully, rng), **extra}
            with np.errstate(invalid="ignore"):
                got, want = fused.run(f)[0], plain.run(f)[0]
                ref = ReferenceEvaluator(model).run(None, f)[0]
            assert got.shape == want.shape == ref.shape
            np.testing.assert_array_equal(got, want)
            np.testing.assert_allclose(got, ref, rtol=1e-6, atol=1e-7)


def test_a_mask_read_elsewhere_keeps_its_isnan() -> None:
    model = attention_tail(mask_out=True)
    fused = Plan(model)
    assert "IsNaN" in ops(fused) and "NanSelect" not in ops(fused)
    f = feeds(np.float32, True, np.random.default_rng(6))
    with np.errstate(invalid="ignore"):
        y, nan = fused.run(f)
    assert nan[1, :, 2].all() and nan.sum() == 3 * 4 and (y[1, :, 2] == 0).all()


torch = pytest.importorskip("torch")


class _Attention(torch.nn.Module):
    """A weighted sum of masked attention's output: a scalar loss."""

    def forward(self, q, k, v, keep, w):  # noqa: ANN001, ANN201
        return (torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep) * w).sum()


def _exported_attention(shape: tuple[int, ...], keep: np.ndarray) -> onnx.ModelProto:
    pytest.importorskip("onnxscript", reason="torch's dynamo exporter needs onnxscript")
    args = tuple(torch.zeros(shape) for _ in range(3)) + (torch.from_numpy(keep), torch.zeros(shape))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return torch.onnx.export(_Attention(), args, dynamo=True, optimize=False, verbose=False,
                                 input_names=["q", "k", "v", "keep", "w"], output_names=["loss"]).model_proto


@pytest.mark.parametrize("fully_masked", [False, True])
def test_exported_masked_attention_trains_as_torch(fully_masked: bool) -> None:
    """torch's export of masked scaled_dot_product_attention: the fused graph's output and q/k/v gradients
    against torch autograd (no fully masked row) or the unfused plan (a fully masked row, whose NaN torch
    eager and the export treat differently)."""
    from onnxtrain.autodiff import build_gradient_model

    rng = np.random.default_rng(7)
    shape = (2, 3, 6, 8)
    keep = rng.random((2, 1, 6, 6)) < 0.7
    keep[..., 0] = True
    if fully_masked:
        keep[0, 0, 4, :] = False
    model = _exported_attention(shape, keep)
    assert [n.op_type for n in model.graph.node].count("IsNaN") == 1  # the pattern this fusion is for
    grads = build_gradient_model(model, "loss", ["q", "k", "v"])
    onnx.checker.check_model(grads, full_check=True)
    fused, plain = Plan(grads), Plan(grads, fuse=False)
    assert "IsNaN" not in ops(fused) and ops(fused).count("NanSelect") == 2  # the forward's and gradient's
    qkv = {n: rng.standard_normal(shape).astype(np.float32) for n in "qkv"}
    weights = rng.standard_normal(shape).astype(np.float32)
    f = {**qkv, "keep": keep, "w": weights}
    names = [o.name for o in grads.graph.output]
    with np.errstate(invalid="ignore"):
        got = dict(zip(names, fused.run(f)))
        unfused = dict(zip(names, plain.run(f)))
    for n in names:
        np.testing.assert_array_equal(got[n], unfused[n])
    assert all(np.isfinite(v).all() for v in got.values())
    if fully_masked:
        return
    ts = {n: torch.from_numpy(a).requires_grad_() for n, a in qkv.items()}
    loss = _Attention()(ts["q"], ts["k"], ts["v"], torch.from_numpy(keep), torch.from_numpy(weights))
    loss.backward()
    np.testing.assert_allclose(got["loss"], loss.item(), rtol=1e-5)
    for n in "qkv":
        np.testing.assert_allclose(got[f"{n}_grad"], ts[n].grad.numpy(), rtol=1e-4, atol=1e-5)
