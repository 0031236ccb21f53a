"""Loading the artifact models and checking user feeds against their graph inputs."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import onnx

from onnxtrain.capi.feeds import feed_array
from onnxtrain.capi.ortvalue import OrtValue
from onnxtrain.errors import InvalidFeed, InvalidFeedType
from onnxtrain.ir.builder import loadable_model
from onnxtrain.ir.types import np_dtype_of, value_info_shape
from onnxtrain.training.ort_artifacts.common import MS, OPTIMIZER_OPS

ModelLike = str | os.PathLike | bytes | onnx.ModelProto


def load_model(uri: ModelLike, what: str) -> tuple[onnx.ModelProto, str | None]:
    """The ModelProto of ``uri`` (path, bytes or proto) and its path (None when not from a file); one of an
    IR version or opset the installed onnx (onnxruntime, for com.microsoft) does not know is refused."""
    model, path = _read(uri, what)
    return loadable_model(model, f"the {what} model{f' {path}' if path else ''}: "), path


def is_optimizer_model(model: onnx.ModelProto) -> bool:
    """Whether ``model`` is an optimizer model: onnxtrain's (its ``onnxtrain.optimizer`` metadata) or
    onnxruntime-training's (an AdamWOptimizer or SGDOptimizerV2 node)."""
    if any(p.key == "onnxtrain.optimizer" for p in model.metadata_props):
        return True
    return any(n.op_type in OPTIMIZER_OPS and n.domain == MS for n in model.graph.node)


def _read(uri: ModelLike, what: str) -> tuple[onnx.ModelProto, str | None]:
    if isinstance(uri, onnx.ModelProto):
        return uri, None
    if isinstance(uri, (bytes, bytearray, memoryview)):
        data = bytes(uri)
        name = _file_name(data)
        if name is None or not os.path.isfile(name):
            try:
                return onnx.load_from_string(data), None
            except Exception as e:
                if name is None:
                    raise ValueError(f"the {what} model bytes could not be parsed: {e}") from None
                if not os.path.exists(name):
                    raise FileNotFoundError(f"Load model from {name} failed: the {what} model file does not "
                                            f"exist (nor do the bytes parse as a model: {e})") from None
        uri = name  # a file's name, as onnxruntime-training reads bytes
    if not isinstance(uri, (str, os.PathLike)):
        raise TypeError(f"the {what} model must be a path, bytes or an onnx.ModelProto, "
                        f"got {type(uri).__name__}")
    path = os.fspath(uri)
    if path.endswith(".ort"):
        raise ValueError(f"{path}: ORT-format models are not supported; pass the .onnx file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"the {what} model path is a directory: {path}")
    if not os.path.exists(path):
        raise FileNotFoundError(f"Load model from {path} failed: the {what} model file does not exist")
    return parse_model_file(path), path


def _file_name(data: bytes) -> str | None:
    """``data`` as a file name (``os.fsdecode``) when it may be one: no NUL and not past PATH_MAX; else None.
    onnxruntime-training passes ``os.fspath(uri)`` to its binding, which takes bytes as the file's name."""
    if not data or b"\0" in data or len(data) > 4096:
        return None
    return os.fsdecode(data)


def parse_model_file(path: str) -> onnx.ModelProto:
    """The ONNX model in file ``path``; a ValueError "Load model from <path> failed: not a valid ONNX model"
    when it does not parse."""
    try:
        return onnx.load(path)
    except Exception as e:
        raise ValueError(f"Load model from {path} failed: not a valid ONNX model ({e})") from None


@dataclass(frozen=True)
class InputSpec:
    """A user input: name, element type and dims (int, symbolic name or None; shape None = unknown rank)."""

    name: str
    dtype: np.dtype | None
    shape: tuple[int | str | None, ...] | None
    # derived once for the quick check of a plain array: whether it applies (a declared dtype other than
    # object), the dims when all are fixed, else the (axis, size) pairs that are
    _quick: bool = field(init=False, repr=False, compare=False)
    _static: tuple[int, ...] | None = field(init=False, repr=False, compare=False)
    _fixed: tuple[tuple[int, int], ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        shape = self.shape
        quick = self.dtype is not None and self.dtype != np.dtype(object)
        static = shape if shape is not None and all(isinstance(d, int) for d in shape) else None
        fixed = () if shape is None else tuple((i, d) for i, d in enumerate(shape) if isinstance(d, int))
        object.__setattr__(self, "_quick", quick)
        object.__setattr__(self, "_static", static)
        object.__setattr__(self, "_fixed", fixed)

    @classmethod
    def of(cls, vi: onnx.ValueInfoProto) -> InputSpec:
        shape = value_info_shape(vi.type)
        return cls(vi.name, np_dtype_of(vi.type), None if shape is None else tuple(shape))

    def check(self, value: Any) -> np.ndarray:
        """``value`` as an array of the right dtype and shape; InvalidFeedType / InvalidFeed (also TypeError /
        ValueError) name the input."""
        # a plain row-major array of the declared dtype and dims: the full check would return it as it is
        if (type(value) is np.ndarray and self._quick and value.dtype == self.dtype
                and value.flags.c_contiguous):
            if self._static is not None:
                if value.shape == self._static:
                    return value
            elif self.shape is None or (value.ndim == len(self.shape)
                                        and all(value.shape[i] == d for i, d in self._fixed)):
                return value
        return self._full_check(value)

    def _full_check(self, value: Any) -> np.ndarray:
        """:meth:`check` for any value."""
        if isinstance(value, OrtValue):
            value = value.numpy()
        arr = feed_array(self.name, value, self.dtype)
        if self.dtype == np.dtype(object) and arr.dtype.kind in "US":  # numpy strings for a string input
            arr = arr.astype(object)
        if self.dtype is not None and arr.dtype != self.dtype:
            raise InvalidFeedType(f"input {self.name!r}: unexpected data type. Actual: {arr.dtype}, "
                            f"expected: {self.dtype}")
        if self.shape is not None:
            if arr.ndim != len(self.shape):
                raise InvalidFeed(f"input {self.name!r}: invalid rank. Got: {arr.ndim} (shape {arr.shape}), "
                                 f"Expected: {len(self.shape)} ({self.describe_shape()})")
            for i, (got, want) in enumerate(zip(arr.shape, self.shape)):
                if isinstance(want, int) and got != want:
                    raise InvalidFeed(f"input {self.name!r}: invalid dimension at index {i}. Got: {got}, "
                                     f"Expected: {want} (shape {arr.shape}, expected "
                                     f"{self.describe_shape()})")
        return arr

    def describe_shape(self) -> str:
        if self.shape is None:
            return "any shape"
        return "[" + ", ".join("?" if d is None else str(d) for d in self.shape) + "]"


def check_user_inputs(specs: Sequence[InputSpec], inputs: Sequence[Any], what: str) -> dict[str, np.ndarray]:
    """Feeds for ``specs`` from positional ``inputs``; the count must match."""
    if len(inputs) != len(specs):
        names = [s.name for s in specs]
        raise InvalidFeed(f"{what} expects {len(specs)} input(s) {names}, got {len(inputs)}")
    return {s.name: s.check(v) for s, v in zip(specs, inputs)}


def check_device(device: Any) -> None:
    if not isinstance(device, str):
        raise TypeError(f"device must be a str such as 'cpu', got {type(device).__name__}")
    kind, _, index = device.partition(":")
    if kind.lower() != "cpu" or (index and index != "0"):
        raise ValueError(f"Unsupported device type: {device!r}; onnxtrain runs on 'cpu' only")
