"""The cut sessions' warnings point at the line of the script that built the session, as Python's own do.

One ``mpiexec -n 2`` run of a script (written here) that builds a pipelined session with options that warn
(a data_parallel_size that does not fit, Adasum with one replica) and a horizontal session of a
model with no MLP block; every rank writes where each warning pointed.
"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, sys, warnings
sys.path.insert(0, {root!r})
import numpy as np
from onnx import helper, numpy_helper
import onnxtrain
from tests.session.helpers import mlp_model, params

linear = helper.make_model(helper.make_graph(
    [helper.make_node("MatMul", ["x", "W"], ["y"]),
     helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)],
    "g", [helper.make_tensor_value_info("x", 1, [4, 3])], [helper.make_tensor_value_info("loss", 1, [])],
    [numpy_helper.from_array(np.ones((3, 2), np.float32), "W")]), opset_imports=[helper.make_opsetid("", 17)])
pipelined = params(pipeline_parallel_size=2, data_parallel_size=2, enable_adasum=True)
pipelined.pipeline_cut_info_string = "hr"
profiled = onnxtrain.SessionOptions()
profiled.enable_profiling = True
out = {{}}
with warnings.catch_warnings(record=True) as got:
    warnings.simplefilter("always")
    onnxtrain.TrainingSession(mlp_model().SerializeToString(), pipelined, profiled)  # PIPELINE
    onnxtrain.TrainingSession(linear.SerializeToString(), params(horizontal_parallel_size=2))  # HORIZONTAL
lines = open(__file__).read().splitlines()
from mpi4py import MPI
with open(f"{{__file__}}.{{MPI.COMM_WORLD.rank}}.json", "w") as f:
    json.dump([[w.filename == __file__ and lines[w.lineno - 1].split("# ")[-1], str(w.message)]
               for w in got], f)
"""


@pytest.mark.mpi
def test_cut_session_warnings_point_at_the_script(tmp_path):
    script = tmp_path / "build_sessions.py"
    script.write_text(SCRIPT.format(root=ROOT))
    proc = run_mpi(worker=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    want = {
        "data_parallel_size=2 times pipeline_parallel_size=2": "PIPELINE",
        "TrainingParameters.enable_adasum has no effect": "PIPELINE",
        "horizontal_parallel_size=2: no MLP or attention block": "HORIZONTAL",
    }
    for rank in range(2):
        got = json.loads((tmp_path / f"build_sessions.py.{rank}.json").read_text())
        where = {start: [at for at, msg in got if msg.startswith(start)] for start in want}
        assert where == {start: [at] for start, at in want.items()}, (rank, got)
