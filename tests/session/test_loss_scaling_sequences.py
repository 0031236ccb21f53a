"""Sequences of mixed-precision steps of the legacy TrainingSession against a float64 numpy
reimplementation of onnxruntime-training's legacy semantics (legacy-training-session.md §4.3, §7.3, §8.4, §10;
onnxruntime's ``amp.loss_scaler.DynamicLossScaler``), driven the way its ORTTrainer drove a session: the scale
fed on every micro-step, the scaler updated after each optimizer run only, the learning rate a function of the
count of updates that applied (``optimization_step``, which a skipped update does not advance).

The reference decides an overflow from float64 values: a float16 value beyond ±65504 is inf (an input cast to
float16, a loss-scaled gradient of a half tensor); with bfloat16 only the float32 sum of squares of the global
norm can overflow. Each decision is checked to be far from the boundary, so that rounding cannot flip it.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import RunOptions, TrainingSession
from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
from onnxtrain.ir.builder import make_model
from tests.session.helpers import backend_options, params

GROUP = "Group_Accumulated_Gradients"
HALF_MAX = {"float16": 65504.0, "bfloat16": float(np.finfo(np.float32).max)}
F32_MAX = float(np.finfo(np.float32).max)
WEIGHTS = ["W1", "W2", "b"]


def tanh_model() -> onnx.ModelProto:
    """x[N,4] → MatMul W1 → Tanh → MatMul W2 → Add b → SoftmaxCrossEntropyLoss(y) (mean)."""
    rng = np.random.default_rng(5)
    inits = {"W1": rng.standard_normal((4, 6)) * 0.5, "W2": rng.standard_normal((6, 3)) * 0.5,
             "b": rng.standard_normal(3) * 0.1}
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]), helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["z"]), helper.make_node("Add", ["z", "b"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "tanh_mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 4]),
                                              helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, [])],
                          [numpy_helper.from_array(v.astype(np.float32), k) for k, v in inits.items()])
    return make_model(g, 17)


def batch(k: int, big: bool = False, n: int = 8, value: float = 1e5) -> dict[str, np.ndarray]:
    """Batch ``k``; ``big`` puts one feature at ``value``, by default 1e5, beyond float16's range (inf once
    cast)."""
    rng = np.random.default_rng(100 + k)
    x = rng.standard_normal((n, 4)).astype(np.float32)
    if big:
        x[2, 1] = value
    return {"x": x, "y": rng.integers(0, 3, n)}


# ------------------------------------------------------------------------------------------------ reference
class ScalerRef:
    """onnxruntime's DynamicLossScaler arithmetic, written out again."""

    def __init__(self, scale: float, window: int, lo: float, hi: float):
        self.scale, self.window, self.lo, self.hi, self.stable = scale, window, lo, hi, 0

    def update(self, finite: bool) -> None:
        if finite:
            self.stable += 1
            if self.stable >= self.window:
                self.scale, self.stable = min(self.hi, 2 * self.scale), 0
        else:
            self.scale, self.stable = max(self.lo, self.scale / 2), 0


class LegacyRef:
    """The legacy step in float64: fp32 accumulation buffers averaged over the micro-steps, the global norm of
    the loss-scaled gradients, the finite flag, Adam or SGD with the clipping divisor s of §10, and a skipped
    update that keeps weights, moments and Update_Count and resets the buffers."""

    def __init__(self, model: onnx.ModelProto, opt: str, dtype: str, micro: int = 1, clip: bool = True,
                 max_norm: float = 1.0):
        self.w = {t.name: numpy_helper.to_array(t).astype(np.float64) for t in model.graph.initializer}
        self.opt, self.dtype, self.micro, self.clip, self.max_norm = opt, dtype, micro, clip, max_norm
        self.m1 = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.m2 = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.count = dict.fromkeys(self.w, 1)
        self.buf = {k: np.zeros_like(v) for k, v in self.w.items()}
        self.overflowed = False  # a micro-step since the last update overflowed
        self.clipped = 0  # updates whose unscaled norm exceeded max_norm_clip
        self.margins: list[float] = []  # |log2(largest value / the type's limit)| of each decision

    def forward_backward(self, feed: dict, scale: float) -> tuple[float, dict, float]:
        """Loss, the loss-scaled gradients, and the largest value a half tensor of the step holds."""
        x, y = feed["x"].astype(np.float64), feed["y"]
        w = self.w
        h = x @ w["W1"]
        a = np.tanh(h)
        logits = a @ w["W2"] + w["b"]
        e = np.exp(logits - logits.max(1, keepdims=True))
        p = e / e.sum(1, keepdims=True)
        n = len(y)
        loss = float(-np.log(p[np.arange(n), y]).mean())
        d = p.copy()
        d[np.arange(n), y] -= 1
        d *= scale / n
        g = {"b": d.sum(0), "W2": a.T @ d}
        da = d @ w["W2"].T
        dh = da * (1 - a * a)
        g["W1"] = x.T @ dh
        half = [x, h, a, logits, d, da, dh, *g.values()]
        return loss, g, max(float(np.abs(v).max()) for v in half)

    def micro_step(self, feed: dict, scale: float) -> float:
        with np.errstate(invalid="ignore", over="ignore"):  # (an inf input: NaN, as the session's)
            loss, g, biggest = self.forward_backward(feed, scale)
        limit = HALF_MAX[self.dtype]
        over = biggest > limit
        self.margins.append(abs(np.log2(max(biggest, 1e-30) / limit)))
        self.overflowed |= over
        for k in g:
            self.buf[k] += g[k]
        return loss

    def update(self, lr: float, scale: float) -> tuple[bool, float]:
        """The optimizer run: returns (all_gradients_finite, global norm of the scaled gradients)."""
        g = {k: v / self.micro for k, v in self.buf.items()}
        self.buf = {k: np.zeros_like(v) for k, v in self.buf.items()}
        sq = sum(float((v * v).sum()) for v in g.values())
        norm = float(np.sqrt(sq))
        if not self.overflowed:  # the float32 sum of squares
            self.margins.append(abs(np.log2(sq / F32_MAX)))
        finite = not self.overflowed and sq <= F32_MAX
        self.overflowed = False
        if not finite:
            return False, norm
        clips = self.clip and self.opt != "SGDOptimizer" and norm > scale * self.max_norm
        s = norm / self.max_norm if clips else scale
        self.clipped += clips
        for k in self.w:
            gk = g[k] / s
            if self.opt == "SGDOptimizer":
                self.w[k] -= lr * gk
                continue
            a, b, t = float(np.float32(0.9)), float(np.float32(0.999)), self.count[k]
            self.m1[k] = a * self.m1[k] + (1 - a) * gk
            self.m2[k] = b * self.m2[k] + (1 - b) * gk * gk
            c1, c2 = 1 - a**t, 1 - b**t
            self.w[k] -= lr * (self.m1[k] / c1) / (np.sqrt(self.m2[k] / c2) + 1e-8)
            self.count[k] = t + 1
        return True, norm

    def state(self) -> dict[str, np.ndarray]:
        out = dict(self.w)
        if self.opt == "AdamOptimizer":
            for k in self.w:
                out[f"Moment_1_{k}"], out[f"Moment_2_{k}"] = self.m1[k], self.m2[k]
                out[f"Update_Count_{k}"] = np.array([self.count[k]])
        return out


def schedule(optimization_step: int) -> float:
    """A warm-up then decay, read at the count of applied updates (ORTTrainer's optimization_step)."""
    return 0.02 * min(1.0, (optimization_step + 1) / 3) / (1 + 0.2 * optimization_step)


def assert_state(sess: TrainingSession, ref: LegacyRef, dtype: str, where: str) -> None:
    got = sess.get_state()
    rtol, atol = (2e-2, 2e-3) if dtype == "float16" else (5e-2, 5e-3)
    for name, want in ref.state().items():
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(got[name], want, err_msg=f"{name} {where}")
        elif name.startswith("Moment_2"):  # squares of gradients: relative
            np.testing.assert_allclose(got[name], want, rtol=4 * rtol, atol=1e-9, err_msg=f"{name} {where}")
        else:
            np.testing.assert_allclose(got[name], want, rtol=rtol, atol=atol, err_msg=f"{name} {where}")


def make_session(opt: str, dtype: str, micro: int = 1, clip: bool = True, max_norm: float = 1.0,
                 backend: str = "numpy") -> TrainingSession:
    attrs = {w: {"max_norm_clip": max_norm} for w in WEIGHTS} if opt != "SGDOptimizer" else {}
    p = params(opt, use_mixed_precision=True, mixed_precision_dtype=dtype, gradient_accumulation_steps=micro,
               enable_grad_norm_clip=clip, optimizer_attributes_map=attrs)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingSession(tanh_model().SerializeToString(), p, backend_options(backend))


class Driver:
    """ORTTrainer's train_step over one or more sessions kept in lockstep, with the reference beside them."""

    def __init__(self, sessions: list[TrainingSession], ref: LegacyRef, scaler: DynamicLossScaler,
                 sref: ScalerRef, dtype: str):
        self.sessions, self.ref, self.scaler, self.sref, self.dtype = sessions, ref, scaler, sref, dtype
        self.optimization_step = 0
        self.micro_done = 0
        self.flags: list[bool] = []
        self.scales: list[float] = []

    def step(self, feed: dict) -> None:
        ref, micro = self.ref, self.ref.micro
        scale = self.scaler.loss_scale
        assert scale == self.sref.scale and self.scaler.stable_steps == self.sref.stable
        lr = schedule(self.optimization_step)
        want_loss = ref.micro_step(feed, scale)
        feeds = {**feed, self.sessions[0].loss_scale_input_name: np.array([scale], np.float32)}
        self.micro_done += 1
        if self.micro_done % micro:
            ro = RunOptions()
            ro.only_execute_path_to_fetches = True
            for s in self.sessions:
                loss, _ = s.run(["loss", GROUP], feeds, ro)
                if np.isfinite(want_loss) and not ref.overflowed:
                    np.testing.assert_allclose(loss, want_loss, rtol=2e-2)
            return
        feeds["Learning_Rate"] = np.array([lr], np.float32)
        outs = [s.run(["loss", "all_gradients_finite", "global_gradient_norm"], feeds) for s in self.sessions]
        overflowed = ref.overflowed
        finite, norm = ref.update(lr, scale)
        where = f"update {len(self.flags)} (scale {scale:g})"
        for loss, flag, got_norm in outs:
            assert bool(np.asarray(flag).reshape(-1)[0]) == finite, where
            if finite:
                np.testing.assert_allclose(got_norm, norm, rtol=2e-2, err_msg=where)
            if not overflowed:
                np.testing.assert_allclose(loss, want_loss, rtol=2e-2, err_msg=where)
        for s in self.sessions:
            assert_state(s, ref, self.dtype, where)
        self.scaler.update_loss_scale(finite)
        self.sref.update(finite)
        self.flags.append(finite)
        self.scales.append(scale)
        if finite:
            self.optimization_step += 1
        # float16 rounding moves these values by about 0.1 %: a decision 2 % from the limit cannot flip
        assert min(ref.margins) > np.log2(1.02), f"an overflow decision within 2 % of the limit: {where}"


# ------------------------------------------------------------------------------------------------ tests
@pytest.mark.filterwarnings("ignore:DynamicLossScaler. a step was not finite at the smallest")
@pytest.mark.parametrize("opt", ["AdamOptimizer", "SGDOptimizer"])
def test_dynamic_scale_with_forced_overflows_and_bounds(opt: str) -> None:
    """float16, one micro-step: batches with a value beyond float16's range at chosen updates, the scale
    growing after each window of 2 clean updates up to its maximum and backing off to its minimum; each
    update's flag, norm, weights, moments, Update_Count and the scaler's state as the reference's, the
    learning rate following the applied updates only."""
    forced = {6, 9, 10, 11, 12, 13, 14}
    sess = make_session(opt, "float16", max_norm=0.5)
    ref = LegacyRef(tanh_model(), opt, "float16", max_norm=0.5)
    kw = {"loss_scale": 2.0**8, "up_scale_window": 2, "min_loss_scale": 2.0**5, "max_loss_scale": 2.0**10}
    d = Driver([sess], ref, DynamicLossScaler(**kw), ScalerRef(2.0**8, 2, 2.0**5, 2.0**10), "float16")
    for k in range(16):
        d.step(batch(k, big=k in forced))
    assert d.flags == [k not in forced for k in range(16)]
    assert max(d.scales) == 2.0**10 and min(d.scales) == 2.0**5  # both bounds reached and held
    assert d.scales[4:6] == [2.0**10] * 2 and d.scales[14] == 2.0**5
    assert d.optimization_step == 9


def test_scale_overflow_backs_off_until_finite() -> None:
    """Adam, float16, a starting scale far too high: the scaled gradients overflow (not the data), the scale
    halves each update until they fit, then the updates apply and Adam's bias correction starts at step 1."""
    sess = make_session("AdamOptimizer", "float16")
    ref = LegacyRef(tanh_model(), "AdamOptimizer", "float16")
    d = Driver([sess], ref, DynamicLossScaler(loss_scale=2.0**30, up_scale_window=50),
               ScalerRef(2.0**30, 50, 1.0, 2.0**24), "float16")
    for k in range(20):
        d.step(batch(k))
    skipped = d.flags.index(True)
    assert 5 <= skipped < 17 and all(d.flags[skipped:]) and not any(d.flags[:skipped])


@pytest.mark.parametrize("clip", [True, False])
def test_accumulation_with_an_overflowing_micro_batch(clip: bool) -> None:
    """Adam, float16, 3 micro-steps per update: one overflowing micro-batch skips its update (its buffers are
    dropped, the next update starts clean), with and without clipping (a small max_norm_clip: the clipped
    norm is of the unscaled gradients)."""
    sess = make_session("AdamOptimizer", "float16", micro=3, clip=clip, max_norm=0.4)
    ref = LegacyRef(tanh_model(), "AdamOptimizer", "float16", micro=3, clip=clip, max_norm=0.4)
    d = Driver([sess], ref, DynamicLossScaler(loss_scale=2.0**9, up_scale_window=2, max_loss_scale=2.0**10),
               ScalerRef(2.0**9, 2, 1.0, 2.0**10), "float16")
    for k in range(24):
        d.step(batch(k, big=k in (4, 15)))  # the 2nd micro-step of update 1, the 1st of update 5
    assert d.flags == [True, False, True, True, True, False, True, True]
    assert not clip or 0 < ref.clipped < 6  # some updates clipped, some not


def test_bfloat16_keeps_what_float16_skips() -> None:
    """bfloat16 has float32's range: the batches that overflow float16 train; only a scale whose gradients'
    squares overflow the float32 norm skips an update."""
    sess = make_session("AdamOptimizer", "bfloat16", max_norm=0.5)
    ref = LegacyRef(tanh_model(), "AdamOptimizer", "bfloat16", max_norm=0.5)
    scaler = DynamicLossScaler(loss_scale=2.0**8, up_scale_window=2, max_loss_scale=2.0**10)
    d = Driver([sess], ref, scaler, ScalerRef(2.0**8, 2, 1.0, 2.0**10), "bfloat16")
    for k in range(8):
        if k == 4:  # a scale of 2^100: gradients near 1e29, whose squares overflow float32
            scaler.loss_scale = d.sref.scale = 2.0**100
        if k == 5:  # (its half, 2^99, would overflow too)
            scaler.loss_scale = d.sref.scale = 2.0**6
        d.step(batch(k, big=k in (1, 2)))
    assert d.flags == [True] * 4 + [False] + [True] * 3


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_state_round_trips_mid_sequence(backend: str, tmp_path) -> None:
    """After a skipped update, the session's state goes through get_state → load_state into a second session
    and through a checkpoint file into a third, and the scaler's state (scale, clean steps) through the
    checkpoint's properties; the three continue in lockstep with the reference. (On the onnxruntime backend,
    whose casts to float16 before its float32 products vanish, the overflowing value is an inf.)"""
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, session_to_checkpoint

    value = 1e5 if backend == "numpy" else np.inf
    sess = make_session("AdamOptimizer", "float16", micro=2, max_norm=0.5, backend=backend)
    ref = LegacyRef(tanh_model(), "AdamOptimizer", "float16", micro=2, max_norm=0.5)
    scaler = DynamicLossScaler(loss_scale=2.0**9, up_scale_window=2, max_loss_scale=2.0**10)
    d = Driver([sess], ref, scaler, ScalerRef(2.0**9, 2, 1.0, 2.0**10), "float16")
    for k in range(6):
        d.step(batch(k, big=k == 5, value=value))
    assert d.flags == [True, True, False]
    s2 = make_session("AdamOptimizer", "float16", micro=2, max_norm=0.5, backend=backend)
    s2.load_state(sess.get_state(), strict=True)
    props = {"loss_scale": scaler.loss_scale, "loss_scale_stable_steps": scaler.stable_steps}
    save_checkpoint(session_to_checkpoint(sess, tanh_model(), 0.02, 3, props), tmp_path / "c.ckpt")
    ckpt = load_checkpoint(tmp_path / "c.ckpt")
    s3 = make_session("AdamOptimizer", "float16", micro=2, max_norm=0.5, backend=backend)
    s3.load_state(checkpoint_to_state(ckpt, s3), strict=True)
    resumed = DynamicLossScaler(loss_scale=2.0**9, up_scale_window=2, max_loss_scale=2.0**10)
    resumed.loss_scale = float(ckpt.properties["loss_scale"])
    resumed.stable_steps = int(ckpt.properties["loss_scale_stable_steps"])
    assert (resumed.loss_scale, resumed.stable_steps) == (scaler.loss_scale, scaler.stable_steps)
    d.sessions += [s2, s3]
    for k in range(6, 16):
        d.step(batch(k, big=k == 10, value=value))
    assert d.flags[3:] == [True, True, False, True, True]


def test_onnxruntime_backend_follows_the_sequence() -> None:
    """The same forced-overflow sequence on the onnxruntime backend, whose float16 products are float32: the
    overflow here comes from a scale so large that the float32 norm's squares overflow."""
    sess = make_session("AdamOptimizer", "float16", max_norm=0.5, backend="onnxruntime")
    ref = LegacyRef(tanh_model(), "AdamOptimizer", "bfloat16", max_norm=0.5)  # float32 range for the flag
    scaler = DynamicLossScaler(loss_scale=2.0**8, up_scale_window=2, max_loss_scale=2.0**10)
    d = Driver([sess], ref, scaler, ScalerRef(2.0**8, 2, 1.0, 2.0**10), "float16")
    for k in range(8):
        if k == 3:
            scaler.loss_scale = d.sref.scale = 2.0**100
        if k == 4:
            scaler.loss_scale = d.sref.scale = 2.0**6
        d.step(batch(k))
    assert d.flags == [True] * 3 + [False] + [True] * 4


@pytest.mark.parametrize("micro", [1, 3])
@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer", "SGDOptimizer"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_step_graphs_are_valid_onnx_and_run_in_onnxruntime(dtype: str, opt: str, micro: int) -> None:
    """Every graph the mixed-precision session builds (forward, transformed, gradient, accumulate, full step)
    passes onnx.checker's full check; under float16 the step graphs run in plain onnxruntime with the outputs
    of our engine (bfloat16: onnxruntime's CPU package has no kernels for it)."""
    ort = pytest.importorskip("onnxruntime")
    from onnxtrain.engine import compile_model

    sess = make_session(opt, dtype, micro=micro, max_norm=0.5)
    graphs = sess._graphs
    for name in ("forward", "transformed", "gradient", "accumulate", "full"):
        g = getattr(graphs, name)
        if g is not None:
            onnx.checker.check_model(g, full_check=True)
    if dtype != "float16":
        return
    state = sess.get_state()
    feeds = {**batch(0), "Learning_Rate": np.array([0.01], np.float32),
             sess.loss_scale_input_name: np.array([2.0**8], np.float32)}
    for g in (graphs.full, graphs.accumulate):
        if g is None:
            continue
        run = ort.InferenceSession(g.SerializeToString(), providers=["CPUExecutionProvider"])
        f = {}
        for i in run.get_inputs():
            if i.name in feeds:
                f[i.name] = feeds[i.name]
            elif i.name in state:
                f[i.name] = state[i.name]
            else:  # an accumulation buffer: a micro-step's gradients already in it
                w = i.name.removesuffix("_grad_accumulate_buffer")
                f[i.name] = np.full_like(state[w], 0.25)
        names = [o.name for o in run.get_outputs()]
        want = run.run(names, f)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            got = compile_model(g).run(dict(f), names)
        for n, a, b in zip(names, got, want):
            a, b = np.asarray(a), np.asarray(b)
            assert a.dtype == b.dtype and a.shape == b.shape, n
            if a.dtype.kind in "biu":
                np.testing.assert_array_equal(a, b, err_msg=n)
            else:  # float16 against onnxruntime's float32 products: an error relative to the tensor's scale
                b = b.astype(np.float64)
                tol = 1e-2 * max(1.0, float(np.abs(b).max())) if b.size else 0.0
                np.testing.assert_allclose(a.astype(np.float64), b, rtol=1e-2, atol=tol, err_msg=n)


def test_onnxruntime_backend_warns_that_half_inputs_do_not_overflow(monkeypatch) -> None:
    """onnxruntime's CPU provider drops the cast of a float32 input to float16 in front of its float32
    products, so an input beyond ±65504 trains there (the numpy engine, as a GPU, sees inf and skips the
    update): the backend's warning says so, beside the loss scale that cannot overflow."""
    from onnxtrain.engine import backends

    monkeypatch.setattr(backends, "_warned_float16", [])
    p = params("AdamOptimizer", use_mixed_precision=True)
    with pytest.warns(UserWarning, match="no float16 MatMul") as seen:
        ort_sess = TrainingSession(tanh_model().SerializeToString(), p, backend_options("onnxruntime"))
    text = " ".join(str(w.message) for w in seen)
    assert "input" in text and "65504" in text, text
    feeds = {**batch(0, big=True), "Learning_Rate": np.array([0.01], np.float32),
             ort_sess.loss_scale_input_name: np.array([1.0], np.float32)}
    numpy_sess = make_session("AdamOptimizer", "float16")
    (on_ort,) = ort_sess.run(["all_gradients_finite"], feeds)
    (on_numpy,) = numpy_sess.run(["all_gradients_finite"], feeds)
    assert bool(on_ort[0]) and not bool(on_numpy[0])


def test_static_scaler_reset_restores_its_initial_scale() -> None:
    """``LossScaler.reset()`` puts back the scale it was made with, as onnxruntime-training 1.19.2's base
    ``LossScaler.reset`` does (it kept a scale set since)."""
    import json
    import types

    from onnxtrain.graph_transforms.loss_scaler import LossScaler
    from tests.ortt import run_script

    script = (
        "import json, sys, types\n"
        "sys.modules['onnxruntime.training.optim'] = types.ModuleType('onnxruntime.training.optim')\n"
        "from onnxruntime.training import amp\n"
        "s = amp.LossScaler(8.0)\n"
        "s.loss_scale = 32.0\n"
        "s.reset()\n"
        "d = amp.DynamicLossScaler(loss_scale=8.0, up_scale_window=1)\n"
        "d.update(types.SimpleNamespace(all_finite=True))\n"
        "d.loss_scale = 2.0\n"
        "d.reset()\n"
        "print(json.dumps([s.loss_scale, d.loss_scale]))\n"
    )
    want = run_script(script)
    s = LossScaler(8.0)
    s.loss_scale = 32.0
    s.reset()
    d = DynamicLossScaler(loss_scale=8.0, up_scale_window=1)
    d.update(types.SimpleNamespace(all_finite=True))
    d.loss_scale = 2.0
    d.reset()
    assert [s.loss_scale, d.loss_scale] == want == json.loads("[8.0, 8.0]")
