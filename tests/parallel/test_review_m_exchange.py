"""Review M: the gradient exchange of the legacy session over MPI against independent float64 oracles.

One ``mpiexec -n 2`` spawn of ``review_m_worker.py`` (a 3-rank one in the full suite) gives every rank's
results; the oracles are computed here:

* allreduce (SGD; Adam with clipping and 2 micro-steps of accumulation) and ZeRO stage 1 (Adam with clipping,
  with and without accumulation; the gathered moments too): torch float64 gradients of the mean loss over the
  step's whole batch (every rank's rows, every micro-step), clipped by their global norm, and onnxruntime's
  Adam (``AdamOptimizer``: bias-corrected, ε outside the square root) written here in float64;
* Adasum (SGD; Adam with 2 micro-steps): each rank's own step in float64 (its own moments, clipped by its
  own norm), the deltas combined by the pairwise rule of Horovod / onnxruntime's Adasum written here (per
  tensor, ``(1 − a·b/2‖a‖²)·a + (1 − a·b/2‖b‖²)·b``, a coefficient 1 below sqrt(DBL_MIN));
* half-precision gradients: the exchanged mean is one process's (a session accumulating every rank's
  micro-steps): the float32 sum times float32 ``1/(steps·ranks)``, rounded once to the half type (it was
  rounded twice: each rank's scaled part, then the float32 sum; then, from 42f179af, the factor was float64,
  which rounds a few elements in ten million otherwise than one process: two such columns are in the data);
* a mixed-precision step skipped for overflow on one rank or on all: every rank skips it, the weights stay
  bit-identical across ranks and equal (bit for bit) to a session that never saw the skipped steps.
"""

from __future__ import annotations

import os
import pickle

import numpy as np
import pytest

from tests.parallel import review_m_worker as wk
from tests.parallel.conftest import run_mpi
from tests.tiers import extended

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "review_m_worker.py")
WEIGHTS = ("W1", "b1", "W2", "b2")
_TINY = float(np.sqrt(np.finfo(np.float64).tiny))


@pytest.fixture(scope="module", params=[2, extended(3, id="3")], ids=lambda n: str(n))
def ranks(request, tmp_path_factory) -> list[dict]:
    n = request.param
    out = tmp_path_factory.mktemp("review_m") / f"n{n}.pkl"
    r = run_mpi(str(out), n=n, timeout=300, worker=WORKER)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    with open(out, "rb") as f:
        return pickle.load(f)


# ---- the float64 oracle -------------------------------------------------------------------------
def _initial() -> dict[str, np.ndarray]:
    from onnx import numpy_helper

    return {t.name: numpy_helper.to_array(t).astype(np.float64) for t in wk.model().graph.initializer}


def _gradients(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """float64 gradients of mean((tanh(x·W1ᵀ + b1)·W2ᵀ + b2 − y)²) by torch autograd."""
    import torch

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    xt, yt = torch.tensor(x, dtype=torch.float64), torch.tensor(y, dtype=torch.float64)
    o = torch.tanh(xt @ t["W1"].T + t["b1"]) @ t["W2"].T + t["b2"]
    ((o - yt) ** 2).mean().backward()
    return {k: v.grad.numpy() for k, v in t.items()}


def _mean_gradients(w, batches) -> dict[str, np.ndarray]:
    """The mean of the micro-batches' gradients (equal sizes: the gradient of the mean loss of all rows)."""
    gs = [_gradients(w, x, y) for x, y in batches]
    return {k: sum(g[k] for g in gs) / len(gs) for k in w}


def _clip(g: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    norm = np.sqrt(sum(float(np.sum(v * v)) for v in g.values()))
    return {k: v * (wk.MAX_NORM / norm) for k, v in g.items()} if norm > wk.MAX_NORM else g


class _Adam:
    """onnxruntime's AdamOptimizer (weight decay 0, bias correction on), float64."""

    def __init__(self, w):
        self.m = {k: np.zeros_like(v) for k, v in w.items()}
        self.v = {k: np.zeros_like(v) for k, v in w.items()}
        self.t = 0

    def step(self, w, g):
        self.t += 1
        a, b, eps = 0.9, 0.999, 1e-8
        new = {}
        for k in w:
            self.m[k] = a * self.m[k] + (1 - a) * g[k]
            self.v[k] = b * self.v[k] + (1 - b) * g[k] * g[k]
            mh, vh = self.m[k] / (1 - a ** self.t), self.v[k] / (1 - b ** self.t)
            new[k] = w[k] - wk.LR * mh / (np.sqrt(vh) + eps)
        return new


def _sgd(w, g):
    return {k: w[k] - wk.LR * g[k] for k in w}


def _adasum_pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    dot, na, nb = float(np.vdot(a, b)), float(np.vdot(a, a)), float(np.vdot(b, b))
    ca = 1.0 - dot / na * 0.5 if na >= _TINY else 1.0
    cb = 1.0 - dot / nb * 0.5 if nb >= _TINY else 1.0
    return ca * a + cb * b


def _adasum(vectors: list[np.ndarray]) -> np.ndarray:
    while len(vectors) > 1:  # rank 2i with 2i+1, then the pairs' results, ...
        vectors = [_adasum_pair(a, b) for a, b in zip(vectors[0::2], vectors[1::2])]
    return vectors[0]


def oracle(name: str, size: int) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    """The float64 weights after the case's 3 steps, and the Adam moments (``Moment_1_<w>``, ...) when one
    state is shared (allreduce, ZeRO)."""
    mode, opt, acc = wk.CASES[name]
    micro = wk.micro_batches(acc)
    w = _initial()
    if mode != "adasum":
        adam = _Adam(w)
        norms = []
        for s in range(wk.STEPS):
            g = _mean_gradients(w, micro[s * acc:(s + 1) * acc])
            norms.append(np.sqrt(sum(float(np.sum(v * v)) for v in g.values())))
            w = adam.step(w, _clip(g)) if opt == "AdamOptimizer" else _sgd(w, g)
        moments = {f"Moment_{i}_{k}": m[k] for k in w for i, m in ((1, adam.m), (2, adam.v))}
        return w, ({**moments, "norms": np.array(norms)} if opt == "AdamOptimizer" else {})
    adams = [_Adam(w) for _ in range(size)]
    for s in range(wk.STEPS):
        deltas = []
        for r in range(size):
            mine = [(wk.part(x, r, size), wk.part(y, r, size)) for x, y in micro[s * acc:(s + 1) * acc]]
            g = _mean_gradients(w, mine)
            new = adams[r].step(w, _clip(g)) if opt == "AdamOptimizer" else _sgd(w, g)
            deltas.append({k: new[k] - w[k] for k in w})
        w = {k: w[k] + _adasum([d[k] for d in deltas]) for k in w}
    return w, {}


# ---- the tests ----------------------------------------------------------------------------------
@pytest.mark.mpi
@pytest.mark.parametrize("name", list(wk.CASES))
def test_training_matches_the_float64_oracle(ranks, name: str) -> None:
    size = len(ranks)
    mode = wk.CASES[name][0]
    if mode == "adasum" and size & (size - 1):
        pytest.skip("Adasum needs a power-of-two number of ranks")
    want, moments = oracle(name, size)
    states = [r["train"][name] for r in ranks]
    for k in WEIGHTS:
        for r, st in enumerate(states):  # float32 training against float64: 3 steps of size ~LR
            np.testing.assert_allclose(st[k], want[k], rtol=1e-4, atol=2e-6, err_msg=f"{name} {k} rank {r}")
            np.testing.assert_array_equal(st[k], states[0][k], err_msg=f"{name} {k}: ranks differ")
    norms = moments.pop("norms", None)
    for k, v in moments.items():  # ZeRO: gathered from the ranks' pieces
        for r, st in enumerate(states):
            np.testing.assert_allclose(st[k], v, rtol=2e-4, atol=1e-9, err_msg=f"{name} {k} rank {r}")
    if norms is not None:  # the global norm of the averaged gradients (above MAX_NORM: clipping acted)
        assert (norms > 2 * wk.MAX_NORM).all(), norms
        for r, got in enumerate(ranks):
            np.testing.assert_allclose(got["train"][name + " norms"], norms, rtol=1e-5, err_msg=f"{name} {r}")
    if mode == "zero":  # each rank holds the moments of its own pieces only, together every element once
        held = [sum(n for k, n in r["train"][name + " own state"].items() if k.startswith("Moment_1_"))
                for r in ranks]
        total = sum(v.size for k, v in wk.model_weights().items())
        assert sum(held) == total and max(held) < total, (held, total)


def _one_process_half(tname: str, rows: np.ndarray) -> np.ndarray:
    """``W`` after one process's SGD step (learning rate −1) accumulating every rank's micro-steps, in rank
    order: its float32 accumulation buffer times the graph's float32 ``1/steps``, cast to the half type."""
    from onnxtrain import TrainingSession

    ttype = wk.HALF_TYPES[tname][0]
    flat = rows.reshape(-1, rows.shape[-1])
    s = TrainingSession(wk.half_model(ttype), wk.params("allreduce", "SGDOptimizer", len(flat)))
    for x in flat:
        s.run(["loss"], {"x": x[None], "Learning_Rate": np.array([-1.0], np.float32)})
    return np.asarray(s.get_state()["W"])


@pytest.mark.mpi
@pytest.mark.parametrize("tname", list(wk.HALF_TYPES))
def test_half_gradients_are_averaged_as_one_process(ranks, tname: str) -> None:
    """W = 0 − (−1)·mean gradient: the exchanged mean itself, bit for bit (allreduce, ZeRO's reduce-scatter)
    against one process accumulating every rank's micro-steps, whose mean is the float32 sum times float32
    ``1/steps`` rounded once to the half type (on 2 ranks in float16, columns where that is not the float64
    mean rounded once); the on-device ``allreduce_gradients`` against the float64 sum and mean."""
    size = len(ranks)
    dtype = wk.HALF_TYPES[tname][1]
    rows = wk.half_rows(size, dtype)
    sums = rows.astype(np.float64).sum(axis=1)  # [size, HALF_N]; each rank's float32 sum is exact
    mean = _one_process_half(tname, rows)
    total = rows.astype(np.float64).sum(axis=(0, 1))
    assert (total.astype(np.float32) == total).all()  # the float32 sum over ranks is exact too
    np.testing.assert_array_equal(  # one process's arithmetic, as the accumulation graph writes it
        mean.astype(np.float64),
        (total.astype(np.float32) * np.float32(1 / rows[:, :, 0].size)).astype(dtype).astype(np.float64))
    if size == 2 and tname == "float16":  # where one process is not the float64 mean rounded once
        k = len(wk.HALF_MIDPOINT_COLUMNS)
        assert (mean[:k] != (total[:k] / 6).astype(dtype)).all(), "the columns no longer discriminate"
    for r, got in enumerate(ranks):
        for mode in ("allreduce", "zero"):
            w = got["half"][f"{tname}_{mode}"]
            bad = np.flatnonzero(w.astype(np.float64) != mean.astype(np.float64))
            assert bad.size == 0, f"{tname} {mode} rank {r}: elements {bad.tolist()} not one process's mean"
        local = sums.astype(dtype).astype(np.float64)  # each rank's sum rounded to the half type first
        for average, want in ((False, local.sum(0)), (True, local.sum(0) / size)):
            w = got["half"][f"{tname}_allreduce_gradients_{average}"]
            bad = int(np.sum(w.astype(np.float64) != want.astype(dtype).astype(np.float64)))
            assert bad == 0, f"{tname} allreduce_gradients average={average} rank {r}: {bad} off"


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["adasum", "zero", extended("allreduce", id="allreduce")])
@pytest.mark.parametrize("acc", [1, extended(2, id="2")])
def test_a_step_skipped_for_overflow_keeps_the_ranks_in_lockstep(ranks, mode: str, acc: int) -> None:
    """Steps 2 (rank 1 overflows) and 3 (every rank) are skipped on every rank: all_gradients_finite (and
    Adasum's adasum_all_deltas_finite) false on both; weights, moments and counts bit-identical to the
    session that ran steps 1 and 4 only, and across ranks (under Adasum the weights: each rank keeps its own
    moments)."""
    if f"{mode}{acc}" not in ranks[0]["skip"]:
        pytest.skip("Adasum needs a power-of-two number of ranks")
    for r, got in enumerate(ranks):
        state, flags = got["skip"][f"{mode}{acc}"]["skipped"]
        control, cflags = got["skip"][f"{mode}{acc}"]["control"]
        width = len(flags[0])
        assert flags == [[True] * width, [False] * width, [False] * width, [True] * width], (mode, r, flags)
        assert cflags == [[True] * width] * 2, (mode, r, cflags)
        assert sorted(state) == sorted(control), (mode, r)
        for k in state:
            np.testing.assert_array_equal(state[k], control[k], err_msg=f"{mode} {k} rank {r}")
            if mode != "adasum" or k in WEIGHTS:  # (Adasum's ranks keep optimizer states of their own)
                np.testing.assert_array_equal(state[k], ranks[0]["skip"][f"{mode}{acc}"]["skipped"][0][k],
                                              err_msg=f"{mode} {k}: rank {r} differs from rank 0")
