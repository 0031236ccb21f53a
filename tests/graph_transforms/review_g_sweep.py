"""A seeded random sweep over the legacy TrainingSession's options in combination, against a float64 oracle
written from the spec (../shared/spec/legacy-training-session.md §4.3, §7, §8.4, §10) and onnxruntime's
``amp/loss_scaler.py``.

One seed draws a model (an MLP with Gelu, a small conv net, a regression with a loss built of generic ops),
an optimizer (SGD / Adam / Lamb) with attributes per weight, ``gradient_accumulation_steps`` 1-4 (the legacy
protocol or ``auto``), clipping, mixed precision (float16 / bfloat16) fed by a dynamic loss scaler with
micro-steps whose loss overflows, recompute options, a weight selection, gradient / norm / finite-flag
fetches, a learning rate fed per update, evaluations and ``get_state``/``load_state`` round trips (into the
same session mid-accumulation, into a new one between updates). :func:`run_case` runs it and checks every
step against :class:`Oracle` (torch autograd in float64 for the gradients, the update formulas in float64).

Wide sweep: ``python -m tests.graph_transforms.review_g_sweep START STOP``.
"""

from __future__ import annotations

import math
import sys
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto as T
from onnx import helper, numpy_helper

GROUP = "Group_Accumulated_Gradients"
NORM = "global_gradient_norm"
FINITE = "all_gradients_finite"


# ---------------------------------------------------------------------------------------------- models
def _init(rng: np.random.Generator, name: str, shape: tuple[int, ...], scale: float) -> onnx.TensorProto:
    return numpy_helper.from_array((rng.standard_normal(shape) * scale).astype(np.float32), name)


def mlp_model() -> onnx.ModelProto:
    """x[N,5] → MatMul W1 + b1 → Gelu → MatMul W2 + b2 → SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(101)
    inits = [_init(rng, "W1", (5, 7), 0.5), _init(rng, "b1", (7,), 0.1), _init(rng, "W2", (7, 4), 0.5),
             _init(rng, "b2", (4,), 0.1)]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Gelu", ["h"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["z"]),
             helper.make_node("Add", ["z", "b2"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 5]),
                                         helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


def conv_model() -> onnx.ModelProto:
    """x[N,1,5,5] → Conv K, kb (pads 1) → Tanh → GlobalAveragePool → Flatten → Gemm Wc, bc →
    SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(102)
    inits = [_init(rng, "K", (3, 1, 3, 3), 0.5), _init(rng, "kb", (3,), 0.1), _init(rng, "Wc", (3, 4), 0.8),
             _init(rng, "bc", (4,), 0.1)]
    nodes = [helper.make_node("Conv", ["x", "K", "kb"], ["c"], pads=[1, 1, 1, 1], kernel_shape=[3, 3]),
             helper.make_node("Tanh", ["c"], ["a"]), helper.make_node("GlobalAveragePool", ["a"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]),
             helper.make_node("Gemm", ["f", "Wc", "bc"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "conv", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 1, 5, 5]),
                                          helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def mse_model() -> onnx.ModelProto:
    """x[N,5] → Gemm W, b (transB; b starts at zero: Lamb's trust ratio is then 1) → Tanh → MatMul V → mean
    squared error to y, of Sub, Mul, ReduceMean."""
    rng = np.random.default_rng(103)
    inits = [_init(rng, "W", (6, 5), 0.5), _init(rng, "b", (6,), 0.0), _init(rng, "V", (6, 3), 0.5)]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1),
             helper.make_node("Tanh", ["h"], ["a"]),
             helper.make_node("MatMul", ["a", "V"], ["out"]), helper.make_node("Sub", ["out", "y"], ["d"]),
             helper.make_node("Mul", ["d", "d"], ["d2"]),
             helper.make_node("ReduceMean", ["d2"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "mse", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 5]),
                                         helper.make_tensor_value_info("y", T.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("out", T.FLOAT, ["N", 3])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])


def ln_model() -> onnx.ModelProto:
    """x[N,5] → Gemm W, b (transB) → LayerNormalization(g, be) → Gelu → MatMul V →
    SoftmaxCrossEntropyLoss(y)."""
    rng = np.random.default_rng(105)
    inits = [_init(rng, "W", (8, 5), 0.5), _init(rng, "b", (8,), 0.1),
             numpy_helper.from_array((1 + 0.1 * rng.standard_normal(8)).astype(np.float32), "g"),
             _init(rng, "be", (8,), 0.1), _init(rng, "V", (8, 4), 0.5)]
    nodes = [helper.make_node("Gemm", ["x", "W", "b"], ["h"], transB=1),
             helper.make_node("LayerNormalization", ["h", "g", "be"], ["n"], axis=-1, epsilon=1e-5),
             helper.make_node("Gelu", ["n"], ["a"]), helper.make_node("MatMul", ["a", "V"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "ln", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 5]),
                                        helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 4])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 20)])


MODELS = {"mlp": mlp_model, "conv": conv_model, "mse": mse_model, "ln": ln_model}
OUTPUT = {"mlp": "logits", "conv": "logits", "mse": "out", "ln": "logits"}
ACTIVATIONS = {"mlp": ["h", "a", "z"], "conv": ["c", "a", "p"], "mse": ["h", "a", "d"], "ln": ["h", "n", "a"]}


def forward(kind: str, p: dict, feed: dict) -> tuple[Any, Any]:
    """(loss, model output) in torch float64."""
    import torch
    import torch.nn.functional as F

    x = torch.from_numpy(np.asarray(feed["x"], np.float64))
    if kind == "mlp":
        out = F.gelu(x @ p["W1"] + p["b1"]) @ p["W2"] + p["b2"]
        return F.cross_entropy(out, torch.from_numpy(feed["y"])), out
    if kind == "ln":
        n = F.layer_norm(x @ p["W"].T + p["b"], (8,), p["g"], p["be"], eps=1e-5)
        out = F.gelu(n) @ p["V"]
        return F.cross_entropy(out, torch.from_numpy(feed["y"])), out
    if kind == "conv":
        a = torch.tanh(F.conv2d(x, p["K"], p["kb"], padding=1))
        out = a.mean((2, 3)) @ p["Wc"] + p["bc"]
        return F.cross_entropy(out, torch.from_numpy(feed["y"])), out
    out = torch.tanh(x @ p["W"].T + p["b"]) @ p["V"]
    return ((out - torch.from_numpy(feed["y"]).double()) ** 2).mean(), out


def batch(kind: str, rng: np.random.Generator, n: int = 6) -> dict[str, np.ndarray]:
    if kind == "conv":
        return {"x": rng.standard_normal((n, 1, 5, 5)).astype(np.float32), "y": rng.integers(0, 4, n)}
    if kind in ("mlp", "ln"):
        return {"x": rng.standard_normal((n, 5)).astype(np.float32), "y": rng.integers(0, 4, n)}
    return {"x": rng.standard_normal((n, 5)).astype(np.float32),
            "y": (0.5 * rng.standard_normal((n, 3))).astype(np.float32)}


# ---------------------------------------------------------------------------------------------- config
OPTS = ["SGDOptimizer", "AdamOptimizer", "LambOptimizer"]


@dataclass
class Case:
    seed: int
    kind: str
    opt: str
    weights: list[str]  # the model's float initializers
    trained: list[str]
    select: dict[str, Any]  # weights_to_train / weights_not_to_train
    fattrs: dict[str, dict[str, float]]
    iattrs: dict[str, dict[str, int]]
    steps: int
    mode: str  # gradient_accumulation_mode
    clip: bool
    cpu_adam: bool
    fp16_moments: bool
    mp: str | None  # mixed_precision_dtype, None: off
    scaler: tuple[float, int, float]  # initial scale, up_scale_window, max_loss_scale
    recompute: dict[str, Any]
    grads_out: bool
    backend: str
    updates: int
    lr_name: str
    overflow: set[int] = field(default_factory=set)  # micro-steps whose loss overflows (mixed precision)
    reload_same: set[int] = field(default_factory=set)  # micro-steps before which the session reloads itself
    reload_new: set[int] = field(default_factory=set)  # updates after which a new session takes the state
    evals: set[int] = field(default_factory=set)  # micro-steps after which an evaluation runs
    loads: set[int] = field(default_factory=set)  # micro-steps before which other weights and state load
    initial: bool = False  # set_optimizer_initial_state with drawn moments and counts

    def params(self, initial: dict | None = None):
        from onnxtrain import TrainingParameters

        p = TrainingParameters()
        p.loss_output_name = "loss"
        p.training_optimizer_name = self.opt
        p.lr_params_feed_name = self.lr_name
        p.gradient_accumulation_steps = self.steps
        p.gradient_accumulation_mode = self.mode
        p.enable_grad_norm_clip = self.clip
        p.optimizer_attributes_map = self.fattrs
        p.optimizer_int_attributes_map = self.iattrs
        p.set_gradients_as_graph_outputs = self.grads_out
        if self.cpu_adam:
            p.legacy_cpu_adam = True
        if self.fp16_moments:
            p.use_fp16_moments = True
        if self.mp is not None:
            p.use_mixed_precision = True
            p.mixed_precision_dtype = self.mp
        for k, v in {**self.select, **self.recompute}.items():
            setattr(p, k, v)
        if initial:
            p.set_optimizer_initial_state(initial)
        return p


def draw(seed: int, backends: tuple[str, ...] = ("numpy", "onnxruntime")) -> Case:
    rng = np.random.default_rng(seed)
    kind = str(rng.choice(list(MODELS)))
    model = MODELS[kind]()
    weights = sorted(t.name for t in model.graph.initializer)
    opt = OPTS[seed % 3]
    r = rng.random()
    if r < 0.4:
        select, trained = {}, weights
    elif r < 0.7:
        trained = sorted(rng.choice(weights, size=int(rng.integers(1, len(weights))), replace=False).tolist())
        select = {"weights_to_train": set(trained)}
    else:
        frozen = sorted(rng.choice(weights, size=int(rng.integers(1, len(weights))), replace=False).tolist())
        trained = [w for w in weights if w not in frozen]
        select = {"weights_not_to_train": set(frozen)}
    fattrs: dict[str, dict[str, float]] = {}
    iattrs: dict[str, dict[str, int]] = {}
    lamb_globals = {}
    if opt == "LambOptimizer":
        if rng.random() < 0.5:
            lamb_globals["ratio_max"] = float(rng.choice([0.5, 2.0, 10.0]))
        if rng.random() < 0.3:
            lamb_globals["ratio_min"] = float(rng.choice([0.01, 0.1]))
    lamb_bias = int(rng.integers(0, 2))
    for k, w in enumerate(trained):
        f: dict[str, float] = {}
        i: dict[str, int] = {}
        if opt != "SGDOptimizer":
            if rng.random() < 0.5:
                f["alpha"] = float(rng.choice([0.9, 0.8, 0.5]))
            if rng.random() < 0.5:
                f["beta"] = float(rng.choice([0.999, 0.99, 0.9]))
            if rng.random() < 0.5:
                f["lambda"] = float(rng.choice([0.0, 0.01, 0.1]))
            if rng.random() < 0.4:
                f["epsilon"] = float(rng.choice([1e-8, 1e-6, 1e-3]))
            if rng.random() < 0.6:
                f["max_norm_clip"] = float(rng.choice([0.05, 0.3, 2.0]))
        if opt == "AdamOptimizer":
            if rng.random() < 0.5:
                i["do_bias_correction"] = int(rng.integers(0, 2))
            if rng.random() < 0.5:
                i["weight_decay_mode"] = int(rng.integers(0, 2))
        if opt == "LambOptimizer" and (k == 0 or rng.random() < 0.5):  # the first weight sets the globals;
            # others repeat them or not
            f.update(lamb_globals)
            i["do_bias_correction"] = lamb_bias
        fattrs[w], iattrs[w] = f, i
    steps = int(rng.integers(1, 5))
    mode = "auto" if rng.random() < 0.3 else "legacy"
    clip = bool(rng.random() < 0.7)
    cpu_adam = opt == "AdamOptimizer" and bool(rng.random() < 0.2)
    fp16_moments = opt != "SGDOptimizer" and bool(rng.random() < 0.2)
    mp = [None, None, "float16", "bfloat16"][int(rng.integers(0, 4))]
    backend = str(rng.choice(list(backends)))
    if mp == "bfloat16" and backend == "onnxruntime":
        backend = "numpy"  # (onnxruntime's CPU package has no bfloat16 kernels)
    scaler = (float(2 ** int(rng.integers(5, 9))), int(rng.choice([1, 2, 3, 1000])), 512.0)
    recompute: dict[str, Any] = {}
    rr = rng.random()
    if rr < 0.3:
        acts = ACTIVATIONS[kind]
        recompute["recompute_checkpoints"] = sorted(
            rng.choice(acts, size=int(rng.integers(1, len(acts))), replace=False).tolist())
    elif rr < 0.45 and kind in ("mlp", "ln"):
        recompute["gelu_recompute"] = True
    if kind == "ln" and rng.random() < 0.5:
        recompute["use_memory_efficient_gradient"] = True
    updates = int(rng.integers(3, 6))
    total = updates * steps
    case = Case(seed, kind, opt, weights, trained, select, fattrs, iattrs, steps, mode, clip, cpu_adam,
                fp16_moments, mp, scaler, recompute, mp is not None or bool(rng.random() < 0.5), backend,
                updates,
                "Learning_Rate" if rng.random() < 0.7 else "lr")
    if mp is not None:
        case.overflow = {int(k) for k in rng.choice(total, size=int(rng.integers(1, 3)), replace=False)}
    case.reload_same = {int(k) for k in range(1, total) if rng.random() < 0.15}
    case.reload_new = {int(u) for u in range(updates - 1) if rng.random() < 0.3}
    case.evals = {int(k) for k in range(total) if rng.random() < 0.2}
    case.loads = {int(k) for k in range(1, total) if rng.random() < 0.1}
    case.initial = opt != "SGDOptimizer" and bool(rng.random() < 0.4)
    return case


def drawn_state(case: Case, rng: np.random.Generator, weights: dict[str, np.ndarray],
                moments: bool = True) -> dict[str, dict[str, np.ndarray]]:
    """Optimizer state to load or start from, by weight (``get_optimizer_state()``'s layout): moments (the
    second positive) in the kept dtype, counts from 0 to 5."""
    out: dict[str, dict[str, np.ndarray]] = {}
    dt = np.float16 if case.fp16_moments else np.float32
    for w in case.trained:
        shape = weights[w].shape
        d: dict[str, np.ndarray] = {}
        if moments:
            d["Moment_1"] = (0.05 * rng.standard_normal(shape)).astype(dt)
            d["Moment_2"] = (0.01 * rng.random(shape) + 1e-4).astype(dt)
        if case.opt == "AdamOptimizer":
            d["Update_Count"] = np.array([rng.integers(0, 6)], np.int64)
        out[w] = d
    if case.opt == "LambOptimizer":
        out["shared_optimizer_state"] = {"Step": np.array([rng.integers(0, 6)], np.int64)}
    return out


# ---------------------------------------------------------------------------------------------- oracle
class Scaler:
    """onnxruntime's DynamicLossScaler.update (amp/loss_scaler.py), called after each optimizer step."""

    def __init__(self, scale: float, window: int, top: float, bottom: float = 1.0):
        self.scale, self.window, self.top, self.bottom, self.stable = scale, window, top, bottom, 0

    def update(self, finite: bool) -> None:
        if finite:
            self.stable += 1
            if self.stable >= self.window:
                self.scale = min(self.top, self.scale * 2)
                self.stable = 0
        else:
            self.scale = max(self.bottom, self.scale / 2)
            self.stable = 0


def f32(v: float) -> float:
    return float(np.float32(v))


class Oracle:
    """The legacy step in float64: gradients of loss·L (L the loss scale under mixed precision, else 1) summed
    over the micro-steps; at the update the mean G = Σ/N, its global norm ‖G‖ (loss-scaled), a skip (nothing
    changes, sums dropped) when ‖G‖ is not finite under mixed precision, else per weight the divisor
    s = ‖G‖/max_norm_clip when clipping (Adam, Lamb; not SGD, not legacy_cpu_adam) and ‖G‖ > L·max_norm_clip,
    else s = L, and the optimizer on G/s."""

    def __init__(self, case: Case, model: onnx.ModelProto):
        import torch

        self.c = case
        self.p = {t.name: torch.tensor(numpy_helper.to_array(t).astype(np.float64),
                                       requires_grad=t.name in case.trained) for t in model.graph.initializer}
        self.m1 = {w: torch.zeros_like(self.p[w]) for w in case.trained}
        self.m2 = {w: torch.zeros_like(self.p[w]) for w in case.trained}
        self.count = dict.fromkeys(case.trained, 1)
        self.lamb_step = 1
        self.buf = {w: torch.zeros_like(self.p[w]) for w in case.trained}
        self.bad = False  # a micro-step of this cycle overflowed

    def grads(self, feed: dict, scale: float) -> tuple[float, dict]:
        """The micro-step's loss and gradients of loss·scale."""
        import torch

        loss, _ = forward(self.c.kind, self.p, feed)
        gs = torch.autograd.grad(loss * scale, [self.p[w] for w in self.c.trained])
        return float(loss.detach()), {w: v.detach() for w, v in zip(self.c.trained, gs)}

    def accumulate(self, g: dict, overflow: bool) -> None:
        self.bad |= overflow
        for w in self.c.trained:
            self.buf[w] = self.buf[w] + g[w]

    def norm(self) -> float:
        return math.sqrt(sum(float(((v / self.c.steps) ** 2).sum()) for v in self.buf.values()))

    def fa(self, w: str, key: str, default: float) -> float:
        return f32(self.c.fattrs.get(w, {}).get(key, default))

    def ia(self, w: str, key: str, default: int) -> int:
        return int(self.c.iattrs.get(w, {}).get(key, default))

    def update(self, lr: float, scale: float) -> bool:
        """The optimizer step; returns whether it applied (all finite)."""
        import torch

        c = self.c
        G = {w: v / c.steps for w, v in self.buf.items()}
        norm = self.norm()
        self.buf = {w: torch.zeros_like(v) for w, v in self.buf.items()}
        bad, self.bad = self.bad, False
        if bad:
            return False
        uses_norm = c.clip and c.opt != "SGDOptimizer" and not c.cpu_adam
        g = {}
        for w in c.trained:
            mnc = self.fa(w, "max_norm_clip", 1.0)
            s = norm / mnc if uses_norm and norm > scale * mnc else scale
            g[w] = G[w] / s
        with torch.no_grad():
            if c.opt == "SGDOptimizer":
                for w in c.trained:
                    self.p[w] -= lr * g[w]
            elif c.opt == "AdamOptimizer":
                for w in c.trained:
                    self._adam(w, g[w], lr)
            else:
                self._lamb(g, lr)
        return True

    def _moments(self, w: str, g, a: float, b: float):
        return a * self.m1[w] + (1 - a) * g, b * self.m2[w] + (1 - b) * g * g

    def _store(self, w: str, m1, m2) -> None:
        import torch

        if self.c.fp16_moments:  # kept in float16 (spec §8.5); a second moment at least float16's smallest
            tiny = float(np.finfo(np.float16).smallest_subnormal)  # subnormal (onnxtrain's documented floor)
            m1 = m1.to(torch.float16).double()
            m2 = torch.clamp(m2, min=tiny).to(torch.float16).double()
        self.m1[w], self.m2[w] = m1, m2

    def _adam(self, w: str, g, lr: float) -> None:
        import torch

        a, b = self.fa(w, "alpha", 0.9), self.fa(w, "beta", 0.999)
        lam, eps = self.fa(w, "lambda", 0.0), self.fa(w, "epsilon", 1e-8)
        bias, mode = self.ia(w, "do_bias_correction", 1), self.ia(w, "weight_decay_mode", 0)
        t = self.count[w]
        m1, m2 = self._moments(w, g, a, b)
        c1, c2 = (1 - a ** t, 1 - b ** t) if bias and t > 0 else (1.0, 1.0)
        p = self.p[w]
        if mode == 0:
            p -= lr * ((m1 / c1) / (torch.sqrt(m2 / c2) + eps) + lam * p)
        else:
            u = lr * math.sqrt(c2) / c1 * m1 / (torch.sqrt(m2) + eps)
            p -= u + lr * lam * (p - u)
        self.count[w] = t + 1
        self._store(w, m1, m2)

    def _lamb(self, g: dict, lr: float) -> None:
        import torch

        first = self.c.trained[0]
        bias = self.ia(first, "do_bias_correction", 0)
        rmin, rmax = self.fa(first, "ratio_min", -np.inf), self.fa(first, "ratio_max", np.inf)
        t = self.lamb_step
        for w in self.c.trained:
            a, b = self.fa(w, "alpha", 0.9), self.fa(w, "beta", 0.999)
            lam, eps = self.fa(w, "lambda", 0.0), self.fa(w, "epsilon", 1e-6)
            m1, m2 = self._moments(w, g[w], a, b)
            c1, c2 = (1 - a ** t, 1 - b ** t) if bias and t > 0 else (1.0, 1.0)
            d = lam * self.p[w] + (m1 / c1) / (torch.sqrt(m2 / c2) + eps)
            wn, dn = float(self.p[w].norm()), float(d.norm())
            eta = lr * max(rmin, min(rmax, wn / dn)) if wn > 0 and dn > 0 else lr
            self.p[w] -= eta * d
            self._store(w, m1, m2)
        self.lamb_step = t + 1

    def load(self, opt_state: dict[str, dict[str, np.ndarray]], weights: dict[str, np.ndarray]) -> None:
        """Take weights and optimizer state (``get_optimizer_state()``'s layout) as the session's load."""
        import torch

        for w, v in weights.items():
            self.p[w] = torch.tensor(v.astype(np.float64), requires_grad=True)
        for w, d in opt_state.items():
            if w == "shared_optimizer_state":
                self.lamb_step = int(d["Step"][0])
                continue
            if "Moment_1" in d:
                self.m1[w] = torch.from_numpy(d["Moment_1"].astype(np.float64))
                self.m2[w] = torch.from_numpy(d["Moment_2"].astype(np.float64))
            if "Update_Count" in d:
                self.count[w] = int(d["Update_Count"][0])

    def state(self) -> dict[str, np.ndarray]:
        c = self.c
        out = {w: self.p[w].detach().numpy() for w in c.trained}
        if c.opt != "SGDOptimizer":
            for w in c.trained:
                out[f"Moment_1_{w}"] = self.m1[w].numpy()
                out[f"Moment_2_{w}"] = self.m2[w].numpy()
                if c.opt == "AdamOptimizer":
                    out[f"Update_Count_{w}"] = np.array([self.count[w]], np.int64)
            if c.opt == "LambOptimizer":
                out["Step"] = np.array([self.lamb_step], np.int64)
        return out


# ---------------------------------------------------------------------------------------------- runner
def make_session(case: Case, model: onnx.ModelProto, initial: dict | None = None):
    from onnxtrain import SessionOptions, TrainingSession

    so = SessionOptions()
    if case.backend == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return TrainingSession(model.SerializeToString(), case.params(initial), so)


def tolerances(case: Case, state: bool = False) -> dict[str, float]:
    """Float32 runs against float64; under mixed precision the outputs (loosely: half-precision compute),
    and the state (``state``) tightly, its update taking the session's gradients."""
    if case.mp is None or state:
        return {"rtol": 2e-4, "atol": 2e-5}
    return {"rtol": 3e-2, "atol": 5e-3} if case.mp == "float16" else {"rtol": 6e-2, "atol": 2e-2}


def check_state(sess, oracle: Oracle, case: Case, where: str) -> None:
    got = sess.get_state()
    want = oracle.state()
    tol = tolerances(case, state=True)
    for name, v in want.items():
        assert name in got, f"{where}: {name} missing from get_state(): {sorted(got)}"
        if v.dtype.kind == "i":
            np.testing.assert_array_equal(got[name], v, err_msg=f"{where}: {name}")
        else:
            t = dict(tol)
            if name.startswith("Moment_2"):  # squares: their relative error doubles
                t["rtol"] *= 2
                t["atol"] = t["atol"] ** 2
            if case.fp16_moments and name.startswith("Moment"):  # stored in float16: a value on a rounding
                # boundary may round either way (an ulp, a subnormal's below 6.1e-5)
                t["rtol"] = max(t["rtol"], 2e-3)
                t["atol"] = max(t["atol"], float(np.finfo(np.float16).smallest_subnormal))
            np.testing.assert_allclose(got[name].astype(np.float64), v, err_msg=f"{where}: {name}", **t)
    untrained = [w for w in case.weights if w not in case.trained]
    for w in untrained:
        assert w not in got, f"{where}: frozen weight {w} in get_state()"
    # the same values by weight (get_optimizer_state, spec §5.4) and as the model state (§5.3)
    opt_state = sess.get_optimizer_state()
    keys = {"SGDOptimizer": [], "AdamOptimizer": ["Moment_1", "Moment_2", "Update_Count"],
            "LambOptimizer": ["Moment_1", "Moment_2"]}[case.opt]
    want_keys = {w: keys for w in case.trained} if keys else {}
    if case.opt == "LambOptimizer":
        want_keys["shared_optimizer_state"] = ["Step"]
    assert {w: sorted(d) for w, d in opt_state.items()} == {w: sorted(k) for w, k in want_keys.items()}, where
    for w, d in opt_state.items():
        for key, v in d.items():
            flat = key if w == "shared_optimizer_state" else f"{key}_{w}"
            np.testing.assert_array_equal(v, got[flat], err_msg=f"{where}: get_optimizer_state {w} {key}")
    model_state = sess.get_model_state(include_mixed_precision_weights=True)
    assert sorted(model_state["full_precision"]) == case.trained, where
    for w in case.trained:
        np.testing.assert_array_equal(model_state["full_precision"][w], got[w], err_msg=where)
        if case.mp is not None:
            half = model_state["mixed_precision"][w]
            twin = got[f"{w}_fp16" if case.mp == "float16" else f"{w}_bf16"]
            assert half.dtype == twin.dtype and str(half.dtype) == case.mp, (where, half.dtype)
            np.testing.assert_array_equal(half.astype(np.float32),
                                          got[w].astype(half.dtype).astype(np.float32),
                                          err_msg=f"{where}: half twin of {w}")
            np.testing.assert_array_equal(twin.astype(np.float32), half.astype(np.float32), err_msg=where)


def run_case(case: Case, check_every_update: bool = True) -> dict[str, Any]:
    """Train ``case`` and check it step by step; returns a summary (skipped updates, scales). The oracle's
    torch default dtype is float64 for the call only: the process's other tests keep theirs."""
    import torch

    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        return _run_case(case, check_every_update)
    finally:
        torch.set_default_dtype(before)


def _run_case(case: Case, check_every_update: bool) -> dict[str, Any]:
    import torch

    from onnxtrain import RunOptions
    from onnxtrain.graph_transforms.loss_scaler import DynamicLossScaler

    model = MODELS[case.kind]()
    rng = np.random.default_rng(case.seed + 1000)
    oracle = Oracle(case, model)
    initial = None
    if case.initial:
        initial = drawn_state(case, rng, {w: oracle.p[w].detach().numpy() for w in case.trained},
                              moments=bool(rng.random() < 0.7))
        oracle.load(initial, {})
    sess = make_session(case, model, initial)
    init, window, top = case.scaler
    scaler = DynamicLossScaler(loss_scale=init, up_scale_window=window, max_loss_scale=top)
    mine = Scaler(init, window, top)
    path = RunOptions()
    path.only_execute_path_to_fetches = True
    tol = tolerances(case)
    mp = case.mp is not None
    ls = sess.loss_scale_input_name
    assert (ls is not None) == mp, f"loss_scale_input_name {ls!r} with mixed precision {case.mp}"
    summary = {"skipped": 0, "scales": []}
    for k in range(case.updates * case.steps):
        u, last = k // case.steps, (k + 1) % case.steps == 0
        if k in case.reload_same:  # the session's own state back, mid-accumulation or not: nothing changes
            sess.load_state(sess.get_state(), strict=True)
        if k in case.loads:  # other weights and optimizer state, mid-accumulation or not (the sums stay)
            cur = sess.get_state()
            weights = {w: (cur[w] + 0.05 * rng.standard_normal(cur[w].shape)).astype(np.float32)
                       for w in case.trained if rng.random() < 0.7}
            opt_state = drawn_state(case, rng, cur) if case.opt != "SGDOptimizer" else {}
            flat = dict(weights)
            for w, d in opt_state.items():
                for key, v in d.items():
                    flat[key if w == "shared_optimizer_state" else f"{key}_{w}"] = v
            sess.load_state(flat, strict=True)
            oracle.load(opt_state, weights)
        feed = batch(case.kind, rng, n=int(rng.integers(3, 8)))
        over = k in case.overflow
        if over:  # beyond float16 (a float32 input is cast to it), or beyond any float for bfloat16
            key = "y" if case.kind == "mse" else "x"
            feed[key] = feed[key].copy()
            # (the onnxruntime backend computes the float16 products of its CPU kernels in float32, README: a
            # value beyond float16 does not overflow there); the conv net's whole first image, whose inf
            # products of kernel weights of both signs sum to NaN (a single one may saturate a Tanh)
            huge = 1e5 if case.mp == "float16" and case.backend == "numpy" else np.inf
            if case.kind == "conv":
                feed[key][0] = huge
            else:
                feed[key].flat[0] = huge
        scale = float(scaler.loss_scale) if mp else 1.0
        if mp:
            assert scale == mine.scale, (k, scale, mine.scale)
            feed[ls] = scaler.feed()
        loss_want, g = oracle.grads(feed, scale)
        fetch = ["loss"]
        if case.grads_out and (mp or rng.random() < 0.6):
            fetch += [f"{w}_grad" for w in case.trained]
            if mp and rng.random() < 0.5:  # onnxruntime's name: the half twin's gradient
                suffix = "_fp16_grad" if case.mp == "float16" else "_bf16_grad"
                fetch += [f"{w}{suffix}" for w in case.trained]
        if (case.clip or mp) and rng.random() < 0.5:
            fetch.append(NORM)
        if mp and (last or rng.random() < 0.3):
            fetch.append(FINITE)
        lr = np.array([rng.uniform(0.005, 0.05)], np.float32)
        if case.mode == "auto":  # the session counts the micro-steps (and a new session starts a cycle)
            assert sess.next_run_updates == last, (case.seed, k, "next_run_updates")
        if case.mode == "legacy" and not last:
            names = [*fetch, GROUP]
            got = dict(zip(names, sess.run(names, feed, path)))
        else:
            got = dict(zip(fetch, sess.run(fetch, {**feed, case.lr_name: lr})))
        where = f"seed {case.seed} micro-step {k}"
        # under mixed precision the update is checked on the session's own (half-precision) gradients, which
        # are checked against float64 here: the update's arithmetic is then compared tightly
        oracle.accumulate({w: torch.from_numpy(got[f"{w}_grad"].astype(np.float64)) for w in case.trained}
                          if mp else g, over)
        if over:
            assert not np.all(np.isfinite(got["loss"])), f"{where}: loss {got['loss']} finite"
        else:
            np.testing.assert_allclose(got["loss"], loss_want, err_msg=f"{where}: loss", **tol)
        for w in case.trained:
            if f"{w}_grad" in got and not over:
                np.testing.assert_allclose(got[f"{w}_grad"].astype(np.float64), g[w].numpy(),
                                           rtol=tol["rtol"], atol=tol["atol"] * max(1.0, scale),
                                           err_msg=f"{where}: {w}_grad")
        for w in case.trained:
            for suffix in ("_fp16_grad", "_bf16_grad"):
                if w + suffix in got:
                    half = got[w + suffix]
                    assert str(half.dtype) == case.mp, (where, w + suffix, half.dtype)
                    np.testing.assert_array_equal(half.astype(np.float32),
                                                  got[f"{w}_grad"].astype(half.dtype).astype(np.float32),
                                                  err_msg=f"{where}: {w}{suffix}")
        if FINITE in got:
            assert bool(np.asarray(got[FINITE]).reshape(-1)[0]) == (not oracle.bad), f"{where}: {FINITE}"
        if NORM in got and not oracle.bad:
            np.testing.assert_allclose(got[NORM], oracle.norm(), rtol=2e-4, atol=1e-6 * max(1.0, scale),
                                       err_msg=f"{where}: {NORM}")
        if last:
            applied = oracle.update(float(lr[0]), scale)
            summary["skipped"] += not applied
            if mp:
                scaler.update(bool(np.asarray(got[FINITE]).reshape(-1)[0]))
                mine.update(applied)
                summary["scales"].append(scale)
            if check_every_update:
                check_state(sess, oracle, case, where)
            if u in case.reload_new:  # a new session takes the state between updates
                state = sess.get_state()
                sess = make_session(case, model)
                sess.load_state(state, strict=True)
                check_state(sess, oracle, case, where + " (reloaded)")
        if k in case.evals:  # an evaluation: the model's output, no state change
            before = sess.get_state()
            out, = sess.run([OUTPUT[case.kind]], {"x": batch(case.kind, np.random.default_rng(k))["x"]}, path)
            _, want = forward(case.kind, oracle.p, batch(case.kind, np.random.default_rng(k)))
            np.testing.assert_allclose(out, want.detach().numpy(), err_msg=f"{where}: eval", **tol)
            after = sess.get_state()
            for n in before:
                np.testing.assert_array_equal(before[n], after[n], err_msg=f"{where}: eval changed {n}")
    check_state(sess, oracle, case, f"seed {case.seed} end")
    return summary


def main(argv: list[str]) -> int:
    start, stop = int(argv[0]), int(argv[1])
    failed = []
    for seed in range(start, stop):
        case = draw(seed)
        try:
            run_case(case)
        except Exception as e:  # noqa: BLE001 - a sweep reports every failure
            failed.append(seed)
            print(f"seed {seed} FAILED: {type(e).__name__}: {str(e)[:600]}\n  {case}", flush=True)
    print(f"{stop - start - len(failed)} passed, failed: {failed}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))


# ---------------------------------------------------------------------------------------------- 1.16.3
def peer_mlp() -> onnx.ModelProto:
    """x[N,5] → MatMul W1 + b1 → Tanh → MatMul W2 + b2 → SoftmaxCrossEntropyLoss(y), opset 17, every tensor of
    more than 8 values (1.16.3's ConstantSharing renames smaller float initializers, trained ones too)."""
    rng = np.random.default_rng(104)
    inits = [_init(rng, "W1", (5, 10), 0.5), _init(rng, "b1", (10,), 0.1), _init(rng, "W2", (10, 9), 0.5),
             _init(rng, "b2", (9,), 0.1)]
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["h0"]), helper.make_node("Add", ["h0", "b1"], ["h"]),
             helper.make_node("Tanh", ["h"], ["a"]), helper.make_node("MatMul", ["a", "W2"], ["z"]),
             helper.make_node("Add", ["z", "b2"], ["logits"]),
             helper.make_node("SoftmaxCrossEntropyLoss", ["logits", "y"], ["loss"])]
    g = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", T.FLOAT, ["N", 5]),
                                         helper.make_tensor_value_info("y", T.INT64, ["N"])],
                          [helper.make_tensor_value_info("loss", T.FLOAT, []),
                           helper.make_tensor_value_info("logits", T.FLOAT, ["N", 9])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


def peer_case(seed: int):
    """A combination 1.16.3's CPU build runs (SGD or Adam, one step per run, no mixed precision; its CPU Adam
    does not clip: ``legacy_cpu_adam`` on our side), as a :class:`tests.session.legacy_peer.Case`."""
    from tests.session.legacy_peer import Case as PeerCase
    from tests.session.legacy_peer import Step as PeerStep

    rng = np.random.default_rng(seed)
    model = peer_mlp()
    weights = ["W1", "W2", "b1", "b2"]
    opt = ["SGDOptimizer", "AdamOptimizer"][seed % 2]
    params: dict[str, Any] = {"loss_output_name": "loss", "training_optimizer_name": opt,
                              "enable_grad_norm_clip": bool(rng.random() < 0.5),
                              "set_gradients_as_graph_outputs": bool(rng.random() < 0.5)}
    if rng.random() < 0.3:
        params["lr_params_feed_name"] = "lr"
    r = rng.random()
    trained = weights
    if r < 0.35:
        trained = sorted(rng.choice(weights, size=int(rng.integers(1, 4)), replace=False).tolist())
        params["weights_to_train"] = trained
    elif r < 0.6:
        frozen = sorted(rng.choice(weights, size=int(rng.integers(1, 4)), replace=False).tolist())
        params["weights_not_to_train"] = frozen
        trained = [w for w in weights if w not in frozen]
    floats: dict[str, dict[str, float]] = {}
    ints: dict[str, dict[str, int]] = {}
    for w in trained:
        f: dict[str, float] = {}
        i: dict[str, int] = {}
        if opt == "AdamOptimizer":
            for key, values in (("alpha", [0.9, 0.8]), ("beta", [0.999, 0.95]), ("lambda", [0.0, 0.01, 0.1]),
                                ("epsilon", [1e-8, 1e-4]), ("max_norm_clip", [0.1, 1.0])):
                if rng.random() < 0.5:
                    f[key] = float(rng.choice(values))
            for key in ("do_bias_correction", "weight_decay_mode"):
                if rng.random() < 0.5:
                    i[key] = int(rng.integers(0, 2))
        floats[w], ints[w] = f, i
    params["optimizer_attributes_map"] = floats
    params["optimizer_int_attributes_map"] = ints
    initial = None
    shapes = {t.name: tuple(t.dims) for t in model.graph.initializer}
    if opt == "AdamOptimizer" and rng.random() < 0.4:
        initial = {w: {"Moment_1": (0.05 * rng.standard_normal(shapes[w])).astype(np.float32),
                       "Moment_2": (0.01 * rng.random(shapes[w]) + 1e-4).astype(np.float32),
                       "Update_Count": np.array([rng.integers(1, 5)], np.int64)} for w in trained}
    lr = params.get("lr_params_feed_name", "Learning_Rate")
    extra = ["global_gradient_norm"] if params["enable_grad_norm_clip"] else []
    if params["set_gradients_as_graph_outputs"]:
        extra += [f"{w}_grad" for w in trained]
    steps = []
    for k in range(int(rng.integers(3, 6))):
        n = int(rng.integers(3, 8))
        feed = {"x": rng.standard_normal((n, 5)).astype(np.float32), "y": rng.integers(0, 9, n),
                lr: np.array([rng.uniform(0.005, 0.1)], np.float32)}
        load = None
        if k and rng.random() < 0.25:  # other weights (and Adam counts) loaded before the run
            load = {w: (0.3 * rng.standard_normal(shapes[w])).astype(np.float32) for w in trained
                    if rng.random() < 0.6}
            if opt == "AdamOptimizer":
                load.update({f"Update_Count_{w}": np.array([rng.integers(1, 6)], np.int64) for w in trained})
        steps.append(PeerStep(feed, ["loss", "logits", *extra], load=load, strict=True))
        # (1.16.3 takes every input on a run of the path to its fetches alone, as on others)
        if extra and rng.random() < 0.3:  # the gradients or their norm alone: the path to them, no update
            steps.append(PeerStep(feed, extra, {"only_execute_path_to_fetches": True}))
        if rng.random() < 0.2:  # an evaluation of the logits
            steps.append(PeerStep(feed, ["logits"], {"only_execute_path_to_fetches": True}))
    case = PeerCase(model, params, steps, initial_state=initial,
                    ours={"legacy_cpu_adam": True} if opt == "AdamOptimizer" else {})
    return case, trained
