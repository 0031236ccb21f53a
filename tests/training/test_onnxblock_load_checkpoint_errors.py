"""onnxblock.load_checkpoint_to_model's refusals are RuntimeErrors, as onnxruntime-training 1.19.2's are.

There the function is a binding (``get_model_after_loading_checkpoint``), so a missing file, a file that
is no checkpoint, a folder and a nominal checkpoint all raise a ``RuntimeError``; a script ported from it
catches them with ``except RuntimeError``. Oracle: onnxruntime-training 1.19.2 itself (tests/ortt.py), run
on the same paths; onnxtrain must raise an instance of that class (and keeps its own, more specific,
``FileNotFoundError`` / ``ValueError`` / ``IsADirectoryError`` duals, whose messages name the path).
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import numpy_helper

from onnxtrain.training import onnxblock
from tests.ortt import PREAMBLE, run_script, small_mlp

_ORT_SCRIPT = PREAMBLE + r"""
from onnxruntime.training import onnxblock
folder = sys.argv[1]
model = onnx.load(folder + "/mlp.onnx")
out = {}
for case in ("missing", "damaged", "folder", "nominal"):
    path = folder if case == "folder" else f"{folder}/{case}"
    try:
        onnxblock.load_checkpoint_to_model(path, model)
        out[case] = None
    except Exception as e:
        out[case] = [c.__name__ for c in type(e).__mro__]
print(json.dumps(out))
"""

CASES = ("missing", "damaged", "folder", "nominal")
OWN_CLASS = {"missing": FileNotFoundError, "damaged": ValueError, "folder": IsADirectoryError,
             "nominal": ValueError}


@pytest.fixture(scope="module")
def paths(tmp_path_factory):
    folder = tmp_path_factory.mktemp("ltm")
    import onnx

    onnx.save(small_mlp(), str(folder / "mlp.onnx"))
    (folder / "damaged").write_bytes(b"not a checkpoint" * 8)
    bias = numpy_helper.from_array(np.ones(8, np.float32), "fc1.bias")
    onnxblock.save_checkpoint(([bias], []), str(folder / "nominal"), nominal_checkpoint=True)
    return folder


@pytest.fixture(scope="module")
def reference(paths):
    return run_script(_ORT_SCRIPT, str(paths))


@pytest.mark.parametrize("case", CASES)
def test_load_checkpoint_to_model_refuses_with_onnxruntime_trainings_class(paths, reference, case):
    theirs = reference[case]
    assert theirs is not None and theirs[0] == "RuntimeError", theirs  # the oracle refuses, RuntimeError
    model = small_mlp()
    before = model.SerializeToString()
    path = str(paths) if case == "folder" else str(paths / case)
    with pytest.raises(RuntimeError) as info:
        onnxblock.load_checkpoint_to_model(path, model)
    assert isinstance(info.value, OWN_CLASS[case]), type(info.value).__mro__
    if case != "nominal":
        assert path in str(info.value)
    assert model.SerializeToString() == before  # the model is left as it was
