"""Review R3 of 43a11f70: ``artifacts.artifact_files(nominal_checkpoint, optimizer)``, which the CLI's folder
check and generate_artifacts' stale-file warning read, names the files one generation writes.

The oracle is the folder itself: each combination of the two options generates into an empty folder, whose
files must be the list (and the ``ARTIFACT_FILES`` of that prefix); a second generation with the same options
warns of nothing, one without the optimizer or nominal checkpoint names the file left over. The CLI refuses a
folder standing where an artifact goes (naming it and -o/--output) only for an artifact it writes."""

from __future__ import annotations

import os
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnxtrain.training import artifacts

COMBOS = [(False, False), (True, False), (False, True), (True, True)]


def _model():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", 3])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, ["batch", 2])
    w = numpy_helper.from_array(np.ones((3, 2), np.float32), "w")
    graph = helper.make_graph([helper.make_node("MatMul", ["x", "w"], ["y"])], "g", [x], [y], [w])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _generate(folder, nominal: bool, optimizer: bool, prefix: str = "") -> list[str]:
    """The warnings of one generation into ``folder``."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        artifacts.generate_artifacts(_model(), requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                     optimizer=artifacts.OptimType.SGD if optimizer else None,
                                     artifact_directory=folder, nominal_checkpoint=nominal, prefix=prefix)
    return [str(w.message) for w in caught]


@pytest.mark.parametrize(("nominal", "optimizer"), COMBOS)
def test_the_list_is_what_a_generation_writes(tmp_path, nominal, optimizer):
    assert _generate(tmp_path, nominal, optimizer, prefix="p_") == []
    written = sorted(os.listdir(tmp_path))
    assert written == sorted("p_" + f for f in artifacts.artifact_files(nominal, optimizer))
    assert set(written) <= {"p_" + f for f in artifacts.ARTIFACT_FILES}
    assert _generate(tmp_path, nominal, optimizer, prefix="p_") == []  # the same set again: nothing stale


def test_a_smaller_generation_names_what_is_left_over(tmp_path):
    assert _generate(tmp_path, True, True) == []
    caught = _generate(tmp_path, False, False)
    assert len(caught) == 1 and "['nominal_checkpoint', 'optimizer_model.onnx']" in caught[0], caught


@pytest.mark.parametrize(("taken", "option"), [("optimizer_model.onnx", "--optimizer=SGD"),
                                               ("nominal_checkpoint", "--nominal-checkpoint")])
def test_the_cli_refuses_a_folder_only_where_it_writes(tmp_path, capsys, taken, option):
    import onnx

    from onnxtrain.cli import main

    onnx.save(_model(), tmp_path / "m.onnx")
    out = tmp_path / "out"
    (out / taken).mkdir(parents=True)
    args = ["artifacts", str(tmp_path / "m.onnx"), "--requires-grad", "w", "--loss", "MSELoss",
            "-o", str(out)]
    assert main([*args, option]) != 0
    err = capsys.readouterr().err
    assert "-o/--output" in err and os.path.join(str(out), taken) in err, err
    assert not (out / "training_model.onnx").exists()  # refused before any work
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the folder is named as an earlier generation's file)
        assert main(args) == 0
    assert (out / "training_model.onnx").exists()
