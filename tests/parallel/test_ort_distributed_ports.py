"""onnxruntime's distributed training, as facts, over three and four ranks (the other MPI tests take two).

The facts, from onnxruntime's training sources (``adasum_interface.h``, ``adasum_optimizer_graph_builder.cc``,
``allreduce_optimizer_graph_builder.cc``, ``zero_optimizer_graph_builder.cc``):

* Adasum needs a power-of-two number of ranks and combines them as a tree: at level d = 1, 2, 4, … ranks
  ``r`` and ``r ^ d`` pair up, so over four ranks (0 + 1) and (2 + 3) are combined first, then the two
  results; every coefficient takes the dot products of whole tensors. The optimizer runs first, on the
  rank's own gradients averaged over its accumulation steps (scaled by 1/steps, not 1/ranks), and the
  ranks' update deltas are combined; each rank keeps its own optimizer state.
* Allreduce and ZeRO scale the gradients by 1/(steps · ranks) and sum them: the average of the ranks'.
* ZeRO stage 1 pads the flat weights to a multiple of ranks · 32 and gives each rank an equal block: a
  weight may be cut into a piece before, the owned piece and a piece after (three ranks share it), and a
  rank may own only padding. The global norm is the square root of the sum over ranks of the squared norms
  of the owned pieces, the norm of the averaged gradient.

The references: float64 torch gradients with the Adasum tree in numpy (SGD), one float64 SGD process on the
whole batch, and single-process sessions (one on the whole batch for allreduce and ZeRO, one a rank whose
deltas ``adasum_reference`` combines for Adam under Adasum).
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.parallel import ort_distributed_worker as wk
from tests.parallel.conftest import run_mpi

pytestmark = pytest.mark.mpi

FOUR = ["adasum_sgd_a2", "adasum_adam", "adasum_adam_mp", "adasum_lamb", "adasum_lamb_mp", "zero_adam_clip",
        "zero_adam_mp", "zero_tiny_adam", "zero_tiny_adam_mp_overflow", "allreduce_lamb_a2",
        "allreduce_sgd_a3"]
THREE = ["adasum_adam", "zero_adam_clip", "zero_adam_mp", "zero_adasum_adam", "allreduce_sgd_a3"]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def _launch(tmp_path_factory: pytest.TempPathFactory, n: int, names: list[str]) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp(f"ranks{n}") / "out.npz"
    t0 = time.perf_counter()
    r = run_mpi(str(out), ",".join(names), n=n, worker=wk.__file__, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    print(f"mpiexec -n {n}: {len(names)} cases in {time.perf_counter() - t0:.1f} s")
    return dict(np.load(out))


@pytest.fixture(scope="module")
def four(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    return _launch(tmp_path_factory, 4, FOUR)


@pytest.fixture(scope="module")
def three(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    return _launch(tmp_path_factory, 3, THREE)


def _results(got: dict[str, np.ndarray], name: str, rank: int) -> dict[str, np.ndarray]:
    prefix = f"{name}/{rank}/"
    return {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}


def _rank_parts(case: wk.Case, n: int, r: int) -> list[tuple[np.ndarray, np.ndarray]]:
    from onnxtrain.parallel import split_batch

    return [split_batch(b, r, n) for b in wk.micro_batches(case)]


def _check_steps(got: dict[str, np.ndarray], name: str, n: int, want: list[dict[str, np.ndarray]],
                 rtol: float) -> None:
    """Every rank's weights after each step equal ``want`` (one dict a step), and equal each other bit for
    bit."""
    for r in range(n):
        mine = _results(got, name, r)
        for s, ws in enumerate(want):
            for k, v in ws.items():
                g = mine[f"{s}/{k}"]
                assert g.shape == v.shape, (name, r, s, k)
                err = rel_err(g, v)
                assert err <= rtol, f"{name} rank {r} step {s} {k}: relative error {err:.3g}"
                np.testing.assert_array_equal(g, got[f"{name}/0/{s}/{k}"], err_msg=f"{name} rank {r} {k}")


# ---- float64 oracles ---------------------------------------------------------------------------------

def _torch_gradients(w: dict[str, np.ndarray], x: np.ndarray, y: np.ndarray) -> dict[str, np.ndarray]:
    """The float64 gradients of mlp_model's mean cross-entropy loss at weights ``w`` on ``(x, y)``."""
    import torch

    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in w.items()}
    h = torch.relu(torch.as_tensor(x, dtype=torch.float64) @ t["W1"].T + t["b1"])
    logits = h @ t["W2"].T + t["b2"]
    torch.nn.functional.cross_entropy(logits, torch.as_tensor(y)).backward()
    return {k: v.grad.numpy() for k, v in t.items()}


def _initial(case: wk.Case) -> dict[str, np.ndarray]:
    from tests.session.helpers import mlp_model, weights_of

    din, dh, dout = case.dims
    return {k: v.astype(np.float64) for k, v in weights_of(mlp_model(din=din, dh=dh, dout=dout)).items()}


def _sgd_float64(case: wk.Case, n: int, adasum: bool) -> list[dict[str, np.ndarray]]:
    """SGD over ``n`` ranks in float64: each rank's gradient averaged over its accumulation steps; the
    ranks' deltas −lr·g combined by the Adasum tree (``adasum``) or averaged. Weights after each step."""
    from onnxtrain.parallel.adasum import adasum_reference

    lr = float(wk.LR[0])
    parts = [_rank_parts(case, n, r) for r in range(n)]
    w, out = _initial(case), []
    for s in range(wk.STEPS):
        deltas = []
        for r in range(n):
            g = {k: np.zeros_like(v) for k, v in w.items()}
            for j in range(case.accum):
                for k, v in _torch_gradients(w, *parts[r][s * case.accum + j]).items():
                    g[k] += v / case.accum
            deltas.append([-lr * g[k] for k in wk.WEIGHTS])
        combined = adasum_reference(deltas) if adasum else [sum(d[i] for d in deltas) / n
                                                              for i in range(len(wk.WEIGHTS))]
        w = {k: w[k] + c for k, c in zip(wk.WEIGHTS, combined)}
        out.append(dict(w))
    return out


# ---- single-process references --------------------------------------------------------------------

def _one_process(case: wk.Case, n: int) -> tuple[object, list[dict[str, np.ndarray]], list[float]]:
    """One process on the whole batches; under mixed precision (float16 products round per rank) one process
    taking each step's micro-batches rank by rank as accumulation steps."""
    import dataclasses

    if not case.mp:
        return wk.train(case, wk.micro_batches(case), data_parallel=False)
    parts = [_rank_parts(case, n, r) for r in range(n)]
    feeds = [parts[r][s * case.accum + j]
             for s in range(wk.STEPS) for r in range(n) for j in range(case.accum)]
    return wk.train(dataclasses.replace(case, accum=case.accum * n), feeds, data_parallel=False)


def _adasum_sessions(case: wk.Case, n: int) -> list[dict[str, np.ndarray]]:
    """One single-process session a rank, each on the rank's parts with its own optimizer state; after each
    step every session takes the old weights plus the float64 Adasum of the ranks' deltas."""
    from onnxtrain import TrainingSession
    from onnxtrain.parallel.adasum import adasum_reference

    sessions = [TrainingSession(wk.model_bytes(case), wk.parameters(case, data_parallel=False))
                for _ in range(n)]
    parts = [_rank_parts(case, n, r) for r in range(n)]
    old = sessions[0].get_model_state()["full_precision"]
    out = []
    for s in range(wk.STEPS):
        new = []
        for r, sess in enumerate(sessions):
            wk.train(case, parts[r][s * case.accum:(s + 1) * case.accum], sess=sess)
            new.append(sess.get_model_state()["full_precision"])
        deltas = [[nw[k].astype(np.float64) - old[k].astype(np.float64) for k in wk.WEIGHTS] for nw in new]
        combined = {k: (old[k].astype(np.float64) + c).astype(old[k].dtype)
                    for k, c in zip(wk.WEIGHTS, adasum_reference(deltas))}
        for sess in sessions:
            sess.load_state(combined)
        old = combined
        out.append(combined)
    return out


# ---- the tests -----------------------------------------------------------------------------------------

def test_adasum_over_four_ranks_is_a_tree_of_pairs(four: dict[str, np.ndarray]) -> None:
    """SGD with two accumulation steps, each rank on its quarter: every step adds the Adasum tree of the
    ranks' deltas (float64 torch gradients, each averaged over the rank's two micro-batches), not their
    average, nor a left-to-right chain."""
    case = wk.CASES["adasum_sgd_a2"]
    want = _sgd_float64(case, 4, adasum=True)
    _check_steps(four, "adasum_sgd_a2", 4, want, 1e-5)
    mean = _sgd_float64(case, 4, adasum=False)
    assert rel_err(want[-1]["W1"], mean[-1]["W1"]) > 1e-3  # the ranks' gradients differ enough to tell


@pytest.mark.parametrize("name", ["adasum_adam", "adasum_adam_mp", "adasum_lamb", "adasum_lamb_mp"])
def test_adasum_adam_and_lamb_over_four_ranks_combine_the_deltas(four: dict[str, np.ndarray],
                                                                  name: str) -> None:
    """Adam and LAMB (under mixed precision too, clipping by each rank's own norm) over four ranks, each with
    its own optimizer state: the weights of four single-process sessions whose deltas the float64 tree
    combines."""
    want = _adasum_sessions(wk.CASES[name], 4)
    _check_steps(four, name, 4, want, 1e-3 if wk.CASES[name].mp else 1e-5)


def test_adasum_refuses_three_ranks_by_name(three: dict[str, np.ndarray]) -> None:
    for r in range(3):
        msg = str(three[f"adasum_adam/{r}/error"])
        assert "enable_adasum" in msg and "power-of-two" in msg and "got 3" in msg, msg


@pytest.mark.parametrize("n,name", [(4, "allreduce_sgd_a3"), (3, "allreduce_sgd_a3")])
def test_allreduce_scales_by_steps_times_ranks(four: dict[str, np.ndarray], three: dict[str, np.ndarray],
                                               n: int, name: str) -> None:
    """SGD with three accumulation steps: the update is −lr times the average of every rank's and every
    step's gradient (float64 torch gradients), as one process on the whole batches."""
    got = four if n == 4 else three
    _check_steps(got, name, n, _sgd_float64(wk.CASES[name], n, adasum=False), 1e-5)


@pytest.mark.parametrize("n,name", [(4, "allreduce_lamb_a2"), (4, "zero_adam_clip"), (4, "zero_adam_mp"),
                                    (4, "zero_tiny_adam"), (4, "zero_tiny_adam_mp_overflow"),
                                    (3, "zero_adam_clip"), (3, "zero_adam_mp"), (3, "zero_adasum_adam")])
def test_ranks_train_as_one_process(four: dict[str, np.ndarray], three: dict[str, np.ndarray],
                                    n: int, name: str) -> None:
    """LAMB under allreduce and Adam under ZeRO stage 1 (clipping by the global norm; weights cut over
    three ranks; ranks owning only padding, also when float16 overflows and every rank must skip): each
    step's weights, global norm and all-finite flag equal one process's on the whole batch, and ZeRO's
    gathered optimizer state is that process's state. ZeRO and Adasum both set: ZeRO, also on three
    ranks."""
    got = four if n == 4 else three
    case = wk.CASES[name]
    sess, want, norms = _one_process(case, n)
    _check_steps(got, name, n, want, 1e-5)
    for r in range(n):
        mine = _results(got, name, r)
        np.testing.assert_allclose(mine["norms"], norms, rtol=1e-5, err_msg=f"{name} rank {r}")
        np.testing.assert_array_equal(mine["flags"], sess.test_flags, err_msg=f"{name} rank {r}")
        if case.mp:  # the overflowing case skips every update, the others apply every one
            assert sess.test_flags == [case.loss_scale < 1e20] * wk.STEPS, (name, sess.test_flags)
        if case.mode == "zero+adasum":  # ZeRO, with a warning (and on three ranks)
            assert any("ZeRO is used" in m for m in mine["warnings"]), mine["warnings"]
        if "zero" not in case.mode:
            continue
        gathered = {k.split("/", 1)[1]: v for k, v in mine.items() if k.startswith("gathered/")}
        full = sess.get_state()
        assert sorted(gathered) == sorted(full), (name, r)
        for k, v in full.items():
            assert gathered[k].shape == v.shape and gathered[k].dtype == v.dtype, (name, r, k)
            assert rel_err(gathered[k], v) <= 1e-5, f"{name} rank {r} {k}: {rel_err(gathered[k], v):.3g}"


def _cut_run(tmp_path, ranks: int) -> dict[str, np.ndarray]:
    wk.register_cut_cases()
    out = tmp_path / f"cut{ranks}.npz"
    r = run_mpi("cut", str(out), ",".join(wk.cut_cases(ranks)), n=ranks, worker=wk.__file__, timeout=240)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return dict(np.load(out))


def test_four_way_split_and_four_stages_train_as_one_process(tmp_path) -> None:
    """horizontal_parallel_size = 4 (an MLP's 16 hidden units, 4 a rank; two GELU blocks) and
    pipeline_parallel_size = 4 (a node a stage): the losses, the gathered state and a forward-only output
    equal one process's accumulating the same micro-batches (the other tests split over two ranks)."""
    from tests.parallel.test_pipeline import compare

    got = _cut_run(tmp_path, 4)
    for case in wk.cut_cases(4):
        compare(got, case, 2e-6)


def test_four_replicas_of_stages_and_of_a_split(tmp_path) -> None:
    """Eight ranks: four data-parallel replicas of two pipeline stages or of a two-way split, averaging
    (also under ZeRO stage 1) as one process accumulating every replica's micro-batches, and under Adasum
    as one process a replica whose deltas the float64 tree combines (two levels over four replicas; a split
    weight's dot products those of the whole tensor)."""
    from tests.parallel.test_pipeline import assert_adasum, compare

    got = _cut_run(tmp_path, 8)
    for case in ("adam2x4_clip", "adam2x4_zero_clip", "adam_h2x4_gelu_zero", "sgd_h2x4_gelu_blocks"):
        compare(got, case, 2e-6)
    assert_adasum(got, "adam2x4_adasum_clip", "adam2x4_clip")
    assert_adasum(got, "sgd_h2x4_gelu_adasum", "sgd_h2x4_gelu_blocks")


def test_zero_layouts_of_these_cases() -> None:
    """What the ZeRO cases above exercise: over four ranks W1 is cut in three (rank 1 owns its middle) and
    the tiny model leaves ranks 1..3 only padding; over three ranks two weights straddle a boundary."""
    from onnxtrain.parallel.zero import ZeroLayout

    def layout(case: wk.Case, n: int, r: int) -> ZeroLayout:
        return ZeroLayout({k: v.shape for k, v in _initial(case).items()}, n, r)

    big, tiny = wk.CASES["zero_adam_clip"], wk.CASES["zero_tiny_adam"]
    mid = layout(big, 4, 1)
    assert [(p.name, p.start, p.stop) for p in mid.pieces] == [("W1_view_1", 64, 128)]
    assert layout(big, 4, 0).padded == 256 and layout(big, 3, 0).padded == 288
    assert [p.name for p in layout(big, 3, 1).pieces] == ["W1_view_1", "W2_view_0"]
    assert [p.name for p in layout(tiny, 4, 0).pieces] == ["W1", "W2", "b1", "b2"]
    assert all(not layout(tiny, 4, r).pieces for r in (1, 2, 3))


def _legacy_pieces(shapes: dict[str, tuple[int, ...]], size: int, rank: int) -> list[tuple[str, int, int]]:
    """onnxruntime's ZeRO partition (zero_optimizer_graph_builder.cc), restated: the weights in name order
    padded to a multiple of size·32, rank r's block ``[r·c, (r+1)·c)``; a weight overlapping the block is
    kept whole when inside it, else viewed as pieces (before | owned | after), numbered from 0 in order,
    and only the owned view is updated. Returns (name, first, end) of the rank's updated elements."""
    counts = {w: int(np.prod(s, dtype=np.int64)) for w, s in sorted(shapes.items())}
    total = sum(counts.values())
    align = size * 32
    per = (total + align - total % align) // size
    lo, hi = rank * per, (rank + 1) * per
    out, offset = [], 0
    for w, n in counts.items():
        if offset < hi and offset + n > lo:
            if offset >= lo and offset + n <= hi:
                out.append((w, 0, n))
            else:
                before, after = offset < lo, offset + n > hi
                first, end = max(lo - offset, 0), min(hi - offset, n)
                out.append((f"{w}_view_{1 if before else 0}", first, end))
                assert before or after
        offset += n
    return out


def test_zero_partition_matches_the_legacy_rule_for_many_layouts() -> None:
    """Random weight sets over 1..8 ranks: every rank's updated pieces are the legacy builder's."""
    from onnxtrain.parallel.zero import ZeroLayout

    rng = np.random.default_rng(3)
    for _ in range(300):
        shapes = {f"w{k:02d}": tuple(int(d) for d in rng.integers(1, 40, rng.integers(1, 3)))
                  for k in range(int(rng.integers(1, 7)))}
        size = int(rng.integers(1, 9))
        for rank in range(size):
            got = [(p.name, p.start, p.stop) for p in ZeroLayout(shapes, size, rank).pieces]
            assert got == _legacy_pieces(shapes, size, rank), (shapes, size, rank)
