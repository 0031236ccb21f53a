"""bench/gemm.py names the BLAS kernels and threads of the GEMM peak, with or without threadpoolctl: the
figures are set from outside (OPENBLAS_NUM_THREADS, OPENBLAS_CORETYPE in a fresh process) and read back."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _gemm_line(**env: str) -> dict:
    cmd = [sys.executable, os.path.join(REPO, "bench", "gemm.py"), "--n", "64", "--repeats", "1"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120, check=True,
                         env={**os.environ, **env}).stdout
    return json.loads(out.strip().splitlines()[-1])


@pytest.mark.parametrize("threads", ["1", "2"])
def test_gemm_line_names_threads_and_kernels(threads: str) -> None:
    import numpy as np

    if "openblas" not in str(np.__config__.CONFIG["Build Dependencies"]["blas"]["name"]):
        pytest.skip("numpy is not built with OpenBLAS")
    line = _gemm_line(OPENBLAS_NUM_THREADS=threads, OPENBLAS_CORETYPE="Haswell")
    assert line["threads"] == int(threads)
    assert str(line["kernels"]).lower() == "haswell"
    assert "0." in str(line["blas"])  # a version
