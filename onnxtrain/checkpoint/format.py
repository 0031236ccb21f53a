"""onnxruntime-training's on-device checkpoint: the ``ODTC`` version 2 FlatBuffers file.

Schema (``ort_training_checkpoint.fbs``, with ``Tensor`` from ``ort.fbs``), field ids in order::

    Checkpoint      { version:int32; module_state:ModuleState; optimizer_groups:[OptimizerGroup];
                      property_bag:PropertyBag }
    ModuleState     { requires_grad_params:[Tensor]; frozen_params:[Tensor]; is_nominal_state:bool;
                      has_external_data:bool }
    OptimizerGroup  { group_name:string; step:int64; initial_learning_rate:float;
                      optimizer_states:[ParameterOptimizerState] }
    ParameterOptimizerState { param_name:string; momentums:[Tensor] }
    PropertyBag     { ints:[IntProperty]; floats:[FloatProperty]; strings:[StringProperty] }
    IntProperty / FloatProperty / StringProperty { name:string; value:int64 / float / string }
    Tensor          { name:string; doc_string:string; dims:[int64]; data_type:int32; raw_data:[ubyte];
                      string_data:[string]; external_data_offset:int64 = -1 }

Everything is written sorted by name, as onnxruntime-training saves a state, except that the generator
of artifacts keeps the parameters in the model's initializer order, as its generator does, and
``onnxblock.save_checkpoint`` in the order of its lists, as its namesake does
(``save_checkpoint(..., sort_parameters=False)``). Above a size threshold the tensor bytes go to
``<path>.data`` (in saved order: trainable, frozen, then optimizer moments; each tensor at an
offset that is a multiple of its itemsize, as onnxruntime writes them) and the main file keeps
only metadata with ``external_data_offset`` set.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import math
import mmap
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import IO

import numpy as np

from onnxtrain.checkpoint import flatbuf
from onnxtrain.checkpoint.flatbuf import (
    Bytes,
    FlatBufferError,
    Scalar,
    Scalars,
    Str,
    Table,
    Tables,
    TableView,
    encode,
    root_table,
)
from onnxtrain.ir.io import StagedFiles, recover_commits, written_through
from onnxtrain.ir.types import np_dtype, onnx_elem_type
from onnxtrain.user_warning import warn

IDENTIFIER = b"ODTC"
# a checkpoint with external data: a random token ends its .data file (after the tensors, where readers that
# know only the offsets never look) and names it in the main file's properties, so that a load can tell a
# main file and a .data of different saves apart (a reader during a save over the same path, a swapped
# .data) and read again; neither is shown to callers
DATA_TOKEN = "onnxtrain.data_token"
_TRAILER = b"ONNXTRN1"  # + 16 random bytes
_TORN_RETRIES, _TORN_WAIT = 40, 0.025  # a save's two renames follow each other at once


class _TornRead(ValueError):
    """The main file and the .data read are of different saves."""
VERSION = 2
_READABLE_VERSIONS = (1, 2)
# onnxruntime-training verifies a checkpoint with FlatBuffers' default verifier options, which refuse a buffer
# of more than a million tables ("Checkpoint verification failed"; 1.19.2 loads 1,000,000 and refuses
# 1,000,001): a save past it warns that onnxruntime-training cannot load the file (onnxtrain can)
ORT_MAX_TABLES = 1_000_000
# ONNX element types stored as raw little-endian bytes: every numeric type of whole bytes
# (strings and the packed 2/4/6-bit types are not checkpoint parameters).
_SUPPORTED = frozenset(range(1, 8)) | frozenset(range(9, 21)) | {24}


@dataclass
class OptimizerGroup:
    """One optimizer group: completed steps, initial learning rate, per-parameter moments."""

    name: str = "group0"
    step: int = 0
    initial_lr: float = 0.001
    states: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)  # param -> {"momentum0": ..}


@dataclass
class Checkpoint:
    """Training state: parameters, optimizer groups and a property bag.

    In a nominal checkpoint the parameters carry names and dtypes only: saving ignores
    their values, loading gives zero-size arrays of the right dtype.
    """

    trainable: dict[str, np.ndarray] = field(default_factory=dict)  # requires_grad params
    frozen: dict[str, np.ndarray] = field(default_factory=dict)
    optimizer_groups: list[OptimizerGroup] = field(default_factory=list)
    properties: dict[str, int | float | str] = field(default_factory=dict)
    nominal: bool = False


# ---------------------------------------------------------------- public API

def checkpoint_to_bytes(ckpt: Checkpoint) -> bytes:
    """Serialize ``ckpt`` as one buffer, all tensor data inline (refused above FlatBuffers' 2 GiB)."""
    _check_reserved(ckpt)
    _warn_past_table_limit(ckpt, "the checkpoint")
    size = 0 if ckpt.nominal else _data_bytes(ckpt)
    if size > flatbuf.MAX_SIZE:  # (refused before a buffer of that size is built)
        raise ValueError(f"the checkpoint's tensors hold {size} bytes, more than one FlatBuffer can (2 GiB); "
                         "save_checkpoint writes them to a file of their own beside the checkpoint")
    return bytes(_encode(ckpt, external=False)[0])


def checkpoint_from_bytes(data: bytes) -> Checkpoint:
    """Parse a checkpoint buffer; raises ValueError if it is malformed or refers to external data."""
    try:
        return _decode(data, None)
    except FlatBufferError as e:
        raise ValueError(f"Not a valid onnxruntime training checkpoint: {e}") from None


def save_checkpoint(ckpt: Checkpoint, path: str | os.PathLike,
                    external_threshold: int = 1800 * 2**20, *, sort_parameters: bool = True) -> None:
    """Write ``ckpt`` to ``path`` atomically.

    The parameters are written sorted by name (as onnxruntime-training saves a state), or with
    ``sort_parameters=False`` in the order of ``ckpt.trainable`` and ``ckpt.frozen`` (as its artifact
    generator writes them, the model's initializer order, and its ``onnxblock.save_checkpoint`` the
    order of the lists it is given).

    When the tensors hold more than ``external_threshold`` bytes, or more than one FlatBuffer can (2 GiB
    with the metadata), their data goes to ``<path>.data`` and ``path`` keeps only metadata; otherwise a
    stale ``<path>.data`` is removed.
    Both files are written to temporaries first and renamed together (see ``StagedFiles``).
    """
    with StagedFiles() as files:
        stage_checkpoint(files, ckpt, path, external_threshold, sort_parameters=sort_parameters)


def stage_checkpoint(files: StagedFiles, ckpt: Checkpoint, path: str | os.PathLike,
                     external_threshold: int = 1800 * 2**20, *, sort_parameters: bool = True) -> None:
    """Write ``ckpt`` for ``path`` (and ``<path>.data``) into ``files``, renamed when they are committed. A
    ``path`` that is a symbolic link is written through: the file it points to and its ``.data`` beside
    that file are replaced, the link stays (as onnxruntime-training's save writes through it)."""
    path = written_through(path)
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Cannot save checkpoint, the path is a directory", path)
    if not os.path.isdir(os.path.dirname(os.path.abspath(path))):
        raise FileNotFoundError(errno.ENOENT, "Cannot save checkpoint, its directory does not exist", path)
    _check_reserved(ckpt)
    size = 0 if ckpt.nominal else _data_bytes(ckpt)
    external = size > external_threshold or (size > flatbuf.MAX_SIZE // 2
                                             and not _fits_inline(ckpt, size, sort_parameters))
    if external:
        token = os.urandom(16)
        ckpt = dataclasses.replace(ckpt, properties={**ckpt.properties, DATA_TOKEN: token.hex()})
    _warn_past_table_limit(ckpt, f"checkpoint {path}")
    main, arrays = _encode(ckpt, external, sort_parameters)
    data_path = path + ".data"
    if external:  # renamed before the main file that refers to it

        def write_data(d: IO[bytes]) -> None:
            _write_arrays(d, arrays)
            d.write(_TRAILER + token)

        files.write(data_path, write_data)
    files.write(path, lambda f: f.write(main))
    if not external:
        files.remove_after(data_path)


def load_checkpoint(path: str | os.PathLike, *, optimizer_state: bool = True) -> Checkpoint:
    """Read a checkpoint file (complete or nominal, inline or with ``<path>.data``). With
    ``optimizer_state=False`` its optimizer groups are left out, never read (the parameters of an export).

    The file is mapped, not read whole: each tensor's bytes are copied out and their pages let go, so the
    load holds little more than the arrays it returns.

    If a save of ``path`` was killed between its two renames (its journal is beside it), the old pair is
    put back first (:func:`onnxtrain.ir.io.recover_commits`), with a warning saying so (an OSError
    saying so where the folder does not let it: the mixed pair is never loaded)."""
    given = os.fspath(path)
    path = os.path.realpath(given) if os.path.islink(given) else given  # where a save through it wrote
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, "Cannot load checkpoint, the path is a directory", given)
    folder = os.path.dirname(os.path.abspath(path))
    try:
        put_back = recover_commits(folder, naming=[path, path + ".data"]).put_back
    except OSError as e:  # a read-only folder, another user's journal: never load the mixed pair
        raise type(e)(e.errno, f"a save of checkpoint {path} was killed part way (its commit journal, "
                      "*.journal.tmp, is beside it), leaving its files mismatched, and they cannot be put "
                      f"back here: {e}; load it once where its folder can be written, which puts back the "
                      "previous checkpoint") from e
    if put_back:
        warn(f"a save of checkpoint {path} was killed part way, leaving its files mismatched: put back "
             f"{', '.join(put_back)} as they were before it (the previous checkpoint)")
    # the data beside the file, else beside the link (a pair of links, each to a file of its own name)
    data_path = path + ".data" if path == given or os.path.exists(path + ".data") else given + ".data"
    for attempt in range(_TORN_RETRIES + 1):
        try:
            main = _MainFile(path)
        except FileNotFoundError:
            raise FileNotFoundError(errno.ENOENT, "Checkpoint file not found", given) from None
        data = main.data
        try:
            return _decode(data, data_path, optimizer_state, main.let_go)
        except _TornRead as e:  # a save over the path ran between the two reads: read them again
            if attempt == _TORN_RETRIES:
                raise ValueError(f"Cannot load checkpoint {given!r}: {e}") from None
            time.sleep(_TORN_WAIT)
        except FileNotFoundError:  # no .data: gone with a save over the path that needs none, since read?
            if attempt == _TORN_RETRIES or not _replaced(path, data):
                raise
            time.sleep(_TORN_WAIT)
        except FlatBufferError as e:
            raise ValueError(f"Cannot load checkpoint {given!r}: the file is damaged, or is not an "
                             f"onnxruntime training checkpoint ({e})") from None
        except ValueError as e:
            raise ValueError(f"Cannot load checkpoint {given!r}: {e}") from None
        finally:
            main.close()
    raise AssertionError("unreachable")


class _MainFile:
    """A checkpoint's main file, mapped (read whole where it cannot be: an empty file, a pipe)."""

    def __init__(self, path: str) -> None:
        self.map: mmap.mmap | None = None
        with open(path, "rb") as f:
            try:
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            except (OSError, ValueError):
                self.data: bytes | mmap.mmap = _read_stream(f, path)
            else:
                self.data = self.map

    def let_go(self, start: int, length: int) -> None:
        """Drop the pages of bytes ``start`` to ``start + length`` (read again if touched again)."""
        if self.map is None or not hasattr(mmap, "MADV_DONTNEED") or length < mmap.PAGESIZE:
            return
        begin = start - start % mmap.PAGESIZE
        with contextlib.suppress(OSError):
            self.map.madvise(mmap.MADV_DONTNEED, begin, start + length - begin)

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # a view still held (an error's traceback): unmapped
                self.map.close()  # when collected


def _read_stream(f: IO[bytes], path: str) -> bytes:
    """The bytes of a file that cannot be mapped (a pipe, a device), or its first 8 alone when they are not a
    checkpoint's (the decoder says so): an endless device such as /dev/zero is not read on. A ValueError
    past the 2 GiB a FlatBuffer can hold."""
    head = f.read(8)
    if len(head) < 8 or head[4:] != IDENTIFIER:
        return head
    chunks, size = [head], len(head)
    while chunk := f.read(1 << 20):
        size += len(chunk)
        if size > flatbuf.MAX_SIZE:
            raise ValueError(f"Cannot load checkpoint {path!r}: it holds more than the {flatbuf.MAX_SIZE} "
                             "bytes a FlatBuffer can")
        chunks.append(chunk)
    return b"".join(chunks)


def _replaced(path: str, data: bytes | mmap.mmap) -> bool:
    """Whether the file at ``path`` no longer holds ``data`` (a save replaced it after it was read)."""
    view = memoryview(data)
    try:
        with open(path, "rb") as f:
            at = 0
            while chunk := f.read(1 << 24):
                if view[at:at + len(chunk)] != chunk:
                    return True
                at += len(chunk)
            return at != len(view)
    except OSError:
        return True
    finally:
        view.release()


# ---------------------------------------------------------------- encoding

def _as_array(value: object, what: str) -> np.ndarray:
    arr = np.asarray(value)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    try:
        elem = onnx_elem_type(arr.dtype)
    except Exception:
        elem = None
    if elem not in _SUPPORTED:
        raise TypeError(f"{what}: dtype {arr.dtype} cannot be stored in a checkpoint")
    return arr if arr.flags.c_contiguous else arr.copy(order="C")  # keeps 0-d arrays 0-d


def _data_bytes(ckpt: Checkpoint) -> int:
    tensors = [*ckpt.trainable.values(), *ckpt.frozen.values()]
    for g in ckpt.optimizer_groups:
        tensors += [m for moments in g.states.values() for m in moments.values()]
    return sum(np.asarray(t).nbytes for t in tensors)


def _check_reserved(ckpt: Checkpoint) -> None:
    """A ValueError for a user property named :data:`DATA_TOKEN` (every load takes it out)."""
    if DATA_TOKEN in ckpt.properties:
        raise ValueError(f"property {DATA_TOKEN!r} is reserved: a save with external data writes it, and "
                         "loads take it out; give the property another name")


def _table_count(ckpt: Checkpoint) -> int:
    """The FlatBuffers tables of ``ckpt`` as :func:`_encode` writes it (what a verifier counts): the root and
    the module state, a tensor per parameter and moment, a state per parameter of a group, each group, the
    property bag and each property."""
    count = 2 + len(ckpt.trainable) + len(ckpt.frozen)
    for g in ckpt.optimizer_groups:
        count += 1 + sum(1 + len(moments) for moments in g.states.values())
    return count + (1 + len(ckpt.properties) if ckpt.properties else 0)


def _warn_past_table_limit(ckpt: Checkpoint, what: str) -> None:
    """A warning when onnxruntime-training cannot load ``ckpt`` for its number of tables (ORT_MAX_TABLES)."""
    count = _table_count(ckpt)
    if count > ORT_MAX_TABLES:
        moments = sum(len(m) for g in ckpt.optimizer_groups for m in g.states.values())
        params = len(ckpt.trainable) + len(ckpt.frozen)
        warn(f"{what} is written as {count} FlatBuffers tables ({params} parameters, {moments} optimizer "
             f"moments, {len(ckpt.properties)} properties): onnxruntime-training refuses to load a "
             f"checkpoint of more than {ORT_MAX_TABLES} ('Checkpoint verification failed'); onnxtrain "
             "loads it")


def _fits_inline(ckpt: Checkpoint, size: int, sort_parameters: bool) -> bool:
    """Whether ``ckpt``, whose tensors hold ``size`` bytes, fits in one FlatBuffer: its metadata (as written
    with external data) plus the bytes, with each tensor's length and alignment padding."""
    main, arrays = _encode(ckpt, True, sort_parameters)
    return len(main) + size + 20 * len(arrays) <= flatbuf.MAX_SIZE


def _text(value: object, kind: str, label: str) -> Str:
    """``value`` as a FlatBuffers string: a TypeError saying ``kind`` must be str, a ValueError naming
    ``label`` and the value for a str without a UTF-8 form (a lone surrogate, from ``os.fsdecode``)."""
    if not isinstance(value, str):
        raise TypeError(f"{kind} must be str, got {type(value).__name__}")
    try:
        return Str(value)
    except UnicodeEncodeError as e:
        raise ValueError(f"{label} {value!r} is not valid UTF-8 text ({e.reason} at index {e.start}); "
                         "checkpoints store strings as UTF-8") from None


def _check_names(names: object, kind: str) -> None:
    """A TypeError unless every name in ``names`` is a str (before they are sorted)."""
    for name in names:  # type: ignore[attr-defined]
        if not isinstance(name, str):
            raise TypeError(f"{kind} must be str, got {type(name).__name__} {name!r}")


def _check_parameter_names(ckpt: Checkpoint) -> None:
    """Parameter names are str and not empty (onnxruntime-training refuses a file with an empty one)."""
    for params, kind in ((ckpt.trainable, "trainable parameter"), (ckpt.frozen, "frozen parameter")):
        _check_names(params, f"{kind}: names")
        if "" in params:
            raise ValueError(f"a {kind} has an empty name, which onnxruntime-training refuses to load "
                             "('Parameter must have a non-empty name')")


def _tensor(name: str, value: object, nominal: bool, place: Callable[[np.ndarray], int] | None,
            what: str) -> Table:
    text = _text(name, f"{what}: names", what)
    arr = _as_array(value, f"{what} {name!r}")
    elem = onnx_elem_type(arr.dtype)
    if nominal:  # name and type only, as onnxruntime writes them
        return Table(text, None, Scalars("q", []), Scalar("i", elem), Bytes(b""))
    dims = Scalars("q", arr.shape)
    if place is not None:
        return Table(text, None, dims, Scalar("i", elem), None, None, Scalar("q", place(arr), -1))
    return Table(text, None, dims, Scalar("i", elem), Bytes(arr.reshape(-1).view(np.uint8)))


def _property(name: str, value: object) -> tuple[int, Table]:
    """(0 int / 1 float / 2 string, table) for one property."""
    text = _text(name, "property names", "property")
    if isinstance(value, (bool, np.bool_, int, np.integer)):
        v = int(value)
        if not -(2**63) <= v < 2**63:
            raise ValueError(f"property {name!r}: {v} does not fit in int64")
        return 0, Table(text, Scalar("q", v))
    if isinstance(value, (float, np.floating)):
        return 1, Table(text, Scalar("f", float(np.float32(value)), 0.0))
    if isinstance(value, str):
        return 2, Table(text, _text(value, "property values", f"property {name!r}: the value"))
    raise TypeError(f"property {name!r}: type {type(value).__name__} is not int, float or str")


def _encode(ckpt: Checkpoint, external: bool, sort_parameters: bool = True
            ) -> tuple[bytearray, list[np.ndarray]]:
    """The main file's bytes and, when ``external``, the arrays for ``<path>.data`` in order; the
    parameters sorted by name, or in the dicts' order with ``sort_parameters=False``."""
    arrays: list[np.ndarray] = []  # with zero-byte fillers, so each offset is a multiple of the itemsize
    end = [0]

    def place(arr: np.ndarray) -> int:
        at = -(-end[0] // arr.itemsize) * arr.itemsize
        if at > end[0]:
            arrays.append(np.zeros(at - end[0], np.uint8))
        arrays.append(arr)
        end[0] = at + arr.nbytes
        return at

    where = place if external else None
    _check_parameter_names(ckpt)
    _check_names(ckpt.properties, "property names")
    dup = set(ckpt.trainable) & set(ckpt.frozen)
    if dup:
        raise ValueError(f"parameters both trainable and frozen: {sorted(dup)}")
    order = sorted if sort_parameters else list
    trainable = [_tensor(n, ckpt.trainable[n], ckpt.nominal, where, "trainable parameter")
                 for n in order(ckpt.trainable)]
    frozen = [_tensor(n, ckpt.frozen[n], ckpt.nominal, where, "frozen parameter")
              for n in order(ckpt.frozen)]
    module = Table(Tables(trainable), Tables(frozen), Scalar("?", bool(ckpt.nominal), False),
                   Scalar("?", external, False))

    groups = []
    names = [g.name for g in ckpt.optimizer_groups]
    if len(set(names)) != len(names):
        raise ValueError(f"optimizer group names repeat: {names}")
    _check_names(names, "optimizer group names")
    for g in sorted(ckpt.optimizer_groups, key=lambda g: g.name):
        kind = f"parameter names of optimizer group {g.name!r}"
        _check_names(g.states, kind)
        states = []
        for p in sorted(g.states):
            _check_names(g.states[p], f"optimizer state of {p!r}: names")
            moments = [_tensor(m, g.states[p][m], False, where, f"optimizer state of {p!r}")
                       for m in sorted(g.states[p])]
            states.append(Table(_text(p, kind, f"optimizer group {g.name!r}: parameter"), Tables(moments)))
        step = int(g.step)
        if not -(2**63) <= step < 2**63:
            raise ValueError(f"optimizer group {g.name!r}: step {step} does not fit in int64")
        groups.append(Table(_text(g.name, "optimizer group names", "optimizer group"), Scalar("q", step),
                            Scalar("f", float(np.float32(g.initial_lr)), 0.0), Tables(states)))

    bag = None
    if ckpt.properties:
        by_kind: list[list[Table]] = [[], [], []]
        for n in sorted(ckpt.properties):
            kind, table = _property(n, ckpt.properties[n])
            by_kind[kind].append(table)
        bag = Table(*(Tables(t) for t in by_kind))

    root = Table(Scalar("i", VERSION), module, Tables(groups), bag)
    return encode(root, IDENTIFIER), arrays


def _write_arrays(f: IO[bytes], arrays: list[np.ndarray]) -> None:
    for arr in arrays:
        f.write(memoryview(arr.reshape(-1).view(np.uint8)))


# ---------------------------------------------------------------- decoding

class _DataFile:
    """Reads tensors from ``<checkpoint>.data`` on demand."""

    def __init__(self, path: str | None, expected: str | None = None) -> None:
        """``expected``: the token the main file names (:data:`DATA_TOKEN`), checked as the file opens."""
        self.path, self.file, self.size, self.expected = path, None, 0, expected

    def read(self, offset: int, dtype: np.dtype, shape: tuple[int, ...], name: str) -> np.ndarray:
        if self.path is None:
            raise ValueError("External data is present in the checkpoint but the checkpoint path is "
                             "not provided")
        if self.file is None:
            try:
                self.file = open(self.path, "rb")  # noqa: SIM115 (kept open over reads, see close)
            except FileNotFoundError:
                raise FileNotFoundError(errno.ENOENT, "Checkpoint external data file not found",
                                        self.path) from None
            self.size = os.fstat(self.file.fileno()).st_size
            token = self.token()  # before any offset is read: a shorter .data of another save is not "cut"
            if self.expected is not None and token is not None and token.hex() != self.expected:
                raise _TornRead(f"its .data file is not the one saved with it (another save over the path "
                                f"ran while it was read, or {self.path} was replaced or is damaged): save "
                                "under a new name when something may be reading")
        nbytes = math.prod(shape) * dtype.itemsize
        if offset + nbytes > self.size:
            raise ValueError(f"{self.path} is damaged: it ends before the {nbytes} bytes of tensor "
                             f"{name!r} at offset {offset}")
        arr = np.empty(shape, dtype)
        self.file.seek(offset)
        if self.file.readinto(memoryview(arr.reshape(-1).view(np.uint8))) != arr.nbytes:
            raise ValueError(f"{self.path} is damaged: it ends before the {arr.nbytes} bytes of tensor "
                             f"{name!r} at offset {offset}")
        return arr

    def token(self) -> bytes | None:
        """The save's token that ends the .data file read (see :data:`DATA_TOKEN`); None when no tensor was
        read from it or it has none (written by onnxruntime-training)."""
        if self.file is None or self.size < len(_TRAILER) + 16:
            return None
        self.file.seek(self.size - len(_TRAILER) - 16)
        tail = self.file.read(len(_TRAILER) + 16)
        return tail[len(_TRAILER):] if tail.startswith(_TRAILER) else None

    def close(self) -> None:
        if self.file is not None:
            self.file.close()


def _keep(start: int, length: int) -> None:
    """A buffer's bytes read stay as they are (a buffer in memory)."""


def _read_tensor(t: TableView, nominal: bool, data: _DataFile, let_go: Callable[[int, int], None] = _keep
                 ) -> tuple[str, np.ndarray]:
    name = t.string(0)
    if name is None:
        raise FlatBufferError("a tensor has no name")
    elem = t.scalar(3, "i", 0)
    if elem not in _SUPPORTED:
        raise ValueError(f"tensor {name!r} has unsupported data type {elem}")
    dtype = np_dtype(elem)
    dims = t.scalars(2, "<i8")
    if nominal:  # names and types only (no dims, or a 0-d or empty tensor): more is a full checkpoint's
        if dims is not None and math.prod(int(d) for d in dims) > 1:
            raise FlatBufferError(f"tensor {name!r} has dims {tuple(int(d) for d in dims)} in a nominal "
                                  "checkpoint, which holds no values (its is_nominal_state flag is wrong)")
        return name, np.empty(0, dtype)
    shape = () if dims is None else tuple(int(d) for d in dims)
    if any(d < 0 for d in shape):
        raise FlatBufferError(f"tensor {name!r} has negative dims {shape}")
    if len(shape) > 64 or math.prod(d or 1 for d in shape) * dtype.itemsize >= 2**63:  # (numpy's limits)
        raise FlatBufferError(f"tensor {name!r} has dims {shape} that no array can have")
    count = math.prod(shape)
    offset = t.scalar(6, "q", -1)
    if offset >= 0:
        return name, data.read(offset, dtype, shape, name)
    raw = t.bytes(4)
    if raw is None:
        raise FlatBufferError(f"tensor {name!r} has neither raw data nor an external data offset")
    if len(raw) != count * dtype.itemsize:
        raise FlatBufferError(f"tensor {name!r} of shape {shape} and type {dtype} has {len(raw)} data bytes, "
                         f"expected {count * dtype.itemsize}")
    arr = np.frombuffer(raw, dtype, count).reshape(shape).copy()
    let_go(*t.span(4))
    return name, arr


def _read_tensors(tables: list[TableView] | None, nominal: bool, data: _DataFile,
                  into: dict[str, np.ndarray], what: str, let_go: Callable[[int, int], None] = _keep) -> None:
    for t in tables or []:
        name, arr = _read_tensor(t, nominal, data, let_go)
        if name in into:
            raise FlatBufferError(f"{what} {name!r} appears twice")
        into[name] = arr


def _decode(buf: bytes | mmap.mmap, data_path: str | None, optimizer_state: bool = True,
            let_go: Callable[[int, int], None] = _keep) -> Checkpoint:
    """The checkpoint in ``buf`` (without its optimizer groups unless ``optimizer_state``), ``let_go`` told
    the span of each tensor's bytes once they are copied out."""
    root = root_table(buf, IDENTIFIER)
    version = root.scalar(0, "i", 0)
    if version not in _READABLE_VERSIONS:
        raise ValueError(f"checkpoint version {version} is not supported (this reader knows "
                         f"{', '.join(map(str, _READABLE_VERSIONS))})")
    ckpt = Checkpoint()
    expected = None
    bag = root.table(3)
    if bag is not None:
        props: dict[str, int | float | str] = {}
        for kind, convert in ((0, lambda p: int(p.scalar(1, "q", 0))),
                              (1, lambda p: float(p.scalar(1, "f", 0.0))),
                              (2, lambda p: p.string(1) or "")):
            for p in bag.tables(kind) or []:
                name = p.string(0)
                if name is None:
                    raise FlatBufferError("a property has no name")
                props[name] = convert(p)
        expected = props.pop(DATA_TOKEN, None)
        ckpt.properties = {n: props[n] for n in sorted(props)}
    data = _DataFile(data_path, expected if isinstance(expected, str) else None)
    try:
        module = root.table(1)
        if module is not None:
            ckpt.nominal = bool(module.scalar(2, "?", False))
            _read_tensors(module.tables(0), ckpt.nominal, data, ckpt.trainable, "parameter", let_go)
            _read_tensors(module.tables(1), ckpt.nominal, data, ckpt.frozen, "parameter", let_go)
            both = set(ckpt.trainable) & set(ckpt.frozen)
            if both:
                raise FlatBufferError(f"parameters both trainable and frozen: {sorted(both)}")
        for g in (root.tables(2) or []) if optimizer_state else []:
            name = g.string(0)
            if name is None:
                raise FlatBufferError("an optimizer group has no name")
            group = OptimizerGroup(name, int(g.scalar(1, "q", 0)), float(g.scalar(2, "f", 0.0)))
            if any(group.name == other.name for other in ckpt.optimizer_groups):
                raise FlatBufferError(f"optimizer group {group.name!r} appears twice")
            for s in g.tables(3) or []:
                param = s.string(0)
                if param is None:
                    raise FlatBufferError(f"an optimizer state of group {group.name!r} has no parameter name")
                moments: dict[str, np.ndarray] = {}
                _read_tensors(s.tables(1), False, data, moments, f"optimizer state of {param!r}", let_go)
                group.states[param] = moments
            ckpt.optimizer_groups.append(group)
    finally:
        data.close()
    return ckpt
