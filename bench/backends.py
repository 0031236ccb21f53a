"""Training-step time of the legacy TrainingSession on each backend: numpy engine vs onnxruntime.

    python bench/backends.py [--batch 64] [--optimizer adam|sgd] [--repeats 7] [--threads N] [--quick]

The MLP 784-512-512-10 (ReLU, softmax cross-entropy in the graph, ``onnxtrain.zoo.mlp``) trained by the
same step graph (forward + backward + optimizer update) on both backends: the numpy engine (default) and
``onnxtrain.backend=onnxruntime`` (onnxruntime's inference package, state bound through IOBinding).
Each session cycles over the same 4 seeded batches. Peers are interleaved, median of the repeats after a
warm-up (bench/common.py); the figure quoted is onnxruntime's samples/s over the numpy engine's.
``--threads N`` caps both: onnxruntime's intra-op threads and numpy's BLAS (through threadpoolctl); on a
loaded machine, multi-threaded OpenBLAS slows down far more than onnxruntime, so quote both settings.
Both backends share this process, so onnxruntime's idle threads do not spin here (spinning, they took the
cores from numpy's BLAS: numpy step 11.4 ms instead of about 2.5); ``python -m bench`` runs each backend in
a process of its own, with onnxruntime's default threading.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
from bench.common import compare, fmt_time  # noqa: E402 - run from a checkout
from onnxtrain import SessionOptions, TrainingParameters, TrainingSession, zoo  # noqa: E402
from onnxtrain.engine.backends import BACKENDS, CONFIG_KEY  # noqa: E402
from onnxtrain.engine.ort_plan import SPIN_KEY  # noqa: E402

SIZES = [784, 512, 512, 10]
OPTIMIZERS = {"adam": "AdamOptimizer", "sgd": "SGDOptimizer"}


def make_step(backend: str, batch: int, optimizer: str, threads: int = 0, n_batches: int = 4):
    """A zero-argument callable running one training step of a fresh session on ``backend``."""
    p = TrainingParameters()
    p.loss_output_name = "loss"
    p.training_optimizer_name = OPTIMIZERS[optimizer]
    so = SessionOptions()
    so.add_session_config_entry(CONFIG_KEY, backend)
    if backend == "onnxruntime":  # in this process its idle threads would spin while numpy's BLAS works
        so.add_session_config_entry(SPIN_KEY, "0")
    so.intra_op_num_threads = threads
    sess = TrainingSession(zoo.mlp(SIZES, seed=0), p, so)
    rng = np.random.default_rng(1)
    lr = np.array([1e-3], np.float32)
    feeds = [{"x": rng.standard_normal((batch, SIZES[0])).astype(np.float32),
              "y": rng.integers(0, SIZES[-1], batch), "Learning_Rate": lr} for _ in range(n_batches)]
    k = [0]

    def step() -> None:
        sess.run(["loss"], feeds[k[0] % n_batches])
        k[0] += 1

    return step


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="adam")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=0, help="threads of each backend (0: their defaults)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 5 short repeats")
    a = ap.parse_args(argv)
    limit = contextlib.nullcontext()
    if a.threads:
        try:
            from threadpoolctl import threadpool_limits
        except ImportError:
            print("--threads needs threadpoolctl (pip install threadpoolctl) to cap numpy's BLAS")
            return 1
        limit = threadpool_limits(a.threads)
    try:
        import onnxruntime
    except ImportError:
        print("bench/backends.py: onnxruntime is not installed; skipped (pip install onnxruntime)")
        return 0
    with limit:
        peers = {b: make_step(b, a.batch, a.optimizer, a.threads) for b in BACKENDS}
        t = compare(peers, repeats=5 if a.quick else a.repeats, warmup=1 if a.quick else 3,
                    min_time=0.02 if a.quick else 0.2)
    threads = f"{a.threads} thread(s) each" if a.threads else "default threads"
    label = f"MLP {'-'.join(map(str, SIZES))}, batch {a.batch}, {OPTIMIZERS[a.optimizer]}, {threads}"
    print(f"{label} (onnxruntime {onnxruntime.__version__}, {os.cpu_count()} CPUs)")
    for b in BACKENDS:
        print(f"  {t[b]}  → {a.batch / t[b].median:,.0f} samples/s")
    ratio = t["numpy"].median / t["onnxruntime"].median
    print(f"onnxruntime backend / numpy engine, samples/s: {ratio:.2f}× "
          f"({fmt_time(t['onnxruntime'].median)} vs {fmt_time(t['numpy'].median)} per step)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
