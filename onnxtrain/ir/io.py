"""Writing files atomically: a temporary name in the same folder, flushed, then renamed.

:func:`write_atomic` writes one file. :class:`StagedFiles` writes several that go together (a model and
its external data, a checkpoint and its ``.data`` file, a set of training artifacts): every file goes to
its temporary first, and only when all are written are they renamed onto their targets. A failure
while writing leaves every old file as it was; a failure among the renames puts the old files back
(kept meanwhile as hard links). Temporaries are named ``<target name>.<random>.tmp``.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
import tempfile
from collections.abc import Callable
from types import TracebackType
from typing import IO

import onnx


def _umask() -> int:
    """The process's umask, read without changing it where /proc says it (os.umask is process-wide)."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _fsync_dir(folder: str) -> None:
    """Flush ``folder``'s entries (the renames) to disk; best effort (not every system allows it)."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


class StagedFiles:
    """Files written to temporaries beside their targets, renamed onto them together by :meth:`commit`.

    Use as a context manager: the files are committed when the block ends, discarded when it raises::

        with StagedFiles() as files:
            files.save_model(training, "art/training_model.onnx")
            files.write("art/checkpoint", lambda f: f.write(data))
    """

    def __init__(self) -> None:
        self._staged: list[tuple[str, str]] = []  # (temporary, target), in rename order
        self._remove: list[str] = []
        self._closed = False

    def __enter__(self) -> StagedFiles:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None,
                 tb: TracebackType | None) -> None:
        if kind is None:
            self.commit()
        else:
            self.discard()

    @property
    def targets(self) -> list[str]:
        """The files staged so far, in the order they will be renamed."""
        return [path for _, path in self._staged]

    def write(self, path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
        """Call ``write(f)`` on a new temporary beside ``path`` and fsync it; renamed at :meth:`commit`."""
        if self._closed:
            raise RuntimeError("these staged files were already committed or discarded")
        path = os.fspath(path)
        if os.path.abspath(path) in {os.path.abspath(t) for t in self.targets}:  # ./a/x and a/x alike
            raise ValueError(f"{path} is staged twice")
        folder = os.path.dirname(os.path.abspath(path))
        os.makedirs(folder, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".tmp", dir=folder)
        try:
            with os.fdopen(fd, "wb") as f:
                write(f)
                f.flush()
                os.fsync(f.fileno())
            try:  # mkstemp makes files owner-only: the old file's mode, else the usual one
                mode = stat.S_IMODE(os.stat(path).st_mode)
            except OSError:
                mode = 0o666 & ~_umask()
            os.chmod(tmp, mode)
        except BaseException:
            _unlink_quietly(tmp)
            raise
        self._staged.append((tmp, path))

    def save_model(self, model: onnx.ModelProto, path: str | os.PathLike) -> None:
        """Stage ``model`` serialized (no external data) for ``path``."""
        self.write(path, lambda f: f.write(model.SerializeToString()))

    def remove_after(self, path: str | os.PathLike) -> None:
        """Delete ``path`` (if it is a file) once every staged file is in place: a side file now unused."""
        self._remove.append(os.fspath(path))

    def discard(self) -> None:
        """Delete the temporaries; the targets stay as they were."""
        for tmp, _ in self._staged:
            _unlink_quietly(tmp)
        self._staged.clear()
        self._closed = True

    def commit(self) -> None:
        """Rename every temporary onto its target; if one rename fails, put back the files already
        replaced (the old ones, or none where there was none) and raise."""
        if self._closed:
            raise RuntimeError("these staged files were already committed or discarded")
        self._closed = True
        done: list[tuple[str, str | None, bool]] = []  # (target, hard link to its old file, had one)
        backups: list[str] = []
        pending = list(self._staged)
        try:
            while pending:
                tmp, path = pending[0]
                existed = os.path.lexists(path)
                old = _keep_old(path) if len(self._staged) > 1 and existed else None
                if old is not None:
                    backups.append(old)
                os.replace(tmp, path)
                pending.pop(0)
                done.append((path, old, existed))
        except BaseException:
            for path, old, existed in reversed(done):
                try:
                    if old is not None:
                        os.replace(old, path)
                    elif not existed:
                        _unlink_quietly(path)  # there was no such file before
                except OSError:
                    pass
            for tmp, _ in pending:
                _unlink_quietly(tmp)
            for b in backups:
                _unlink_quietly(b)
            raise
        for b in backups:
            _unlink_quietly(b)
        for path in self._remove:
            if path not in self.targets and os.path.isfile(path):
                os.unlink(path)
        for folder in sorted({os.path.dirname(os.path.abspath(p)) for p in self.targets + self._remove}):
            _fsync_dir(folder)


def _keep_old(path: str) -> str | None:
    """A copy of the entry at ``path`` under a temporary name beside it, so that a failed commit can put it
    back with one rename: a hard link to a file (a byte copy where hard links are refused), a new symlink
    to a symlink's target; None when there is nothing to keep (no entry, or a folder, which the rename
    itself refuses)."""
    if not os.path.lexists(path) or (os.path.isdir(path) and not os.path.islink(path)):
        return None
    folder, name = os.path.split(os.path.abspath(path))
    for _ in range(8):
        backup = os.path.join(folder, f"{name}.{secrets.token_hex(4)}.old.tmp")
        try:
            if os.path.islink(path):
                os.symlink(os.readlink(path), backup)
            else:
                try:
                    os.link(path, backup)
                except FileExistsError:
                    raise
                except OSError:  # no hard links here: keep a copy of the bytes and the mode
                    shutil.copy2(path, backup)
            return backup
        except FileExistsError:
            continue
    return None


def write_atomic(path: str | os.PathLike, write: Callable[[IO[bytes]], None]) -> None:
    """Call ``write(f)`` on a temporary file beside ``path``, fsync it, then rename it onto ``path``."""
    with StagedFiles() as files:
        files.write(path, write)


def save_model_atomic(model: onnx.ModelProto, path: str | os.PathLike, *,
                      external_data: str | None = None, size_threshold: int = 1024) -> None:
    """Save ``model`` to ``path`` atomically (with ``external_data``: see :func:`stage_model`)."""
    with StagedFiles() as files:
        stage_model(files, model, path, external_data=external_data, size_threshold=size_threshold)


_DATA_FIELDS = ("float_data", "int32_data", "string_data", "int64_data", "double_data", "uint64_data",
                "raw_data")


def _initializers(g: onnx.GraphProto) -> list[onnx.TensorProto]:
    """The initializers of ``g`` and of the graphs inside its nodes' attributes."""
    out = list(g.initializer)
    for n in g.node:
        for a in n.attribute:
            for sub in ([a.g] if a.type == onnx.AttributeProto.GRAPH else
                        a.graphs if a.type == onnx.AttributeProto.GRAPHS else []):
                out += _initializers(sub)
    return out


def stage_model(files: StagedFiles, model: onnx.ModelProto, path: str | os.PathLike, *,
                external_data: str | None = None, size_threshold: int = 1024) -> None:
    """Stage ``model`` for ``path`` in ``files``. With ``external_data`` (a file name in ``path``'s folder),
    initializers of at least ``size_threshold`` bytes go to that file, written whole (never appended to an
    old one, as onnx.save_model's external-data writer does) and renamed just before the model; ``model``
    itself is left unchanged."""
    path = os.fspath(path)
    if external_data is None:
        files.save_model(model, path)
        return
    if os.path.basename(external_data) != external_data or external_data in ("", ".", ".."):
        raise ValueError(f"external_data must be a file name (no folder), got {external_data!r}")
    from onnx import numpy_helper

    m = onnx.ModelProto()
    m.CopyFrom(model)
    chunks: list[bytes] = []
    offset = 0
    for t in _initializers(m.graph):
        if t.data_location == onnx.TensorProto.EXTERNAL or t.data_type == onnx.TensorProto.STRING:
            continue
        if t.HasField("raw_data"):
            raw = t.raw_data
        else:
            raw = numpy_helper.from_array(numpy_helper.to_array(t)).raw_data
        if len(raw) < size_threshold:
            continue
        for f in _DATA_FIELDS:
            t.ClearField(f)
        t.data_location = onnx.TensorProto.EXTERNAL
        del t.external_data[:]
        for key, value in (("location", external_data), ("offset", str(offset)), ("length", str(len(raw)))):
            entry = t.external_data.add()
            entry.key, entry.value = key, value
        chunks.append(raw)
        offset += len(raw)

    def write_data(f: IO[bytes]) -> None:
        for c in chunks:
            f.write(c)

    if chunks:  # (no tensor that large: the model alone)
        files.write(os.path.join(os.path.dirname(path), external_data), write_data)
    files.save_model(m if chunks else model, path)
