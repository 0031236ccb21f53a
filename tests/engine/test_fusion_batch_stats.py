"""A training-mode BatchNormalization hands its batch mean and variance to the gradient's recomputation of
them (engine/fusion/batch_stats.py): the gradient graph's two ReduceMeans of X and (X − mean)² are gone
from the plan, and every output is bit for bit what the plan gives without the pass. Oracles: the same
plan with the pass left out (the bits), torch autograd in float64 (the gradients' values)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain.engine.fusion as fusion
import onnxtrain.engine.fusion.batch_stats as batch_stats
from onnxtrain.autodiff.builder import build_gradient_model
from onnxtrain.engine.plan import Plan

FLOAT_TYPES = {np.float32: TensorProto.FLOAT, np.float64: TensorProto.DOUBLE, np.float16: TensorProto.FLOAT16}


def bn_gradient_model(rank: int, dtype: type = np.float32, opset: int = 17, transposed: bool = False,
                      channels: int = 3) -> onnx.ModelProto:
    """loss = Σ BN(x)·t (training mode, running statistics as extra outputs) and its gradients with respect
    to x, the scale and the bias. ``transposed``: x is read through a Transpose of its first two axes."""
    et = FLOAT_TYPES[dtype]
    inits = [numpy_helper.from_array(np.linspace(0.5, 1.5, channels).astype(dtype), "scale"),
             numpy_helper.from_array(np.linspace(-0.2, 0.3, channels).astype(dtype), "bias"),
             numpy_helper.from_array(np.zeros(channels, dtype), "mean"),
             numpy_helper.from_array(np.ones(channels, dtype), "var")]
    src = "x"
    nodes = []
    if transposed:
        nodes.append(helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, *range(2, rank)]))
        src = "xt"
    nodes += [helper.make_node("BatchNormalization", [src, "scale", "bias", "mean", "var"],
                               ["y", "mean_out", "var_out"], training_mode=1, momentum=0.9, epsilon=1e-3),
              helper.make_node("Mul", ["y", "t"], ["yt"]),
              helper.make_node("ReduceSum", ["yt"], ["loss"], keepdims=0)]
    dims = [f"d{i}" for i in range(rank)]
    g = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", et, dims),
                                       helper.make_tensor_value_info("t", et, dims)],
                          [helper.make_tensor_value_info("loss", et, [])], inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    return build_gradient_model(m, "loss", ["x", "scale", "bias"], extra_outputs=["mean_out", "var_out"])


def plans(model: onnx.ModelProto, monkeypatch: pytest.MonkeyPatch) -> tuple[Plan, Plan]:
    """The plan with every fusion, and the same without the batch statistics' hand-over."""
    fused = Plan(model)
    with monkeypatch.context() as mp:
        mp.setattr(fusion, "share_batch_statistics", lambda plan, steps: steps)
        without = Plan(model)
    return fused, without


def count_hand_overs(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """A list whose length counts the fused steps' runs that handed the forward's statistics over."""
    calls: list[int] = []
    kernel = batch_stats.batch_norm_training

    def counted(*args):
        calls.append(1)
        return kernel(*args)

    monkeypatch.setattr(batch_stats, "batch_norm_training", counted)
    return calls


def ops(plan: Plan) -> list[str]:
    return [st.node.op_type for st in plan.steps]


def feeds(shape: tuple[int, ...], dtype: type, seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal(shape) * 2 + 3).astype(dtype)  # a mean far from 0: the variance's sum matters
    return {"x": x, "t": rng.standard_normal(shape).astype(dtype)}


def run_both(fused: Plan, without: Plan, f: dict[str, np.ndarray]) -> list[np.ndarray]:
    got, want = fused.run(f), without.run(f)
    assert len(got) == len(want) == 6  # loss, mean_out, var_out and three gradients
    for a, b in zip(got, want):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    return got


@pytest.mark.parametrize("opset", [15, 17, 18])  # 18: the reductions' axes are inputs
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("shape", [(4, 3, 5, 6), (2, 3, 7), (3, 3, 2, 2, 3), (1, 3, 9, 9)], ids=str)
def test_the_gradient_reads_the_forwards_statistics_with_the_same_bits(opset, dtype, shape, monkeypatch):
    fused, without = plans(bn_gradient_model(len(shape), dtype, opset), monkeypatch)
    assert "BatchNormalizationStats" in ops(fused) and "BatchNormalization" not in ops(fused)
    assert ops(without).count("ReduceMean") == 1 and "ReduceMean" not in ops(fused)
    assert ops(fused).count("ChannelDot") == ops(without).count("ChannelDot") - 1  # the variance's
    handed = count_hand_overs(monkeypatch)
    for seed in range(3):  # traced, then run twice
        run_both(fused, without, feeds(shape, dtype, seed))
    assert len(handed) == 3


def test_the_gradients_match_torch_autograd_in_float64(monkeypatch) -> None:
    torch = pytest.importorskip("torch")
    shape = (5, 3, 4, 6)
    fused, _ = plans(bn_gradient_model(4, np.float64), monkeypatch)
    f = feeds(shape, np.float64, seed=3)
    loss, mean_out, var_out, dx, dscale, dbias = fused.run(f)
    x = torch.tensor(f["x"], requires_grad=True)
    scale = torch.tensor(np.linspace(0.5, 1.5, 3), requires_grad=True)
    bias = torch.tensor(np.linspace(-0.2, 0.3, 3), requires_grad=True)
    y = torch.nn.functional.batch_norm(x, None, None, scale, bias, training=True, eps=1e-3)
    want_loss = (y * torch.tensor(f["t"])).sum()
    want_loss.backward()
    np.testing.assert_allclose(loss, want_loss.item(), rtol=1e-10)
    for got, want in ((dx, x.grad), (dscale, scale.grad), (dbias, bias.grad)):
        np.testing.assert_allclose(got, want.numpy(), rtol=1e-10, atol=1e-12)
    m = float(np.float32(0.9))  # the momentum attribute is a float32
    batch_mean = f["x"].mean(axis=(0, 2, 3))
    np.testing.assert_allclose(mean_out, (1 - m) * batch_mean, rtol=1e-12)  # running = m·0 + (1 − m)·batch
    np.testing.assert_allclose(var_out, m + (1 - m) * f["x"].var(axis=(0, 2, 3)), rtol=1e-12)


@pytest.mark.parametrize("shape", [
    (4, 3, 1, 1),  # one value per (image, channel) plane: the forward sums another way
    (0, 3, 4, 4),  # an empty batch
], ids=str)
def test_inputs_the_forward_sums_otherwise_run_the_dropped_steps(shape, monkeypatch) -> None:
    fused, without = plans(bn_gradient_model(4), monkeypatch)
    handed = count_hand_overs(monkeypatch)
    run_both(fused, without, feeds((4, 3, 5, 5), np.float32))
    run_both(fused, without, feeds(shape, np.float32, seed=1))
    assert len(handed) == 1


def test_a_non_contiguous_input_runs_the_dropped_steps(monkeypatch) -> None:
    # x read through a Transpose: the BatchNorm's input is a strided view
    fused, without = plans(bn_gradient_model(4, transposed=True), monkeypatch)
    assert "BatchNormalizationStats" in ops(fused)
    f = feeds((3, 4, 5, 5), np.float32)
    f["t"] = f["t"].swapaxes(0, 1).copy()
    handed = count_hand_overs(monkeypatch)
    run_both(fused, without, f)
    assert not handed


@pytest.mark.parametrize("rank, dtype", [(2, np.float32), (4, np.float16)])
def test_no_hand_over_where_the_gradient_reduces_something_else(rank, dtype, monkeypatch) -> None:
    # (N, C): the statistics over axis 0 alone; float16: the gradient averages a float32 cast of x
    fused, without = plans(bn_gradient_model(rank, dtype), monkeypatch)
    assert "BatchNormalizationStats" not in ops(fused)
    assert ops(fused) == ops(without)


def mean_after_bn(keepdims: int, axes: list[int], var: bool) -> onnx.ModelProto:
    """A BatchNorm and, by hand, the mean of its input over ``axes`` (and the variance about it)."""
    c = 4
    inits = [numpy_helper.from_array(np.ones(c, np.float32), n) for n in ("scale", "var")]
    inits += [numpy_helper.from_array(np.zeros(c, np.float32), n) for n in ("bias", "mean")]
    nodes = [helper.make_node("BatchNormalization", ["x", "scale", "bias", "mean", "var"], ["y"],
                              training_mode=1),
             helper.make_node("ReduceMean", ["x"], ["m"], axes=axes, keepdims=keepdims)]
    outs = ["y", "m"]
    if var:
        nodes += [helper.make_node("Sub", ["x", "m"], ["d"]), helper.make_node("Mul", ["d", "d"], ["dd"]),
                  helper.make_node("ReduceMean", ["dd"], ["v"], axes=axes, keepdims=keepdims)]
        outs += ["v", "d"]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outs], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("keepdims, var", [(0, False), (1, False), (1, True)])
@pytest.mark.parametrize("axes", [[0, 2, 3], [3, 0, 2], [0, -2, -1]], ids=str)
def test_a_mean_over_every_axis_but_the_channels_is_handed_over(keepdims, axes, var, monkeypatch) -> None:
    fused, without = plans(mean_after_bn(keepdims, axes, var), monkeypatch)
    assert "BatchNormalizationStats" in ops(fused) and "ReduceMean" not in ops(fused)
    x = feeds((6, 4, 5, 7), np.float32)["x"]
    got, want = fused.run({"x": x}), without.run({"x": x})
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(got[1].reshape(-1), x.astype(np.float64).mean(axis=(0, 2, 3)), rtol=1e-6)
    errors = []
    for plan in (fused, without):  # a rank its axes do not fit fails as it did
        with pytest.raises(Exception) as e:
            plan.run({"x": x[0]})
        errors.append(str(e.value))
    assert errors[0] == errors[1]
    for a, b in zip(fused.run({"x": x[..., None]}), without.run({"x": x[..., None]})):  # a mean over 0, 2, 3
        np.testing.assert_array_equal(a, b)  # of five axes: the dropped steps run


def test_a_variance_about_a_mean_without_its_axes_is_left_to_its_steps(monkeypatch) -> None:
    # keepdims=0: Sub(x, mean) with a (C,) mean subtracts along the last axis (here as long as C), which is
    # not the forward's per-channel centering: the mean is handed over, the variance computed by its steps
    fused, without = plans(mean_after_bn(0, [0, 2, 3], True), monkeypatch)
    assert "ReduceMean" not in ops(fused) and "ChannelDot" in ops(fused)
    x = feeds((6, 4, 5, 4), np.float32)["x"]
    got, want = fused.run({"x": x}), without.run({"x": x})
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    d = x.astype(np.float64) - x.astype(np.float64).mean(axis=(0, 2, 3))  # broadcast along the last axis
    np.testing.assert_allclose(got[2], (d * d).mean(axis=(0, 2, 3)), rtol=1e-5)


@pytest.mark.parametrize("axes", [[0, 1, 2], [2, 3], [0, 3, 4]], ids=str)
def test_other_means_are_left_alone(axes, monkeypatch) -> None:
    fused, without = plans(mean_after_bn(1, axes, False), monkeypatch)
    assert "BatchNormalizationStats" not in ops(fused) and ops(fused) == ops(without)


def test_a_mean_over_fewer_axes_than_the_input_has_is_not_handed_over(monkeypatch) -> None:
    # axes (0, 2) fit a rank-3 input: fused, but a rank-4 one averages over (0, 2) only, as without the pass
    fused, without = plans(mean_after_bn(1, [0, 2], False), monkeypatch)
    assert "BatchNormalizationStats" in ops(fused)
    for shape in ((6, 4, 5), (6, 4, 5, 7)):
        x = feeds(shape, np.float32)["x"]
        for a, b in zip(fused.run({"x": x}), without.run({"x": x})):
            np.testing.assert_array_equal(a, b)
