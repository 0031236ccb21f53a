"""Damaged checkpoint files: every truncation point and thousands of seeded byte changes.

Each load of a damaged file either raises a ValueError that names the file and says it is damaged, or,
where the damage cannot be told (a changed tensor value, a cut in the zero padding that ends the buffer or
in the save's trailer after the .data tensors), gives a checkpoint. Never another exception, a hang or a
large allocation from a corrupt length.
"""

from __future__ import annotations

import contextlib
import os
import time
import tracemalloc

import numpy as np
import pytest

from onnxtrain.checkpoint import Checkpoint, OptimizerGroup, load_checkpoint, save_checkpoint
from onnxtrain.checkpoint import format as fmt
from onnxtrain.training.api import CheckpointState
from tests.checkpoint.test_checkpoint import _assert_equal, _sample

KINDS = {
    "inline": lambda: (_sample(), 10**9),
    "external": lambda: (_sample(), 0),
    "nominal": lambda: (Checkpoint(trainable=_sample().trainable, frozen=_sample().frozen, nominal=True,
                                   properties={"epoch": 3, "tag": "x"}), 10**9),
}
TRAILER = len(fmt._TRAILER) + 16  # the save's token after the .data tensors


@pytest.fixture
def no_retries(monkeypatch):
    """A .data whose token was changed reads as another save's: refused at once instead of re-read."""
    monkeypatch.setattr(fmt, "_TORN_RETRIES", 0)


def _saved(tmp_path, kind: str) -> tuple[str, bytes, bytes | None, Checkpoint]:
    ckpt, threshold = KINDS[kind]()
    path = str(tmp_path / f"{kind}.ckpt")
    save_checkpoint(ckpt, path, external_threshold=threshold)
    data = _read(path + ".data") if os.path.exists(path + ".data") else None
    return path, _read(path), data, load_checkpoint(path)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(path: str, main: bytes, data: bytes | None) -> None:
    with open(path, "wb") as f:
        f.write(main)
    if data is not None:
        with open(path + ".data", "wb") as f:
            f.write(data)


def _load(path: str) -> Checkpoint | None:
    """The checkpoint, or None after checking the error names the file and says it is damaged (or, for a
    version or data type code changed to one this reader does not know, that it is not supported)."""
    start = time.monotonic()
    try:
        return load_checkpoint(path)
    except ValueError as e:
        assert path in str(e), str(e)
        assert "damaged" in str(e) or "not supported" in str(e) or "unsupported data type" in str(e), str(e)
        return None
    finally:
        assert time.monotonic() - start < 5, "a load of a damaged file took over 5 s"


@pytest.mark.parametrize("kind", list(KINDS))
def test_every_truncation_of_the_main_file(tmp_path, kind, no_retries):
    path, main, data, whole = _saved(tmp_path, kind)
    target = str(tmp_path / "cut.ckpt")
    loaded = 0
    for cut in range(len(main)):
        _write(target, main[:cut], data)
        got = _load(target)
        if got is not None:  # only the zero padding that ends the buffer was cut
            assert not any(main[cut:]), cut
            _assert_equal(got, whole)
            loaded += 1
    assert loaded < 8


def test_every_truncation_of_the_data_file(tmp_path, no_retries):
    path, main, data, whole = _saved(tmp_path, "external")
    assert data is not None
    target = str(tmp_path / "cut.ckpt")
    for cut in range(len(data)):
        _write(target, main, data[:cut])
        got = _load(target)
        if got is not None:  # the tensors are whole: only the trailer was cut
            assert cut >= len(data) - TRAILER, cut
            _assert_equal(got, whole)


@pytest.mark.parametrize("kind", list(KINDS))
def test_random_byte_changes_of_the_main_file(tmp_path, kind, no_retries):
    path, main, data, _ = _saved(tmp_path, kind)
    target = str(tmp_path / "changed.ckpt")
    rng = np.random.default_rng(sum(map(ord, kind)))
    refused = 0
    for _ in range(1000):
        buf = bytearray(main)
        for at in rng.integers(0, len(buf), rng.integers(1, 4)):
            buf[at] = rng.integers(0, 256)
        _write(target, bytes(buf), data)
        refused += _load(target) is None
    assert refused > 500  # most changes hit the structure, and are seen


def test_random_byte_changes_of_the_data_file(tmp_path, no_retries):
    path, main, data, _ = _saved(tmp_path, "external")
    assert data is not None
    target = str(tmp_path / "changed.ckpt")
    rng = np.random.default_rng(7)
    for _ in range(1000):
        buf = bytearray(data)
        for at in rng.integers(0, len(buf), rng.integers(1, 4)):
            buf[at] = rng.integers(0, 256)
        _write(target, main, bytes(buf))
        _load(target)


@pytest.mark.parametrize("dims", [[2**40, 2**40], [0, 2**62, 2**62], [2**31] * 3, [3, 5]])
@pytest.mark.parametrize("external", [False, True])
def test_a_huge_or_odd_shape_is_refused_without_allocating_it(tmp_path, dims, external, no_retries):
    """A tensor's dims set to a size far beyond the file, with a zero among huge ones, or to another shape."""
    from onnxtrain.checkpoint import flatbuf

    shape = (2,) * len(dims)
    ckpt = Checkpoint(trainable={"w": np.ones(shape, np.int64)}, optimizer_groups=[
        OptimizerGroup("group0", 1, 0.1, {"w": {"momentum0": np.zeros(shape, np.int64)}})])
    path = str(tmp_path / "c")
    save_checkpoint(ckpt, path, external_threshold=0 if external else 10**9)
    buf = bytearray(_read(path))
    root = flatbuf.root_table(bytes(buf), b"ODTC")
    tensor = root.table(1).tables(0)[0]
    at, n = tensor._vector(2, 8)
    assert n == len(dims)
    buf[at:at + 8 * n] = np.array(dims, "<u8").tobytes()
    with open(path, "wb") as f:
        f.write(buf)
    tracemalloc.start()
    try:
        assert _load(path) is None
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


def test_checkpoint_state_and_onnxblock_name_the_damaged_file(tmp_path):
    from onnxtrain import zoo
    from onnxtrain.training import onnxblock

    path, main, _, _ = _saved(tmp_path, "inline")
    with open(path, "wb") as f:
        f.write(main[: len(main) // 2])
    with pytest.raises(RuntimeError, match=path):  # onnxruntime-training's class, as its own load raises
        CheckpointState.load_checkpoint(path)
    with pytest.raises(ValueError, match=path):
        onnxblock.load_checkpoint_to_model(path, zoo.mlp([4, 3, 2]))


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_an_endless_device_is_refused_without_reading_it_all(device):
    """A file that cannot be mapped is read whole: /dev/zero was read until memory ran out."""
    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    tracemalloc.start()
    try:
        with pytest.raises(ValueError, match=device):
            load_checkpoint(device)
        assert tracemalloc.get_traced_memory()[1] < 2**20
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("limit", [None, 1024], ids=["whole", "over-the-limit"])
def test_a_checkpoint_read_from_a_pipe(tmp_path, monkeypatch, limit):
    """Read whole, unless it passes the 2 GiB a FlatBuffer holds (here a stand-in limit)."""
    import threading

    from onnxtrain.checkpoint import flatbuf

    path, main, _, whole = _saved(tmp_path, "inline")
    assert len(main) > 1024
    fifo = str(tmp_path / "fifo")
    os.mkfifo(fifo)

    def feed() -> None:
        with open(fifo, "wb") as f, contextlib.suppress(BrokenPipeError):
            f.write(main)

    writer = threading.Thread(target=feed)
    writer.start()
    try:
        if limit is None:
            _assert_equal(load_checkpoint(fifo), whole)
        else:
            monkeypatch.setattr(flatbuf, "MAX_SIZE", limit)
            with pytest.raises(ValueError, match=f"{fifo}.*more than the 1024 bytes"):
                load_checkpoint(fifo)
    finally:
        writer.join()


def _module_file(path: str, nominal: bool, tensors: list[tuple[str, tuple[int, ...], bytes]]) -> None:
    """A checkpoint file with the given trainable tensors (float32) and is_nominal_state flag."""
    from onnxtrain.checkpoint.flatbuf import Bytes, Scalar, Scalars, Str, Table, Tables, encode

    tables = [Table(Str(n), None, Scalars("q", shape), Scalar("i", 1), Bytes(raw))
              for n, shape, raw in tensors]
    module = Table(Tables(tables), Tables([]), Scalar("?", nominal, False))
    with open(path, "wb") as f:
        f.write(encode(Table(Scalar("i", 2), module), b"ODTC"))


def test_a_full_checkpoint_flagged_nominal_is_refused(tmp_path):
    """One bit, the is_nominal_state flag, turned a checkpoint's weights into names only, silently: a nominal
    file holds no values (onnxtrain and onnxruntime-training write no dims; the latter's re-save of a nominal
    state writes 0-d tensors), so a tensor of shape (2, 3) under the flag is damage."""
    w = np.arange(6, dtype=np.float32)
    path = str(tmp_path / "c")
    _module_file(path, False, [("w", (2, 3), w.tobytes())])
    np.testing.assert_array_equal(load_checkpoint(path).trainable["w"], w.reshape(2, 3))
    _module_file(path, True, [("w", (2, 3), w.tobytes())])
    with pytest.raises(ValueError, match=f"{path}.*damaged.*'w'.*nominal"):
        load_checkpoint(path)
    # as onnxtrain, onnxruntime-training's re-save and test_checkpoint's oracle-built file write them
    for shape, raw in (((), b""), ((), np.float32(0).tobytes()), ((0,), b"")):
        _module_file(path, True, [("w", shape, raw)])
        got = load_checkpoint(path)
        assert got.nominal and got.trainable["w"].dtype == np.float32 and got.trainable["w"].size == 0
