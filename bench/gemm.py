"""numpy's float32 GEMM throughput on this machine: the "peak" the training figures are a fraction of.

    python bench/gemm.py [--n 2048] [--repeats 7]     # prints one JSON line
    python bench/gemm.py --serve [--n 2048] [--repeats 3]   # one JSON line per "run" read from stdin

Square ``n×n`` float32 matmuls into a preallocated output; the figure is the best of the repeats (a peak,
not a typical value: the machine may be shared). Set ``OPENBLAS_CORETYPE`` before starting Python to
pick OpenBLAS's kernels; the line names the kernels and threads in use (threadpoolctl, when installed).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import math
import os
import sys
import time
from typing import TextIO

import numpy as np


def blas() -> dict[str, object]:
    """The BLAS numpy uses: name and version, the kernels (OpenBLAS's core type) and its thread count, from
    threadpoolctl or, without it, from the OpenBLAS library loaded in this process; {} when neither tells."""
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        return _openblas_info()
    for i in threadpool_info():
        if i.get("user_api") == "blas":
            return {
                "blas": f"{i.get('internal_api')} {i.get('version')}",
                "kernels": i.get("architecture"),
                "threads": i.get("num_threads"),
            }
    return {}


def _openblas_info() -> dict[str, object]:
    """What threadpoolctl would say of an OpenBLAS that numpy loaded, asked through its C functions (their
    names carry scipy-openblas's prefix and suffix in numpy's wheels)."""
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f if "openblas" in line.lower() and "/" in line})
    except OSError:
        return {}
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas_", "64_"), ("scipy_openblas_", ""), ("openblas_", "")):
            if not hasattr(lib, f"{prefix}get_num_threads{suffix}"):
                continue
            threads = getattr(lib, f"{prefix}get_num_threads{suffix}")
            threads.restype = ctypes.c_int
            core = getattr(lib, f"{prefix}get_corename{suffix}")
            core.restype = ctypes.c_char_p
            config = getattr(lib, f"{prefix}get_config{suffix}")
            config.restype = ctypes.c_char_p
            words = config().decode().split()
            return {"blas": " ".join(words[:2]), "kernels": core().decode(), "threads": threads()}
    return {}


def _operands(n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    a = rng.standard_normal((n, n), np.float32)
    b = rng.standard_normal((n, n), np.float32)
    c = np.empty((n, n), np.float32)
    np.matmul(a, b, out=c)  # warm-up: OpenBLAS's threads and buffers
    return a, b, c


def _best(a: np.ndarray, b: np.ndarray, c: np.ndarray, repeats: int) -> float:
    best = math.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        np.matmul(a, b, out=c)
        best = min(best, time.perf_counter() - t0)
    return 2 * a.shape[0] ** 3 / best / 1e9


def gemm_gflops(n: int = 2048, repeats: int = 7) -> float:
    return _best(*_operands(n), repeats)


def serve(n: int, repeats: int, lines: TextIO, out: TextIO) -> None:
    """A probe kept alive through a bench run: for each ``run`` line read, one JSON line with the best
    of ``repeats`` products (GFLOP/s); ``quit`` or the end of input stops it. Sampled once a round, it
    gives the GEMM rate the machine offered next to the peers' samples of that round."""
    a, b, c = _operands(n)
    for line in lines:
        cmd = line.strip()
        if cmd == "quit":
            return
        if cmd != "run":
            raise SystemExit(f"gemm.py --serve: unknown command {cmd!r} (expected 'run' or 'quit')")
        out.write(json.dumps({"gflops": _best(a, b, c, repeats)}) + "\n")
        out.flush()


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--n", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--serve", action="store_true", help="answer 'run' lines on stdin until 'quit'")
    a = p.parse_args(argv)
    if a.serve:
        serve(a.n, a.repeats, sys.stdin, sys.stdout)
        return
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
