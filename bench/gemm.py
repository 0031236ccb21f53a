"""numpy's float32 GEMM throughput on this machine: the "peak" the training figures are a fraction of.

    python bench/gemm.py [--n 2048] [--repeats 7]     # prints one JSON line

Square ``n×n`` float32 matmuls into a preallocated output; the figure is the best of the repeats (a peak,
not a typical value: the machine may be shared). Set ``OPENBLAS_CORETYPE`` before starting Python to
pick OpenBLAS's kernels; the line names the kernels and threads in use (threadpoolctl, when installed).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time

import numpy as np


def blas() -> dict[str, object]:
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return {}
    for i in threadpool_info():
        if i.get("user_api") == "blas":
            return {
                "blas": f"{i.get('internal_api')} {i.get('version')}",
                "kernels": i.get("architecture"),
                "threads": i.get("num_threads"),
            }
    return {}


def gemm_gflops(n: int = 2048, repeats: int = 7) -> float:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * n**3 / best / 1e9


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    a = p.parse_args(argv)
    print(
        json.dumps(
            {
                "gflops": gemm_gflops(a.n, a.repeats),
                "n": a.n,
                "coretype": os.environ.get("OPENBLAS_CORETYPE", ""),
                **blas(),
            }
        )
    )


if __name__ == "__main__":
    main()
