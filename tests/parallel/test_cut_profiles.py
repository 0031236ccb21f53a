"""Pipelined and horizontally split sessions write a profile of their own graphs' nodes.

One ``mpiexec -n 2`` run of a script (written here) per backend: a two-stage pipeline and a two-way
horizontal split of the same MLP, two steps each, ``end_profiling()`` on every rank; each rank records the
op names of its trace and the files left in its folder. Both kinds of session wrote no trace before (the
pipelined one warned that it records none).
"""

from __future__ import annotations

import json
import os

import pytest

from tests.parallel.conftest import run_mpi

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SCRIPT = """
import json, os, sys
sys.path.insert(0, {root!r})
import numpy as np
import onnxtrain
from mpi4py import MPI
from tests.session.helpers import batches, mlp_model, params
rank = MPI.COMM_WORLD.rank
out = {{}}
for kind, p in (("pipeline", params(pipeline_parallel_size=2)),
                ("horizontal", params(horizontal_parallel_size=2))):
    if kind == "pipeline":
        p.pipeline_cut_info_string = "hr"
    folder = os.path.join({folder!r}, f"{{kind}}{{rank}}")
    os.makedirs(folder)
    so = onnxtrain.SessionOptions()
    so.enable_profiling = True
    so.profile_file_prefix = os.path.join(folder, "prof_")
    if {backend!r} == "onnxruntime":
        so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
    sess = onnxtrain.TrainingSession(mlp_model(dh=16).SerializeToString(), p, so)
    for x, y in batches(2, 8):
        sess.run(["loss"], {{"x": x, "y": y, "Learning_Rate": np.array([0.1], np.float32)}})
    path = sess.end_profiling()
    with open(path) as f:
        events = [e for e in json.load(f) if e["cat"] == "Node"]
    out[kind] = {{"ops": sorted({{e["args"]["op_name"] for e in events}}), "files": os.listdir(folder),
                  "trace": os.path.basename(path), "ts": [e["ts"] for e in events]}}
with open(os.path.join({folder!r}, f"rank{{rank}}.json"), "w") as f:
    json.dump(out, f)
"""


@pytest.mark.mpi
@pytest.mark.parametrize("backend", ["numpy", "onnxruntime"])
def test_cut_sessions_write_a_profile_of_their_nodes(tmp_path, backend):
    script = tmp_path / "profile_cut.py"
    script.write_text(SCRIPT.format(root=ROOT, folder=str(tmp_path), backend=backend))
    proc = run_mpi(worker=str(script))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for rank in range(2):
        got = json.loads((tmp_path / f"rank{rank}.json").read_text())
        for kind in ("pipeline", "horizontal"):
            g = got[kind]
            assert g["files"] == [g["trace"]], (rank, kind, g["files"])  # onnxruntime's own files folded in
            assert "onnxruntime" not in g["ops"] and g["ts"] == sorted(g["ts"]), (rank, kind, g["ops"])
            assert {"MatMul", "Gemm", "FusedGemm"} & set(g["ops"]), (rank, kind, g["ops"])
            # each rank's trace holds its update too: SGD's weight step
            assert "Sub" in g["ops"] or "Mul" in g["ops"], (rank, kind, g["ops"])
