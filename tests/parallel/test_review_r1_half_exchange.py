"""Review R1 of 42f179af (half-precision gradients summed across ranks in float32, scaled after the sum):

* one ``mpiexec -n 4`` spawn (about 3 s): float16 and bfloat16 weights trained under allreduce and ZeRO-1
  over 4 replicas, and pipeline (2 stages) and horizontal (2 ranks) sessions with 2 data-parallel replicas
  each, against one process accumulating the same micro-batches (``tests/parallel/test_half_sums_cut.py``'s
  model; rows of several magnitudes): the same weights, bit for bit (before 42f179af, where each rank's
  scaled part was rounded to the half type, they were not; the pipeline and horizontal sessions' replicas
  rounded each replica's mean to the half type before their sum until the cut sessions handed the reducer
  their float32 sums);
* in-process, with a stand-in communicator (the ranks' sum is known): ``BucketReducer`` of float32 and float64
  gradients moves the buffers it did before (one flat buffer per dtype, the same bytes), and
  ``allreduce_gradients`` keeps apart gradients of two float8 types (numpy names both ``<V1``).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import ml_dtypes
import numpy as np
import pytest

from tests.parallel.conftest import run_mpi
from tests.parallel.test_half_sums_cut import LR, MICRO, NP, STEPS, session

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# mode → data-parallel replicas on 4 ranks
MODES = {"allreduce": 4, "zero": 4, "pipeline": 2, "horizontal": 2}

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
import numpy as np
from mpi4py import MPI
from tests.parallel.test_review_r1_half_exchange import MODES, replica_feeds, session, steps
rank = MPI.COMM_WORLD.rank
out = {{}}
for kind in ("float16", "bfloat16"):
    for mode in MODES:
        sess = session(kind, mode)
        d = getattr(sess, "data_parallel_rank", rank) if mode in ("pipeline", "horizontal") else rank
        for feeds in steps(kind):
            mine = replica_feeds(feeds, d, MODES[mode])
            sess.run(["loss"], {{**mine, "Learning_Rate": np.array([{lr}], np.float32)}})
        for k, v in sess.gather_state().items():
            out[f"{{kind}}.{{mode}}.{{k}}"] = v.astype(np.float32)
if rank == 0:
    np.savez({folder!r} + "/state.npz", **out)
"""


def steps(kind: str) -> list[dict[str, np.ndarray]]:
    """Three runs' feeds of 4 rows: values of several magnitudes (the rows' gradients, summed in float32 over
    12 micro-batches at most, stay exact there)."""
    rng = np.random.default_rng(7)
    half = NP[kind]
    out = []
    for _ in range(STEPS):
        x = rng.standard_normal((4, 4)) * np.exp2(rng.integers(-2, 3, (4, 1)))
        y = rng.standard_normal((4, 3)) * np.exp2(rng.integers(-2, 3, (4, 1)))
        out.append({"x": x.astype(np.float32).astype(half), "y": y.astype(np.float32).astype(half)})
    return out


def replica_feeds(feeds: dict[str, np.ndarray], replica: int, replicas: int) -> dict[str, np.ndarray]:
    """A replica's rows of a run's batch."""
    return {k: np.split(v, replicas)[replica] for k, v in feeds.items()}


def one_process(kind: str, replicas: int, micro: int, make: Callable | None = None,
                lr: np.ndarray = LR) -> dict[str, np.ndarray]:
    """One process accumulating every replica's micro-batches of the three runs before its one update;
    ``make(kind, accumulation_steps)``: its session (default: SGD, :func:`session`)."""
    sess = (make or (lambda k, n: session(k, "one", n)))(kind, STEPS * replicas * micro)
    for feeds in steps(kind):
        for d in range(replicas):
            mine = replica_feeds(feeds, d, replicas)
            for k in range(micro):
                part = {n: np.split(v, micro)[k] for n, v in mine.items()}
                sess.run(["loss"], {**part, "Learning_Rate": lr})
    return {k: np.asarray(v).astype(np.float32) for k, v in sess.get_state().items()}


@pytest.fixture(scope="module")
def replicas_state(tmp_path_factory) -> dict[str, np.ndarray]:
    folder = tmp_path_factory.mktemp("half_replicas")
    script = folder / "half_replicas.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(folder), lr=float(LR[0])))
    proc = run_mpi(worker=str(script), n=4, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(np.load(folder / "state.npz"))


@pytest.mark.mpi
@pytest.mark.parametrize("kind", list(NP))
@pytest.mark.parametrize("mode", list(MODES))
def test_half_weights_over_replicas_give_one_process_weights(replicas_state, mode: str, kind: str) -> None:
    replicas = MODES[mode]
    want = one_process(kind, replicas, MICRO if mode == "pipeline" else 1)
    for w in ("W1", "W2"):
        key = f"{kind}.{mode}.{w}"
        np.testing.assert_array_equal(replicas_state[key], want[w], err_msg=key)


class _TwoSameRanks:
    """A stand-in communicator of 2 ranks holding the same gradients: the sum is twice this rank's."""

    size, rank = 2, 0

    def __init__(self) -> None:
        self.moved: list[tuple[str, int]] = []

    def allreduce_(self, buf: np.ndarray, what: str = "allreduce") -> np.ndarray:
        self.moved.append((buf.dtype.str, buf.nbytes))
        buf *= 2
        return buf


def test_float32_and_float64_gradients_move_as_before() -> None:
    """One flat buffer per dtype, in their own type, reduced in place (the views are the buffer) and
    returned scaled as before: float32 times a float32 factor, float64 times a float64 one."""
    from onnxtrain.parallel import BucketReducer

    rng = np.random.default_rng(0)
    shapes = [(3, 5), (7,), (0,), (1,), (4, 4)]
    dtypes = [np.float32, np.float64, np.float32, np.float64, np.float32]
    comm = _TwoSameRanks()
    red = BucketReducer(comm, shapes, dtypes, bucket_bytes=64)
    grads = [rng.standard_normal(s).astype(t) for s, t in zip(shapes, dtypes)]
    out = red.reduce(grads, 1 / 6)
    assert {np.dtype(k) for k in red.flat} == {np.dtype(np.float32), np.dtype(np.float64)}
    assert red.nbytes == (15 + 0 + 16) * 4 + (7 + 1) * 8
    assert sum(n for _, n in comm.moved) == red.nbytes
    assert {k for k, _ in comm.moved} == {"<f4", "<f8"}
    for g, o in zip(grads, out):
        assert o.dtype == g.dtype and any(np.shares_memory(o, b) for b in red.flat.values()) or o.size == 0
        factor = g.dtype.type(1 / 6)
        np.testing.assert_array_equal(o, (g * factor) * g.dtype.type(2))


@pytest.mark.parametrize("first, second", [(ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz),
                                           (ml_dtypes.float8_e5m2fnuz, ml_dtypes.float8_e4m3b11fnuz)])
def test_allreduce_gradients_keeps_float8_types_apart(first, second) -> None:
    """numpy names these float8 types alike (``<V1``): gradients of the second type, of the first's
    shapes, must come back in their own type with their own values."""
    from onnxtrain.parallel import allreduce_gradients

    comm = _TwoSameRanks()
    values = np.array([0.3, 1.7, -2.5, 0.0])
    for t in (first, second):
        got = allreduce_gradients([values.astype(t)], inplace=False, comm=comm)[0]
        assert got.dtype == np.dtype(t), (t, got.dtype)
        np.testing.assert_array_equal(got.astype(np.float64), values.astype(t).astype(np.float64))


def test_a_float16_sum_past_its_range_is_infinite_without_a_numpy_warning() -> None:
    """``allreduce_gradients(average=False)`` of float16 gradients whose sum passes 65504: infinite, as MPI's
    float16 sum gave it before 42f179af, and no 'overflow encountered in cast' RuntimeWarning from the cast
    of the float32 sum."""
    import warnings

    from onnxtrain.parallel import allreduce_gradients

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        got = allreduce_gradients([np.array([60000.0, -60000.0, 1.5], np.float16)], average=False,
                                  inplace=False, comm=_TwoSameRanks())[0]
    assert got.dtype == np.float16
    np.testing.assert_array_equal(got, np.array([np.inf, -np.inf, 3.0], np.float16))
