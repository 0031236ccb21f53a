"""Module-level names of onnxruntime's binding that ported scripts use (``ExecutionOrder``, the default
logger's settings, ``get_build_info``, the MPI context), and ``SessionOptions.optimized_model_filepath``."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest

import onnxtrain
from onnxtrain import InferenceSession, SessionOptions, TrainingSession
from onnxtrain.capi import _pybind_state as C
from onnxtrain.capi import runtime_info
from tests.session.helpers import batches, mlp_model, params


def test_execution_order_is_onnxruntimes_enum() -> None:
    assert {k: int(v) for k, v in onnxtrain.ExecutionOrder.__members__.items()} == {
        k: int(v) for k, v in ort.ExecutionOrder.__members__.items()}
    assert C.ExecutionOrder is onnxtrain.ExecutionOrder


@pytest.mark.parametrize("severity", [-1, 0, 2, 4, 5])
def test_logger_severity_takes_what_onnxruntime_takes(severity: int) -> None:
    """onnxruntime (the oracle) refuses a severity outside 0..4 with a RuntimeError; so does onnxtrain (a
    ValueError too), and it keeps the last valid one."""
    try:
        ort.set_default_logger_severity(severity)
        accepted = True
    except RuntimeError:
        accepted = False
    finally:
        ort.set_default_logger_severity(2)
    try:
        if accepted:
            onnxtrain.set_default_logger_severity(severity)
            assert runtime_info.default_logger_severity() == severity
        else:
            with pytest.raises(RuntimeError, match="severity") as e:
                onnxtrain.set_default_logger_severity(severity)
            assert isinstance(e.value, ValueError)
    finally:
        onnxtrain.set_default_logger_severity(2)
    with pytest.raises(TypeError, match="severity must be an int"):
        onnxtrain.set_default_logger_severity("3")


def test_logger_verbosity_and_build_info() -> None:
    ort.set_default_logger_verbosity(-1)  # onnxruntime takes any int
    onnxtrain.set_default_logger_verbosity(-1)
    onnxtrain.set_default_logger_verbosity(0)
    ort.set_default_logger_verbosity(0)
    info = onnxtrain.get_build_info()
    assert info.startswith(f"onnxtrain {onnxtrain.__version__}") and f"numpy {np.__version__}" in info


def test_mpi_context_outside_a_job_and_from_the_launchers_variables(monkeypatch) -> None:
    for var in ("PMI_SIZE", "PMI_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_RANK", "ONNXTRAIN_MPI",
                "MPI_LOCALNRANKS", "MPI_LOCALRANKID"):
        monkeypatch.delenv(var, raising=False)
    got = (C.get_mpi_context_world_rank(), C.get_mpi_context_world_size(), C.get_mpi_context_local_rank(),
           C.get_mpi_context_local_size())
    assert got == (0, 1, 0, 1)
    monkeypatch.setenv("PMI_SIZE", "4")
    monkeypatch.setenv("PMI_RANK", "3")
    monkeypatch.setenv("MPI_LOCALNRANKS", "2")
    monkeypatch.setenv("MPI_LOCALRANKID", "1")
    got = (C.get_mpi_context_world_rank(), C.get_mpi_context_world_size(), C.get_mpi_context_local_rank(),
           C.get_mpi_context_local_size())
    assert got == (3, 4, 1, 2)


def test_optimized_model_filepath_gets_the_graph_the_engine_runs(tmp_path) -> None:
    """onnxruntime wrote its optimized graph there; onnxtrain writes the graph its engine runs: a training
    session's training graph (the same as ``model_with_training_graph_path``), an inference session's
    model. Both pass the checker; the inference model gives onnxruntime's outputs."""
    so = SessionOptions()
    so.optimized_model_filepath = str(tmp_path / "training.onnx")
    p = params("AdamOptimizer", model_with_training_graph_path=str(tmp_path / "dump.onnx"))
    TrainingSession(mlp_model().SerializeToString(), p, so)
    written = onnx.load(so.optimized_model_filepath)
    onnx.checker.check_model(written, full_check=True)
    assert written.SerializeToString() == onnx.load(str(tmp_path / "dump.onnx")).SerializeToString()
    assert {"W1_grad", "Moment_1_W1"} <= {v for n in written.graph.node for v in (*n.input, *n.output)}

    so.optimized_model_filepath = str(tmp_path / "inference.onnx")
    model = mlp_model()
    model.graph.node.pop()  # the logits alone: no loss, no labels
    del model.graph.output[0]
    del model.graph.input[1]
    InferenceSession(model.SerializeToString(), so)
    written = onnx.load(so.optimized_model_filepath)
    onnx.checker.check_model(written, full_check=True)
    x, _ = batches(1, 5)[0]
    cpu = ["CPUExecutionProvider"]
    want = ort.InferenceSession(model.SerializeToString(), providers=cpu).run(None, {"x": x})
    got = ort.InferenceSession(written.SerializeToString(), providers=cpu).run(None, {"x": x})
    np.testing.assert_array_equal(got[0], want[0])


def test_ortvalue_dlpack_shares_memory_with_torch() -> None:
    """``OrtValue`` speaks DLPack as onnxruntime's does (the protocol, and the legacy ``to_dlpack`` /
    ``from_dlpack(data, is_bool_tensor)``): torch sees the same memory both ways."""
    torch = pytest.importorskip("torch")
    from onnxtrain import OrtValue

    v = OrtValue.ortvalue_from_numpy(np.arange(6, dtype=np.float32).reshape(2, 3))
    t = torch.from_dlpack(v)
    t[0, 0] = 7.0
    assert v.numpy()[0, 0] == 7.0
    t2 = torch.utils.dlpack.from_dlpack(v.to_dlpack())
    assert t2.shape == (2, 3) and t2.dtype == torch.float32 and float(t2[0, 0]) == 7.0
    src = torch.arange(4, dtype=torch.int64)
    w = OrtValue.from_dlpack(src.__dlpack__())  # a raw capsule, as the legacy frontends passed
    src[1] = 9
    assert w.numpy().tolist() == [0, 9, 2, 3] and w.data_type() == "tensor(int64)"
    flags = OrtValue.from_dlpack(torch.tensor([1, 0], dtype=torch.uint8), is_bool_tensor=True)
    assert flags.numpy().tolist() == [True, False] and flags.data_type() == "tensor(bool)"


_SEVERITY_SCRIPT = """
import sys, numpy as np
import onnxtrain
if sys.argv[1] != "default":
    onnxtrain.set_default_logger_severity(int(sys.argv[1]))   # before onnxruntime is imported
assert "onnxruntime" not in sys.modules
from onnx import helper, TensorProto as T
g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                      [helper.make_tensor_value_info("x", T.FLOAT, [2])],
                      [helper.make_tensor_value_info("y", T.FLOAT, [2])])
so = onnxtrain.SessionOptions()
so.add_session_config_entry("onnxtrain.backend", "onnxruntime")
s = onnxtrain.InferenceSession(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), so)
s.run(None, {"x": np.ones(2, np.float32)})
"""


def test_logger_severity_set_before_onnxruntime_is_imported_reaches_the_backend(tmp_path) -> None:
    """The usual order (the setting first, the backend imports onnxruntime later): the backend's sessions
    log at that severity (onnxruntime's verbose lines at 0, none by default)."""
    import subprocess
    import sys

    script = tmp_path / "severity.py"
    script.write_text(_SEVERITY_SCRIPT)
    verbose = {}
    for level in ("0", "default"):
        run = subprocess.run([sys.executable, str(script), level], capture_output=True, text=True,
                             timeout=120)
        assert run.returncode == 0, run.stderr
        verbose[level] = sum("[V:onnxruntime" in line for line in run.stderr.splitlines())
    assert verbose["0"] > 0 and verbose["default"] == 0, verbose
