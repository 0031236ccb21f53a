"""The legacy Adam/Lamb update's scalar prologue (bias corrections, next step counts) in fewer nodes.

The reference is the emission before the change, kept below as copies of the old helpers and patched into
``onnxtrain.optim.adam``/``lamb`` for a reference session: losses and every state array (weights, moments,
counts) must have the same bits over several steps, on the numpy engine and on onnxruntime, for Adam over
many weights, one weight, corrections partly or wholly off, float16/float64 weights, mixed precision, the
flat update, and Lamb with and without bias correction. Torch's float64 Adam is the independent oracle of
the default setup (within float32 rounding).
"""

from __future__ import annotations

from collections import Counter

import numpy as np
import onnx
import pytest
from onnx import TensorProto, numpy_helper

import onnxtrain
from onnxtrain.ir.builder import NodeWriter
from onnxtrain.ir.types import held
from onnxtrain.optim import adam, lamb
from onnxtrain.optim.base import scalar
from tests.session.helpers import mlp_model, params

# --- the emission before the change (reference) -------------------------------------------------------------


def _old_bias_corrections(w: NodeWriter, t: str, alpha: float, beta: float, on: bool, et: int):
    if not on:
        one = scalar(w, 1.0, et)
        return one, one
    tf = w.one("Cast", t, to=TensorProto.DOUBLE)
    c1 = _old_correction(w, scalar(w, held(alpha, et), TensorProto.DOUBLE), tf)
    c2 = _old_correction(w, scalar(w, held(beta, et), TensorProto.DOUBLE), tf)
    if et == TensorProto.DOUBLE:
        return c1, c2
    return w.one("Cast", c1, to=et), w.one("Cast", c2, to=et)


def _old_correction(w: NodeWriter, base: str, tf: str) -> str:
    one = scalar(w, 1.0, TensorProto.DOUBLE)
    c = w.one("Sub", one, w.one("Pow", base, tf))
    return w.one("Where", w.one("Greater", tf, scalar(w, 0.0, TensorProto.DOUBLE)), c, one)


def _old_shared(w: NodeWriter, items, et: int, lr=None, **_ignored):
    on = [i for i, (_, _, _, flag) in enumerate(items) if flag]
    out = [(*_old_bias_corrections(w, t, a, b, False, et), None) for t, a, b, _ in items]
    if len(on) == 1:
        t, a, b, _ = items[on[0]]
        out[on[0]] = (*_old_bias_corrections(w, t, a, b, True, et), None)
    elif on:
        dbl = TensorProto.DOUBLE
        sizes = w.ints([1] * len(on))
        tf = w.one("Cast", w.one("Concat", *[items[i][0] for i in on], axis=0), to=dbl)
        vectors = []
        for k in (1, 2):
            c = _old_correction(w, w.const(np.array([held(items[i][k], et) for i in on]), dbl), tf)
            vectors.append(c if et == dbl else w.one("Cast", c, to=et))
        c1s, c2s = (w.emit("Split", [c, sizes], len(on), axis=0) for c in vectors)
        steps = [None] * len(on)
        if lr is not None:
            step = adam.step_size(w, lr, vectors[0], vectors[1])
            steps = list(w.emit("Split", [step, sizes], len(on), axis=0))
        for i, c1, c2, st in zip(on, c1s, c2s, steps):
            out[i] = (c1, c2, st)
    return out


def _old_next_counts(w: NodeWriter, counts, names, **_ignored):
    if len(counts) == 1:
        return w.emit("Add", [counts[0], w.ints([1])], names)
    stepped = w.one("Add", w.one("Concat", *counts, axis=0), w.ints([1]))
    return w.emit("Split", [stepped, w.ints([1] * len(counts))], names, axis=0)


def _use_old(mp: pytest.MonkeyPatch) -> None:
    mp.setattr(adam, "bias_corrections", _old_bias_corrections)
    mp.setattr(adam, "shared_bias_corrections", _old_shared)
    mp.setattr(adam, "next_counts", _old_next_counts)
    # Lamb called the scalar form per weight
    mp.setattr(lamb, "shared_bias_corrections", lambda w, items, et, *_a, **_k: [
        (*_old_bias_corrections(w, t, a, b, on, et), None) for t, a, b, on in items])


# --- models and runs ----------------------------------------------------------------------------------------


def _typed(model: onnx.ModelProto, np_dtype) -> onnx.ModelProto:
    """``model`` with its float initializers, inputs and outputs in ``np_dtype``."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    to = onnx.helper.np_dtype_to_tensor_dtype(np.dtype(np_dtype))
    for i, t in enumerate(m.graph.initializer):
        a = numpy_helper.to_array(t)
        if a.dtype == np.float32:
            m.graph.initializer[i].CopyFrom(numpy_helper.from_array(a.astype(np_dtype), t.name))
    for v in list(m.graph.input) + list(m.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.FLOAT:
            v.type.tensor_type.elem_type = to
    return m


def _session(cfg: dict) -> onnxtrain.TrainingSession:
    so = onnxtrain.SessionOptions()
    so.add_session_config_entry("onnxtrain.backend", cfg.get("backend", "numpy"))
    so.add_session_config_entry("onnxtrain.flat_update", cfg.get("flat", "0"))
    p = params(cfg.get("opt", "AdamOptimizer"), enable_grad_norm_clip=cfg.get("clip", False))
    for k, v in cfg.get("p", {}).items():
        setattr(p, k, v)
    model = _typed(mlp_model(din=6, dh=10, dout=4, seed=3), cfg.get("dtype", np.float32))
    return onnxtrain.TrainingSession(model.SerializeToString(), p, so)


def _run(cfg: dict, steps: int = 6) -> tuple[list, dict]:
    sess = _session(cfg)
    rng = np.random.default_rng(11)
    dt = cfg.get("dtype", np.float32)
    losses = []
    for i in range(steps):
        feeds = {"x": rng.standard_normal((5, 6)).astype(dt), "y": rng.integers(0, 4, 5).astype(np.int64),
                 "Learning_Rate": np.array([0.02 * (1 + i % 2)], np.float32), **cfg.get("feeds", {})}
        losses.append(sess.run(["loss"], feeds)[0])
        if i == 2 and "load" in cfg:  # counts that differ per weight (and a zero count)
            sess.load_state(cfg["load"](sess.get_state()), strict=False)
    return losses, sess.get_state()


def _bits(a) -> tuple:
    a = np.asarray(a)
    return a.dtype.str, a.shape, a.tobytes()


def _uneven_counts(state: dict) -> dict:
    out = {}
    for i, k in enumerate(sorted(k for k in state if k.startswith("Update_Count_"))):
        out[k] = np.array([[0, 7, 1, 1234567][i % 4]], np.int64)
    return out


_W = ("W1", "b1", "W2", "b2")


def _int_map(**given: dict) -> dict:
    """An int attribute map with an entry for every weight (the session asks for one)."""
    return {"optimizer_int_attributes_map": {k: given.get(k, {}) for k in _W}}


_MAPS = dict(
    optimizer_attributes_map={"W1": {"alpha": 0.8, "beta": 0.95}, "b1": {}, "W2": {}, "b2": {"lambda": 0.01}},
    **_int_map(b1={"do_bias_correction": 0, "weight_decay_mode": 1}, W2={"weight_decay_mode": 1}),
)
_ONE_WEIGHT_BETAS = {"weights_to_train": {"W1"},
                     "optimizer_attributes_map": {"W1": {"alpha": 0.882, "beta": 0.991}}}
CASES = {
    "adam": {},
    "adam_ort": {"backend": "onnxruntime"},
    "adam_flat_ort": {"backend": "onnxruntime", "flat": "1"},
    "adam_clip": {"clip": True},
    "adam_maps": {"p": _MAPS},
    "adam_maps_ort": {"p": _MAPS, "backend": "onnxruntime"},
    "adam_uneven_counts": {"load": _uneven_counts},
    "adam_one_weight": {"p": {"weights_to_train": {"W1"}}},
    "adam_two_of_four_corrected": {"p": _int_map(W1={"do_bias_correction": 0},
                                                   b2={"do_bias_correction": 0})},
    "adam_uncorrected": {"p": _int_map(**{k: {"do_bias_correction": 0} for k in _W})},
    "adam_float64": {"dtype": np.float64},
    # one weight, α = 0.882 and β = 0.991 (float32 values, as the attribute map holds them): their cubes
    # rounded once ((a·a)·a: a·a is exact) are not numpy's float64 power of them on this host
    "adam_one_weight_float64": {"dtype": np.float64, "p": _ONE_WEIGHT_BETAS},
    "adam_one_weight_float64_ort": {"dtype": np.float64, "backend": "onnxruntime", "p": _ONE_WEIGHT_BETAS},
    "adam_float64_ort": {"dtype": np.float64, "backend": "onnxruntime"},
    "adam_float16": {"dtype": np.float16},
    "adam_mixed": {"p": {"use_mixed_precision": True},
                   "feeds": {"loss_scale": np.array([1024.0], np.float32)}},
    "lamb": {"opt": "LambOptimizer"},
    "lamb_corrected": {"opt": "LambOptimizer", "p": _int_map(W1={"do_bias_correction": 1})},
    "lamb_corrected_float64": {"opt": "LambOptimizer", "dtype": np.float64,
                               "p": _int_map(W1={"do_bias_correction": 1})},
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_same_bits_as_the_previous_emission(case: str) -> None:
    cfg = CASES[case]
    if cfg.get("backend") == "onnxruntime":
        pytest.importorskip("onnxruntime")
    new_losses, new_state = _run(cfg)
    with pytest.MonkeyPatch.context() as mp:
        _use_old(mp)
        old_losses, old_state = _run(cfg)
    assert [_bits(v) for v in new_losses] == [_bits(v) for v in old_losses]
    assert sorted(new_state) == sorted(old_state)
    for k in old_state:
        assert _bits(new_state[k]) == _bits(old_state[k]), k
    assert any(np.any(np.asarray(old_state[k]) != 0) for k in old_state if k.startswith("Moment_1"))


def _update_ops(cfg: dict) -> Counter:
    sess = _session(cfg)
    g = sess._graphs.full
    onnx.checker.check_model(g, full_check=True)
    assert all(n.domain in ("", "ai.onnx") for n in g.graph.node)
    return Counter(n.op_type for n in g.graph.node)


@pytest.mark.parametrize("case,removed", [
    ("adam", {"Pow": 1, "Greater": 1, "Concat": 1, "Sub": 1, "Where": 1, "Cast": 1}),
    ("adam_one_weight", {"Pow": 1, "Greater": 1, "Sub": 1, "Where": 1, "Cast": 1}),
    ("adam_two_of_four_corrected", {"Pow": 1, "Greater": 1, "Sub": 1, "Where": 1}),
    ("adam_float64", {"Pow": 1, "Greater": 1, "Concat": 1, "Sub": 1, "Where": 1}),
    # four weights with one shared step: seven nodes each before, one vector now
    ("lamb_corrected", {"Pow": 7, "Greater": 7, "Sub": 7, "Where": 7, "Cast": 10, "Concat": -1}),
])
def test_fewer_prologue_nodes(case: str, removed: dict) -> None:
    new = _update_ops(CASES[case])
    with pytest.MonkeyPatch.context() as mp:
        _use_old(mp)
        old = _update_ops(CASES[case])
    for op, k in removed.items():
        assert old[op] - new[op] == k, (op, old[op], new[op])
    assert sum(new.values()) < sum(old.values())


def test_default_adam_against_torch() -> None:
    """Four weights, six steps: torch's float64 Adam (its eps inside the corrected denominator, as mode 0)."""
    torch = pytest.importorskip("torch")
    losses, state = _run({})
    m = mlp_model(din=6, dh=10, dout=4, seed=3)
    ws = {t.name: torch.tensor(numpy_helper.to_array(t).astype(np.float64), requires_grad=True)
          for t in m.graph.initializer}
    betas = (float(np.float32(0.9)), float(np.float32(0.999)))  # as the graph holds them
    opt = torch.optim.Adam(list(ws.values()), lr=0.02, betas=betas, eps=1e-8)
    rng = np.random.default_rng(11)
    for i in range(6):
        x = torch.tensor(rng.standard_normal((5, 6)).astype(np.float32), dtype=torch.float64)
        y = torch.tensor(rng.integers(0, 4, 5).astype(np.int64))
        for gr in opt.param_groups:
            gr["lr"] = float(np.float32(0.02 * (1 + i % 2)))
        h = torch.relu(x @ ws["W1"].T + ws["b1"])
        loss = torch.nn.functional.cross_entropy(h @ ws["W2"].T + ws["b2"], y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        np.testing.assert_allclose(losses[i], loss.item(), rtol=2e-5)
    for k, v in ws.items():
        np.testing.assert_allclose(state[k], v.detach().numpy(), rtol=2e-4, atol=2e-6, err_msg=k)
    assert all(int(state[f"Update_Count_{k}"][0]) == 7 for k in ws)
