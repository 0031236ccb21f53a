"""Element types and shapes of ONNX value infos, as numpy sees them."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper

_NP_DTYPES: dict[int, np.dtype] = {}  # element type → dtype, as found (a graph pass asks once a value)


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type (bfloat16 and float8 through ml_dtypes)."""
    dt = _NP_DTYPES.get(elem_type)
    if dt is None:  # (an unknown type raises here, every time)
        dt = _NP_DTYPES[elem_type] = np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))
    return dt


def widens_exactly(src: Any, dst: Any) -> bool:
    """Whether every value of float dtype ``src`` is one of float dtype ``dst`` (numpy's floats, ml_dtypes'
    bfloat16 and float8 types): float16 or bfloat16 into float32, not float32 into float16."""
    import ml_dtypes

    src, dst = np.dtype(src), np.dtype(dst)
    if src.kind not in "fV" or dst.kind not in "fV":
        return False
    try:
        a, b = ml_dtypes.finfo(src), ml_dtypes.finfo(dst)
    except (TypeError, ValueError):  # (a structured or opaque type)
        return False

    def specials(dt: np.dtype) -> tuple[bool, bool]:  # (has infinities, has -0): float8's fn/fnuz lack them
        with np.errstate(invalid="ignore", over="ignore"):
            inf, zero = np.array([np.inf, -0.0], np.float32).astype(dt).astype(np.float32)
        return bool(np.isinf(inf)), bool(np.signbit(zero))

    # the same or more significand bits, a range as wide, a quantum (smallest subnormal) as fine
    return (a.nmant <= b.nmant and a.maxexp <= b.maxexp and a.minexp - a.nmant >= b.minexp - b.nmant
            and all(d or not s for s, d in zip(specials(src), specials(dst))))


def onnx_elem_type(dtype: Any) -> int:
    """The ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def np_dtype_of(tp: onnx.TypeProto) -> np.dtype | None:
    """The numpy dtype of a tensor TypeProto, or None for other types."""
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type != TensorProto.UNDEFINED:
        return np_dtype(tp.tensor_type.elem_type)
    return None


# an ONNX element type → its name in schemas' type constraints and onnxruntime's NodeArg types:
# FLOAT → "tensor(float)"
TENSOR_TYPE_STRINGS = {v: f"tensor({k.lower()})" for k, v in TensorProto.DataType.items() if v}


def type_string(tp: onnx.TypeProto, unknown: str | None = None) -> str | None:
    """A value's type as schemas' type constraints and onnxruntime name it ("tensor(float)",
    "seq(tensor(int64))", "optional(tensor(bool))", "map(string,tensor(float))", "sparse_tensor(float)");
    ``unknown`` for no element type or another kind; with ``unknown`` None, None also for a container of an
    unknown type."""
    kind = tp.WhichOneof("value")
    if kind == "tensor_type":
        return TENSOR_TYPE_STRINGS.get(tp.tensor_type.elem_type, unknown)
    if kind == "sparse_tensor_type":
        dense = TENSOR_TYPE_STRINGS.get(tp.sparse_tensor_type.elem_type)
        return unknown if dense is None else f"sparse_{dense}"
    if kind == "map_type":
        key = TENSOR_TYPE_STRINGS.get(tp.map_type.key_type)
        value = type_string(tp.map_type.value_type, None)
        if key is None or value is None:
            return unknown
        return f"map({key[len('tensor('):-1]},{value})"
    if kind == "sequence_type":
        inner = type_string(tp.sequence_type.elem_type, unknown)
        return None if inner is None else f"seq({inner})"
    if kind == "optional_type":
        inner = type_string(tp.optional_type.elem_type, unknown)
        return None if inner is None else f"optional({inner})"
    return unknown


def value_info_shape(tp: onnx.TypeProto) -> list[int | str | None] | None:
    """Dims of a tensor type (int, symbolic name or None); None when the rank is unknown."""
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return shape_dims(tp.tensor_type.shape)


def shape_dims(shape: onnx.TensorShapeProto) -> list[int | str | None]:
    """The dims of a shape (int, symbolic name or None)."""
    dims: list[int | str | None] = []
    for d in shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.dim_param:  # (an empty name is no name: unknown, as onnxruntime shows it)
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def shown_dims(shape: onnx.TensorShapeProto) -> list[int | str]:
    """The dims of a shape as messages show them: ints, symbolic names, "?" where unknown."""
    return ["?" if d is None or d == "" else d for d in shape_dims(shape)]


def symbolic_shape(types: dict[str, onnx.TypeProto], name: str) -> list[int | str | None] | None:
    """Dims of ``name``: ints, symbolic names, or None; None when the rank is unknown."""
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim
    ]


def held(value: float, elem_type: int) -> float:
    """An optimizer's float hyperparameter (β, say) as onnxruntime's optimizers hold it for weights of
    ``elem_type``: a float32 attribute (their kernels' ``1.f - beta`` is then exact: 1 − 0.999 in float64
    rounds to another float32), or the value itself for float64 weights."""
    return value if elem_type == TensorProto.DOUBLE else float(np.float32(value))
