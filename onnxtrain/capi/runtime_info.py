"""Module-level functions of onnxruntime's Python binding that scripts call before any session: the
default logger's severity and verbosity, telemetry, the build string and features, and the MPI context."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from typing import Any

from onnxtrain.errors import FailValueError

# onnxruntime's defaults: WARNING, verbosity 0, its own sink
_LOGGER: dict[str, Any] = {"severity": 2, "verbosity": 0, "callback": None}
_SET: set[str] = set()  # the settings a caller made (passed on to onnxruntime when it is imported later)


def _level(value: object, what: str, lo: int | None, hi: int | None) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {type(value).__name__} {value!r}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        raise FailValueError(f"{what} must be in {lo}..{hi}, got {value}")  # onnxruntime: a RuntimeError
    return int(value)


def set_default_logger_severity(severity: int) -> None:
    """The severity below which onnxruntime's log lines are dropped (0 verbose … 4 fatal; default 2,
    warnings). It applies to the onnxruntime backend's sessions created afterwards; onnxtrain's own
    messages are Python warnings, filtered with the ``warnings`` module."""
    _LOGGER["severity"] = _level(severity, "severity", 0, 4)
    _SET.add("severity")
    _pass_on()


def set_default_logger_verbosity(verbosity: int) -> None:
    """The verbosity of onnxruntime's verbose log lines (with severity 0); any int, as onnxruntime takes."""
    _LOGGER["verbosity"] = _level(verbosity, "verbosity", None, None)
    _SET.add("verbosity")
    _pass_on()


def set_default_logger_callback(callback: Callable[[int, str, str, str, str], None] | None,
                                severity: int = 2) -> None:
    """Route onnxruntime's log lines to ``callback(severity, category, logid, code_location, message)``
    (None: back to its default sink), setting the default severity when a callback is given, as onnxruntime's
    function does; passed on to the onnxruntime backend like the severity. The numpy engine writes no log
    lines (onnxtrain's own messages are Python warnings), so no line of its sessions reaches the callback.
    A severity outside 0..4 or a callback that is not callable is refused, as there."""
    level = _level(severity, "severity", 0, 4)
    if callback is not None and not callable(callback):
        raise FailValueError(f"set_default_logger_callback: callback must be a callable, got "
                             f"{type(callback).__name__}")
    _LOGGER["callback"] = callback
    _SET.add("callback")
    if callback is not None:
        _LOGGER["severity"] = level
        _SET.add("severity")
    _pass_on()


def default_logger_severity() -> int:
    """The severity last set by :func:`set_default_logger_severity` (2 until then)."""
    return _LOGGER["severity"]


def apply_logger_settings(ort: object) -> None:
    """Pass the settings made so far on to the ``onnxruntime`` module ``ort`` (the backend calls this when
    it imports onnxruntime, which may come after the settings)."""
    for key in sorted(_SET):  # (the callback before the severity, which a callback would set)
        fn = getattr(ort, f"set_default_logger_{key}", None)
        if fn is not None and key == "callback":
            fn(_LOGGER["callback"], _LOGGER["severity"])
        elif fn is not None:
            fn(_LOGGER[key])


def _pass_on() -> None:
    """The settings to onnxruntime now when it is already imported (else when the backend imports it)."""
    import sys

    ort = sys.modules.get("onnxruntime")
    if ort is not None:
        apply_logger_settings(ort)


def disable_telemetry_events() -> None:
    """onnxtrain sends no telemetry: nothing to disable."""


def enable_telemetry_events() -> None:
    """onnxtrain sends no telemetry: nothing to enable."""


def has_collective_ops() -> bool:
    """Whether the build has collective (NCCL/MPI) operators: False (onnxtrain's data parallelism
    reduces outside the graphs, over mpi4py)."""
    return False


def get_build_info() -> str:
    """What this onnxtrain runs on: its version and those of numpy, onnx and protobuf, after the words
    "Build Info", as in onnxruntime's (``ORT Build Info: git-branch=...``)."""
    import numpy
    import onnx
    from google.protobuf import __version__ as protobuf_version

    import onnxtrain

    return (f"onnxtrain {onnxtrain.__version__} Build Info: numpy {numpy.__version__}, "
            f"onnx {onnx.__version__}, protobuf {protobuf_version}")


def get_mpi_context_world_rank() -> int:
    """This process's rank in the MPI job (0 outside one)."""
    return _world().rank


def get_mpi_context_world_size() -> int:
    """The number of processes of the MPI job (1 outside one)."""
    return _world().size


def get_mpi_context_local_rank() -> int:
    """This process's rank among the job's processes on its host (0 outside a job)."""
    return _world().local_rank


def get_mpi_context_local_size() -> int:
    """The number of the job's processes on this host (1 outside a job)."""
    return _world().local_size


def _world():
    from onnxtrain.parallel.comm import world

    return world()
