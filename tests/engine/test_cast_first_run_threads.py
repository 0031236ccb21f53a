"""Two threads running one plan share its Cast node's memo: a thread that runs the node while another is
filling that memo on the node's first run gets the cast values, not a KeyError. The interleaving is made
deterministic: the second thread runs the kernel while the first is storing the memo's first entry."""

from __future__ import annotations

import threading

import numpy as np
from onnx import TensorProto as T

from onnxtrain.engine.registry import Attrs, NodeCache, find_kernel


class _RunsBetween(NodeCache):
    """A node memo that, as its first entry is stored, lets another thread run the kernel to the end."""

    def __init__(self, run) -> None:
        super().__init__()
        self.run = run
        self.errors: list[BaseException] = []
        self.results: list = []

    def __setitem__(self, key, value) -> None:
        first = not self
        super().__setitem__(key, value)
        if first:
            def other() -> None:
                try:
                    self.results.append(self.run())
                except BaseException as e:  # noqa: BLE001 - reported by the test
                    self.errors.append(e)

            t = threading.Thread(target=other)
            t.start()
            t.join()


def test_cast_memo_filled_while_another_thread_runs_the_node() -> None:
    cast = find_kernel("Cast", 19)
    attrs = Attrs({"to": T.FLOAT, "saturate": 1}, op="Cast", name="c", opset=19)
    x = np.array([[1, -2], [300, 7]], np.int32)
    cache = _RunsBetween(lambda: cast([x], attrs))
    attrs.cache = cache
    (y,) = cast([x], attrs)
    want = x.astype(np.float64).astype(np.float32)  # (every int32 here is exact in float32)
    assert not cache.errors, cache.errors
    (other,) = cache.results[0]
    for got in (y, other):
        assert got.dtype == np.float32 and np.array_equal(got, want)
