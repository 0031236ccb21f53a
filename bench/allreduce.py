"""Gradient exchange of a transformer-sized parameter set against raw mpi4py Allreduce of the same bytes.

    python bench/allreduce.py [--layers 12] [--d 768] [--vocab 30522] [--repeats 7] [-n 2]

spawns ``mpiexec -n 2`` on itself (or run it under ``mpiexec`` directly). The parameter set is a
BERT/GPT-style encoder: per layer Q, K, V, O projections [d, d] with biases, two LayerNorms, the
feed-forward [d, 4d] and [4d, d] with biases; plus token and position embeddings. Default: BERT-base
sizes, about 110 M float32 parameters (440 MB).

Peers, interleaved in every repeat (median of repeats quoted):
* ``onnxtrain``: ``BucketReducer.reduce`` as the session calls it — every gradient copied and scaled
  by 1/D into the flat buckets (16 MB each by default), one Allreduce per bucket, views returned;
* ``allreduce_gradients``: the in-place helper for the on-device API (adds the copy back);
* ``raw``: one ``comm.Allreduce(IN_PLACE, buf)`` over a single buffer of the same bytes;
* ``raw in buckets``: the same buffer reduced in bucket-sized Allreduce calls, no copies (the floor).
The ratio quoted is raw time / our time (1.0 = as fast as raw MPI; target ≥ 0.9). MPICH reduces one
huge message through a temporary buffer of its size, which is why bucketing beats a single call.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np  # noqa: E402


def transformer_shapes(layers: int, d: int, vocab: int, positions: int = 512) -> list[tuple[int, ...]]:
    shapes: list[tuple[int, ...]] = [(vocab, d), (positions, d), (d,), (d,)]
    for _ in range(layers):
        shapes += [(d, d), (d,)] * 4 + [(d,), (d,)] + [(d, 4 * d), (4 * d,), (4 * d, d), (d,)] + [(d,), (d,)]
    return shapes


def run(args: argparse.Namespace) -> None:
    from onnxtrain.parallel import BucketReducer, allreduce_gradients, get_communicator

    comm = get_communicator()
    shapes = transformer_shapes(args.layers, args.d, args.vocab)
    rng = np.random.default_rng(comm.rank)
    grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
    nbytes = sum(g.nbytes for g in grads)
    bucket = args.bucket_mb << 20
    red = BucketReducer(comm, shapes, [np.float32] * len(shapes), bucket)
    raw = np.zeros(nbytes // 4, np.float32)
    mpi = comm.MPI

    def ours() -> None:
        red.reduce(grads, 1.0 / comm.size)

    def inplace() -> None:
        allreduce_gradients(grads, comm=comm, bucket_bytes=bucket)

    def rawmpi() -> None:
        comm.comm.Allreduce(mpi.IN_PLACE, raw, op=mpi.SUM)

    step = bucket // 4
    pieces = [raw[i:i + step] for i in range(0, raw.size, step)]

    def rawchunks() -> None:
        for p in pieces:
            comm.comm.Allreduce(mpi.IN_PLACE, p, op=mpi.SUM)

    peers = {"onnxtrain": ours, "allreduce_gradients": inplace, "raw": rawmpi, "raw in buckets": rawchunks}
    times: dict[str, list[float]] = {k: [] for k in peers}
    for f in peers.values():  # warm-up
        f()
    for _ in range(args.repeats):
        for name, f in peers.items():
            comm.barrier()
            t0 = time.perf_counter()
            f()
            dt = time.perf_counter() - t0
            times[name].append(comm.comm.allreduce(dt, op=mpi.MAX))
    if comm.rank == 0:
        med = {k: statistics.median(v) for k, v in times.items()}
        print(f"{comm.size} ranks, {len(shapes)} tensors, {nbytes / 1e6:.0f} MB of float32 gradients "
              f"({args.layers} layers, d={args.d}, vocab {args.vocab}); {len(red.chunks)} buckets")
        for k, v in med.items():
            print(f"  {k:20s} {v * 1e3:8.1f} ms  ({nbytes / v / 1e9:.2f} GB/s)   "
                  f"raw/this = {med['raw'] / v:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=12)
    ap.add_argument("--d", type=int, default=768)
    ap.add_argument("--vocab", type=int, default=30522)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--bucket-mb", type=int, default=16, help="bucket size in MiB")
    ap.add_argument("-n", type=int, default=2, help="ranks to spawn when not already under mpiexec")
    args = ap.parse_args()
    from onnxtrain.parallel import launched_by_mpi

    if not launched_by_mpi():
        cmd = ["mpiexec", "-n", str(args.n), sys.executable, os.path.abspath(__file__), *sys.argv[1:]]
        raise SystemExit(subprocess.call(cmd))
    run(args)


if __name__ == "__main__":
    main()
