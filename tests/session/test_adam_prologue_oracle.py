"""The legacy AdamOptimizer's bits over whole training runs against an independent numpy oracle.

The model is loss = Σ_w ReduceSum(w ⊙ x_w), so that each weight's gradient is its feed ``x_w`` exactly and
the oracle can replay the update in numpy alone: the moments in the weight's compute type with α and β as
float32 holds them, the bias corrections 1 − base^t as numpy's float64 power of the counts (1 where a count is
≤ 0) rounded once, the step lr·sqrt(c2)/c1, weight-decay mode 0 (ε·sqrt(c2) with the decay factor 1 − lr·λ
applied to the weight first) or mode 1 (ε as given, the factor applied after). That is the spec's update
(``shared/spec/legacy-training-session.md`` 7.3) rearranged as onnxtrain computes it, so the bits it pins are
that arrangement's: the weights are also held, within float32 rounding, to the spec's formulas as written,
evaluated in float64 (mode 0: w − lr·((m1/c1)/(sqrt(m2/c2) + ε) + λ·w); mode 1: w − u − lr·λ·(w − u)).
Losses, weights, moments and counts must have the same bits after every step, with counts loaded midway
that differ per weight (0, negative, large), corrections off for some weights, mixed modes and λ ≠ 0.
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain.ir.builder import make_model
from tests.session.helpers import params

_SHAPES = {"W1": (3, 4), "b1": (4,), "W2": (5,), "s": (1,)}


def _model(names: tuple[str, ...], dtype) -> onnx.ModelProto:
    """loss = Σ ReduceSum(w ⊙ x_w) over the weights ``names`` of type ``dtype``."""
    rng = np.random.default_rng(5)
    et = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    inits = [numpy_helper.from_array((rng.standard_normal(_SHAPES[n]) * 0.5).astype(dtype), n) for n in names]
    nodes, terms = [], []
    for n in names:
        nodes.append(helper.make_node("Mul", [n, f"x_{n}"], [f"p_{n}"]))
        nodes.append(helper.make_node("ReduceSum", [f"p_{n}"], [f"r_{n}"], keepdims=0))
        terms.append(f"r_{n}")
    acc = terms[0]
    for k, t in enumerate(terms[1:]):
        nodes.append(helper.make_node("Add", [acc, t], [f"acc_{k}"]))
        acc = f"acc_{k}"
    nodes.append(helper.make_node("Identity", [acc], ["loss"]))
    g = helper.make_graph(nodes, "sums", [helper.make_tensor_value_info(f"x_{n}", et, list(_SHAPES[n]))
                                           for n in names],
                          [helper.make_tensor_value_info("loss", et, [])], inits)
    return make_model(g, 17)


def _f(x: float, dt) -> np.ndarray:
    return np.asarray(x, dtype=dt)


def _correction(base: float, t: int) -> float:
    """1 − base^t in float64 (numpy's power), 1 for t ≤ 0."""
    if t <= 0:
        return 1.0
    return float(1.0 - np.power(np.array([base, base]), np.array([float(t), float(t)]))[0])


class _Oracle:
    """One weight's Adam state and update, replayed in numpy."""

    def __init__(self, w: np.ndarray, alpha: float, beta: float, lam: float, eps: float, mode: int,
                 corrected: bool):
        self.dt = np.float64 if w.dtype == np.float64 else np.float32  # the compute type
        self.w = w.copy()
        self.m1 = np.zeros(w.shape, self.dt)
        self.m2 = np.zeros(w.shape, self.dt)
        self.t = 1
        self.alpha = float(np.float32(alpha)) if self.dt == np.float32 else alpha  # as the graph holds it
        self.beta = float(np.float32(beta)) if self.dt == np.float32 else beta
        self.lam, self.eps, self.mode, self.corrected = lam, eps, mode, corrected
        self.spec = (w.astype(np.float64), np.zeros(w.shape), np.zeros(w.shape))  # the spec's form, float64

    def _spec_step(self, g: np.ndarray, lr: float) -> None:
        """The spec's update as written (7.3), in float64 from the same inputs."""
        w, m1, m2 = self.spec
        g = g.astype(np.float64)
        m1 = self.alpha * m1 + (1 - self.alpha) * g
        m2 = self.beta * m2 + (1 - self.beta) * g * g
        c1 = _correction(self.alpha, self.t) if self.corrected else 1.0
        c2 = _correction(self.beta, self.t) if self.corrected else 1.0
        if self.mode == 0:
            w = w - lr * ((m1 / c1) / (np.sqrt(m2 / c2) + self.eps) + self.lam * w)
        else:
            u = lr * np.sqrt(c2) / c1 * m1 / (np.sqrt(m2) + self.eps)
            w = w - u - lr * self.lam * (w - u)
        self.spec = (w, m1, m2)

    def step(self, g: np.ndarray, lr32: np.float32) -> None:
        self._spec_step(g, float(lr32))
        dt = self.dt
        g = g.astype(dt)
        w = self.w.astype(dt)
        a, b = _f(self.alpha, dt), _f(self.beta, dt)
        self.m1 = self.m1 * a + g * _f(1 - self.alpha, dt)
        self.m2 = self.m2 * b + (g * _f(1 - self.beta, dt)) * g
        c1 = _f(_correction(self.alpha, self.t) if self.corrected else 1.0, dt)
        c2 = _f(_correction(self.beta, self.t) if self.corrected else 1.0, dt)
        lr = lr32.astype(dt)
        step = (lr * np.sqrt(c2)) / c1
        eps = np.sqrt(c2) * _f(self.eps, dt) if self.mode == 0 else _f(self.eps, dt)
        u = step * (self.m1 / (np.sqrt(self.m2) + eps))
        keep = _f(1.0, dt) - lr * _f(self.lam, dt) if self.lam else None
        if self.mode == 0:
            new = (w if keep is None else w * keep) - u
        else:
            new = w - u if keep is None else (w - u) * keep
        self.w = new.astype(self.w.dtype)
        self.t += 1


def _bits(a) -> tuple:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _loaded(i: int, name: str) -> int:
    return [0, 7, -3, 2**40, 1, 2][i % 6]


def _check(names: tuple[str, ...], dtype=np.float32, floats=None, ints=None, backend: str = "numpy",
           load=_loaded, steps: int = 6) -> None:
    floats, ints = floats or {}, ints or {}
    p = params("AdamOptimizer", enable_grad_norm_clip=False)
    p.optimizer_attributes_map = {n: dict(floats.get(n, {})) for n in names}
    p.optimizer_int_attributes_map = {n: dict(ints.get(n, {})) for n in names}
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", backend)
    model = _model(names, dtype)
    sess = onnxtrain.TrainingSession(model.SerializeToString(), p, so)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    oracles = {}
    for n in names:
        # a value given in the map is held as a float32 (TrainingParameters' maps), a default as it is
        f = {"alpha": 0.9, "beta": 0.999, "lambda": 0.0, "epsilon": 1e-8,
             **{k: float(np.float32(v)) for k, v in floats.get(n, {}).items()}}
        i = ints.get(n, {})
        oracles[n] = _Oracle(init[n], f["alpha"], f["beta"], f["lambda"], f["epsilon"],
                             i.get("weight_decay_mode", 0), bool(i.get("do_bias_correction", 1)))
    rng = np.random.default_rng(17)
    for k in range(steps):
        feeds = {f"x_{n}": rng.standard_normal(_SHAPES[n]).astype(dtype) for n in names}
        lr = np.array([0.05 * (1 + k % 3)], np.float32)
        loss = sess.run(["loss"], {**feeds, "Learning_Rate": lr})[0]
        want = None
        for n in names:  # the loss is of the weights before the step, summed in the graph's order
            term = np.sum(oracles[n].w * feeds[f"x_{n}"], dtype=dtype)
            want = term if want is None else want + term
            oracles[n].step(feeds[f"x_{n}"], lr[0])
        np.testing.assert_allclose(loss, want, rtol=1e-5)
        state = sess.get_state()
        for n, o in oracles.items():
            assert _bits(state[n]) == _bits(o.w), (k, n)
            assert _bits(state[f"Moment_1_{n}"]) == _bits(o.m1.astype(state[f"Moment_1_{n}"].dtype)), (k, n)
            assert _bits(state[f"Moment_2_{n}"]) == _bits(o.m2.astype(state[f"Moment_2_{n}"].dtype)), (k, n)
            assert _bits(state[f"Update_Count_{n}"]) == _bits(np.array([o.t], np.int64)), (k, n)
            tol = 1e-12 if o.dt == np.float64 else 2e-6
            np.testing.assert_allclose(state[n], o.spec[0], rtol=tol, atol=tol, err_msg=f"{k} {n}")
        if k == 2 and load is not None:  # counts that differ per weight, a zero and a negative one among them
            counts = {f"Update_Count_{n}": np.array([load(i, n)], np.int64) for i, n in enumerate(names)}
            sess.load_state(counts, strict=False)
            for n in names:
                oracles[n].t = int(counts[f"Update_Count_{n}"][0])


_ALL = tuple(_SHAPES)
_MIXED_FLOATS = {"W1": {"alpha": 0.8, "beta": 0.95, "lambda": 0.01}, "b1": {"lambda": 0.1, "epsilon": 1e-3},
                 "W2": {"alpha": 0.882, "beta": 0.991}, "s": {"lambda": 0.02, "epsilon": 1e-6}}
_MIXED_INTS = {"b1": {"do_bias_correction": 0, "weight_decay_mode": 1}, "W2": {"weight_decay_mode": 1},
               "s": {"do_bias_correction": 0}}


def test_defaults() -> None:
    _check(_ALL)


def test_mixed_corrections_modes_and_decay() -> None:
    _check(_ALL, floats=_MIXED_FLOATS, ints=_MIXED_INTS)


def test_mode_one_with_decay_everywhere() -> None:
    """The bench's setup: weight-decay mode 1 and λ for every weight."""
    _check(_ALL, floats={n: {"lambda": 0.01} for n in _ALL}, ints={n: {"weight_decay_mode": 1} for n in _ALL})


def test_no_correction_anywhere() -> None:
    _check(_ALL, floats=_MIXED_FLOATS, ints={n: {"do_bias_correction": 0, **_MIXED_INTS.get(n, {})}
                                              for n in _ALL})


@pytest.mark.parametrize("alpha,beta", [(0.882, 0.991), (0.9, 0.999)])
def test_one_weight(alpha: float, beta: float) -> None:
    """One weight (α = 0.882, β = 0.991: their float64 cubes as numpy's power, not as products)."""
    _check(("W1",), floats={"W1": {"alpha": alpha, "beta": beta}})


def test_float64_weights() -> None:
    _check(_ALL, dtype=np.float64, floats=_MIXED_FLOATS, ints=_MIXED_INTS)


def test_float64_one_weight() -> None:
    _check(("W2",), dtype=np.float64, floats={"W2": {"alpha": 0.882, "beta": 0.991}})


@pytest.mark.parametrize("case", ["mixed", "one"])
def test_onnxruntime_backend(case: str) -> None:
    pytest.importorskip("onnxruntime")
    if case == "mixed":
        _check(_ALL, floats=_MIXED_FLOATS, ints=_MIXED_INTS, backend="onnxruntime")
    else:
        _check(("W1",), floats={"W1": {"alpha": 0.882, "beta": 0.991}}, backend="onnxruntime")


def test_graph_is_valid() -> None:
    """The full step graph passes onnx's full check and holds only standard-domain nodes."""
    p = params("AdamOptimizer", enable_grad_norm_clip=False)
    p.optimizer_int_attributes_map = {n: dict(_MIXED_INTS.get(n, {})) for n in _ALL}
    p.optimizer_attributes_map = {n: dict(_MIXED_FLOATS.get(n, {})) for n in _ALL}
    sess = onnxtrain.TrainingSession(_model(_ALL, np.float32).SerializeToString(), p)
    g = sess._graphs.full
    onnx.checker.check_model(g, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in g.graph.node)
    consts = {a.t.data_type for n in g.graph.node for a in n.attribute if a.name == "value"}
    assert TensorProto.DOUBLE in consts  # (the corrections are computed in float64)
