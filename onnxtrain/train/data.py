"""Training data for ``onnxtrain train``: the bundled digits, user arrays (.npz/.npy), generated sequences.

Every source gives a train and an eval set as dicts of equally long arrays keyed by feed name.
The built-in sources key their arrays ``x`` (inputs) and ``y`` (labels); the trainer renames them
to the model's input names. Shuffling is a permutation per epoch from a seeded numpy Generator,
whose state a checkpoint saves so that a resumed run sees the same batches.
"""

from __future__ import annotations

import json
import math
import os
import zipfile
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from onnxtrain.train.config import ConfigError, DigitsData, FilesData, SequenceData

_SPLIT_STREAM = 0x5EED  # seed-sequence tags, so each use of the seed draws from its own stream
_SEQ_TRAIN, _SEQ_EVAL = 1, 2
_ORDER_STREAM = 3


@dataclass
class Dataset:
    train: dict[str, np.ndarray]
    eval: dict[str, np.ndarray]

    @property
    def n_train(self) -> int:
        return len(next(iter(self.train.values())))

    @property
    def n_eval(self) -> int:
        return len(next(iter(self.eval.values())))


def _same_length(arrays: dict[str, np.ndarray], what: str, key: str = "data.feeds") -> None:
    """A ConfigError naming ``key`` unless ``arrays`` (the ``what`` split) hold the same number of rows, and
    some."""
    lengths = {k: len(v) for k, v in arrays.items()}
    if len(set(lengths.values())) > 1:
        raise ConfigError(key, f"{what} arrays differ in length: {lengths}")
    if not lengths or not next(iter(lengths.values())):
        raise ConfigError(key, f"{what} arrays are empty")


def sequence_task(task: str, vocab: int, length: int, n: int,
                  rng: np.random.Generator) -> dict[str, np.ndarray]:
    """``n`` random token sequences ``x`` and their per-token targets ``y`` (reverse, sort or copy)."""
    x = rng.integers(0, vocab, size=(n, length), dtype=np.int64)
    if task == "reverse":
        y = x[:, ::-1]
    elif task == "sort":
        y = np.sort(x, axis=1)
    elif task == "copy":
        y = x
    else:
        raise ValueError(f"unknown sequence task {task!r}; expected reverse, sort or copy")
    return {"x": x, "y": np.ascontiguousarray(y)}


def _why_unreadable(e: BaseException) -> str:
    """numpy's reason a data file did not load, in words about the file: numpy takes any file that is
    neither .npy nor .npz for a pickle, which it refuses to load."""
    if isinstance(e, ValueError) and "pickled" in str(e):
        return "it is neither a .npy nor an .npz file, or it holds Python objects"
    if isinstance(e, (zipfile.BadZipFile, zlib.error)):
        return f"a damaged .npz archive: {_one_line(e)}"
    return _one_line(e)


def _declared(fp: Any) -> tuple[tuple[int, ...], np.dtype] | None:
    """The shape and dtype that the .npy header at ``fp`` declares; None when numpy's reader would refuse
    the header or its data is pickled (np.load then says why)."""
    fmt = np.lib.format
    try:
        version = fmt.read_magic(fp)
        read = fmt.read_array_header_1_0 if version == (1, 0) else fmt.read_array_header_2_0
        shape, _, dtype = read(fp)
    except (ValueError, TypeError, OSError, EOFError, zipfile.BadZipFile, zlib.error):
        return None
    return None if dtype.hasobject else (tuple(shape), dtype)


def _bytes_text(n: int) -> str:
    for unit in ("bytes", "KiB", "MiB", "GiB"):
        if n < 1024:
            return f"{n} {unit}" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} TiB"


def _check_declared_size(fp: Any, size: int, what: str) -> None:
    """Refuse a header at ``fp`` (a stream of ``size`` bytes) that declares more data than follows it,
    before numpy allocates the array it declares; raises ValueError saying so about ``what``."""
    declared = _declared(fp)
    if declared is None:
        return
    shape, dtype = declared
    need, have = math.prod(shape) * dtype.itemsize, max(size - fp.tell(), 0)
    if need > have:
        raise ValueError(f"{what}its header declares shape {shape} of {dtype} ({_bytes_text(need)}) but only "
                         f"{_bytes_text(have)} of data follow it: the file is truncated or damaged")


def _check_npy(path: str) -> None:
    with open(path, "rb") as fp:
        _check_declared_size(fp, os.fstat(fp.fileno()).st_size, "")


def _check_npz_member(archive: zipfile.ZipFile, name: str) -> None:
    member = name if name in archive.namelist() else f"{name}.npy"
    info = archive.getinfo(member)
    with archive.open(info) as fp:
        _check_declared_size(fp, info.file_size, f"array {name!r}: ")


def _load_files(d: FilesData, seed: int) -> Dataset:
    def read(npz_path: str | None, key: str, name: str, file_key: str) -> np.ndarray:
        npy = name.lower().endswith(".npy")
        where, path = (f"data.feeds.{key}", name) if npy else (file_key, npz_path)
        try:
            if npy:
                _check_npy(name)
                array = np.load(name, allow_pickle=False)
            else:
                with np.load(npz_path, allow_pickle=False) as z:
                    if name not in z.files:
                        raise ConfigError(f"data.feeds.{key}", f"no array {name!r} in {npz_path}; it holds "
                                                               f"{z.files}")
                    _check_npz_member(z.zip, name)
                    array = z[name]
        except ConfigError:
            raise
        except (ValueError, OSError, EOFError, zipfile.BadZipFile, zlib.error) as e:
            # not numpy's format, a damaged archive, or arrays of Python objects
            why = _why_unreadable(e)
            raise ConfigError(where, f"{path} could not be read as numpy arrays ({why})") from None
        if not isinstance(array, np.ndarray) or array.ndim == 0 or array.dtype == object:
            what = "a scalar" if np.ndim(array) == 0 else str(array.dtype)
            source = path if npy else f"{name!r} in {path}"
            raise ConfigError(f"data.feeds.{key}", f"{source} is {what}; give an array of numbers with one "
                                                   "row per sample")
        if array.dtype.kind in "fc" and not np.isfinite(array).all():
            bad = np.argwhere(~np.isfinite(array))
            source = path if npy else f"{name!r} in {path}"
            raise ConfigError(f"data.feeds.{key}", f"{source} holds {len(bad)} NaN or infinite value(s), the "
                                                   f"first at index {tuple(int(i) for i in bad[0])}")
        return array

    train = {k: read(d.path, k, v, "data.path") for k, v in d.feeds.items()}
    _same_length(train, "training")
    if d.eval_path is not None:
        ev = {k: read(d.eval_path, k, v, "data.eval_path") for k, v in d.feeds.items()
              if not v.lower().endswith(".npy")}
        missing = [k for k in train if k not in ev]
        if missing:
            raise ConfigError("data.eval_path", f"feeds {missing} are .npy files; give an .npz for them or "
                                                "drop eval_path to hold out a split")
        _same_length(ev, "eval", "data.eval_path")
        return Dataset(train, ev)
    n = len(next(iter(train.values())))
    n_eval = int(round(n * d.eval_fraction))
    if not 0 < n_eval < n:
        raise ConfigError("data.eval_fraction",
                          f"holds out {n_eval} of {n} samples; need at least one on each side")
    order = np.random.default_rng([seed, _SPLIT_STREAM]).permutation(n)
    held, kept = order[:n_eval], order[n_eval:]
    return Dataset({k: v[kept] for k, v in train.items()}, {k: v[held] for k, v in train.items()})


def load_data(cfg: Any) -> Dataset:
    """The train and eval arrays that ``cfg.data`` describes."""
    d = cfg.data
    seed = cfg.training.seed
    if isinstance(d, DigitsData):
        from onnxtrain.data import load_digits

        tr, te = load_digits(images=d.images)
        return Dataset({"x": tr.x, "y": tr.y}, {"x": te.x, "y": te.y})
    if isinstance(d, SequenceData):
        def make(n: int, stream: int) -> dict[str, np.ndarray]:
            return sequence_task(d.task, d.vocab, d.length, n, np.random.default_rng([seed, stream]))

        train, ev = make(d.train_size, _SEQ_TRAIN), make(d.eval_size, _SEQ_EVAL)
        return Dataset(train, ev)
    if isinstance(d, FilesData):
        return _load_files(d, seed)
    raise TypeError(f"unknown data config {type(d).__name__}")


def order_rng(seed: int) -> np.random.Generator:
    """The generator that draws each epoch's permutation."""
    return np.random.default_rng([seed, _ORDER_STREAM])


def rng_state_to_str(rng: np.random.Generator) -> str:
    return json.dumps(rng.bit_generator.state)


def rng_from_str(text: str) -> np.random.Generator:
    state = json.loads(text)
    rng = np.random.Generator(getattr(np.random, state["bit_generator"])())
    rng.bit_generator.state = state
    return rng


def batches(arrays: dict[str, np.ndarray], order: np.ndarray, batch_size: int, start: int = 0
            ) -> Iterator[dict[str, np.ndarray]]:
    """Full batches of ``arrays`` in ``order``, from batch index ``start``; a short last batch is dropped."""
    for b in range(start, len(order) // batch_size):
        idx = order[b * batch_size:(b + 1) * batch_size]
        yield {k: v[idx] for k, v in arrays.items()}


def eval_batches(arrays: dict[str, np.ndarray], batch_size: int) -> Iterator[dict[str, np.ndarray]]:
    n = len(next(iter(arrays.values())))
    for i in range(0, n, batch_size):
        yield {k: v[i:i + batch_size] for k, v in arrays.items()}


def _one_line(e: BaseException) -> str:
    """An error's message on one line, its first sentence."""
    text = " ".join(str(e).split())
    return text.split(". ")[0] if text else type(e).__name__
