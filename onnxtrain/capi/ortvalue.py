"""OrtValue, OrtDevice and IOBinding with onnxruntime's names: thin holders of numpy arrays."""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from onnx import TensorProto, helper

from onnxtrain.capi.sparse_tensor import SparseTensor
from onnxtrain.errors import Fail, FailValueError, InvalidFeed, InvalidFeedType

if TYPE_CHECKING:
    from onnxtrain.inference import InferenceSession


class OrtDevice:
    """A device description; only the CPU exists here."""

    _TYPES = {"cpu": 0, "cuda": 1, "dml": 4}

    def __init__(self, device_type: int | str = 0, memory_type: int = 0, device_id: int = 0):
        self._type = self._TYPES.get(device_type, 0) if isinstance(device_type, str) else int(device_type)
        self._memory_type = memory_type
        self._id = device_id

    @staticmethod
    def make(device_type: int | str, device_id: int = 0) -> OrtDevice:
        """A device of that type and id (onnxruntime's ``OrtDevice.make``)."""
        return OrtDevice(device_type, 0, device_id)

    @staticmethod
    def cpu() -> int:
        return 0

    @staticmethod
    def cuda() -> int:
        return 1

    @staticmethod
    def default_memory() -> int:
        return 0

    def device_id(self) -> int:
        return self._id

    def device_type(self) -> int:
        return self._type

    def memory_type(self) -> int:
        return self._memory_type

    def device_mem_type(self) -> int:
        """The memory type (0, the default), under onnxruntime 1.2x's name."""
        return self._memory_type

    def device_vendor_id(self) -> int:
        """The PCI vendor id onnxruntime gives the device: NVIDIA's for CUDA, 0 (none) for the CPU."""
        return 0x10DE if self._type == self._TYPES["cuda"] else 0


def _check_device(device_type: str | Any) -> None:
    name = device_type if isinstance(device_type, str) else "cpu"
    if name.lower() != "cpu":
        raise FailValueError(f"device {name!r} is not available: onnxtrain runs on the CPU only")


# the device names onnxruntime's binding knows (others: "Unsupported device type")
_DEVICE_NAMES = ("cpu", "cuda", "gpu", "dml", "cann", "npu", "webgpu")


def _np_type(element_type: Any) -> np.dtype:
    """A numpy dtype from a numpy type or dtype, or from an ONNX type number (``TensorProto.FLOAT``)."""
    if isinstance(element_type, int) and not isinstance(element_type, bool):
        try:
            return np.dtype(helper.tensor_dtype_to_np_dtype(element_type))
        except KeyError:
            raise FailValueError(f"unknown ONNX element type {element_type}") from None
    return np.dtype(element_type)


def array_from_pointer(ptr: int, element_type: Any, shape: Sequence[int]) -> np.ndarray:
    """A numpy view of ``prod(shape)`` elements of ``element_type`` (a numpy type, or an ONNX type number as
    onnxruntime takes it) at raw address ``ptr`` (no copy)."""
    dtype = _np_type(element_type)
    count = int(np.prod(shape, dtype=np.int64))
    if count == 0:
        return np.empty(tuple(shape), dtype=dtype)
    buf = (ctypes.c_char * (count * dtype.itemsize)).from_address(int(ptr))
    return np.frombuffer(buf, dtype=dtype, count=count).reshape(tuple(shape))


class OrtValue:
    """A value: a tensor (a numpy array, wrapped without a copy), a sequence of tensors (a list) or an
    optional one left empty (None), as a session's outputs are."""

    def __init__(self, array: Any, declared: str | None = None):
        if isinstance(array, OrtValue):  # onnxruntime's OrtValue(ortvalue): the same value
            array, declared = array._array, declared or array._declared
        self._array = array
        self._declared = declared  # the graph's type of the value ("seq(tensor(int64))"), when known

    @staticmethod
    def ortvalue_from_numpy(numpy_obj: np.ndarray, device_type: str = "cpu", device_id: int = 0,
                            vendor_id: int = -1) -> OrtValue:
        _check_device(device_type)
        arr = np.asarray(numpy_obj)
        return OrtValue(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))

    @staticmethod
    def ortvalue_from_numpy_with_onnx_type(data: np.ndarray, onnx_element_type: int) -> OrtValue:
        """An OrtValue of ONNX element type ``onnx_element_type`` over the bytes of ``data`` (no copy for a
        C-ordered array), whose items must have that type's width: bfloat16 or float8 values given as
        uint16 or uint8 bits, as onnxruntime takes them; strings are refused, as there."""
        array = np.asarray(data)
        if onnx_element_type == TensorProto.STRING or array.dtype.kind in "OUS":
            raise FailValueError(f"ortvalue_from_numpy_with_onnx_type: element type {onnx_element_type} of "
                                 f"an array of {array.dtype}: strings cannot be reinterpreted")
        dtype = _np_type(int(onnx_element_type))
        if dtype.itemsize != array.dtype.itemsize:
            raise FailValueError(f"ortvalue_from_numpy_with_onnx_type: items of {array.itemsize} bytes "
                                 f"({array.dtype}) for ONNX element type {onnx_element_type} ({dtype}), of "
                                 f"{dtype.itemsize}")
        # (np.ascontiguousarray would make a 0-d array [1])
        return OrtValue((array if array.flags.c_contiguous else np.array(array, order="C")).view(dtype))

    @staticmethod
    def ortvalue_from_shape_and_type(
        shape: Sequence[int], element_type: Any, device_type: str = "cpu", device_id: int = 0,
        vendor_id: int = -1, memory_info: Any = None
    ) -> OrtValue:
        _check_device(device_type)
        if memory_info is not None and getattr(memory_info, "name", "Cpu").lower() != "cpu":
            raise FailValueError(f"ortvalue_from_shape_and_type: onnxtrain allocates on the CPU only, got "
                                 f"memory_info {memory_info!r}")
        dims = tuple(int(d) for d in shape)
        if any(d < 0 for d in dims):
            raise FailValueError(f"ortvalue_from_shape_and_type: shape {list(dims)} has a negative dimension")
        return OrtValue(np.empty(dims, dtype=_np_type(element_type)))

    @property
    def _ortvalue(self) -> OrtValue:
        """Itself: onnxruntime's wrapper held the C value here, which scripts passed on (e.g. to
        ``Module.copy_buffer_to_parameters``, which refused the wrapper in onnxruntime-training 1.19)."""
        return self

    @staticmethod
    def ort_value_from_sparse_tensor(sparse_tensor: Any) -> OrtValue:
        """An OrtValue holding ``sparse_tensor`` (a :class:`~onnxtrain.capi.sparse_tensor.SparseTensor`)."""
        if not isinstance(sparse_tensor, SparseTensor):
            raise TypeError(f"ort_value_from_sparse_tensor takes a SparseTensor, got "
                            f"{type(sparse_tensor).__name__}")
        return OrtValue(sparse_tensor)

    def as_sparse_tensor(self) -> Any:
        """The SparseTensor this value holds; a Fail for another value, as in onnxruntime."""
        if not self.is_sparse_tensor():
            raise Fail(f"OrtValue.as_sparse_tensor: the value is {self.data_type()}, not a sparse tensor")
        return self._array

    def numpy(self) -> np.ndarray:
        if isinstance(self._array, SparseTensor):  # (onnxruntime: no numpy array of a sparse tensor)
            raise Fail("OrtValue.numpy: the value is a sparse tensor; read it with as_sparse_tensor()")
        return self._array

    def _tensor(self, what: str) -> np.ndarray:
        if not isinstance(self._array, np.ndarray):
            raise Fail(f"OrtValue.{what}: the value is {self.data_type()}, not a tensor")
        return self._array

    def shape(self) -> list[int]:
        if self.is_sparse_tensor():  # its dense shape, as onnxruntime gives it
            return self._array.dense_shape()
        return list(self._tensor("shape()").shape)

    def data_type(self) -> str:
        value = self._array
        if isinstance(value, np.ndarray):
            return f"tensor({_type_name(value.dtype)})"
        if self.is_sparse_tensor():
            return value.data_type()
        declared = self._declared or ""
        if declared.startswith("optional(") and value is not None:  # an optional holding a value: the value's
            declared = declared[len("optional("):-1]
        if isinstance(value, (list, tuple)):
            if declared.startswith("seq(") and (not value or isinstance(value[0], dict)):
                return declared  # empty, or of maps (ZipMap's): the graph's type
            first = next((np.asarray(v) for v in value), None)
            return f"seq(tensor({_type_name(first.dtype) if first is not None else 'float'}))"
        if value is None:
            return declared if declared.startswith("optional(") else "optional(tensor(float))"
        return type(value).__name__

    def element_type(self) -> int:
        """The ONNX element type (``TensorProto.FLOAT`` = 1, ...), as onnxruntime returns it; a sequence's
        is its elements' (from its type, ``seq(tensor(int16))``, when it is empty)."""
        if isinstance(self._array, (list, tuple)):
            from onnxtrain.ir.types import TENSOR_TYPE_STRINGS

            name = self.data_type()  # seq(tensor(<type>))
            inner = name[len("seq(tensor("):-2] if name.startswith("seq(tensor(") else ""
            code = next((k for k, v in TENSOR_TYPE_STRINGS.items() if v == f"tensor({inner})"), None)
            if code is not None:
                return int(code)
        if self.is_sparse_tensor():
            return self._array._element_type()
        return int(helper.np_dtype_to_tensor_dtype(self._tensor("element_type()").dtype))

    def proto_type(self) -> int:
        """The ONNX element type number, as onnxruntime-training's builds named :meth:`element_type`."""
        return self.element_type()

    def tensor_size_in_bytes(self) -> int:
        return int(self._tensor("tensor_size_in_bytes()").nbytes)

    def __array__(self, dtype: Any = None, copy: bool | None = None) -> np.ndarray:
        array = self._tensor("__array__")
        if dtype is not None and np.dtype(dtype) != array.dtype:
            return array.astype(dtype)
        return array.copy() if copy else array

    def device_name(self) -> str:
        return "cpu"

    def data_ptr(self) -> int:
        return int(self._tensor("data_ptr()").ctypes.data)

    def is_tensor(self) -> bool:
        return isinstance(self._array, np.ndarray)

    def is_sparse_tensor(self) -> bool:
        return isinstance(self._array, SparseTensor)

    def is_tensor_sequence(self) -> bool:
        return isinstance(self._array, (list, tuple))

    def has_value(self) -> bool:
        return self._array is not None

    def update_inplace(self, data: np.ndarray) -> None:
        """Copy ``data`` (as many values as this value holds) into this value's array. Values of another
        type of the same width are copied bit for bit, as onnxruntime copies (bfloat16 or float8 values
        given as uint16 or uint8 bits); values of another width are converted."""
        src = np.asarray(data)
        if src.size != self._array.size:
            raise FailValueError(f"update_inplace: {src.size} values for an OrtValue of {self._array.size}")
        numeric = src.dtype.kind not in "OUS" and self._array.dtype.kind not in "OUS"  # (not text)
        if numeric and src.dtype != self._array.dtype and src.dtype.itemsize == self._array.dtype.itemsize:
            src = np.ascontiguousarray(src).view(self._array.dtype)
        np.copyto(self._array, src.reshape(self._array.shape))

    # DLPack: the protocol (``torch.from_dlpack(value)``), and the legacy training API's ``to_dlpack`` and
    # ``from_dlpack(data, is_bool_tensor)``; no copy either way
    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._array.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> tuple[int, int]:
        return self._array.__dlpack_device__()

    def to_dlpack(self) -> Any:
        """A DLPack capsule of the value (shares its memory)."""
        return self._array.__dlpack__()

    @staticmethod
    def from_dlpack(data: Any, is_bool_tensor: bool = False) -> OrtValue:
        """An OrtValue sharing the memory of ``data``: an object with ``__dlpack__`` (a torch tensor, a
        numpy array) or a raw DLPack capsule of a CPU tensor. ``is_bool_tensor``: a uint8 tensor holding
        bools (as legacy exporters passed them) is read as bool."""
        source = data if hasattr(data, "__dlpack__") else _Capsule(data)
        array = np.from_dlpack(source)
        if is_bool_tensor and array.dtype == np.uint8:
            array = array.view(np.bool_)
        return OrtValue(array)

    def __repr__(self) -> str:
        shape = f", shape={self.shape()}" if self.is_tensor() else ""
        return f"OrtValue({self.data_type()}{shape})"


class OrtValueVector(list):
    """A list of OrtValues (onnxruntime's ``OrtValueVector``)."""

    def push_back(self, value: OrtValue) -> None:
        self.append(value)

    def reserve(self, n: int) -> None:
        """Accepted for onnxruntime's interface; a Python list needs no reservation."""

    def element_type_at(self, index: int) -> int:
        """The ONNX element type number of the value at ``index``."""
        return self[index].element_type()

    def to_dlpack(self, to_tensor: Callable[[Any], Any] | None = None) -> list[Any]:
        """A DLPack capsule of each value (sharing its memory), or ``to_tensor(capsule)`` of each."""
        capsules = [v.to_dlpack() for v in self]
        return capsules if to_tensor is None else [to_tensor(c) for c in capsules]


class _Capsule:
    """A raw DLPack capsule as the protocol's object, for ``np.from_dlpack`` (CPU memory only)."""

    def __init__(self, capsule: Any):
        self._capsule = capsule

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self._capsule

    def __dlpack_device__(self) -> tuple[int, int]:
        return (1, 0)  # kDLCPU, device 0


def _type_name(dtype: np.dtype) -> str:
    name = helper.tensor_dtype_to_string(helper.np_dtype_to_tensor_dtype(dtype))
    return {"TensorProto.FLOAT": "float", "TensorProto.DOUBLE": "double"}.get(
        name, name.replace("TensorProto.", "").lower()
    )


class IOBinding:
    """Inputs and outputs bound ahead of ``run_with_iobinding`` (numpy arrays, OrtValues or raw pointers)."""

    def __init__(self, session: InferenceSession):
        self._session = session
        self._inputs: dict[str, np.ndarray] = {}
        self._outputs: dict[str, np.ndarray | None] = {}
        self._results: list[OrtValue] = []
        # outputs bound without a buffer: the value a run made, which later runs of the same shape and type
        # write into, as onnxruntime reuses it (an OrtValue fetched once shows each run's result)
        self._made: dict[str, OrtValue] = {}
        # the OrtValues bound as outputs, which get_outputs returns before the first run (as onnxruntime)
        self._bound: dict[str, OrtValue] = {}

    def _input(self, name: str) -> str:
        """``name`` when the session has an input (or overridable initializer) of that name; else
        InvalidFeed, as onnxruntime refuses the binding at once."""
        s = self._session
        names = [a.name for a in (*s.get_inputs(), *s.get_overridable_initializers())]
        if name not in names:
            raise InvalidFeed(f"IOBinding: the session has no input {name!r}; its inputs are {names}")
        return name

    def _output(self, name: str) -> str:
        names = [a.name for a in self._session.get_outputs()]
        if name not in names:
            raise InvalidFeed(f"IOBinding: the session has no output {name!r}; its outputs are {names}")
        return name

    def bind_cpu_input(self, name: str, arr_on_cpu: np.ndarray) -> None:
        self._inputs[self._input(name)] = np.asarray(arr_on_cpu)

    def bind_input(
        self,
        name: str,
        device_type: Any = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Sequence[int] | None = None,
        buffer_ptr: int | None = None,
    ) -> None:
        """Bind input ``name`` to an array, or to a raw CPU buffer at ``buffer_ptr`` (no copy)."""
        name = self._input(name)
        if isinstance(device_type, (np.ndarray, OrtValue)):  # bind_input(name, array) shorthand
            self._inputs[name] = device_type.numpy() if isinstance(device_type, OrtValue) else device_type
            return
        _check_device(device_type)
        if buffer_ptr is None or element_type is None or shape is None:
            raise FailValueError(f"bind_input({name!r}): element_type, shape and buffer_ptr are required")
        self._inputs[name] = array_from_pointer(buffer_ptr, element_type, shape)

    def bind_ortvalue_input(self, name: str, ortvalue: OrtValue) -> None:
        self._inputs[self._input(name)] = ortvalue.numpy()

    def bind_output(
        self,
        name: str,
        device_type: Any = "cpu",
        device_id: int = 0,
        element_type: Any = None,
        shape: Sequence[int] | None = None,
        buffer_ptr: int | None = None,
    ) -> None:
        """Bind output ``name``; with ``buffer_ptr`` the result is written into that buffer."""
        name = self._output(name)
        if buffer_ptr is not None or device_type not in _DEVICE_NAMES:
            _check_device(device_type)
        # (bound by name to a device onnxruntime knows, the output is made on the CPU, as onnxruntime's CPU
        # package makes it)
        self._made.pop(name, None)  # bound anew: the next run makes a value of its own, as onnxruntime's
        self._bound.pop(name, None)
        if buffer_ptr is not None:
            if element_type is None or shape is None:
                raise FailValueError(
                    f"bind_output({name!r}): element_type and shape are required with buffer_ptr"
                )
            self._outputs[name] = array_from_pointer(buffer_ptr, element_type, shape)
        else:
            self._outputs[name] = None

    def bind_ortvalue_output(self, name: str, ortvalue: OrtValue) -> None:
        name = self._output(name)
        self._made.pop(name, None)
        self._outputs[name] = ortvalue.numpy()
        self._bound[name] = ortvalue

    def get_outputs(self) -> list[OrtValue]:
        """The last run's outputs; before a run, one per bound output, as onnxruntime: the OrtValue bound,
        the bound buffer's, or an empty one (``has_value()`` False) for an output bound by name alone."""
        if not self._results:
            return [self._bound[n] if n in self._bound else OrtValue(a) for n, a in self._outputs.items()]
        return list(self._results)

    def get_outputs_as_ortvaluevector(self) -> OrtValueVector:
        return OrtValueVector(self._results)

    def copy_outputs_to_cpu(self) -> list[Any]:
        """Copies of the outputs: arrays, lists of arrays for sequences, None for empty optionals."""
        def copied(v: Any) -> Any:
            if isinstance(v, (list, tuple)):  # (a sequence of maps: ZipMap's dicts)
                return [dict(x) if isinstance(x, dict) else np.array(x, copy=True) for x in v]
            return None if v is None else np.array(v, copy=True)

        return [copied(v.numpy()) for v in self._results]

    def clear_binding_inputs(self) -> None:
        self._inputs.clear()

    def clear_binding_outputs(self) -> None:
        self._outputs.clear()
        self._made.clear()
        self._bound.clear()
        self._results = []

    def synchronize_inputs(self) -> None:
        pass

    def synchronize_outputs(self) -> None:
        pass

    def _check_targets(self, declared: Sequence[Any], inputs: Sequence[Any] = ()) -> None:
        """Before a run: every buffer bound to an output of ``declared`` (the session's ``NodeArg`` list) of
        a known element type must be of that type, and of a declared shape of rank ≥ 1 (``[]`` may mean
        unknown) of its rank and known sizes (a symbolic size that the bound ``inputs``, the session's input
        ``NodeArg`` list, fix included), so that a wrong buffer fails before the run changes a training
        session's state."""
        from onnxtrain.ir.types import TENSOR_TYPE_STRINGS

        sizes: dict[str, int] = {}  # symbolic dims the bound inputs fix (the first input giving one)
        for a in inputs:
            v = self._inputs.get(a.name)
            if isinstance(v, np.ndarray) and a.shape and len(a.shape) == v.ndim:
                for d, size in zip(a.shape, v.shape):
                    if isinstance(d, str) and d:
                        sizes.setdefault(d, size)
        by_name = {a.name: a for a in declared}
        for n, target in self._outputs.items():
            arg = by_name.get(n)
            if target is None or arg is None:
                continue
            want = TENSOR_TYPE_STRINGS.get(helper.np_dtype_to_tensor_dtype(target.dtype))
            if arg.type.startswith("tensor(") and want != arg.type:
                raise InvalidFeedType(f"output {n!r}: bound buffer is {want} ({target.dtype}), the output is "
                                      f"{arg.type}")
            dims = [sizes.get(d, d) if isinstance(d, str) else d for d in arg.shape or []]
            if dims and (len(dims) != target.ndim or any(isinstance(d, int) and d != s
                                                         for d, s in zip(dims, target.shape))):
                raise InvalidFeed(f"output {n!r}: bound buffer has shape {list(target.shape)}, the output "
                                  f"has {dims}")

    def _store(self, names: Sequence[str], values: Sequence[np.ndarray],
               declared: dict[str, str] | None = None) -> None:
        """Keep a run's outputs: written into the bound buffers, or as OrtValues (of the ``declared`` types
        by name: an empty sequence's or optional's type is the graph's)."""
        results = []
        for n, v in zip(names, values):
            target = self._outputs.get(n)
            if target is not None:
                if target.shape != np.shape(v) and not target.size == np.size(v) == 1:
                    raise InvalidFeed(
                        f"output {n!r}: bound buffer has shape {list(target.shape)}, "
                        f"result has {list(np.shape(v))}"
                    )
                np.copyto(target, np.reshape(v, target.shape))  # (a scalar into a one-value buffer too)
                results.append(OrtValue(target))
            elif v is None or isinstance(v, (list, tuple)):  # a sequence stays a list, an empty optional None
                results.append(OrtValue(v, (declared or {}).get(n)))
            else:
                v = np.asarray(v)
                made = self._made.get(n)
                if (made is not None and made._array.shape == v.shape and made._array.dtype == v.dtype
                        and made._array.flags.writeable):
                    np.copyto(made._array, v)
                else:
                    made = self._made[n] = OrtValue(v, (declared or {}).get(n))
                results.append(made)
        self._results = results
