"""The guards of the MPI sessions: a rank failing before MPI starts, the global norm and finiteness flag on
the fetches' path under data parallelism, the start-up check of the setup (key order, optimizer attributes),
feed shapes and the global norm in pipeline and horizontal sessions, an explicit ``world_rank``."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import pytest

from onnxtrain import RunOptions, TrainingSession
from onnxtrain.errors import InvalidFeed
from onnxtrain.parallel import World, check_world_options
from onnxtrain.parallel.fingerprint import canonical
from onnxtrain.session_parallel import fingerprint
from tests.parallel.conftest import run_mpi
from tests.parallel.guard_worker import LR, WEIGHTS, data, model_bytes, params

GUARD_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "guard_worker.py")


def guarded(command: str, tmp_path, timeout: float = 180.0) -> list[dict]:
    """Every rank's results of ``guard_worker.py command``."""
    out = tmp_path / f"{command}.json"
    r = run_mpi(command, str(out), timeout=timeout, worker=GUARD_WORKER)
    assert r.returncode == 0, r.stdout + r.stderr
    with open(out) as f:
        return json.load(f)


@pytest.mark.mpi
def test_rank_failing_before_mpi_starts_ends_the_job() -> None:
    """Rank 1 raises before building its session, so before MPI starts; rank 0 starts MPI in its session.
    Before the fix rank 0 waited in MPI_Init for ever (no watchdog yet): now rank 1's uncaught exception
    starts MPI and aborts every rank."""
    t0 = time.perf_counter()
    r = run_mpi("early", timeout=90, worker=GUARD_WORKER)
    took = time.perf_counter() - t0
    assert r.returncode != 0
    assert took < 60, f"the job took {took:.1f} s to end"
    assert "rank 1 fails on purpose" in r.stderr and "aborting all ranks" in r.stderr, r.stderr


def _one_process_norms() -> dict[str, list[float]]:
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    (x, y), (x2, y2) = data()
    s = TrainingSession(model_bytes(), params())
    path, = s.run(["global_gradient_norm"], {"x": x, "y": y}, ro)
    auto = TrainingSession(
        model_bytes(), params(gradient_accumulation_steps=2, gradient_accumulation_mode="auto")
    )
    n1 = auto.run(["loss", "global_gradient_norm"], {"x": x, "y": y, "Learning_Rate": LR})[1]
    n2, = auto.run(["global_gradient_norm"], {"x": x2, "y": y2, "Learning_Rate": LR})
    return {"path": [float(path)], "auto_micro": [float(n1), float(n2)]}


@pytest.mark.mpi
def test_path_norm_and_flag_are_the_ranks_under_data_parallelism(tmp_path) -> None:
    """``global_gradient_norm`` fetched on the fetches' path alone is the norm of the averaged gradients (as
    in the step, one process's on the whole batch), on every rank, and updates nothing; so is a micro-step's
    under "auto" accumulation; ``all_gradients_finite`` is false on every rank when one rank's overflow.
    Before the fix each rank returned its own half-batch norm (0.78 and 0.91 against 0.59 in the audit)."""
    ranks = guarded("pathnorm", tmp_path)
    ref = _one_process_norms()
    for rank, got in enumerate(ranks):
        for case in ("allreduce", "zero"):
            path, step, unchanged = got[case]
            assert unchanged, f"rank {rank} {case}: the path run changed the state"
            np.testing.assert_allclose(path, ref["path"][0], rtol=1e-6, err_msg=f"rank {rank} {case}")
            np.testing.assert_allclose(path, step, rtol=1e-6, err_msg=f"rank {rank} {case}")
        np.testing.assert_allclose(got["auto_micro"], ref["auto_micro"], rtol=1e-6, err_msg=f"rank {rank}")
        assert got["mp_flag"] == [False, False], f"rank {rank}: {got['mp_flag']}"


def test_setup_fingerprint_ignores_key_order() -> None:
    """Equal attribute maps filled in another order (as by iterating a set, whose order follows each
    process's hash seed) give the same fingerprint; different values do not."""
    import onnx

    from onnxtrain.optim import get_optimizer
    from onnxtrain.training_graph import build_step_graphs

    a, b = {"b": {"y": 1, "x": {2, 1}}, "a": [1, 2]}, {"a": [1, 2], "b": {"x": {1, 2}, "y": 1}}
    assert canonical(a) == canonical(b)
    assert canonical({"a": [1, 2]}) != canonical({"a": [2, 1]})
    model = onnx.load_from_string(model_bytes())
    prints = []
    for order in (WEIGHTS, tuple(reversed(WEIGHTS))):
        attrs = {w: {"lambda": 0.01, "alpha": 0.9} for w in order}
        p = params("LambOptimizer", optimizer_attributes_map=attrs)
        prints.append(fingerprint(model, build_step_graphs(model, p, get_optimizer("LambOptimizer")), p))
    assert prints[0] == prints[1]


@pytest.mark.mpi
def test_setup_check_order_and_optimizer_attributes(tmp_path) -> None:
    """Maps in another key order on each rank are accepted (before: the data-parallel session aborted); maps
    with other values are refused, naming the option, in pipeline and horizontal sessions too (before:
    accepted there); so are weights frozen on one rank only."""
    for rank, got in enumerate(guarded("setup", tmp_path)):
        for mode, what in (("dp", "training"), ("pipe", "pipeline"), ("horiz", "horizontal")):
            assert got[f"{mode}/order"] == "ok", (rank, mode, got[f"{mode}/order"])
            refused = got[f"{mode}/differ"]
            assert f"do not hold the same model and {what} setup" in refused, (rank, refused)
            assert "optimizer_attributes_map" in refused, (rank, refused)
            if mode != "dp":  # weights frozen on one rank only (before: a horizontal split died in MPI)
                assert "weights_not_to_train" in got[f"{mode}/frozen"], (rank, got[f"{mode}/frozen"])


@pytest.mark.mpi
def test_cut_sessions_check_feed_shapes_on_every_rank(tmp_path) -> None:
    """A feed whose fixed dimension differs from the model's is an InvalidFeed naming the input and the
    dimension on every rank, as in one process (before: y [16, 1] for [N, 4] broadcast silently, a wrong x
    failed inside the engine, on the stage reading it only)."""
    x, y = data()[0]
    single = TrainingSession(model_bytes(), params("SGDOptimizer"))
    with pytest.raises(InvalidFeed, match="input 'y': dimension 1 must be 4, got 1"):
        single.run(["loss"], {"x": x, "y": y[:, :1], "Learning_Rate": LR})
    for rank, got in enumerate(guarded("feeds", tmp_path)):
        for mode in ("pipe", "horiz"):
            for name, want in (("y", "dimension 1 must be 4, got 1"), ("x", "dimension 1 must be 8, got 3")):
                assert got[f"{mode}/{name}"].startswith(f"InvalidFeed: input '{name}': {want}"), (rank, got)
            # as in one process: a zero loss scale refused (it made NaN weights), idle options warned
            refused = "ValueError: input 'loss_scale': the loss scale must"
            assert got[f"{mode}/loss_scale"].startswith(refused), got
            assert "loss_scale has no effect" in got[f"{mode}/warnings"], got
            assert "use_memory_efficient_gradient has no effect" in got[f"{mode}/warnings"], got


@pytest.mark.mpi
def test_cut_sessions_output_the_global_norm(tmp_path) -> None:
    """With clipping on, pipeline and horizontal sessions list ``global_gradient_norm`` and return the whole
    model's norm, one process's on the whole batch (before: "unknown output")."""
    (x, y), (x2, y2) = data()
    s = TrainingSession(model_bytes(), params())
    want = [o.name for o in s.get_outputs()]
    ref = [float(s.run(["global_gradient_norm"], {"x": x, "y": y, "Learning_Rate": LR})[0]),
           float(s.run(["global_gradient_norm"], {"x": x2, "y": y2, "Learning_Rate": LR})[0])]
    for rank, got in enumerate(guarded("norm", tmp_path)):
        for mode in ("pipe", "horiz"):
            names, n1, n2 = got[mode]
            assert names == want, (rank, mode, names)
            np.testing.assert_allclose([n1, n2], ref, rtol=2e-6, err_msg=f"rank {rank} {mode}")


@pytest.mark.mpi
@pytest.mark.parametrize("mode", ["zero", "pipe_zero", "one"])
def test_world_rank_contradicting_mpi_ends_the_job(mode: str) -> None:
    """An explicit world_rank (0 included: set, it is not the default's "take it from MPI") that is not the
    rank MPI gives is an error naming the option, and the job ends promptly (``one``: rank 0 raised before
    starting MPI, and rank 1 waited in MPI_Init for ever)."""
    t0 = time.perf_counter()
    r = run_mpi("world_rank", mode, timeout=90, worker=GUARD_WORKER)
    took = time.perf_counter() - t0
    assert r.returncode != 0, r.stdout + r.stderr
    assert took < 60, f"the job took {took:.1f} s to end"
    rank = 0 if mode == "one" else 1
    assert f"TrainingParameters.world_rank={1 - rank} but MPI says this is rank {rank}" in r.stderr, r.stderr


def test_world_rank_checks() -> None:
    """world_rank without mpiexec must be 0; under MPI an assigned one must be the rank's (0 included)."""
    p = params()
    check_world_options(p, World(0, 1, 0, 1))
    check_world_options(p, World(1, 2, 1, 2))  # unset: MPI's rank
    p.world_rank = 0
    check_world_options(p, World(0, 2, 0, 2))
    with pytest.raises(ValueError, match="world_rank=0 but MPI says this is rank 1"):
        check_world_options(p, World(1, 2, 1, 2))
    p.world_rank = 1
    check_world_options(p, World(1, 2, 1, 2))
    with pytest.raises(ValueError, match=r"world_rank=1, but this process was not started.*mpiexec -n 2"):
        check_world_options(p, World(0, 1, 0, 1))
    with pytest.raises(ValueError, match="world_rank=1, but this process was not started by mpiexec"):
        TrainingSession(model_bytes(), p)


@pytest.mark.parametrize(
    "key, value",
    [("world_size", 0), ("world_size", -3), ("data_parallel_size", 0), ("horizontal_parallel_size", 0),
     ("pipeline_parallel_size", -1), ("world_rank", -2)],
)
def test_impossible_sizes_are_refused_by_name(key: str, value: int) -> None:
    """A rank count below 1 (or a rank below -1) is an error naming the property, not a run of one rank."""
    p = params()
    setattr(p, key, value)
    with pytest.raises(ValueError, match=f"TrainingParameters.{key}={value}: a"):
        TrainingSession(model_bytes(), p)


def test_world_rank_minus_one_is_unset() -> None:
    """ort_trainer's create_ort_training_session_with_optimizer passed world_rank=-1 by default: one process
    trains as with the rank unset, and under MPI each rank takes its own."""
    p = params()
    p.world_rank = -1
    check_world_options(p, World(1, 2, 1, 2))
    x, y = data(1)[0]
    a = TrainingSession(model_bytes(), p).run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
    b = TrainingSession(model_bytes(), params()).run(["loss"], {"x": x, "y": y, "Learning_Rate": LR})
    assert a[0].tobytes() == b[0].tobytes()


def test_setup_fingerprint_holds_the_initial_optimizer_state() -> None:
    """Ranks given different ``set_optimizer_initial_state`` (rank 0 alone restoring it) trained apart with
    no error; the start-up check now compares it: equal states agree, different ones differ by that key."""
    import onnx

    from onnxtrain.optim import get_optimizer
    from onnxtrain.training_graph import build_step_graphs

    model = onnx.load_from_string(model_bytes())
    w = WEIGHTS[0]
    shape = next(t.dims for t in model.graph.initializer if t.name == w)

    def print_of(moment: float | None) -> dict:
        p = params("AdamOptimizer")
        if moment is not None:
            p.set_optimizer_initial_state({w: {"Moment_1": np.full(shape, moment, np.float32)}})
        return fingerprint(model, build_step_graphs(model, p, get_optimizer("AdamOptimizer")), p)

    key = "initial optimizer state (set_optimizer_initial_state)"
    assert print_of(0.5) == print_of(0.5)
    for a, b in ((0.5, 0.25), (0.5, None)):
        pa, pb = print_of(a), print_of(b)
        assert pa[key] != pb[key] and {k for k in pa if pa[k] != pb[k]} == {key}


@pytest.mark.mpi
def test_zero_ranks_resume_from_their_own_optimizer_state_parts(tmp_path) -> None:
    """Under ZeRO each rank holds its part of the optimizer state and may be given that part alone: the
    start-up check compares the initial optimizer state under plain allreduce only (it refused these parts,
    which resume bit for bit)."""
    for rank, got in enumerate(guarded("zero_resume", tmp_path)):
        assert got["same"], rank


@pytest.mark.mpi
def test_ranks_feeding_different_learning_rates_are_stopped(tmp_path) -> None:
    """Under allreduce each rank updates its own replica with its own feeds: rank 1 feeding twice rank 0's
    learning rate (a rank-local schedule) made the weights part without a word (0.15 apart after 3 steps).
    Every rank now raises before updating; with the same values the step goes through, the replicas equal."""
    got = guarded("rates", tmp_path)
    for case, name in (("lr", "Learning_Rate"), ("loss_scale", "loss_scale")):
        for rank in got:
            assert rank[case].startswith(f"ValueError: input '{name}': the ranks fed different values"), rank
        assert got[0][f"{case}/weights"] == got[1][f"{case}/weights"]
