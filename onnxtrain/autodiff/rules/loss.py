"""Gradient rules of the losses and Dropout (same names as engine/kernels/loss.py).

Labels, class weights, Dropout's ratio and training_mode get no gradient.
"""

from __future__ import annotations

import numpy as np
from onnx import TensorProto

from onnxtrain.autodiff.context import GradCtx, RuleError
from onnxtrain.autodiff.registry import gradient
from onnxtrain.autodiff.rules.reduce import constant_value


def _class_factor(g: GradCtx) -> tuple[str, str | None]:
    """(labels with ignored entries set to 0, per-sample factor f or None) for inputs (x, labels, weights).

    loss_i = w_i·ℓ_i with w_i = weight[label_i] (1 without weights) and 0 for ignored samples;
    reduction none: dℓ_i = dL_i·w_i; sum: dL·w_i; mean: dL·w_i/Σw. f is shaped like the labels,
    or a scalar; None stands for 1.
    """
    lab = g.x(1)
    lt = g.elem_type(lab)
    ii = g.attr("ignore_index")
    ignored = None
    if ii is not None:
        ignored = g.emit("Equal", lab, g.const(ii, lt))
        lab = g.emit("Where", ignored, g.const(0, lt), lab)
    w = g.emit("Gather", g.x(2), lab) if g.has_x(2) else None
    if ignored is not None:
        kf = g.emit("Where", ignored, g.const(0.0), g.const(1.0))  # 1 for a kept sample, 0 for an ignored one
        w = kf if w is None else g.emit("Mul", w, kf)
    dl = g.dy(0)
    red = g.attr("reduction")
    if red == "mean":
        if w is not None:
            # Σw = 0 (every sample ignored, or zero-weighted): the loss is 0/0 = nan, but each w_i is 0,
            # so the gradient is 0 as torch's; dividing by 1 there keeps 0·(dL/0) = nan out (scalar ops).
            # Without class weights Σw counts the kept samples (0 or at least 1): Max(Σw, 1) is that choice
            tw = g.emit("ReduceSum", w, keepdims=0)
            if g.has_x(2):
                dl = g.emit("Div", dl, g.emit("Where", g.emit("Equal", tw, g.const(0)), g.const(1), tw))
            else:
                dl = g.emit("Div", dl, g.emit("Max", tw, g.const(1)))
        else:
            dl = g.emit("Div", dl, _count(g))
    f = dl if w is None else g.emit("Mul", dl, w)
    return lab, f


def _count(g: GradCtx) -> str:
    """The number of samples N·d1·… (the labels' size), of the node's float type."""
    ls = g.static_shape(1)
    if ls is not None and all(d is not None for d in ls):
        n = 1
        for d in ls:
            n *= d  # type: ignore[operator]
        return g.const(float(n))
    return g.emit("Cast", g.emit("Size", g.x(1)), to=g.dtype)


def _spread(g: GradCtx, t: str, f: str, per_sample: bool) -> str:
    """``t`` (N, C, d…) times the factor ``f``: per sample (N, d…) gets a class axis first."""
    return g.emit("Mul", t, g.emit("Unsqueeze", f, g.ints([1])) if per_sample else f)


def _is_label(g: GradCtx, lab: str) -> str:
    """Bool (N, C, d…): class c is sample i's label. Equal against a class iota rather than OneHot,
    which onnxruntime lacks for float64 values."""
    lt = g.elem_type(g.node.input[1])  # the labels' integer type
    r = g.rank(0)
    xs = g.static_shape(0)
    if r is not None and xs is not None and xs[1] is not None:
        iota = g.const(np.arange(xs[1]).reshape((xs[1],) + (1,) * (r - 2)), lt)
    else:
        if r is None:
            raise RuleError(f"{g.node.op_type} gradient needs the rank of the scores "
                            "(shape inference found none)")
        c = g.emit("Gather", g.shape(0), g.const(1, TensorProto.INT64))
        iota = g.emit("Range", g.const(0, TensorProto.INT64), c, g.const(1, TensorProto.INT64))
        if lt != TensorProto.INT64:
            iota = g.emit("Cast", iota, to=lt)
        if r > 2:
            iota = g.emit("Unsqueeze", iota, g.ints(range(1, r - 1)))
    return g.emit("Equal", g.emit("Unsqueeze", lab, g.ints([1])), iota)


def _minus_one_hot(g: GradCtx, p: str, lab: str) -> str:
    """``p − OneHot(lab)`` over the class axis 1, as a ScatterElements adding −1 at each sample's label
    (the same values as the subtraction, without building the one-hot tensor; gradient graphs are at
    opset ≥ 17, where ScatterElements has reductions)."""
    idx = g.emit("Unsqueeze", lab, g.ints([1]))
    minus_one = g.emit("Expand", g.const(-1.0), g.emit("Shape", idx))
    return g.emit("ScatterElements", p, idx, minus_one, axis=1, reduction="add")


def _per_sample(g: GradCtx) -> bool:
    return g.has_x(2) or g.attr("ignore_index") is not None or g.attr("reduction") == "none"


def _check_scores_rank(g: GradCtx) -> None:
    """RuleError unless the scores are (N, C, ...) and the labels (N, ...), where their ranks are known
    (an invalid model would otherwise give a gradient graph that only fails when checked or run)."""
    rs, rl = g.rank(0), g.rank(1)
    if rs is not None and rs < 2:
        raise RuleError(f"{g.node.op_type} needs scores of shape (N, C, ...), got rank {rs} "
                        f"({g.node.input[0]!r}); the model is invalid")
    if rs is not None and rl is not None and rl != rs - 1:
        raise RuleError(f"{g.node.op_type} needs labels of rank {rs - 1} for scores of rank {rs}, got "
                        f"rank {rl} ({g.node.input[1]!r}); the model is invalid")


@gradient("SoftmaxCrossEntropyLoss", uses=("x1", "x2", "y1"), stop=(1, 2), uncomputed=(2,))
def softmax_cross_entropy_grad(g: GradCtx) -> None:
    # ℓ_i = −log_prob[i, label_i]:  dScores = (Exp(log_prob) − OneHot(label))·f  (f: see _class_factor);
    # a gradient into the log_prob output adds the LogSoftmax backward dLP − Exp(LP)·Σ_c dLP.
    _check_scores_rank(g)
    lp = g.y(1)
    p = g.emit("Exp", lp)
    parts = []
    if g.dy(0) is not None:
        lab, f = _class_factor(g)
        parts.append(_spread(g, _minus_one_hot(g, p, lab), f, _per_sample(g)))
    dlp = g.dy(1)
    if dlp is not None:
        s = g.reduce("ReduceSum", dlp, [1], keepdims=1)
        parts.append(g.emit("Sub", dlp, g.emit("Mul", p, s)))
    g.set_dx(0, parts[0] if len(parts) == 1 else g.emit("Add", *parts))


@gradient("NegativeLogLikelihoodLoss", uses=("x1", "x2"), stop=(1, 2), uncomputed=(2,))
def nll_loss_grad(g: GradCtx) -> None:
    # ℓ_i = −input[i, label_i]:  dInput = −f at the label's class, 0 elsewhere
    _check_scores_rank(g)
    lab, f = _class_factor(g)
    neg = g.emit("Neg", g.emit("Unsqueeze", f, g.ints([1])) if _per_sample(g) else f)
    g.set_dx(0, g.emit("Where", _is_label(g, lab), neg, g.const(0)))


@gradient("Dropout", uses=("x1", "x2", "y1"), stop=(1, 2), uncomputed=(1,))
def dropout_grad(g: GradCtx) -> None:
    # training: dX = dY·mask/(1 − ratio) with the forward's own mask (output 1, added if omitted);
    # inference (training_mode absent or false): dX = dY. A dynamic training_mode selects the scale
    # at run time (the mask is all true in inference mode).
    dy = g.dy(0)
    training: bool | str = False
    if g.has_x(2):
        v = constant_value(g, g.node.input[2])
        training = g.x(2) if v is None else bool(v.reshape(-1)[0])
    if training is False:
        g.set_dx(0, dy)
        return
    scale: float | str = 2.0  # ratio 0.5 by default
    if g.has_x(1):
        v = constant_value(g, g.node.input[1])
        if v is None:
            ratio = g.x(1)
            if g.elem_type(ratio) != g.dtype:
                ratio = g.emit("Cast", ratio, to=g.dtype)
            scale = g.emit("Reciprocal", g.emit("Sub", g.const(1), ratio))
        else:
            scale = 1.0 / (1.0 - float(v.reshape(-1)[0])) if float(v.reshape(-1)[0]) != 1 else 0.0
    if scale == 1.0:  # ratio 0: nothing dropped
        g.set_dx(0, dy)
        return
    s = g.const(scale) if isinstance(scale, float) else scale
    if isinstance(training, str):
        s = g.emit("Where", training, s, g.const(1))
    g.set_dx(0, g.emit("Where", g.y(1), g.emit("Mul", dy, s), g.const(0)))
