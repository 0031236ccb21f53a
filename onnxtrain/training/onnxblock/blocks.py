"""Building blocks (spec §1.9): each call appends standard ONNX nodes to the base model and
returns the name(s) of the new value(s).

Write a custom loss by subclassing :class:`Block`::

    class HalfMSE(onnxblock.Block):
        def __init__(self):
            super().__init__()
            self.mse = onnxblock.loss.MSELoss()
            self.mul = onnxblock.blocks.Mul()
            self.half = onnxblock.blocks.Constant(0.5)

        def build(self, output_name):
            return self.mul(self.mse(output_name), self.half())

Differences from onnxruntime-training: constants are 0-d (a scalar times a scalar loss stays a
scalar), a constant takes the element type of the tensor it is combined with (float64 and
float16 models), and ``ReduceAllL2`` is built from standard ops.
"""

from __future__ import annotations

import abc
import os
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto

from onnxtrain.training.onnxblock.model_accessor import BlockError, ModelBase, check_after_block, current


class Block(abc.ABC):
    """A callable that appends nodes to the base model; subclasses implement ``build``.

    ``build(*input_names)`` returns a tensor name or a tuple of names. ``self.base`` is the
    ModelProto being edited during the call.
    """

    def __init__(self, temp_file_name: str = "temp.onnx") -> None:
        # onnxruntime-training saved the model there between blocks when the base had a path (external
        # data); onnxtrain edits it in memory, and only checks the name as onnxruntime did
        if os.path.isabs(temp_file_name):
            raise RuntimeError("Please pass in a relative path for the temp_file_name.")
        self.temp_file_name = temp_file_name
        self.base: onnx.ModelProto | None = None

    @abc.abstractmethod
    def build(self, *args: Any, **kwargs: Any) -> Any:
        """Append the block's nodes; return the output name(s)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        """``build`` on the current base; in ``base()``/``empty_base()`` the model must then pass
        onnx.checker (after the outermost call: a block may leave it incomplete for the block that called
        it), else BlockError naming the block."""
        acc = current()
        self.base = acc.model
        acc.depth += 1
        try:
            result = self.build(*args, **kwargs)
        finally:
            acc.depth -= 1
        if acc.depth == 0 and acc.check_calls:
            check_after_block(acc, type(self).__name__)
        return result

    def infer_shapes_on_base(self) -> onnx.ModelProto:
        """The model being edited, with the value infos ONNX shape inference gives it (a copy)."""
        return onnx.shape_inference.infer_shapes(current().model)


def _acc() -> ModelBase:
    return current()


# ---- elementwise ------------------------------------------------------------------------------------
class _Binary(Block):
    op = ""
    token = ""

    def build(self, input_name1: str, input_name2: str) -> str:
        acc = _acc()
        a, b = acc.align(input_name1, input_name2)
        return acc.node(self.op, [a, b], self.token)[0]


class Add(_Binary):
    """``a + b`` (broadcasting)."""

    op, token = "Add", "add_output"


class Sub(_Binary):
    """``a - b``."""

    op, token = "Sub", "sub_output"


class Mul(_Binary):
    """``a * b``."""

    op, token = "Mul", "mul_output"


class Div(_Binary):
    """``a / b``."""

    op, token = "Div", "div_output"


class Max(_Binary):
    """Elementwise maximum of two tensors."""

    op, token = "Max", "max_output"


class Min(_Binary):
    """Elementwise minimum of two tensors."""

    op, token = "Min", "min_output"


class _Unary(Block):
    op = ""
    token = ""

    def build(self, input_name: str) -> str:
        return _acc().node(self.op, [input_name], self.token)[0]


class Neg(_Unary):
    op, token = "Neg", "neg_output"


class Abs(_Unary):
    op, token = "Abs", "abs_output"


class Log(_Unary):
    op, token = "Log", "log_output"


class Exp(_Unary):
    op, token = "Exp", "exp_output"


class Sqrt(_Unary):
    op, token = "Sqrt", "sqrt_output"


class Sigmoid(_Unary):
    op, token = "Sigmoid", "sigmoid_output"


class Tanh(_Unary):
    op, token = "Tanh", "tanh_output"


class Relu(_Unary):
    op, token = "Relu", "relu_output"


class Identity(_Unary):
    op, token = "Identity", "identity_output"


class Pow(Block):
    """``x ** exponent`` with a constant exponent."""

    def __init__(self, exponent: float) -> None:
        super().__init__()
        self.exponent = float(exponent)

    def build(self, pow_input_name: str) -> str:
        acc = _acc()
        e = acc.scalar(self.exponent, acc.float_type_of(pow_input_name))
        return acc.node("Pow", [pow_input_name, e], "pow_output")[0]


class Softplus(Block):
    """``log(1 + exp(x))`` without overflow, with the exact gradient ``sigmoid(x)`` everywhere.

    As ``max(x, 0) + log(1 + exp(-|x|))`` where max and |x| are built from one ``Where`` each,
    so no kink of Max/Abs (whose gradient at 0 would be a tie) and no ``exp`` of a large value.
    """

    def build(self, input_name: str) -> str:
        acc = _acc()
        et = acc.float_type_of(input_name)
        zero = acc.scalar(0.0, et)
        pos = acc.node("Greater", [input_name, zero], "greater_output")[0]
        xp = acc.node("Where", [pos, input_name, zero], "where_output")[0]  # max(x, 0)
        xn = acc.node("Where", [pos, zero, input_name], "where_output")[0]  # min(x, 0)
        e = acc.node("Exp", [acc.node("Sub", [xn, xp], "sub_output")[0]], "exp_output")[0]  # exp(-|x|) <= 1
        lg = acc.node("Log", [acc.node("Add", [e, acc.scalar(1.0, et)], "add_output")[0]], "log_output")[0]
        return acc.node("Add", [xp, lg], "softplus_output")[0]


class Clip(Block):
    """``Clip(x, clip_min, clip_max)`` with optional constant bounds."""

    def __init__(self, clip_min: float | None = None, clip_max: float | None = None) -> None:
        super().__init__()
        self.clip_min, self.clip_max = clip_min, clip_max

    def build(self, clip_input_name: str) -> str:
        acc = _acc()
        et = acc.float_type_of(clip_input_name)
        lo = acc.scalar(self.clip_min, et) if self.clip_min is not None else ""
        hi = acc.scalar(self.clip_max, et) if self.clip_max is not None else ""
        inputs = [clip_input_name, lo, hi]
        while inputs[-1] == "":
            inputs.pop()
        return acc.node("Clip", inputs, "clip_output")[0]


class Cast(Block):
    """``Cast(x, to)``; ``to`` is an ONNX element type (``onnx.TensorProto.FLOAT`` ...)."""

    def __init__(self, to: int) -> None:
        super().__init__()
        self.to = int(to)

    def build(self, cast_input_name: str) -> str:
        return _acc().node("Cast", [cast_input_name], "cast_output", to=self.to)[0]


# ---- reductions -------------------------------------------------------------------------------------
class _Reduce(Block):
    op = ""
    token = ""

    def __init__(self, keepdims: bool = True, axes: list[int] | None = None) -> None:
        super().__init__()
        self.keepdims = int(bool(keepdims))
        self.axes = None if axes is None else [int(a) for a in axes]

    def build(self, input_name: str) -> str:
        return reduce(_acc(), self.op, input_name, self.axes, self.keepdims, self.token)


def reduce(acc: ModelBase, op: str, x: str, axes: list[int] | None, keepdims: int, token: str) -> str:
    """``op`` over ``axes`` (all axes when None), axes as input or attribute as the opset wants."""
    if axes is None:
        return acc.node(op, [x], token, keepdims=keepdims)[0]
    as_input = acc.opset >= (13 if op == "ReduceSum" else 18)
    if as_input:
        return acc.node(op, [x, acc.initializer(axes, "axes", "int64")], token, keepdims=keepdims)[0]
    return acc.node(op, [x], token, axes=axes, keepdims=keepdims)[0]


class ReduceMean(_Reduce):
    """Mean over all axes (or ``axes``); ``keepdims=False`` gives a scalar."""

    op, token = "ReduceMean", "reducemean_output"


class ReduceSum(_Reduce):
    """Sum over all axes (or ``axes``)."""

    op, token = "ReduceSum", "reducesum_output"


class ReduceSumSquare(_Reduce):
    """Sum of squares over all axes (or ``axes``)."""

    op, token = "ReduceSumSquare", "reducesumsquare_output"


class ReduceAllL2(Block):
    """``sqrt(Σ over all inputs and elements of x²)``, a scalar (standard ops, unlike onnxruntime's)."""

    def build(self, *input_names: str) -> str:
        acc = _acc()
        if not input_names:
            raise BlockError("ReduceAllL2 needs at least one input")
        parts = [
            acc.node("ReduceSumSquare", [x], "reducesumsquare_output", keepdims=0)[0] for x in input_names
        ]
        total = parts[0] if len(parts) == 1 else acc.node("Sum", parts, "sum_output")[0]
        return acc.node("Sqrt", [total], "reduceall_l2_output")[0]


# ---- constants and inputs ---------------------------------------------------------------------------
class Constant(Block):
    """A 0-d constant (``build()`` takes no input); float32 unless ``dtype`` is given.

    Combined with a tensor of another float type in a binary block it takes that type.
    """

    def __init__(self, value_float: float, dtype: int = TensorProto.FLOAT) -> None:
        super().__init__()
        self.value = float(value_float)
        self.dtype = int(dtype)

    def build(self) -> str:
        return _acc().scalar(self.value, self.dtype)


class InputLike(Block):
    """A new graph input named ``input_name`` (a generated name if None) with the type and shape of value
    ``like``.

    If a value named ``input_name`` already exists it is returned unchanged.
    """

    def __init__(self, like: str) -> None:
        super().__init__()
        self.like = like

    def build(self, input_name: str | None = None) -> str:
        acc = _acc()
        if input_name is None:  # a generated name, as onnxruntime-training's
            input_name = acc.fresh("input")
        if acc.has_value(input_name):
            return input_name
        tp = onnx.TypeProto()
        tp.CopyFrom(acc.type_of(self.like))
        return acc.add_input(input_name, tp)


class PassThrough(Block):
    """Returns its inputs unchanged, as a tuple of names (one element for one input, as onnxruntime's)."""

    def build(self, *input_names: str) -> tuple[str, ...]:
        return tuple(input_names)


class SequenceConstruct(Block):
    """A sequence of the given tensors (``SequenceConstruct``)."""

    def build(self, *input_names: str) -> str:
        if not input_names:
            raise BlockError("SequenceConstruct needs at least one tensor")
        return _acc().node("SequenceConstruct", list(input_names), "sequenceconstruct_output")[0]


# ---- layers -----------------------------------------------------------------------------------------
class Linear(Block):
    """``Gemm(x, W, b, alpha, beta)`` with new float32 parameters drawn from numpy's global normal
    generator (seed it with ``np.random.seed`` for the same draws): W of shape ``(in_features,
    out_features)`` (not torch's layout) and, with ``bias``, b of ``(out_features,)``, as onnxruntime's
    block makes them."""

    def __init__(self, in_features: int, out_features: int, bias: bool = True, alpha: float = 1.0,
                 beta: float = 1.0) -> None:
        super().__init__()
        if in_features < 1 or out_features < 1:
            raise BlockError(f"Linear: in_features and out_features must be >= 1, got {in_features}, "
                             f"{out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bias, self.alpha, self.beta = bool(bias), float(alpha), float(beta)

    def build(self, linear_input_name: str) -> str:
        acc = _acc()
        inputs = [linear_input_name,
                  acc.initializer(np.random.randn(self.in_features, self.out_features), "linear.weight",
                                  np.float32)]
        if self.bias:
            inputs.append(acc.initializer(np.random.randn(self.out_features), "linear.bias", np.float32))
        return acc.node("Gemm", inputs, "linear.output", alpha=self.alpha, beta=self.beta)[0]


class LabelEncoder(Block):
    """``ai.onnx.ml.LabelEncoder``: maps keys (floats, int64s or strings) to values. The block writes the node
    (and the ``ai.onnx.ml`` opset) as onnxruntime's does (the numpy engine runs it:
    :mod:`onnxtrain.engine.kernels.ml`)."""

    def __init__(self, default_float: float = 0.0, default_int64: int = -1, default_string: str = "_Unused",
                 keys_floats: list[float] | None = None, keys_int64s: list[int] | None = None,
                 keys_strings: list[str] | None = None, values_floats: list[float] | None = None,
                 values_int64s: list[int] | None = None, values_strings: list[str] | None = None) -> None:
        super().__init__()
        self.attrs: dict[str, Any] = {"default_float": default_float, "default_int64": default_int64,
                                      "default_string": default_string}
        for name, value in (("keys_floats", keys_floats), ("keys_int64s", keys_int64s),
                            ("keys_strings", keys_strings), ("values_floats", values_floats),
                            ("values_int64s", values_int64s), ("values_strings", values_strings)):
            if value is not None:
                self.attrs[name] = list(value)

    def build(self, label_encoder_input_name: str) -> str:
        acc = _acc()
        if not acc.has_value(label_encoder_input_name):  # (onnx's shape inference crashes on the node)
            raise BlockError(f"LabelEncoder: its input {label_encoder_input_name!r} is not a value of the "
                             "model")
        if not any(o.domain == "ai.onnx.ml" for o in acc.model.opset_import):
            acc.model.opset_import.append(onnx.helper.make_opsetid("ai.onnx.ml", 2))
        return acc.node("LabelEncoder", [label_encoder_input_name], "label_encoder.output",
                        domain="ai.onnx.ml", **self.attrs)[0]


__all__ = [
    "Abs",
    "Add",
    "Block",
    "Cast",
    "Clip",
    "Constant",
    "Div",
    "Exp",
    "Identity",
    "InputLike",
    "LabelEncoder",
    "Linear",
    "Log",
    "Max",
    "Min",
    "Mul",
    "Neg",
    "PassThrough",
    "Pow",
    "ReduceAllL2",
    "ReduceMean",
    "ReduceSum",
    "ReduceSumSquare",
    "Relu",
    "SequenceConstruct",
    "Sigmoid",
    "Softplus",
    "Sqrt",
    "Sub",
    "Tanh",
]
