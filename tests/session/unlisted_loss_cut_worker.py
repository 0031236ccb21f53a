"""``mpiexec -n 2 python unlisted_loss_cut_worker.py`` (run by test_legacy_ort116_unlisted_loss): the model of
that test, whose loss is no output, in a two-stage pipeline session; prints, on rank 0, one JSON line: the
session class, get_outputs()' names, and per step run(None)'s values and then run(["loss", "yo"])'s."""

from __future__ import annotations

import json
import os
import sys
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from tests.session.test_legacy_ort116_unlisted_loss import STEPS, cut_parameters, run_steps  # noqa: E402


def main() -> None:
    import onnxtrain
    from onnxtrain.capi._pybind_state import get_mpi_context_world_rank

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        result = run_steps(onnxtrain, cut_parameters(onnxtrain), STEPS)
    if get_mpi_context_world_rank() == 0:
        print(json.dumps(result))


if __name__ == "__main__":
    main()
