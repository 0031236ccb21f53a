"""Random kernels: distributions checked by statistics, shapes and dtypes, seeding, and that the plan
never folds, memoises or merges a random step.

Statistical bounds are computed from the sample sizes so that a correct kernel fails one with probability
about 1e-9: means and rates within 6 standard errors, empirical CDFs within the Dvoretzky-Kiefer-Wolfowitz
band, Multinomial frequencies within the Laurent-Massart tail bound of their chi-square statistic.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain.autodiff import build_gradient_model
from onnxtrain.engine import Plan, compile_model
from onnxtrain.engine.plan import EngineError
from onnxtrain.engine.seeds import set_random_seed
from onnxtrain.ir.builder import make_model

DELTA = 1e-9  # allowed false-alarm probability of each statistical check
Z = 6.0  # standard errors (two-sided normal tail ~2e-9)
SHAPE = [200, 200]


def _model(nodes: list[onnx.NodeProto], inputs: list[onnx.ValueInfoProto], outputs: list[str],
           inits: list[onnx.TensorProto] | None = None, opset: int = 17) -> onnx.ModelProto:
    outs = [helper.make_empty_tensor_value_info(n) for n in outputs]
    return make_model(helper.make_graph(nodes, "random", inputs, outs, inits or []), opset)


def _one(op: str, x: np.ndarray | None = None, n_nodes: int = 1, diff: bool = False,
         **attrs: Any) -> onnx.ModelProto:
    """``n_nodes`` nodes of ``op`` (on input ``x`` when given), outputs y0, y1, ...; with ``diff``, two
    nodes whose outputs stay inside the graph and one output ``d = y0 - y1``."""
    ins = [] if x is None else ["x"]
    nodes = [helper.make_node(op, ins, [f"y{i}"], name=f"{op}{i}", **attrs) for i in range(n_nodes)]
    inputs = [] if x is None else [helper.make_tensor_value_info(
        "x", helper.np_dtype_to_tensor_dtype(x.dtype), x.shape)]
    if diff:
        return _model([*nodes, helper.make_node("Sub", ["y0", "y1"], ["d"])], inputs, ["d"])
    return _model(nodes, inputs, [f"y{i}" for i in range(n_nodes)])


def _run(model: onnx.ModelProto, x: np.ndarray | None = None) -> list[np.ndarray]:
    return compile_model(model).run({} if x is None else {"x": x})


def _dkw(n: int) -> float:
    """Half-width of the band that holds the empirical CDF of n draws with probability 1 - DELTA."""
    return math.sqrt(math.log(2 / DELTA) / (2 * n))


def _ks(sample: np.ndarray, cdf) -> float:
    """Largest distance between the empirical CDF of ``sample`` and ``cdf``."""
    x = np.sort(sample.astype(np.float64).ravel())
    n = x.size
    f = cdf(x)
    return float(max(np.max(np.arange(1, n + 1) / n - f), np.max(f - np.arange(n) / n)))


def _normal_cdf(mean: float, scale: float):
    f64 = torch.float64
    dist = torch.distributions.Normal(torch.tensor(mean, dtype=f64), torch.tensor(scale, dtype=f64))
    return lambda x: dist.cdf(torch.from_numpy(x)).numpy()


def _check_moments(y: np.ndarray, mean: float, var: float, mu4: float) -> None:
    """Sample mean and variance against the distribution's (4th central moment ``mu4`` sets the spread)."""
    v = y.astype(np.float64).ravel()
    n = v.size
    assert abs(v.mean() - mean) <= Z * math.sqrt(var / n), (v.mean(), mean)
    assert abs(v.var(ddof=1) - var) <= Z * math.sqrt((mu4 - var**2) / n) + 1e-3 * var, (v.var(), var)


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize("dtype, mean, scale", [
    (T.FLOAT, 0.0, 1.0), (T.DOUBLE, -3.0, 0.25), (T.FLOAT16, 2.0, 3.0), (T.BFLOAT16, 0.0, 1.0)],
    ids=["f32", "f64", "f16", "bf16"])
def test_random_normal_draws_the_normal_distribution(dtype: int, mean: float, scale: float) -> None:
    (y,) = _run(_one("RandomNormal", shape=SHAPE, dtype=dtype, mean=mean, scale=scale))
    assert y.shape == tuple(SHAPE) and y.dtype == helper.tensor_dtype_to_np_dtype(dtype)
    rounding = 0.0 if dtype in (T.FLOAT, T.DOUBLE) else 0.4 * 2**-7  # bf16's 8 bits: the CDF shifts a little
    assert _ks(y, _normal_cdf(mean, scale)) <= _dkw(y.size) + rounding
    if dtype != T.BFLOAT16:
        _check_moments(y, mean, scale**2, 3 * scale**4)


@pytest.mark.parametrize("dtype, low, high", [
    (T.FLOAT, 0.0, 1.0), (T.DOUBLE, -2.0, 5.0), (T.FLOAT16, -1.0, 1.0)], ids=["f32", "f64", "f16"])
def test_random_uniform_draws_the_uniform_distribution(dtype: int, low: float, high: float) -> None:
    (y,) = _run(_one("RandomUniform", shape=SHAPE, dtype=dtype, low=low, high=high))
    assert y.shape == tuple(SHAPE) and y.dtype == helper.tensor_dtype_to_np_dtype(dtype)
    assert y.min() >= low and y.max() <= high
    w = high - low
    rounding = 1e-3 if dtype == T.FLOAT16 else 0.0
    assert _ks(y, lambda x: np.clip((x - low) / w, 0, 1)) <= _dkw(y.size) + rounding
    _check_moments(y, (low + high) / 2, w**2 / 12, w**4 / 80)


@pytest.mark.parametrize("dtype, low, high", [
    (T.FLOAT16, 1.0, 2.0), (T.BFLOAT16, 1.0, 2.0), (T.FLOAT, 1.0, 2.0), (T.FLOAT16, 0.0, 0.1)],
    ids=["f16", "bf16", "f32", "f16-0.1"])
@pytest.mark.parametrize("op", ["RandomUniform", "RandomUniformLike"])
def test_random_uniform_never_draws_high_after_rounding(op: str, dtype: int, low: float, high: float) -> None:
    # the schema's interval is [low, high): a draw close to high that rounds up to it takes the value below
    shape, np_dt = [2_000_000], helper.tensor_dtype_to_np_dtype(dtype)
    like = {"x": np.zeros(shape, np.float32)} if op.endswith("Like") else {"shape": shape}
    (y,) = _run(_one(op, like.get("x"), dtype=dtype, low=low, high=high, seed=3.0,
                     **({} if "x" in like else like)), like.get("x"))
    assert y.dtype == np_dt and float(y.min()) >= low and float(y.max()) < high
    assert (y == np.nextafter(np.array(high, np_dt), np.array(low, np_dt))).any() or dtype == T.FLOAT


@pytest.mark.parametrize("op", ["RandomNormalLike", "RandomUniformLike"])
def test_like_ops_take_shape_and_dtype_from_the_input_unless_told(op: str) -> None:
    for x in (np.zeros((3, 0, 2), np.float16), np.zeros((4, 5), np.float64), np.zeros((), np.float32)):
        (y,) = _run(_one(op, x), x)
        assert y.shape == x.shape and y.dtype == x.dtype
    x = np.zeros((300, 100), np.int64)
    (y,) = _run(_one(op, x, dtype=T.DOUBLE), x)
    assert y.shape == x.shape and y.dtype == np.float64
    cdf = _normal_cdf(0.0, 1.0) if op == "RandomNormalLike" else (lambda v: np.clip(v, 0, 1))
    assert _ks(y, cdf) <= _dkw(y.size)
    with pytest.raises(EngineError, match=f"{op}: the input is int64 and no dtype attribute"):
        _run(_one(op, x), x)


_HALF_ROW = np.full((1, 4), 0.5, np.float32)


@pytest.mark.parametrize("op, x, attrs, msg", [
    ("RandomNormal", None, {"shape": [2], "dtype": T.UNDEFINED}, "dtype 0 is not a known tensor element"),
    ("RandomUniform", None, {"shape": [2], "dtype": 999}, "dtype 999 is not a known tensor element type"),
    ("RandomUniformLike", _HALF_ROW, {"dtype": 999}, "dtype 999 is not"),
    ("Bernoulli", _HALF_ROW, {"dtype": 999}, "dtype 999 is not a known"),
    ("Bernoulli", _HALF_ROW, {"dtype": T.STRING}, "dtype must be a bool, integer or float type"),
    ("Bernoulli", _HALF_ROW, {"dtype": T.COMPLEX64}, "dtype must be a bool, integer or float type"),
    ("Multinomial", _HALF_ROW, {"dtype": T.UNDEFINED}, "dtype 0 is not a known tensor element type"),
], ids=["normal_undefined", "uniform_unknown", "uniform_like_unknown", "bernoulli_unknown",
        "bernoulli_string", "bernoulli_complex", "multinomial_undefined"])
def test_bad_dtype_attributes_are_refused_by_name(op: str, x: np.ndarray | None, attrs: dict[str, Any],
                                                  msg: str) -> None:
    """The dtype attribute outside the op's type constraint (onnxruntime refuses these models too) is
    named, with the op, in the error: not a bare KeyError nor an object or complex output."""
    with pytest.raises(EngineError, match=f"{op}: {msg}"):
        _run(_one(op, x, **attrs), x)


def test_bernoulli_undefined_dtype_means_the_input_type() -> None:
    """dtype UNDEFINED (0) on Bernoulli reads as unset, as on the *Like forms: the input's type."""
    p = np.full((2, 3), 0.5, np.float64)
    (y,) = _run(_one("Bernoulli", p, dtype=T.UNDEFINED), p)
    assert y.dtype == np.float64 and y.shape == p.shape


_P = np.array([0.0, 0.02, 0.3, 0.5, 0.77, 0.99, 1.0])


@pytest.mark.parametrize("in_dtype, attrs, out_dtype", [
    (np.float32, {}, np.float32), (np.float64, {}, np.float64), (np.float16, {}, np.float16),
    (np.float32, {"dtype": T.BOOL}, np.bool_), (np.float64, {"dtype": T.INT32}, np.int32)],
    ids=["f32", "f64", "f16", "to_bool", "to_int32"])
def test_bernoulli_draws_ones_at_the_given_rates(in_dtype, attrs, out_dtype) -> None:
    n = 20_000
    p = np.tile(_P.astype(in_dtype), (n, 1))
    (y,) = _run(_one("Bernoulli", p, **attrs), p)
    assert y.shape == p.shape and y.dtype == out_dtype
    assert set(np.unique(y.astype(np.float64))) <= {0.0, 1.0}
    rate = y.astype(np.float64).mean(axis=0)
    q = _P.astype(in_dtype).astype(np.float64)
    np.testing.assert_array_less(np.abs(rate - q), Z * np.sqrt(q * (1 - q) / n) + 1e-12)
    assert rate[0] == 0.0 and rate[-1] == 1.0


@pytest.mark.parametrize("in_dtype, attrs", [(np.float32, {}), (np.float64, {"dtype": T.BOOL})],
                         ids=["f32", "f64_to_bool"])
def test_bernoulli_on_the_onnxruntime_backend_draws_ones_at_the_given_rates(in_dtype, attrs) -> None:
    """onnxruntime's kernel draws 1 with probability 1 - p; the backend hands it 1 - p (a body's too)."""
    import onnxtrain

    n = 20_000
    p = np.tile(_P.astype(in_dtype), (n, 1))
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    model = _one("Bernoulli", p, **attrs)
    et = attrs.get("dtype", helper.np_dtype_to_tensor_dtype(np.dtype(in_dtype)))
    then = helper.make_graph([helper.make_node("Bernoulli", ["x"], ["b"], **attrs)], "then", [],
                             [helper.make_tensor_value_info("b", et, None)])
    model.graph.node.append(helper.make_node("If", ["on"], ["yb"], then_branch=then, else_branch=then))
    model.graph.initializer.append(numpy_helper.from_array(np.array(True), "on"))
    model.graph.output.append(helper.make_tensor_value_info("yb", et, None))
    for y in onnxtrain.InferenceSession(model.SerializeToString(), so).run(None, {"x": p}):
        rate = y.astype(np.float64).mean(axis=0)
        q = _P.astype(in_dtype).astype(np.float64)
        np.testing.assert_array_less(np.abs(rate - q), Z * np.sqrt(q * (1 - q) / n) + 1e-12)


@pytest.mark.parametrize("p", [np.array([0.5, 1.5]), np.array([-0.1]), np.array([np.nan])],
                         ids=["above_one", "negative", "nan"])
def test_bernoulli_refuses_probabilities_outside_0_1(p: np.ndarray) -> None:
    with pytest.raises(EngineError, match=r"Bernoulli: every input probability must be in \[0, 1\]"):
        _run(_one("Bernoulli", p), p)


def _chi_square_bound(df: int) -> float:
    """P(chi2_df >= bound) <= DELTA (Laurent and Massart, 2000)."""
    t = math.log(1 / DELTA)
    return df + 2 * math.sqrt(df * t) + 2 * t


@pytest.mark.parametrize("attrs, dtype", [({}, np.int32), ({"dtype": T.INT64}, np.int64)],
                         ids=["int32", "int64"])
def test_multinomial_frequencies_follow_the_softmax_of_each_row(attrs: dict[str, Any], dtype) -> None:
    n = 30_000
    rng = np.random.default_rng(3)
    x = rng.normal(0, 1.5, (3, 6)).astype(np.float32)
    x[1] += 1000.0  # large logits: the kernel must shift by the row's max
    x[2, 4] = -np.inf  # a class that can never be drawn
    (y,) = _run(_one("Multinomial", x, sample_size=n, **attrs), x)
    assert y.shape == (3, n) and y.dtype == dtype
    assert y.min() >= 0 and y.max() < 6
    probs = torch.softmax(torch.from_numpy(x.astype(np.float64)), dim=1).numpy()
    for row, p in zip(y, probs):
        observed = np.bincount(row, minlength=6)
        live = p > 0
        assert observed[~live].sum() == 0
        expected = n * p[live]
        chi2 = float(((observed[live] - expected) ** 2 / expected).sum())
        assert chi2 <= _chi_square_bound(int(live.sum()) - 1), (observed, expected)


@pytest.mark.parametrize("x, msg", [
    (np.full((2, 3), -np.inf, np.float32), "row 0 has no finite largest log-probability"),
    (np.array([[0.0, np.nan]], np.float32), "row 0 has no finite largest"),
    (np.array([[0.0, 1.0], [np.nan, 1.0]]), "NaN"),
    (np.zeros(4, np.float32), r"float \[batch, classes\] tensor"),
])
def test_multinomial_refuses_bad_log_probabilities(x: np.ndarray, msg: str) -> None:
    with pytest.raises(EngineError, match=f"Multinomial: .*{msg}"):
        _run(_one("Multinomial", x, sample_size=3), x)


# ---------------------------------------------------------------- seeds and fresh randomness

_HALF = np.full((40, 50), 0.5, np.float32)
_CASES: list[tuple[str, np.ndarray | None, dict[str, Any]]] = [
    ("RandomNormal", None, {"shape": [40, 50]}),
    ("RandomUniform", None, {"shape": [40, 50], "dtype": T.DOUBLE}),
    ("RandomNormalLike", _HALF, {}),
    ("RandomUniformLike", _HALF, {}),
    ("Bernoulli", _HALF, {}),
    ("Multinomial", np.zeros((4, 10), np.float32), {"sample_size": 500}),
]
_IDS = [c[0] for c in _CASES]


@pytest.mark.parametrize("op, x, attrs", _CASES, ids=_IDS)
def test_a_seeded_node_repeats_its_sequence_per_plan_and_continues_it_between_runs(op, x, attrs) -> None:
    model = _one(op, x, seed=7.0, **attrs)
    feeds = {} if x is None else {"x": x}
    a, b = compile_model(model), compile_model(model)
    a1, a2 = a.run(feeds)[0], a.run(feeds)[0]
    b1, b2 = b.run(feeds)[0], b.run(feeds)[0]
    np.testing.assert_array_equal(a1, b1)
    np.testing.assert_array_equal(a2, b2)
    assert not np.array_equal(a1, a2)
    other = compile_model(_one(op, x, seed=7.5, **attrs)).run(feeds)[0]
    assert not np.array_equal(a1, other)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
@pytest.mark.parametrize("op, x, attrs", _CASES, ids=_IDS)
def test_unseeded_nodes_draw_fresh_values_every_run_and_per_node(op, x, attrs, fuse: bool) -> None:
    """Two identical unseeded nodes are not merged (common subexpressions): their difference is not 0;
    and no run repeats another."""
    plan = Plan(_one(op, x, n_nodes=2, diff=True, **attrs), fuse=fuse)
    feeds = {} if x is None else {"x": x}
    (first,), (second,) = plan.run(feeds), plan.run(feeds)
    assert first.any() and second.any()
    assert not np.array_equal(first, second)
    (y,) = compile_model(_one(op, x, **attrs)).run(feeds)
    assert not np.array_equal(y, compile_model(_one(op, x, **attrs)).run(feeds)[0])


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "plain"])
def test_random_steps_of_constants_and_shapes_are_neither_folded_nor_memoised(fuse: bool) -> None:
    """RandomUniformLike of a Constant, RandomNormalLike of ConstantOfShape(Shape(x)), RandomNormal of no
    input, each inside the graph: steps the plan would fold or memoise if they were deterministic."""
    c = numpy_helper.from_array(np.zeros((30, 20), np.float32), "c")
    nodes = [
        helper.make_node("Constant", [], ["k"], value=c),
        helper.make_node("RandomUniformLike", ["k"], ["u"]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("ConstantOfShape", ["s"], ["z"]),
        helper.make_node("RandomNormalLike", ["z"], ["n"], dtype=T.FLOAT),
        helper.make_node("RandomNormal", [], ["r"], shape=[30, 20]),
        *(helper.make_node("Add", [v, "x"], [f"{v}x"]) for v in ("u", "n", "r")),
    ]
    x = helper.make_tensor_value_info("x", T.FLOAT, [30, 20])
    plan = Plan(_model(nodes, [x], ["ux", "nx", "rx"]), fuse=fuse)
    feeds = {"x": np.ones((30, 20), np.float32)}
    first, second = plan.run(feeds), plan.run(feeds)
    for a, b in zip(first, second):
        assert a.shape == (30, 20) and not np.array_equal(a, b)


def test_set_random_seed_makes_unseeded_nodes_reproducible() -> None:
    model = _one("RandomNormal", n_nodes=2, shape=[100])
    try:
        set_random_seed(11)
        first = _run(model)
        set_random_seed(11)
        again = _run(model)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
        assert not np.array_equal(first[0], first[1])
        set_random_seed(12)
        assert not np.array_equal(first[0], _run(model)[0])
    finally:
        set_random_seed(None)


# ---------------------------------------------------------------- autodiff


def test_a_reparameterised_sample_carries_gradients_to_its_mean_and_scale() -> None:
    """z = mu + s * eps with eps = RandomNormalLike(mu); loss = sum(z^2). The gradient graph reuses the
    forward's eps (the random node runs once): dmu = 2z and ds = sum(2 z eps) with the eps returned."""
    nodes = [
        helper.make_node("RandomNormalLike", ["mu"], ["eps"]),
        helper.make_node("Mul", ["s", "eps"], ["se"]),
        helper.make_node("Add", ["mu", "se"], ["z"]),
        helper.make_node("Mul", ["z", "z"], ["zz"]),
        helper.make_node("ReduceSum", ["zz"], ["loss"], keepdims=0),
    ]
    ins = [helper.make_tensor_value_info("mu", T.DOUBLE, [5, 4]),
           helper.make_tensor_value_info("s", T.DOUBLE, [])]
    grad_model = build_gradient_model(_model(nodes, ins, ["loss", "eps"]), "loss", ["mu", "s"])
    mu, s = np.random.default_rng(0).normal(size=(5, 4)), np.array(0.7)
    loss, eps, dmu, ds = compile_model(grad_model).run({"mu": mu, "s": s})
    z = mu + s * eps
    np.testing.assert_allclose(loss, (z * z).sum(), rtol=1e-12)
    np.testing.assert_allclose(dmu, 2 * z, rtol=1e-12)
    np.testing.assert_allclose(ds, (2 * z * eps).sum(), rtol=1e-12)
