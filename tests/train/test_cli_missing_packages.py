"""The CLI without one of the packages it needs (blocked from importing in a fresh process, as if absent):
one line naming the package and the pip command, not a traceback; a package that only a part of the run
needs does not stop the rest (tqdm when no bar is shown, matplotlib for the plot: the model is still
exported); no mpi4py under an MPI launcher: rank 0 says so once."""

from __future__ import annotations

import os
import subprocess
import sys

import onnxruntime
import pytest

from tests.train.conftest import config_path

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_BLOCKED_RUN = r"""
import sys
blocked = sys.argv[1]

class Block:
    def find_spec(self, name, path=None, target=None):
        if name == blocked or name.startswith(blocked + "."):
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None

sys.meta_path.insert(0, Block())
from onnxtrain.cli import main
sys.exit(main(sys.argv[2:]))
"""


def _run_without(package: str, args: list[str], **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("PMI_", "OMPI_", "MPI_", "PMIX_"))}
    clean.update(PYTHONPATH=REPO + os.pathsep + clean.get("PYTHONPATH", ""), OPENBLAS_NUM_THREADS="1", **env)
    clean.pop("ONNXTRAIN_DEBUG", None)
    return subprocess.run([sys.executable, "-c", _BLOCKED_RUN, package, *args], capture_output=True,
                          text=True, timeout=300, env=clean)


def _train(out, *extra: str) -> list[str]:
    return ["train", config_path("digits_mlp"), "--output-dir", str(out), "--set", "training.steps=4",
            "--set", "training.eval_every=4", *extra]


def test_no_tqdm_without_a_bar(tmp_path) -> None:
    r = _run_without("tqdm", _train(tmp_path / "run", "-q"))
    assert r.returncode == 0, r.stderr
    assert os.path.exists(tmp_path / "run" / "model.onnx")


def test_no_tqdm_with_a_bar_names_the_package(tmp_path) -> None:
    r = _run_without("tqdm", _train(tmp_path / "run"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "the Python package 'tqdm' cannot be imported" in lines[0] and "pip install tqdm" in lines[0]


def test_no_matplotlib_still_exports_the_model(tmp_path) -> None:
    """The run, its checkpoint and its model stand; a warning says the plot is missing and why."""
    r = _run_without("matplotlib", _train(tmp_path / "run", "-q"))
    assert r.returncode == 0, r.stderr
    assert "no plot (metrics.png): matplotlib cannot be imported" in r.stderr
    assert "pip install matplotlib" in r.stderr
    assert not os.path.exists(tmp_path / "run" / "metrics.png")
    summary = [line for line in r.stdout.splitlines() if line.startswith("outputs in")]
    assert summary and "metrics.png" not in summary[0] and "model.onnx" in summary[0], r.stdout
    model = str(tmp_path / "run" / "model.onnx")
    sess = onnxruntime.InferenceSession(model, providers=["CPUExecutionProvider"])  # a whole model
    assert [i.name for i in sess.get_inputs()]


def test_no_yaml_names_the_pip_package(tmp_path) -> None:
    r = _run_without("yaml", _train(tmp_path / "run", "-q"))
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert "'yaml' cannot be imported" in lines[0] and "pip install PyYAML" in lines[0]


@pytest.mark.parametrize("rank", ["0", "1"])
def test_no_mpi4py_under_a_launcher_says_so_once(tmp_path, rank: str) -> None:
    """As mpiexec starts a rank (its environment variables), without mpi4py: rank 0 prints one line naming
    mpi4py and the pip command, every rank exits 1 (a chained traceback, printed three times, before)."""
    r = _run_without("mpi4py", _train(tmp_path / "run", "-q"), PMI_SIZE="2", PMI_RANK=rank)
    assert r.returncode == 1
    lines = r.stderr.strip().splitlines()
    if rank == "0":
        assert len(lines) == 1, r.stderr
        assert "data parallelism needs mpi4py" in lines[0] and "pip install mpi4py mpich" in lines[0]
    else:
        assert lines == [], r.stderr


def test_repeated_fields_are_found_on_protobufs_with_and_without_is_repeated() -> None:
    """protobuf 6.31+ descriptors say ``is_repeated`` (7 has no ``label``); older ones only have ``label``
    (onnxtrain failed in every session on protobuf 5)."""
    from onnxtrain.ir.large import _repeated

    class Old:
        LABEL_OPTIONAL, LABEL_REPEATED = 1, 3

        def __init__(self, label: int) -> None:
            self.label = label

    import onnx

    fields = onnx.ModelProto.DESCRIPTOR.fields_by_name
    assert _repeated(fields["opset_import"]) and not _repeated(fields["graph"])
    assert _repeated(Old(3)) and not _repeated(Old(1))


def test_pip_hints_name_the_distribution() -> None:
    """Import names whose distribution is called otherwise: protobuf's google.protobuf, PyYAML's yaml."""
    from onnxtrain.cli import _missing_package

    for module, pip in (("google.protobuf.message", "protobuf"), ("yaml", "PyYAML"), ("tqdm", "tqdm")):
        line = _missing_package(ModuleNotFoundError(f"No module named {module!r}", name=module))
        assert line.endswith(f"pip install {pip}"), line


def test_commands_that_read_no_yaml_run_without_it(tmp_path) -> None:
    """``info`` and ``gradient-graph`` read only an ONNX model: they run without PyYAML (it stopped them);
    the gradient graph written runs on onnxruntime and gives d(sum(x·W))/dW = xᵀ·1."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2), "W")
    g = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["y"]),
                           helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    path = str(tmp_path / "m.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), path)
    r = _run_without("yaml", ["info", path])
    assert r.returncode == 0, r.stderr
    assert "MatMul" in r.stdout
    out = str(tmp_path / "grad.onnx")
    r = _run_without("yaml", ["gradient-graph", path, "--loss", "loss", "--wrt", "W", "-o", out])
    assert r.returncode == 0, r.stderr
    x = np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)
    sess = onnxruntime.InferenceSession(out, providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, {"x": x})))
    np.testing.assert_allclose(got["W_grad"], np.repeat(x.sum(0)[:, None], 2, axis=1), rtol=1e-6)
