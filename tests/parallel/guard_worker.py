"""Run under ``mpiexec -n 2``: the start-up and run-time guards of the MPI sessions.

``python guard_worker.py COMMAND [OUT.json]``:

* ``early`` — rank 1 raises before building a session, rank 0 builds a data-parallel one (it must not wait
  for rank 1 in ``MPI_Init`` for ever);
* ``pathnorm OUT.json`` — ``global_gradient_norm`` / ``all_gradients_finite`` fetched on the fetches' path
  alone under data parallelism (allreduce, ZeRO, a micro-step of "auto" accumulation, mixed precision with
  rank 1's gradients overflowing), each rank's values;
* ``world_rank MODE`` — an explicit ``world_rank`` contradicting MPI (``zero``: 0 on every rank;
  ``pipe_zero``: the same with pipeline stages; ``one``: 1 on every rank);
* ``setup OUT.json`` — attribute maps filled in another key order on each rank (accepted), and differing
  optimizer attributes (refused) in data-parallel, pipeline and horizontal sessions;
* ``feeds OUT.json`` — a wrong-shaped feed and a zero loss scale to pipeline and horizontal sessions (every
  rank's error), and the warnings of options without effect;
* ``norm OUT.json`` — ``global_gradient_norm`` of pipeline and horizontal sessions;
* ``rates OUT.json`` — allreduce steps whose ranks feed different learning rates or loss scales (every rank's
  error), then the same (each rank's weights after).
"""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import numpy as np  # noqa: E402

from onnxtrain import RunOptions, TrainingParameters, TrainingSession  # noqa: E402
from onnxtrain.parallel import get_communicator, split_batch, world  # noqa: E402
from tests.session.helpers import batches, mlp_model  # noqa: E402
from tests.session.helpers import params as session_params  # noqa: E402

LR = np.array([0.05], np.float32)
BATCH = 16
PIPE = {"pipeline_parallel_size": 2, "pipeline_cut_info_string": "hr", "num_pipeline_micro_batches": 2}
HORIZ = {"horizontal_parallel_size": 2}
WEIGHTS = ("W1", "b1", "W2", "b2")


def params(opt: str = "AdamOptimizer", **kw) -> TrainingParameters:
    return session_params(opt, **kw)


def model_bytes() -> bytes:
    return mlp_model(loss="mse").SerializeToString()


def data(steps: int = 2) -> list[tuple[np.ndarray, np.ndarray]]:
    return batches(steps, BATCH, loss="mse")


def path_norms() -> dict[str, object]:
    """This rank's values of each case (see the module docstring)."""
    ro = RunOptions()
    ro.only_execute_path_to_fetches = True
    out: dict[str, object] = {}
    (x, y), (x2, y2) = data()
    halves = {"x": split_batch(x), "y": split_batch(y)}
    for case, kw in (("allreduce", {}), ("zero", {"deepspeed_zero_stage": 1})):
        s = TrainingSession(model_bytes(), params(**kw))
        before = s.get_state()
        n, = s.run(["global_gradient_norm"], halves, ro)
        unchanged = all(np.array_equal(before[k], v) for k, v in s.get_state().items())
        step, = s.run(["global_gradient_norm"], {**halves, "Learning_Rate": LR})
        out[case] = [float(n), float(step), unchanged]
    # "auto" accumulation over 2 runs: the first run's norm (of the sums so far: the micro-path plan)
    auto = params(gradient_accumulation_steps=2, gradient_accumulation_mode="auto")
    s = TrainingSession(model_bytes(), auto)
    n1, = s.run(["loss", "global_gradient_norm"], {**halves, "Learning_Rate": LR})[1:]
    n2, = s.run(["global_gradient_norm"], {"x": split_batch(x2), "y": split_batch(y2), "Learning_Rate": LR})
    out["auto_micro"] = [float(n1), float(n2)]
    # mixed precision: only rank 1's gradients overflow
    s = TrainingSession(model_bytes(), params(use_mixed_precision=True))
    scale = {s.loss_scale_input_name: np.array([1024.0], np.float32)}
    yy = halves["y"] * (np.float32(3e4) if world().rank == 1 else np.float32(1))
    f, = s.run(["all_gradients_finite"], {"x": halves["x"], "y": yy, **scale}, ro)
    g, = s.run(["all_gradients_finite"], {"x": halves["x"], "y": yy, **scale, "Learning_Rate": LR})
    out["mp_flag"] = [bool(f), bool(g)]
    return out


def setup_cases() -> dict[str, str]:
    """Each case: "ok", or the error (its first 300 characters)."""
    rank = world().rank
    order = list(WEIGHTS) if rank == 0 else list(reversed(WEIGHTS))
    same = {w: {"lambda": 0.01, "alpha": 0.9} if rank == 0 else {"alpha": 0.9, "lambda": 0.01} for w in order}
    differ = {w: {"lambda": 0.01 * (rank + 1)} for w in WEIGHTS}
    frozen = {"W1"} if rank == 1 else set()  # which weights train: what a split cuts, what a stage updates
    out = {}
    for mode, kw in (("dp", {}), ("pipe", PIPE), ("horiz", HORIZ)):
        cases = [("order", "LambOptimizer", {"optimizer_attributes_map": same}),
                 ("differ", "LambOptimizer", {"optimizer_attributes_map": differ})]
        if mode != "dp":
            cases.append(("frozen", "SGDOptimizer", {"weights_not_to_train": frozen}))
        for what, opt, options in cases:
            try:
                TrainingSession(model_bytes(), params(opt, **options, **kw))
                out[f"{mode}/{what}"] = "ok"
            except RuntimeError as e:
                out[f"{mode}/{what}"] = str(e)[:300]
    return out


def feed_errors() -> dict[str, str]:
    x, y = data()[0]
    out = {}
    for mode, kw in (("pipe", PIPE), ("horiz", HORIZ)):
        s = TrainingSession(model_bytes(), params("SGDOptimizer", **kw))
        for what, feeds in (("y", {"x": x, "y": y[:, :1]}), ("x", {"x": x[:, :3], "y": y})):
            try:
                s.run(["loss"], {**feeds, "Learning_Rate": LR})
                out[f"{mode}/{what}"] = "accepted"
            except Exception as e:  # noqa: BLE001 - the test reads its type and message
                out[f"{mode}/{what}"] = f"{type(e).__name__}: {e}"
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            idle = params("SGDOptimizer", use_mixed_precision=True, loss_scale=8.0,
                          use_memory_efficient_gradient=True, **kw)
            s = TrainingSession(model_bytes(), idle)
        out[f"{mode}/warnings"] = " | ".join(str(w.message) for w in caught)
        try:
            s.run(["loss"], {"x": x, "y": y, "Learning_Rate": LR, "loss_scale": np.zeros(1, np.float32)})
            out[f"{mode}/loss_scale"] = "accepted"
        except Exception as e:  # noqa: BLE001 - the test reads its type and message
            out[f"{mode}/loss_scale"] = f"{type(e).__name__}: {e}"
    return out


def rate_errors() -> dict[str, str]:
    """Allreduce steps where rank 1 feeds another learning rate (or loss scale) than rank 0, then the same."""
    (x, y), _ = data()
    halves = {"x": split_batch(x), "y": split_batch(y)}
    out = {}
    rank = world().rank
    for case, kw in (("lr", {}), ("loss_scale", {"use_mixed_precision": True})):
        s = TrainingSession(model_bytes(), params(**kw))
        feeds = {**halves, "Learning_Rate": LR * np.float32(1 + (case == "lr") * rank)}
        if s.loss_scale_input_name:
            feeds[s.loss_scale_input_name] = np.array([1024.0 * (1 + rank)], np.float32)
        try:
            s.run(["loss"], feeds)
            out[case] = "accepted"
        except Exception as e:  # noqa: BLE001 - the test reads its type and message
            out[case] = f"{type(e).__name__}: {e}"
        same = {**halves, "Learning_Rate": LR}
        if s.loss_scale_input_name:
            same[s.loss_scale_input_name] = np.array([1024.0], np.float32)
        s.run(["loss"], same)  # then the same values: the step goes through
        out[f"{case}/weights"] = [s.get_state()[w].tolist() for w in WEIGHTS]
    return out


def norms() -> dict[str, object]:
    (x, y), (x2, y2) = data()
    out: dict[str, object] = {}
    for mode, kw in (("pipe", PIPE), ("horiz", HORIZ)):
        s = TrainingSession(model_bytes(), params(**kw))
        names = [o.name for o in s.get_outputs()]
        first = s.run(["loss", "global_gradient_norm"], {"x": x, "y": y, "Learning_Rate": LR})
        second = s.run(["global_gradient_norm"], {"x": x2, "y": y2, "Learning_Rate": LR})
        out[mode] = [names, float(first[1]), float(second[0])]
    return out


def zero_resume() -> dict[str, object]:
    """ZeRO stage 1: each rank resumes from its own part of the optimizer state (its get_optimizer_state()
    given to set_optimizer_initial_state) and the weights it saved; whether the resumed run ends where the
    uninterrupted one does."""
    import onnx
    from onnx import numpy_helper

    batches_ = data(4)

    def step(s: TrainingSession, i: int) -> None:
        x, y = batches_[i]
        s.run(["loss"], {"x": split_batch(x), "y": split_batch(y), "Learning_Rate": LR})

    whole = TrainingSession(model_bytes(), params(deepspeed_zero_stage=1))
    first = TrainingSession(model_bytes(), params(deepspeed_zero_stage=1))
    for i in range(4):
        step(whole, i)
    for i in range(2):
        step(first, i)
    model = onnx.load_from_string(model_bytes())
    weights = first.get_model_state()["full_precision"]
    for t in model.graph.initializer:
        if t.name in weights:
            t.CopyFrom(numpy_helper.from_array(weights[t.name], t.name))
    p = params(deepspeed_zero_stage=1)
    p.set_optimizer_initial_state(first.get_optimizer_state())  # this rank's part only
    resumed = TrainingSession(model.SerializeToString(), p)
    for i in range(2, 4):
        step(resumed, i)
    a, b = whole.get_model_state()["full_precision"], resumed.get_model_state()["full_precision"]
    return {"same": all(np.array_equal(a[k], b[k]) for k in a)}


def main() -> None:
    what = sys.argv[1]
    out_path = sys.argv[2] if len(sys.argv) > 2 else ""
    w = world()
    if what == "early":
        if w.rank == 1:
            raise FileNotFoundError("rank 1 fails on purpose before building its session")
        TrainingSession(model_bytes(), params())
        print("rank 0 built its session", flush=True)
        return
    if what == "world_rank":
        mode = sys.argv[2]
        p = params(**(PIPE if mode.startswith("pipe") else {}))
        p.world_rank = 1 if mode == "one" else 0
        TrainingSession(model_bytes(), p)
        print(f"rank {w.rank} built its session", flush=True)
        return
    result = {"pathnorm": path_norms, "setup": setup_cases, "feeds": feed_errors, "norm": norms,
              "zero_resume": zero_resume, "rates": rate_errors}[what]()
    everyone = get_communicator().allgather_object(result, "gathering the results")
    if w.rank == 0:
        with open(out_path, "w") as f:
            json.dump(everyone, f)


if __name__ == "__main__":
    main()
