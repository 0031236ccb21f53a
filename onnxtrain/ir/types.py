"""Element types and shapes of ONNX value infos, as numpy sees them."""

from __future__ import annotations

from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX element type (bfloat16 and float8 through ml_dtypes)."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def onnx_elem_type(dtype: Any) -> int:
    """The ONNX element type of a numpy dtype."""
    return helper.np_dtype_to_tensor_dtype(np.dtype(dtype))


def np_dtype_of(tp: onnx.TypeProto) -> np.dtype | None:
    """The numpy dtype of a tensor TypeProto, or None for other types."""
    if tp.HasField("tensor_type") and tp.tensor_type.elem_type != TensorProto.UNDEFINED:
        return np_dtype(tp.tensor_type.elem_type)
    return None


def value_info_shape(tp: onnx.TypeProto) -> list[int | str | None] | None:
    """Dims of a tensor type (int, symbolic name or None); None when the rank is unknown."""
    if not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    dims: list[int | str | None] = []
    for d in tp.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            dims.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            dims.append(d.dim_param)
        else:
            dims.append(None)
    return dims


def symbolic_shape(types: dict[str, onnx.TypeProto], name: str) -> list[int | str | None] | None:
    """Dims of ``name``: ints, symbolic names, or None; None when the rank is unknown."""
    tp = types.get(name)
    if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.HasField("shape"):
        return None
    return [
        d.dim_value if d.HasField("dim_value") else (d.dim_param or None) for d in tp.tensor_type.shape.dim
    ]
