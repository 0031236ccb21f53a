"""The on-device Optimizer's flat update holds each merged value once: after the first step the arrays the
state held before the merge (the checkpoint's weights, the moments' initial zeros or a resumed checkpoint's
moments, the gradients the first training call made when the onnxruntime backend writes them into the flat
buffer) are freed, their values living on in the group's buffers only; what a merged group holds in total is
its buffers. A parameter someone else holds is the exception (test_flat_update.py: it keeps its array)."""

from __future__ import annotations

import gc
import os
import weakref

import numpy as np
import pytest

from onnxtrain.training.api import CheckpointState, Module, Optimizer
from tests.training.test_flat_update import _artifacts, _batch, _open, onnxblock

MERGED = ("W1", "b1", "b2", "W3")  # (W2: a group of its own, trained in its own arrays)


def _refs(state: CheckpointState, opt) -> dict[str, weakref.ref]:
    """Weak references to the merged parameters' current weights, gradients and moments."""
    refs = {}
    for p in MERGED:
        prm = state._params[p]
        refs[p] = weakref.ref(prm.data)
        if prm.grad is not None:
            refs[f"{p}.grad"] = weakref.ref(prm.grad)
        for k, m in opt._opt.moments[p].items():
            refs[f"{p}.{k}"] = weakref.ref(m)
    return refs


def _steps(state, module, opt, start: int, n: int) -> None:
    for i in range(start, start + n):
        module(*_batch(i))
        opt.step()
        module.lazy_reset_grad()


def _merged_bytes(opt) -> int:
    group = next(g for g in opt._flat.groups if not g.single)
    assert tuple(group.params) == MERGED
    return group.size * group.dtype.itemsize


@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_the_arrays_before_the_merge_are_freed(tmp_path, backend) -> None:
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    folder = _artifacts(tmp_path, onnxblock.optim.AdamW(weight_decay=0.01))
    state, module, opt = _open(folder, backend)
    module(*_batch(0))  # the gradients of the first call: the Module's own arrays
    before = _refs(state, opt)
    assert len(before) == 4 * len(MERGED)  # weight, gradient and two moments each
    values = {p: state._params[p].data.copy() for p in MERGED}
    opt.step()
    module.lazy_reset_grad()
    _steps(state, module, opt, 1, 2)
    gc.collect()
    kept = [k for k, r in before.items() if r() is not None]
    if not opt._flat.grads_in_place:  # the numpy engine: gathered each step, .grad stays the Module's
        kept = [k for k in kept if not k.endswith(".grad")]
    assert kept == []
    flat = next(g for g in opt._flat.groups if not g.single)
    for p, view in flat.views:  # the state's arrays are the buffer's views, the values trained
        assert state._params[p].data is view
        assert not np.array_equal(view, values[p])
    for p, k, view in flat.moment_views:
        assert opt._opt.moments[p][k] is view


def test_resumed_moments_are_freed_and_the_saved_state_is_the_trained_one(tmp_path) -> None:
    folder = _artifacts(tmp_path, onnxblock.optim.AdamW(weight_decay=0.01))
    state, module, opt = _open(folder)
    _steps(state, module, opt, 0, 2)
    path = str(tmp_path / "resume.ckpt")
    CheckpointState.save_checkpoint(state, path, include_optimizer_state=True)
    resumed = CheckpointState.load_checkpoint(path)
    module2 = Module(os.path.join(folder, "training_model.onnx"), resumed)
    opt2 = Optimizer(os.path.join(folder, "optimizer_model.onnx"), module2)
    loaded = _refs(resumed, opt2)
    _steps(resumed, module2, opt2, 2, 1)
    _steps(state, module, opt, 2, 1)
    gc.collect()
    assert [k for k, r in loaded.items() if r() is not None and not k.endswith(".grad")] == []
    assert _merged_bytes(opt2) == sum(resumed._params[p].data.nbytes for p in MERGED)
    for p in MERGED:  # one run resumed, one not: the same bits
        np.testing.assert_array_equal(resumed._params[p].data, state._params[p].data)
        for k, m in opt._opt.moments[p].items():
            np.testing.assert_array_equal(opt2._opt.moments[p][k], m)
    again = str(tmp_path / "again.ckpt")
    CheckpointState.save_checkpoint(resumed, again, include_optimizer_state=True)
    reread = CheckpointState.load_checkpoint(again)
    for p in MERGED:
        np.testing.assert_array_equal(reread._params[p].data, resumed._params[p].data)
        for k, m in opt2._opt.moments[p].items():
            np.testing.assert_array_equal(reread._optimizer.moments[p][k], m)
