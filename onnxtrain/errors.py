"""onnxruntime's exception classes (``onnxruntime.capi._pybind_state.Fail``, ``InvalidArgument``, ...), all
``RuntimeError``\\ s, so that ported ``except`` clauses catch onnxtrain's errors of the same kind.

onnxtrain's own errors derive from them and from the Python class they were before (a bad feed is an
``InvalidArgument`` and a ``ValueError``), so code written for either keeps working."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any, TypeVar


class Fail(RuntimeError):
    """A failure while loading or running a model (onnxruntime's status FAIL)."""


class InvalidArgument(RuntimeError):
    """An argument the call cannot take: a feed of the wrong type or shape, an unknown name."""


class NoSuchFile(RuntimeError):
    """A file the call needs does not exist."""


class NoModel(RuntimeError):
    """No model was loaded."""


class EngineError(RuntimeError):
    """onnxruntime's status ENGINE_ERROR."""


class RuntimeException(RuntimeError):
    """onnxruntime's status RUNTIME_EXCEPTION."""


class InvalidProtobuf(RuntimeError):
    """A model file that does not parse as ONNX."""


class ModelLoaded(RuntimeError):
    """A model was already loaded."""


class NotImplementedError_(RuntimeError):  # exported as ``NotImplemented``, onnxruntime's name
    """onnxruntime's status NOT_IMPLEMENTED."""


class InvalidGraph(RuntimeError):
    """A graph that is not valid ONNX."""


class EPFail(RuntimeError):
    """An execution provider failed."""


class InvalidFeed(InvalidArgument, ValueError):
    """A feed or requested output the graph does not have, or of the wrong shape."""


class InvalidFeedType(InvalidArgument, TypeError):
    """A feed of the wrong element type or kind."""


class NoneFed(InvalidFeed, Fail, RuntimeException):
    """None fed to a tensor input: onnxruntime's ``Fail`` ("Missing Input"; ``RuntimeException`` in
    onnxruntime-training 1.16.3 and 1.19.2), and an ``InvalidFeed``."""


class ModelNotFound(NoSuchFile, FileNotFoundError):
    """A model path that does not exist."""


class FailValueError(Fail, ValueError):
    """A value the legacy session cannot take (a setting, a state tensor): a ``ValueError``, and the
    ``Fail`` onnxruntime's binding raised for it."""


class FailKeyError(Fail, KeyError):
    """A name the legacy session does not know (a state tensor): a ``KeyError``, and onnxruntime's
    ``Fail``."""

    def __str__(self) -> str:  # the message, not KeyError's repr of it
        return str(self.args[0]) if len(self.args) == 1 else super().__str__()


class NoSuchFileError(FileNotFoundError, NoSuchFile):  # OSError's constructor first: errno, filename
    """A file or folder the call needs does not exist: a ``FileNotFoundError`` (with its errno and file
    name), and onnxruntime's ``NoSuchFile``."""


class NoFolderForOutput(NoSuchFileError, InvalidArgument):
    """``SessionOptions.optimized_model_filepath`` in a folder that does not exist: a ``FileNotFoundError``
    and ``NoSuchFile``, and the ``InvalidArgument`` onnxruntime's sessions raise for it ("SystemError :
    2")."""


class FailTypeError(Fail, TypeError):
    """A value of the wrong type for the legacy session (a state tensor's dtype): a ``TypeError``, and
    onnxruntime's ``Fail``."""


class FailNotImplementedError(Fail, NotImplementedError):
    """A setting the legacy session does not implement (ZeRO stage 2): a ``NotImplementedError``, and
    onnxruntime's ``Fail``."""


class FailIsADirectoryError(IsADirectoryError, Fail):
    """A folder where the call needs a file: an ``IsADirectoryError``, and onnxruntime's ``Fail``."""


class FailNotADirectoryError(NotADirectoryError, Fail):
    """A file where the call needs a folder: a ``NotADirectoryError``, and onnxruntime's ``Fail``."""


class FailPermissionError(PermissionError, Fail):
    """A file or folder the call may not read or write: a ``PermissionError``, and onnxruntime's ``Fail``."""


class FailOSError(OSError, Fail):
    """A file the call could not write or read for another reason (a full disk, a size limit, an I/O
    error): an ``OSError`` with its errno and file name, and onnxruntime's ``Fail``."""


_F = TypeVar("_F", bound=Callable[..., Any])


def raises_as_onnxruntime(fn: _F) -> _F:
    """``fn`` with its ``ValueError``, ``KeyError``, ``TypeError``, ``NotImplementedError``,
    ``FileNotFoundError``, ``IsADirectoryError``, ``NotADirectoryError``, ``PermissionError`` and a plain
    ``OSError`` raised as
    their duals above (subclasses, onnxtrain's own errors among them, pass unchanged): onnxruntime's
    bindings raised a ``RuntimeError`` where onnxtrain's checks raise these, so ported ``except
    RuntimeError`` clauses and code written for onnxtrain both catch them."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except (OSError, KeyError, ValueError, TypeError, NotImplementedError) as e:
            dual = _DUALS.get(type(e))  # a subclass (TranslationError, ...) keeps its own class
            if dual is None:
                raise
            if isinstance(e, OSError) and e.filename is not None:
                args: tuple = (e.errno, e.strerror, e.filename)
            else:
                args = e.args
            raise dual(*args).with_traceback(e.__traceback__) from None

    return wrapper  # type: ignore[return-value]


_DUALS: dict[type, type] = {FileNotFoundError: NoSuchFileError, IsADirectoryError: FailIsADirectoryError,
                            NotADirectoryError: FailNotADirectoryError, PermissionError: FailPermissionError,
                            KeyError: FailKeyError, ValueError: FailValueError, TypeError: FailTypeError,
                            NotImplementedError: FailNotImplementedError, OSError: FailOSError}


# the names of onnxruntime.capi._pybind_state
ORT_EXCEPTIONS = {
    "Fail": Fail,
    "InvalidArgument": InvalidArgument,
    "NoSuchFile": NoSuchFile,
    "NoModel": NoModel,
    "EngineError": EngineError,
    "RuntimeException": RuntimeException,
    "InvalidProtobuf": InvalidProtobuf,
    "ModelLoaded": ModelLoaded,
    "NotImplemented": NotImplementedError_,
    "InvalidGraph": InvalidGraph,
    "EPFail": EPFail,
}


def program_hint(obj: object) -> str:
    """A hint for an unsupported model argument that is torch's ``ONNXProgram`` (else "")."""
    return " (torch's ONNXProgram: pass its .model_proto)" if hasattr(obj, "model_proto") else ""
