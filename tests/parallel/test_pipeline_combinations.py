"""Pipeline parallelism in combination on ``mpiexec -n 2`` (two stages), against one process.

Micro-batches a run (1, 2, 4) × gradient accumulation over runs (1, 2, and 2 under onnxruntime's protocol:
the runs that do not update fetch ``Group_Accumulated_Gradients``) × clipping × float16 mixed precision ×
SGD / Adam / LAMB × numpy engine / onnxruntime backend × the cut (after a MatMul, after an activation, a cut
tensor read by two later nodes, a skip connection crossing the cut, a BatchNormalization or a seeded Dropout
in each stage) × frozen weights (one weight of the first stage, or all of them). The default suite runs a
pairwise selection (every pair of option values in some case) in one ``mpiexec``; ``ONNXTRAIN_FULL_TESTS=1``
runs every combination (3600; 25 minutes on 2 shared cores).

Oracle: one session on the uncut model, in one process, with ``gradient_accumulation_steps = micro ×
accum`` (and the same protocol) fed the same micro-batches, one run each (README "Pipeline parallelism";
spec §4.3: the update takes the mean of the micro-batches' gradients). Every rank must return the loss and
logits of each run's last micro-batch and the update's global norm, as that process's last micro-step
does; the eval runs (forward only, training mode off, mid-accumulation and at the end) its logits and loss
on the whole batch; the gathered state its state, and each rank's ``get_state()`` its stage's part of it.

Tolerance 1e-5 relative per tensor in float32: the stages sum the global norm's squares in float64 and
the weights' gradients in another float32 order than one graph does (≈1e-7 relative a step; LAMB's trust
ratio and the clip pass that through with a gain of order one over the few steps), while a real fault (a
micro-batch dropped or counted twice, a mean over the wrong count, a clip missed, a stage's norm left out
of the global one) moves the weights by 1e-2 or more. Under float16 mixed precision 1e-3: a master weight
1 ulp apart can round to a float16 twin one half-ulp apart (1e-3 of that element). On the onnxruntime
backend under mixed precision 3e-3: onnxruntime computes MatMul and Gemm in float32 and drops the casts to
float16 in front of them (the backend's warning), so one process's graph may skip the float16 rounding of
the cut tensor that the first stage sends as float16: one half-ulp (5e-4) of an activation, up to 8.4e-4
in a second moment over the combinations.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from tests.parallel import pipeline_combo_worker as pw
from tests.parallel.conftest import run_mpi
from tests.tiers import extended

pytestmark = pytest.mark.mpi

WORKER = pw.__file__
RTOL, RTOL_MP, RTOL_MP_ORT = 1e-5, 1e-3, 3e-3
SWEEPS = ["pairwise", extended("every", id="every")]


def rel_err(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def tolerance(case: pw.Case) -> float:
    if not case.mp:
        return RTOL
    return RTOL_MP_ORT if case.backend == "ort" else RTOL_MP


def _selected(sweep: str) -> list[pw.Case]:
    cases = pw.cases()
    return cases if sweep == "every" else pw.pairwise(cases)


# ---- the reference ---------------------------------------------------------------------------------------

def one_process(case: pw.Case, sess=None, first: int = 0, last: int | None = None) -> dict[str, np.ndarray]:
    """What every rank should fetch and hold after runs ``first`` .. ``last - 1`` of ``case`` (keys as
    :func:`pipeline_combo_worker.train_pipeline`'s, ``own/`` aside): one session accumulating the runs'
    micro-batches, one ``run()`` each."""
    sess = pw.session(case, False) if sess is None else sess
    last = case.runs if last is None else last
    losses, logits, norms = [], [], []
    out: dict[str, np.ndarray] = {}
    for i, feeds in enumerate(pw.run_batches(case.runs)[first:last], start=first):
        parts = [{n: np.split(v, case.micro)[k] for n, v in feeds.items()} for k in range(case.micro)]
        for k, part in enumerate(parts):
            got = pw.train_run(sess, case, part, k == case.micro - 1 and (i + 1) % case.accum == 0)
        losses.append(got[0])
        logits.append(got[1])
        if len(got) > 2:
            norms.append(got[2])
        if i == first:
            out["eval_mid_logits"], out["eval_mid_loss"] = pw.eval_run(sess)
    out["eval_logits"], out["eval_loss"] = pw.eval_run(sess)
    out["losses"], out["logits"] = np.asarray(losses), np.asarray(logits)
    out["norms"] = np.asarray(norms, np.float64)
    out.update({f"state/{k}": v for k, v in sess.get_state().items()})
    return out


# ---- checks ----------------------------------------------------------------------------------------------

def _close(got: np.ndarray, want: np.ndarray, rtol: float) -> str | None:
    if got.shape != want.shape:
        return f"shape {got.shape} != {want.shape}"
    if got.dtype.kind == "f" and not np.isfinite(got).all():
        return "not finite"
    if want.dtype.kind == "f" and want.size:
        tol = max(rtol, 1e-3) if want.dtype == np.float16 else rtol  # a half twin: one rounding of its master
        err = rel_err(got, want)
        return f"relative error {err:.3g}" if err > tol else None
    return None if np.array_equal(got, want) else "differs"


def check_case(name: str, got: dict[str, np.ndarray], want: dict[str, np.ndarray], rtol: float) -> list[str]:
    """What differs between the ranks' results ``got`` and the reference ``want`` (empty: all well)."""
    bad = []
    owned: set[str] = set()
    for r in range(2):
        mine = {k.split("/", 2)[2]: v for k, v in got.items() if k.startswith(f"{name}/{r}/")}
        own = {k[len("own/"):]: v for k, v in mine.items() if k.startswith("own/")}
        mine = {k: v for k, v in mine.items() if not k.startswith("own/")}
        if sorted(mine) != sorted(want):
            bad.append(f"rank {r}: keys {sorted(set(mine) ^ set(want))} differ")
            continue
        for k, v in want.items():
            msg = _close(mine[k], v, rtol)
            if msg:
                bad.append(f"rank {r} {k}: {msg}")
        for k, v in own.items():  # the stage's own part of the state: the same values under the same names
            ref = want.get(f"state/{k}")
            msg = "not a state name of one process" if ref is None else _close(v, ref, rtol)
            if msg:
                bad.append(f"rank {r} own {k}: {msg}")
        owned |= set(own)
    missing = sorted({k[len("state/"):] for k in want if k.startswith("state/")} - owned)
    if missing:
        bad.append(f"no stage's get_state() holds {missing}")
    for k in [k.split("/", 2)[2] for k in got if k.startswith(f"{name}/0/")]:
        if k.startswith(("state/", "eval", "losses", "logits", "norms")):  # every rank returns the same
            a, b = got[f"{name}/0/{k}"], got.get(f"{name}/1/{k}")
            if b is None or not np.array_equal(a, b):
                bad.append(f"{k}: ranks 0 and 1 differ")
    return [f"{name}: {m}" for m in bad]


def _run_worker(tmp_path, what: str, *args: str, timeout: float, env: dict[str, str] | None = None
                ) -> dict[str, np.ndarray]:
    out = tmp_path / f"{what}.npz"
    t0 = time.perf_counter()
    r = run_mpi(what, str(out), *args, worker=WORKER, timeout=timeout, env=env)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    print(f"mpiexec -n 2 {what}: {time.perf_counter() - t0:.1f} s")
    return dict(np.load(out))


@pytest.mark.parametrize("sweep", SWEEPS)
def test_pipeline_option_combinations(tmp_path, sweep: str) -> None:
    """Every selected combination on two stages fetches, evaluates and ends as one process accumulating
    the micro-batches, and both ranks return and gather the same values."""
    pytest.importorskip("onnxruntime")
    cases = _selected(sweep)
    got = _run_worker(tmp_path, "train", ",".join(c.name for c in cases),
                      timeout=7200 if sweep == "every" else 240)
    bad = []
    for c in cases:
        bad += check_case(c.name, got, one_process(c), tolerance(c))
    assert not bad, "\n".join(bad)


# ---- a stage's state to and from one process ---------------------------------------------------------------

def _part(got: dict[str, np.ndarray], name: str, segment: str) -> dict[str, np.ndarray]:
    """``got``'s results of one segment of a resume run, under ``check_case``'s keys."""
    out = {}
    for r in range(2):
        prefix = f"{name}/{r}/{segment}/"
        out.update({f"{name}/{r}/{k[len(prefix):]}": v for k, v in got.items() if k.startswith(prefix)})
    return out


RESUMED = ["bn-m2-a2-clip-mp-adam-numpy-w1", "skip-m4-a1-clip-fp32-lamb-ort-all",
           "cross-m2-a2-noclip-fp32-sgd-numpy-s0"]


@pytest.mark.parametrize("name", RESUMED)
def test_stage_state_moves_to_and_from_one_process(tmp_path, name: str) -> None:
    """After half the updates the gathered state of the two stages (as a dict, and as a checkpoint of
    ``onnxtrain.checkpoint``) resumes in one process, and one process's (dict and checkpoint) resumes on the
    two stages, each loaded strictly: every continuation ends where one process that never stopped
    ends."""
    from onnxtrain.checkpoint import load_checkpoint, save_checkpoint
    from onnxtrain.train.state import checkpoint_to_state, optimizer_layout

    pytest.importorskip("onnxruntime")
    case = pw.Case.parse(name)
    rtol = tolerance(case)
    half = case.runs // 2
    ref = pw.session(case, False)
    first = one_process(case, ref, 0, half)
    np.savez(tmp_path / "alone.npz", **ref.get_state())
    save_checkpoint(pw.checkpoint_of(ref, case, ref.get_state()), tmp_path / "alone.ckpt")
    final = one_process(case, ref, half)
    got = _run_worker(tmp_path, "resume", str(tmp_path), name, timeout=120)
    bad = [f"first half, {m}" for m in check_case(name, _part(got, name, "first"), first, rtol)]
    for segment in ("continued", "resumed", "checkpoint"):
        bad += [f"{segment}, {m}" for m in check_case(name, _part(got, name, segment), final, rtol)]
    for how in ("npz", "ckpt"):
        one = pw.session(case, False)
        if how == "npz":
            one.load_state(dict(np.load(tmp_path / "from_ranks.npz")), strict=True)
        else:
            one.load_state(checkpoint_to_state(load_checkpoint(tmp_path / "from_ranks.ckpt"), one,
                                               one.get_state(), optimizer_layout(one)), strict=True)
        for k, v in first.items():
            if k.startswith("state/") and (msg := _close(one.get_state()[k[6:]], v, rtol)):
                bad.append(f"one process loading the stages' {how}: {k}: {msg}")
        for k, v in one_process(case, one, half).items():
            if msg := _close(v, final[k], rtol):
                bad.append(f"one process resumed from the stages' {how}: {k}: {msg}")
    assert not bad, "\n".join(bad)


# ---- a rank fed a bad batch ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind, rank, names", [
    ("width", 1, "'x'"),  # rank 1's x too wide: refused by its feed check, rank 0 in its stage's exchange
    ("rows", 0, "'x'"),  # rank 0's batch does not divide into the micro-batches
    ("label", 1, ""),  # the labels out of range: only the last stage's loss reads them
])
def test_rank_fed_a_bad_batch_ends_both_stages(tmp_path, kind: str, rank: int, names: str) -> None:
    """One rank's run fails on its feeds while the other waits for it in the pipeline's exchange: the job
    ends at once (not after the exchange's timeout, not hanging), non-zero, the error naming the rank (and
    the input)."""
    t0 = time.perf_counter()
    r = run_mpi("badfeed", str(tmp_path / "unused.npz"), "skip-m4-a1-clip-fp32-adam-numpy-all", kind,
                worker=WORKER, timeout=90, env={"ONNXTRAIN_MPI_TIMEOUT": "60"})
    took = time.perf_counter() - t0
    assert r.returncode != 0, r.stdout + r.stderr
    assert "finished without noticing" not in r.stdout, r.stdout
    assert took < 45, f"the job took {took:.1f} s to end"
    assert f"[rank {rank}/2]" in r.stderr and "aborting all ranks" in r.stderr, r.stderr[-3000:]
    assert names in r.stderr, r.stderr[-3000:]
