"""``GradCtx``: what a gradient rule sees of one forward node, and how it emits backward nodes.

Vocabulary (after ONNX Runtime's gradient builders): ``x(i)``/``y(i)`` are the forward input and
output names, ``dy(i)`` the incoming gradient of output ``i`` (None when it has none),
``needs_dx(i)`` says whether input ``i`` wants a gradient and ``set_dx(i, name)`` provides it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import onnx
from onnx import TensorProto

from onnxtrain.ir.builder import NodeWriter, elem_type, static_shape

if TYPE_CHECKING:
    from onnxtrain.autodiff.builder import _Backward
    from onnxtrain.autodiff.registry import Rule


class RuleError(RuntimeError):
    """A gradient rule cannot handle this node (the message names the node)."""


class GradCtx:
    """The context of one forward node during the backward walk."""

    def __init__(
        self,
        bw: _Backward,
        node: onnx.NodeProto,
        rule: Rule,
        attrs: dict[str, Any],
        dys: list[str | None],
        needs: list[bool],
    ):
        self._bw = bw
        self.node = node
        self.rule = rule
        self.attrs = attrs
        self._dys = dys
        self._needs = needs
        self.opset = bw.opset
        self.w = NodeWriter(
            bw.names,
            bw.backward_nodes,
            prefix=f"{node.name or node.op_type}_Grad/",
            const_cache=bw.const_cache,
        )
        self.dxs: dict[int, str] = {}
        # a control-flow node: the outer values its bodies read that want a gradient, and those gradients
        self.body_wrt: list[str] = []
        self.body_dxs: dict[str, str] = {}
        first = next(
            (n for n in (*node.output, *node.input) if n and elem_type(bw.types, n) in _FLOATS), None
        )
        self.dtype: int = elem_type(bw.types, first) if first else TensorProto.FLOAT

    # ---- forward values -------------------------------------------------------------
    def _check_use(self, key: str) -> None:
        u = self.rule.uses
        if key not in u and f"{key[0]}*" not in u:
            raise RuleError(
                f"gradient rule of {self.node.op_type} reads {key} but does not declare it in uses="
            )

    def x(self, i: int) -> str:
        """Name of forward input ``i`` (declared in ``uses``)."""
        self._check_use(f"x{i}")
        return self.node.input[i]

    def y(self, i: int) -> str:
        """Name of forward output ``i``; adds the output to the forward node if it was omitted."""
        self._check_use(f"y{i}")
        return self._bw.ensure_output(self.node, i)

    def constant_value(self, name_or_index: str | int) -> Any:
        """The value of a fixed input (initializer or Constant), e.g. axes or shapes, else None."""
        if isinstance(name_or_index, int):
            if not self.has_x(name_or_index):
                return None
            name_or_index = self.node.input[name_or_index]
        return self._bw.constant_value(name_or_index)

    def readers(self, name: str) -> list[onnx.NodeProto]:
        """The forward nodes that read value ``name`` (for rules that look at how an output is used)."""
        return self._bw.readers(name)

    def producer(self, name: str) -> onnx.NodeProto | None:
        """The forward node that makes value ``name``, or None."""
        return self._bw.producer_node(name)

    def varies(self, name: str) -> bool:
        """Whether value ``name`` depends on a value being differentiated (a trained initializer is no
        constant here, though ``constant_value`` reads its value)."""
        return name in self._bw.requires

    def is_graph_output(self, name: str) -> bool:
        return name in self._bw.graph_outputs

    def has_x(self, i: int) -> bool:
        return i < len(self.node.input) and bool(self.node.input[i])

    @property
    def n_inputs(self) -> int:
        return len(self.node.input)

    @property
    def n_outputs(self) -> int:
        return len(self.node.output)

    def attr(self, name: str) -> Any:
        return self.attrs.get(name)

    def shape(self, name_or_index: str | int, output: bool = False) -> str:
        """``Shape`` of a forward value, computed in the forward pass so the value itself can be freed (an
        output the model left unnamed is named first)."""
        if isinstance(name_or_index, str):
            name = name_or_index
        elif output:
            name = self._bw.ensure_output(self.node, name_or_index)
        else:
            name = self.node.input[name_or_index]
        return self._bw.shape_of(name)

    def static_shape(self, name_or_index: str | int, output: bool = False) -> list[int | None] | None:
        name = (
            name_or_index
            if isinstance(name_or_index, str)
            else (self.node.output[name_or_index] if output else self.node.input[name_or_index])
        )
        return static_shape(self._bw.types, name)

    def rank(self, name_or_index: str | int, output: bool = False) -> int | None:
        s = self.static_shape(name_or_index, output)
        return None if s is None else len(s)

    def elem_type(self, name: str) -> int:
        return elem_type(self._bw.types, name)

    # ---- gradients ------------------------------------------------------------------
    def dy(self, i: int = 0) -> str | None:
        return self._dys[i] if i < len(self._dys) else None

    def dy_or_zeros(self, i: int) -> str:
        """The gradient of output ``i``, or zeros shaped like that output."""
        d = self.dy(i)
        if d is not None:
            return d
        self._check_use(f"y{i}")
        return self.zeros_like(self._bw.ensure_output(self.node, i))

    def needs_dx(self, i: int) -> bool:
        return i < len(self._needs) and self._needs[i]

    def set_dx(self, i: int, name: str) -> None:
        if self.needs_dx(i):
            self.dxs[i] = name

    # ---- emitting -------------------------------------------------------------------
    def emit(self, op: str, *inputs: str | None, outputs: int = 1, **attrs: Any) -> Any:
        """Emit one node; returns its output name (or the list of names when ``outputs > 1``). A Reshape to
        a value's own shape (:meth:`shape`) keeps that shape's zeros as zeros (``allowzero``): an empty
        value's gradient, where a 0 would copy the input's size."""
        if (op == "Reshape" and len(inputs) == 2 and "allowzero" not in attrs and self.opset >= 14
                and inputs[1] in self._bw.shape_outputs):
            attrs["allowzero"] = 1
        outs = self.w.emit(op, inputs, outputs, **attrs)
        return outs[0] if outputs == 1 else outs

    def in_float32(self, op: str, *inputs: str, **attrs: Any) -> str:
        """``op`` on ``inputs`` (all of the node's float type), computed in float32 when that type is
        bfloat16, which ONNX does not define the op for (Einsum; Conv and EyeLike before opset 22): the
        inputs cast to float32, the output cast back. Otherwise as :meth:`emit`."""
        if self.dtype != TensorProto.BFLOAT16:
            return self.emit(op, *inputs, **attrs)
        wide = [self.emit("Cast", x, to=TensorProto.FLOAT) for x in inputs]
        return self.emit("Cast", self.emit(op, *wide, **attrs), to=TensorProto.BFLOAT16)

    def const(self, value: Any, elem: int | None = None) -> str:
        """A Constant of the node's float type (or ``elem``)."""
        return self.w.const(value, self.dtype if elem is None else elem)

    def ints(self, values: Sequence[int]) -> str:
        return self.w.ints(values)

    def int64(self, value: int) -> str:
        """A scalar int64 Constant (a Gather with it drops the axis; Range takes its bounds so)."""
        return self.w.const(np.array(value, dtype=np.int64), TensorProto.INT64)

    def shape_entry(self, shape: str, i: int) -> str:
        """Entry ``i`` of a 1-D shape tensor, as a scalar (e.g. one dim of ``Shape(X)`` read at run time)."""
        return self.emit("Gather", shape, self.int64(i), axis=0)

    def sgn(self, x: str) -> str:
        """torch's sign of ``x`` (of the node's float type) for gradients: ±1, and 0 at ±0 and at NaN, where
        ONNX's Sign is NaN (dY·Sign(NaN) sent NaN back from a NaN that was masked out downstream)."""
        zero = self.const(0)
        return self.emit("Where", self.emit("Greater", x, zero), self.const(1),
                         self.emit("Where", self.emit("Less", x, zero), self.const(-1), zero))

    def zeros_like(self, name: str) -> str:
        et = self.elem_type(name) or self.dtype
        zero = onnx.numpy_helper.from_array(np.zeros(1, dtype=onnx.helper.tensor_dtype_to_np_dtype(et)))
        return self.emit("ConstantOfShape", self._bw.shape_of(name), value=zero)

    def reduce(self, op: str, name: str, axes: Sequence[int] | str | None, keepdims: int = 1) -> str:
        """``op`` (ReduceSum, ReduceMean ...) over ``axes``, as an input or attribute per the opset."""
        axes_as_input = op == "ReduceSum" and self.opset >= 13 or self.opset >= 18
        if axes is None:
            return self.emit(op, name, keepdims=keepdims)
        if axes_as_input:
            ax = axes if isinstance(axes, str) else self.ints(axes)
            return self.emit(op, name, ax, keepdims=keepdims)
        if isinstance(axes, str):
            raise RuleError(f"{op} with dynamic axes needs opset 18 (node {self.node.name!r})")
        return self.emit(op, name, axes=list(axes), keepdims=keepdims)

    def unbroadcast(self, grad: str, i: int, grad_rank: int | None = None) -> str:
        """Sum ``grad`` (shaped like the broadcast result) down to the shape of input ``i``."""
        return self._bw.unbroadcast(self, grad, self.node.input[i], grad_rank)

    def unbroadcast_at_run_time(self, grad: str, i: int) -> str:
        """Sum ``grad`` over the axes where input ``i``'s shape, seen at run time, differs (a 1 broadcast)."""
        return self._bw._unbroadcast_dynamic(self, grad, self.node.input[i])


_FLOATS = {TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.FLOAT16, TensorProto.BFLOAT16}
