"""Data parallelism over ``mpiexec -n 2``: same weights as one process on the whole batch, ZeRO stage 1,
Adasum against a float64 reference, and the failure paths (a raising or killed rank, mismatched models)."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.parallel import mpi_worker
from tests.parallel.conftest import run_mpi
from tests.session.helpers import mlp_model, weights_of

pytestmark = pytest.mark.mpi


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("mpi") / "train.npz"
    t0 = time.perf_counter()
    r = run_mpi("train", str(out), timeout=240)
    assert r.returncode == 0, r.stdout + r.stderr
    print(f"mpiexec -n 2 train: {time.perf_counter() - t0:.1f} s\n{r.stdout}")
    return dict(np.load(out))


@pytest.mark.parametrize("case", list(mpi_worker.CASES))
def test_two_ranks_half_batch_equal_one_process_whole_batch(trained: dict[str, np.ndarray],
                                                             case: str) -> None:
    if case in mpi_worker.HALVES:
        ref, ref_norms = mpi_worker.train(case, halves=True)
    else:
        ref, ref_norms = mpi_worker.train(mpi_worker.reference_case(case), rank=0, size=1)
    want = ref.get_model_state()["full_precision"]
    for r in range(2):
        for k, v in want.items():
            err = rel_err(trained[f"{case}/{r}/{k}"], v)
            assert err <= 1e-6, f"{case} rank {r} {k}: relative error {err:.3g}"
    if ref_norms and case != "adam_adasum_mp_overflow":  # there rank 0's own gradients are finite
        np.testing.assert_allclose(trained[f"{case}/0/norms"], ref_norms, rtol=1e-5)
    if mpi_worker.CASES[case][3].get("use_mixed_precision"):  # every rank reports the same verdicts
        overflow = case.endswith("_mp_overflow")
        flags = ["all_gradients_finite"] + (["adasum_all_deltas_finite"] if "adasum" in case else [])
        for name in flags:
            for r in range(2):
                got = trained[f"{case}/{r}/flags/{name}"]
                assert got.shape == (mpi_worker.STEPS,), (name, r)
                assert not got.any() if overflow else got.all(), (name, r, got)
    initial = weights_of(mlp_model(din=mpi_worker.DIN))
    if case.endswith("_mp_overflow"):  # float16 overflows at this loss scale: every rank skipped every update
        assert not np.isfinite(trained[f"{case}/1/norms"]).any()
        for r in range(2):
            for k, v in initial.items():
                np.testing.assert_array_equal(trained[f"{case}/{r}/{k}"], v, err_msg=f"rank {r} {k}")
    elif case in mpi_worker.HALVES:  # it trains
        moved = [rel_err(trained[f"{case}/0/{k}"], v) for k, v in initial.items()]
        assert min(moved) > 1e-3, moved
    if mpi_worker.CASES[case][2]:  # ZeRO: the gathered state is the whole unpartitioned state
        full = ref.get_state()
        for r in range(2):
            got = {k.split("/", 3)[3]: v for k, v in trained.items() if k.startswith(f"{case}/{r}/gathered/")}
            assert sorted(got) == sorted(full)
            for k, v in full.items():
                assert got[k].shape == v.shape and got[k].dtype == v.dtype, k
                assert rel_err(got[k], v) <= 1e-5, k
        ref.load_state(got, strict=True)  # loads into an unpartitioned session


ORT_CASES = ("adam", "adam_accum", "adam_zero", "sgd_accum", "adam_fp16m", "adam_zero_mp")


def test_onnxruntime_backend_two_ranks_equal_the_numpy_engine_in_one_process(tmp_path, monkeypatch) -> None:
    """The same data-parallel runs on the onnxruntime backend (its updates written in place where the graph
    allows, its gradient and update graphs run in turn): the weights of one numpy process on the whole
    batch, within 1e-5. Mixed precision rounds its float16 products differently on each runtime, so there
    the reference is one onnxruntime-backend process accumulating the ranks' halves."""
    pytest.importorskip("onnxruntime")
    out = tmp_path / "train_ort.npz"
    r = run_mpi("train", str(out), ",".join(ORT_CASES), timeout=240,
                env={"ONNXTRAIN_TEST_BACKEND": "onnxruntime"})
    assert r.returncode == 0, r.stdout + r.stderr
    assert "[W:onnxruntime:" not in r.stderr, r.stderr[-3000:]  # the graphs handed over are clean
    trained = dict(np.load(out))
    for case in ORT_CASES:
        if case in mpi_worker.HALVES:
            with monkeypatch.context() as m:
                m.setenv("ONNXTRAIN_TEST_BACKEND", "onnxruntime")
                ref, _ = mpi_worker.train(case, halves=True)
        else:
            ref, _ = mpi_worker.train(mpi_worker.reference_case(case), rank=0, size=1)
        for r_ in range(2):
            for k, v in ref.get_model_state()["full_precision"].items():
                err = rel_err(trained[f"{case}/{r_}/{k}"], v)
                assert err <= 1e-5, f"{case} rank {r_} {k}: relative error {err:.3g}"


def test_zero_stage1_partitions_optimizer_state(trained: dict[str, np.ndarray]) -> None:
    ref, _ = mpi_worker.train("adam", rank=0, size=1)
    total = sum(a.nbytes for d in ref.get_optimizer_state().values() for a in d.values())
    per_rank = [int(trained[f"adam_zero/{r}/optimizer_state_bytes"]) for r in range(2)]
    print(f"ZeRO-1 optimizer-state bytes per rank {per_rank} of {total} in total "
          f"({[round(b / total, 3) for b in per_rank]})")
    for b in per_rank:
        assert abs(b / total - 0.5) < 0.05
    assert all(int(trained[f"sgd_zero/{r}/optimizer_state_bytes"]) == 0 for r in range(2))


@pytest.fixture(scope="module")
def collectives(tmp_path_factory: pytest.TempPathFactory) -> dict[str, np.ndarray]:
    out = tmp_path_factory.mktemp("mpi") / "collectives.npz"
    r = run_mpi("collectives", str(out), timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    return dict(np.load(out))


def test_helpers_for_other_training_loops(collectives: dict[str, np.ndarray]) -> None:
    d = collectives
    for r in range(2):
        np.testing.assert_array_equal(d[f"helpers/{r}/world"], [r, 2, r, 2])
        # two ranks on this host: each rank's OpenBLAS and engine get half of its CPUs (at least one), not
        # all of them (oversubscribed, a data-parallel MLP step took 100 ms against 10)
        blas, width, cpus = d[f"helpers/{r}/threads"]
        chosen = os.environ.get("OPENBLAS_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")  # then kept
        assert width == max(1, cpus // 2), (width, cpus)
        assert blas in (int(chosen) if chosen else width, -1), (blas, width, cpus)
        np.testing.assert_array_equal(d[f"helpers/{r}/shard"], [4 * r, 4 * r + 4])
        for k in ("avg", "inplace"):
            assert d[f"helpers/{r}/{k}0"].dtype == np.float32 and d[f"helpers/{r}/{k}1"].dtype == np.float64
            np.testing.assert_array_equal(d[f"helpers/{r}/{k}0"], 1.5)
            np.testing.assert_array_equal(d[f"helpers/{r}/{k}1"], 15.0)


def test_adasum_matches_float64_reference(collectives: dict[str, np.ndarray]) -> None:
    from onnxtrain.parallel.adasum import adasum_reference

    d = collectives
    for dt, tol in (("float32", 1e-6), ("float64", 1e-13)):
        n = len([k for k in d if k.startswith(f"{dt}/in/0/")])
        ins = [[d[f"{dt}/in/{rank}/{i}"] for i in range(n)] for rank in range(2)]
        want = adasum_reference(ins)
        for i, w in enumerate(want):
            for rank in range(2):
                got = d[f"{dt}/out/{rank}/{i}"]
                assert got.dtype == np.dtype(dt) and got.shape == w.shape
                if w.size:
                    assert rel_err(got, w) <= tol, f"{dt} tensor {i} rank {rank}: {rel_err(got, w):.3g}"
            np.testing.assert_array_equal(d[f"{dt}/out/0/{i}"], d[f"{dt}/out/1/{i}"])
        np.testing.assert_array_equal(want[-1], 0.0)  # two zero vectors sum to zero


@pytest.mark.parametrize("how", ["raise", "kill", "hang", "exit"])
def test_failing_rank_ends_the_job(how: str, tmp_path) -> None:
    from onnxtrain.checkpoint import load_checkpoint

    ckpt = tmp_path / "last.ckpt"
    t0 = time.perf_counter()
    # a hanging rank is caught by the other rank's collective timeout (set to 3 s by the worker)
    r = run_mpi(how, str(ckpt), timeout=60, env={"ONNXTRAIN_MPI_TIMEOUT": "20"})
    took = time.perf_counter() - t0
    assert r.returncode != 0
    assert took < 30, f"the job took {took:.1f} s to end"
    assert "finished without noticing" not in r.stdout
    if how == "raise":
        assert "rank 1 fails on purpose" in r.stderr and "aborting all ranks" in r.stderr
    if how == "exit":  # sys.exit(4) on rank 1 inside abort_on_error() ends the job at once
        assert r.returncode == 4 and "exit status 4; aborting all ranks" in r.stderr, (r.returncode, r.stderr)
        assert took < 15, f"the job took {took:.1f} s to end"
    if how == "hang":
        # the watchdog aborts with code 3 after printing what it waited for; on MPI_Abort, mpiexec may
        # drop a rank's last stderr lines (seen in CI), so the code alone also shows it was the watchdog
        assert r.returncode == 3 or "did not complete within 3 s" in r.stderr, (r.returncode, r.stderr)
        if "did not complete" in r.stderr:
            assert "[rank 0/2]: ZeRO gradient reduce-scatter" in r.stderr
    last = load_checkpoint(ckpt)  # the last checkpoint written before the failure is whole
    assert 1 <= int(last.properties["step"]) <= 3 and sorted(last.trainable) == ["W1", "W2", "b1", "b2"]


def test_sizes_of_one_assigned_under_mpiexec(tmp_path) -> None:
    """``world_size = 1`` assigned under ``mpiexec -n 2``: each rank trains alone on its own data, as
    onnxruntime's legacy session did (it read MPI's sizes only for a world_size above 1), with a warning;
    ``data_parallel_size = 1``: the ranks train together (the world size wins), with a warning."""
    import json

    from onnxtrain import TrainingSession

    out = str(tmp_path / "sizes")
    r = run_mpi("sizes", out, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = {}
    for rank in (0, 1):
        with open(f"{out}.{rank}.json") as f:
            got[rank] = json.load(f)
    x, y = mpi_worker.batches(1, mpi_worker.GLOBAL_BATCH, din=mpi_worker.DIN)[0]
    alone = []
    for data in (x, 2 * x):  # rank 0's and rank 1's
        sess = TrainingSession(mlp_model(din=mpi_worker.DIN).SerializeToString(),
                               mpi_worker.params("SGDOptimizer", 1, 0, {}))
        sess.run(["loss"], {"x": data, "y": y, "Learning_Rate": mpi_worker.LR})
        alone.append(sess.get_state()["W1"])
    for rank in (0, 1):
        ws, dp = got[rank]["world_size"], got[rank]["data_parallel_size"]
        np.testing.assert_allclose(ws["W1"], alone[rank], rtol=1e-6, atol=1e-7)
        assert any("each rank trains alone" in m for m in ws["warnings"]), ws["warnings"]
        np.testing.assert_allclose(dp["W1"], (alone[0] + alone[1]) / 2, rtol=1e-6, atol=1e-7)
        assert any("data_parallel_size=1 does not equal world_size 2" in m for m in dp["warnings"]), dp
    assert not np.allclose(alone[0], alone[1], rtol=1e-3)


def test_mismatched_models_are_named() -> None:
    r = run_mpi("mismatch", timeout=60)
    assert r.returncode != 0
    assert "do not hold the same model" in r.stderr
    assert "trained weights (dtype, shape)" in r.stderr and "W1" in r.stderr



@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["allreduce", "zero"])
def test_float64_model_trains_in_float64_on_two_ranks(mode: str, tmp_path) -> None:
    """A float64 model (Adam, clipping on) on two ranks of half batches: the norms fetched are float64 and
    equal one process's on the whole batch, and so are the weights, to float64 precision (ZeRO fed and
    returned a float32 norm before)."""
    from tests.parallel import float64_worker

    out = tmp_path / f"{mode}.npz"
    worker = float64_worker.__file__
    r = run_mpi(mode, str(out), worker=worker, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = np.load(out)
    norms, weights = float64_worker.train("single")
    assert list(got["norm_dtypes"]) == ["<f8"] * 3
    np.testing.assert_allclose(got["norms"], np.stack(norms), rtol=1e-12)
    np.testing.assert_allclose(got["weights"], weights, rtol=1e-12)


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["pipeline", "horizontal"])
@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_float64_model_in_cut_sessions_clips_with_a_float64_norm(mode: str, backend: str, tmp_path) -> None:
    """A float64 model with clipping in a 2-stage pipeline or split horizontally: the norm fed to each
    rank's update is of the type its graph declares (onnxruntime refused the float32 norm these sessions
    fed: "Actual: (tensor(float)), expected: (tensor(double))"), and equals one process's."""
    if backend == "onnxruntime":
        pytest.importorskip("onnxruntime")
    from tests.parallel import float64_cut_worker

    out = tmp_path / "norms.npz"
    r = run_mpi(mode, backend, str(out), worker=float64_cut_worker.__file__, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    got = np.load(out)
    assert list(got["dtypes"]) == ["<f8"] * 3
    want = np.stack(float64_cut_worker.train("single", "numpy"))
    np.testing.assert_allclose(got["norms"], want, rtol=1e-9)


@pytest.mark.mpi
def test_zero_state_with_a_one_element_piece_round_trips(tmp_path) -> None:
    """Rank 0 holds one element of W2: its step counter (shape [1], as the piece) was taken for a moment,
    so gather_state() gave Update_Count_W2 in W2's shape and no session (ZeRO or one process, the CLI's
    --resume) loaded it. Oracle: one process trained on the whole batch."""
    from tests.parallel import zero_piece_worker as wk

    out = tmp_path / "state"
    r = run_mpi(str(out), worker=wk.__file__, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr
    ranks = [np.load(f"{out}.{k}.npz") for k in range(2)]
    for got in ranks:
        assert got["update_count_w2"].shape == (1,) and int(got["update_count_w2"][0]) == 4
        assert got["update_count_w1"].shape == (1,)
        assert bool(got["zero_load"])
    from onnxtrain import TrainingSession
    from tests.session.helpers import params

    one = TrainingSession(wk.model_bytes(), params("AdamOptimizer"))
    x, y = wk.batch()
    for _ in range(4):
        loss = one.run(["loss"], {"x": x, "y": y, "Learning_Rate": wk.LR})[0]
    np.testing.assert_allclose(ranks[0]["one_loss"], loss, rtol=1e-5)
