"""Loss blocks (spec §1.7): MSELoss, L1Loss, BCEWithLogitsLoss, CrossEntropyLoss.

Each ``build(prediction, target_name=...)`` uses the target value if the model already has one
of that name, else creates a graph input for it, and returns the loss. ``reduction`` is "mean"
(over all elements; CrossEntropyLoss: over the non-ignored samples), "sum" or "none".

Fixes over onnxruntime-training 1.19.2: BCEWithLogitsLoss is the stable log-sum-exp form (no NaN
for large logits); CrossEntropyLoss declares its labels right for scores of any rank ≥ 2 (classes on
axis 1, as the ONNX op, torch and onnxruntime's kernels take them; onnxruntime-training declared the
labels as if they were last), and ``class_axis=-1`` takes logits ``[B, T, C]`` with labels ``[B, T]``;
``weight`` may be a numpy array; ``reduction="none"`` works for every loss.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.ir.types import np_dtype
from onnxtrain.training.onnxblock.blocks import Block, InputLike, Softplus, _acc, reduce
from onnxtrain.training.onnxblock.model_accessor import BlockError, ModelBase, UnknownValue

REDUCTIONS = ("mean", "sum", "none")


def _check_reduction(reduction: str) -> str:
    if reduction not in REDUCTIONS:
        raise BlockError(f"Reduction {reduction} not supported. Use one of {', '.join(REDUCTIONS)}.")
    return reduction


def _reduce(acc: ModelBase, x: str, reduction: str) -> str:
    if reduction == "none":
        return x
    op = "ReduceMean" if reduction == "mean" else "ReduceSum"
    return reduce(acc, op, x, None, 0, op.lower() + "_output")


def _float_const(acc: ModelBase, value: Any, like: str, token: str) -> str:
    arr = np.asarray(value, dtype=np_dtype(acc.float_type_of(like)))
    return acc.initializer(arr, token)


class _PointwiseLoss(Block):
    """``reduce(f(x - target))`` for an elementwise ``f`` given by :meth:`_of_difference`."""

    def __init__(self, reduction: str = "mean") -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction)

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        acc = _acc()
        target = InputLike(loss_input_name)(target_name)
        d = acc.node("Sub", [loss_input_name, target], "sub_output")[0]
        return _reduce(acc, self._of_difference(acc, d), self.reduction)

    def _of_difference(self, acc: ModelBase, d: str) -> str:
        raise NotImplementedError


class MSELoss(_PointwiseLoss):
    """``reduce((x - target)²)``."""

    def _of_difference(self, acc: ModelBase, d: str) -> str:
        return acc.node("Mul", [d, d], "mul_output")[0]


class L1Loss(_PointwiseLoss):
    """``reduce(|x - target|)``."""

    def _of_difference(self, acc: ModelBase, d: str) -> str:
        return acc.node("Abs", [d], "abs_output")[0]


class BCEWithLogitsLoss(Block):
    """``reduce(weight · [(1 − t)·x + (1 + (pos_weight − 1)·t)·softplus(−x)])``.

    Equal to ``−weight·[pos_weight·t·log σ(x) + (1 − t)·log(1 − σ(x))]`` (the reference's naive
    form) but finite for any logit.
    """

    def __init__(self, weight: Any = None, reduction: str = "mean", pos_weight: Any = None) -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction)
        self.weight = None if weight is None else np.asarray(weight)
        self.pos_weight = None if pos_weight is None else np.asarray(pos_weight)
        self.softplus = Softplus()

    def build(self, loss_input_name: str, target_name: str = "target") -> str:
        acc = _acc()
        x = loss_input_name
        et = acc.float_type_of(x)
        t = InputLike(x)(target_name)
        one = acc.scalar(1.0, et)
        sp = self.softplus(acc.node("Neg", [x], "neg_output")[0])  # softplus(−x) = −log σ(x)
        lin = acc.node("Mul", [acc.node("Sub", [one, t], "sub_output")[0], x], "mul_output")[0]  # (1 − t)·x
        if self.pos_weight is not None:
            pw1 = _float_const(acc, self.pos_weight - 1, x, "bce.pos_weight_minus_one")
            sp = acc.node(
                "Mul",
                [acc.node("Add", [one, acc.node("Mul", [pw1, t], "mul_output")[0]], "add_output")[0], sp],
                "mul_output",
            )[0]
        loss = acc.node("Add", [lin, sp], "add_output")[0]
        if self.weight is not None:
            loss = acc.node("Mul", [loss, _float_const(acc, self.weight, x, "bce.weight")], "mul_output")[0]
        return _reduce(acc, loss, self.reduction)


class CrossEntropyLoss(Block):
    """``SoftmaxCrossEntropyLoss(scores, labels[, weight])``: scores ``[N, C, d1, ...]``, classes on axis 1
    as in the ONNX op and ``torch.nn.functional.cross_entropy``.

    The labels input (created when absent) is INT64 with the scores' shape minus the class axis.
    ``class_axis=-1`` (onnxtrain's) takes classes on the last axis instead, e.g. a language model's logits
    ``[B, T, C]`` with labels ``[B, T]``: the scores are then transposed to the op's layout.
    """

    def __init__(self, weight: Any = None, reduction: str = "mean", ignore_index: int | None = None,
                 class_axis: int = 1) -> None:
        super().__init__()
        self.reduction = _check_reduction(reduction)
        self.weight = None if weight is None else np.asarray(weight)
        self.ignore_index = None if ignore_index is None else int(ignore_index)
        if class_axis not in (1, -1):
            raise BlockError(f"CrossEntropyLoss: class_axis must be 1 (the ONNX layout) or -1 (the last "
                             f"axis), got {class_axis!r}")
        self.class_axis = class_axis

    def build(self, scores_input_name: str, labels_name: str = "labels") -> str:
        acc = _acc()
        x = scores_input_name
        if not acc.has_value(x):
            raise UnknownValue(f"CrossEntropyLoss: its scores {x!r} are not a value of the model")
        shape = acc.shape(x)
        if shape is None or len(shape) < 2:
            got = "an unknown rank" if shape is None else f"shape {shape}"
            raise BlockError(f"CrossEntropyLoss needs scores of known rank >= 2; {x!r} has {got}")
        last = self.class_axis == -1
        if not acc.has_value(labels_name):
            tp = helper.make_tensor_type_proto(TensorProto.INT64, None)
            for d in (shape[:-1] if last else [shape[0], *shape[2:]]):
                dim = tp.tensor_type.shape.dim.add()
                if isinstance(d, int):
                    dim.dim_value = d
                elif isinstance(d, str):
                    dim.dim_param = d
            acc.add_input(labels_name, tp)
        if last and len(shape) > 2:  # [B, d1.., C] -> [B, C, d1..]
            x = acc.node(
                "Transpose", [x], "transpose_output", perm=[0, len(shape) - 1, *range(1, len(shape) - 1)]
            )[0]
        inputs = [x, labels_name]
        if self.weight is not None:
            inputs.append(_float_const(acc, self.weight, x, "celoss.weight"))
        return acc.node(
            "SoftmaxCrossEntropyLoss",
            inputs,
            "loss",
            reduction=self.reduction,
            ignore_index=self.ignore_index,
        )[0]


__all__ = ["BCEWithLogitsLoss", "CrossEntropyLoss", "L1Loss", "MSELoss"]
