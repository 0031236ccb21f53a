"""SHA-256 sums of a run's checkpoints, beside them: ``step_<N>.ckpt.sha256``.

The checkpoint files stay onnxruntime-training's format (which has no checksum), so the sums go to a file
of their own, in ``sha256sum``'s format (``<hex>  step_<N>.ckpt``, and a line for its ``.data`` file when it
has one: ``sha256sum -c`` checks them in the checkpoints folder). It is written in the same atomic commit as
the checkpoint (:class:`onnxtrain.ir.io.StagedFiles`), from the bytes as they are written. ``--resume``,
``eval`` and ``export`` check a checkpoint against it before they load it; a checkpoint without one
(written before the sums were, or by another tool) loads unchecked, as before.
"""

from __future__ import annotations

import hashlib
import os
import re
from collections.abc import Callable
from typing import IO, Any

from onnxtrain.checkpoint import Checkpoint
from onnxtrain.checkpoint.format import stage_checkpoint
from onnxtrain.ir.io import StagedFiles

SUFFIX = ".sha256"
_LINE = re.compile(r"^([0-9a-f]{64}) [ *](.+)$")


def sums_path(checkpoint: str) -> str:
    """The file holding the SHA-256 sums of ``checkpoint`` (and of its ``.data``)."""
    return checkpoint + SUFFIX


class _Tee:
    """A file being written whose bytes also go to a hash."""

    def __init__(self, f: IO[bytes], h: Any) -> None:
        self._f, self._h = f, h

    def write(self, data: Any) -> int:
        self._h.update(data)
        return self._f.write(data)


class _Hashing:
    """The part of :class:`StagedFiles` that ``stage_checkpoint`` uses, hashing each file it stages."""

    def __init__(self, files: StagedFiles) -> None:
        self.files = files
        self.sums: list[tuple[str, str]] = []  # (file name, hex digest), in the order written

    def write(self, path: str, write: Callable[[IO[bytes]], None]) -> None:
        h = hashlib.sha256()
        self.files.write(path, lambda f: write(_Tee(f, h)))
        self.sums.append((os.path.basename(path), h.hexdigest()))

    def remove_after(self, path: str) -> None:
        self.files.remove_after(path)


def save_with_checksum(ckpt: Checkpoint, path: str, external_threshold: int = 1800 * 2**20) -> None:
    """``save_checkpoint(ckpt, path, external_threshold)`` with ``path.sha256`` beside it, all renamed in
    one commit."""
    with StagedFiles() as files:
        hashing = _Hashing(files)
        stage_checkpoint(hashing, ckpt, path, external_threshold)  # type: ignore[arg-type]
        text = "".join(f"{digest}  {name}\n" for name, digest in sorted(hashing.sums))
        files.write(sums_path(path), lambda f: f.write(text.encode()))


def _sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


_CHECKED: set[tuple[Any, ...]] = set()  # the (file, size, mtime) sets found whole: not hashed twice


def checksum_problem(path: str) -> str | None:
    """What is wrong with the checkpoint at ``path`` by its SHA-256 sums (a sentence naming the file), or
    None when its files match them or it has none to check."""
    sums = sums_path(path)
    try:
        with open(sums, encoding="utf-8") as f:
            text = f.read()
    except FileNotFoundError:
        return None
    except (OSError, UnicodeDecodeError) as e:
        return f"checkpoint {path}: its checksum file {sums} cannot be read ({e})"
    folder, own = os.path.dirname(path), os.path.basename(path)
    wanted: dict[str, str] = {}
    for line in text.splitlines():
        m = _LINE.match(line)
        if m is None or m.group(2) not in (own, own + ".data"):
            return f"checkpoint {path}: its checksum file {sums} is damaged (line {line[:80]!r})"
        wanted[m.group(2)] = m.group(1)
    if own not in wanted:
        return f"checkpoint {path}: its checksum file {sums} has no sum for it"
    files = [os.path.join(folder, name) for name in sorted(wanted)]
    try:
        key = tuple((f, os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in [*files, sums])
    except OSError as e:
        return f"checkpoint {path}: {e.filename or path} cannot be read ({e.strerror})"
    if key in _CHECKED:
        return None
    for name, file in zip(sorted(wanted), files):
        try:
            got = _sha256(file)
        except OSError as e:
            return f"checkpoint {path}: {file} cannot be read ({e.strerror})"
        if got != wanted[name]:
            return (f"checkpoint {file} is damaged: its SHA-256 is {got[:16]}…, not the {wanted[name][:16]}… "
                    f"its save wrote in {os.path.basename(sums)}")
    _CHECKED.add(key)
    return None
