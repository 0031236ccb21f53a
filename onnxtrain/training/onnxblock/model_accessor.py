"""The model under construction (spec §1.9): blocks append nodes, initializers and inputs to it. The
module's name is onnxruntime-training's (``onnxblock.model_accessor``), so ported imports of it work.

As in onnxruntime-training one *base* model is edited at a time, set with the context managers
``base(model)`` or ``empty_base(opset_version)``; blocks called inside read and extend it and
return tensor names. New values are named ``onnx::<token>::<n>`` with a counter per base, so
one generation gives the same names in any process (read names from the model, never guess).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.ir.builder import NameGen, elem_type, model_opset, symbolic_shape, value_types
from onnxtrain.ir.types import np_dtype
from onnxtrain.version import PRODUCER

DEFAULT_OPSET = 17


class BlockError(RuntimeError, ValueError):
    """A block cannot be built (bad argument, missing value, wrong type); the message says which."""


class UnknownValue(BlockError, LookupError):
    """A name given to a block, or returned by one, that is no value of the model: a ``LookupError`` too,
    as onnxruntime-training's blocks raise when they look such a name up."""


class ModelBase:
    """The model being edited plus name and type bookkeeping (onnxruntime-training's ``ModelAccessor``)."""

    def __init__(self, model: onnx.ModelProto, model_path: str | None = None):
        self.model = model
        self.opset = model_opset(model) or DEFAULT_OPSET
        self.names = NameGen.for_model(model)
        self.counter = 0
        self.consts: dict[str, tuple[float, int]] = {}  # 0-d constants made by blocks: name -> (value, type)
        self._types: dict[str, onnx.TypeProto] | None = None
        # graph input name → its index (the first of the name), for as many inputs as the graph had then
        self._inputs: tuple[int, dict[str, int]] = (-1, {})
        # the model's path, as given here or to base() (kept by replace)
        self.path: str | None = model_path if model_path is not None else getattr(self, "path", None)
        # blocks being called (nested calls count), and whether the outermost call's result is checked;
        # both kept by replace, which a block may call midway
        self.depth: int = getattr(self, "depth", 0)
        self.check_calls: bool = getattr(self, "check_calls", False)

    @property
    def has_path(self) -> bool:
        """Whether ``base`` was given the model's path (onnxruntime-training's accessor attribute)."""
        return self.path is not None

    def replace(self, model: onnx.ModelProto) -> None:
        """Hold ``model`` from now on (a copy into the edited proto; names and types looked up afresh)."""
        self.model.CopyFrom(model)
        self.__init__(self.model)  # type: ignore[misc]

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph

    # ---- names and types
    def fresh(self, token: str) -> str:
        """A new unique value name ``onnx::<token>::<n>``."""
        while True:
            self.counter += 1
            name = f"onnx::{token}::{self.counter}"
            if name not in self.names.taken:
                self.names.taken.add(name)
                return name

    def types(self) -> dict[str, onnx.TypeProto]:
        if self._types is None:
            self._types = value_types(self.model)
        return self._types

    def _input_named(self, name: str) -> onnx.ValueInfoProto | None:
        """The first graph input named ``name``, or None; the inputs are indexed as they are added (an
        optimizer block asks for the type of each of thousands of inputs)."""
        inputs = self.graph.input
        count, index = self._inputs
        if count != len(inputs):
            if count < 0 or count > len(inputs):
                count, index = 0, {}
            for k in range(count, len(inputs)):  # the inputs added since (add_input appends)
                index.setdefault(inputs[k].name, k)
            self._inputs = (len(inputs), index)
        k = index.get(name)
        if k is not None and inputs[k].name == name:
            return inputs[k]
        if k is None:
            return None
        self._inputs = (-1, {})  # an input renamed in place: indexed anew
        return self._input_named(name)

    def elem_type(self, name: str) -> int:
        v = self._input_named(name)  # graph inputs and initializers without shape inference
        if v is not None and v.type.HasField("tensor_type") and v.type.tensor_type.elem_type:
            return v.type.tensor_type.elem_type
        if name in self.consts:
            return self.consts[name][1]
        return elem_type(self.types(), name)

    def shape(self, name: str) -> list[int | str | None] | None:
        return symbolic_shape(self.types(), name)

    def has_value(self, name: str) -> bool:
        g = self.graph
        if any(v.name == name for v in g.input) or any(t.name == name for t in g.initializer):
            return True
        return any(name in n.output for n in g.node)

    def type_of(self, name: str) -> onnx.TypeProto:
        tp = self.types().get(name)
        if tp is None:
            if not self.has_value(name):
                raise UnknownValue(f"{name!r} is not a value of the model")
            raise BlockError(f"the type of {name!r} is unknown (shape inference gives none)")
        return tp

    # ---- editing
    def node(self, op: str, inputs: list[str], token: str, outputs: int = 1, **attrs: Any) -> list[str]:
        """Append one node; its outputs get fresh ``onnx::<token>::<n>`` names."""
        outs = [self.fresh(token) for _ in range(outputs)]
        attrs = {k: v for k, v in attrs.items() if v is not None}
        self.graph.node.append(
            helper.make_node(op, inputs, outs, name=self.names(f"{op}_{self.counter}"), **attrs)
        )
        self._types = None
        return outs

    def initializer(self, value: Any, token: str, dtype: Any = None) -> str:
        arr = np.asarray(value, dtype=dtype)
        name = self.fresh(token)
        self.graph.initializer.append(numpy_helper.from_array(arr, name))
        self._types = None
        return name

    def scalar(self, value: float, et: int = TensorProto.FLOAT) -> str:
        """A 0-d constant initializer of element type ``et`` (shared by equal values)."""
        for name, (v, t) in self.consts.items():
            if v == value and t == et:
                return name
        name = self.initializer(np.asarray(value, dtype=np_dtype(et)), "constant")
        self.consts[name] = (float(value), et)
        return name

    def add_input(self, name: str, tp: onnx.TypeProto) -> str:
        if name in self.names.taken and self.has_value(name):
            raise BlockError(f"cannot add graph input {name!r}: the model already has a value of that name")
        self.names.taken.add(name)
        self.graph.input.append(helper.make_value_info(name, tp))
        self._types = None
        return name

    def float_type_of(self, name: str) -> int:
        """Element type of ``name``; float32 when unknown."""
        return self.elem_type(name) or TensorProto.FLOAT

    def align(self, a: str, b: str) -> tuple[str, str]:
        """Give a block-made scalar constant the element type of the other operand (float64 models)."""
        if a in self.consts and b not in self.consts:
            et = self.elem_type(b)
            if et and et != self.consts[a][1]:
                a = self.scalar(self.consts[a][0], et)
        elif b in self.consts and a not in self.consts:
            et = self.elem_type(a)
            if et and et != self.consts[b][1]:
                b = self.scalar(self.consts[b][0], et)
        return a, b


ModelAccessor = ModelBase  # onnxruntime-training's name of the class base() yields


def value_info(name: str, types: dict[str, onnx.TypeProto]) -> onnx.ValueInfoProto:
    """A graph output's value info: its type from ``types`` when known, else an empty one."""
    tp = types.get(name)
    return helper.make_value_info(name, tp) if tp is not None else helper.make_empty_tensor_value_info(name)


_STACK: list[ModelBase] = []


def current() -> ModelBase:
    """The base being edited; error outside ``base(...)``/``empty_base(...)``."""
    if not _STACK:
        raise BlockError(
            "blocks must be called inside `with onnxblock.base(model):` or "
            "`with onnxblock.empty_base():` (no base model is set)"
        )
    return _STACK[-1]


def _refuse_nesting() -> None:
    if _STACK:
        raise BlockError("Base onnx model already exists. Cannot nest onnxblock.base contexts.")


@contextlib.contextmanager
def base(model: onnx.ModelProto, model_path: str | None = None) -> Iterator[ModelBase]:
    """Edit a copy of ``model`` with blocks (the caller's model is left as it is; the edited one is the
    yielded handle's ``.model``); nesting is refused as in onnxruntime-training."""
    _refuse_nesting()
    if not isinstance(model, onnx.ModelProto):
        raise BlockError(f"onnxblock.base expects an onnx.ModelProto, got {type(model).__name__}")
    clone = onnx.ModelProto()
    clone.CopyFrom(model)
    with editing(clone, check_calls=True) as acc:
        acc.path = model_path  # onnxruntime-training's accessor tells whether the model came with a path
        yield acc


@contextlib.contextmanager
def editing(model: onnx.ModelProto, check_calls: bool = False) -> Iterator[ModelBase]:
    """Edit ``model`` itself with blocks (``base`` without the copy, for the artifact pipeline's own
    models, which it checks once when they are whole). With ``check_calls`` the model must pass
    onnx.checker (full check) after each outermost block call, as onnxruntime-training required."""
    _refuse_nesting()
    acc = ModelBase(model)
    acc.check_calls = check_calls
    _STACK.append(acc)
    try:
        yield acc
    finally:
        _STACK.pop()


@contextlib.contextmanager
def detached() -> Iterator[ModelBase]:
    """The current base, taken off the stack for the block: a block that builds whole models with bases of
    its own (a TrainingBlock, an optimizer's full model) runs them inside, then the base is set again."""
    acc = current()
    _STACK.pop()
    try:
        yield acc
    finally:
        _STACK.append(acc)


@contextlib.contextmanager
def empty_base(opset_version: int | None = None) -> Iterator[ModelBase]:
    """A fresh empty model (default domain only) to build into, e.g. an optimizer graph."""
    opset = opset_version or DEFAULT_OPSET
    graph = helper.make_graph([], "graph", [], [])
    opsets = [helper.make_opsetid("", opset)]
    model = helper.make_model(
        graph,
        opset_imports=opsets,
        **PRODUCER,
        ir_version=helper.find_min_ir_version_for(opsets),
    )
    with editing(model, check_calls=True) as acc:
        yield acc


def check_after_block(acc: ModelBase, block: str) -> None:
    """BlockError naming ``block`` when the model it left fails onnx.checker's full check (past protobuf's
    2 GiB, that of its skeleton: :func:`~onnxtrain.ir.large.check_model_full`)."""
    from onnxtrain.ir.large import check_model_full

    try:
        check_model_full(acc.model)
    except Exception as err:  # checker ValidationError and shape inference's InferenceError
        raise BlockError(f"the model fails onnx.checker after block {block}: {err}") from None


@contextlib.contextmanager
def custom_op_library(custom_op_library_path: str | os.PathLike) -> Iterator[None]:
    """onnxruntime-training registers a custom-op library for gradient building here; onnxtrain builds
    gradients of standard ONNX ops only, so it refuses (a missing file is named first)."""
    path = os.fspath(custom_op_library_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"custom_op_library: {path} does not exist")
    raise BlockError(f"custom_op_library({path!r}) is not supported: onnxtrain builds gradients for standard "
                     "ONNX ops only")
    yield  # pragma: no cover - never reached
