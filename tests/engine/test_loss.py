"""Loss and Dropout kernels: seeding and mask behaviour of Dropout, losses against torch, bad targets."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
import pytest
from onnx import helper

from onnxtrain.engine import compile_model
from onnxtrain.engine.kernels.loss import set_dropout_seed
from onnxtrain.engine.plan import EngineError


def _dropout_model(n_nodes: int = 1, seed: int | None = None, ratio: float = 0.5,
                   elem: int = onnx.TensorProto.FLOAT) -> onnx.ModelProto:
    """``n_nodes`` training-mode Dropout nodes on the same input, each with its output and mask."""
    inits = [helper.make_tensor("r", onnx.TensorProto.FLOAT, [], [ratio]),
             helper.make_tensor("t", onnx.TensorProto.BOOL, [], [True])]
    extra = {} if seed is None else {"seed": seed}
    nodes, outs = [], []
    for i in range(n_nodes):
        nodes.append(helper.make_node("Dropout", ["x", "r", "t"], [f"y{i}", f"m{i}"], name=f"d{i}", **extra))
        outs += [helper.make_tensor_value_info(f"y{i}", elem, None),
                 helper.make_tensor_value_info(f"m{i}", onnx.TensorProto.BOOL, None)]
    x = helper.make_tensor_value_info("x", elem, None)
    g = helper.make_graph(nodes, "dropout", [x], outs, initializer=inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


_X = np.random.default_rng(0).uniform(1, 2, (64, 50)).astype(np.float32)


def test_dropout_masks_differ_between_runs_and_scale_the_kept_values() -> None:
    plan = compile_model(_dropout_model(ratio=0.25))
    y1, m1 = plan.run({"x": _X})
    y2, m2 = plan.run({"x": _X})
    assert m1.dtype == np.bool_ and not np.array_equal(m1, m2)
    assert abs(m1.mean() - 0.75) < 0.03
    np.testing.assert_allclose(y1, np.where(m1, _X / 0.75, 0), rtol=1e-6)


@pytest.mark.parametrize("elem", [onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16])
def test_dropout_in_half_precision(elem: int) -> None:
    """float16 and bfloat16 inputs (mixed precision runs Dropout in half; bfloat16 failed): the mask the
    same seed gives a float32 input, and the float32 result within one unit in the last place of the half
    type (the scale 1/(1 − ratio) multiplies in float32, as onnxruntime computes it)."""
    dt = onnx.helper.tensor_dtype_to_np_dtype(elem)
    x = _X.astype(dt)
    y, m = compile_model(_dropout_model(seed=7, ratio=0.25, elem=elem)).run({"x": x})
    y32, m32 = compile_model(_dropout_model(seed=7, ratio=0.25)).run({"x": x.astype(np.float32)})
    assert y.dtype == dt and np.array_equal(m, m32)
    ulp = np.abs(y32) * 2.0 ** -(10 if elem == onnx.TensorProto.FLOAT16 else 7)
    assert np.all(np.abs(y.astype(np.float32) - y32) <= ulp)
    assert np.all(y.astype(np.float32)[~m] == 0)
    # rounded once from the float32 product: the scale is not rounded to the half type first (float16 did,
    # which biased every kept value)
    np.testing.assert_array_equal(y, (x.astype(np.float32) * np.float32(1 / 0.75) * m).astype(dt))


def test_set_dropout_seed_makes_unseeded_nodes_reproducible() -> None:
    set_dropout_seed(123)
    plan = compile_model(_dropout_model(n_nodes=2))
    first = plan.run({"x": _X})
    second = plan.run({"x": _X})
    assert not np.array_equal(first[1], first[3]), "two nodes must not share a mask"
    set_dropout_seed(123)
    again = compile_model(_dropout_model(n_nodes=2)).run({"x": _X})
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
    set_dropout_seed(123)  # also reseeds a plan that already ran
    for a, b in zip(first, plan.run({"x": _X})):
        np.testing.assert_array_equal(a, b)
    assert not np.array_equal(first[1], second[1])
    set_dropout_seed(None)


def test_seed_attribute_matches_numpy_legacy_seeding_and_ignores_set_dropout_seed() -> None:
    set_dropout_seed(5)
    a = compile_model(_dropout_model(seed=9)).run({"x": _X})
    set_dropout_seed(6)
    b = compile_model(_dropout_model(seed=9)).run({"x": _X})
    np.testing.assert_array_equal(a[1], b[1])
    np.testing.assert_array_equal(a[1], np.random.RandomState(9).uniform(0, 1, _X.shape) >= 0.5)
    set_dropout_seed(None)


@pytest.mark.parametrize("ratio", [0.9999, 0.99999, 1e-5, 0.01, 0.1])
def test_dropout_keeps_each_value_with_probability_one_minus_ratio(ratio: float) -> None:
    """The number kept out of 2**24 is within 5 standard deviations of Binomial(2**24, 1 - ratio) (16
    random bits per value kept 256 at 0.99999 where 168 is expected, and dropped none at 1e-5), and the kept
    values are scaled by 1 / (1 - ratio): the mean stays 1."""
    set_dropout_seed(5)
    try:
        n = 1 << 24
        y, m = compile_model(_dropout_model(ratio=ratio)).run({"x": np.ones(n, np.float32)})
    finally:
        set_dropout_seed(None)
    r = float(np.float32(ratio))  # the ratio the model holds
    dropped = n - int(m.sum())
    mean, sd = n * r, (n * r * (1 - r)) ** 0.5
    assert abs(dropped - mean) <= 5 * sd + 1, (dropped, mean, sd)
    np.testing.assert_allclose(y[m], np.float32(1 / (1 - r)), rtol=1e-6)


def test_dropout_inference_is_identity_with_a_full_mask() -> None:
    node = helper.make_node("Dropout", ["x"], ["y", "m"])
    g = helper.make_graph([node], "d", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, None)],
                          [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None),
                           helper.make_tensor_value_info("m", onnx.TensorProto.BOOL, None)])
    y, m = compile_model(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])).run({"x": _X})
    np.testing.assert_array_equal(y, _X)
    assert m.dtype == np.bool_ and m.all()


def _loss_model(op: str, inputs: list[Any], **attrs: Any) -> onnx.ModelProto:
    names = [f"x{i}" if v is not None else "" for i, v in enumerate(inputs)]
    g_in = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(names, inputs) if n]
    scores = helper.np_dtype_to_tensor_dtype(inputs[0].dtype)  # the loss is of the scores' type
    g = helper.make_graph([helper.make_node(op, names, ["loss"], **attrs)], op, g_in,
                          [helper.make_tensor_value_info("loss", scores, None)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_softmax_cross_entropy_matches_torch(reduction: str, weighted: bool) -> None:
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    x = rng.normal(0, 2, (6, 4, 3)).astype(np.float32)
    t = rng.integers(0, 4, (6, 3)).astype(np.int64)
    t[0, :] = -100
    w = rng.uniform(0.5, 2, 4).astype(np.float32) if weighted else None
    inputs = [x, t] if w is None else [x, t, w]
    (ours,) = compile_model(_loss_model("SoftmaxCrossEntropyLoss", inputs, reduction=reduction,
                                        ignore_index=-100)).run({f"x{i}": v for i, v in enumerate(inputs)})
    theirs = torch.nn.functional.cross_entropy(torch.from_numpy(x), torch.from_numpy(t), reduction=reduction,
                                               weight=None if w is None else torch.from_numpy(w),
                                               ignore_index=-100).numpy()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["SoftmaxCrossEntropyLoss", "NegativeLogLikelihoodLoss"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("weighted", [False, True])
def test_ignored_rows_with_infinite_scores_add_nothing(op: str, reduction: str, weighted: bool) -> None:
    # padding positions whose logits are all masked to -inf, and ignored: their loss is 0, not -inf · 0
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 5)).astype(np.float32)
    x[0, :] = -np.inf
    x[3, 3] = np.nan
    t = np.array([3, 1, 2, 3], np.int64)
    w = rng.uniform(0.5, 2, 5).astype(np.float32) if weighted else None
    inputs = [x, t] if w is None else [x, t, w]
    (ours,) = compile_model(_loss_model(op, inputs, reduction=reduction, ignore_index=3)).run(
        {f"x{i}": v for i, v in enumerate(inputs)})
    xt = torch.from_numpy(x).double()
    lp = torch.log_softmax(xt, 1) if op.startswith("Softmax") else xt
    theirs = torch.nn.functional.nll_loss(lp, torch.from_numpy(t), reduction=reduction, ignore_index=3,
                                          weight=None if w is None else torch.from_numpy(w).double()).numpy()
    assert np.isfinite(ours).all()
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-6)


def test_target_out_of_range_is_an_error() -> None:
    x = np.zeros((2, 3), np.float32)
    t = np.array([0, 3], np.int64)
    with pytest.raises(EngineError, match="outside"):
        compile_model(_loss_model("NegativeLogLikelihoodLoss", [x, t])).run({"x0": x, "x1": t})


def _general_sce(x: np.ndarray, t: np.ndarray, reduction: str, ignore_index: int | None = None
                 ) -> tuple[np.ndarray, np.ndarray]:
    """The kernel's general path (log_softmax_along + _nll), which the 2-D path must match bit for bit."""
    from onnxtrain.engine.kernels.loss import _nll
    from onnxtrain.engine.kernels.normalization import log_softmax_along
    from onnxtrain.engine.registry import Attrs

    logp = log_softmax_along(x, 1)
    return _nll(logp, t, None, Attrs({"reduction": reduction, "ignore_index": ignore_index})), logp


def _float64_sce(x: np.ndarray, t: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Log-probabilities and per-row losses of 2-D scores, written out in float64 (the oracle)."""
    x64 = x.astype(np.float64)
    lp = x64 - x64.max(1, keepdims=True)
    lp -= np.log(np.exp(lp).sum(1, keepdims=True))
    return lp, -lp[np.arange(x.shape[0]), t]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(1, 1), (7, 3), (256, 10), (64, 300)])
@pytest.mark.parametrize("ignore_index", [None, -100])
def test_softmax_cross_entropy_2d_rows_match_the_general_path_and_float64(
    dtype: type, reduction: str, shape: tuple[int, int], ignore_index: int | None
) -> None:
    rng = np.random.default_rng(sum(shape))
    x = rng.normal(0, 4, shape).astype(dtype)
    x[0, 0] = 60.0  # a confident row
    t = rng.integers(0, shape[1], shape[0]).astype(np.int64)
    extra = {} if ignore_index is None else {"ignore_index": ignore_index}  # named, but no target is it
    model = _loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction=reduction, **extra)
    model.graph.node[0].output.append("logp")
    model.graph.output.append(helper.make_tensor_value_info("logp", helper.np_dtype_to_tensor_dtype(x.dtype),
                                                            None))
    loss, logp = compile_model(model).run({"x0": x, "x1": t})
    ref_loss, ref_logp = _general_sce(x, t, reduction, ignore_index)
    np.testing.assert_array_equal(logp, ref_logp)
    np.testing.assert_array_equal(loss, ref_loss)
    assert loss.dtype == logp.dtype == dtype
    # and the values, against float64 written out
    lp, per = _float64_sce(x, t)
    want = {"none": per, "sum": per.sum(), "mean": per.mean()}[reduction]
    tol = 1e-5 if dtype == np.float32 else 1e-12
    np.testing.assert_allclose(logp, lp, rtol=tol, atol=tol)
    np.testing.assert_allclose(loss, want, rtol=tol, atol=tol)


@pytest.mark.parametrize("bad", [-1, 3])
def test_softmax_cross_entropy_2d_target_out_of_range_is_an_error(bad: int) -> None:
    x = np.zeros((2, 3), np.float32)
    t = np.array([0, bad], np.int64)
    with pytest.raises(EngineError, match="outside"):
        compile_model(_loss_model("SoftmaxCrossEntropyLoss", [x, t])).run({"x0": x, "x1": t})


def test_softmax_cross_entropy_2d_nan_scores_give_nan() -> None:
    x = np.array([[0.0, np.nan, 1.0], [1.0, 2.0, 3.0]], np.float32)
    t = np.array([0, 2], np.int64)
    (loss,) = compile_model(_loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction="none")).run(
        {"x0": x, "x1": t})
    assert np.isnan(loss[0]) and np.isfinite(loss[1])


@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_softmax_cross_entropy_2d_with_ignored_targets_matches_the_general_path(reduction: str) -> None:
    rng = np.random.default_rng(5)
    x = rng.normal(0, 2, (9, 4)).astype(np.float32)
    t = rng.integers(0, 4, 9).astype(np.int64)
    t[[2, 5]] = -100
    model = _loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction=reduction, ignore_index=-100)
    (loss,) = compile_model(model).run({"x0": x, "x1": t})
    np.testing.assert_array_equal(loss, _general_sce(x, t, reduction, -100)[0])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
@pytest.mark.parametrize("shape", [(2, 4), (64, 10), (7, 3)])
@pytest.mark.parametrize("special", [False, True])
def test_softmax_cross_entropy_2d_small_inputs_have_the_bits_of_the_row_split_path(
    dtype: type, reduction: str, shape: tuple[int, int], special: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Scores below MIN_VALUES take the inlined rows path; the same bits as the path that splits the rows
    over two threads (forced here), the mean as np.mean computes it, and float64's values."""
    from onnxtrain.engine import parallel
    from onnxtrain.engine.kernels import loss as loss_module
    from onnxtrain.engine.plan import Plan

    rng = np.random.default_rng(shape[0])
    x = rng.normal(0, 3, shape).astype(dtype)
    t = rng.integers(0, shape[1], shape[0]).astype(np.int64)
    if special:  # a row with -0.0 and +0.0 tied at its max, an infinite score, a NaN
        x[0, :2] = [-0.0, 0.0]
        x[0, 2:] = -1e4
        x[1, 0] = -np.inf
        x[-1, -1] = np.nan
    model = _loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction=reduction)
    model.graph.node[0].output.append("logp")
    model.graph.output.append(helper.make_tensor_value_info("logp", helper.np_dtype_to_tensor_dtype(x.dtype),
                                                            None))
    small = Plan(model, threads=2).run({"x0": x, "x1": t})
    monkeypatch.setattr(loss_module, "MIN_VALUES", 0)
    monkeypatch.setattr(parallel, "MIN_ROWS_WORK", 1)
    calls: list[int] = []
    real = parallel.parallel_for
    monkeypatch.setattr(parallel, "parallel_for", lambda n, fn: (calls.append(n), real(n, fn)))
    split = Plan(model, threads=2).run({"x0": x, "x1": t})
    assert calls == [2]  # the rows in two parts
    for a, b in zip(small, split):
        assert a.dtype == b.dtype == dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
    per = -_general_sce(x, t, "none")[0]
    if reduction == "mean":
        assert small[0].tobytes() == np.asarray(np.mean(-per, dtype=dtype)).tobytes()
    if not special:
        want = _float64_sce(x, t)[1]
        want = {"none": want, "sum": want.sum(), "mean": want.mean()}[reduction]
        tol = 1e-5 if dtype == np.float32 else 1e-12
        np.testing.assert_allclose(small[0], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("bad", [None, -1, 4])
def test_softmax_cross_entropy_2d_int32_and_int64_targets_agree(bad: int | None) -> None:
    """int64 targets are checked and offset by ravel_multi_index, others by in_range: the same losses for the
    same classes, and the same error for a class outside [0, C)."""
    rng = np.random.default_rng(9)
    x = rng.normal(0, 2, (5, 4)).astype(np.float32)
    t = rng.integers(0, 4, 5)
    if bad is not None:
        t[2] = bad
    got = []
    for dtype in (np.int64, np.int32):
        model = _loss_model("SoftmaxCrossEntropyLoss", [x, t.astype(dtype)], reduction="none")
        if bad is not None:
            with pytest.raises(EngineError, match="outside"):
                compile_model(model).run({"x0": x, "x1": t.astype(dtype)})
            continue
        got.append(compile_model(model).run({"x0": x, "x1": t.astype(dtype)})[0])
    if bad is None:
        assert got[0].tobytes() == got[1].tobytes() == _general_sce(x, t, "none")[0].tobytes()


@pytest.mark.parametrize("dtype", [np.int64, np.int32])
@pytest.mark.parametrize("spatial", [False, True])
def test_softmax_cross_entropy_target_out_of_range_fails_as_a_value_error(spatial: bool, dtype) -> None:
    """A class outside [0, C) fails as the same ValueError on the 2-D rows path as on the general path (the
    onnxruntime backend words its refusal so too: ort_plan.py), not as the rows path's own signal."""
    x = np.random.default_rng(14).normal(0, 2, (5, 4, 1) if spatial else (5, 4)).astype(np.float32)
    t = np.array([0, 1, 7, 3, 2], dtype).reshape((5, 1) if spatial else (5,))
    plan = compile_model(_loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction="mean"))
    with pytest.raises(EngineError) as e:
        plan.run({"x0": x, "x1": t})
    assert "ValueError: target holds class indices outside [0, 4) that are not ignore_index" in str(e.value)
    assert type(e.value.__cause__) is ValueError


@pytest.mark.parametrize("ignore_index", [-100, 4, 2])
@pytest.mark.parametrize("case", ["none_ignored", "some_ignored", "out_of_range"])
@pytest.mark.parametrize("reduction", ["mean", "sum", "none"])
def test_softmax_cross_entropy_ignored_class_outside_the_classes_needs_no_scan(
    ignore_index: int, case: str, reduction: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An ignore_index outside [0, C) (torch's -100) is not looked for: the rows path runs, and a target out
    of range (that class, or another) sends the batch to the general path, which ignores that class or
    reports the others. The general path's bits and errors in every case; one inside [0, C) is scanned for
    first."""
    from onnxtrain.engine.kernels import loss as loss_module

    rows_calls: list[bool] = []
    real = loss_module._sce_rows
    monkeypatch.setattr(loss_module, "_sce_rows", lambda *a: rows_calls.append(True) or real(*a))
    rng = np.random.default_rng(13)
    x = rng.normal(0, 2, (6, 4)).astype(np.float32)
    t = rng.integers(0, 4, 6).astype(np.int64)
    t[t == ignore_index] = (ignore_index + 1) % 4
    if case == "some_ignored":
        t[[1, 4]] = ignore_index
    elif case == "out_of_range":
        t[3] = 7
    model = _loss_model("SoftmaxCrossEntropyLoss", [x, t], reduction=reduction, ignore_index=ignore_index)
    if case == "out_of_range":
        with pytest.raises(EngineError, match="outside"):
            compile_model(model).run({"x0": x, "x1": t})
        return
    (loss,) = compile_model(model).run({"x0": x, "x1": t})
    assert loss.tobytes() == _general_sce(x, t, reduction, ignore_index)[0].tobytes()
    scanned_in = 0 <= ignore_index < 4
    assert bool(rows_calls) == (case == "none_ignored" or not scanned_in)
