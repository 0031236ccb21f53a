"""onnxruntime's ``SparseTensor`` and ``OrtSparseFormat``: a sparse tensor in COO or CSR(C) layout, held as
numpy arrays on the CPU (values and indices), to be wrapped in an ``OrtValue``.

onnxtrain's kernels compute with dense tensors only: a model's sparse initializers and ``Constant``
``sparse_value`` attributes are made dense when it is loaded, so these objects are for code that builds,
inspects or passes sparse values around, as onnxruntime's Python API lets it.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import Any

import numpy as np

from onnxtrain.errors import Fail, FailValueError


class OrtSparseFormat(enum.IntEnum):
    """The layouts of a sparse tensor, with onnxruntime's values."""

    ORT_SPARSE_UNDEFINED = 0
    ORT_SPARSE_COO = 1
    ORT_SPARSE_CSRC = 2
    ORT_SPARSE_BLOCK_SPARSE = 4


def _read_only(array: np.ndarray) -> np.ndarray:
    """A view of ``array`` that cannot be written, as onnxruntime hands out a sparse tensor's buffers."""
    view = array.view()
    view.setflags(write=False)
    return view


class SparseCooView:
    """The indices of a COO sparse tensor: linear (one per value) or coordinates ``[nnz, rank]``."""

    def __init__(self, indices: np.ndarray):
        self._indices = indices

    def indices(self) -> np.ndarray:
        """The indices (read-only)."""
        return _read_only(self._indices)


class SparseCsrView:
    """The indices of a CSR(C) sparse tensor: ``inner`` (a column per value) and ``outer`` (the offset of each
    row's first value, and the count of values last)."""

    def __init__(self, inner: np.ndarray, outer: np.ndarray):
        self._inner, self._outer = inner, outer

    def inner(self) -> np.ndarray:
        """The column of each value (read-only)."""
        return _read_only(self._inner)

    def outer(self) -> np.ndarray:
        """Each row's first value's offset, then the count of values (read-only)."""
        return _read_only(self._outer)


def _cpu_only(device: Any, what: str) -> None:
    """Refuse a device other than the CPU (an ``OrtDevice`` of another type)."""
    kind = device.device_type() if hasattr(device, "device_type") else 0
    if kind != 0:
        raise FailValueError(f"SparseTensor.{what}: onnxtrain holds sparse tensors on the CPU only, got a "
                             f"device of type {kind}")


def _values(values: Any) -> np.ndarray:
    """A sparse tensor's values as a 1-D array (strings as objects, as onnxruntime returns them)."""
    array = np.asarray(values)
    if array.dtype.kind in "US":
        array = array.astype(object)
    if array.ndim != 1:
        raise FailValueError(f"SparseTensor: the values must be a 1-D array, got shape {list(array.shape)}")
    return array


def _index_array(indices: Any, what: str) -> np.ndarray:
    array = np.asarray(indices)
    if array.dtype.kind not in "iu":
        raise FailValueError(f"SparseTensor: the {what} must be integers, got {array.dtype}")
    return array


class SparseTensor:
    """A sparse tensor (onnxruntime's ``SparseTensor``): its dense shape, its non-zero values and their
    indices in COO or CSR(C) layout. Make one with :meth:`sparse_coo_from_numpy` or
    :meth:`sparse_csr_from_numpy`."""

    def __init__(self, dense_shape: Sequence[int], values: np.ndarray, layout: OrtSparseFormat,
                 indices: tuple[np.ndarray, ...]):
        self._shape = [int(d) for d in dense_shape]
        self._values = values
        self._format = layout
        self._indices = indices

    @staticmethod
    def sparse_coo_from_numpy(dense_shape: Sequence[int], values: Any, coo_indices: Any,
                              ort_device: Any = None) -> SparseTensor:
        """A COO sparse tensor: ``values`` at ``coo_indices``, linear indices into the dense shape (one per
        value) or coordinates ``[len(values), rank]``."""
        _cpu_only(ort_device, "sparse_coo_from_numpy")
        array = _values(values)
        indices = _index_array(coo_indices, "COO indices")
        nnz, rank = len(array), len(dense_shape)
        if not (indices.shape == (nnz,) or indices.shape == (nnz, rank) or (nnz == 0 and indices.size == 0)):
            raise FailValueError(f"SparseTensor.sparse_coo_from_numpy: {nnz} values need indices of shape "
                                 f"[{nnz}] or [{nnz}, {rank}], got {list(indices.shape)}")
        return SparseTensor(dense_shape, array, OrtSparseFormat.ORT_SPARSE_COO, (indices,))

    @staticmethod
    def sparse_csr_from_numpy(dense_shape: Sequence[int], values: Any, inner_indices: Any,
                              outer_indices: Any, ort_device: Any = None) -> SparseTensor:
        """A CSR(C) sparse tensor of a 2-D dense shape: ``inner_indices`` the column of each value,
        ``outer_indices`` the offset of each row's first value (rows + 1 of them)."""
        _cpu_only(ort_device, "sparse_csr_from_numpy")
        array = _values(values)
        inner = _index_array(inner_indices, "inner indices")
        outer = _index_array(outer_indices, "outer indices")
        if len(dense_shape) != 2:
            raise FailValueError(f"SparseTensor.sparse_csr_from_numpy: CSR needs a 2-D dense shape, got "
                                 f"{list(dense_shape)}")
        nnz = len(array)
        if inner.shape != (nnz,) or (nnz and outer.shape != (int(dense_shape[0]) + 1,)):
            raise FailValueError(f"SparseTensor.sparse_csr_from_numpy: {nnz} values of a {list(dense_shape)} "
                                 f"tensor need {nnz} inner indices and {int(dense_shape[0]) + 1} outer ones, "
                                 f"got {inner.size} and {outer.size}")
        return SparseTensor(dense_shape, array, OrtSparseFormat.ORT_SPARSE_CSRC, (inner, outer))

    def format(self) -> OrtSparseFormat:
        """The layout: COO or CSR(C)."""
        return self._format

    def dense_shape(self) -> list[int]:
        """The shape of the dense tensor this one stands for."""
        return list(self._shape)

    def data_type(self) -> str:
        """onnxruntime's type string, e.g. ``sparse_tensor(float)``."""
        from onnxtrain.capi.ortvalue import _type_name

        return f"sparse_tensor({_type_name(self._values.dtype)})"

    def device_name(self) -> str:
        """Where the values live: always the CPU."""
        return "cpu"

    def values(self) -> np.ndarray:
        """The non-zero values (read-only)."""
        return _read_only(self._values)

    def as_coo_view(self) -> SparseCooView:
        """The COO indices; Fail for another layout."""
        if self._format != OrtSparseFormat.ORT_SPARSE_COO:
            raise Fail(f"SparseTensor.as_coo_view: the tensor is {self._format.name}, not COO")
        return SparseCooView(*self._indices)

    def as_csrc_view(self) -> SparseCsrView:
        """The CSR(C) indices; Fail for another layout."""
        if self._format != OrtSparseFormat.ORT_SPARSE_CSRC:
            raise Fail(f"SparseTensor.as_csrc_view: the tensor is {self._format.name}, not CSR(C)")
        return SparseCsrView(*self._indices)

    def as_blocksparse_view(self) -> Any:
        """Fail: onnxtrain makes no block-sparse tensors."""
        raise Fail(f"SparseTensor.as_blocksparse_view: the tensor is {self._format.name}, not block-sparse")

    def to_cuda(self, ort_device: Any) -> SparseTensor:
        """Fail: onnxtrain runs on the CPU only."""
        raise Fail("SparseTensor.to_cuda: CUDA is not available (onnxtrain runs on the CPU)")

    def _element_type(self) -> int:
        from onnx import helper

        return int(helper.np_dtype_to_tensor_dtype(self._values.dtype))

    def __repr__(self) -> str:
        return (f"SparseTensor({self._format.name}, dense_shape={self._shape}, "
                f"{len(self._values)} values of {self._values.dtype})")


__all__ = ["OrtSparseFormat", "SparseTensor"]
