"""Training-step time of the legacy session over ``mpiexec -n 2`` against one process, in one run.

    python bench/parallel.py [--models mlp256,transformer32] [--rounds 5] [--steps 10]

For each model (exported by torch, as ``python -m bench`` does) the modes take turns in every round:
``one process`` on the whole batch; ``data parallel``, each rank on half of it; ``pipeline``, two stages cut
in the middle of the model with 4 micro-batches; ``horizontal``, the MLP blocks split over the two ranks
(models without a block that splits are skipped). A mode's figure is the median over the rounds of the
time per step (Adam, lr 1e-3); ``× one process`` is the one-process time over the mode's, so > 1 is
faster. Each step of every mode covers the same global batch.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the tensor that ends a model's first stage
CUTS = {
    "mlp256": "/model/net/net.2/Relu_output_0",
    "mlp64": "/model/net/net.2/Relu_output_0",
    "transformer32": "/model/layers.0/norm2/LayerNormalization_output_0",
    "gpt16": "/model/blocks.0/ln2/LayerNormalization_output_0",
}
MODES = ("one process", "data parallel", "pipeline", "horizontal")


def step_time(folder: str, mode: str, steps: int) -> float | None:
    """Seconds per training step of ``mode`` on the model in ``folder`` (run under mpiexec but for the
    first mode); None when the mode does not apply to the model."""
    import numpy as np
    import onnx

    from onnxtrain import TrainingParameters, TrainingSession
    from onnxtrain.parallel import world

    model = onnx.load(os.path.join(folder, "model_loss.onnx"))
    data = np.load(os.path.join(folder, "batches.npz"))
    inits = {t.name for t in model.graph.initializer}
    x_name, y_name = [i.name for i in model.graph.input if i.name not in inits][:2]
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = "AdamOptimizer"
    w = world()
    if mode == "pipeline":
        p.pipeline_parallel_size = 2
        p.num_pipeline_micro_batches = 4
        p.pipeline_cut_info_string = CUTS[os.path.basename(os.path.normpath(folder))]
    elif mode == "horizontal":
        p.horizontal_parallel_size = 2
    sess = TrainingSession(model.SerializeToString(), p)
    if mode == "horizontal" and not sess._blocks:
        return None
    lr = np.array([1e-3], np.float32)
    feeds = []
    for k in range(len(data.files) // 2):
        x, y = data[f"x{k}"], data[f"y{k}"]
        if mode == "data parallel":
            x, y = np.split(x, w.size)[w.rank], np.split(y, w.size)[w.rank]
        feeds.append({x_name: x, y_name: y, "Learning_Rate": lr})
    for k in range(3):
        sess.run(["loss"], feeds[k % len(feeds)])
    t0 = time.perf_counter()
    for k in range(steps):
        sess.run(["loss"], feeds[k % len(feeds)])
    return (time.perf_counter() - t0) / steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp256,transformer32")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--worker", nargs=2, metavar=("FOLDER", "MODE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker:
        t = step_time(args.worker[0], args.worker[1], args.steps)
        from onnxtrain.parallel import world

        if world().rank == 0:
            print(json.dumps({"seconds": t}))
        return
    from bench.models import CASES, prepare

    me = os.path.abspath(__file__)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    with tempfile.TemporaryDirectory() as tmp:
        for key in args.models.split(","):
            case = next(c for c in CASES if c.key == key)
            folder = os.path.join(tmp, key)
            os.makedirs(folder)
            prepare(case, folder)
            times: dict[str, list[float]] = {m: [] for m in MODES}
            for _ in range(args.rounds):
                for mode in MODES:
                    cmd = [sys.executable, me, "--worker", folder, mode, "--steps", str(args.steps)]
                    if mode != "one process":
                        cmd = ["mpiexec", "-n", "2", *cmd]
                    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
                    line = [x for x in out.stdout.splitlines() if x.startswith("{")]
                    if out.returncode or not line:
                        raise SystemExit(f"{key} {mode} failed:\n{out.stdout}\n{out.stderr}")
                    t = json.loads(line[-1])["seconds"]
                    if t is not None:
                        times[mode].append(t)
            one = statistics.median(times["one process"])
            print(f"{case.title} ({args.rounds} rounds of {args.steps} steps):")
            for mode, ts in times.items():
                if ts:
                    med = statistics.median(ts)
                    print(f"  {mode:14s} {med * 1e3:8.2f} ms/step   × one process {one / med:5.2f}")
                else:
                    print(f"  {mode:14s}        -   (no MLP block splits)")


if __name__ == "__main__":
    main()
