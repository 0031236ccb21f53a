"""Optimizer blocks (spec §1.8): AdamW (Hugging Face variant, onnxruntime's "mode 1"), SGD, and
ClipGradNorm, as standard ONNX nodes over one tensor per parameter.

``generate_artifacts`` calls an optimizer block inside an empty base with the names of the
graph inputs and gets back, for every input the step changes, the name of its new value
(see the interface note of ``onnxtrain.training.artifacts``).

Loss scaling (onnxtrain extension, for mixed-precision artifacts): ``build(..., loss_scale=name)``
takes gradients of ``loss · loss_scale``. It computes their global norm N (loss-scaled domain,
float32), the flag ``all_gradients_finite`` = isfinite(N), divides every gradient by
``s = L`` — or, with ``clip_grad``, ``s = max(L, (N + L·1e-6) / max_norm)``, which is
``ClipGradNorm``'s coefficient applied to the unscaled gradients (spec §10) — and guards every new
value with ``Where(flag, new, old)``: a non-finite step leaves parameters, moments and gradients as
they were. With ``clip_grad`` the gradients' new values are the clipped gradients times L: the
gradient buffers stay in the loss-scaled domain, as the training model fills them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

from onnxtrain.graph_transforms.clipping import HALF_TYPES, norm_type
from onnxtrain.ir.builder import half_widened
from onnxtrain.ir.types import held
from onnxtrain.training.onnxblock.blocks import Block, _acc
from onnxtrain.training.onnxblock.model_accessor import BlockError, ModelBase, detached
from onnxtrain.training.onnxblock.model_blocks import NOT_BUILT_FORWARD

CLIP_EPS = 1e-6
# the attribute defaults of onnxruntime's AdamWOptimizer operator (training_op_defs.cc): a node that leaves an
# attribute out runs with them, as onnxruntime-training's AdamW block writes for eps or weight_decay None
ADAMW_OPERATOR_DEFAULTS = {"alpha": 0.9, "beta": 0.999, "epsilon": 1e-8, "weight_decay": 1e-2,
                           "correct_bias": 1, "adam_mode": 0}
ALL_FINITE = "all_gradients_finite"


class ClipGradNorm(Block):
    """Scale all gradients by ``min(max_norm / (‖g‖ + 1e-6), 1)``, ‖g‖ the global L2 norm."""

    def __init__(self, max_norm: float) -> None:
        super().__init__()
        self.max_norm = float(max_norm)
        if not self.max_norm > 0:
            raise BlockError(f"ClipGradNorm: max_norm must be > 0, got {max_norm}")

    def build(self, *gradient_names: str) -> tuple[str, ...]:
        return self.clip(*gradient_names)[0]

    def clip(self, *gradient_names: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
        """(the clipped gradients in their own types, the same values before a float16/bfloat16 one is
        rounded to its type: float32, which an optimizer widening that parameter reads, so the step rounds
        once). A half gradient is clipped in float32 and rounded once: in the half type the coefficient and
        the product each rounded, and onnxruntime, which drops the coefficient's Cast to half in front of the
        half Mul it computes in float32, gave other bits than the graph (its step too)."""
        acc = _acc()
        if not gradient_names:
            return (), ()
        for g in gradient_names:
            vi = acc._input_named(g)
            if vi is not None and vi.type.HasField("sequence_type"):
                raise BlockError(f"ClipGradNorm: {g!r} is a tensor sequence; onnxtrain's optimizer blocks "
                                 "take the gradients as separate tensors, ClipGradNorm(max_norm)(*names) (a "
                                 "model of onnxruntime's sequence-based optimizer ops is converted as it is "
                                 "loaded: see the README)")
        types = [acc.float_type_of(g) for g in gradient_names]
        norm, et = _global_norm(acc, gradient_names, types)
        # coef = min(max_norm / (norm + eps), 1)
        ratio = acc.node(
            "Div",
            [
                acc.scalar(self.max_norm, et),
                acc.node("Add", [norm, acc.scalar(CLIP_EPS, et)], "add_output")[0],
            ],
            "div_output",
        )[0]
        coef = acc.node("Min", [ratio, acc.scalar(1.0, et)], "clip_coef")[0]
        coefs: dict[int, str] = {et: coef}
        out, wide = [], []
        for g, t in zip(gradient_names, types):
            if t in HALF_TYPES:
                w = acc.node("Mul", [acc.node("Cast", [g], "cast_output", to=et)[0], coef], "mul_output")[0]
                out.append(acc.node("Cast", [w], "clipped_gradient", to=t)[0])
                wide.append(w)
                continue
            if t not in coefs:
                coefs[t] = acc.node("Cast", [coef], "cast_output", to=t)[0]
            out.append(acc.node("Mul", [g, coefs[t]], "clipped_gradient")[0])
            wide.append(out[-1])
        return tuple(out), tuple(wide)

    def divisor(self, acc: ModelBase, norm: str, loss_scale: str, et: int) -> str:
        """s = max(L, (N + L·eps) / max_norm) for loss-scaled gradients of global norm N (scalars of
        type ``et``): dividing by s unscales, then clips as ``build`` does (g·min(max_norm/(‖g‖+eps), 1))."""
        eps_l = acc.node("Mul", [loss_scale, acc.scalar(CLIP_EPS, et)], "mul_output")[0]
        shifted = acc.node("Add", [norm, eps_l], "add_output")[0]
        over = acc.node("Div", [shifted, acc.scalar(self.max_norm, et)], "div_output")[0]
        return acc.node("Max", [loss_scale, over], "grad_divisor")[0]


def _global_norm(acc: ModelBase, grads: Sequence[str], types: Sequence[int]) -> tuple[str, int]:
    """(‖g‖ = sqrt(Σ_tensors Σ_elements g²), its element type): float64 when a gradient is float64, else
    float32, as the legacy session's norm (:func:`onnxtrain.graph_transforms.clipping.norm_type`)."""
    et = norm_type(types)
    parts = []
    for g, t in zip(grads, types):
        if t in HALF_TYPES:  # squares summed in the norm's type (a float16 sum overflows at a norm of 256)
            g = acc.node("Cast", [g], "cast_output", to=et)[0]
            t = et
        s = acc.node("ReduceSumSquare", [g], "reducesumsquare_output", keepdims=0)[0]
        parts.append(s if t == et else acc.node("Cast", [s], "cast_output", to=et)[0])
    total = parts[0] if len(parts) == 1 else acc.node("Sum", parts, "sum_output")[0]
    return acc.node("Sqrt", [total], "grad_norm")[0], et


class Optimizer(Block):
    """Base of the optimizer blocks.

    ``build(learning_rate, step, params, gradients, states)`` where ``states`` maps each name of
    ``state_names`` to one value per parameter; returns ``{input name: new value name}``. With
    ``loss_scale=`` (a float32 [1] input) the gradients are loss-scaled: see the module docstring;
    the result then also maps ``ALL_FINITE`` to the bool scalar flag.
    """

    name = ""
    state_names: tuple[str, ...] = ()

    def __init__(self, clip_grad: ClipGradNorm | None = None) -> None:
        super().__init__()
        if clip_grad is not None and not isinstance(clip_grad, ClipGradNorm):
            raise BlockError(
                f"clip_grad must be an onnxblock.optim.ClipGradNorm, got {type(clip_grad).__name__}"
            )
        self.clip_grad = clip_grad

    def hyperparameters(self) -> dict[str, Any]:
        return {"clip_grad_max_norm": None if self.clip_grad is None else self.clip_grad.max_norm}

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``block(parameters)`` inside ``onnxblock.empty_base()``, with the ``(trainable, frozen)``
        TensorProto lists of ``TrainingBlock.parameters()``, builds the whole optimizer model (the one
        ``generate_artifacts`` writes) into the base and returns its output names; ``to_model_proto()``
        gives it. Other calls build the update nodes into the base (``build``)."""
        if len(args) == 1 and not kwargs and _is_parameters(args[0]):
            return self._build_model(args[0])
        return super().__call__(*args, **kwargs)

    def _build_model(self, parameters: Any) -> list[str]:
        from onnxtrain.training.artifacts import build_optimizer_model  # it imports this package

        trainable = list(parameters[0])
        if not trainable:
            raise BlockError("the optimizer has no parameter to update: parameters()[0] is empty")
        params = [(t.name, helper.make_tensor_type_proto(t.data_type, list(t.dims))) for t in trainable]
        with detached() as acc:
            model = build_optimizer_model(self, params, acc.opset)
            acc.replace(model)
        self._model = model
        return [o.name for o in model.graph.output]

    def to_model_proto(self) -> Any:
        """The optimizer model built by ``block(parameters)``; RuntimeError before."""
        model = getattr(self, "_model", None)
        if model is None:
            raise BlockError(NOT_BUILT_FORWARD)
        return model

    def build(
        self,
        learning_rate: str,
        step: str,
        params: Sequence[str],
        gradients: Sequence[str],
        states: dict[str, Sequence[str]],
        loss_scale: str | None = None,
    ) -> dict[str, str]:
        acc = _acc()
        new: dict[str, str] = {}
        grads = list(gradients)
        wide: dict[str, str] = {}
        wide_type = TensorProto.FLOAT
        flag = None
        if loss_scale is not None:
            unscaled, flag, scales = self._unscale(acc, grads, loss_scale)
            if self.clip_grad is not None:  # clipped in place, kept loss-scaled: g·L
                new.update((g, acc.node("Mul", [u, scales[acc.float_type_of(g)]], "clipped_gradient")[0])
                           for g, u in zip(grads, unscaled))
            grads = unscaled
        elif self.clip_grad is not None:
            with_clip = self.clip_grad.clip(*grads)
            new.update(zip(grads, with_clip[0]))
            # half ones, clipped in the norm's type (float32; float64 when a gradient is float64)
            wide_type = norm_type([acc.float_type_of(g) for g in grads])
            wide = {g: w for g, c, w in zip(grads, *with_clip) if w != c}
            grads = list(with_clip[0])
        lr = acc.node("Squeeze", [learning_rate], "learning_rate")[0]  # [1] -> scalar: keeps param shapes
        t = acc.node("Squeeze", [step], "step")[0]
        shared: dict[int, dict[str, str]] = {}
        for k, (p, g) in enumerate(zip(params, grads)):
            et = self.compute_type(acc.float_type_of(p))
            if et not in shared:
                shared[et] = self.prepare(acc, lr, t, et)
            kept = {key: states[key][k] for key in self.state_names}
            if wide.get(gradients[k]) is not None and et != acc.float_type_of(p):
                # a half parameter that steps in float32 reads its clipped gradient before that is rounded
                self._widened = (g, wide[gradients[k]], wide_type)
            try:
                new.update(self.update(acc, shared[et], p, g, kept))
            finally:
                self._widened = None
        if flag is not None:
            # a non-finite step changes nothing: every new value falls back to its input
            new = {x: acc.node("Where", [flag, v, x], "if_finite")[0] for x, v in new.items()}
            new[ALL_FINITE] = flag
        return new

    def _unscale(self, acc: ModelBase, grads: list[str], loss_scale: str
                 ) -> tuple[list[str], str, dict[int, str]]:
        """(gradients / s, all_gradients_finite, {element type: scalar L}) for gradients of the loss
        times ``loss_scale``."""
        types = [acc.float_type_of(g) for g in grads]
        norm, et = _global_norm(acc, grads, types)  # of the loss-scaled gradients
        # isfinite(N): N is inf or NaN as soon as one gradient element is
        bad = acc.node("Or", [acc.node("IsInf", [norm], "isinf_output")[0],
                              acc.node("IsNaN", [norm], "isnan_output")[0]], "or_output")[0]
        flag = acc.node("Not", [bad], "all_gradients_finite")[0]
        scale = acc.node("Squeeze", [loss_scale], "loss_scale")[0]  # [1] -> scalar: keeps gradient shapes
        scale = _as_type(acc, scale, TensorProto.FLOAT, et)
        div = scale if self.clip_grad is None else self.clip_grad.divisor(acc, norm, scale, et)
        divs: dict[int, str] = {et: div}
        scales: dict[int, str] = {et: scale}
        out = []
        for g, t in zip(grads, types):
            if t not in divs:
                divs[t] = acc.node("Cast", [div], "cast_output", to=t)[0]
                scales[t] = acc.node("Cast", [scale], "cast_output", to=t)[0]
            out.append(acc.node("Div", [g, divs[t]], "unscaled_gradient")[0])
        return out, flag, scales

    # (a half gradient, its value before rounding, that value's type: the clip's norm type)
    _widened: tuple[str, str, int] | None = None

    def compute_type(self, elem_type: int) -> int:
        """The type the update of a parameter of ``elem_type`` computes in (its own)."""
        return elem_type

    def widen(self, acc: ModelBase, x: str, have: int, want: int) -> str:
        """``x`` of type ``have`` as type ``want``: a Cast, or the float32 value a half clipped gradient was
        rounded from (:meth:`ClipGradNorm.clip`; float64 when another gradient is float64, then cast to
        ``want``)."""
        if self._widened is not None and x == self._widened[0]:
            return _as_type(acc, self._widened[1], self._widened[2], want)
        return _as_type(acc, x, have, want)

    def prepare(self, acc: ModelBase, lr: str, t: str, et: int) -> dict[str, str]:
        """Scalars shared by all parameters whose update computes in ``et`` (:meth:`compute_type`)."""
        return {"lr": _as_type(acc, lr, TensorProto.FLOAT, et)}

    def update(
        self, acc: ModelBase, shared: dict[str, str], p: str, g: str, states: dict[str, str]
    ) -> dict[str, str]:
        raise NotImplementedError


def _is_parameters(v: Any) -> bool:
    """Whether ``v`` is a ``(trainable, frozen)`` pair of TensorProto lists (``TrainingBlock.parameters()``
    gives one)."""
    return (isinstance(v, (tuple, list)) and len(v) == 2 and all(isinstance(g, (list, tuple)) for g in v)
            and all(isinstance(t, onnx.TensorProto) for g in v for t in g))


def _moving_average(acc: ModelBase, old: str, new: str, beta: float, et: int, token: str,
                    squared: bool = False) -> str:
    """``old · β + new · (1 − β)`` (``squared``: ``old · β + (new · (1 − β)) · new``, finite where ``new²``
    overflows), the update of each of AdamW's two moments; 1 − β of the float32 β is exact, as
    onnxruntime-training's ``1.f - beta`` (without bias correction nothing cancels the rounding of 1 − 0.999
    to float32: its steps were 6e-6 larger)."""
    beta = held(beta, et)
    scaled = acc.node("Mul", [new, acc.scalar(1.0 - beta, et)], "mul_output")[0]
    if squared:
        scaled = acc.node("Mul", [scaled, new], "mul_output")[0]
    return acc.node("Add", [acc.node("Mul", [old, acc.scalar(beta, et)], "mul_output")[0], scaled], token)[0]


def _option(value: Any, name: str, default: float) -> float:
    """AdamW option ``name`` as a float, ``default`` for None; a BlockError naming it for anything else."""
    if value is None:
        return default
    try:
        return float(value)
    except (TypeError, ValueError):
        raise BlockError(f"AdamW: {name} must be a number (or None), got {value!r}") from None


def _as_type(acc: ModelBase, x: str, have: int, want: int) -> str:
    return x if have == want else acc.node("Cast", [x], "cast_output", to=want)[0]


class SGD(Optimizer):
    """Plain SGD: ``p ← p − lr·g`` (no momentum, no weight decay), as onnxruntime-training's.

    Declares a ``momentum0`` state (onnxruntime's first_order_moments) that it never reads.
    """

    name = "SGD"
    state_names = ("momentum0",)

    def compute_type(self, elem_type: int) -> int:
        """float32 for float16/bfloat16 parameters (the float32 rate, the new value rounded once, as
        onnxruntime's SGD kernel body widens: in the half type the rate, lr·g and the difference each
        rounded); else the parameter's own type."""
        return half_widened(elem_type)

    def update(
        self, acc: ModelBase, shared: dict[str, str], p: str, g: str, states: dict[str, str]
    ) -> dict[str, str]:
        pt = acc.float_type_of(p)
        et = self.compute_type(pt)
        pc, gc = (x if et == pt else self.widen(acc, x, pt, et) for x in (p, g))
        step = acc.node("Mul", [shared["lr"], gc], "mul_output")[0]
        if et == pt:
            return {p: acc.node("Sub", [pc, step], "updated_param")[0]}
        wide = acc.node("Sub", [pc, step], "sub_output")[0]
        return {p: acc.node("Cast", [wide], "updated_param", to=pt)[0]}


class AdamW(Optimizer):
    """AdamW as onnxruntime-training runs it (Hugging Face variant, spec §1.8)::

        m ← β1·m + (1−β1)·g ;  v ← β2·v + (1−β2)·g²
        lr_t = lr·sqrt(1−β2^t)/(1−β1^t)  (lr without bias correction)
        p ← p − lr_t·m/(sqrt(v) + eps)   (eps on the uncorrected sqrt(v))
        p ← p − lr·weight_decay·p        (decoupled, after the update)

    ``t`` is the ``step`` input. The bias corrections are computed in float64. A float16/bfloat16
    parameter's update computes in float32 (:meth:`compute_type`); its moments stay in its type.
    """

    name = "AdamW"
    state_names = ("momentum0", "momentum1")

    def __init__(
        self,
        bias_correction: bool | None = True,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float | None = 1e-6,
        weight_decay: float | None = 0.0,
        clip_grad: ClipGradNorm | None = None,
    ) -> None:
        """``eps`` or ``weight_decay`` None: the AdamWOptimizer operator's default, 1e-8 and 1e-2, as in
        onnxruntime-training's block (which then writes no attribute); ``bias_correction`` None: off."""
        super().__init__(clip_grad)
        if len(betas) != 2:
            raise BlockError(f"AdamW: betas must be a pair (beta1, beta2), got {betas!r}")
        self.bias_correction = bool(bias_correction)
        self.betas = (float(betas[0]), float(betas[1]))
        self.eps = _option(eps, "eps", ADAMW_OPERATOR_DEFAULTS["epsilon"])
        self.weight_decay = _option(weight_decay, "weight_decay", ADAMW_OPERATOR_DEFAULTS["weight_decay"])

    def hyperparameters(self) -> dict[str, Any]:
        return {
            "bias_correction": self.bias_correction,
            "betas": list(self.betas),
            "eps": self.eps,
            "weight_decay": self.weight_decay,
            **super().hyperparameters(),
        }

    def prepare(self, acc: ModelBase, lr: str, t: str, et: int) -> dict[str, str]:
        out = {"lr": _as_type(acc, lr, TensorProto.FLOAT, et)}
        if self.bias_correction:
            dbl = TensorProto.DOUBLE
            td = acc.node("Cast", [t], "cast_output", to=dbl)[0]
            one = acc.scalar(1.0, dbl)
            c1 = acc.node(
                "Sub",
                [one, acc.node("Pow", [acc.scalar(held(self.betas[0], et), dbl), td], "pow_output")[0]],
                "sub_output",
            )[0]
            c2 = acc.node(
                "Sub",
                [one, acc.node("Pow", [acc.scalar(held(self.betas[1], et), dbl), td], "pow_output")[0]],
                "sub_output",
            )[0]
            lr_d = acc.node("Cast", [lr], "cast_output", to=dbl)[0]
            lr_t = acc.node(
                "Div",
                [acc.node("Mul", [lr_d, acc.node("Sqrt", [c2], "sqrt_output")[0]], "mul_output")[0], c1],
                "div_output",
            )[0]
            out["lr_t"] = _as_type(acc, lr_t, dbl, et)
        else:
            out["lr_t"] = out["lr"]
        if self.weight_decay:  # p·(1 − lr·λ): a scalar factor, one pass over each parameter
            decay = acc.node("Mul", [out["lr"], acc.scalar(self.weight_decay, et)], "mul_output")[0]
            out["keep"] = acc.node("Sub", [acc.scalar(1.0, et), decay], "sub_output")[0]
        return out

    def compute_type(self, elem_type: int) -> int:
        """float32 for float16/bfloat16 parameters, as onnxruntime's optimizer kernels (its CPU AdamWOptimizer
        takes float only; the legacy session's Adam: ``onnxtrain.ir.builder.half_widened``): in float16 eps
        1e-8 is 0 and (1 − β2)·g² underflows for |g| < 7.7e-3. Else the parameter's own type."""
        return half_widened(elem_type)

    def update(
        self, acc: ModelBase, shared: dict[str, str], p: str, g: str, states: dict[str, str]
    ) -> dict[str, str]:
        pt = acc.float_type_of(p)
        et = self.compute_type(pt)
        b1, b2 = self.betas
        m, v = states["momentum0"], states["momentum1"]
        # a half parameter: parameter, gradient and moments (kept in its type) cast to float32, the new
        # values cast back (below); float32/float64 parameters: the nodes as they were
        pc, gc, mc, vc = (x if et == pt else self.widen(acc, x, pt, et) for x in (p, g, m, v))
        m_new = _moving_average(acc, mc, gc, b1, et, "momentum0")
        v_new = _moving_average(acc, vc, gc, b2, et, "momentum1", squared=True)
        denom = acc.node(
            "Add", [acc.node("Sqrt", [v_new], "sqrt_output")[0], acc.scalar(self.eps, et)], "add_output"
        )[0]
        upd = acc.node(
            "Mul", [shared["lr_t"], acc.node("Div", [m_new, denom], "div_output")[0]], "mul_output"
        )[0]
        p_new = acc.node("Sub", [pc, upd], "sub_output" if self.weight_decay else "updated_param")[0]
        if self.weight_decay:
            p_new = acc.node("Mul", [p_new, shared["keep"]], "updated_param")[0]
        if et != pt:
            if pt == TensorProto.FLOAT16:
                # a second moment at least float16's smallest positive value, as the legacy session keeps
                # one (``Optimizer.store_moment``): one that rounded to 0 while the first moment did not
                # would make the next step m / (√0 + ε), up to a million times too large
                tiny = float(np.finfo(np.float16).smallest_subnormal)
                v_new = acc.node("Max", [v_new, acc.scalar(tiny, et)], "max_output")[0]
            p_new, m_new, v_new = (acc.node("Cast", [x], token, to=pt)[0] for x, token in
                                   ((p_new, "updated_param"), (m_new, "momentum0"), (v_new, "momentum1")))
        return {p: p_new, m: m_new, v: v_new}


__all__ = ["ALL_FINITE", "AdamW", "ClipGradNorm", "Optimizer", "SGD"]


# onnxruntime's names of the blocks under AdamW and SGD (there, its com.microsoft optimizer nodes)
AdamWOptimizer = AdamW
SGDOptimizer = SGD
