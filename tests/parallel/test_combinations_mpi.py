"""Data-parallel options in combination on ``mpiexec -n 2``, against single-process references.

Exchange (allreduce, Adasum, ZeRO stage 1) × gradient accumulation (1, 3) × clipping × float16 mixed
precision × SGD / Adam / LAMB × numpy engine / onnxruntime backend × even, uneven or empty local parts ×
a frozen weight, for the legacy ``TrainingSession`` and the on-device ``Module``/``Optimizer`` (allreduce
only), and the legacy session's two accumulation protocols (``gradient_accumulation_mode`` "auto", and
"legacy": micro-steps fetching ``Group_Accumulated_Gradients``). The default suite runs a pairwise
selection (every pair of option values in some case) in one ``mpiexec`` a test; ``ONNXTRAIN_FULL_TESTS=1``
runs every combination (1536 legacy, 256 on-device; about 12 minutes).

Oracles, computed here in one process without MPI:

* allreduce and ZeRO: one session whose gradient is the ranks' average — for even float32 parts the
  session on the concatenated micro-batches; otherwise one session accumulating the ranks' parts as 2·A
  micro-batches (each part's mean gradient weighs 1/2 whatever its rows, as the README says the exchange
  weighs them; under mixed precision also the only reference with the same float16 products).
* Adasum: one session per rank on that rank's parts, its optimizer state its own; after each step both
  take the old weights plus a float64 numpy Adasum of the two deltas (written here from onnxruntime's
  ``adasum_interface.h``: per tensor, ``a·(1 − a·b/2‖a‖²) + b·(1 − a·b/2‖b‖²)``, a coefficient kept at 1
  when its squared norm is below sqrt(DBL_MIN)).

Tolerance 1e-5 relative per tensor: the ranks and the references sum the same float32 gradients in
another order (≈1e-7 relative a step); Adam's and LAMB's normalisation and the clip pass such differences
through with a gain of order one over the 3 steps, while a real fault (a part weighed by its rows, a
clip missed or applied twice, a micro-batch dropped, a rank's delta lost) moves the weights by 1e-2 or more.
Under float16 mixed precision 1e-3: master weights 3e-8 apart can round to float16 twins one half-ulp
apart (1e-3 of that element), and the next gradients then differ by up to 1e-4 (8e-5 measured on a
LAMB moment, 2 of the 768 combinations).
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from tests.parallel import combo_worker as cw
from tests.parallel.conftest import run_mpi
from tests.tiers import extended

pytestmark = pytest.mark.mpi

WORKER = cw.__file__
RTOL, RTOL_MP = 1e-5, 1e-3
_DBL_MIN_SQRT = float(np.sqrt(np.finfo(np.float64).tiny))


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def adasum_two(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Adasum of two ranks' vectors of one tensor, in float64 (onnxruntime's rule; rank 0's is ``a``)."""
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - 0.5 * dot / aa if aa >= _DBL_MIN_SQRT else 1.0
    cb = 1.0 - 0.5 * dot / bb if bb >= _DBL_MIN_SQRT else 1.0
    return ca * a + cb * b


def _selected(cases: list[cw.Case], sweep: str) -> list[cw.Case]:
    """``pairwise``: a few cases holding every pair of option values, and every 64th case (about 15 s in
    all); ``every``: all of them."""
    if sweep == "every":
        return cases
    chosen = cw.pairwise(cases)
    return chosen + [c for c in cases[::64] if c not in chosen]


SWEEPS = ["pairwise", extended("every", id="every")]


# ---- references -------------------------------------------------------------------------------------

def legacy_reference(case: cw.Case) -> list[dict[str, np.ndarray]]:
    """The state and norms each rank of ``case`` should end with (one dict a rank)."""
    if case.mode == "adasum":
        return _adasum_reference(case)
    data = cw.micro_batches(case.accum)
    whole = case.split == "even" and not case.mp
    ref_case = case if whole else cw.Case(**{**case.__dict__, "accum": 2 * case.accum})
    sess = cw.legacy_session(ref_case, data_parallel=False)
    if whole:
        feeds = list(data)
    else:  # each step: rank 0's parts of its micro-batches, then rank 1's
        feeds = [cw.part(data[s * case.accum + j], case.split, r)
                 for s in range(cw.STEPS) for r in (0, 1) for j in range(case.accum)]
    norms = []
    for i, xy in enumerate(feeds):
        n = cw.legacy_run(sess, xy, (i + 1) % ref_case.accum == 0)
        if n is not None:
            norms.append(n)
    want = {f"state/{k}": v for k, v in sess.get_state().items()}
    want["norms"] = np.asarray(norms)
    return [want, want]


def _adasum_reference(case: cw.Case) -> list[dict[str, np.ndarray]]:
    data = cw.micro_batches(case.accum)
    sessions = [cw.legacy_session(case, data_parallel=False) for _ in range(2)]
    norms: list[list[float]] = [[], []]
    old = sessions[0].get_model_state()["full_precision"]
    for s in range(cw.STEPS):
        new = []
        for r, sess in enumerate(sessions):
            for j in range(case.accum):
                n = cw.legacy_run(sess, cw.part(data[s * case.accum + j], case.split, r), j == case.accum - 1)
                if n is not None:
                    norms[r].append(n)
            new.append(sess.get_model_state()["full_precision"])
        combined = {}
        for w, o in old.items():
            deltas = [nw[w].astype(np.float64) - o.astype(np.float64) for nw in new]
            combined[w] = (o.astype(np.float64) + adasum_two(*deltas).reshape(o.shape)).astype(o.dtype)
        for sess in sessions:
            sess.load_state(combined)
        old = combined
    out = []
    for r, sess in enumerate(sessions):
        d = {f"state/{k}": v for k, v in sess.get_state().items()}
        d["norms"] = np.asarray(norms[r])
        out.append(d)
    return out


# ---- checks -----------------------------------------------------------------------------------------

def check_case(name: str, got: dict[str, np.ndarray], want: list[dict[str, np.ndarray]],
               own_state: bool, rtol: float) -> list[str]:
    """What differs between the ranks' results ``got`` and the references ``want`` (empty: all well).
    ``own_state``: each rank keeps optimizer state of its own (Adasum), so only the weights must agree."""
    bad = []
    for r in range(2):
        mine = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{name}/{r}/")}
        if sorted(mine) != sorted(want[r]):
            bad.append(f"rank {r}: keys {sorted(mine)} != {sorted(want[r])}")
            continue
        for k, v in want[r].items():
            g = mine[k]
            if g.shape != v.shape:
                bad.append(f"rank {r} {k}: shape {g.shape} != {v.shape}")
            elif not np.isfinite(g).all():
                bad.append(f"rank {r} {k}: not finite")
            elif v.dtype == np.float16:  # a half twin: derived from the master weights, one rounding
                if rel_err(g, v) > 1e-3:
                    bad.append(f"rank {r} {k}: relative error {rel_err(g, v):.3g}")
            elif g.size and rel_err(g, v) > rtol:
                bad.append(f"rank {r} {k}: relative error {rel_err(g, v):.3g}")
    # every rank holds the same weights, bit for bit (and, except under Adasum, the same optimizer state)
    for k in [k.split("/", 2)[2] for k in got if k.startswith(f"{name}/0/state/")]:
        if own_state and not k.startswith("state/W") and not k.startswith("state/b"):
            continue
        a, b = got[f"{name}/0/{k}"], got.get(f"{name}/1/{k}")
        if b is None or a.dtype != b.dtype or not np.array_equal(a, b):
            bad.append(f"{k}: ranks 0 and 1 differ")
    return [f"{name}: {m}" for m in bad]


def _run_worker(tmp_path, what: str, names: list[str], *extra: str, timeout: float) -> dict[str, np.ndarray]:
    out = tmp_path / f"{what}.npz"
    t0 = time.perf_counter()
    r = run_mpi(what, str(out), *extra, ",".join(names), worker=WORKER, timeout=timeout)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    print(f"mpiexec -n 2 {what}: {len(names)} cases in {time.perf_counter() - t0:.1f} s")
    return dict(np.load(out))


@pytest.mark.parametrize("sweep", SWEEPS)
def test_legacy_session_option_combinations(tmp_path, sweep: str) -> None:
    """Every selected combination on 2 ranks equals its single-process reference (weights, optimizer state,
    gathered ZeRO state, fetched global norms) and leaves both ranks with bit-identical weights."""
    pytest.importorskip("onnxruntime")
    cases = _selected(cw.legacy_cases(), sweep)
    got = _run_worker(tmp_path, "legacy", [c.name for c in cases], timeout=1800 if sweep == "every" else 240)
    bad = []
    for c in cases:
        bad += check_case(c.name, got, legacy_reference(c), own_state=c.mode == "adasum",
                          rtol=RTOL_MP if c.mp else RTOL)
    assert not bad, "\n".join(bad)


# ---- the on-device API ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def artifacts_root(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Artifacts of every kind the on-device cases train with (optimizer, clip, mixed precision, frozen)."""
    from onnxtrain import zoo
    from onnxtrain.training import artifacts, onnxblock

    root = tmp_path_factory.mktemp("combo_artifacts")
    model = zoo.mlp([cw.DIN, 16, cw.DOUT], seed=3, loss=False)
    names = [t.name for t in model.graph.initializer]
    kinds = {cw.artifacts_kind(c): c for c in cw.ondevice_cases()}
    for kind, c in kinds.items():
        clip = onnxblock.optim.ClipGradNorm(cw.CLIP) if c.clip else None
        kind_of = onnxblock.optim.AdamW if c.opt == "adamw" else onnxblock.optim.SGD
        block = kind_of(clip_grad=clip)
        frozen = [cw.ONDEVICE_FROZEN] if c.frozen else []
        (root / kind).mkdir()
        artifacts.generate_artifacts(model, requires_grad=[n for n in names if n not in frozen],
                                     frozen_params=frozen or None, loss=artifacts.LossType.CrossEntropyLoss,
                                     optimizer=block, artifact_directory=str(root / kind),
                                     mixed_precision="float16" if c.mp else None)
    return str(root)


def ondevice_reference(case: cw.Case, root: str) -> list[dict[str, np.ndarray]]:
    """One process: for even float32 parts the module on whole micro-batches; otherwise on each rank's
    parts in turn, the summed gradients then halved in place (the ranks' average) before the step."""
    state, module, opt = cw.open_ondevice(os.path.join(root, cw.artifacts_kind(case)), case.backend)
    whole = case.split == "even" and not case.mp
    finite = []
    for s, b in enumerate(cw.micro_batches(case.accum)):
        if whole:
            module(*b)
        else:
            for r in (0, 1):
                module(*cw.part(b, case.split, r))
        if (s + 1) % case.accum == 0:
            if not whole:
                for _, p in state.parameters:
                    if p.requires_grad and p.grad is not None:
                        g = p.grad  # the live buffer: the step reads it (README, on-device API)
                        g *= g.dtype.type(0.5)
            opt.step()
            finite.append(bool(opt.last_step_finite))
            module.lazy_reset_grad()
    want = {f"state/{k}": v for k, v in cw.ondevice_state(state).items()}
    want["finite"] = np.asarray(finite)
    return [want, want]


@pytest.mark.parametrize("sweep", SWEEPS)
def test_ondevice_option_combinations(tmp_path, artifacts_root: str, sweep: str) -> None:
    """The on-device Module and Optimizer (allreduce) in every selected combination on 2 ranks: the weights
    of one process with the averaged gradient, bit-identical on both ranks."""
    pytest.importorskip("onnxruntime")
    cases = _selected(cw.ondevice_cases(), sweep)
    got = _run_worker(tmp_path, "ondevice", [c.name for c in cases], artifacts_root,
                      timeout=1200 if sweep == "every" else 240)
    bad = []
    for c in cases:
        bad += check_case(c.name, got, ondevice_reference(c, artifacts_root), own_state=False,
                          rtol=RTOL_MP if c.mp else RTOL)
    assert not bad, "\n".join(bad)


# ---- checkpoints across world sizes -------------------------------------------------------------------

def _close(got: dict[str, np.ndarray], want: dict[str, np.ndarray], what: str) -> list[str]:
    if sorted(got) != sorted(want):
        return [f"{what}: names {sorted(got)} != {sorted(want)}"]
    return [f"{what} {k}: relative error {rel_err(got[k], v):.3g}" for k, v in want.items()
            if v.size and rel_err(got[k], v) > RTOL]


def _of(got: dict[str, np.ndarray], prefix: str) -> dict[str, np.ndarray]:
    return {k[len(prefix):]: v for k, v in got.items() if k.startswith(prefix)}


@pytest.mark.parametrize("name", ["zero-a3-clip-fp32-adam-numpy-even-frozen",
                                  "allreduce-a1-clip-fp32-lamb-ort-even-all"])
def test_legacy_checkpoint_moves_between_world_sizes(tmp_path, name: str) -> None:
    """A checkpoint written by rank 0 of 2 (ZeRO-1: from the gathered state, on every rank the whole state)
    resumes in one process, and one written by one process resumes on 2 ranks, both on the trajectory of
    one process that never stopped."""
    from onnxtrain.checkpoint import save_checkpoint
    from onnxtrain.train.state import optimizer_layout

    pytest.importorskip("onnxruntime")
    case, k = cw.Case.parse(name), cw.RESUME_STEPS
    alone, from_ranks = tmp_path / "alone.ckpt", tmp_path / "ranks.ckpt"
    ref = cw.legacy_session(case, data_parallel=False)
    cw.legacy_steps(ref, case, None, 0, k)
    at_k = ref.get_state()
    save_checkpoint(cw.legacy_checkpoint(ref, at_k, optimizer_layout(ref), k), alone)
    cw.legacy_steps(ref, case, None, k, 2 * k)
    final = ref.get_state()
    got = _run_worker(tmp_path, "resume", [name], str(from_ranks), str(alone), timeout=120)
    bad = []
    for r in range(2):
        bad += _close(_of(got, f"{name}/{r}/gathered/"), at_k, f"rank {r} gathered after {k}")
        bad += _close(_of(got, f"{name}/{r}/continued/"), final, f"rank {r} after {2 * k}")
        bad += _close(_of(got, f"{name}/{r}/resumed/"), final, f"rank {r} resumed from one process")
    for part in ("continued", "resumed"):
        for key, v in _of(got, f"{name}/0/{part}/").items():
            if not np.array_equal(v, got[f"{name}/1/{part}/{key}"]):
                bad.append(f"{part} {key}: ranks 0 and 1 differ")
    one = cw.legacy_session(case, data_parallel=False)
    cw.load_legacy_checkpoint(one, str(from_ranks))
    bad += _close(one.get_state(), at_k, "one process loading the ranks' checkpoint")
    cw.legacy_steps(one, case, None, k, 2 * k)
    bad += _close(one.get_state(), final, "one process resumed from the ranks' checkpoint")
    assert not bad, "\n".join(bad)


def test_ondevice_checkpoint_moves_between_world_sizes(tmp_path, artifacts_root: str) -> None:
    """The on-device API: rank 0's checkpoint of 2 ranks resumes in one process and one process's resumes
    on 2 ranks, on the trajectory of one process that never stopped."""
    from onnxtrain.training.api import CheckpointState

    name = "allreduce-a3-clip-fp32-adamw-numpy-even-frozen"
    case, k = cw.Case.parse(name), cw.RESUME_STEPS
    folder = os.path.join(artifacts_root, cw.artifacts_kind(case))
    alone, from_ranks = tmp_path / "alone.ckpt", tmp_path / "ranks.ckpt"
    state, module, opt = cw.open_ondevice(folder, case.backend)
    cw.ondevice_steps(module, opt, case, None, 0, k)
    CheckpointState.save_checkpoint(state, str(alone), include_optimizer_state=True)
    cw.ondevice_steps(module, opt, case, None, k, 2 * k)
    final = cw.ondevice_state(state)
    got = _run_worker(tmp_path, "resume_ondevice", [name], artifacts_root, str(from_ranks), str(alone),
                      timeout=120)
    bad = []
    for r in range(2):
        bad += _close(_of(got, f"{name}/{r}/continued/"), final, f"rank {r} after {2 * k}")
        bad += _close(_of(got, f"{name}/{r}/resumed/"), final, f"rank {r} resumed from one process")
    state, module, opt = cw.open_ondevice(folder, case.backend, str(from_ranks))
    cw.ondevice_steps(module, opt, case, None, k, 2 * k)
    bad += _close(cw.ondevice_state(state), final, "one process resumed from the ranks' checkpoint")
    assert not bad, "\n".join(bad)


# ---- a rank fed a bad batch -----------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["allreduce-a1-clip-fp32-adam-numpy-even-all",
                                  "zero-a3-clip-mp-adam-numpy-even-all",
                                  "adasum-a1-clip-fp32-lamb-ort-even-all", "ondevice"])
def test_rank_fed_a_bad_batch_ends_every_rank(tmp_path, artifacts_root: str, kind: str) -> None:
    """Rank 1 feeds x of the wrong width while rank 0 waits in the exchange: the job ends at once, non-zero,
    the error naming rank 1 and the input (not after the collective timeout, not hanging)."""
    folder = os.path.join(artifacts_root, "adamw-noclip-fp32-all")
    t0 = time.perf_counter()
    r = run_mpi("badfeed", str(tmp_path / "unused.npz"), kind, folder, worker=WORKER, timeout=90,
                env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    took = time.perf_counter() - t0
    assert r.returncode != 0, r.stdout + r.stderr
    assert "finished without noticing" not in r.stdout, r.stdout
    assert took < 45, f"the job took {took:.1f} s to end"
    assert "[rank 1/2]" in r.stderr and "aborting all ranks" in r.stderr, r.stderr[-3000:]
    assert "'x'" in r.stderr or '"x"' in r.stderr, r.stderr[-3000:]


@pytest.fixture(scope="module")
def rates(tmp_path_factory: pytest.TempPathFactory, artifacts_root: str) -> dict[str, np.ndarray]:
    """Every rank's outcome of updates where rank 1 uses twice rank 0's learning rate or loss scale, then
    the same (``combo_worker.different_rates``)."""
    return _run_worker(tmp_path_factory.mktemp("rates"), "rates", ["-"], artifacts_root, timeout=120)


def _stopped(got: dict[str, np.ndarray], checks: tuple[tuple[str, str], ...]) -> None:
    for key, name in checks:
        for r in range(2):
            text = str(got[f"{r}/{key}/True"])
            assert text.startswith(f"ValueError: {name}") and "the ranks fed different values" in text, \
                (r, key, text)
            assert str(got[f"{r}/{key}/False"]) == "ok", (r, key, str(got[f"{r}/{key}/False"]))


def test_zero_ranks_updating_with_different_rates_are_stopped(rates: dict[str, np.ndarray]) -> None:
    """ZeRO-1: rank 1 feeding twice rank 0's learning rate or loss scale raises on every rank before
    updating, as under allreduce (each rank updated its share of the weights with its own rate, or summed
    gradients of different loss scales, without a word); with equal values the updates go through."""
    _stopped(rates, (("zero/lr", "input 'Learning_Rate'"), ("zero/scale", "input 'loss_scale")))


def test_ondevice_ranks_updating_with_different_rates_are_stopped(rates: dict[str, np.ndarray]) -> None:
    """The on-device Optimizer: rank 1 with twice rank 0's learning rate (``set_learning_rate``) or loss
    scale (its Module's scaler) raises on every rank before updating; with equal values the updates go
    through. Before, each rank updated its replica at its own rate and the replicas parted silently."""
    _stopped(rates, (("allreduce/lr", "the learning rate"), ("allreduce/scale", "the loss scale")))
