"""``mpiexec -n 2 python bias_correction_cut_worker.py`` (run by test_legacy_ort116_bias_correction_values):
makes a two-stage pipeline session and a horizontally split session of test_legacy_ort116_unlisted_loss's
model with Adam's ``do_bias_correction`` set to 2 (refused) and to 1 (the control) for both weights; prints,
on rank 0, one JSON line: per mode and value, the error the session was refused with, or null."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.session.test_legacy_ort116_unlisted_loss import _model, _params  # noqa: E402


def attempt(mode: str, value: int) -> str | None:
    import onnxtrain

    p = onnxtrain.TrainingParameters()
    for k, v in _params("AdamOptimizer").items():
        setattr(p, k, v)
    p.optimizer_int_attributes_map = {w: {"do_bias_correction": value} for w in ("W", "G")}
    if mode == "pipeline":
        p.pipeline_parallel_size, p.pipeline_cut_info_string = 2, "a"
    else:
        p.horizontal_parallel_size = 2
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            onnxtrain.TrainingSession(_model().SerializeToString(), p)
    except ValueError as e:  # (every rank holds a weight with the value: each refuses it)
        return f"{type(e).__name__}: {e}"
    return None


def main() -> None:
    from onnxtrain.capi._pybind_state import get_mpi_context_world_rank

    modes = ("pipeline", "horizontal")
    result = {f"{mode} {value}": attempt(mode, value) for mode in modes for value in (2, 1)}
    if get_mpi_context_world_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
