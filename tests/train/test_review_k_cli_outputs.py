"""Review K of the CLI's subcommands other than ``train``: an -o/--output the command cannot write.

``export`` and ``gradient-graph`` (and ``artifacts`` into a folder that exists) found that they could not
write their output only at the end, after loading the checkpoint or building the gradients, and failed with
exit 1 and the operating system's words alone ('[Errno 13] Permission denied: ...'), naming no option,
where the same mistake in ``artifacts`` (a folder it cannot make) is refused at once as a bad command line
(exit 2, naming -o/--output). The oracle is the file system itself: creating a file in the folder fails."""

from __future__ import annotations

import os
import stat
import subprocess
import sys

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from tests.train.conftest import REPO, config_path


def _cannot_create_in(folder: str) -> bool:
    try:
        fd = os.open(os.path.join(folder, ".review_k_probe"), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600)
    except OSError:
        return True
    os.close(fd)
    os.unlink(os.path.join(folder, ".review_k_probe"))
    return False


@pytest.fixture
def unwritable(tmp_path):
    """A folder in which this process cannot create a file (a read-only one; for root, which writes in any
    folder whatever its mode, /sys where sysfs refuses new files); skipped when there is none."""
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        for candidate in (str(folder), "/sys"):
            if os.path.isdir(candidate) and _cannot_create_in(candidate):
                yield candidate
                return
        pytest.skip("no folder this process cannot write in")
    finally:
        folder.chmod(stat.S_IRWXU)


def _cli(*args: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "ONNXTRAIN_DEBUG"}
    return subprocess.run([sys.executable, "-m", "onnxtrain.cli", *args], capture_output=True, text=True,
                          cwd=REPO, env=env, timeout=300)


def _assert_refused(proc: subprocess.CompletedProcess, folder: str) -> None:
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    assert "Traceback" not in proc.stderr
    line, = proc.stderr.strip().splitlines()
    assert "-o/--output" in line and folder in line, line


def _loss_model(path: str) -> str:
    """loss = Σ relu(x·W): a model with its loss in the graph."""
    w = numpy_helper.from_array(np.arange(6, dtype=np.float32).reshape(3, 2) / 6, "W")
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("ReduceSum", ["r"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "m",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                          [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])], [w])
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    onnx.save(model, path)
    return path


@pytest.fixture(scope="module")
def run_folder(tmp_path_factory) -> str:
    """A two-step digits MLP run (a checkpoint to export)."""
    out = str(tmp_path_factory.mktemp("run") / "mlp")
    proc = _cli("train", config_path("digits_mlp"), "--set", "training.steps=2", "--set",
                "training.epochs=null", "--set", "model.args.sizes=[64,8,10]", "--set", "output.plot=false",
                "--output-dir", out, "-q")
    assert proc.returncode == 0, proc.stderr
    return out


def test_export_to_a_folder_it_cannot_write_in_names_the_option(run_folder, unwritable) -> None:
    target = os.path.join(unwritable, "model.onnx")
    proc = _cli("export", os.path.join(run_folder, "config.yaml"), "--checkpoint", run_folder, "-o", target)
    _assert_refused(proc, unwritable)
    assert not os.path.exists(target)


def test_gradient_graph_to_a_folder_it_cannot_write_in_names_the_option(tmp_path, unwritable) -> None:
    model = _loss_model(str(tmp_path / "m.onnx"))
    target = os.path.join(unwritable, "grad.onnx")
    proc = _cli("gradient-graph", model, "--loss", "loss", "--wrt", "W", "-o", target)
    _assert_refused(proc, unwritable)
    assert not os.path.exists(target)


def test_artifacts_into_a_folder_it_cannot_write_in_names_the_option(tmp_path, unwritable) -> None:
    model = _loss_model(str(tmp_path / "m.onnx"))
    proc = _cli("artifacts", model, "-o", unwritable)
    _assert_refused(proc, unwritable)
    assert not os.path.exists(os.path.join(unwritable, "training_model.onnx"))


def test_writable_outputs_are_still_written(tmp_path, run_folder) -> None:
    """The check refuses nothing that can be written, and leaves no file of its own behind."""
    model = _loss_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "out"
    out.mkdir()
    grad = str(out / "g.onnx")
    assert _cli("gradient-graph", model, "--loss", "loss", "--wrt", "W", "-o", grad).returncode == 0
    assert _cli("export", os.path.join(run_folder, "config.yaml"), "--checkpoint", run_folder, "-o",
                str(out / "e.onnx")).returncode == 0
    assert _cli("artifacts", model, "-o", str(out / "arts")).returncode == 0
    assert sorted(os.listdir(out)) == ["arts", "e.onnx", "g.onnx"]
    assert sorted(os.listdir(out / "arts")) == ["checkpoint", "eval_model.onnx", "training_model.onnx"]


@pytest.mark.parametrize(("flags", "taken"), [
    ([], "checkpoint"), ([], "eval_model.onnx"), (["--optimizer", "SGD"], "optimizer_model.onnx"),
    (["--nominal-checkpoint", "--prefix", "p_"], "p_nominal_checkpoint")])
def test_artifacts_where_an_artifact_file_is_a_folder_names_it(tmp_path, flags, taken) -> None:
    """A folder in -o's folder where one of the files written goes: refused before the work, naming it (it
    failed at the save with exit 1, '[Errno 21] Is a directory')."""
    model = _loss_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "arts"
    (out / taken).mkdir(parents=True)
    proc = _cli("artifacts", model, "-o", str(out), *flags)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line, = proc.stderr.strip().splitlines()
    assert "-o/--output" in line and str(out / taken) in line and "Traceback" not in line, line
    assert os.listdir(out) == [taken]


def test_artifacts_beside_a_folder_it_does_not_write_are_written(tmp_path) -> None:
    """A folder named as an artifact the command does not write (no --optimizer) is no obstacle."""
    model = _loss_model(str(tmp_path / "m.onnx"))
    out = tmp_path / "arts"
    (out / "optimizer_model.onnx").mkdir(parents=True)
    proc = _cli("artifacts", model, "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    assert sorted(os.listdir(out)) == ["checkpoint", "eval_model.onnx", "optimizer_model.onnx",
                                       "training_model.onnx"]


def _with_extras(path: str) -> str:
    """_loss_model plus an int64 initializer and a float one that the loss does not read."""
    model = onnx.load(_loss_model(path))
    model.graph.initializer.extend([numpy_helper.from_array(np.array([1, 2], np.int64), "ints"),
                                    numpy_helper.from_array(np.ones(3, np.float32), "unused")])
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(("flags", "words"), [
    (["--requires-grad", "ints"], ["--requires-grad", "'ints'", "INT64"]),
    (["--requires-grad", "W,unused"], ["--requires-grad", "'unused'", "unreachable"]),
])
def test_artifacts_requires_grad_a_value_without_gradient_names_the_flag(tmp_path, flags, words) -> None:
    """--requires-grad naming an int64 initializer, or one the loss does not read (the model's own types and
    graph say so), is a bad command line as gradient-graph's --wrt is: exit 2, naming --requires-grad (it
    was exit 1 in the API's words, 'requires_grad names ...', 'remove it from requires_grad')."""
    model = _with_extras(str(tmp_path / "m.onnx"))
    out = tmp_path / "arts"
    proc = _cli("artifacts", model, "-o", str(out), *flags)
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line, = proc.stderr.strip().splitlines()
    assert all(w in line for w in words) and "Traceback" not in line, line
    assert "requires_grad" not in line, line  # (the API's argument, not the command's flag)
    assert not out.exists()  # (the folder it made is taken away)


def test_artifacts_mixed_precision_of_a_float64_model_names_the_flag(tmp_path) -> None:
    model = onnx.load(_loss_model(str(tmp_path / "m.onnx")))
    w = model.graph.initializer[0]
    w.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(w).astype(np.float64), w.name))
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    model.graph.output[0].type.tensor_type.elem_type = TensorProto.DOUBLE
    onnx.save(model, str(tmp_path / "m64.onnx"))
    proc = _cli("artifacts", str(tmp_path / "m64.onnx"), "-o", str(tmp_path / "arts"), "--mixed-precision",
                "float16")
    assert proc.returncode == 2, (proc.returncode, proc.stderr)
    line, = proc.stderr.strip().splitlines()
    assert "--mixed-precision" in line and "'W'" in line and "Traceback" not in line, line


def _two_outputs(path: str) -> str:
    """_loss_model with its [N, 2] product h as a second output."""
    model = onnx.load(_loss_model(path))
    model.graph.output.append(helper.make_tensor_value_info("h", TensorProto.FLOAT, ["N", 2]))
    onnx.save(model, path)
    return path


@pytest.mark.parametrize(("flags", "said", "unsaid"), [
    (["--frozen", "nope"], "--frozen names ['nope']", "frozen_params"),
    (["--loss-output", "h"], "give a loss (--loss, with --loss-input-names)", "LossType"),
])
def test_artifacts_warnings_name_the_flags(tmp_path, flags, said, unsaid) -> None:
    """generate_artifacts' warnings about what a flag chose speak of the command's flags, not of the API's
    arguments (they said 'frozen_params names', 'loss=LossType..., a custom block')."""
    model = _two_outputs(str(tmp_path / "m.onnx"))
    proc = _cli("artifacts", model, "-o", str(tmp_path / "arts"), *flags)
    assert proc.returncode == 0, proc.stderr
    warned = [line for line in proc.stderr.splitlines() if line.startswith("onnxtrain: warning: ")]
    assert len(warned) == 1 and said in warned[0] and unsaid not in warned[0], proc.stderr
