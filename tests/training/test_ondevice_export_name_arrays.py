"""``export_model_for_inferencing`` takes its output names as onnxruntime-training 1.19.2's binding takes a
``list[str]``: any sequence of str, a numpy array of str included (``np.array(names)[mask]``), and names
given as bytes or bytearray (the outputs their UTF-8 spells), while a str, a bytes object, a generator or a
2-D array is refused.

Oracle: onnxruntime-training 1.19.2 (tests/ortt.py) exporting from its own artifacts with the same name
containers: which calls it accepts, and the exported models' inputs, outputs and values (run by onnxruntime)
against onnxtrain's exports from a copy of the same artifacts.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import onnx
import pytest

from tests.ortt import PREAMBLE, ensure_ortt, run_script, small_mlp

# the same calls on either side: the name containers of each kind, by key. Names given as bytes:
# onnxruntime-training's binding converts each to its std::string (bytes and bytearray taken as they are), so
# these name the outputs whose UTF-8 they are; a bytes or bytearray object itself is no list of names, and a
# name that is no output's (invalid UTF-8) is refused
_DRIVER = r"""
def file_name(kind, key):
    return kind + "_" + key.replace(" ", "_").replace("-", "") + ".onnx"


def exports(CheckpointState, Module, folder, kind):
    import os
    import numpy as np
    import onnx
    state = CheckpointState.load_checkpoint(os.path.join(folder, "checkpoint"))
    module = Module(os.path.join(folder, "training_model.onnx"), state,
                    os.path.join(folder, "eval_model.onnx"))
    if kind == "str":
        cases = {"list": ["output", "c"], "tuple": ("c",), "array": np.array(["output", "c"]),
                 "masked array": np.array(["b", "output", "c"])[[False, True, False]],
                 "str": "output", "generator": (n for n in ["output"]), "2-d array": np.array([["output"]])}
    else:
        cases = {"bytes list": [b"output", b"c"], "bytes array": np.array([b"c", b"output"]),
                 "bytearray list": [bytearray(b"output")], "mixed list": ["c", b"output"],
                 "bytes object array": np.array([b"output"], dtype=object), "bytes": b"output",
                 "bytearray": bytearray(b"output"), "not utf-8": [b"output\xff"]}
    out = {}
    for key, names in cases.items():
        path = os.path.join(folder, file_name(kind, key))
        try:
            module.export_model_for_inferencing(path, names)
        except (TypeError, RuntimeError, ValueError):
            out[key] = None
            continue
        m = onnx.load(path)
        out[key] = [[v.name for v in m.graph.input], [v.name for v in m.graph.output]]
    return out
"""

_NS: dict = {}
exec(compile(_DRIVER, "<driver>", "exec"), _NS)  # noqa: S102 - the same source onnxruntime-training runs

# onnxruntime-training's side: its artifacts (a copy kept for onnxtrain), then the driver on them
_PEER = PREAMBLE + _DRIVER + r"""
import onnx
from onnxruntime.training import artifacts
from onnxruntime.training.api import CheckpointState, Module
base, folder, copy, kind = sys.argv[1:5]
artifacts.generate_artifacts(onnx.load(base), requires_grad=["fc1.weight", "fc2.bias"],
                             frozen_params=["fc1.bias", "fc2.weight"], loss=artifacts.LossType.MSELoss,
                             artifact_directory=folder)
import shutil
shutil.copytree(folder, copy)
print(json.dumps(exports(CheckpointState, Module, folder, kind)))
"""

# what the oracle says of each kind (the test's own check that it asks what it means to)
_ORACLE = {"str": ("array", [["input"], ["output", "c"]], "str"),
           "bytes": ("bytes list", [["input"], ["output", "c"]], "bytes")}


@pytest.mark.parametrize("kind", ["str", "bytes"])
def test_output_name_containers_are_onnxruntime_trainings(tmp_path, kind):
    """Each container of names (str, or bytes and bytearray, which onnxtrain refused with 'graph_output_names
    must hold str') is taken or refused as onnxruntime-training 1.19.2 takes it, and the exports are the same
    models: inputs, outputs, and values run by onnxruntime."""
    import onnxruntime as ort

    from onnxtrain.training.api import CheckpointState, Module

    python = ensure_ortt()
    base = str(tmp_path / "mlp.onnx")
    onnx.save(small_mlp(), base)
    theirs, ours = str(tmp_path / "ortt"), str(tmp_path / "onnxtrain")
    os.makedirs(theirs)
    reference = run_script(_PEER, base, theirs, ours, kind, python=python)
    taken, io, refused = _ORACLE[kind]
    assert reference[taken] == io and reference[refused] is None
    got = _NS["exports"](CheckpointState, Module, ours, kind)
    assert got == reference
    x = np.random.default_rng(1).standard_normal((5, 4)).astype(np.float32)
    for key, io in reference.items():
        if io is None:
            continue
        name = _NS["file_name"](kind, key)
        results = [ort.InferenceSession(os.path.join(folder, name), providers=["CPUExecutionProvider"])
                   .run(None, {"input": x}) for folder in (ours, theirs)]
        for a, b in zip(*results, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6, err_msg=key)
    shutil.rmtree(ours)


@pytest.mark.parametrize("names", [[np.str_("output")], np.array(["output"], dtype=object)])
def test_numpy_strings_name_outputs(tmp_path, names):
    """numpy's str scalars are str; an object array of str is a list of names too."""
    from onnxtrain.training import artifacts
    from onnxtrain.training.api import CheckpointState, Module

    artifacts.generate_artifacts(small_mlp(), requires_grad=["fc2.bias"], loss=artifacts.LossType.MSELoss,
                                 artifact_directory=str(tmp_path))
    state = CheckpointState.load_checkpoint(str(tmp_path / "checkpoint"))
    module = Module(str(tmp_path / "training_model.onnx"), state, str(tmp_path / "eval_model.onnx"))
    module.export_model_for_inferencing(str(tmp_path / "out.onnx"), names)
    m = onnx.load(str(tmp_path / "out.onnx"))
    assert [v.name for v in m.graph.output] == ["output"]
    onnx.checker.check_model(m, full_check=True)
