"""Which of onnxruntime's exception classes a node failing in a run raises, so that a ported script's
``except InvalidArgument`` or ``except RuntimeException`` catches the engine's error for the same mistake.

onnxruntime's class follows how its kernel checks the values: a status it returns as INVALID_ARGUMENT (an
index out of range in Gather), an ``ORT_ENFORCE`` that throws (a Reshape to a size the input does not have,
a broadcast of unequal dims, an axis out of range: ``RuntimeException``), or another status (``Fail``). The
table holds each op's class as onnxruntime-training 1.16.3's CPU kernels raise it for the failures a user's
values cause (``tests/engine/test_node_failure_classes.py`` compares them); ops not in it fail with
``Fail``. The op's class applies only when the kernel failed the way it checks a user's values (an
IndexError, a ValueError, an integer ZeroDivisionError); anything else (a MemoryError, an AssertionError or
TypeError of a kernel's own) is a plain ``Fail``, so that it does not blame the input. Every class is also
an :class:`EngineError` (a ``Fail``), as node failures were before.
"""

from __future__ import annotations

import re

from onnxtrain.engine.interface import EngineError
from onnxtrain.errors import InvalidArgument, RuntimeException


class NodeInvalidArgument(EngineError, InvalidArgument):
    """A node that failed on its inputs' values where onnxruntime's kernel returns INVALID_ARGUMENT."""


class NodeRuntimeException(EngineError, RuntimeException):
    """A node that failed on its inputs' values where onnxruntime's kernel throws (``ORT_ENFORCE``)."""


_BROADCASTING = ("Add", "Sub", "Mul", "Div", "Pow", "Mod", "Max", "Min", "Sum", "Mean", "PRelu", "Where",
                 "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "And", "Or", "Xor", "BitShift",
                 "BitwiseAnd", "BitwiseOr", "BitwiseXor")
_INVALID_ARGUMENT = ("Gather", "GatherND", "Scatter", "ScatterElements", "ScatterND", "Gemm", "Expand",
                     "Tile", "Slice", "Transpose", "Range", "Einsum", "OneHot", "BatchNormalization",
                     "LayerNormalization", "InstanceNormalization", "DepthToSpace")
_RUNTIME_EXCEPTION = ("GatherElements", "Reshape", "Squeeze", "Unsqueeze", "ConstantOfShape", "Pad",
                      "Flatten", "LRN", "NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss",
                      *_BROADCASTING)
OP_CLASSES: dict[str, type[EngineError]] = {
    **dict.fromkeys(_INVALID_ARGUMENT, NodeInvalidArgument),
    **dict.fromkeys(_RUNTIME_EXCEPTION, NodeRuntimeException),
}
# an axis (attribute or input) outside the input's rank: onnxruntime's HandleNegativeAxis enforces it in every
# kernel, so it throws whatever the op
_AXIS_OUT_OF_RANGE = re.compile(r"\baxis -?\d+ is (out of (range|bounds for array)|not in valid range)")
# onnxruntime's class (by name) → the EngineError that is also onnxtrain's twin of it; others: EngineError
_BY_ORT_NAME: dict[str, type[EngineError]] = {"InvalidArgument": NodeInvalidArgument,
                                               "RuntimeException": NodeRuntimeException}
_BY_STATUS = {"INVALID_ARGUMENT": NodeInvalidArgument, "RUNTIME_EXCEPTION": NodeRuntimeException}
_STATUS = re.compile(r"\[ONNXRuntimeError\] : \d+ : ([A-Z_]+) :")
_NODE = re.compile(r"while running (\w+) node\b")
# what the kernels (and numpy under them) raise for a user's values: an index or axis out of range, shapes
# that do not fit, an integer division by zero
VALUE_FAILURES = (IndexError, ValueError, ZeroDivisionError)


def node_failure_class(op_type: str, cause: BaseException) -> type[EngineError]:
    """The class of the error for a node of ``op_type`` that failed with ``cause`` while running: the op's
    onnxruntime class when ``cause`` is a failure on the values (:data:`VALUE_FAILURES`), else EngineError."""
    return _op_class(op_type, cause) if isinstance(cause, VALUE_FAILURES) else EngineError


def _op_class(op_type: str, cause: BaseException) -> type[EngineError]:
    if _AXIS_OUT_OF_RANGE.search(str(cause)):
        return NodeRuntimeException
    return OP_CLASSES.get(op_type, EngineError)


def ort_failure_class(cause: BaseException) -> type[EngineError]:
    """The class of the error for a graph that onnxruntime (the optional backend) failed to run with
    ``cause``: an :class:`EngineError`, and onnxtrain's twin of ``cause``'s class when that is
    ``InvalidArgument`` or ``RuntimeException`` (by its status, or the failed node's op when it says only
    that)."""
    if type(cause).__name__ in _BY_ORT_NAME:
        return _BY_ORT_NAME[type(cause).__name__]
    text = str(cause)
    status = _STATUS.search(text)
    if status:
        return _BY_STATUS.get(status.group(1), EngineError)
    node = _NODE.search(text)  # (a run through IO binding raises a RuntimeError that names the node only)
    return _op_class(node.group(1), cause) if node else EngineError
