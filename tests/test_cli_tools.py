"""`onnxtrain gradient-graph`, `artifacts` and `info` on models that once got silently wrong results or a
traceback (the CLI audit): each bad input is one line on stderr with exit code 2 (a bad command-line value)
or 1 (a model or file the command cannot use)."""

from __future__ import annotations

import os

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnxtrain
from onnxtrain import zoo
from onnxtrain.cli import main


def _error_line(capsys, argv) -> tuple[int, str]:
    code = main(argv)
    err = [e for e in capsys.readouterr().err.strip().splitlines() if "Warning" not in e]
    assert len(err) == 1, err
    return code, err[0]


def _save(tmp_path, model: onnx.ModelProto, name: str = "m.onnx") -> str:
    path = str(tmp_path / name)
    onnx.save(model, path)
    return path


def _two_outputs(ir_version: int = 8) -> onnx.ModelProto:
    """a = sum(x * w), b = sum(x + v): two float outputs, each reached by one of the two parameters."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "w"], ["xw"]),
             helper.make_node("ReduceSum", ["xw"], ["a"], keepdims=0),
             helper.make_node("Add", ["x", "v"], ["xv"]),
             helper.make_node("ReduceSum", ["xv"], ["b"], keepdims=0)]
    inits = [numpy_helper.from_array(np.full(3, k, np.float32), n) for k, n in ((2, "w"), (3, "v"))]
    inits.append(numpy_helper.from_array(np.array([3], np.int64), "shape"))  # an integer constant
    outs = [helper.make_tensor_value_info(n, f, []) for n in ("a", "b")]
    g = helper.make_graph(nodes, "two", [helper.make_tensor_value_info("x", f, [3])], outs, inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=ir_version)


@pytest.fixture
def two_outputs(tmp_path) -> str:
    return _save(tmp_path, _two_outputs(), "two.onnx")


def _outputs(path: str) -> list[str]:
    return [o.name for o in onnx.load(path).graph.output]


def test_artifacts_loss_output_is_the_differentiated_output(two_outputs, tmp_path, capsys):
    out = tmp_path / "art"
    assert main(["artifacts", two_outputs, "-o", str(out), "--loss-output", "b"]) == 0
    assert "(1 trainable parameter)" in capsys.readouterr().out  # only v reaches b
    assert _outputs(str(out / "training_model.onnx")) == ["b", "a", "v_grad.accumulation.out"]
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(out), "--loss-output", "nosuch"])
    assert code == 2 and "--loss-output: 'nosuch' is not an output of" in line and "a, b" in line, line
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(out), "--loss-output", "b",
                                      "--loss", "MSELoss"])
    assert code == 2 and line.startswith("onnxtrain artifacts: --loss-output"), line


def test_artifacts_default_trainables(two_outputs, tmp_path, capsys):
    """Float initializers only (not integer constants), minus --frozen; an unknown --frozen name warns."""
    out = tmp_path / "art"
    assert main(["artifacts", two_outputs, "-o", str(out), "--loss-output", "b", "--frozen", "nosuch"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onnxtrain: warning: ") and "'nosuch'" in err[0], err
    from onnxtrain.checkpoint import load_checkpoint

    ck = load_checkpoint(str(out / "checkpoint"))
    assert list(ck.trainable) == ["v"] and list(ck.frozen) == []  # not the int64 'shape'
    assert main(["artifacts", two_outputs, "-o", str(out), "--frozen", "v"]) == 0
    ck = load_checkpoint(str(out / "checkpoint"))
    assert list(ck.trainable) == ["w"] and list(ck.frozen) == ["v"]
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(tmp_path / "none"),
                                      "--frozen", "w"])  # w is all that reaches a
    assert code == 2 and "no float initializer" in line, line
    assert not os.path.exists(tmp_path / "none")  # no folder made for a run that fails its checks


@pytest.mark.parametrize("option, value, expect", [
    ("--requires-grad", "nosuch", "--requires-grad: 'nosuch' is neither an initializer nor a graph input"),
    ("--requires-grad", "w,w", "--requires-grad: 'w' given twice"),
    ("--additional-outputs", "nosuch", "--additional-outputs: 'nosuch' is not a value of"),
    ("--frozen", "v", "--requires-grad and --frozen both name 'v'"),
    ("--loss", "MSELoss", "--loss MSELoss takes one prediction but"),
])
def test_artifacts_bad_names_exit_2(two_outputs, tmp_path, capsys, option, value, expect):
    argv = ["artifacts", two_outputs, "-o", str(tmp_path / "art"), option, value]
    if option != "--loss":
        argv += ["--loss-output", "b"]
    if option == "--frozen":
        argv += ["--requires-grad", "v"]
    code, line = _error_line(capsys, argv)
    assert code == 2 and expect in line, line


def test_artifacts_take_the_lowest_ir_version_their_opset_allows(tmp_path):
    """(older runtimes load them: onnxruntime-training 1.19 reads IR 10 at most)"""
    path = _save(tmp_path, _two_outputs(ir_version=10))
    assert main(["artifacts", path, "-o", str(tmp_path / "art"), "--loss-output", "a"]) == 0
    for name in ("training_model.onnx", "eval_model.onnx"):
        m = onnx.load(str(tmp_path / "art" / name))
        assert m.ir_version == helper.find_min_ir_version_for(list(m.opset_import))


def test_artifacts_refuse_an_opset_newer_than_onnx_knows(tmp_path):
    from onnxtrain.training.artifacts import ArtifactError, generate_artifacts

    m = _two_outputs()
    m.opset_import[0].version = onnx.defs.onnx_opset_version() + 1
    with pytest.raises(ArtifactError, match=f"opset {m.opset_import[0].version} is newer than the installed"):
        generate_artifacts(m, requires_grad=["w"], artifact_directory=str(tmp_path))


@pytest.mark.parametrize("wrt, loss, expect", [
    ("v", "a", "--wrt: 'v' does not reach 'a'"),
    ("w,w", "a", "--wrt: 'w' given twice"),
    ("shape", "a", "--wrt: 'shape' is of type INT64"),
    ("w", "nosuch", "--loss: 'nosuch' is not a value of"),
])
def test_gradient_graph_refuses_what_has_no_gradient(two_outputs, tmp_path, capsys, wrt, loss, expect):
    code, line = _error_line(capsys, ["gradient-graph", two_outputs, "--loss", loss, "--wrt", wrt,
                                      "-o", str(tmp_path / "g.onnx")])
    assert code == 2 and expect in line, line


def test_gradient_graph_keeps_the_output_order(two_outputs, tmp_path, capsys):
    out = str(tmp_path / "g.onnx")
    assert main(["gradient-graph", two_outputs, "--loss", "b", "--wrt", "v", "-o", out]) == 0
    assert _outputs(out) == ["a", "b", "v_grad"]
    assert "w.r.t. 1 value\n" in capsys.readouterr().out
    code, line = _error_line(capsys, ["gradient-graph", two_outputs, "--loss", "a", "--wrt", "w",
                                      "-o", str(tmp_path)])
    assert code == 2 and "-o/--output:" in line and "is a folder" in line and ".tmp" not in line, line


def test_zero_trainables_is_an_error(tmp_path, capsys):
    i = TensorProto.INT64
    g = helper.make_graph([helper.make_node("Add", ["i", "k"], ["j"])], "ints",
                          [helper.make_tensor_value_info("i", i, [2])],
                          [helper.make_tensor_value_info("j", i, [2])],
                          [numpy_helper.from_array(np.array([1, 2], np.int64), "k")])
    path = _save(tmp_path, helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]))
    code, line = _error_line(capsys, ["gradient-graph", path, "--loss", "j", "--all-initializers",
                                      "-o", str(tmp_path / "g.onnx")])
    assert code == 2 and "no float initializer" in line, line
    code, line = _error_line(capsys, ["gradient-graph", path, "--loss", "j", "--wrt", "k",
                                      "-o", str(tmp_path / "g.onnx")])
    assert code == 2 and "--loss: 'j' is of type INT64" in line, line
    code, line = _error_line(capsys, ["artifacts", path, "-o", str(tmp_path / "art")])
    assert code == 2 and "output 'j'" in line and "is of type INT64" in line, line  # the loss itself


def test_info_looks_ops_up_with_their_domain(tmp_path, capsys):
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]),
             helper.make_node("Relu", ["h"], ["r"], domain="my.dom"),  # not ONNX's Relu
             helper.make_node("ReduceSum", ["r"], ["loss"])]
    g = helper.make_graph(nodes, "custom", [helper.make_tensor_value_info("x", f, [2])],
                          [helper.make_tensor_value_info("loss", f, [])],
                          [numpy_helper.from_array(np.ones(2, np.float32), "w"),
                           numpy_helper.from_array(np.ones(2, np.int64), "n")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.dom", 1)])
    assert main(["info", _save(tmp_path, m)]) == 0
    out = capsys.readouterr().out
    assert "ops: Mul×1, ReduceSum×1, my.dom:Relu×1" in out
    assert "ops without a kernel: my.dom:Relu" in out and "ops without a gradient rule: my.dom:Relu" in out
    assert "parameters: 2 in 1 float initializer, 8 bytes (and 1 other initializer, not counted)" in out


@pytest.mark.parametrize("content", [b"", b"\x08\x07"])
@pytest.mark.parametrize("command", ["info", "gradient-graph", "artifacts"])
def test_empty_files_are_not_models(tmp_path, capsys, monkeypatch, content, command):
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    path = tmp_path / "empty.onnx"
    path.write_bytes(content)
    argv = {"info": [], "artifacts": ["-o", str(tmp_path / "art")],
            "gradient-graph": ["--loss", "loss", "--all-initializers", "-o", str(tmp_path / "g.onnx")],
            }[command]
    code, line = _error_line(capsys, [command, str(path), *argv])
    assert code == 1 and f"{path} is not an ONNX model" in line, line


def test_unreadable_external_data_and_too_new_ir_are_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("ONNXTRAIN_DEBUG", raising=False)
    m = zoo.mlp([4, 3, 2])
    sub = tmp_path / "sub"
    sub.mkdir()
    onnx.save(m, str(tmp_path / "m.onnx"), save_as_external_data=True, location="w.bin", size_threshold=0)
    moved = onnx.load(str(tmp_path / "m.onnx"), load_external_data=False)
    for t in moved.graph.initializer:
        for e in t.external_data:
            e.value = "../w.bin" if e.key == "location" else e.value
    onnx.save(moved, str(sub / "m.onnx"))  # its data file outside its folder: onnx refuses to read it
    gg = ["gradient-graph", "--loss", "loss", "--all-initializers", "-o", str(tmp_path / "g.onnx")]
    for argv in (["info"], gg, ["artifacts", "-o", str(tmp_path / "art"), "--loss", "MSELoss"]):
        code, line = _error_line(capsys, [argv[0], str(sub / "m.onnx"), *argv[1:]])
        assert code == 1 and "cannot read its external data" in line and "fc0.weight" in line, line
    m.ir_version = onnx.IR_VERSION + 1
    path = _save(tmp_path, m, "new.onnx")
    code, line = _error_line(capsys, ["gradient-graph", path, "--loss", "loss", "--all-initializers",
                                      "-o", str(tmp_path / "g.onnx")])
    assert code == 1 and f"IR version {m.ir_version}, newer than the installed onnx" in line, line


def test_info_counts_the_rules_of_the_upgraded_model(tmp_path, capsys):
    """gradient-graph upgrades an opset-9 model first (Upsample becomes Resize, which has a rule)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("Mul", ["x", "w"], ["h"]),
             helper.make_node("Upsample", ["h", "scales"], ["u"], mode="nearest"),
             helper.make_node("ReduceSum", ["u"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "ups", [helper.make_tensor_value_info("x", f, [2, 4])],
                          [helper.make_tensor_value_info("loss", f, [])],
                          [numpy_helper.from_array(np.ones((2, 4), np.float32), "w"),
                           numpy_helper.from_array(np.array([1, 2], np.float32), "scales")])
    path = _save(tmp_path, helper.make_model(g, opset_imports=[helper.make_opsetid("", 9)]))
    assert main(["info", path]) == 0
    assert "ops without a gradient rule: none" in capsys.readouterr().out
    assert main(["gradient-graph", path, "--loss", "loss", "--wrt", "w", "-o", str(tmp_path / "g.onnx")]) == 0


# ---- where artifacts go: -o and --prefix ----

def _tree(root) -> list[str]:
    return sorted(os.path.relpath(os.path.join(d, f), root) for d, dirs, files in os.walk(root)
                  for f in [*dirs, *files])


def test_artifacts_output_folder_under_a_file_is_a_usage_error(two_outputs, tmp_path, capsys):
    (tmp_path / "afile").write_text("not a folder")
    before = _tree(tmp_path)
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(tmp_path / "afile" / "art")])
    assert code == 2, line
    assert line.startswith("onnxtrain artifacts: -o/--output:") and "is a file" in line, line
    assert _tree(tmp_path) == before


def test_artifacts_output_at_a_broken_link_says_so(two_outputs, tmp_path, capsys):
    """-o naming a symbolic link to nothing: the error says that (it said 'is a file'), nothing written."""
    os.symlink(tmp_path / "gone", tmp_path / "art")
    before = _tree(tmp_path)
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(tmp_path / "art")])
    assert code == 2, line
    assert "-o/--output:" in line and "broken symbolic link" in line and "gone" in line, line
    assert _tree(tmp_path) == before


@pytest.mark.parametrize("prefix", ["sub/", "../out_", os.path.join("a", "b_")])
def test_artifacts_prefix_with_a_folder_is_refused(two_outputs, tmp_path, capsys, prefix):
    """--prefix is put before the file names in -o's folder: one naming another folder wrote the files
    elsewhere (../ outside -o) and left -o made and empty."""
    work = tmp_path / "work"
    work.mkdir()
    before = _tree(tmp_path)
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(work / "art"), "--prefix", prefix])
    assert code == 2 and "--prefix:" in line, line
    assert _tree(tmp_path) == before


def test_artifacts_failing_to_write_leaves_no_folders_it_made(two_outputs, tmp_path, capsys, monkeypatch):
    """A write that fails (the disk full) removes every folder of -o that the command made, not only the
    last one."""
    from onnxtrain.ir import io

    def full(self, path, write):
        raise OSError(28, "No space left on device", str(path))

    monkeypatch.setattr(io.StagedFiles, "write", full)
    before = _tree(tmp_path)
    code, line = _error_line(capsys, ["artifacts", two_outputs, "-o", str(tmp_path / "new" / "a" / "b")])
    assert code == 1 and "No space left on device" in line, line
    assert _tree(tmp_path) == before


def _int_output_first() -> onnx.ModelProto:
    """y = x @ w; outputs cls = argmax(y) (int64, first) and loss = sum(y)."""
    f = TensorProto.FLOAT
    nodes = [helper.make_node("MatMul", ["x", "w"], ["y"]),
             helper.make_node("ArgMax", ["y"], ["cls"], axis=1),
             helper.make_node("ReduceSum", ["y"], ["loss"], keepdims=0)]
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", f, [2, 3])],
                          [helper.make_tensor_value_info("cls", TensorProto.INT64, [2, 1]),
                           helper.make_tensor_value_info("loss", f, [])],
                          [numpy_helper.from_array(np.ones((3, 4), np.float32), "w")])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("options, option", [
    ([], "--loss-output"), (["--requires-grad", "w"], "--loss-output"),
    (["--loss-input-names", "cls"], "--loss-input-names"),
    (["--loss", "MSELoss", "--loss-input-names", "cls", "--requires-grad", "w"], "--loss-input-names")])
def test_artifacts_refuse_a_loss_that_is_not_a_float(tmp_path, capsys, options, option):
    """The model's first output (the loss without --loss) is an int: it was refused as 'no float initializer
    reaches the loss', or with --requires-grad failed (exit 1) in the gradient builder, never naming it."""
    model = _save(tmp_path, _int_output_first())
    code, line = _error_line(capsys, ["artifacts", model, "-o", str(tmp_path / "art"), *options])
    assert code == 2 and "'cls'" in line and "INT64" in line and option in line, line
    assert not os.path.exists(tmp_path / "art")
    assert main(["artifacts", model, "-o", str(tmp_path / "art"), "--loss-output", "loss"]) == 0


def test_gradient_graph_warns_of_a_loss_that_is_not_a_scalar(tmp_path, capsys):
    """--loss naming the logits (not the loss) wrote the gradients of their sum without a word."""
    model = _save(tmp_path, zoo.mlp([4, 3]))
    out = str(tmp_path / "g.onnx")
    assert main(["gradient-graph", model, "--loss", "logits", "--all-initializers", "-o", out]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onnxtrain: warning: --loss: 'logits'"), err
    assert "not a scalar" in err[0] and "sum" in err[0], err
    assert main(["gradient-graph", model, "--loss", "loss", "--all-initializers", "-o", out]) == 0
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("field, value, words", [("opset", 30, "opset 30 is newer"),
                                                 ("ir_version", 99, "IR version 99")])
def test_info_says_when_the_model_is_too_new_to_run(tmp_path, capsys, field, value, words):
    """A model of an opset or IR version onnx does not know: info listed no op without a kernel, though every
    session and the gradient builder refuse it."""
    model = zoo.mlp([4, 3])
    if field == "opset":
        model.opset_import[0].version = value
    else:
        model.ir_version = value
    path = _save(tmp_path, model)
    assert main(["info", path]) == 0
    captured = capsys.readouterr()
    assert "ops without a kernel" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("onnxtrain: warning: ") and words in err[0], err
    assert "cannot run or train" in err[0], err
    with pytest.raises(Exception, match=words.split(" is")[0]):
        onnxtrain.InferenceSession(path)


def test_gradient_graph_output_with_a_trailing_separator_is_a_usage_error(tmp_path, capsys):
    model = _save(tmp_path, zoo.mlp([4, 3]))
    target = str(tmp_path / "new") + os.sep
    code, line = _error_line(capsys, ["gradient-graph", model, "--loss", "loss", "--all-initializers",
                                      "-o", target])
    assert code == 2 and line.startswith("onnxtrain gradient-graph: -o/--output: "), line
    assert sorted(os.listdir(tmp_path)) == ["m.onnx"]
