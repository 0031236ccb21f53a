"""Writing files atomically: a temporary name in the same folder, flushed, then renamed."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from typing import IO

import onnx


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``."""
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes files owner-only; give the usual permissions
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike) -> None:
    """Save ``model`` to ``path`` atomically."""
    write_atomic(path, lambda f: f.write(model.SerializeToString()))
