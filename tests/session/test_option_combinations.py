"""The legacy TrainingSession's options in pairs and triples, step for step against a torch reimplementation
of onnxruntime-training's documented semantics (../shared/spec/legacy-training-session.md §4.3, §7, §8, §10):
optimizer and its attributes × gradient accumulation × clipping × mixed precision × learning rate changed
between steps × frozen weights × gradient outputs × recompute × state round trips × evaluation runs.

The oracle computes the gradients with torch autograd in float64 and applies the spec's update formulas;
weights, moments, step counts and losses are compared after several steps.
"""

from __future__ import annotations

import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto as T
from onnx import helper, numpy_helper

from onnxtrain import RunOptions, TrainingParameters, TrainingSession
from onnxtrain.ir.builder import make_model
from tests.session.helpers import params
from tests.tiers import covering

torch = pytest.importorskip("torch")

GROUP = "Group_Accumulated_Gradients"
HALF_MAX = 65504.0


# ---------------------------------------------------------------------------------------------- models
def _f32(rng: np.random.Generator, shape: tuple[int, ...], scale: float) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


def mlp_model() -> onnx.ModelProto:
    """x[N,6] → MatMul W1 (no bias) → Tanh → Gemm W2, b2 → SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(10)
    inits = [numpy_helper.from_array(_f32(rng, (6, 8), 0.5), "W1"),
             numpy_helper.from_array(_f32(rng, (5, 8), 0.5), "W2"),
             numpy_helper.from_array(_f32(rng, (5,), 0.1), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 6]),
                                         helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 5])], inits)
    return make_model(g, 20)


def ln_model() -> onnx.ModelProto:
    """x[N,6] → Gemm W1, b1 → LayerNormalization(g, be) → Gelu → MatMul W2 → mean squared error to y."""
    rng = np.random.default_rng(11)
    inits = [numpy_helper.from_array(_f32(rng, (8, 6), 0.5), "W1"),
             numpy_helper.from_array(_f32(rng, (8,), 0.1), "b1"),
             numpy_helper.from_array((1 + _f32(rng, (8,), 0.1)).astype(np.float32), "g"),
             numpy_helper.from_array(_f32(rng, (8,), 0.1), "be"),
             numpy_helper.from_array(_f32(rng, (8, 4), 0.5), "W2")]
    nodes = [helper.make_node("Gemm", ["x", "W1", "b1"], ["h"], transB=1),
             helper.make_node("LayerNormalization", ["h", "g", "be"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["n"], ["a"]),
             helper.make_node("MatMul", ["a", "W2"], ["out"]),
             helper.make_node("Sub", ["out", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 6]),
                                        helper.make_tensor_value_info("y", T.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("out", T.FLOAT, ["N", 4])], inits)
    return make_model(g, 20)


def emb_model() -> onnx.ModelProto:
    """ids[N,3] → Gather E → ReduceMean over the sequence → Gemm W, b → SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(12)
    inits = [numpy_helper.from_array(_f32(rng, (10, 6), 0.5), "E"),
             numpy_helper.from_array(_f32(rng, (4, 6), 0.5), "W"),
             numpy_helper.from_array(_f32(rng, (4,), 0.1), "b"),
             numpy_helper.from_array(np.array([1], np.int64), "axes")]
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"]),
             helper.make_node("ReduceMean", ["e", "axes"], ["m"], keepdims=0),
             helper.make_node("Gemm", ["m", "W", "b"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "emb", [helper.make_tensor_value_info("ids", T.INT64, ["N", 3]),
                                         helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 4])], inits)
    return make_model(g, 20)


def bn_model() -> onnx.ModelProto:
    """x[N,6] → MatMul W1 (no bias) → BatchNormalization(s, bb; running rm, rv) → Relu → Gemm W2, b2 →
    SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(13)
    inits = [numpy_helper.from_array(_f32(rng, (6, 8), 0.5), "W1"),
             numpy_helper.from_array((1 + _f32(rng, (8,), 0.1)).astype(np.float32), "s"),
             numpy_helper.from_array(_f32(rng, (8,), 0.1), "bb"),
             numpy_helper.from_array(_f32(rng, (8,), 0.1), "rm"),
             numpy_helper.from_array((1 + np.abs(_f32(rng, (8,), 0.1))).astype(np.float32), "rv"),
             numpy_helper.from_array(_f32(rng, (5, 8), 0.5), "W2"),
             numpy_helper.from_array(_f32(rng, (5,), 0.1), "b2")]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h"]),
             helper.make_node("BatchNormalization", ["h", "s", "bb", "rm", "rv"], ["n"], momentum=0.9,
                              epsilon=1e-5),
             helper.make_node("Relu", ["n"], ["a"]),
             helper.make_node("Gemm", ["a", "W2", "b2"], ["logits"], transB=1),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 6]),
                                        helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 5])], inits)
    return make_model(g, 17)


def torch_loss(kind: str, p: dict, feed: dict):
    """The model's loss in torch (float64), from parameters ``p`` and the session's ``feed``; the BatchNorm
    model's forward runs in training mode and moves the running statistics held in ``p`` (ONNX's momentum
    0.9, the biased batch variance)."""
    F = torch.nn.functional
    if kind == "bn":
        x, y = torch.from_numpy(feed["x"]).double(), torch.from_numpy(feed["y"])
        h = x @ p["W1"]
        mean, var = h.mean(0), h.var(0, unbiased=False)
        with torch.no_grad():
            p["rm"].mul_(0.9).add_(0.1 * mean)
            p["rv"].mul_(0.9).add_(0.1 * var)
        n = (h - mean) / torch.sqrt(var + 1e-5) * p["s"] + p["bb"]
        return F.cross_entropy(torch.relu(n) @ p["W2"].T + p["b2"], y)
    if kind == "mlp":
        x, y = torch.from_numpy(feed["x"]).double(), torch.from_numpy(feed["y"])
        return F.cross_entropy(torch.tanh(x @ p["W1"]) @ p["W2"].T + p["b2"], y)
    if kind == "ln":
        x, y = torch.from_numpy(feed["x"]).double(), torch.from_numpy(feed["y"]).double()
        n = F.layer_norm(x @ p["W1"].T + p["b1"], (8,), p["g"], p["be"], eps=1e-5)
        return ((F.gelu(n) @ p["W2"] - y) ** 2).mean()
    ids, y = torch.from_numpy(feed["ids"]), torch.from_numpy(feed["y"])
    return F.cross_entropy(p["E"][ids].mean(1) @ p["W"].T + p["b"], y)


MODELS = {"mlp": mlp_model, "ln": ln_model, "emb": emb_model, "bn": bn_model}


def batches(kind: str, n: int, size: int = 6, seed: int = 3) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        if kind in ("mlp", "bn"):
            out.append({"x": rng.standard_normal((size, 6)).astype(np.float32),
                        "y": rng.integers(0, 5, size)})
        elif kind == "ln":
            out.append({"x": rng.standard_normal((size, 6)).astype(np.float32),
                        "y": rng.standard_normal((size, 4)).astype(np.float32)})
        else:  # repeated ids in a batch: the embedding's gradient sums them
            out.append({"ids": rng.integers(0, 7, (size, 3)), "y": rng.integers(0, 4, size)})
    return out


# ---------------------------------------------------------------------------------------------- oracle
class Reference:
    """onnxruntime-training's legacy step in torch float64: accumulation (mean of the micro-steps), global
    norm in the loss-scaled domain, clipping divisor s (§10), SGD / Adam / Lamb (§7), skipped update when the
    scaled gradients are not finite (§8.4, buffers reset)."""

    def __init__(self, kind: str, model: onnx.ModelProto, opt: str, trained: list[str], steps: int = 1,
                 clip: bool = True, fattrs: dict | None = None, iattrs: dict | None = None,
                 cpu_adam: bool = False, fp16_moments: bool = False):
        self.fp16_moments = fp16_moments
        self.kind, self.opt, self.trained, self.steps, self.clip = kind, opt, sorted(trained), steps, clip
        self.cpu_adam = cpu_adam
        self.p = {t.name: torch.tensor(numpy_helper.to_array(t).astype(np.float64),
                                       requires_grad=t.name in trained)
                  for t in model.graph.initializer if t.data_type == T.FLOAT}
        self.fattrs, self.iattrs = fattrs or {}, iattrs or {}
        self.m1 = {w: torch.zeros_like(self.p[w]) for w in self.trained}
        self.m2 = {w: torch.zeros_like(self.p[w]) for w in self.trained}
        self.count = {w: 1 for w in self.trained}  # Adam's Update_Count, per weight
        self.step_count = 1  # Lamb's shared Step
        self.buf = {w: torch.zeros_like(self.p[w]) for w in self.trained}
        self.micro = 0

    def grads(self, feed: dict, scale: float = 1.0) -> tuple[float, dict]:
        loss = torch_loss(self.kind, self.p, feed)
        gs = torch.autograd.grad(loss * scale, [self.p[w] for w in self.trained])
        return float(loss.detach()), dict(zip(self.trained, gs))

    def accumulate(self, feed: dict, scale: float = 1.0) -> float:
        loss, g = self.grads(feed, scale)
        for w in self.trained:
            self.buf[w] += g[w]
        self.micro += 1
        return loss

    def attr(self, w: str, key: str, default: float) -> float:
        return float(self.fattrs.get(w, {}).get(key, default))

    def update(self, lr: float, scale: float = 1.0, finite: bool = True) -> dict:
        """The optimizer step on the accumulated (scaled) gradients; returns the global norm and flag."""
        g = {w: self.buf[w] / self.steps for w in self.trained}
        norm = float(torch.sqrt(sum((v * v).sum() for v in g.values())))
        self.buf = {w: torch.zeros_like(v) for w, v in self.buf.items()}
        self.micro = 0
        if not finite:
            return {"norm": norm, "finite": False}
        cpu_adam = self.cpu_adam and self.opt == "AdamOptimizer"  # (onnxruntime's CPU kernel did not clip)
        uses_norm = self.opt != "SGDOptimizer" and self.clip and not cpu_adam
        with torch.no_grad():
            if self.opt == "LambOptimizer":
                self._lamb(g, lr, scale, norm, uses_norm)
            for w in self.trained:
                mnc = self.attr(w, "max_norm_clip", 1.0)
                s = norm / mnc if uses_norm and norm > scale * mnc else scale
                gw = g[w] / s
                if self.opt == "SGDOptimizer":
                    self.p[w] -= lr * gw
                elif self.opt == "AdamOptimizer":
                    self._adam(w, gw, lr)
        return {"norm": norm, "finite": True}

    def _adam(self, w: str, g, lr: float) -> None:
        a = float(np.float32(self.attr(w, "alpha", 0.9)))
        b = float(np.float32(self.attr(w, "beta", 0.999)))
        lam, eps = self.attr(w, "lambda", 0.0), self.attr(w, "epsilon", 1e-8)
        bias = int(self.iattrs.get(w, {}).get("do_bias_correction", 1))
        mode = int(self.iattrs.get(w, {}).get("weight_decay_mode", 0))
        t = self.count[w]
        self.m1[w] = a * self.m1[w] + (1 - a) * g
        self.m2[w] = b * self.m2[w] + (1 - b) * g * g
        c1, c2 = (1 - a**t, 1 - b**t) if bias and t > 0 else (1.0, 1.0)
        p = self.p[w]
        if mode == 0:
            p -= lr * ((self.m1[w] / c1) / (torch.sqrt(self.m2[w] / c2) + eps) + lam * p)
        else:
            u = lr * np.sqrt(c2) / c1 * self.m1[w] / (torch.sqrt(self.m2[w]) + eps)
            p -= u + lr * lam * (p - u)
        self.count[w] = t + 1
        self._store_moments(w)

    def _store_moments(self, w: str) -> None:
        """use_fp16_moments: the new moments rounded to float16 as stored (spec §8.5); a second moment at
        least float16's smallest subnormal (onnxtrain's documented floor)."""
        if self.fp16_moments:
            half = torch.float16
            self.m1[w] = self.m1[w].to(half).double()
            tiny = float(np.finfo(np.float16).smallest_subnormal)
            self.m2[w] = torch.clamp(self.m2[w], min=tiny).to(half).double()

    def _lamb(self, g: dict, lr: float, scale: float, norm: float, uses_norm: bool) -> None:
        first = self.trained[0]
        bias = int(self.iattrs.get(first, {}).get("do_bias_correction", 0))
        rmin = self.attr(first, "ratio_min", -np.inf)
        rmax = self.attr(first, "ratio_max", np.inf)
        t = self.step_count
        for w in self.trained:
            mnc = self.attr(w, "max_norm_clip", 1.0)
            s = norm / mnc if uses_norm and norm > scale * mnc else scale
            gw = g[w] / s
            a = float(np.float32(self.attr(w, "alpha", 0.9)))
            b = float(np.float32(self.attr(w, "beta", 0.999)))
            lam, eps = self.attr(w, "lambda", 0.0), self.attr(w, "epsilon", 1e-6)
            m1 = a * self.m1[w] + (1 - a) * gw
            m2 = b * self.m2[w] + (1 - b) * gw * gw
            c1, c2 = (1 - a**t, 1 - b**t) if bias and t > 0 else (1.0, 1.0)
            d = lam * self.p[w] + (m1 / c1) / (torch.sqrt(m2 / c2) + eps)
            wn, dn = float(self.p[w].norm()), float(d.norm())
            eta = lr * max(rmin, min(rmax, wn / dn)) if wn > 0 and dn > 0 else lr
            self.p[w] -= eta * d
            self.m1[w], self.m2[w] = m1, m2
            self._store_moments(w)
        self.step_count = t + 1

    # what the session's get_state() holds
    def state(self) -> dict[str, np.ndarray]:
        out = {w: self.p[w].detach().numpy() for w in self.trained}
        if self.kind == "bn":  # the running statistics
            out.update(rm=self.p["rm"].detach().numpy(), rv=self.p["rv"].detach().numpy())
        if self.opt != "SGDOptimizer":
            for w in self.trained:
                out[f"Moment_1_{w}"] = self.m1[w].numpy()
                out[f"Moment_2_{w}"] = self.m2[w].numpy()
                if self.opt == "AdamOptimizer":
                    out[f"Update_Count_{w}"] = np.array([self.count[w]])
            if self.opt == "LambOptimizer":
                out["Step"] = np.array([self.step_count])
        return out


def trained_of(model: onnx.ModelProto) -> list[str]:
    """The float initializers the session trains by default: all but BatchNormalization running statistics."""
    stats = {n.input[i] for n in model.graph.node if n.op_type == "BatchNormalization" for i in (3, 4)}
    return sorted(t.name for t in model.graph.initializer if t.data_type == T.FLOAT and t.name not in stats)


def lr_of(step: int) -> np.ndarray:
    """A learning rate that changes every step (fed through Learning_Rate)."""
    return np.array([0.05 / (1 + step)], np.float32)


def assert_state(sess: TrainingSession, ref: Reference, rtol: float = 1e-4, atol: float = 1e-5,
                 skip: tuple[str, ...] = ()) -> None:
    got = sess.get_state()
    want = ref.state()
    for name, v in want.items():
        if name in skip:
            continue
        assert name in got, f"{name} missing from get_state(): {sorted(got)}"
        if v.dtype.kind == "i":
            np.testing.assert_array_equal(got[name], v, err_msg=name)
        else:
            np.testing.assert_allclose(got[name].astype(np.float64), v, rtol=rtol, atol=atol, err_msg=name)


def session(model: onnx.ModelProto, p: TrainingParameters, backend: str = "numpy") -> TrainingSession:
    """A session of ``model`` on ``backend`` (the onnxruntime backend runs a step as two graphs and its Adam
    and SGD updates over flat buffers), its setup warnings silenced."""
    from tests.session.helpers import backend_options

    return quiet(TrainingSession, model.SerializeToString(), p, backend_options(backend))


def quiet(fn, *a, **k):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*a, **k)


# ---------------------------------------------------------------------------------------------- tests
BACKENDS = ["numpy", "onnxruntime"]

OPT_CASES = [
    ("SGDOptimizer", {}, {}),
    ("AdamOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05}, {"weight_decay_mode": 0}),
    ("AdamOptimizer", {"lambda": 0.02, "alpha": 0.8, "max_norm_clip": 0.05}, {"weight_decay_mode": 1}),
    ("AdamOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05},
     {"do_bias_correction": 0, "weight_decay_mode": 1}),
    ("LambOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05, "ratio_max": 5.0}, {"do_bias_correction": 1}),
    ("LambOptimizer", {"epsilon": 1e-4}, {}),
]


def _maps(trained: list[str], f: dict, i: dict) -> dict:
    return {"optimizer_attributes_map": {w: dict(f) for w in trained},
            "optimizer_int_attributes_map": {w: dict(i) for w in trained}}


# (the session counts auto mode's micro-steps alike on both backends; by default every pair of an optimizer
# case, a model and a backend/mode runs, tests/tiers.py)
@pytest.mark.parametrize("backend,mode,opt,f,i,kind", covering(
    [("numpy", "legacy"), ("numpy", "auto"), ("onnxruntime", "legacy")], OPT_CASES,
    ["mlp", "bn", "ln", "emb"]))
def test_accumulation_clipping_lr_schedule(backend, kind, opt, f, i, mode):
    """Optimizer attributes × 3 accumulation steps (legacy protocol and auto) × clipping (a small
    max_norm_clip, so it clips) × a learning rate changed every update."""
    model = MODELS[kind]()
    trained = trained_of(model)
    sess = session(model,
                   params(opt, gradient_accumulation_steps=3, gradient_accumulation_mode=mode,
                          **_maps(trained, f, i)), backend)
    ref = Reference(kind, model, opt, trained, steps=3, fattrs={w: f for w in trained},
                    iattrs={w: i for w in trained})
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for k, feed in enumerate(batches(kind, 12)):
        want_loss = ref.accumulate(feed)
        last = (k + 1) % 3 == 0
        if mode == "legacy" and not last:
            loss, _ = sess.run(["loss", GROUP], feed, ro)
        else:
            loss, = sess.run(["loss"], {**feed, "Learning_Rate": lr_of(k // 3)})
        np.testing.assert_allclose(loss, want_loss, rtol=1e-5, atol=1e-6)
        if last:
            ref.update(float(lr_of(k // 3)[0]))
            assert_state(sess, ref)


def _mp_step_loop(kind, opt, f, i, steps, clip, scales, backend, lr_scale=1.0):
    """Train under float16 mixed precision with the loss scales ``scales`` (one per micro-step; a scale of
    1e30 overflows float16), against the reference; returns (session, reference, model)."""
    model = MODELS[kind]()
    trained = trained_of(model)
    sess = session(model,
                   params(opt, use_mixed_precision=True, gradient_accumulation_steps=steps,
                          enable_grad_norm_clip=clip, **_maps(trained, f, i)), backend)
    ref = Reference(kind, model, opt, trained, steps=steps, clip=clip, fattrs={w: f for w in trained},
                    iattrs={w: i for w in trained})
    ls = sess.loss_scale_input_name
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    overflow = False
    for k, (feed, scale) in enumerate(zip(batches(kind, len(scales)), scales)):
        big = scale > 1e20
        overflow |= big
        want_loss = ref.accumulate(feed, 0.0 if big else scale)
        feed = {**feed, ls: np.array([scale], np.float32)}
        if (k + 1) % steps:
            loss, _ = sess.run(["loss", GROUP], feed, ro)
        else:
            lr = lr_of(k // steps) * np.float32(lr_scale)
            loss, finite, norm = sess.run(["loss", "all_gradients_finite", "global_gradient_norm"],
                                          {**feed, "Learning_Rate": lr})
            got = ref.update(float(lr[0]), scale, finite=not overflow)
            assert bool(finite[0]) == (not overflow), k
            if not overflow:
                np.testing.assert_allclose(norm, got["norm"], rtol=2e-2)
            overflow = False
        np.testing.assert_allclose(loss, want_loss, rtol=2e-2, atol=2e-3)
    return sess, ref, model


MP_OPT_CASES = [
    ("SGDOptimizer", {}, {}),
    ("AdamOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05}, {"weight_decay_mode": 1}),
    ("AdamOptimizer", {}, {"weight_decay_mode": 0}),
    ("LambOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05}, {"do_bias_correction": 1}),
]


@pytest.mark.parametrize("backend,steps,clip,opt,f,i,kind", covering(
    [("numpy", 1, True), ("numpy", 2, True), ("numpy", 2, False), ("onnxruntime", 2, True)], MP_OPT_CASES,
    ["bn", "ln", "emb"]))
def test_mixed_precision_static_scale_with_overflow(backend, kind, opt, f, i, steps, clip):
    """Mixed precision × optimizer × accumulation × clipping, static loss scales with one overflowing
    micro-step: its update is skipped (weights, moments, counters kept) and its accumulated gradients
    dropped."""
    n = 4 * steps
    scales = [256.0] * n
    scales[steps] = 1e30  # the second update's first micro-step overflows
    sess, ref, _ = _mp_step_loop(kind, opt, f, i, steps, clip, scales, backend)
    assert_state(sess, ref, rtol=2e-2, atol=3e-3)


@pytest.mark.parametrize("backend", ["numpy"])  # (onnxruntime's CPU products are float32: no overflow)
def test_mixed_precision_dynamic_scale_state_round_trip_after_skip(backend, tmp_path):
    """Adam under mixed precision with a dynamic loss scale that starts too high (the first updates overflow
    and are skipped), 2 accumulation steps and clipping; after a skipped update the state goes through
    get_state → a new session's load_state, and through a checkpoint file into a third session; all three
    continue as the reference does."""
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler
    from onnxtrain.train.state import checkpoint_to_state, session_to_checkpoint

    kind, opt = "mlp", "AdamOptimizer"
    f, i = {"lambda": 0.01, "max_norm_clip": 0.5}, {"weight_decay_mode": 0}
    model = MODELS[kind]()
    trained = trained_of(model)
    p = params(opt, use_mixed_precision=True, gradient_accumulation_steps=2, **_maps(trained, f, i))
    sess = session(model, p, backend)
    ref = Reference(kind, model, opt, trained, steps=2, fattrs={w: f for w in trained},
                    iattrs={w: i for w in trained})
    scaler = DynamicLossScaler(loss_scale=2.0**26, up_scale_window=3)
    ls = sess.loss_scale_input_name
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    data = batches(kind, 24)
    sessions = [sess]
    skipped = 0
    for u in range(12):
        scale = scaler.loss_scale
        for j in range(2):
            feed = {**data[2 * u + j], ls: np.array([scale], np.float32)}
            _, g = ref.grads(data[2 * u + j], scale)
            biggest = max(float(v.abs().max()) for v in g.values())
            ref.accumulate(data[2 * u + j], scale)
            if j == 0:
                for s in sessions:
                    s.run(["loss", GROUP], feed, ro)
            else:
                run = {**feed, "Learning_Rate": lr_of(u)}
                flags = [s.run(["all_gradients_finite"], run)[0] for s in sessions]
        finite = bool(flags[0][0])
        assert all(bool(fl[0]) == finite for fl in flags)
        # the oracle's view of float16: a scaled gradient beyond its range overflows; one far below cannot
        assert finite or biggest > HALF_MAX / 64, (u, biggest)
        assert not finite or biggest < HALF_MAX, (u, biggest)
        ref.update(float(lr_of(u)[0]), scale, finite=finite)
        scaler.update_loss_scale(finite)
        skipped += not finite
        for s in sessions:
            assert_state(s, ref, rtol=2e-2, atol=3e-3)
        if not finite and len(sessions) == 1:  # right after a skipped update: round trips
            state = sess.get_state()
            s2 = session(model, p, backend)
            s2.load_state(state, strict=True)
            ckpt = session_to_checkpoint(sess, model, 0.05, 0, {})
            save_checkpoint(ckpt, tmp_path / "c.ckpt")
            s3 = session(model, p, backend)
            s3.load_state(checkpoint_to_state(load_checkpoint(tmp_path / "c.ckpt"), s3), strict=True)
            sessions += [s2, s3]
    assert 1 <= skipped < 10 and len(sessions) == 3


@pytest.mark.parametrize("backend,opt,mode", covering(BACKENDS, ["AdamOptimizer", "LambOptimizer"],
                                                      ["legacy", "auto"]))
def test_state_load_and_evaluation_mid_accumulation(backend, mode, opt):
    """In the middle of a 3-step accumulation: evaluation runs (forward only, a path-only fetch of the loss
    and of an output without the labels) change nothing, and load_state of other weights keeps the gradients
    accumulated so far (not part of the state, as in onnxruntime): the update adds the later micro-steps'
    gradients at the loaded weights and steps from the loaded weights and moments."""
    kind = "emb"
    model = MODELS[kind]()
    trained = trained_of(model)
    f = {"max_norm_clip": 0.2, "lambda": 0.01}
    sess = session(model,
                   params(opt, gradient_accumulation_steps=3, gradient_accumulation_mode=mode,
                          **_maps(trained, f, {})), backend)
    ref = Reference(kind, model, opt, trained, steps=3, fattrs={w: f for w in trained})
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    data = batches(kind, 9)
    saved = None
    for k, feed in enumerate(data):
        ref.accumulate(feed)
        if (k + 1) % 3:
            if mode == "legacy":
                sess.run(["loss", GROUP], feed, ro)
            else:
                sess.run(["loss"], {**feed, "Learning_Rate": lr_of(k // 3)})
            # evaluations between micro-steps
            loss, = sess.run(["loss"], data[0], ro)
            np.testing.assert_allclose(loss, float(torch_loss(kind, ref.p, data[0]).detach()), rtol=1e-5)
            logits, = sess.run(["logits"], {"ids": data[1]["ids"]}, ro)
            assert logits.shape == (6, 4)
            if mode == "auto":
                assert sess.next_run_updates == ((k + 1) % 3 == 2)
        else:
            sess.run(["loss"], {**feed, "Learning_Rate": lr_of(k // 3)})
            ref.update(float(lr_of(k // 3)[0]))
            assert_state(sess, ref)
        if k == 3:
            saved = sess.get_state()  # after the second cycle's first micro-step
        if k == 6:  # third cycle, after its first micro-step: load the state saved at k == 3
            sess.load_state(saved, strict=True)
            with torch.no_grad():
                for w in trained:
                    ref.p[w].copy_(torch.from_numpy(saved[w].astype(np.float64)))
                    ref.m1[w] = torch.from_numpy(saved[f"Moment_1_{w}"].astype(np.float64))
                    ref.m2[w] = torch.from_numpy(saved[f"Moment_2_{w}"].astype(np.float64))
                    if opt == "AdamOptimizer":
                        ref.count[w] = int(saved[f"Update_Count_{w}"][0])
                if opt == "LambOptimizer":
                    ref.step_count = int(saved["Step"][0])
    assert_state(sess, ref)


@pytest.mark.parametrize("mp", [False, True])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_outputs_with_accumulation(backend, mp):
    """set_gradients_as_graph_outputs × accumulation (× mixed precision): every micro-step's <w>_grad is that
    micro-step's own gradient (loss-scaled under mixed precision, where <w>_fp16_grad is its float16 value),
    not the accumulated sum; the updates are the reference's."""
    kind, opt = "ln", "AdamOptimizer"
    model = MODELS[kind]()
    trained = trained_of(model)
    sess = session(model,
                   params(opt, gradient_accumulation_steps=2, set_gradients_as_graph_outputs=True,
                          use_mixed_precision=mp), backend)
    ref = Reference(kind, model, opt, trained, steps=2)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    scale = 512.0 if mp else 1.0
    extra = {sess.loss_scale_input_name: np.array([scale], np.float32)} if mp else {}
    names = [f"{w}_grad" for w in trained] + ([f"{w}_fp16_grad" for w in trained] if mp else [])
    tol = {"rtol": 2e-2, "atol": 2e-2 * scale} if mp else {"rtol": 1e-4, "atol": 1e-6}
    for k, feed in enumerate(batches(kind, 6)):
        _, want = ref.grads(feed, scale)
        ref.accumulate(feed, scale)
        if k % 2 == 0:
            got = sess.run([GROUP, *names], {**feed, **extra}, ro)[1:]
        else:
            got = sess.run(names, {**feed, **extra, "Learning_Rate": lr_of(k)})
            ref.update(float(lr_of(k)[0]), scale)
        for name, v in zip(names, got):
            w = name.rsplit("_fp16_grad", 1)[0] if name.endswith("_fp16_grad") else name[: -len("_grad")]
            assert v.dtype == (np.float16 if name.endswith("_fp16_grad") else np.float32), name
            np.testing.assert_allclose(v.astype(np.float64), want[w].numpy(), err_msg=name, **tol)
        if k % 2:
            assert_state(sess, ref, rtol=2e-2 if mp else 1e-4, atol=3e-3 if mp else 1e-5)


@pytest.mark.parametrize("opt,f,select,backend", covering(
    [("LambOptimizer", {"lambda": 0.01, "max_norm_clip": 0.05}), ("AdamOptimizer", {"max_norm_clip": 0.05}),
     ("SGDOptimizer", {})], ["to_train", "not_to_train"], BACKENDS))
def test_frozen_weights_with_accumulation_and_clipping(backend, opt, f, select):
    """weights_to_train / weights_not_to_train × accumulation × clipping: the global norm and the update cover
    the trained weights only; the frozen ones keep their values (and evaluations read them)."""
    kind = "mlp"
    model = MODELS[kind]()
    trained = ["W1", "b2"]
    sel = {"weights_to_train": set(trained)} if select == "to_train" else {"weights_not_to_train": {"W2"}}
    sess = session(model,
                   params(opt, gradient_accumulation_steps=2, **sel, **_maps(trained, f, {})), backend)
    ref = Reference(kind, model, opt, trained, steps=2, fattrs={w: f for w in trained})
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for k, feed in enumerate(batches(kind, 8)):
        ref.accumulate(feed)
        if k % 2 == 0:
            sess.run(["loss", GROUP], feed, ro)
        else:
            _, norm = sess.run(["loss", "global_gradient_norm"], {**feed, "Learning_Rate": lr_of(k)})
            got = ref.update(float(lr_of(k)[0]))
            np.testing.assert_allclose(norm, got["norm"], rtol=1e-5)
            assert_state(sess, ref)
    assert "W2" not in sess.get_state()
    loss, = sess.run(["loss"], batches(kind, 1, seed=9)[0], ro)
    want = float(torch_loss(kind, ref.p, batches(kind, 1, seed=9)[0]).detach())
    np.testing.assert_allclose(loss, want, rtol=1e-5)


# by default each option set once, on alternate backends (the bfloat16 one, last, on numpy: tests/tiers.py)
@pytest.mark.parametrize("recompute,backend", covering([
    {"gelu_recompute": True}, {"recompute_checkpoints": ["n"]},
    {"gelu_recompute": True, "use_mixed_precision": True},
    {"gelu_recompute": True, "use_memory_efficient_gradient": True},
    {"recompute_checkpoints": ["h"], "use_memory_efficient_gradient": True, "use_mixed_precision": True},
    {"gelu_recompute": True, "use_mixed_precision": True, "mixed_precision_dtype": "bfloat16"},
], ["onnxruntime", "numpy"], strength=1))
def test_recompute_with_accumulation_and_clipping(backend, recompute):
    """Recompute options × Adam × accumulation × clipping: the same steps as the reference."""
    kind, opt = "ln", "AdamOptimizer"
    model = MODELS[kind]()
    trained = trained_of(model)
    f = {"max_norm_clip": 0.05, "lambda": 0.01}
    mp = recompute.get("use_mixed_precision", False)
    bf16 = recompute.get("mixed_precision_dtype") == "bfloat16"
    if bf16 and backend != "numpy":
        pytest.skip("onnxruntime's CPU package has no bfloat16 kernels (README)")
    sess = session(model,
                   params(opt, gradient_accumulation_steps=2, **recompute, **_maps(trained, f, {})), backend)
    ref = Reference(kind, model, opt, trained, steps=2, fattrs={w: f for w in trained})
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    scale = 256.0 if mp else 1.0
    extra = {sess.loss_scale_input_name: np.array([scale], np.float32)} if mp else {}
    for k, feed in enumerate(batches(kind, 8)):
        ref.accumulate(feed, scale)
        if k % 2 == 0:
            sess.run(["loss", GROUP], {**feed, **extra}, ro)
        else:
            sess.run(["loss"], {**feed, **extra, "Learning_Rate": lr_of(k)})
            ref.update(float(lr_of(k)[0]), scale)
            assert_state(sess, ref, rtol=2e-2 if mp else 1e-4, atol=3e-3 if mp else 1e-5)


PER_WEIGHT = {  # biases and norms without weight decay, the rest with; clips and betas that differ by weight
    "W1": ({"lambda": 0.02, "max_norm_clip": 0.05, "alpha": 0.85}, {"weight_decay_mode": 1}),
    "b1": ({"max_norm_clip": 0.3}, {"do_bias_correction": 0}),
    "g": ({"beta": 0.99}, {}),
    "be": ({}, {"do_bias_correction": 0, "weight_decay_mode": 1}),
    "W2": ({"lambda": 0.01, "epsilon": 1e-6}, {}),
}


@pytest.mark.parametrize("cpu_adam,steps,backend", covering([False, True], [1, 3], BACKENDS))
def test_adam_per_weight_attributes_accumulation_and_loaded_counts(backend, steps, cpu_adam):
    """Adam with attributes that differ by weight (decay, mode, bias correction, betas, max_norm_clip) ×
    accumulation × legacy_cpu_adam (no clipping) × a loaded state whose step counts differ by weight
    (one of them 0: no bias correction on that step)."""
    kind, opt = "ln", "AdamOptimizer"
    model = MODELS[kind]()
    trained = sorted(PER_WEIGHT)
    fm, im = {w: PER_WEIGHT[w][0] for w in trained}, {w: PER_WEIGHT[w][1] for w in trained}
    sess = session(model, params(opt, gradient_accumulation_steps=steps, legacy_cpu_adam=cpu_adam,
                                 optimizer_attributes_map=fm, optimizer_int_attributes_map=im), backend)
    ref = Reference(kind, model, opt, trained, steps=steps, fattrs=fm, iattrs=im, cpu_adam=cpu_adam)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    for k, feed in enumerate(batches(kind, 5 * steps)):
        ref.accumulate(feed)
        if (k + 1) % steps:
            sess.run(["loss", GROUP], feed, ro)
            continue
        u = k // steps
        sess.run(["loss"], {**feed, "Learning_Rate": lr_of(u)})
        ref.update(float(lr_of(u)[0]))
        assert_state(sess, ref)
        if u == 1:  # counts that differ by weight
            counts = {"W1": 7, "b1": 0, "g": 2, "be": 3, "W2": 3}
            sess.load_state({f"Update_Count_{w}": np.array([c], np.int64) for w, c in counts.items()},
                            strict=True)
            ref.count.update(counts)
        if u == 3:  # the same counts again
            sess.load_state({f"Update_Count_{w}": np.array([9], np.int64) for w in trained}, strict=True)
            ref.count.update(dict.fromkeys(trained, 9))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", ["AdamOptimizer", "LambOptimizer"])
def test_auto_accumulation_mixed_precision_fp16_moments_overflow(backend, opt):
    """gradient_accumulation_mode "auto" × mixed precision × use_fp16_moments × an overflowing micro-step:
    micro-steps fetching all_gradients_finite see the sums so far, the update is skipped, the moments are
    float16 and the next cycle starts from empty buffers; a state saved after the skip loads into a new
    session that continues the same."""
    kind = "mlp"
    model = MODELS[kind]()
    trained = trained_of(model)
    f = {"max_norm_clip": 0.2}
    p = params(opt, gradient_accumulation_steps=3, gradient_accumulation_mode="auto",
               use_mixed_precision=True, use_fp16_moments=True, **_maps(trained, f, {}))
    sess = session(model, p, backend)
    ref = Reference(kind, model, opt, trained, steps=3, fattrs={w: f for w in trained}, fp16_moments=True)
    ls = sess.loss_scale_input_name
    sessions = [sess]
    scales = [512.0] * 12
    scales[4] = 1e30  # the second cycle's second micro-step
    overflow = False
    for k, (feed, scale) in enumerate(zip(batches(kind, 12), scales)):
        big = scale > 1e20
        overflow |= big
        ref.accumulate(feed, 0.0 if big else scale)
        run = {**feed, ls: np.array([scale], np.float32), "Learning_Rate": lr_of(k // 3)}
        for s in sessions:
            finite, = s.run(["all_gradients_finite"], run)
            assert bool(finite[0]) == (not overflow), k
        if (k + 1) % 3 == 0:
            ref.update(float(lr_of(k // 3)[0]), scale, finite=not overflow)
            overflow = False
            for s in sessions:
                st = s.get_state()
                assert all(st[f"Moment_{j}_{w}"].dtype == np.float16 for w in trained for j in (1, 2))
                assert_state(s, ref, rtol=2e-2, atol=3e-3)
            if k == 5:
                s2 = session(model, p, backend)
                s2.load_state(sess.get_state(), strict=True)
                sessions.append(s2)
    assert len(sessions) == 2


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("steps", [1, 2])
def test_adam_loaded_counts_that_differ_then_agree(backend, steps):
    """Adam with one attribute set (the onnxruntime backend merges the weights into one flat update) ×
    accumulation × clipping: a load_state that gives the weights different step counts, then equal ones
    again, steps each weight from its own count, as the reference does."""
    kind, opt = "emb", "AdamOptimizer"
    model = MODELS[kind]()
    trained = trained_of(model)
    f, i = {"lambda": 0.01, "max_norm_clip": 0.1}, {"weight_decay_mode": 1}
    sess = session(model, params(opt, gradient_accumulation_steps=steps, lr_params_feed_name="lr",
                                 **_maps(trained, f, i)), backend)
    ref = Reference(kind, model, opt, trained, steps=steps, fattrs={w: f for w in trained},
                    iattrs={w: i for w in trained})
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    plan = {1: {"E": 4, "W": 1, "b": 0}, 3: dict.fromkeys(trained, 6), 4: {"E": 2, "W": 2, "b": 9}}
    for k, feed in enumerate(batches(kind, 6 * steps)):
        ref.accumulate(feed)
        if (k + 1) % steps:
            sess.run(["loss", GROUP], feed, ro)
            continue
        u = k // steps
        sess.run(["loss"], {**feed, "lr": lr_of(u)})
        ref.update(float(lr_of(u)[0]))
        assert_state(sess, ref)
        if u in plan:
            sess.load_state({f"Update_Count_{w}": np.array([c], np.int64) for w, c in plan[u].items()})
            ref.count.update(plan[u])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("opt", ["SGDOptimizer", "AdamOptimizer"])
def test_accumulation_protocol_ignored_updates_every_run_by_mean(backend, opt):
    """gradient_accumulation_steps = 3 with every run a full one (the legacy protocol not followed): each run
    updates with its own gradient divided by 3 (spec §4.3), the buffers emptied each time."""
    kind = "mlp"
    model = MODELS[kind]()
    trained = trained_of(model)
    sess = session(model, params(opt, gradient_accumulation_steps=3, enable_grad_norm_clip=False), backend)
    ref = Reference(kind, model, opt, trained, steps=3, clip=False)
    for k, feed in enumerate(batches(kind, 4)):
        ref.accumulate(feed)
        sess.run(["loss"], {**feed, "Learning_Rate": lr_of(k)})
        ref.update(float(lr_of(k)[0]))
        assert_state(sess, ref)


@pytest.mark.parametrize("fetch,steps,backend", covering(["W1_grad", "global_gradient_norm"], [1, 3],
                                                         BACKENDS))
def test_batch_norm_statistics_on_path_runs(backend, steps, fetch):
    """A bias-free layer followed by BatchNormalization × accumulation × set_gradients_as_graph_outputs: a run
    with only_execute_path_to_fetches that fetches gradients (or their norm) runs the forward in training
    mode, so it moves the running statistics, as onnxruntime's BatchNormInternal did (its kernel writes them
    in place) and torch's forward does; with or without accumulation. Evaluations leave them."""
    kind, opt = "bn", "AdamOptimizer"
    model = MODELS[kind]()
    trained = ["W1", "W2", "b2", "bb", "s"]
    sess = session(model, params(opt, gradient_accumulation_steps=steps, set_gradients_as_graph_outputs=True),
                   backend)
    ref = Reference(kind, model, opt, trained, steps=steps)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    data = batches(kind, 6 * steps)
    for k, feed in enumerate(data):
        _, g = ref.grads(feed)  # (a forward of its own: a path run's)
        got, = sess.run([fetch], feed, ro)
        if fetch == "W1_grad":
            np.testing.assert_allclose(got, g["W1"].numpy(), rtol=1e-4, atol=1e-6)
        else:  # under accumulation the norm is of the sums so far, which take this run's gradients (README)
            if steps > 1:
                for w in trained:
                    ref.buf[w] += g[w]
            sums = ref.buf if steps > 1 else {w: g[w] * steps for w in trained}
            want = np.sqrt(sum(float(((v / steps) ** 2).sum()) for v in sums.values()))
            np.testing.assert_allclose(got, want, rtol=1e-5)
        assert_state(sess, ref)
        sess.run(["logits"], {"x": feed["x"]}, ro)  # an evaluation: no change
        assert_state(sess, ref)
        ref.accumulate(feed)
        if (k + 1) % steps:
            sess.run(["loss", GROUP], feed, ro)
        else:
            sess.run(["loss"], {**feed, "Learning_Rate": lr_of(k)})
            ref.update(float(lr_of(k)[0]))
        assert_state(sess, ref)


@pytest.mark.parametrize("steps,recompute,backend", covering(
    [1, 2], [{"recompute_checkpoints": ["h"]}, {"recompute_checkpoints": ["h"], "use_mixed_precision": True}],
    BACKENDS))
def test_recompute_through_batch_norm(backend, recompute, steps):
    """recompute_checkpoints that make the backward pass rebuild a training-mode BatchNormalization × Adam ×
    accumulation (× mixed precision): the session builds on both backends (the rebuilt node keeps the running
    statistics outputs ONNX requires in training mode, unused) and trains as the reference, the running
    statistics moving once per forward."""
    kind, opt = "bn", "AdamOptimizer"
    model = MODELS[kind]()
    trained = trained_of(model)
    mp = recompute.get("use_mixed_precision", False)
    sess = session(model, params(opt, gradient_accumulation_steps=steps, **recompute), backend)
    ref = Reference(kind, model, opt, trained, steps=steps)
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    scale = 128.0 if mp else 1.0
    extra = {sess.loss_scale_input_name: np.array([scale], np.float32)} if mp else {}
    for k, feed in enumerate(batches(kind, 3 * steps)):
        ref.accumulate(feed, scale)
        if (k + 1) % steps:
            sess.run(["loss", GROUP], {**feed, **extra}, ro)
        else:
            sess.run(["loss"], {**feed, **extra, "Learning_Rate": lr_of(k)})
            ref.update(float(lr_of(k)[0]), scale)
        assert_state(sess, ref, rtol=2e-2 if mp else 1e-4, atol=3e-3 if mp else 1e-5)
